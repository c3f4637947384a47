"""CPU compute of one quantized expert, per format at its real shape, against the time to read its bytes.

Each published quantized format at the shape of a model that ships in it, random codes and
scales in the stored layout, through the expert function the engine uses
(``QuantizedSwiGLU``, ``QuantizedGLU`` for Kimi K3's SiTU-GLU, ``TQExperts`` for turboquant):

* MLX affine 2, 3, 4, 5, 6, 8 bits, group 64, bf16 scales and biases: Qwen3-30B-A3B
  (gate/up [768, 2048], down [2048, 768]) and, at 4 bits, Qwen3-235B-A22B ([1536, 4096]);
* turboquant ``tq*``: 2, 3, 4-bit and ternary codebooks, fp16 group scales, rotated inputs:
  Qwen3.6-35B-A3B ``tq3-g32`` ([512, 2048], groups of 32) and Qwen3-235B-A22B's 2-bit
  experts (``tq3a-tq2e``, [1536, 4096], groups of 64);
* FP8 e4m3, 128 x 128 block scales (bf16): Laguna-XS.2-FP8 ([512, 2048]);
* MXFP4 (e2m1, e8m0 scales per 32), SiTU-GLU: Kimi K3 ([3072, 3584]);
* GGUF in ``--activations q8`` mode (``gguf-<type>-q8act``: the types it covers that are measured here), the
  same experts with their inputs rounded to llama.cpp's 8-bit blocks and integer dot products;
* GGUF (``gguf-<type>``, ggml blocks as llama.cpp stores them): Qwen3-30B-A3B's expert in each ggml
  type moestream computes on (Q8_0, Q4_K, Q6_K, IQ4_XS, and the published-MoE types MXFP4,
  IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0), random codes, float16
  scales near 0.01 (MXFP4: e8m0 exponents near 2^-7), so no subnormal scale slows a type down.

Per format, 1 and 8 tokens (x [rows, H] bf16): the median process CPU time of the expert
over ``--runs`` calls (at least 20) on ``--threads`` threads (default 1), cycling through
enough copies of the expert that they exceed the last-level cache (each call reads its
weights from memory, as a streamed expert); the expert's bytes read at 3 GB/s (this
machine's best disk rate); and the weight bytes per second the kernel reaches. The
machine's single-thread memory-copy rate (a 256 MiB ``copy_``, bytes copied per second)
bounds a memory-bound kernel. Targets (issue 21): 1 token, 1 thread: compute <= read (4-bit
30B expert: <= 0.9 ms); 8 tokens: compute <= 2x read; decode weight GB/s >= half the copy rate.

    python benchmarks/expert_kernels.py --json FILE [--threads N] [--runs 30] [--path auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from functools import partial
from pathlib import Path

import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch
from _common import cpu_model, median_ms
from torch import nn

from moestream.models.kimi_linear import situ_expert
from moestream.models.moe import swiglu_expert
from moestream.quant import affine, ggml, native
from moestream.quant.expert import expert_fn_for
from moestream.quant.formats import (
    Q8_ACTIVATION_TYPES,
    ExpertFormat,
    LinearFormat,
    Scheme,
    ggml_scheme,
    with_activations,
)
from moestream.quant.turboquant import TRIT, TQExpertFormat, TQExperts, TQScheme, codes_per_word

DISK_GBPS = 3.0


def copy_gbps() -> float:
    """Single-thread memory-copy rate: bytes copied per second by a 256 MiB ``copy_`` (median of 7)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(64 << 20)
        dst = torch.empty_like(src)
        ms = median_ms(lambda: dst.copy_(src), 7, time.process_time)
    finally:
        torch.set_num_threads(threads)
    return src.numel() * 4 / (ms * 1e-3) / 1e9


def llc_bytes() -> int:
    """The last-level cache size (lscpu's L3, else 32 MiB)."""
    try:
        out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("L3"):
                return int(line.split(":")[1].split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return 32 << 20


def shapes(inter: int, hidden: int):
    return (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))


