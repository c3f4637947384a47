"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): ``model_type: mixtral``.

Reference: transformers ``models/mixtral/modeling_mixtral.py``. Pre-norm decoder layers of
grouped-query attention (rotary, no biases, a sliding window over every layer when
``sliding_window`` is set) and a sparse MoE block ``block_sparse_moe``: softmax router in
float32, top-k, always renormalized, SwiGLU experts stored per expert as ``w1`` (gate),
``w3`` (up) and ``w2`` (down), which is also what transformers 5 ``save_pretrained`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .layers import Attention, RMSNorm, rope_scaling_type, rope_theta
from .moe import StreamedMoE, softmax_topk
from .variants import DecoderLayer, optional_positive

MODEL_TYPES = ("mixtral",)


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields Mixtral uses (names as Hugging Face spells them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        heads, hidden = positive(cfg, "num_attention_heads"), positive(cfg, "hidden_size")
        experts, top_k = positive(cfg, "num_local_experts"), positive(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts {experts}")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for mixtral (its experts use silu)")
        rope_type = rope_scaling_type(cfg)
        if rope_type != "default":
            raise ConfigError(f"rope type {rope_type!r} is not supported for mixtral (only default)")
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            head_dim=field(cfg, "head_dim", int, None) or hidden // heads,
            intermediate_size=positive(cfg, "intermediate_size"),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-5),
            rope_theta=rope_theta(cfg),
            sliding_window=optional_positive(cfg, "sliding_window"),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )


def mixtral_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing, as transformers' ``MixtralTopKRouter``: softmax in float32, top-k, renormalized.

    Returns ``(weights [T, K] float32, indices [T, K] int64)``; the weights stay float32
    as in the reference (the expert output is scaled in float32, then cast).
    """
    return softmax_topk(logits.float(), top_k, True)


class Model(CausalLM):
    """Mixtral causal LM with streamed experts."""

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        for i in range(a.num_hidden_layers):
            attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             window=a.sliding_window)
            router = partial(mixtral_route, top_k=a.num_experts_per_tok)
            moe = StreamedMoE(a.hidden_size, a.num_local_experts, i, router, renormalize=True)
            self.decoder.layers.append(DecoderLayer(
                RMSNorm(a.hidden_size, a.rms_norm_eps), attn, RMSNorm(a.hidden_size, a.rms_norm_eps), moe,
                mlp_name="block_sparse_moe",
            ))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.intermediate_size, self.args.hidden_size


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    return dict(cfg, num_hidden_layers=layers)


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a Mixtral checkpoint of ``cfg``'s shapes, experts as on the Hub (w1, w3, w2)."""
    a = ModelArgs.from_config(cfg)
    h, hd, inter = a.hidden_size, a.head_dim, a.intermediate_size
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (a.num_attention_heads * hd, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (a.num_key_value_heads * hd, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (a.num_key_value_heads * hd, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, a.num_attention_heads * hd), "out"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "block_sparse_moe.gate.weight", (a.num_local_experts, h), "normal"),
        ]
        for e in range(a.num_local_experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            out += [
                SynthTensor(x + "w1.weight", (inter, h), "normal"),
                SynthTensor(x + "w3.weight", (inter, h), "normal"),
                SynthTensor(x + "w2.weight", (h, inter), "out"),
            ]
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
