"""HunYuan MoE V1 (Hunyuan-A13B as transformers implements it): ``model_type: hunyuan_v1_moe``.

Reference: transformers ``models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py``. Pre-norm
decoder layers of grouped-query attention with per-head q/k RMSNorm applied after
rotary (``query_layernorm``, ``key_layernorm``), and a MoE block: router ``gate.wg`` on
float32 hidden states, softmax top-k (``moe_topk``) renormalized, SwiGLU experts plus a
shared MLP ``shared_mlp`` of the same width (``intermediate_size``), added after.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .layers import MLP, RMSNorm, rope_scaling_type, rope_theta
from .moe import StreamedMoE, softmax_topk
from .variants import DecoderLayer, VariantAttention

MODEL_TYPES = ("hunyuan_v1_moe",)


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields HunYuan MoE V1 uses (names as Hugging Face spells them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    moe_topk: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        heads, hidden = positive(cfg, "num_attention_heads"), positive(cfg, "hidden_size")
        experts, top_k = _one(cfg, "num_experts"), _one(cfg, "moe_topk")
        if top_k > experts:
            raise ConfigError(f"moe_topk {top_k} must be between 1 and num_experts {experts}")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for hunyuan_v1_moe (its experts use silu)")
        kind = rope_scaling_type(cfg)
        if kind != "default":
            raise ConfigError(f"rope type {kind!r} is not supported for hunyuan_v1_moe (only default)")
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            head_dim=field(cfg, "head_dim", int, None) or hidden // heads,
            intermediate_size=positive(cfg, "intermediate_size"),
            num_experts=experts,
            moe_topk=top_k,
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-5),
            rope_theta=rope_theta(cfg),
            attention_bias=field(cfg, "attention_bias", bool, False),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )


def _one(cfg: dict, name: str) -> int:
    """An int field, or a per-layer list of one repeated value (the reference's experts take one count)."""
    value = cfg.get(name)
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        return positive({name: value[0]}, name)
    return positive(cfg, name)


class _WgGate(nn.Module):
    """The router ``gate.wg`` [E, H]: x [T, H] -> logits [T, E] through the router's own forward
    (in the compute dtype, which its weight is loaded in; a quantized ``wg`` holds packed words)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(x)


class HunYuanMoE(StreamedMoE):
    """Routed experts streamed, plus the resident ``shared_mlp``."""

    def __init__(self, a: ModelArgs, layer: int):
        router = partial(softmax_topk, top_k=a.moe_topk, norm_topk_prob=True)
        super().__init__(a.hidden_size, a.num_experts, layer, router, renormalize=True)
        self.gate = _WgGate(a.hidden_size, a.num_experts)
        self.shared_mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: routed experts plus the shared MLP (added after, as the reference)."""
        shared = self.shared_mlp(x)
        return super().forward(x) + shared


class Model(CausalLM):
    """HunYuan MoE V1 causal LM with streamed experts."""

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        for i in range(a.num_hidden_layers):
            attn = VariantAttention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, bias=a.attention_bias,
                qk_norm="head", norm_eps=a.rms_norm_eps, norm_after_rope=True,
                norm_names=("query_layernorm", "key_layernorm"),
            )
            self.decoder.layers.append(DecoderLayer(
                RMSNorm(a.hidden_size, a.rms_norm_eps), attn, RMSNorm(a.hidden_size, a.rms_norm_eps), HunYuanMoE(a, i),
            ))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.intermediate_size, self.args.hidden_size

    @property
    def top_k(self) -> int:
        """HunYuan names top-k ``moe_topk``."""
        return self.args.moe_topk


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    out = dict(cfg, num_hidden_layers=layers)
    for name in ("num_experts", "moe_topk"):
        if isinstance(cfg.get(name), list):
            out[name] = cfg[name][:layers]
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a HunYuan MoE V1 checkpoint of ``cfg``'s shapes, with the names transformers 5 writes."""
    a = ModelArgs.from_config(cfg)
    h, hd, inter = a.hidden_size, a.head_dim, a.intermediate_size
    q, kv = a.num_attention_heads * hd, a.num_key_value_heads * hd

    def mlp(prefix: str) -> list[SynthTensor]:
        return [SynthTensor(prefix + "gate_proj.weight", (inter, h), "normal"),
                SynthTensor(prefix + "up_proj.weight", (inter, h), "normal"),
                SynthTensor(prefix + "down_proj.weight", (h, inter), "out")]

    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (q, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, q), "out"),
            SynthTensor(p + "self_attn.query_layernorm.weight", (hd,), "norm"),
            SynthTensor(p + "self_attn.key_layernorm.weight", (hd,), "norm"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "mlp.gate.wg.weight", (a.num_experts, h), "normal"),
        ]
        if a.attention_bias:
            out += [SynthTensor(p + f"self_attn.{n}_proj.bias", (d,), "zeros")
                    for n, d in (("q", q), ("k", kv), ("v", kv), ("o", h))]
        out += mlp(p + "mlp.shared_mlp.")
        for e in range(a.num_experts):
            out += mlp(f"{p}mlp.experts.{e}.")
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
