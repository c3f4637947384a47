"""The attention variant the OLMoE, gpt-oss, Laguna, MiniMax-M2 and HunYuan families need beyond
``layers.py``: :class:`VariantAttention`, grouped-query attention with the options these
families switch on: q/k RMSNorm per head (Laguna) or over the whole projection (OLMoE),
``clip_qkv`` (OLMoE), attention sinks (gpt-oss), a softplus output gate (Laguna), partial
rotary, sliding window, biases. Activations are ``[T, hidden]`` for one sequence, as in
``layers.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .layers import AttentionProjections, KVCache, RMSNorm
from .rope import apply_rotary


class VariantAttention(AttentionProjections):
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

    synth_params_after = "o_proj"  # the checkpoint lists the sinks after the projections

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False, window: int | None = None,
        qk_norm: str | None = None, norm_eps: float = 1e-6, clip_qkv: float | None = None, sinks: bool = False,
        gate: str | None = None, norm_after_rope: bool = False, norm_names: tuple[str, str] = ("q_norm", "k_norm"),
    ):
        super().__init__(hidden, heads, kv_heads, head_dim, bias, window, heads_name="attention heads")
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

    @classmethod
    def of(cls, a, **options) -> VariantAttention:
        """The attention of config ``a`` (a :class:`~moestream.models.base.DecoderArgs`: its widths, heads and
        norm eps) with ``options`` (the keyword arguments above)."""
        return cls(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, norm_eps=a.rms_norm_eps,
                   **options)

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
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.qk_norm == "head" and self.norm_after_rope:  # HunYuan normalizes the rotated q and k
            q, k = q_norm(q), k_norm(k)
        out = kv.attend(layer, start, q, k, v, self.scale, self.window, self.sinks)
        out = out.transpose(0, 1).reshape(t, self.heads * self.head_dim)
        if self.gate is not None:
            g = ops.softplus(self.g_proj(x).float()).to(out.dtype)
            if self.gate == "per-head":
                out = (out.view(t, self.heads, self.head_dim) * g[..., None]).view(t, -1)
            else:
                out = out * g
        return self.o_proj(out)
