"""Layer variants the Mixtral, OLMoE, gpt-oss and Laguna families need beyond ``layers.py``.

* :func:`yarn_inv_freq` and :class:`Rope`: rotary embeddings with YaRN scaling (Peng et al.
  2023), an attention scaling of cos/sin, and partial rotary (only the first dimensions of
  each head rotate), as transformers' ``modeling_rope_utils``.
* :class:`PerTypeRope`: one rotary embedding per layer type (Laguna's ``rope_parameters``
  keyed by ``full_attention`` / ``sliding_attention``).
* :class:`VariantAttention`: grouped-query attention with the options these families
  switch on: q/k RMSNorm per head (Laguna) or over the whole projection (OLMoE),
  ``clip_qkv`` (OLMoE), attention sinks (gpt-oss), a softplus output gate (Laguna),
  partial rotary, sliding window, biases.
* :class:`DecoderLayer`: the pre-norm decoder layer all four share.

Activations are ``[T, hidden]`` for one sequence, as in ``layers.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .base import field
from .layers import KVCache, RMSNorm, attention_mask, rotate_half


def optional_positive(cfg: dict, name: str) -> int | None:
    """An integer field that is absent, null, or at least 1 (a sliding window, say).

    Raises:
        ConfigError: naming the field when it is not an integer or below 1.
    """
    value = field(cfg, name, int, None)
    if value is not None and value < 1:
        raise ConfigError(f"field {name!r} = {value} must be at least 1 or null")
    return value


def yarn_inv_freq(dim: int, theta: float, params: dict, truncate: bool) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [dim / 2] (float32) and the attention scaling of cos/sin.

    As transformers' ``_compute_yarn_parameters``: frequencies blend interpolation
    (divided by ``factor``) and extrapolation along a linear ramp between the correction
    dimensions of ``beta_fast`` and ``beta_slow`` rotations at
    ``original_max_position_embeddings``; the scaling is ``attention_factor``, else
    ``0.1 ln(factor) + 1`` (or the ``mscale``/``mscale_all_dim`` ratio). ``truncate``
    floors/ceils the correction range (transformers reads it as ``rope_parameters.get("truncate", True)``).

    Raises:
        ConfigError: a missing ``factor`` or ``original_max_position_embeddings``.
    """
    try:
        factor = float(params["factor"])
        original = float(params["original_max_position_embeddings"])
    except (KeyError, TypeError):
        raise ConfigError(
            "yarn rope parameters need factor and original_max_position_embeddings, found "
            f"{sorted(params)}"
        ) from None

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class Rope(nn.Module):
    """Rotary embedding over the first ``dim`` dimensions of each head, optionally YaRN-scaled.

    Args:
        dim: rotated dimensions per head (``int(head_dim * partial_rotary_factor)``).
        theta: ``rope_theta``.
        params: the rope parameters (``rope_type`` ``default`` or ``yarn``).
        truncate: YaRN's ``truncate`` (see :func:`yarn_inv_freq`).

    Raises:
        ConfigError: another ``rope_type``.
    """

    def __init__(self, dim: int, theta: float, params: dict | None = None, truncate: bool = True):
        super().__init__()
        params = params or {}
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scaling = 1.0
        elif kind == "yarn":
            inv_freq, self.scaling = yarn_inv_freq(dim, theta, params, truncate)
        else:
            raise ConfigError(f"rope type {kind!r} is not supported (default or yarn)")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, dim] in ``dtype``, for int64 ``positions`` [T] (scaled as the reference)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


class PerTypeRope(nn.Module):
    """One :class:`Rope` per layer type; returns ``({type: cos}, {type: sin})`` for the layers to pick from."""

    def __init__(self, ropes: dict[str, Rope]):
        super().__init__()
        self.ropes = nn.ModuleDict(ropes)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[dict, dict]:
        cos, sin = {}, {}
        for kind, rope in self.ropes.items():
            cos[kind], sin[kind] = rope(positions, dtype)
        return cos, sin


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [heads, T, head_dim]; the rest pass (as Laguna/GLM)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)


