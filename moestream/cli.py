"""The ``moestream`` command line: ``generate``, ``synth`` and ``demo``.

Errors a user can cause are printed as one line naming the file, tensor or field
(exit status 2); tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import MoestreamError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, cache and I/O options, shared by every command that loads a model (generate, serve)."""
    p.add_argument("--model", required=True, help="checkpoint folder or Hugging Face Hub id")
    p.add_argument(
        "--cache-budget-gb", default="3",
        help="expert cache budget in GB (10^9 bytes), or 'all' to keep every expert resident (default 3)",
    )
    p.add_argument("--prefetch-workers", type=int, default=8, help="parallel expert reads (default 8)")


def check_engine_args(args: argparse.Namespace) -> None:
    """Check the options of :func:`add_engine_args` before any loading. Raises MoestreamError."""
    from .cache import parse_budget

    if args.prefetch_workers < 1:
        raise MoestreamError(f"--prefetch-workers must be at least 1, got {args.prefetch_workers}")
    parse_budget(args.cache_budget_gb)


def load_engine(args: argparse.Namespace, tokenizer: bool = True):
    """``engine.load`` with the options of :func:`add_engine_args`."""
    from .engine import load

    return load(args.model, args.cache_budget_gb, workers=args.prefetch_workers, tokenizer=tokenizer)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--no-chat-template", action="store_true", help="encode the prompt as is, without the chat template")
    p.add_argument("--stats-json", type=Path, default=None, help="also write the run's stats to this JSON file")
    p.add_argument("--quiet", action="store_true", help="print only the generated text, not the stats")


def run_generate(args: argparse.Namespace, out=sys.stdout, err=sys.stderr):
    """Load, generate with streamed output, print stats; returns the GenerationStats.

    Every argument is checked before the model is loaded.
    """
    from .generation import GenerationStats, SamplingParams, generate
    from .tokenizer import encode_prompt

    if not args.prompt:
        raise MoestreamError("--prompt is empty")
    if args.max_tokens < 1:
        raise MoestreamError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.stats_json is not None and (args.stats_json.is_dir() or not args.stats_json.parent.is_dir()):
        raise MoestreamError(f"--stats-json {args.stats_json}: not a file in an existing folder")
    check_engine_args(args)
    sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.seed)
    engine = load_engine(args)
    try:
        if engine.unused_tensors:
            names = engine.unused_tensors
            print(f"note: {len(names)} checkpoint tensors are not used, such as {names[:3]}", file=err)
        ids = encode_prompt(engine.tokenizer, args.prompt, chat_template=not args.no_chat_template)
        if not ids:
            raise MoestreamError("--prompt encodes to no tokens")
        if max(ids) >= engine.model.vocab_size:  # e.g. the bundled Qwen3 tokenizer on a synth of a smaller vocabulary
            raise MoestreamError(
                f"--prompt encodes to token id {max(ids)}, outside the model's vocab_size {engine.model.vocab_size}: "
                "the tokenizer does not fit the model (try --no-chat-template, or another tokenizer)"
            )
        stats = GenerationStats()
        for step in generate(engine, ids, args.max_tokens, sampling, stats):
            if step.text:
                out.write(step.text)
                out.flush()
        out.write("\n")
        out.flush()
        if not args.quiet:
            print("-" * 60, file=err)
            print(stats.summary(), file=err)
        if args.stats_json:
            try:
                args.stats_json.write_text(stats.to_json() + "\n")
            except OSError as e:
                raise MoestreamError(f"--stats-json {args.stats_json}: cannot write: {e.strerror or e}") from None
        return stats
    finally:
        engine.close()


def _add_synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="a published config.json (real shapes)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to create")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default all)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--seed", type=int, default=0, help="weights depend on the seed and tensor name only (default 0)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder to copy (default: bundled Qwen3)")
    p.add_argument("--init", default="spread", choices=["spread", "plain"],
                   help="spread (default): near-uniform routing like a load-balanced model; plain: all std 0.02")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")


def run_synth(args: argparse.Namespace) -> Path:
    from .engine import progress_bar
    from .synth import plan_synth, write_synth

    plan = plan_synth(args.config, args.layers, args.dtype, args.seed, args.tokenizer, args.init, args.shard_gb)
    with progress_bar(plan.nbytes, f"writing {args.out.name}") as bar:
        out = write_synth(plan, args.out, bar.update)
    print(f"wrote {out} ({plan.nbytes / 1e9:.2f} GB of weights)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts models bigger than memory by streaming their experts from disk.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, streaming experts through a cache")
    _add_generate_args(g)
    s = sub.add_parser("synth", help="write a random-weight checkpoint of a real config's shapes")
    _add_synth_args(s)
    d = sub.add_parser("demo", help="build a small model on first run and stream it")
    d.add_argument("--dir", type=Path, default=None, help="where the demo checkpoint lives (default: user cache)")
    d.add_argument("--max-tokens", type=int, default=48, help="tokens to generate in each demo run (default 48)")
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "synth":
            run_synth(args)
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(args.dir, args.max_tokens)
        return 0
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130


def generate_main(argv: list[str] | None = None) -> int:
    """``python -m moestream.stream_generate``: the ``generate`` command's flags, alone."""
    return main(["generate", *(sys.argv[1:] if argv is None else argv)])
