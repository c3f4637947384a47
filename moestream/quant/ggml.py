"""ggml block quantization (the weights of GGUF files, as llama.cpp writes them): layouts and dequantization.

A ggml-quantized weight [out, in] is stored row after row; each row is ``in / block``
blocks of ``type_size`` bytes, each block holding ``block`` consecutive weights of the row
(``in`` a multiple of the block). moestream keeps such a weight as its raw bytes, a uint8
tensor [out, in / block * type_size] whose dtype name in the tensor index is ``GGML_<type>``
(:data:`DTYPE_PREFIX`), so one expert of a stacked ``[E, out, in]`` tensor is one contiguous
byte range and one row is ``row_bytes`` contiguous bytes.

Block layouts (ggml ``ggml-common.h``; all multi-byte fields little-endian, ``d``/``m``/``dmin``
float16; ``QK_K`` = 256):

* ``Q4_0`` (32 weights, 18 bytes): ``d``, ``qs[16]``; weight ``j`` is ``d * ((qs[j] & 15) - 8)``,
  weight ``j + 16`` is ``d * ((qs[j] >> 4) - 8)``.
* ``Q4_1`` (32, 20): ``d``, ``m``, ``qs[16]``; ``d * q + m`` with ``q`` as in Q4_0 without the 8.
* ``Q5_0`` (32, 22): ``d``, ``qh[4]``, ``qs[16]``; bit ``j`` of the 32-bit ``qh`` is bit 4 of weight
  ``j``; ``d * (q - 16)``.
* ``Q5_1`` (32, 24): ``d``, ``m``, ``qh[4]``, ``qs[16]``; ``d * q + m``.
* ``Q8_0`` (32, 34): ``d``, ``qs[32]`` int8; ``d * qs[j]``.
* ``Q2_K`` (256, 84): ``scales[16]`` (low nibble scale, high nibble min of each 16 weights),
  ``qs[64]`` (2-bit codes: per 128 weights, 32 bytes read at shifts 0, 2, 4, 6), ``d``, ``dmin``;
  ``d * sc * q - dmin * mn``.
* ``Q3_K`` (256, 110): ``hmask[32]`` (bit 2 of each code, cleared meaning minus 4), ``qs[64]``
  (low 2 bits, as Q2_K), ``scales[12]`` (16 6-bit scales, offset by 32), ``d``.
* ``Q4_K`` (256, 144): ``d``, ``dmin``, ``scales[12]`` (8 6-bit scales and mins), ``qs[128]``
  (per 64 weights, 32 bytes: low nibbles the first 32, high nibbles the next); ``d * sc * q - dmin * mn``.
* ``Q5_K`` (256, 176): as Q4_K plus ``qh[32]`` before ``qs``: bit ``2 i`` / ``2 i + 1`` of ``qh[l]`` is
  bit 4 of weight ``l`` of the low / high nibble half of 64-weight chunk ``i``.
* ``Q6_K`` (256, 210): ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), ``scales[16]`` int8, ``d``;
  ``d * sc * (q - 32)``.
* ``IQ4_NL`` (32, 18): ``d``, ``qs[16]`` (nibbles as Q4_0); ``d * KVALUES[q]``, a non-linear 16-entry table.
* ``IQ4_XS`` (256, 136): ``d``, ``scales_h`` (uint16: 2 high bits per 32 weights), ``scales_l[4]`` (4 low
  bits per 32 weights), ``qs[128]`` (per 32 weights, 16 bytes: low then high nibbles);
  ``d * (scale - 32) * KVALUES[q]``.
* ``MXFP4`` (32, 17; gpt-oss GGUFs): ``e`` (e8m0 byte), ``qs[16]`` (nibbles as Q4_0: weight ``j`` the low
  nibble of ``qs[j]``, ``j + 16`` its high nibble, unlike the safetensors layout of :mod:`.mxfp4`, which
  pairs neighbours); ``2^(e - 128) * MXFP4_VALUES[q]`` (the e2m1 values doubled; ``e < 2``: a float32
  subnormal, ``e = 255``: ``2^127``, not NaN).

The codebook (``IQ1``-``IQ3``) types look 8 or 4 weights up at once in a grid (IQ2, IQ3: magnitudes,
IQ1: -1, 0, 1): the ``gguf`` package's own tables (:func:`grid`), never copied here. IQ2 and IQ3
signs come as 7-bit indices into ``ksigns`` (an 8th sign bit making the count of minus signs
even) or as sign bits, one per weight (bit ``j`` set: weight ``j`` negative).

* ``IQ2_XXS`` (256, 66): ``d``, then per 32 weights two uint32: four grid indices (bytes of the
  first; grid of 256 x 8), and of the second: four 7-bit sign indices at bits 0, 7, 14, 21 and
  a 4-bit scale ``s`` at bit 28; ``d * (0.5 + s) * 0.25 * grid * sign``.
* ``IQ2_XS`` (256, 74): ``d``, ``qs[32]`` uint16 (9-bit grid index of 512 x 8, 7-bit sign index above
  it), ``scales[8]`` (a nibble per 16 weights, low first); ``d * (0.5 + s) * 0.25 * grid * sign``.
* ``IQ2_S`` (256, 82): ``d``, ``qs[32]`` (low 8 bits of each 10-bit index into 1024 x 8), sign bits
  ``[32]``, ``qh[8]`` (the 2 high index bits, 4 per byte), ``scales[8]`` (per 16 weights); as IQ2_XS.
* ``IQ3_XXS`` (256, 98): ``d``, ``qs[64]`` (grid indices of 256 x 4), then per 32 weights a uint32 of four
  7-bit sign indices and a 4-bit scale at bit 28; ``d * (0.5 + s) * 0.5 * grid * sign``.
* ``IQ3_S`` (256, 110): ``d``, ``qs[64]`` (low 8 bits of 9-bit indices into 512 x 4), ``qh[8]`` (the 9th
  bits), sign bits ``[32]``, ``scales[4]`` (a nibble per 32 weights); ``d * (1 + 2 s) * grid * sign``.
* ``IQ1_S`` (256, 50): ``d``, ``qs[32]`` (low 8 bits of 11-bit indices into a 2048 x 8 grid of -1, 0, 1),
  ``qh[8]`` uint16 per 32 weights: 3 high index bits per 8 weights at bits 0, 3, 6, 9, a 3-bit scale
  ``s`` at bit 12, the sign of ``delta`` at bit 15; ``d * (2 s + 1) * (grid +- 0.125)``.
* ``IQ1_M`` (256, 56): ``qs[32]``, ``qh[16]`` (a nibble per 8 weights: 3 high index bits, bit 3 the sign
  of ``delta``), ``scales`` 4 uint16 (3-bit scales per 16 weights at bits 0, 3, 6, 9; their top nibbles
  together are the float16 ``d``); as IQ1_S.
* ``TQ1_0`` (256, 54): ``qs[48]``, ``qh[4]``, ``d`` last; five (``qh``: four) ternary digits per byte as a
  base-3 fraction: digit ``k`` of byte ``q`` is ``((q * 3^k mod 256) * 3) >> 8``, weight ``d * (digit - 1)``;
  digit ``k`` of ``qs[m]`` is weight ``32 k + m`` (m < 32), ``160 + 16 k + m - 32`` (32 <= m < 48), of ``qh[m]``
  weight ``240 + 4 k + m``.
* ``TQ2_0`` (256, 66): ``qs[64]`` (2-bit codes as Q2_K: per 128 weights, 32 bytes at shifts 0, 2, 4, 6),
  ``d`` last; ``d * (q - 1)``.

:func:`dequantize` is the float32 reference of every type; its float operations are those
of ggml's ``dequantize_row_*`` (and of the ``gguf`` package's ``gguf.quants``), so it gives
their bits.
"""

