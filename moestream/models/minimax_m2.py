"""MiniMax-M2: ``model_type: minimax_m2``.

Reference: transformers ``models/minimax_m2/modeling_minimax_m2.py``. Pre-norm decoder
layers of full attention whose q and k are RMS-normalized over the whole projection,
with partial rotary embeddings (``rotary_dim`` or ``partial_rotary_factor``), and a MoE
block ``block_sparse_moe``: sigmoid routing with a correction bias for the top-k choice
and the chosen scores renormalized, kept in float32 (as Laguna's,
:func:`~moestream.models.laguna.laguna_sigmoid_topk`, without softcapping), SwiGLU
experts stored per expert as ``w1``/``w3``/``w2``, the bias as
``block_sparse_moe.e_score_correction_bias`` (what transformers 5 ``save_pretrained`` writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .laguna import laguna_sigmoid_topk
from .layers import RMSNorm
from .moe import StreamedMoE
from .variants import DecoderLayer, Rope, VariantAttention

MODEL_TYPES = ("minimax_m2",)


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields MiniMax-M2 uses (names as Hugging Face spells them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        heads, hidden = positive(cfg, "num_attention_heads"), positive(cfg, "hidden_size")
        experts = field(cfg, "num_local_experts", int, None) or positive(cfg, "num_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts {experts}")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for minimax_m2 (its experts use silu)")
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind != "default":
            raise ConfigError(f"rope type {kind!r} is not supported for minimax_m2 (only default)")
        head_dim = field(cfg, "head_dim", int, None) or hidden // heads
        factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        rotary = field(cfg, "rotary_dim", int, None)
        if factor is None:
            factor = rotary / head_dim if rotary else 1.0
        rot = int(head_dim * factor)
        if rot < 2 or rot > head_dim or rot % 2:
            raise ConfigError(f"rotary_dim {rot} must be even and between 2 and head_dim {head_dim}")
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            rotary_dim=rot,
            intermediate_size=positive(cfg, "intermediate_size"),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-6),
            rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 5000000.0))),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )


class MiniMaxM2MoE(StreamedMoE):
    """MiniMax-M2's MoE block: router ``gate``, ``e_score_correction_bias`` [E], experts streamed."""

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__(a.hidden_size, a.num_local_experts, layer, self._route, renormalize=True)
        self.top_k = a.num_experts_per_tok
        self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_local_experts), requires_grad=False)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the weights stay float32, as the reference's
        return laguna_sigmoid_topk(logits, self.e_score_correction_bias, self.top_k)


class Model(CausalLM):
    """MiniMax-M2 causal LM with streamed experts."""

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        with torch.device("cpu"):
            self.rotary = Rope(a.rotary_dim, a.rope_theta)
        for i in range(a.num_hidden_layers):
            attn = VariantAttention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                    qk_norm="full", norm_eps=a.rms_norm_eps)
            self.decoder.layers.append(DecoderLayer(
                RMSNorm(a.hidden_size, a.rms_norm_eps), attn, RMSNorm(a.hidden_size, a.rms_norm_eps),
                MiniMaxM2MoE(a, i), mlp_name="block_sparse_moe",
            ))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.intermediate_size, self.args.hidden_size


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers (float weights: no ``quantization_config``)."""
    out = dict(cfg, num_hidden_layers=layers)
    out.pop("quantization_config", None)
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a MiniMax-M2 checkpoint of ``cfg``'s shapes, experts per expert (w1, w3, w2)."""
    a = ModelArgs.from_config(cfg)
    h, inter = a.hidden_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        m = p + "block_sparse_moe."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (q, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, q), "out"),
            SynthTensor(p + "self_attn.q_norm.weight", (q,), "norm"),
            SynthTensor(p + "self_attn.k_norm.weight", (kv,), "norm"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
            SynthTensor(m + "gate.weight", (a.num_local_experts, h), "normal"),
            SynthTensor(m + "e_score_correction_bias", (a.num_local_experts,), "zeros"),
        ]
        for e in range(a.num_local_experts):
            x = f"{m}experts.{e}."
            out += [SynthTensor(x + "w1.weight", (inter, h), "normal"),
                    SynthTensor(x + "w3.weight", (inter, h), "normal"),
                    SynthTensor(x + "w2.weight", (h, inter), "out")]
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
