"""Linear layers for bf16 on CPUs without native bf16 arithmetic.

On a CPU without AVX512-BF16 or AMX (an AVX2 machine, say), PyTorch's bf16 matmul handles
a ``[T, in]`` input one row at a time: a 512-token prefill through a ``[768, 2048]`` expert
took 84 ms in bf16 against 14 ms upcast to float32 and rounded back, while a single decode
row took 0.20 ms in bf16 against 1.5 ms upcast (the weight's conversion dominates)
(``docs/benchmarks.md``, "bf16 matmuls on an AVX2 CPU"). So from :data:`UPCAST_ROWS` rows
on, :func:`linear` computes in float32 and rounds the result to bf16 once.

Which path runs depends only on the input's shape and the machine, never on where an
expert came from, so every cache budget still gives the same bits; the two paths' bits
differ from each other (float32 accumulation, one rounding), as any change of matmul shape
already does in bf16.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

UPCAST_ROWS = 8
"""Rows (tokens) from which a bf16 matmul on a CPU without native bf16 runs in float32.

Measured on the development machine (AVX2): 4 rows 0.69 ms bf16 / 1.25 ms upcast, 8 rows
1.64 / 1.31 ms, 32 rows 5.5 / 2.0 ms, for ``[T, 2048] x [2048, 768]``."""


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


UPCAST = not native_bf16()
"""Whether :func:`linear` upcasts wide bf16 matmuls on the CPU (decided once, from the hardware)."""

CHUNK_ELEMENTS = 4 * 1024 * 1024
"""Weight elements upcast at a time (16 MB of float32 scratch per computing thread).

A weight is upcast into a reused buffer, ``CHUNK_ELEMENTS`` at a time (whole output rows):
converting into fresh memory cost 2.0 ms per ``[768, 2048]`` expert matrix against 0.48 ms
into a reused one, the rest being page faults."""

_scratch = threading.local()


def _buffer(n: int) -> torch.Tensor:
    """This thread's float32 scratch of at least ``n`` elements (kept for reuse)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: written in place both in and out of inference mode
            buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32 over ``weight`` upcast a chunk of output rows at a time; [..., out] bf16.

    The chunks split the output features only (each output is one dot product over all of
    ``in``), and their boundaries depend only on the weight's shape.
    """
    out_f, in_f = weight.shape
    rows = max(1, CHUNK_ELEMENTS // in_f)
    xf = x.float()
    parts = []
    for a in range(0, out_f, rows):
        b = min(out_f, a + rows)
        w = _buffer((b - a) * in_f).view(b - a, in_f).copy_(weight[a:b])
        parts.append(F.linear(xf, w, None if bias is None else bias[a:b].float()))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.to(torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` [..., in] times ``weight`` [out, in] (+ ``bias`` [out]).

    For a bf16 ``x`` on a CPU without native bf16 (:data:`UPCAST`) and at least
    :data:`UPCAST_ROWS` rows, computed in float32 (input, weight and bias upcast, the
    weight through a reused per-thread buffer, :data:`CHUNK_ELEMENTS` at a time) and rounded
    to bf16 once. Returns [..., out] in ``x``'s dtype.
    """
    if (
        UPCAST
        and x.dtype is torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() >= 2
        and x.numel() >= UPCAST_ROWS * x.shape[-1]
        and weight.dtype is torch.bfloat16
    ):
        return _upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters and state dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_fast_linear(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`Linear` in place; returns how many.

    Subclasses (quantized layers, float32 routers) keep their own forward.
    """
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
            n += 1
    return n