def affine_expert(inter, hidden, bits, group=64, seed=0, activations="float"):
    """An MLX affine expert; ``activations="q8"``: in --activations q8 mode (8-bit activation blocks)."""
    g = torch.Generator().manual_seed(seed)
    pieces, lins = {}, {}
    for role, (o, i) in shapes(inter, hidden):
        q, s, b = affine.quantize((torch.randn(o, i, generator=g) * 0.02).bfloat16(), bits, group)
        pieces[role], pieces[role + ".scales"], pieces[role + ".biases"] = q, s, b
        lins[role] = with_activations(LinearFormat(role, Scheme("affine", bits, group), o, i), activations)
    return pieces, expert_fn_for(swiglu_expert, ExpertFormat(lins))


def fp8_expert(inter, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = Scheme("fp8", 8, 128, (128, 128), "weight_scale")
    pieces, lins = {}, {}
    for role, (o, i) in shapes(inter, hidden):
        pieces[role] = (torch.randn(o, i, generator=g) * 100).to(torch.float8_e4m3fn)
        pieces[role + ".weight_scale"] = (torch.rand(-(-o // 128), -(-i // 128), generator=g) * 1e-4).bfloat16()
        lins[role] = LinearFormat(role, s, o, i)
    return pieces, expert_fn_for(swiglu_expert, ExpertFormat(lins))


def mxfp4_expert(inter, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = Scheme("mxfp4", 4, 32, None, "weight_scale")
    pieces, lins = {}, {}
    for role, (o, i) in shapes(inter, hidden):
        pieces[role] = torch.randint(0, 256, (o, i // 2), generator=g, dtype=torch.uint8)
        pieces[role + ".weight_scale"] = torch.randint(118, 124, (o, i // 32), generator=g, dtype=torch.uint8)
        lins[role] = LinearFormat(role, s, o, i)
    fn = partial(situ_expert, beta=4.0, linear_beta=25.0)  # Kimi K3's activation_situ_beta, _linear_beta
    return pieces, expert_fn_for(fn, ExpertFormat(lins))


# GGUF types: the byte ranges of each block's float16 scales (ggml-common.h), set to about 0.01
_GGUF_F16 = {"Q8_0": ((0, 2),), "Q4_K": ((0, 4),), "Q6_K": ((208, 210),), "IQ4_XS": ((0, 2),), "IQ2_XXS": ((0, 2),),
             "IQ2_XS": ((0, 2),), "IQ2_S": ((0, 2),), "IQ3_XXS": ((0, 2),), "IQ3_S": ((0, 2),), "IQ1_S": ((0, 2),),
             "TQ1_0": ((52, 54),), "TQ2_0": ((64, 66),), "MXFP4": (), "IQ1_M": ()}
GGUF_TYPES = tuple(_GGUF_F16)


def gguf_blocks(qtype: str, out: int, inn: int, g: torch.Generator) -> torch.Tensor:
    """Random ``qtype`` blocks [out, row bytes] with finite, normal scales."""
    block, size, _ = ggml.TYPES[qtype]
    raw = torch.randint(0, 256, (out, inn // block, size), generator=g, dtype=torch.uint8)
    scale = (torch.rand(out, inn // block, 1, generator=g) * 0.01 + 0.005).half().view(torch.uint8)
    for a, b in _GGUF_F16[qtype]:
        raw[..., a:b] = scale.unsqueeze(2).expand(-1, -1, (b - a) // 2, 2).reshape(out, inn // block, b - a)
    if qtype == "MXFP4":
        raw[..., 0] = torch.randint(118, 124, (out, inn // block), generator=g, dtype=torch.uint8)
    elif qtype == "IQ1_M":  # d is the top nibbles of the 4 scale words
        bits = scale.view(torch.int16).to(torch.int32) & 0xFFFF
        words = raw[..., 48:56].contiguous().view(torch.int16).to(torch.int32) & 0x0FFF
        words = words | (((bits >> torch.tensor((0, 4, 8, 12))) & 0xF) << 12)
        raw[..., 48:56] = words.to(torch.int16).view(torch.uint8)
    return raw.reshape(out, -1)


def gguf_expert(inter, hidden, qtype, seed=0, activations="float"):
    """A ggml-type expert; ``activations="q8"``: in moestream's --activations q8 mode (llama.cpp's 8-bit
    activation blocks and integer dot products)."""
    g = torch.Generator().manual_seed(seed)
    pieces, lins = {}, {}
    for role, (o, i) in shapes(inter, hidden):
        pieces[role] = gguf_blocks(qtype, o, i, g)
        lins[role] = with_activations(LinearFormat(role, ggml_scheme(ggml.dtype_name(qtype)), o, i), activations)
    return pieces, expert_fn_for(swiglu_expert, ExpertFormat(lins))


_TQ_LEVELS = {2: 4, 3: 8, 4: 16, "ternary": TRIT}


def tq_expert(inter, hidden, bits, group, seed=0):
    """A turboquant expert: streamed codes and fp16 scales; shared codebook and signs in resident holders."""
    g = torch.Generator().manual_seed(seed)
    levels = _TQ_LEVELS[bits]
    pieces, lins, holders = {}, {}, {}
    for role, (o, i) in shapes(inter, hidden):
        words = -(-i // codes_per_word(levels))
        top = 3**20 if levels == TRIT else 2**32
        pieces[role] = torch.randint(0, top, (o, words), generator=g, dtype=torch.int64).to(torch.int32) \
            .view(torch.uint32)
        pieces[role + ".scales"] = (torch.rand(o, i // group, generator=g) * 0.02 + 0.005).half()
        h = nn.Module()
        h.codebook = nn.Parameter(torch.linspace(-2, 2, levels).half(), requires_grad=False)
        h.signs = nn.Parameter((torch.randint(0, 2, (i,), generator=g) * 2 - 1).half(), requires_grad=False)
        holders[role] = h
        scheme = TQScheme("turboquant", 0 if levels == TRIT else {4: 2, 8: 3, 16: 4}[levels], group, levels=levels)
        lins[role] = LinearFormat(role, scheme, o, i)
    return pieces, TQExperts(TQExpertFormat(lins, False, {}), holders)


# (model, format, bits, (inter, hidden), builder)
CASES = [
    *(("Qwen3-30B-A3B", "mlx-affine-g64", b, (768, 2048), partial(affine_expert, 768, 2048, b))
      for b in (8, 6, 5, 4, 3, 2)),
    *(("Qwen3-30B-A3B", "mlx-affine-g64-q8act", b, (768, 2048), partial(affine_expert, 768, 2048, b, activations="q8"))
      for b in (8, 4)),
    ("Qwen3-235B-A22B", "mlx-affine-g64", 4, (1536, 4096), partial(affine_expert, 1536, 4096, 4)),
    *(("Qwen3.6-35B-A3B", "turboquant-g32", b, (512, 2048), partial(tq_expert, 512, 2048, b, 32))
      for b in (4, 3, 2, "ternary")),
    ("Qwen3-235B-A22B", "turboquant-g64", 2, (1536, 4096), partial(tq_expert, 1536, 4096, 2, 64)),
    ("Laguna-XS.2", "fp8-block128", 8, (512, 2048), partial(fp8_expert, 512, 2048)),
    ("Kimi-K3", "mxfp4-situ", 4, (3072, 3584), partial(mxfp4_expert, 3072, 3584)),
    *(("Qwen3-30B-A3B", f"gguf-{t}", ggml.TYPES[t][2], (768, 2048), partial(gguf_expert, 768, 2048, t))
      for t in GGUF_TYPES),
    # --activations q8: the types it covers, each measured right after its float row above (``--only gguf-Q4_K``)
    *(("Qwen3-30B-A3B", f"gguf-{t}-q8act", ggml.TYPES[t][2], (768, 2048),
       partial(gguf_expert, 768, 2048, t, activations="q8")) for t in Q8_ACTIVATION_TYPES if t in GGUF_TYPES),
]


class Cycle:
    """Calls the experts ``copies`` [(pieces, fn)] on ``x`` in turn (each call reads another copy's weights)."""

    def __init__(self, copies, x):
        self.copies, self.x, self.i = copies, x, 0

    def __call__(self):
        pieces, fn = self.copies[self.i % len(self.copies)]
        self.i += 1
        return fn(self.x, pieces)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=30, help="calls per measurement (at least 20)")
    ap.add_argument("--path", default="auto", choices=native.CHOICES, help="kernel path (default: the fastest)")
    ap.add_argument("--only", default="", help="comma-separated substrings of model/format to run")
    args = ap.parse_args()
    runs = max(20, args.runs)
    torch.set_num_threads(args.threads)
    with native.use(args.path):
        path = native.selected()
    copy = copy_gbps()
    llc = llc_bytes()
    flags = native.cpu_flags().split(": ", 1)[-1].split()
    simd = [f for f in flags if f.startswith(("avx512", "avx2", "fma", "f16c", "amx"))]
    print(f"CPU {cpu_model()}; {' '.join(simd)}; path {path}; {args.threads} thread(s); "
          f"copy {copy:.1f} GB/s; LLC {llc >> 20} MiB; load average {os.getloadavg()[0]:.1f}")
    rows = []
    only = [o for o in args.only.split(",") if o]
    for model, fmt, bits, (inter, hidden), build in CASES:
        if only and not any(o in model or o in fmt for o in only):
            continue
        first = build(seed=0)
        nbytes = sum(t.numel() * t.element_size() for t in first[0].values())
        # copies in distinct memory (clones: the same codes, so the same compute), past twice the LLC
        copies = [first] + [({k: t.clone() for k, t in first[0].items()}, first[1])
                            for _ in range(1, max(2, -(-2 * llc // nbytes)))]
        read_ms = nbytes / (DISK_GBPS * 1e9) * 1e3
        for n in (1, 8):
            x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)).bfloat16()
            with native.use(args.path):
                ms = median_ms(Cycle(copies, x), runs, time.process_time)
            gbps = nbytes / (ms * 1e-3) / 1e9
            target = read_ms * (1 if n == 1 else 2)
            row = dict(model=model, format=fmt, bits=bits, shape=[inter, hidden], rows=n, compute_ms=round(ms, 4),
                       read_ms=round(read_ms, 4), weight_gbps=round(gbps, 2), expert_bytes=nbytes, path=path,
                       threads=args.threads, copy_gbps=round(copy, 2), hit=ms <= target,
                       load_average=round(os.getloadavg()[0], 2))
            if n == 1:
                row["half_copy_hit"] = gbps >= copy / 2
            rows.append(row)
            print(f"{model:16s} {fmt:16s} {str(bits):8s} {inter}x{hidden} rows {n}: {nbytes / 1e6:6.2f} MB, "
                  f"read {read_ms:6.3f} ms, compute {ms:7.3f} ms ({gbps:5.1f} GB/s) -> "
                  f"{'hit' if row['hit'] else 'MISS'} (<= {'' if n == 1 else '2x '}read)"
                  + ("" if n > 1 else f", {'hit' if row['half_copy_hit'] else 'MISS'} (>= half copy rate)"),
                  flush=True)
    meta = dict(cpu=cpu_model(), flags=simd, path=path, threads=args.threads, copy_gbps=copy, llc_bytes=llc,
                load_average=os.getloadavg(), runs=runs)
    args.json.write_text(json.dumps({"machine": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
