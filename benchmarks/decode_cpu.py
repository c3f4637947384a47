"""Decode CPU seconds per token of one checkpoint at given budgets: the overhead check of a refactor.

Feeds the bench's varied tokens (``../shared/bench/continuation.txt``, one per step, after a
short prompt) through ``moestream.load`` + ``generation.generate`` and reports, per budget, the
process CPU time and wall time per decoded token (medians over the steps), the hit rate and the
distinct experts per layer. Run it on two trees one after the other (``PYTHONPATH=<tree>``) to
compare them on the same machine::

    PYTHONPATH=. python benchmarks/decode_cpu.py --model /tmp/q30b-2l --budgets all,0.5 --tokens 48
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch
from _common import timed_steps

from moestream.engine import load

SHARED = Path(__file__).resolve().parents[2] / "shared"


def fed_tokens(tokenizer, n: int) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode((SHARED / "bench" / "prompt.txt").read_text())[:64]
    cont = tokenizer.encode((SHARED / "bench" / "continuation.txt").read_text())[:n]
    return prompt, cont


def run(model: str, budget: str, tokens: int, workers: int) -> dict:
    """One load at ``budget``: a 64-token prompt prefilled, then ``tokens`` fed tokens decoded one by one."""
    engine = load(model, budget, workers=workers, hotlist=False, learn_experts=False, progress=False)
    try:
        prompt, cont = fed_tokens(engine.tokenizer, tokens)
        net = engine.model
        with torch.inference_mode():
            kv = net.new_kv_cache(len(prompt) + len(cont) + 1)
            net(torch.tensor(prompt), 0, kv)
            h0, l0 = engine.cache.stats.hits, engine.cache.stats.lookups
            cpu, wall = timed_steps(net, cont, len(prompt), kv)
        s = engine.cache.stats
        used = {layer: int((u > 0).sum()) for layer, u in engine.cache.usage.items()}
        return {"budget": budget, "tokens": len(cpu), "cpu_s_per_token": statistics.median(cpu),
                "wall_s_per_token": statistics.median(wall),
                "decode_hit_rate": (s.hits - h0) / max(1, s.lookups - l0),
                "distinct_experts_per_layer": statistics.mean(used.values()), "threads": torch.get_num_threads()}
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--budgets", default="all,0.5")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rows = [run(a.model, b, a.tokens, a.workers) for b in a.budgets.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
