"""``moestream demo``: build a small Qwen3-MoE-shaped model on first run, then stream it.

The demo model (``data/demo_config.json``: 8 layers of 48 experts, about 1.5 GB in
bf16, random weights, the real Qwen3 tokenizer) is written once to the user cache
folder. The demo then generates with a cache budget of a quarter of the expert bytes,
sampling so that routing varies from token to token, prints the stats, and generates
again with every expert resident to show every step's logits are bit-identical.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

DEMO_CONFIG = Path(__file__).parent.parent / "data" / "demo_config.json"
PROMPT = "Explain in two sentences why streaming experts from disk lets a large MoE model run in little memory."


def default_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "moestream" / "demo-qwen3-moe"


def run_demo(folder: Path | None = None, max_tokens: int = 48) -> None:
    from .build import run_synth
    from .generate import run_generate

    folder = Path(folder) if folder else default_dir()
    if not (folder / "config.json").is_file():
        print(f"[demo] first run: writing a random-weight Qwen3-MoE-shaped model to {folder}", file=sys.stderr)
        folder.parent.mkdir(parents=True, exist_ok=True)
        run_synth(argparse.Namespace(
            config=DEMO_CONFIG, out=folder, layers=None, dtype="bf16", seed=0, tokenizer=None,
            init="spread", shard_gb=5.0,
        ))
    from ..checkpoint import Checkpoint
    from ..layout import discover_experts

    with Checkpoint(folder) as ckpt:
        expert_gb = discover_experts(ckpt.tensors).total_bytes / 1e9
    budget = round(expert_gb / 4, 3)
    print(
        f"[demo] model: {folder} ({expert_gb:.2f} GB of experts). Weights are random, so the text is gibberish; "
        "what matters is the stats.",
        file=sys.stderr,
    )
    common = dict(model=str(folder), prompt=PROMPT, max_tokens=max_tokens, temp=1.0, top_p=1.0, top_k=0, seed=0,
                  no_chat_template=False, stats_json=None, prefetch_workers=8, quiet=False,
                  whole_model_hint=False)  # streaming a model that fits is the demo's point
    print(f"\n[demo] 1/2 streaming experts through a {budget} GB cache (sampling, temperature 1, seed 0):",
          file=sys.stderr)
    streamed = run_generate(argparse.Namespace(cache_budget_gb=str(budget), **common))
    print("\n[demo] 2/2 the same run with every expert resident (--cache-budget-gb all; text not shown again)",
          file=sys.stderr)
    resident = run_generate(argparse.Namespace(cache_budget_gb="all", **dict(common, quiet=True)), out=io.StringIO())
    # every step's logits, bit for bit, not only the tokens (random weights make tokens a weak check)
    same = (streamed.logits_sha256 == resident.logits_sha256
            and streamed.generated_token_ids == resident.generated_token_ids)
    print(
        f"\n[demo] logits of every step bit-identical to the all-resident run: {same} "
        f"(SHA-256 {streamed.logits_sha256[:16]}...). Streamed: "
        f"{streamed.decode_tok_s:.2f} tok/s, {streamed.cache_hit_rate:.0%} hit rate, "
        f"{streamed.mb_read_per_decoded_token:.0f} MB read per token, peak RSS {streamed.peak_rss_gb:.2f} GB.\n"
        f"[demo] delete the demo model with: rm -rf {folder}",
        file=sys.stderr,
    )
    if not same:
        raise SystemExit("[demo] streamed output differs from the all-resident run: this is a bug")
