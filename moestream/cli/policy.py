"""Command-line options and commands of expert usage and cache policy.

Options (in every command that loads a model, through ``cli.add_engine_args``):
``--max-active-experts``, ``--no-hotlist``, ``--hot-fraction``, ``--pin-file``, ``--usage-file``,
``--no-learn-experts``, ``--trace``, ``--cache-policy``. Commands: ``moestream hotlist``
(make a hot list) and ``moestream cache-sim`` (replay routing traces under each policy).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..errors import MoestreamError
from ..policies import POLICIES

# varied built-in prompts for `moestream hotlist`: code, maths, prose, facts, dialogue, other languages
HOTLIST_PROMPTS = [
    "Write a Python function that merges two sorted lists, and explain its complexity.",
    "Solve for x: 3x + 7 = 22. Then explain each step to a twelve-year-old.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarize the causes and consequences of the French Revolution in five bullet points.",
    "Traduis en français : The weather is lovely today, let's walk by the river.",
    "You are a helpful assistant. A user asks: how do I fix a flat bicycle tyre?",
    "用三句话解释光合作用。",
    "List ten creative names for a coffee shop run by robots, with a one-line pitch each.",
]


def add_commands(sub, add_engine_args) -> None:
    """Register ``hotlist`` and ``cache-sim`` on the CLI's subparsers."""
    h = sub.add_parser("hotlist", help="make a hot list (hot_experts.json) from a usage profile or built-in prompts")
    add_engine_args(h)
    h.add_argument("--out", required=True, type=Path, help="hot list to write (e.g. MODEL/hot_experts.json)")
    h.add_argument("--from-prompts", action="store_true",
                   help="run the built-in prompts even when a usage profile exists")
    h.add_argument("--max-tokens", type=int, default=64, help="tokens sampled per built-in prompt (default 64)")
    c = sub.add_parser("cache-sim", help="replay routing traces under LRU, LFU-decay, layer and Belady's MIN; "
                                         "their locality statistics")
    c.add_argument("--trace", required=True, type=Path, nargs="+",
                   help="traces: written with --trace, JSON lines with layer/token/experts (or selected_ids), or "
                        "FLAME-MoE parquet (a layer_NN.parquet file or a folder of them; needs pyarrow)")
    c.add_argument("--budgets", default=None,
                   help="cache budgets in GB, comma-separated (e.g. 0.5,1,2); this or --residency is required")
    c.add_argument("--residency", default=None,
                   help="cache budgets as shares of all experts, comma-separated (e.g. 0.1,0.2,0.4); this or "
                        "--budgets is required")
    c.add_argument("--prefetch", default="0",
                   help="read-ahead depths to replay, comma-separated, 0-2 (default 0; 1 and 2 need a moestream trace)")
    c.add_argument("--hot-from", type=Path, nargs="+", default=None,
                   help="traces whose usage makes a hot list, pinned up to --hot-fraction of the budget (tables with "
                        "and without)")
    c.add_argument("--hot-fraction", type=float, default=None,
                   help="share of the budget the --hot-from list pins (default 0.5)")
    c.add_argument("--max-tokens", type=int, default=None, help="replay only each trace's first N tokens")
    c.add_argument("--policies", default=",".join([*POLICIES, "belady"]),
                   help="comma-separated, from lru, lfu, layer, belady (default all)")
    c.add_argument("--half-life", type=float, default=None,
                   help="LFU decay half-life in lookups (default: the model's routed experts, as the engine)")


