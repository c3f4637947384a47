"""OLMoE (OLMoE-1B-7B): ``model_type: olmoe``.

Reference: transformers ``models/olmoe/modeling_olmoe.py``. Pre-norm decoder layers of
grouped-query attention whose q and k are RMS-normalized over the whole projection
(not per head) before rotary, optionally clamped to ``clip_qkv``, and a sparse MoE
block: softmax router, top-k, renormalized only when ``norm_topk_prob`` (false by
default), SwiGLU experts (per expert on disk, as transformers 5 ``save_pretrained`` writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .layers import RMSNorm, rope_scaling_type, rope_theta
from .moe import StreamedMoE, softmax_topk
from .variants import DecoderLayer, VariantAttention

MODEL_TYPES = ("olmoe",)


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields OLMoE uses (names as Hugging Face spells them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    clip_qkv: float | None
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        heads, hidden = positive(cfg, "num_attention_heads"), positive(cfg, "hidden_size")
        experts, top_k = positive(cfg, "num_experts"), positive(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
        if hidden % heads or field(cfg, "head_dim", int, hidden // heads) != hidden // heads:
            raise ConfigError(f"head_dim must be hidden_size / num_attention_heads ({hidden} / {heads}) for olmoe")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for olmoe (its experts use silu)")
        rope_type = rope_scaling_type(cfg)
        if rope_type != "default":
            raise ConfigError(f"rope type {rope_type!r} is not supported for olmoe (only default)")
        clip = field(cfg, "clip_qkv", float, None)
        if clip is not None and clip <= 0:
            raise ConfigError(f"field 'clip_qkv' = {clip} must be above 0 or null")
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            intermediate_size=positive(cfg, "intermediate_size"),
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=field(cfg, "norm_topk_prob", bool, False),
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-5),
            rope_theta=rope_theta(cfg),
            attention_bias=field(cfg, "attention_bias", bool, False),
            clip_qkv=clip,
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )


class Model(CausalLM):
    """OLMoE causal LM with streamed experts."""

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        for i in range(a.num_hidden_layers):
            attn = VariantAttention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, bias=a.attention_bias,
                qk_norm="full", norm_eps=a.rms_norm_eps, clip_qkv=a.clip_qkv,
            )
            router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
            moe = StreamedMoE(a.hidden_size, a.num_experts, i, router, renormalize=a.norm_topk_prob)
            self.decoder.layers.append(DecoderLayer(
                RMSNorm(a.hidden_size, a.rms_norm_eps), attn, RMSNorm(a.hidden_size, a.rms_norm_eps), moe,
            ))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.intermediate_size, self.args.hidden_size


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    return dict(cfg, num_hidden_layers=layers)


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of an OLMoE checkpoint of ``cfg``'s shapes, experts per expert as on the Hub."""
    a = ModelArgs.from_config(cfg)
    h, inter, kv = a.hidden_size, a.intermediate_size, a.num_key_value_heads * a.head_dim
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (h, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, h), "out"),
            SynthTensor(p + "self_attn.q_norm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.k_norm.weight", (kv,), "norm"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "mlp.gate.weight", (a.num_experts, h), "normal"),
        ]
        if a.attention_bias:
            out += [SynthTensor(p + f"self_attn.{n}_proj.bias", (d,), "zeros")
                    for n, d in (("q", h), ("k", kv), ("v", kv), ("o", h))]
        for e in range(a.num_experts):
            x = f"{p}mlp.experts.{e}."
            out += [
                SynthTensor(x + "gate_proj.weight", (inter, h), "normal"),
                SynthTensor(x + "up_proj.weight", (inter, h), "normal"),
                SynthTensor(x + "down_proj.weight", (h, inter), "out"),
            ]
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
