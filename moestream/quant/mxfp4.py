"""MXFP4 weights (OCP Microscaling FP4), as gpt-oss ships its experts.

Definition (OCP MX spec v1.0; transformers ``integrations/mxfp4.py``,
``convert_moe_packed_tensors``): a weight [out, in] is stored as ``<name>_blocks``
[out, in / 32, 16] uint8 and ``<name>_scales`` [out, in / 32] uint8. Each block of 32
values shares one power-of-two scale, an e8m0 exponent ``2^(scale - 127)``; each value
is a 4-bit e2m1 code, two per byte, the low nibble holding the even position:

    w[o, 32 b + 2 j]     = FP4[blocks[o, b, j] & 15] * 2^(scales[o, b] - 127)
    w[o, 32 b + 2 j + 1] = FP4[blocks[o, b, j] >> 4] * 2^(scales[o, b] - 127)

with ``FP4`` = (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6).
gpt-oss fuses gate and up as ``gate_up_proj`` [E, 2I, H] with gate and up rows
interleaved (gate the even rows, up the odd ones) and ``down_proj`` [E, H, I].
"""

from __future__ import annotations

import torch

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [..., out, in] (``dtype``) of ``blocks`` [..., out, in/32, 16] and ``scales`` [..., out, in/32].

    Exact: every e2m1 value times a power of two is representable in float32 (and in
    bf16 within its exponent range), computed in float32 then cast.
    """
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.view(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    vals = vals.flatten(-3)  # [..., G * 32]
    exp = scales.view(torch.uint8).to(torch.int32) - 127
    w = torch.ldexp(vals.view(*vals.shape[:-1], -1, BLOCK), exp.unsqueeze(-1).float())
    return w.flatten(-2).to(dtype)