def run_command(args: argparse.Namespace, out=None) -> bool:
    """Run ``hotlist`` or ``cache-sim`` (printing to ``out``, default stdout); False for other commands."""
    out = out or sys.stdout
    if args.command == "cache-sim":
        from ..cachesim import run_cache_sim
        from ..usage import HOT_SHARE

        budgets = _numbers(args.budgets, "--budgets", "numbers of GB >= 0", 0, 1e9)
        residency = _numbers(args.residency, "--residency", "shares between 0 and 1", 0, 1, top=True)
        if not budgets and not residency:
            raise MoestreamError("cache-sim: give --budgets (GB) or --residency (shares of the experts)")
        raw = _numbers(args.prefetch, "--prefetch", "depths 0, 1 or 2", 0, 2, top=True)
        if any(d != int(d) for d in raw):
            raise MoestreamError(f"--prefetch {args.prefetch!r}: give comma-separated depths 0, 1 or 2")
        depths = [int(d) for d in raw]
        if args.max_tokens is not None and args.max_tokens < 1:
            raise MoestreamError(f"--max-tokens {args.max_tokens}: give a number of tokens >= 1")
        # checked here, not by the LFU policy mid-replay (a traceback), and 0 is not "the default"
        if args.half_life is not None and not 0 < args.half_life < math.inf:
            raise MoestreamError(f"--half-life {args.half_life}: give a number of lookups above 0")
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        bad = [p for p in policies if p not in (*POLICIES, "belady")]
        if bad or not policies:
            raise MoestreamError(f"--policies: {bad or policies} not among {', '.join([*POLICIES, 'belady'])}")
        hf = HOT_SHARE if args.hot_fraction is None else args.hot_fraction
        if not 0 <= hf <= 1:
            raise MoestreamError(f"--hot-fraction {hf}: give a share of the budget between 0 and 1")
        print(run_cache_sim(args.trace, budgets, policies, args.half_life, residency, depths or [0], args.hot_from,
                            args.max_tokens, hf), file=out)
        return True
    if args.command == "hotlist":
        run_hotlist(args, out)
        return True
    return False


def _numbers(text: str | None, flag: str, what: str, lo: float, hi: float, top: bool = False) -> list[float]:
    """Comma-separated numbers in [lo, hi) ([lo, hi] with ``top``); [] for None. Raises MoestreamError."""
    if text is None:
        return []
    try:
        vals = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise MoestreamError(f"{flag} {text!r}: give comma-separated {what}") from None
    if not vals or any(not (lo <= v <= hi if top else lo <= v < hi) for v in vals):
        raise MoestreamError(f"{flag} {text!r}: give comma-separated {what}")
    return vals


def run_hotlist(args: argparse.Namespace, out=None) -> list:
    """Make a hot list: from the model's usage profile, or by sampling the built-in prompts.

    Returns the keys written, hottest first.
    """
    import torch

    from ..engine import load
    from ..generation import generate
    from ..options import EngineOptions
    from ..sampling import SamplingParams
    from ..tokenizer import encode_prompt
    from ..usage import default_profile_path, ranked, read_profile, warn, write_keys

    out = out or sys.stdout
    options = EngineOptions.from_args(args).replace(learn_experts=False, hotlist=False, pin_file=None)
    if args.out.is_dir() or not args.out.parent.is_dir():
        raise MoestreamError(f"--out {args.out}: not a file in an existing folder")
    engine = load(args.model, options=options, tokenizer=True)
    try:
        model_id = engine.usage.model_id
        num_experts = engine.usage.num_experts
        path = args.usage_file or default_profile_path(engine.checkpoint.path, model_id)
        counts, source = None, ""
        if not args.from_prompts and Path(path).exists():
            counts, problem = read_profile(Path(path), model_id, num_experts)
            if counts is None:
                warn(f"usage profile {path} {problem}; running the built-in prompts instead")
            else:
                source = f"usage profile {path}"
        if counts is None:
            for i, prompt in enumerate(HOTLIST_PROMPTS):
                ids = encode_prompt(engine.tokenizer, prompt, chat_template=True)
                for _ in generate(engine, ids, args.max_tokens, SamplingParams(temperature=1.0, seed=i)):
                    pass
            counts = {layer: u.to(torch.float64).tolist() for layer, u in engine.cache.usage.items()}
            source = f"{len(HOTLIST_PROMPTS)} built-in prompts x {args.max_tokens} tokens (sampled)"
        keys = ranked(counts)
        write_keys(args.out, keys, model_id)
        print(f"wrote {args.out}: {len(keys)} experts, hottest first, from {source}", file=out)
        return keys
    finally:
        engine.close()
