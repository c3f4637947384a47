"""Decode compute of turboquant (``tq*``) experts and LM heads against the time to read them.

Random codes in the tq layout (``moestream.quant.turboquant``) at the real shapes of two
published builds: one routed expert of Qwen3.6-35B-A3B ``tq3-g32`` (gate and up [512, 2048],
down [2048, 512], 3 bits, group 32) and of Qwen3-235B-A22B ``tq3a-tq2e`` (gate and up
[1536, 4096], down [4096, 1536], 2 bits, group 64, assumed), through the engine's expert
function (``TQExperts``) for one decode token; and 8192 rows of a 3-bit LM head (the full
head is ``vocab / 8192`` times that). "Read" is the expert's bytes (codes and fp16 scales)
at 3 GB/s, this disk's best rate.

    python benchmarks/turboquant.py [--runs 20] [--threads 1] [--clock cpu|wall]

On a shared machine ``--clock cpu --threads 1`` measures the CPU time on one core.
"""

from __future__ import annotations

import argparse
import json
import time

import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch
from _common import median_ms
from torch import nn

from moestream.quant import turboquant as tq
from moestream.quant.formats import LinearFormat

DISK_GBPS = 3.0
BUILDS = {"Qwen3.6-35B-A3B tq3-g32": (2048, 512, 8, 32), "Qwen3-235B-A22B tq3a-tq2e": (4096, 1536, 4, 64)}


def expert(hidden: int, inter: int, levels: int, group: int):
    """(TQExperts, one expert's tensors, bytes per expert) with random codes and Lloyd-Max-like codebook."""
    gen = torch.Generator().manual_seed(0)
    linears, holders, w = {}, {}, {}
    for role, (out, inn) in {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items():
        scheme = tq.TQScheme("turboquant", tq.LEVEL_BITS[levels], group, None, levels)
        linears[role] = LinearFormat(role, scheme, out, inn)
        h = nn.Module()
        h.codebook = torch.linspace(-2, 2, levels).half()
        h.signs = (torch.randint(0, 2, (inn,), generator=gen) * 2 - 1).half()
        holders[role] = h
        w[role] = tq.pack_codes(torch.randint(0, levels, (out, inn), generator=gen), levels)
        w[role + ".scales"] = torch.rand(out, inn // group, generator=gen).half()
    fmt = tq.TQExpertFormat(linears, False, {r: r for r in linears})
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    return tq.TQExperts(fmt, holders), w, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    rows = []
    with torch.inference_mode():
        for name, (hidden, inter, levels, group) in BUILDS.items():
            fn, w, nbytes = expert(hidden, inter, levels, group)
            x = torch.randn(1, hidden, dtype=torch.bfloat16)
            ms = median_ms(lambda fn=fn, x=x, w=w: fn(x, w), a.runs, clock, warmup=1)
            rows.append({"what": f"{name}: one expert", "MB": nbytes / 1e6, "read_ms": nbytes / DISK_GBPS / 1e6,
                         "compute_ms": ms})
        hidden = 2048
        packed = tq.pack_codes(torch.randint(0, 8, (8192, hidden)), 8)
        scales = torch.rand(8192, hidden // 32).half()
        cb, signs = torch.linspace(-2, 2, 8).half(), torch.ones(hidden).half()
        x = torch.randn(1, hidden)
        ms = median_ms(lambda: tq.rotated_matmul(tq.rotate(x, signs, True), packed, scales, cb), a.runs, clock,
                       warmup=1)
        rows.append({"what": "LM head, 3-bit g32, 8192 rows x 2048", "MB": 0.0, "read_ms": 0.0, "compute_ms": ms})
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