from __future__ import annotations

import functools

import torch

from ..checkpoint import BLOCK_DTYPE_PREFIX

DTYPE_PREFIX = BLOCK_DTYPE_PREFIX
QK_K = 256

# type -> (weights per block, bytes per block, nominal bits): the types moestream computes on
TYPES: dict[str, tuple[int, int, int]] = {
    # the legacy blocks of 32
    "Q4_0": (32, 18, 4), "Q4_1": (32, 20, 4), "Q5_0": (32, 22, 5), "Q5_1": (32, 24, 5), "Q8_0": (32, 34, 8),
    # the k-quants' super-blocks
    "Q2_K": (QK_K, 84, 2), "Q3_K": (QK_K, 110, 3), "Q4_K": (QK_K, 144, 4), "Q5_K": (QK_K, 176, 5),
    "Q6_K": (QK_K, 210, 6),
    # 4-bit codes through a table of values (KVALUES; MXFP4_VALUES)
    "IQ4_NL": (32, 18, 4), "IQ4_XS": (QK_K, 136, 4), "MXFP4": (32, 17, 4),
    # codebooks (GRID_TYPES)
    "IQ2_XXS": (QK_K, 66, 2), "IQ2_XS": (QK_K, 74, 2), "IQ2_S": (QK_K, 82, 2), "IQ3_XXS": (QK_K, 98, 3),
    "IQ3_S": (QK_K, 110, 3), "IQ1_S": (QK_K, 50, 1), "IQ1_M": (QK_K, 56, 1),
    # ternary
    "TQ1_0": (QK_K, 54, 2), "TQ2_0": (QK_K, 66, 2),
}
# the codebook types' grids (gguf.quants classes of the same names; IQ1_M shares IQ1_S's)
GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
# MXFP4's code values: the e2m1 values doubled (ggml-common.h kvalues_mxfp4), times 2^(e - 128)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# the IQ4 types' code values (ggml-common.h kvalues_iq4nl)
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml float types, read as the float dtypes of the same names
FLOAT_TYPES = ("F32", "F16", "BF16")


