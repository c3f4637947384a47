"""Expert functions on quantized pieces, chosen by the pieces' format.

A family declares what one expert computes (an :class:`~moestream.pipeline.ExpertSpec`: ``swiglu``
for Qwen3-MoE, DeepSeek, Mixtral, ...). :func:`expert_fn_for` returns the function a MoE block
uses for a layer whose experts are stored in :class:`~moestream.quant.formats.ExpertFormat`:

* SwiGLU experts get :class:`QuantizedSwiGLU`: ``down(silu(gate x) * up x)`` in one call of
  the compiled CPU kernels (:func:`moestream.quant.native.swiglu`) where they cover the
  format, else every projection through :func:`~moestream.quant.kernels.qlinear` (no
  dequantized expert is held; for an interleaved ``gate_up``, gate is the even outputs,
  up the odd ones).
* Kimi K3's SiTU-GLU experts get :class:`QuantizedGLU`: the same single call with its activation.
* Any other family's expert function gets :class:`DequantizedExpert`: the expert's
  weights dequantized into the compute dtype for the call, then the float function.
  Correct for every family; a family with a non-SwiGLU expert can add its own fast form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..pipeline import ExpertFn, ExpertSpec
from . import native
from .formats import ExpertFormat, is_quant_param
from .kernels import dequantize_linear, qlinear


class QuantizedSwiGLU:
    """``down(silu(gate x) * up x)`` on quantized pieces: ``x`` [n, H] -> [n, H] in x.dtype.

    Math as :func:`moestream.models.moe.swiglu_expert` (transformers ``Qwen3MoeExperts``).
    ``w``: the expert's stored pieces (``gate``, ``gate.scales``, ... as the store hands
    them). On the CPU kernels (:func:`moestream.quant.native.swiglu`) the whole expert is
    one call with a float32 intermediate; on the PyTorch path each projection's output is
    rounded to x.dtype, as the float expert does.
    """

    def __init__(self, fmt: ExpertFormat):
        self.fmt = fmt

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        y = native.swiglu(x, w, self.fmt)
        if y is not None:
            return y
        lin = self.fmt.linears
        if self.fmt.fused_gate_up:
            gu = qlinear(x, w, lin["gate_up"])
            gate, up = gu[:, 0::2], gu[:, 1::2]
        else:
            gate, up = qlinear(x, w, lin["gate"]), qlinear(x, w, lin["up"])
        return qlinear(F.silu(gate) * up, w, lin["down"])


class QuantizedGLU:
    """A gated expert ``down(act(gate x, up x))`` with a known activation (Kimi K3's SiTU-GLU) on quantized
    pieces: one call of :func:`moestream.quant.native.expert` (float32 intermediate), else ``float_fn`` on
    the dequantized weights (:class:`DequantizedExpert`). ``x`` [n, H] -> [n, H] in x.dtype."""

    def __init__(self, fmt: ExpertFormat, float_fn, act: str, **params):
        self.fmt, self.act, self.params = fmt, act, params
        self.fallback = DequantizedExpert(fmt, float_fn)

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        y = native.expert(x, w, self.fmt, self.act, **self.params)
        return self.fallback(x, w) if y is None else y


class DequantizedExpert:
    """A family's float expert function applied to the expert's weights dequantized to x.dtype."""

    def __init__(self, fmt: ExpertFormat, float_fn):
        self.fmt, self.float_fn = fmt, float_fn

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        lin = self.fmt.linears
        # float pieces the function takes as they are (biases of a linear), not quantization parameters
        dense = {r: t for r, t in w.items() if r not in lin and not is_quant_param(r)}
        for role, lf in lin.items():
            dense[role] = dequantize_linear(w, lf, x.dtype)
        if self.fmt.fused_gate_up:
            gu = dense.pop("gate_up")
            dense["gate"], dense["up"] = gu[0::2], gu[1::2]
        return self.float_fn(x, dense)


def expert_fn_for(expert: ExpertSpec | ExpertFn, fmt: ExpertFormat | None):
    """The expert function for experts of spec ``expert`` (or a float function, by :meth:`ExpertSpec.of`) stored
    as ``fmt`` (the float function itself when None): chosen by the spec's kind."""
    spec = ExpertSpec.of(expert)
    if fmt is None:
        return spec.fn
    if spec.kind == "swiglu":
        return QuantizedSwiGLU(fmt)
    if spec.kind == "situ_glu":
        return QuantizedGLU(fmt, spec.fn, "situ", **spec.keywords)
    return DequantizedExpert(fmt, spec.fn)
