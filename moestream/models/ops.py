"""The arithmetic of a token, device by device: linears, activations, RMSNorm, attention and the gated MLP.

On the CPU each runs on moestream's compiled kernels (:mod:`moestream.quant.native`), whose bits depend
only on the values a result is made of: a linear's output row only on its input row and the weight (one
fixed reduction, whatever the number of rows in the call, the thread count or where the weight lies in
memory), attention only on the query and the keys and values of the positions it sees (never on the KV
cache's capacity or how the prompt was split into chunks), an activation only on its input. PyTorch's own
CPU kernels are not such: its BLAS picks code by the operands' alignment and the number of rows, its
scaled-dot-product attention by the shapes, and its vectorized and scalar loops give different bits for
``sigmoid``, ``silu`` and ``softplus`` of the same float32 value (``docs/reliability.md``, "Invariance").

On CUDA attention runs on moestream's Triton kernel (:mod:`moestream.attention_kernel`), with the same
independence from the cache's capacity and the queries in the call. Elsewhere, or with
``MOESTREAM_CPU_KERNELS=torch`` (the reference path) or no compiled kernels, each op is the PyTorch call
it replaces, with the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import attention_kernel, dense_kernel
from ..quant import native


def _cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` [..., in] times ``weight`` [out, in] (+ ``bias`` [out]) -> [..., out]
    in x's dtype, float32 accumulation and one rounding (the compiled kernels on the CPU). ``spec``: the
    weight's kernel view made before (:func:`moestream.quant.native.float_spec`; a resident weight's). On CUDA
    :func:`moestream.dense_kernel.linear` (a row's bits independent of the rows beside it)."""
    if _cpu(x):
        y = native.float_linear(x, weight, bias, spec=spec)
        if y is not None:
            return y
    elif x.is_cuda:
        y = dense_kernel.linear(x, weight, bias)  # cuBLAS's bits depend on the rows of the call
        if y is not None:
            return y
    return F.linear(x, weight, bias)