def dtype_name(ggml_type: str) -> str:
    """The tensor-index dtype name of a block type: ``"Q4_K"`` -> ``"GGML_Q4_K"``."""
    return DTYPE_PREFIX + ggml_type


def block_type(dtype: str) -> str | None:
    """The ggml block type of a tensor-index dtype name (``"GGML_Q4_K"`` -> ``"Q4_K"``), else None."""
    return dtype[len(DTYPE_PREFIX):] if isinstance(dtype, str) and dtype.startswith(DTYPE_PREFIX) else None


def row_bytes(ggml_type: str, n: int) -> int:
    """Bytes of one row of ``n`` weights; raises ValueError when ``n`` is not a whole number of blocks."""
    block, size, _ = TYPES[ggml_type]
    if n % block:
        raise ValueError(f"{n} weights are not a whole number of {ggml_type} blocks of {block}")
    return n // block * size


def in_features(ggml_type: str, nbytes: int) -> int | None:
    """Weights in a row of ``nbytes`` bytes, or None when ``nbytes`` is not a whole number of blocks."""
    block, size, _ = TYPES[ggml_type]
    return None if nbytes % size else nbytes // size * block


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian float16 bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] codes: the k low nibbles, then the k high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 8k] bits, bit ``i`` of byte ``j`` at ``8 j + i``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b):
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5(b, start: int):
    hi = _bits(b[:, start:start + 4])  # bit j of the 32-bit qh: bit 4 of weight j
    return _nibbles(b[:, start + 4:]) | (hi << 4)


def _q5_0(b):
    return _f16(b[:, :2]) * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b):
    return _f16(b[:, :2]) * _q5(b, 4).float() + _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


_SHIFT2 = (0, 2, 4, 6)


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit codes: [n, 64] bytes -> [n, 16, 16] (per 128 weights, 32 bytes at shifts 0, 2, 4, 6)."""
    n = qs.shape[0]
    shifts = torch.tensor(_SHIFT2, dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.view(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16)


def _q2_k(b):
    n = b.shape[0]
    sc, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).view(n, 16, 1)
    return (dl * _two_bit(qs).float() - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    # 16 6-bit scales: low nibbles from bytes 0-7 (low then high nibble halves), high 2 bits from bytes 8-11
    low = torch.cat((sc[:, :8] & 0x0F, sc[:, :8] >> 4), dim=-1)
    shifts = torch.tensor(_SHIFT2, dtype=torch.uint8, device=b.device).view(1, 4, 1)
    high = ((sc[:, 8:12].view(n, 1, 4) >> shifts) & 3).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).view(n, 16, 1)
    # hmask: bit j of byte l is bit 2 of code 32 j + l (a cleared bit means minus 4)
    hbits = ((hmask.view(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1)
    q = _two_bit(qs).to(torch.int8) - ((hbits.reshape(n, 16, 16) ^ 1) << 2).to(torch.int8)
    return (dl * q.float()).reshape(n, QK_K)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 6-bit scales and 8 6-bit mins ([n, 8] each)."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scale, mn


def _k4(b, q: torch.Tensor):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    return (dl * q.view(n, 8, 32).float() - ml).reshape(n, QK_K)


def _q4_k(b):
    n = b.shape[0]
    return _k4(b, _nibbles(b[:, 16:].reshape(n, 4, 32)))


def _q5_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)
    hi = (b[:, 16:48].view(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    return _k4(b, low | (hi << 4))


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * sc.contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _nibbles(ql.reshape(n, 2, 64)).view(n, 2, 4, 32)  # per 128 weights: 4 runs of 32 low nibbles
    shifts = torch.tensor(_SHIFT2, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).to(torch.int8) - 32
    return (dl * q.view(n, 16, 16).float()).reshape(n, QK_K)


def _kv(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.float32, device=q.device)[q.long()]


def _iq4_nl(b):
    return _f16(b[:, :2]) * _kv(_nibbles(b[:, 2:]))


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    hi = ((b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF).view(n, 1)
          >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    lo = torch.stack((b[:, 4:8] & 0x0F, b[:, 4:8] >> 4), dim=-1).reshape(n, 8).to(torch.int32)
    dl = (d * ((lo | (hi << 4)) - 32).float()).view(n, 8, 1)
    return (dl * _kv(_nibbles(b[:, 8:].reshape(n, 8, 16)))).reshape(n, QK_K)


@functools.lru_cache(maxsize=None)
def grid(ggml_type: str) -> torch.Tensor:
    """The grid of a codebook type (:data:`GRID_TYPES`), float32 [entries, 8 or 4]: the ``gguf``
    package's own table (``gguf.quants.<type>.grid``, decoded from its hex by ``init_grid``), so
    moestream holds no copy of the constants.

    Raises:
        ValueError: not a codebook type.
    """
    if ggml_type not in GRID_TYPES:
        raise ValueError(f"ggml type {ggml_type} has no grid (the codebook types: {', '.join(GRID_TYPES)})")
    from gguf import quants  # the GGUF reader's package (a dependency): only its tables are needed

    cls = getattr(quants, ggml_type)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())


@functools.lru_cache(maxsize=None)
def ksigns() -> torch.Tensor:
    """The 128 sign bytes of 7-bit sign indices (ggml's ``ksigns_iq2xs``, from the ``gguf`` package), uint8 [128]."""
    from gguf import quants

    return torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)


