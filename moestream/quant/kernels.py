"""Matmuls on quantized weights, without materializing a whole dequantized weight.

``qlinear(x, tensors, fmt)`` computes ``x @ W^T`` for one linear of an expert (or a
resident linear) whose weight ``W`` [out, in] is stored quantized. Paths:

* ``int4``: affine weights of at most 4 bits (and 8 bits, as two 4-bit halves) whose
  groups PyTorch's CPU int4 kernel takes (``torch._weight_int4pack_mm_for_cpu``; group 32,
  64, 128 or 256, ``out`` a multiple of the kernel's row block), when the compute dtype is
  bf16 (the kernel is fast only there). The row block depends on the CPU PyTorch
  dispatches to (32 rows on AVX2, 64 on AVX-512), so it is probed once per process
  against PyTorch's own converter, and the packed product is checked against a float64
  product of the dequantized weight (:func:`int4_block`); if either check fails the
  path is off and the chunked path below computes every linear. The codes are repacked
  once per read into the kernel's layout by :func:`prepare` (cached with the expert);
  mlx's ``w = s q + b`` is the kernel's ``w = (q - 8) s + z`` with ``z = b + 8 s``; at
  8 bits ``q = 16 hi + lo`` gives two products, ``hi`` with scale ``16 s`` and zero
  ``b + 128 s``, ``lo`` with ``s`` and ``8 s``.
* ``int8``: affine 8-bit weights with one group per row (``group_size == in``), through
  ``torch._weight_int8pack_mm`` (per-channel scales) plus the bias term ``b * sum(x)``.
* ``chunks``: every other case (any bits, fp8, mxfp4, float32 compute): dequantize
  ``ROWS`` output rows at a time into a float32 buffer that stays in cache and multiply,
  so no dequantized layer is ever held.

The path depends only on the format and dtypes, never on the cache state, so streaming
stays bit-identical across budgets.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from . import affine, fp8, mxfp4
from .formats import LinearFormat

# float32 elements dequantized per chunk (256 KiB: stays in L2 while it is multiplied)
CHUNK_ELEMS = 64 * 1024
INT4_GROUPS = (32, 64, 128, 256)


def int4_eligible(lf: LinearFormat, dtype: torch.dtype) -> bool:
    """Whether ``lf`` runs on PyTorch's int4 CPU kernel in compute dtype ``dtype``.

    Needs bf16, an affine scheme of 2, 3, 4 or 8 bits with a group the kernel takes, and
    ``out`` a multiple of the kernel's row block on this CPU (:func:`int4_block`; the path is
    off where the probe found no layout it can build).
    """
    s = lf.scheme
    if not (
        s is not None and s.method == "affine" and s.bits in (2, 3, 4, 8) and s.group_size in INT4_GROUPS
        and lf.in_features % s.group_size == 0 and dtype == torch.bfloat16
    ):
        return False
    block = int4_block()
    return block is not None and lf.out_features % block == 0


@functools.cache
def int4_block() -> int | None:
    """The row block of PyTorch's CPU int4 layout on this CPU (32 or 64), or None to keep the path off.

    ``torch._convert_weight_to_int4pack_for_cpu`` packs rows in blocks of ``B`` (32 where
    PyTorch dispatches to AVX2, 64 on AVX-512): per block and input column ``B/2`` bytes,
    byte ``j`` holding row ``j`` in its low nibble and row ``j + B/2`` in its high one. This
    builds that layout by hand for each candidate ``B`` and compares it with PyTorch's own
    converter on a probe matrix, then checks the packed product of random codes, scales
    and zeros against a float64 product of the dequantized weight. Once per process (a few
    ms). None (with one line on stderr) when no candidate matches or the product is off,
    so a future PyTorch layout can never compute wrong values silently.
    """
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    n, k, group = 128, 64, 32
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    try:
        want = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    except RuntimeError:
        want = None
    for block in (32, 64):
        packed = _int4pack(codes.to(torch.uint8), block)
        if want is not None and not torch.equal(packed, want):
            continue
        scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
        zeros = torch.randn(n, k // group, generator=gen) * 0.1
        sz = _scale_zero(scales, zeros, torch.bfloat16)
        x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(x, packed, group, sz).double()
        s64, z64 = sz.double().transpose(0, 1).unbind(-1)  # [n, groups] as the kernel rounded them
        w = (codes.double() - 8).view(n, -1, group) * s64[..., None] + z64[..., None]
        ref = x.double() @ w.view(n, k).t()
        if (y - ref).abs().max() <= 0.02 * ref.abs().max():
            return block
    print("moestream: note: PyTorch's int4 CPU kernel takes a weight layout moestream does not build on this "
          "CPU; quantized bf16 linears use the slower dequantizing path", file=sys.stderr)
    return None


def _int4pack(codes: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Codes [out, in] (0..15, uint8) in the layout ``_convert_weight_to_int4pack_for_cpu`` makes.

    Rows in blocks of ``block`` (default :func:`int4_block`); per block and input column,
    ``block/2`` bytes, byte ``j`` holding row ``j`` in its low nibble and row ``j + block/2`` in
    its high one. Building it here costs about 1 ms for 768x2048, the PyTorch call about 18 ms.
    """
    b = block or int4_block()
    n, k = codes.shape
    v = codes.view(n // b, 2, b // 2, k).permute(0, 3, 2, 1)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous().view(n, k // 2)


def _int4pack_mlx4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int4 kernel layout straight from mlx 4-bit words [n, k/8] (no code tensor in between).

    mlx byte ``j`` of a row holds codes ``2j`` (low nibble) and ``2j+1`` (high); the kernel wants,
    per block of ``B`` rows and column, rows ``i`` and ``i + B/2`` in one byte.
    """
    b = int4_block()
    raw = packed.contiguous().view(torch.uint8).view(n // b, 2, b // 2, k // 2)
    lo, hi = raw[:, 0], raw[:, 1]  # rows i and i + B/2 of each block: [nb, B/2, k/2]
    even = (lo & 0x0F) | (hi << 4)  # code 2j of both rows
    odd = (lo >> 4) | (hi & 0xF0)  # code 2j+1
    return torch.stack((even, odd), -1).permute(0, 2, 3, 1).contiguous().view(n, k // 2)


def _int4pack_bytes(codes: torch.Tensor, shift: int) -> torch.Tensor:
    """The int4 kernel layout of nibble ``shift`` (0 low, 4 high) of 8-bit codes [n, k]."""
    b = int4_block()
    n, k = codes.shape
    c = codes.view(n // b, 2, b // 2, k)
    if shift:
        out = (c[:, 0] >> 4) | (c[:, 1] & 0xF0)
    else:
        out = (c[:, 0] & 0x0F) | (c[:, 1] << 4)
    return out.permute(0, 2, 1).contiguous().view(n, k // 2)


def prepare(tensors: dict[str, torch.Tensor], fmt, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Add kernel-ready forms to an expert's (or linear's) tensors, once per read.

    For each int4-eligible linear (see :func:`int4_eligible`), adds ``<role>.int4``
    (packed codes) and ``<role>.int4sz`` ([in/group, out, 2] scales and zeros in bf16), at
    8 bits also ``<role>.int4lo`` and ``<role>.int4lo_sz`` (the low nibbles), and drops the
    mlx pieces. Other linears are unchanged. Returns the new dict.
    """
    out = dict(tensors)
    for role, lf in fmt.linears.items():
        if not int4_eligible(lf, dtype):
            continue
        s = lf.scheme
        packed = out.pop(role)
        n, k = lf.out_features, lf.in_features
        scales, biases = out.pop(role + ".scales").float(), out.pop(role + ".biases").float()
        if s.bits == 8:
            codes = packed.contiguous().view(torch.uint8).view(n, k)
            out[role + ".int4"] = _int4pack_bytes(codes, 4)
            out[role + ".int4sz"] = _scale_zero(16 * scales, biases + 128 * scales, dtype)
            out[role + ".int4lo"] = _int4pack_bytes(codes, 0)
            out[role + ".int4lo_sz"] = _scale_zero(scales, 8 * scales, dtype)
        else:
            fast = s.bits == 4
            out[role + ".int4"] = _int4pack_mlx4(packed, n, k) if fast else _int4pack(affine.unpack(packed, s.bits, k))
            out[role + ".int4sz"] = _scale_zero(scales, biases + 8 * scales, dtype)
    return out


def _scale_zero(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, groups] scales and zeros as the int4 kernel takes them: [groups, out, 2] in ``dtype``."""
    return torch.stack((scales, zeros), -1).transpose(0, 1).to(dtype).contiguous()


def _rows(lf: LinearFormat) -> int:
    return max(1, CHUNK_ELEMS // lf.in_features)


def dequantize_rows(t: dict[str, torch.Tensor], lf: LinearFormat, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of the float32 weight of linear ``lf`` from its pieces ``t``."""
    role, s = lf.role, lf.scheme
    if s is None:
        return t[role][r0:r1].float()
    if s.method == "affine":
        return affine.dequantize(t[role][r0:r1], t[role + ".scales"][r0:r1], t[role + ".biases"][r0:r1],
                                 s.bits, s.group_size, torch.float32)
    if s.method == "fp8":
        return fp8.dequantize_rows(t[role], t[role + "." + s.scale_param], s.block, r0, r1, torch.float32)
    # gpt-oss blocks [out, in/32, 16] or compressed-tensors' packed [out, in/2]: the same bytes
    blocks = t[role][r0:r1]
    return mxfp4.dequantize(blocks.reshape(blocks.shape[0], -1, 16), t[role + "." + s.scale_param][r0:r1],
                            torch.float32)


def dequantize_linear(t: dict[str, torch.Tensor], lf: LinearFormat, dtype: torch.dtype) -> torch.Tensor:
    """The whole float weight [out, in] of linear ``lf`` in ``dtype`` (for references and fallbacks)."""
    if lf.role + ".int4" in t:
        raise ValueError("dequantize_linear needs the stored pieces, not the prepared int4 form")
    return dequantize_rows(t, lf, 0, lf.out_features).to(dtype)


def qlinear(x: torch.Tensor, t: dict[str, torch.Tensor], lf: LinearFormat) -> torch.Tensor:
    """``x`` [n, in] times the quantized weight of ``lf`` (pieces in ``t``), transposed: [n, out] in x.dtype.

    Float32 accumulation on every path but int4 (bf16 in, bf16 out, as PyTorch's kernel).
    """
    role, s = lf.role, lf.scheme
    if s is None and t[role].dtype == x.dtype:
        return F.linear(x, t[role])
    packed = t.get(role + ".int4")
    if packed is not None:
        x = x.contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x, packed, s.group_size, t[role + ".int4sz"])
        lo = t.get(role + ".int4lo")
        if lo is not None:
            y = y + torch._weight_int4pack_mm_for_cpu(x, lo, s.group_size, t[role + ".int4lo_sz"])
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
        step = max(s.block[0], step // s.block[0] * s.block[0])
    for r0 in range(0, lf.out_features, step):
        r1 = min(r0 + step, lf.out_features)
        out[:, r0:r1] = xf @ dequantize_rows(t, lf, r0, r1).t()
    return out.to(x.dtype)


class Prepare:
    """The store's prepare hook: int4-eligible expert linears repacked for the int4 kernel once per read.

    ``active`` is False when no linear of any layer qualifies (the hook is then not set).
    """

    def __init__(self, layout, formats: dict, dtype: torch.dtype):
        self.layout, self.formats, self.dtype = layout, formats, dtype
        self.roles = {i: [r for r, lf in f.linears.items() if int4_eligible(lf, dtype)] for i, f in formats.items()}
        self.active = any(self.roles.values())

    def __call__(self, key, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fmt = self.formats.get(key[0])
        return tensors if fmt is None or not self.roles[key[0]] else prepare(tensors, fmt, self.dtype)

    def nbytes(self, key, stored: int) -> int:
        """Bytes of the prepared expert, given ``stored``, the bytes of its pieces as read."""
        from ..store import PIECE_ALIGN

        fmt = self.formats.get(key[0])
        for role in self.roles.get(key[0], ()):
            lf = fmt.linears[role]
            for p in self.layout.pieces(*key):
                if p.role in (role, role + ".scales", role + ".biases"):
                    stored -= -(-p.nbytes // PIECE_ALIGN) * PIECE_ALIGN
            groups = lf.in_features // lf.scheme.group_size
            halves = 2 if lf.scheme.bits == 8 else 1
            stored += halves * (lf.out_features * lf.in_features // 2 + groups * lf.out_features * 4)
        return stored
