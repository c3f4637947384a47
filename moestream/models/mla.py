"""Multi-head Latent Attention (MLA) with a KV cache of the compressed latent.

MLA (DeepSeek-V2, arXiv 2405.04434) projects each token's hidden state to a small
latent ``c_kv`` [kv_lora_rank] (``kv_a_proj_with_mqa``, then RMSNorm ``kv_a_layernorm``)
plus one rope key ``k_rot`` [qk_rope_head_dim] shared by every head; the per-head keys
``k_nope`` [qk_nope_head_dim] and values [v_head_dim] are ``kv_b_proj(c_kv)``. Queries
come from ``q_proj``, or from the low-rank ``q_a_proj -> q_a_layernorm -> q_b_proj`` when
``q_lora_rank`` is set, and split into ``q_nope`` and ``q_rot``.

Here the KV cache holds only ``c_kv`` and the rotated ``k_rot`` per token and layer:
``(kv_lora_rank + qk_rope_head_dim) * itemsize`` bytes (DeepSeek-V3 / Kimi-K2 in bf16:
(512 + 64) x 2 = 1152 bytes per token per layer, 70,272 over 61 layers; the expanded
keys and values would take 128 x (192 + 128) x 2 = 81,920 per layer). Attention is
computed in the absorbed form of DeepSeek's own inference code (``attn_impl="absorb"``):
``q_nope`` is multiplied by ``kv_b_proj``'s key rows so the scores are taken against the
latent directly, and the softmax-weighted latent is multiplied by ``kv_b_proj``'s value
rows, so the cache is never expanded. This is the same function as transformers'
``DeepseekV3Attention`` (which expands ``kv_b_proj(c_kv)`` and applies softmax in
float32), reassociated: equal up to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..quant import native
from . import ops
from .layers import KVCache, RMSNorm, attention_mask
from .rope import apply_rotary, apply_rotary_interleaved

ROPE_STYLES = ("interleaved", "half", None)
SCORE_ELEMENTS = 1 << 24  # attention scores held at once per layer (float32: 64 MiB)


class MLAttention(nn.Module):
    """Multi-head Latent Attention with a latent KV cache (DeepSeek V2/V3, Kimi K2, Kimi-Linear's MLA layers).

    Parameter names are transformers' (``DeepseekV3Attention``): ``q_proj`` or
    ``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``.

    Args:
        hidden: model width H; heads: attention heads.
        kv_lora_rank: latent width; qk_nope_head_dim / qk_rope_head_dim / v_head_dim: per-head
            dims of the unrotated key part, the rotated part (shared across heads) and the value.
        q_lora_rank: rank of the low-rank query projection, None for a plain ``q_proj``.
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``).
        scale: softmax scale; default ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5`` (see
            :func:`~moestream.models.rope.mla_softmax_scale` for YaRN's correction).
        rope: ``"interleaved"`` (DeepSeek checkpoints: rotary dims in pairs), ``"half"``
            (transformers' rotate-half layout), or None for no rotation (the rope dims
            are still part of the key, as in Kimi-Linear).
        norm_eps: eps of ``q_a_layernorm`` and ``kv_a_layernorm`` (transformers: 1e-6).
        output_gate: multiply the attention output by ``sigmoid(g_proj x)`` (``g_proj``
            [heads * v_head_dim, H]) before ``o_proj``: Kimi K3's ``mla_use_output_gate``.

    Raises:
        ConfigError: a non-positive dimension or an unknown rope style.
    """

    def __init__(
        self, hidden: int, heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
        v_head_dim: int, q_lora_rank: int | None = None, bias: bool = False, scale: float | None = None,
        rope: str | None = "interleaved", norm_eps: float = 1e-6, output_gate: bool = False,
    ):
        super().__init__()
        if rope not in ROPE_STYLES:
            raise ConfigError(f"MLA rope style {rope!r}: expected one of {ROPE_STYLES}")
        for name, v in (("kv_lora_rank", kv_lora_rank), ("v_head_dim", v_head_dim), ("num_attention_heads", heads)):
            if v < 1:
                raise ConfigError(f"field {name!r} = {v} must be at least 1")
        if qk_nope_head_dim < 0 or qk_rope_head_dim < 0 or qk_nope_head_dim + qk_rope_head_dim < 1:
            raise ConfigError(f"qk_nope_head_dim {qk_nope_head_dim}, qk_rope_head_dim {qk_rope_head_dim}: invalid")
        self.heads, self.rank, self.rope = heads, kv_lora_rank, rope
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * qk, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), bias=False)
        if output_gate:  # declared before o_proj, the checkpoint's order
            self.g_proj = nn.Linear(hidden, heads * v_head_dim, bias=False)
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=bias)
        self.output_gate = output_gate
        self.scale = qk**-0.5 if scale is None else scale

    def _attend(self, q_nope, q_rot, w, latents, k_rots, mask, dtype) -> torch.Tensor:
        """Absorbed attention of a block of heads: q_nope [h, T, nope], q_rot [h, T, rope], w [h, nope+v, rank]
        (``kv_b_proj`` rows), latents [S, rank], k_rots [S, rope], mask [T, S] or None -> [h, T, v]."""
        # q_nope . (W_uk c) = (q_nope W_uk) . c: scores are taken against the latent itself
        scores = torch.matmul(torch.matmul(q_nope, w[:, : self.nope]), latents.T)  # [h, T, S]
        if self.rope_dim:
            scores = scores + torch.matmul(q_rot, k_rots.T)
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        return torch.matmul(torch.matmul(probs, latents), w[:, self.nope :].transpose(1, 2))

    def cache_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token takes in this layer: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``."""
        return (self.rank + self.rope_dim) * itemsize

    def key_mask(
        self, x: torch.Tensor, q_resid: torch.Tensor | None, cos, sin, kv: KVCache, layer: int, start: int,
        causal: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The keys each query attends: boolean [T, start+T] (True = attend), or None for all.

        Here the causal mask; a subclass may narrow it (DeepSeek-V3.2's sparse attention
        indexer). ``q_resid`` is ``q_a_layernorm(q_a_proj(x))`` [T, q_lora_rank] (None without
        ``q_lora_rank``).
        """
        return causal

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, kv: KVCache, layer: int, start: int
    ) -> torch.Tensor:
        """x [T, H] at positions ``start..start+T`` -> [T, H].

        ``cos``/``sin`` [T, qk_rope_head_dim] (ignored when the layer has no rope).
        Appends this chunk's latent [1, T, kv_lora_rank] and rotated key
        [1, T, qk_rope_head_dim] to ``kv`` at ``layer`` (as its k and v).
        """
        t = x.shape[0]
        q_resid = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
        q = q.view(t, self.heads, self.nope + self.rope_dim).transpose(0, 1)  # [heads, T, qk]
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.rope is not None and self.rope_dim:
            rotate = apply_rotary_interleaved if self.rope == "interleaved" else apply_rotary
            q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[None], cos, sin)[0]
        latents, k_rots = kv.update(layer, start, latent[None], k_rot[None].contiguous())
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        if x.device.type == "cpu" and native.selected() != "torch" and not hasattr(self.kv_b_proj, "dense_weight"):
            out = self._attend_cpu(q_nope, q_rot, w, latents, k_rots, x, q_resid, cos, sin, kv, layer, start)
        else:
            out = self._attend_torch(q_nope, q_rot, w, latents[0], k_rots[0], x, q_resid, cos, sin, kv, layer, start)
        if self.output_gate:
            out = out * ops.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _attend_cpu(self, q_nope, q_rot, w, latents, k_rots, x, q_resid, cos, sin, kv, layer, start) -> torch.Tensor:
        """The absorbed attention on the compiled kernels: per head ``q_nope W_uk`` (a linear over the stored
        ``kv_b_proj`` rows), attention over [latent, rotary key] with the latent as the value, then ``W_uv``;
        [T, heads * v]."""
        t = x.shape[0]
        q_abs = torch.stack([ops.matmul_t(q_nope[h], w[h, : self.nope]) for h in range(self.heads)])  # [h, T, rank]
        q = torch.cat([q_abs, q_rot], dim=-1) if self.rope_dim else q_abs
        # the keys a query may see besides causality (the kernel applies causality itself): None for all
        mask = self.key_mask(x, q_resid, cos, sin, kv, layer, start, attention_mask(start, t, None, x.device))
        att = ops.attend(q, latents, latents, start, self.scale, mask=mask,
                         keys2=k_rots if self.rope_dim else None)  # [h, T, rank] in q's dtype
        out = torch.stack([ops.linear(att[h], w[h, self.nope :]) for h in range(self.heads)])  # [h, T, v]
        return out.transpose(0, 1).reshape(t, self.heads * self.v_dim)

    def _attend_torch(self, q_nope, q_rot, w, latents, k_rots, x, q_resid, cos, sin, kv, layer, start
                      ) -> torch.Tensor:
        """The absorbed attention in PyTorch (off the CPU kernels); [T, heads * v]."""
        t = x.shape[0]
        mask = self.key_mask(x, q_resid, cos, sin, kv, layer, start, attention_mask(start, t, None, x.device))
        # heads in blocks, so the [heads, T, S] scores stay under SCORE_ELEMENTS (long prefill chunks)
        step = max(1, SCORE_ELEMENTS // max(1, t * latents.shape[0]))
        out = torch.cat([self._attend(q_nope[h : h + step], q_rot[h : h + step], w[h : h + step], latents, k_rots,
                                      mask, x.dtype) for h in range(0, self.heads, step)])
        return out.transpose(0, 1).reshape(t, self.heads * self.v_dim)
