"""Decode compute of one compressed-tensors expert, as published, against the time to read its bytes.

Two experts at their real shapes, random codes and scales in the stored layout:

* Laguna-XS.2-FP8: ``float-quantized`` block FP8, gate/up [512, 2048], down [2048, 512],
  ``weight_scale`` per 128x128 block (bf16), SwiGLU (``QuantizedSwiGLU``, the engine's path);
* Kimi K3: ``mxfp4-pack-quantized``, gate/up [3072, 3584], down [3584, 3072], uint8 e8m0
  scales per 32 values, SiTU-GLU (``DequantizedExpert`` around ``situ_expert``: the expert
  is dequantized to bf16 for each call, the path the engine uses for a non-SwiGLU family).

One decode token (x [1, H] bf16): the median time of the expert, and its bytes read at
3 GB/s (this machine's best disk rate).

    python benchmarks/compressed_experts.py [--runs 50] [--threads 1] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch
from _common import median_ms

from moestream.models.kimi_linear import situ_expert
from moestream.models.moe import swiglu_expert
from moestream.quant.expert import expert_fn_for
from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme

DISK_GBPS = 3.0


def fp8_expert(inter: int, hidden: int):
    g = torch.Generator().manual_seed(0)
    s = Scheme("fp8", 8, 128, (128, 128), "weight_scale")
    pieces, lin = {}, {}
    for role, (o, i) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        pieces[role] = (torch.randn(o, i, generator=g) * 100).to(torch.float8_e4m3fn)
        pieces[role + ".weight_scale"] = (torch.rand(-(-o // 128), -(-i // 128), generator=g) * 1e-4).bfloat16()
        lin[role] = LinearFormat(role, s, o, i)
    return pieces, ExpertFormat(lin)


def mxfp4_expert(inter: int, hidden: int):
    g = torch.Generator().manual_seed(1)
    s = Scheme("mxfp4", 4, 32, None, "weight_scale")
    pieces, lin = {}, {}
    for role, (o, i) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        pieces[role] = torch.randint(0, 256, (o, i // 2), generator=g, dtype=torch.uint8)
        pieces[role + ".weight_scale"] = torch.randint(118, 124, (o, i // 32), generator=g, dtype=torch.uint8)
        lin[role] = LinearFormat(role, s, o, i)
    return pieces, ExpertFormat(lin)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"load average before: {os.getloadavg()}; {args.threads} thread(s), {args.clock} clock")
    cases = [
        ("Laguna-XS.2 fp8 block 128x128", fp8_expert(512, 2048), swiglu_expert, 2048),
        ("Kimi K3 mxfp4", mxfp4_expert(3072, 3584), partial(situ_expert, beta=4.0, linear_beta=25.0), 3584),
    ]
    for name, (pieces, fmt), float_fn, hidden in cases:
        fn = expert_fn_for(float_fn, fmt)
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
        nbytes = sum(t.numel() * t.element_size() for t in pieces.values())
        ms = median_ms(lambda fn=fn, p=pieces, x=x: fn(x, p), args.runs, clock)
        read = nbytes / (DISK_GBPS * 1e9) * 1e3
        print(f"{name:32s} {nbytes:>12,d} bytes  read {read:7.3f} ms  compute {ms:8.3f} ms  "
              f"({type(fn).__name__})")


if __name__ == "__main__":
    main()
