"""Matmuls on quantized weights, without materializing a whole dequantized weight.

``qlinear(x, tensors, fmt)`` computes ``x @ W^T`` for one linear of an expert (or a
resident linear) whose weight ``W`` [out, in] is stored quantized, on the pieces as stored
(nothing is repacked per read). Paths, in order:

* ``native``: moestream's compiled CPU kernels (:mod:`.native`: AVX-512, AVX2 or portable
  C++, chosen once per process) for every format they cover, on CPU tensors;
  ``MOESTREAM_CPU_KERNELS=torch`` turns them off (then the paths below are the reference).
* ``int8``: affine 8-bit weights with one group per row (``group_size == in``), through
  ``torch._weight_int8pack_mm`` (per-channel scales) plus the bias term ``b * sum(x)``.
* ``chunks``: every other case (any bits, fp8, mxfp4, ggml blocks, other devices): dequantize ``ROWS``
  output rows at a time into a float32 buffer that stays in cache and multiply, so no
  dequantized layer is ever held. :func:`dequantize_rows` is the float reference of every
  format.

The path depends only on the format, dtypes, device and the process's kernel selection,
never on the cache state, so streaming stays bit-identical across budgets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fp8, native, registry
from .formats import LinearFormat

# float32 elements dequantized per chunk (256 KiB: stays in L2 while it is multiplied)
CHUNK_ELEMS = 64 * 1024


def _rows(lf: LinearFormat) -> int:
    return max(1, CHUNK_ELEMS // lf.in_features)


def dequantize_rows(t: dict[str, torch.Tensor], lf: LinearFormat, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of the float32 weight of linear ``lf`` from its pieces ``t``: its stored format's
    reference dequantizer (:mod:`.registry`)."""
    if lf.scheme is None:
        return t[lf.role][r0:r1].float()
    return registry.of(lf.scheme).dequantize(t, lf, r0, r1)


def dequantize_linear(t: dict[str, torch.Tensor], lf: LinearFormat, dtype: torch.dtype) -> torch.Tensor:
    """The whole float weight [out, in] of linear ``lf`` in ``dtype`` (for references and fallbacks)."""
    return dequantize_rows(t, lf, 0, lf.out_features).to(dtype)


def qlinear(x: torch.Tensor, t: dict[str, torch.Tensor], lf: LinearFormat) -> torch.Tensor:
    """``x`` [n, in] times the quantized weight of ``lf`` (pieces in ``t``), transposed: [n, out] in x.dtype.

    Float32 accumulation on every path, one rounding to x.dtype at the end.

    Raises:
        ValueError: pieces whose shapes disagree with ``lf`` (from the native kernels, naming the piece).
    """
    role, s = lf.role, lf.scheme
    if s is None and t[role].dtype == x.dtype:
        return F.linear(x, t[role])
    y = native.linear(x, t, lf)
    if y is not None:
        return y
    if s is not None and s.method == "affine" and s.bits == 8 and s.group_size == lf.in_features:
        q = t[role].view(torch.uint8).view(lf.out_features, lf.in_features)
        xf = x.float()
        scales, biases = t[role + ".scales"].float()[:, 0], t[role + ".biases"].float()[:, 0]
        # w = s q + b = s (q - 128) + (b + 128 s): the int8 kernel takes signed codes
        signed = (q ^ 0x80).view(torch.int8)  # q - 128 in two's complement
        y = torch._weight_int8pack_mm(xf, signed, scales) + xf.sum(-1, keepdim=True) * (biases + 128 * scales)
        return y.to(x.dtype)
    xf = x.float()
    out = xf.new_empty(x.shape[0], lf.out_features)
    step = _rows(lf)
    if s is not None and s.method == "fp8":
        bn = fp8.resolve_block(s.block, (lf.out_features, lf.in_features))[0]
        step = max(bn, step // bn * bn)
    for r0 in range(0, lf.out_features, step):
        r1 = min(r0 + step, lf.out_features)
        out[:, r0:r1] = xf @ dequantize_rows(t, lf, r0, r1).t()
    return out.to(x.dtype)