def _aligned(b: torch.Tensor, n: int) -> torch.Tensor:
    """``b`` contiguous with its storage offset and row strides multiples of ``n`` bytes (a wider view needs them;
    a block's field inside a row can start anywhere, and a one-row slice keeps its parent's row stride)."""
    b = b.contiguous()
    if b.storage_offset() % n == 0 and all(s % n == 0 for s in b.stride()[:-1]):
        return b
    return torch.empty(b.shape, dtype=b.dtype).copy_(b)  # fresh storage, packed strides


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4k] little-endian bytes -> [..., k] uint32 values as int64."""
    return _aligned(b, 4).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _u16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2k] little-endian bytes -> [..., k] uint16 values as int32."""
    return _aligned(b, 2).view(torch.int16).to(torch.int32) & 0xFFFF


def _sign_bits(s: torch.Tensor) -> torch.Tensor:
    """Sign bytes [...] -> float32 [..., 8]: -1 where bit j is set, else 1."""
    bits = (s.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=s.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0)


def _sign_index(aux: torch.Tensor) -> torch.Tensor:
    """uint32 (int64) [..., k] -> float32 signs [..., k, 4, 8] of the four 7-bit sign indices at bits 0, 7, 14, 21."""
    idx = (aux.unsqueeze(-1) >> torch.tensor((0, 7, 14, 21), device=aux.device)) & 127
    return _sign_bits(ksigns().to(aux.device)[idx])


