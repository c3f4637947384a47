"""The linear layer of every family: ``nn.Linear`` whose product runs on moestream's compiled kernels on
the CPU (:func:`moestream.models.ops.linear`).

PyTorch's CPU matmul is not invariant: its BLAS picks code by the operands' alignment and the number of
rows (a float32 ``x @ w.t()`` of one row gives other bits for 12 of 16 misaligned placements of the same
``w`` on an AVX2 EPYC), and its bf16 matmul on CPUs without native bf16 handles a many-row input one
row at a time (84 ms against 14 ms upcast for a 512-token ``[768, 2048]`` expert,
``docs/benchmarks.md``). The compiled kernels do neither: float32 accumulation of float32, bf16 or fp16
weights in one fixed reduction per output, and one rounding to the input's dtype.

Off the CPU (CUDA), or on the PyTorch path (``MOESTREAM_CPU_KERNELS=torch``, no compiled kernels),
:func:`linear` is ``F.linear``, except that a bf16 input of at least :data:`UPCAST_ROWS` rows on a CPU
without native bf16 is computed in float32 and rounded once (the reference path's speed fix above).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import native
from . import ops

UPCAST_ROWS = 8
"""Rows (tokens) from which a bf16 matmul on the PyTorch path on a CPU without native bf16 runs in float32.

Measured on the development machine (AVX2): 4 rows 0.69 ms bf16 / 1.25 ms upcast, 8 rows
1.64 / 1.31 ms, 32 rows 5.5 / 2.0 ms, for ``[T, 2048] x [2048, 768]``."""


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


UPCAST = not native_bf16()
"""Whether :func:`linear` upcasts wide bf16 matmuls on the PyTorch path (decided once, from the hardware)."""

CHUNK_ELEMENTS = 4 * 1024 * 1024
"""Weight elements upcast at a time on the PyTorch path (16 MB of float32 scratch per computing thread)."""

_scratch = threading.local()


def _buffer(n: int) -> torch.Tensor:
    """This thread's float32 scratch of at least ``n`` elements (kept for reuse)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: written in place both in and out of inference mode
            buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32 over ``weight`` upcast a chunk of output rows at a time; [..., out] bf16."""
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` [..., in] times ``weight`` [out, in] (+ ``bias`` [out]) -> [..., out]
    in ``x``'s dtype: the compiled kernels on the CPU (``spec``: the weight's kernel view made before),
    else ``F.linear`` (module docstring)."""
    if x.device.type == "cpu":
        y = native.float_linear(x, weight, bias, spec=spec)
        if y is not None:
            return y
        if (UPCAST and x.dtype is torch.bfloat16 and x.dim() >= 2 and x.numel() >= UPCAST_ROWS * x.shape[-1]
                and weight.dtype is torch.bfloat16):
            return _upcast_linear(x, weight, bias)
    return ops.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters and state dict names); on the CPU the
    weight's kernel view is made once and kept until the weight changes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = None
        if x.device.type == "cpu" and self.weight.device.type == "cpu":
            spec = native.spec_of(self.weight, lambda w: native.float_spec(w, self.bias))
        return linear(x, self.weight, self.bias, spec)


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