def matmul_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight (+ bias)`` for a weight stored input-major, [in, out] (gpt-oss's experts) -> [..., out] in
    x's dtype; on the CPU each output is one fma chain over the inputs in order."""
    if _cpu(x):
        y = native.float_linear(x, weight, bias, transposed=True)
        if y is not None:
            return y
    y = x @ weight
    return y if bias is None else y + bias


def _activation(name: str, x: torch.Tensor, reference, *args) -> torch.Tensor:
    """Activation ``name`` of ``x`` by the compiled kernel on the CPU where it has one, else ``reference(x)``."""
    if _cpu(x):
        y = native.activation(name, x, *args)
        if y is not None:
            return y
    return reference(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` (x / (1 + e^-x)), in x's dtype."""
    return _activation("silu", x, F.silu)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)``, in x's dtype."""
    return _activation("sigmoid", x, torch.sigmoid)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1; x itself above ``threshold``), in x's dtype."""
    return _activation("softplus", x, lambda t: F.softplus(t, threshold=threshold), threshold)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: str = "weight") -> torch.Tensor:
    """RMSNorm of ``x`` [..., d]: ``weight * (x r).to(x.dtype)`` (``weight``), ``(x r (1 + weight)).to(x.dtype)``
    in float32 (``one_plus``) or ``(x r).to(x.dtype)`` (``none``), ``r = rsqrt(mean(x^2) + eps)`` in float32
    (Zhang & Sennrich 2019; transformers' ``Qwen3MoeRMSNorm`` and ``Qwen3NextRMSNorm``)."""
    if _cpu(x):
        y = native.rms_norm(x, weight, eps, mode)
        if y is not None:
            return y
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "one_plus":
        return (h * (1.0 + weight.float())).to(x.dtype)
    if mode == "weight_f32":
        return (weight * h).to(x.dtype)
    if mode == "none":
        return h.to(x.dtype)
    return weight * h.to(x.dtype)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, specs=None) -> torch.Tensor:
    """The SwiGLU MLP ``down(silu(gate x) * up x)`` (Shazeer 2020) of float weights gate, up [I, H] and
    down [H, I]: x [n, H] -> [n, H] in x's dtype. On the CPU one call of the compiled expert (the
    intermediate stays float32, one rounding at the end); elsewhere three linears, each rounded to x's
    dtype as transformers' ``Qwen3MoeMLP``. ``specs``: the weights' kernel views made before, or None."""
    if _cpu(x):
        y = native.float_expert(x, gate, up, down, specs=specs)
        if y is not None:
            return y
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def attention_mask(start: int, t: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean mask [t, start+t] (True = attend) for queries at ``start..start+t``.

    Causal, and limited to the last ``window`` positions when ``window`` is set
    (a query at position i sees keys in (i - window, i], as transformers' sliding
    window mask). ``None`` when every key may be seen (one query, no window reach).
    """
    total = start + t
    if t == 1 and (window is None or total <= window):
        return None
    q = torch.arange(start, total, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None, mask: torch.Tensor | None = None,
           keys2: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of one sequence's queries over its cached keys and values.

    Args:
        q: [Hq, T, D] queries at positions ``start..start+T-1``; keys [Hkv, S, D1], values [Hkv, S, Dv] of
            positions 0..S-1 (S >= start + T); Hq a multiple of Hkv (grouped-query attention).
        keys2: [Hkv, S, D2] a second part of the keys (D = D1 + D2: MLA's latent then its rotary key), or None.
        window: each query sees only the last ``window`` positions up to its own, or None.
        sinks: [Hq] logits that join each softmax's denominator and are dropped (gpt-oss), or None.
        mask: bool [T, S] of the keys a query may see besides causality (DeepSeek-V3.2's selection), or None.

    Returns:
        [Hq, T, Dv] in q's dtype: ``softmax(q k^T * scale) v`` over the positions each query sees. On the
        CPU the compiled kernel (position order, canonical exp: bits independent of S beyond the visible
        positions and of T); on CUDA the Triton kernel of :mod:`moestream.attention_kernel` (blocks of 64
        positions in position order: the same independence); elsewhere PyTorch's scaled-dot-product
        attention.

    Raises:
        NotImplementedError: ``keys2`` or ``mask`` off the CPU kernels (those callers keep their own PyTorch
            form there).
    """
    t = q.shape[1]
    if _cpu(q):
        out = native.attention(q.transpose(0, 1), keys, values, start, scale, window, keys2, sinks, mask)
        if out is not None:
            return out.to(q.dtype).transpose(0, 1)
    elif keys2 is None and mask is None and attention_kernel.available(q.device):
        if q.stride(-1) != 1:
            q = q.contiguous()
        return attention_kernel.attention(q, keys, values, start, scale, window, sinks)
    end = start + t
    if sinks is not None and keys2 is None and mask is None:
        return _eager_sink_attention(q, keys[:, :end], values[:, :end], attention_mask(start, t, window, q.device),
                                     sinks, scale)
    if sinks is not None or keys2 is not None or mask is not None:
        raise NotImplementedError("attend: split keys and key masks are computed on the CPU kernels only; the "
                                  "caller keeps its own form elsewhere")
    return F.scaled_dot_product_attention(q[None], keys[None, :, :end], values[None, :, :end],
                                          attn_mask=attention_mask(start, t, window, q.device), scale=scale,
                                          enable_gqa=q.shape[0] != keys.shape[0])[0]


def _eager_sink_attention(q, keys, values, mask, sinks, scale) -> torch.Tensor:
    """softmax([q k^T * scale, sink]) without the sink column, times v, in q's dtype, as transformers' gpt-oss eager
    attention (the form off the CPU kernels)."""
    rep = q.shape[0] // keys.shape[0]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    sink = sinks.to(logits.dtype)[:, None, None].expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
