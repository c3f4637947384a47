"""Decode speed of a GGUF file in float and ``--activations q8`` mode, side by side (CPU).

Loads FILE at budget ``all`` (every expert in memory) in each mode in turn, ``--rounds`` times alternating,
prefills 32 tokens and times ``--steps`` greedy one-token decode steps: wall and process CPU milliseconds
per token, and the load average, per run. ``--threads`` intra-op threads (default 2).

    python benchmarks/q8_decode.py FILE.gguf [--rounds 4] [--steps 24] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch

from moestream.engine import load


def run(path: Path, activations: str, steps: int) -> dict:
    """One load in ``activations`` mode: ms of wall and process CPU time per decoded token."""
    engine = load(path, cache_budget_gb="all", tokenizer=False, workers=2, activations=activations)
    try:
        with torch.inference_mode():
            kv = engine.model.new_kv_cache()
            engine.model(torch.arange(100, 132), 0, kv)
            tok = torch.tensor([7])
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(steps):
                logits = engine.model(tok, 32 + i, kv)
                tok = logits.reshape(-1, logits.shape[-1])[-1].argmax().view(1)
            wall, cpu = (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps
    finally:
        engine.close()
    return {"activations": activations, "wall_ms": round(wall * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2),
            "tok_s": round(1 / wall, 2), "load_average": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    for _ in range(args.rounds):
        for act in ("float", "q8"):
            runs.append(run(args.file, act, args.steps))
            print(json.dumps(runs[-1]), flush=True)
    summary = {a: {k: statistics.median(r[k] for r in runs[2:] if r["activations"] == a)  # the first round warms up
                   for k in ("wall_ms", "cpu_ms", "tok_s")} for a in ("float", "q8")}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"file": str(args.file), "threads": args.threads, "runs": runs,
                                         "median_after_first_round": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
