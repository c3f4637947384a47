"""Decode compute of one quantized Qwen3-30B-A3B expert against the time to read its bytes.

For one expert of the Qwen3-30B-A3B shape (hidden 2048, moe_intermediate 768: gate and up
[768, 2048], down [2048, 768]) stored as MLX affine at 8, 4, 3 and 2 bits (bf16 scales and
biases), one decode token (x [1, 2048] bf16): the median time of the expert's SwiGLU on the
quantized pieces (``moestream.quant.expert.QuantizedSwiGLU``, the path the engine uses),
on the kernels this process selects (``moestream.quant.native``; nothing is prepared per
read), and the time to read the expert's bytes at 3 GB/s (this machine's best disk rate).
Compute must not exceed the read. ``benchmarks/expert_kernels.py`` measures every format.

    python benchmarks/quant_kernels.py [--group-size 64] [--runs 200] [--threads 2] [--clock wall|cpu]

On a shared machine, ``--clock cpu --threads 1`` measures the CPU time the computation
needs on one core, which other processes' load barely changes; wall time does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch
from _common import median_ms

from moestream.quant import affine, native
from moestream.quant.expert import QuantizedSwiGLU
from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme

H, INTER = 2048, 768
DISK_GBPS = 3.0


def expert(bits: int, group: int):
    g = torch.Generator().manual_seed(bits)
    pieces, linears = {}, {}
    for role, (o, i) in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER))):
        w = (torch.randn(o, i, generator=g) * 0.02).to(torch.bfloat16)
        q, s, b = affine.quantize(w, bits, group)
        pieces[role], pieces[role + ".scales"], pieces[role + ".biases"] = q, s, b
        linears[role] = LinearFormat(role, Scheme("affine", bits, group), o, i)
    return pieces, ExpertFormat(linears)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or process CPU time (all threads; robust to other processes' load)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = []
    print(f"load average before: {os.getloadavg()}")
    for bits in (8, 4, 3, 2):
        pieces, fmt = expert(bits, args.group_size)
        nbytes = sum(t.numel() * t.element_size() for t in pieces.values())
        read_ms = nbytes / (DISK_GBPS * 1e9) * 1e3
        fn = QuantizedSwiGLU(fmt)
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        compute = median_ms(lambda fn=fn, p=pieces: fn(x, p), args.runs, clock, warmup=5)
        path = native.selected()
        rows.append(dict(clock=args.clock, threads=args.threads, bits=bits, group=args.group_size, path=path,
                         expert_mb=nbytes / 1e6, read_ms=read_ms, compute_ms=compute, hit=compute <= read_ms))
        print(f"{bits}-bit g{args.group_size} [{path}]: {nbytes / 1e6:.2f} MB, read at 3 GB/s {read_ms:.3f} ms, "
              f"compute {compute:.3f} ms -> {'hit' if compute <= read_ms else 'MISS'}")
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
