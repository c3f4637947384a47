"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): ``model_type: qwen3_moe``.

Reference: transformers ``models/qwen3_moe/modeling_qwen3_moe.py``. Pre-norm decoder
layers of grouped-query attention (per-head RMSNorm on q and k, rotary embeddings) and
a sparse MoE block: softmax router, top-k experts (renormalized when
``norm_topk_prob``), SwiGLU experts. Layers listed in ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid use a dense SwiGLU MLP instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .layers import MLP, Attention, KVCache, RMSNorm, rope_scaling_type, rope_theta
from .moe import StreamedMoE, softmax_topk

MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields Qwen3-MoE uses (names as Hugging Face spells them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    sliding_window: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        heads = positive(cfg, "num_attention_heads")
        hidden = positive(cfg, "hidden_size")
        # transformers 5 writes num_local_experts; published configs say num_experts
        experts = field(cfg, "num_experts", int, None)
        if experts is None:
            experts = positive(cfg, "num_local_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        if experts < 1 or top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for qwen3_moe (its experts use silu)")
        rope_type = rope_scaling_type(cfg)
        if rope_type != "default":
            raise ConfigError(f"rope type {rope_type!r} is not supported for qwen3_moe yet (only default)")
        window = None
        if field(cfg, "use_sliding_window", bool, False):
            window = positive(cfg, "sliding_window")
        only = field(cfg, "mlp_only_layers", list, [])
        if not all(isinstance(i, int) for i in only):
            raise ConfigError(f"mlp_only_layers {only!r} is not a list of layer indices")
        head_dim = field(cfg, "head_dim", int, None) or hidden // heads
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate_size=positive(cfg, "intermediate_size"),
            moe_intermediate_size=positive(cfg, "moe_intermediate_size"),
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=field(cfg, "norm_topk_prob", bool, False),
            decoder_sparse_step=positive(cfg, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(only),
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta(cfg),
            attention_bias=field(cfg, "attention_bias", bool, False),
            sliding_window=window,
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(
            a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
            bias=a.attention_bias, qk_norm_eps=a.rms_norm_eps, window=a.sliding_window,
        )
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.is_moe_layer(i):
            router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
            self.mlp = StreamedMoE(a.hidden_size, a.num_experts, i, router, renormalize=a.norm_topk_prob)
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, i, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    """Qwen3-MoE causal LM with streamed experts."""

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        self.decoder.layers.extend(DecoderLayer(a, i) for i in range(a.num_hidden_layers))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.moe_intermediate_size, self.args.hidden_size


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    out = dict(cfg)
    out["num_hidden_layers"] = layers
    if "max_window_layers" in out:
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    out["mlp_only_layers"] = [i for i in cfg.get("mlp_only_layers", []) if i < layers]
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a Qwen3-MoE checkpoint of ``cfg``'s shapes, with per-expert experts as on the Hub."""
    a = ModelArgs.from_config(cfg)
    h, hd = a.hidden_size, a.head_dim
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (a.num_attention_heads * hd, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (a.num_key_value_heads * hd, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (a.num_key_value_heads * hd, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, a.num_attention_heads * hd), "out"),
            SynthTensor(p + "self_attn.q_norm.weight", (hd,), "norm"),
            SynthTensor(p + "self_attn.k_norm.weight", (hd,), "norm"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
        if a.attention_bias:
            for proj, n in (("q", a.num_attention_heads), ("k", a.num_key_value_heads), ("v", a.num_key_value_heads)):
                out.append(SynthTensor(p + f"self_attn.{proj}_proj.bias", (n * hd,), "zeros"))
            out.append(SynthTensor(p + "self_attn.o_proj.bias", (h,), "zeros"))
        if a.is_moe_layer(i):
            m, inter = p + "mlp.", a.moe_intermediate_size
            out.append(SynthTensor(m + "gate.weight", (a.num_experts, h), "normal"))
            for e in range(a.num_experts):
                x = f"{m}experts.{e}."
                out += [
                    SynthTensor(x + "gate_proj.weight", (inter, h), "normal"),
                    SynthTensor(x + "up_proj.weight", (inter, h), "normal"),
                    SynthTensor(x + "down_proj.weight", (h, inter), "out"),
                ]
        else:
            m, inter = p + "mlp.", a.intermediate_size
            out += [
                SynthTensor(m + "gate_proj.weight", (inter, h), "normal"),
                SynthTensor(m + "up_proj.weight", (inter, h), "normal"),
                SynthTensor(m + "down_proj.weight", (h, inter), "out"),
            ]
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out

