"""MLX affine quantization: bit packing, dequantization, and a reference quantizer.

Definition (mlx ``mx.quantize(w, group_size, bits, mode="affine")``, mlx-lm checkpoints):
a weight ``w`` [out, in] is cut along ``in`` into groups of ``group_size`` values; each
group has a float ``scale`` and ``bias`` (``scales``, ``biases`` [out, in / group_size],
in the model's float dtype) and each value an unsigned ``bits``-bit code ``q``, so that

    w[o, i] = scales[o, i // group_size] * q[o, i] + biases[o, i // group_size].

The codes of a row are one continuous little-endian bit stream: code ``i`` occupies bits
``i * bits .. (i + 1) * bits - 1`` counting from the least significant bit of byte 0,
stored as uint32 words (``weight`` [out, in * bits / 32]). For 2, 4 and 8 bits a word
holds 16, 8 or 4 whole codes; 3, 5 and 6-bit codes straddle bytes and words (mlx packs
8, 8 and 4 codes into 3, 5 and 3 bytes, which is the same stream).
"""

from __future__ import annotations

import math

import torch

BITS = (2, 3, 4, 5, 6, 8)


def _pack_shape(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte run of ``bits``-bit codes."""
    nbytes = math.lcm(bits, 8) // 8
    return nbytes * 8 // bits, nbytes


def unpack(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Codes [..., in_features] (uint8, 0 .. 2^bits - 1) from packed words [..., in_features * bits / 32].

    ``packed`` is uint32 (or int32, or the raw uint8 bytes), as mlx stores it.
    """
    raw = packed.contiguous().view(torch.uint8)
    lead = raw.shape[:-1]
    if bits == 8:
        return raw[..., :in_features]
    per, nbytes = _pack_shape(bits)
    mask = (1 << bits) - 1
    if nbytes == 1:
        word = raw
    else:  # whole-byte runs of `nbytes` bytes as one integer (little-endian)
        runs = raw.reshape(*lead, -1, nbytes).to(torch.int32 if nbytes <= 3 else torch.int64)
        word = runs[..., 0].clone()
        for j in range(1, nbytes):
            word |= runs[..., j] << (8 * j)
    out = torch.empty(*word.shape, per, dtype=torch.uint8, device=raw.device)
    for i in range(per):  # scalar shifts: vectorized, unlike a broadcast shift tensor (measured 3x slower)
        out[..., i] = (word >> (i * bits)) & mask
    return out.reshape(*lead, -1)[..., :in_features]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [..., in] (integers 0 .. 2^bits - 1; ``in * bits`` a multiple of 32) into uint32 words.

    The inverse of :func:`unpack`. Raises ValueError on a width that cannot be packed.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    n = codes.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole uint32 words")
    lead = codes.shape[:-1]
    per, nbytes = _pack_shape(bits)
    if nbytes == 1:  # 2, 4, 8 bits: whole codes per byte, combined in uint8 (the int64 path is 10x slower)
        c = codes.to(torch.uint8).reshape(*lead, -1, per)
        raw = c[..., 0].clone()
        for j in range(1, per):
            raw |= c[..., j] << (j * bits)
        return raw.reshape(*lead, -1).contiguous().view(torch.uint32)
    wide = torch.int64
    c = codes.to(wide).reshape(*lead, -1, per)
    shifts = torch.arange(0, per * bits, bits, dtype=wide, device=codes.device)
    word = (c << shifts).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    byte_shifts = torch.arange(0, 8 * nbytes, 8, dtype=wide, device=codes.device)
    raw = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*lead, -1)
    return raw.contiguous().view(torch.uint32)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The float weight [..., in] of an affine-quantized one (``scales * q + biases``, per group).

    Computed in ``dtype`` (default: the scales' dtype), as mlx computes in the scales' dtype.
    """
    dtype = dtype or scales.dtype
    groups = scales.shape[-1]
    q = unpack(packed, bits, groups * group_size).to(dtype)
    q = q.view(*q.shape[:-1], groups, group_size)
    w = q * scales.to(dtype).unsqueeze(-1) + biases.to(dtype).unsqueeze(-1)
    return w.reshape(*w.shape[:-2], groups * group_size)


def quantize(w: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine-quantize ``w`` [..., in] (``in`` a multiple of ``group_size``): (packed uint32, scales, biases).

    Min-max per group: ``bias = min``, ``scale = (max - min) / (2^bits - 1)``, ``q =
    round((w - bias) / scale)`` clipped to the code range; computed in float32, scales
    and biases returned in ``w``'s dtype and the codes chosen against those rounded
    values, so ``scale * q + bias`` is the nearest point of the stored grid. Deterministic
    (same input, same bytes). ``dtype``: of scales and biases (default ``w``'s).
    """
    dtype = dtype or w.dtype
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    n = w.shape[-1]
    if n % group_size:
        raise ValueError(f"in features {n} is not a multiple of group size {group_size}")
    g = w.float().reshape(*w.shape[:-1], n // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    top = (1 << bits) - 1
    scales = ((hi - lo) / top).to(dtype)
    biases = lo.to(dtype)
    s = scales.float().unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((g - biases.float().unsqueeze(-1)) / safe).clamp_(0, top)
    return pack(q.to(torch.uint8).reshape(w.shape), bits), scales, biases