def _low_high(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: low nibble of byte i at 2 i, high nibble at 2 i + 1."""
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def _mxfp4(b):
    e = b[:, :1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128), as float32 bits (e < 2: subnormal)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    vals = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    return d * vals[_nibbles(b[:, 1:]).long()]


def _grid(t: str, idx: torch.Tensor) -> torch.Tensor:
    return grid(t).to(idx.device)[idx.long()]


def _iq2_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    aux = _u32(b[:, 2:]).view(n, 8, 2)
    db = (d * (0.5 + (aux[..., 1] >> 28).float()) * 0.25).view(n, 8, 1, 1)
    g = _grid("IQ2_XXS", b[:, 2:].reshape(n, 8, 8)[:, :, :4])  # the first uint32's bytes: 4 indices
    return (db * g * _sign_index(aux[..., 1])).reshape(n, QK_K)


def _iq2_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _u16(b[:, 2:66])
    db = (d * (0.5 + _low_high(b[:, 66:74]).float()) * 0.25).view(n, 16, 1, 1)
    signs = _sign_bits(ksigns().to(b.device)[(qs >> 9).long()]).view(n, 16, 2, 8)
    g = _grid("IQ2_XS", qs & 511).view(n, 16, 2, 8)
    return (db * g * signs).reshape(n, QK_K)


def _iq2_s(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    db = (d * (0.5 + _low_high(b[:, 74:82]).float()) * 0.25).view(n, 16, 1, 1)
    signs = _sign_bits(b[:, 34:66]).view(n, 16, 2, 8)
    high = ((b[:, 66:74].unsqueeze(-1) >> torch.tensor(_SHIFT2, dtype=torch.uint8, device=b.device)) & 3)
    idx = b[:, 2:34].to(torch.int32) | (high.reshape(n, 32).to(torch.int32) << 8)
    return (db * _grid("IQ2_S", idx).view(n, 16, 2, 8) * signs).reshape(n, QK_K)


def _iq3_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    aux = _u32(b[:, 66:98])
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    g = _grid("IQ3_XXS", b[:, 2:66]).view(n, 8, 4, 8)
    return (db * g * _sign_index(aux)).reshape(n, QK_K)


def _iq3_s(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    db = (d * (1 + 2 * _low_high(b[:, 106:110])).float()).view(n, 8, 1, 1)
    signs = _sign_bits(b[:, 74:106]).view(n, 8, 4, 8)
    idx = b[:, 2:66].to(torch.int32) | (_bits(b[:, 66:74]).to(torch.int32) << 8)
    return (db * _grid("IQ3_S", idx).view(n, 8, 4, 8) * signs).reshape(n, QK_K)


def _iq1(g: torch.Tensor, dl: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    delta = torch.where(neg, -0.125, 0.125)
    return dl * (g + delta)


def _iq1_s(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qh = _u16(b[:, 34:50])
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    high = (qh.unsqueeze(-1) >> torch.tensor((0, 3, 6, 9), dtype=torch.int32, device=b.device)) & 7
    idx = b[:, 2:34].to(torch.int32) | (high.reshape(n, 32) << 8)
    g = _grid("IQ1_S", idx).view(n, 8, 4, 8)
    return _iq1(g, dl, (qh & 0x8000).view(n, 8, 1, 1) != 0).reshape(n, QK_K)


def _iq1_m(b):
    n = b.shape[0]
    sc = _u16(b[:, 48:56])
    # the float16 d: the top nibbles of the four scale words, lowest first
    dbits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = _f16(torch.stack((dbits & 0xFF, dbits >> 8), dim=-1).to(torch.uint8))
    s3 = (sc.unsqueeze(-1) >> torch.tensor((0, 3, 6, 9), dtype=torch.int32, device=b.device)) & 7
    dl = (d * (2 * s3.reshape(n, 16) + 1).float()).view(n, 8, 2, 1, 1)
    q4 = _low_high(b[:, 32:48]).to(torch.int32)  # a nibble per 8 weights
    idx = b[:, :32].to(torch.int32) | ((q4 & 7) << 8)
    g = _grid("IQ1_M", idx).view(n, 8, 2, 2, 8)
    return _iq1(g, dl, (q4 & 8).view(n, 8, 2, 2, 1) != 0).reshape(n, QK_K)


def _trits(q: torch.Tensor, digits: int) -> torch.Tensor:
    """[n, k] bytes -> [n, digits * k] base-3 digits (0..2), digit-major, as int32."""
    pow3 = torch.tensor((1, 3, 9, 27, 81)[:digits], dtype=torch.uint8, device=q.device).view(1, digits, 1)
    shifted = q.unsqueeze(1) * pow3  # uint8: mod 256, as ggml's uint8_t product
    return ((shifted.to(torch.int32) * 3) >> 8).reshape(q.shape[0], -1)


def _tq1_0(b):
    d = _f16(b[:, 52:54])
    q = torch.cat((_trits(b[:, :32], 5), _trits(b[:, 32:48], 5), _trits(b[:, 48:52], 4)), dim=-1)
    return d * (q - 1).float()


def _tq2_0(b):
    n = b.shape[0]
    d = _f16(b[:, 64:66])
    return d * (_two_bit(b[:, :64]).reshape(n, QK_K).to(torch.int32) - 1).float()


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl,
            "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s,
            "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "TQ1_0": _tq1_0, "TQ2_0": _tq2_0}


def dequantize(raw: torch.Tensor, ggml_type: str, n: int) -> torch.Tensor:
    """The float32 weight [..., n] of ``raw`` [..., n / block * type_size] (uint8) stored as ``ggml_type``.

    Raises:
        ValueError: a type this module does not read, or bytes that are not whole blocks of ``n`` weights.
    """
    if ggml_type not in _DEQUANT:
        raise ValueError(f"ggml type {ggml_type} is not supported (moestream reads {', '.join(TYPES)})")
    block, size, _ = TYPES[ggml_type]
    lead = raw.shape[:-1]
    if raw.shape[-1] != row_bytes(ggml_type, n):
        raise ValueError(f"{ggml_type}: a row of {n} weights takes {row_bytes(ggml_type, n)} bytes, "
                         f"got {raw.shape[-1]}")
    blocks = raw.contiguous().view(torch.uint8).reshape(-1, size)
    return _DEQUANT[ggml_type](blocks).reshape(*lead, n)
