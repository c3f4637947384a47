"""The CPU attention kernel (``moestream.quant.native.attention``) at real shapes, for one or two source trees.

Each shape runs in a fresh process of each tree (``PYTHONPATH=<tree>``), the trees alternating; per shape the
median wall and CPU milliseconds of a call (after a warm-up), the multiply-adds per CPU second, and whether
the trees' outputs are the same bits. Shapes: Qwen3-30B-A3B's (32 query heads on 4 key heads of 128, bf16
cache) for one decode query at 300, 2,064 and 8,192 positions and a 64-query prefill chunk at 2,064;
DeepSeek-V3's MLA (128 heads on one latent of 512 + 64) for one query at 2,064::

    python benchmarks/cpu_attention.py --a /tmp/base --b . --runs 3 --out cpu_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, load_average  # noqa: E402

SHAPES = {  # name: (queries T, query heads, key heads, D1, D2, Dv, positions S, calls)
    "decode-300": (1, 32, 4, 128, 0, 128, 300, 200),
    "decode-2064": (1, 32, 4, 128, 0, 128, 2064, 60),
    "decode-8192": (1, 32, 4, 128, 0, 128, 8192, 20),
    "prefill-64-at-2064": (64, 32, 4, 128, 0, 128, 2064, 5),
    "mla-decode-2064": (1, 128, 1, 512, 64, 512, 2064, 20),
}

WORKER = r"""
import hashlib, json, statistics, sys, time
import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
from moestream.quant import native  # before torch: moestream's OpenMP wait policy
import torch
T, hq, hkv, d1, d2, dv, S, calls = (int(v) for v in sys.argv[1:9])
g = torch.Generator().manual_seed(0)
q = torch.randn(T, hq, d1 + d2, generator=g)
k = torch.randn(hkv, S, d1 + d2, generator=g).to(torch.bfloat16)
v = torch.randn(hkv, S, dv, generator=g).to(torch.bfloat16)
if d2:
    call = lambda: native.attention(q, k[:, :, :d1], k[:, :, :d1], S - T, 0.05, k2=k[:, :, d1:])
else:
    call = lambda: native.attention(q, k, v, S - T, 0.08)
out = call()
walls, cpus = [], []
for _ in range(calls):
    w0, c0 = time.perf_counter(), time.process_time()
    call()
    walls.append(time.perf_counter() - w0)
    cpus.append(time.process_time() - c0)
print(json.dumps({"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
                  "digest": hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16], "path": native.selected()}))
"""


def measure(tree: Path, shape: tuple) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # cwd: ``python -c`` puts it first on sys.path, before PYTHONPATH
    r = subprocess.run([sys.executable, "-c", WORKER, *map(str, shape)], env=env, cwd=tree, capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", type=Path, required=True, help="the tree measured first (before)")
    p.add_argument("--b", type=Path, default=None, help="the tree measured second (after), or none")
    p.add_argument("--runs", type=int, default=3, help="processes per tree and shape (default 3)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    trees = [("a", a.a.resolve())] + ([("b", a.b.resolve())] if a.b else [])
    res = {"cpu": cpu_model(), "load_before": load_average(), "trees": {n: str(t) for n, t in trees}, "shapes": {}}
    for name, shape in SHAPES.items():
        runs = {n: [] for n, _ in trees}
        for _ in range(a.runs):
            for n, t in trees:
                runs[n].append(measure(t, shape))
        row = {}
        for n, _ in trees:
            wall = statistics.median(r["wall_ms"] for r in runs[n])
            cpu = statistics.median(r["cpu_ms"] for r in runs[n])
            t_, hq, _, d1, d2, dv, s, _ = shape
            fma = hq * (t_ * s - t_ * (t_ - 1) / 2) * (d1 + d2 + dv)
            row[n] = {"wall_ms": round(wall, 3), "cpu_ms": round(cpu, 3), "gfma_per_cpu_s": round(fma / cpu / 1e6, 2),
                      "digest": runs[n][0]["digest"], "path": runs[n][0]["path"]}
        if len(trees) == 2:
            row["wall_a_over_b"] = round(row["a"]["wall_ms"] / row["b"]["wall_ms"], 2)
            row["cpu_a_over_b"] = round(row["a"]["cpu_ms"] / row["b"]["cpu_ms"], 2)
            row["same_bits"] = row["a"]["digest"] == row["b"]["digest"]
        res["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    res["load_after"] = load_average()
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