class VariantAttention(nn.Module):
    """Grouped-query attention with a KV cache and the options of the families in this module's docstring.

    Args:
        hidden: model width H; heads / kv_heads / head_dim: attention shape.
        bias: q/k/v/o biases. window: sliding-window length (None: full attention).
        qk_norm: ``"head"`` (RMSNorm over each head, before rotary: Qwen3, Laguna),
            ``"full"`` (RMSNorm over the whole q and k projections: OLMoE) or None.
        norm_eps: eps of those norms. clip_qkv: clamp q, k, v to [-c, c] (OLMoE), or None.
        sinks: one learned sink logit per head joins the softmax and is dropped (gpt-oss).
        gate: ``"per-head"`` or ``"per-element"``: the output is multiplied by
            softplus(g_proj(x)) before o_proj (Laguna); None for no gate.
        norm_after_rope: apply the per-head q/k norm after rotary instead of before (HunYuan).
        norm_names: the checkpoint's names of the q and k norms (HunYuan: query_layernorm, key_layernorm).

    Parameter names follow transformers (``q_proj`` ... ``o_proj``, ``q_norm``,
    ``k_norm``, ``sinks``, ``g_proj``). With sinks the softmax is computed as transformers'
    eager gpt-oss attention; otherwise by ``scaled_dot_product_attention``.
    """

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False, window: int | None = None,
        qk_norm: str | None = None, norm_eps: float = 1e-6, clip_qkv: float | None = None, sinks: bool = False,
        gate: str | None = None, norm_after_rope: bool = False, norm_names: tuple[str, str] = ("q_norm", "k_norm"),
    ):
        super().__init__()
        if heads % kv_heads:
            raise ConfigError(f"attention heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.qk_norm, self.norm_after_rope = qk_norm, norm_after_rope
        self.norm_names = norm_names
        if qk_norm == "head":
            q_norm, k_norm = RMSNorm(head_dim, norm_eps), RMSNorm(head_dim, norm_eps)
        elif qk_norm == "full":
            q_norm, k_norm = RMSNorm(heads * head_dim, norm_eps), RMSNorm(kv_heads * head_dim, norm_eps)
        elif qk_norm is not None:
            raise ValueError(f"qk_norm {qk_norm!r}")
        if qk_norm is not None:
            setattr(self, norm_names[0], q_norm)
            setattr(self, norm_names[1], k_norm)
        self.clip_qkv = clip_qkv
        self.sinks = nn.Parameter(torch.zeros(heads), requires_grad=False) if sinks else None
        self.gate = gate
        if gate is not None:
            self.g_proj = nn.Linear(hidden, heads if gate == "per-head" else heads * head_dim, bias=False)
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, layer: int, start: int
    ) -> torch.Tensor:
        """x [T, H] at positions ``start..start+T`` -> [T, H]; appends this chunk's keys/values to ``kv``."""
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm is not None:
            q_norm, k_norm = getattr(self, self.norm_names[0]), getattr(self, self.norm_names[1])
        if self.qk_norm == "full":
            q, k = q_norm(q), k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.qk_norm == "head" and not self.norm_after_rope:
            q, k = q_norm(q), k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if self.qk_norm == "head" and self.norm_after_rope:  # HunYuan normalizes the rotated q and k
            q, k = q_norm(q), k_norm(k)
        keys, values = kv.update(layer, start, k, v)
        mask = attention_mask(start, t, self.window, x.device)
        if self.sinks is None:
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=mask, scale=self.scale,
                enable_gqa=self.heads != self.kv_heads,
            )[0]
        else:
            out = self._sink_attention(q, keys, values, mask)
        out = out.transpose(0, 1).reshape(t, self.heads * self.head_dim)
        if self.gate is not None:
            g = F.softplus(self.g_proj(x).float()).to(out.dtype)
            if self.gate == "per-head":
                out = (out.view(t, self.heads, self.head_dim) * g[..., None]).view(t, -1)
            else:
                out = out * g
        return self.o_proj(out)

    def _sink_attention(self, q, keys, values, mask) -> torch.Tensor:
        """softmax([q k^T * scale, sink]) without the sink column, times v, as transformers' gpt-oss eager attention."""
        rep = self.heads // self.kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)
        logits = torch.matmul(q, keys.transpose(1, 2)) * self.scale
        if mask is not None:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        sinks = self.sinks.to(logits.dtype)[:, None, None].expand(-1, logits.shape[1], 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``.

    ``mlp_name`` is the checkpoint's name of the feed-forward block (``mlp``, or Mixtral's
    ``block_sparse_moe``); ``rope_key`` picks this layer's cos/sin when the model's rotary
    embedding returns one per layer type (:class:`PerTypeRope`).
    """

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 mlp_name: str = "mlp", rope_key: str | None = None):
        super().__init__()
        self.input_layernorm = norm1
        self.self_attn = attn
        self.post_attention_layernorm = norm2
        self.mlp_name, self.rope_key = mlp_name, rope_key
        setattr(self, mlp_name, mlp)

    def forward(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> torch.Tensor:
        if self.rope_key is not None:
            cos, sin = cos[self.rope_key], sin[self.rope_key]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, i, start)
        return h + getattr(self, self.mlp_name)(self.post_attention_layernorm(h))
