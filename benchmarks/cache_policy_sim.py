"""Record routing traces of a synth checkpoint and replay them under LRU, LFU-decay, layer-cycle and Belady's MIN.

Usage (about 5 GB of disk for the 4-layer checkpoint, deleted at the end unless --keep):

    python benchmarks/cache_policy_sim.py --config ../shared/models/configs/Qwen3-30B-A3B.json \\
        --layers 4 --dir /tmp/cp-qwen3-4l --tokens 96 --budgets 0.5,1,1.5,2,3,4

Traces are recorded with a 1 GB cache (the routing, and so the trace, is bit-identical at
any budget; ``all`` held 6.4 GB and was killed by the OOM killer on the shared machine),
sampled at temperature 1 with seed 0 on varied prompts. The printed table is what goes
into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
    "Explain the difference between TCP and UDP to a network engineering student.",
]


def moestream(*args: str) -> None:
    cmd = [sys.executable, "-m", "moestream", *args]
    print("+ moestream " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dir", required=True, type=Path, help="where the checkpoint and traces go")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--budgets", default="0.5,1,1.5,2,3,4")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    a = p.parse_args()
    model = a.dir / "model"
    a.dir.mkdir(parents=True, exist_ok=True)
    try:
        if not (model / "config.json").exists():
            moestream("synth", "--config", str(a.config), "--layers", str(a.layers), "--out", str(model))
        traces = []
        for i, prompt in enumerate(PROMPTS):
            trace = a.dir / f"trace{i}.jsonl"
            t0 = time.perf_counter()
            moestream("generate", "--model", str(model), "--prompt", prompt, "--max-tokens", str(a.tokens),
                      "--temp", "1", "--seed", "0", "--cache-budget-gb", "1", "--no-learn-experts",
                      "--trace", str(trace), "--quiet")
            print(f"  trace {trace.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            traces.append(str(trace))
        moestream("cache-sim", "--trace", *traces, "--budgets", a.budgets)
    finally:
        if not a.keep and model.exists():
            shutil.rmtree(model)


if __name__ == "__main__":
    main()
