"""Matmuls on quantized weights, without materializing a whole dequantized weight.

``qlinear(x, tensors, fmt)`` computes ``x @ W^T`` for one linear of an expert (or a
resident linear) whose weight ``W`` [out, in] is stored quantized. Paths:

* ``int4``: affine weights of at most 4 bits (and 8 bits, as two 4-bit halves) whose
  groups PyTorch's CPU int4 kernel takes (``torch._weight_int4pack_mm_for_cpu``; group 32,
  64, 128 or 256, ``out`` a multiple of 32), when the compute dtype is bf16 (the kernel is
  fast only there). The codes are repacked once per read into the kernel's layout by
  :func:`prepare` (cached with the expert); mlx's ``w = s q + b`` is the kernel's
  ``w = (q - 8) s + z`` with ``z = b + 8 s``; at 8 bits ``q = 16 hi + lo`` gives two
  products, ``hi`` with scale ``16 s`` and zero ``b + 128 s``, ``lo`` with ``s`` and ``8 s``.
* ``int8``: affine 8-bit weights with one group per row (``group_size == in``), through
  ``torch._weight_int8pack_mm`` (per-channel scales) plus the bias term ``b * sum(x)``.
* ``chunks``: every other case (any bits, fp8, mxfp4, float32 compute): dequantize
  ``ROWS`` output rows at a time into a float32 buffer that stays in cache and multiply,
  so no dequantized layer is ever held.

The path depends only on the format and dtypes, never on the cache state, so streaming
stays bit-identical across budgets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import affine, fp8, mxfp4
from .formats import LinearFormat

# float32 elements dequantized per chunk (256 KiB: stays in L2 while it is multiplied)
CHUNK_ELEMS = 64 * 1024
INT4_GROUPS = (32, 64, 128, 256)


def int4_eligible(lf: LinearFormat, dtype: torch.dtype) -> bool:
    """Whether ``lf`` runs on PyTorch's int4 CPU kernel in compute dtype ``dtype``."""
    s = lf.scheme
    return (
        s is not None and s.method == "affine" and s.bits in (2, 3, 4, 8) and s.group_size in INT4_GROUPS
        and lf.out_features % 32 == 0 and lf.in_features % s.group_size == 0 and dtype == torch.bfloat16
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")
    )


def _int4pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15, uint8) in the layout ``_convert_weight_to_int4pack_for_cpu`` makes.

    That layout (measured on PyTorch 2.13): rows in blocks of 32; per block and input
    column, 16 bytes, byte ``j`` holding row ``j`` in its low nibble and row ``j + 16`` in its
    high one. Building it here costs about 1 ms for 768x2048, the PyTorch call about 18 ms.
    """
    n, k = codes.shape
    v = codes.view(n // 32, 2, 16, k).permute(0, 3, 2, 1)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous().view(n, k // 2)


def _int4pack_mlx4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int4 kernel layout straight from mlx 4-bit words [n, k/8] (no code tensor in between).

    mlx byte ``j`` of a row holds codes ``2j`` (low nibble) and ``2j+1`` (high); the kernel wants,
    per 32-row block and column, rows ``i`` and ``i + 16`` in one byte.
    """
    raw = packed.contiguous().view(torch.uint8).view(n // 32, 2, 16, k // 2)
    a, b = raw[:, 0], raw[:, 1]  # rows i and i + 16 of each block: [nb, 16, k/2]
    even = (a & 0x0F) | (b << 4)  # code 2j of both rows
    odd = (a >> 4) | (b & 0xF0)  # code 2j+1
    return torch.stack((even, odd), -1).permute(0, 2, 3, 1).reshape(n, k // 2)


def _int4pack_bytes(codes: torch.Tensor, shift: int) -> torch.Tensor:
    """The int4 kernel layout of nibble ``shift`` (0 low, 4 high) of 8-bit codes [n, k]."""
    n, k = codes.shape
    c = codes.view(n // 32, 2, 16, k)
    if shift:
        out = (c[:, 0] >> 4) | (c[:, 1] & 0xF0)
    else:
        out = (c[:, 0] & 0x0F) | (c[:, 1] << 4)
    return out.permute(0, 2, 1).reshape(n, k // 2)


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
