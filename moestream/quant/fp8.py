"""FP8 (e4m3) weights with block scales, as DeepSeek-V3, Kimi K2 and Qwen3 FP8 releases ship them.

Definition (config ``quantization_config: {quant_method: "fp8", weight_block_size: [bn, bk]}``,
DeepSeek-V3's ``weight_dequant``, transformers ``integrations/finegrained_fp8.py``): a
linear's ``weight`` [out, in] is stored as ``float8_e4m3fn`` and ``weight_scale_inv``
[ceil(out / bn), ceil(in / bk)] (float32) holds one scale per block; the float weight is

    w[o, i] = float(weight[o, i]) * weight_scale_inv[o // bn, i // bk].

Per-channel and per-tensor scales (compressed-tensors ``strategy: channel`` / ``tensor``) are
the same math with one block per row (``block = (1, 0)``) or one for the whole weight
(``(0, 0)``): a 0 in ``block`` stands for the whole dimension (:func:`resolve_block`).
"""

from __future__ import annotations

import torch


def resolve_block(block: tuple[int, int], shape: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of one scale's block for a weight of ``shape`` [out, in]; 0 in ``block`` = the whole dim."""
    return block[0] or shape[0], block[1] or shape[1]


def block_scales_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` [out, in] with blocks ``block``."""
    bn, bk = resolve_block(block, shape)
    return -(-shape[0] // bn), -(-shape[1] // bk)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in] in ``dtype`` of an fp8 one and its block scales (product in float32).

    ``scale_inv``: [ceil(out / bn), ceil(in / bk)] (a per-tensor scale may be stored as [1] or []).
    """
    out, inn = weight.shape[-2:]
    block = resolve_block(block, (out, inn))
    scale_inv = scale_inv.reshape(*scale_inv.shape[:-2], *block_scales_shape((out, inn), block)) \
        if scale_inv.dim() < 2 else scale_inv
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :out, :]
    s = s.repeat_interleave(block[1], -1)[..., :inn]
    return (weight.float() * s).to(dtype)


def dequantize_rows(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], r0: int, r1: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows ``r0:r1`` of :func:`dequantize` (``r0`` a multiple of the block height)."""
    bn, bk = resolve_block(block, tuple(weight.shape[-2:]))
    if scale_inv.dim() < 2:  # one per-tensor scale
        scale_inv = scale_inv.reshape(1, 1)
    return dequantize(weight[r0:r1], scale_inv[r0 // bn : -(-r1 // bn)], (bn, bk), dtype)
