"""Qwen3-Next (Qwen3-Next-80B-A3B): ``model_type: qwen3_next``.

Reference: transformers ``models/qwen3_next/modeling_qwen3_next.py`` (torch fallback path).
A hybrid decoder: per ``layer_types`` (default: every ``full_attention_interval``-th
layer full attention), each layer mixes tokens with Gated DeltaNet linear attention or
with gated full attention (output gate, zero-centred q/k norms, partial rotary), then a
MoE block of softmax top-k routed experts (renormalized when ``norm_topk_prob``) plus a
resident shared expert behind a sigmoid gate. Norms are zero-centred (``1 + weight``).
Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid use a dense MLP.

The cache (:class:`~moestream.models.layers.HybridCache`) holds keys and values for the
attention layers and the convolution window and recurrent state for the DeltaNet layers.
Checkpoints may carry a multi-token-prediction layer (``mtp.*``); it is not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .hybrid import (
    GatedAttention,
    GatedDeltaNet,
    HybridCache,
    SharedExpertMoE,
    ZeroCenteredRMSNorm,
    layer_types,
    rotary_fraction,
    synth_layer_tensors,
)
from .layers import MLP, rope_scaling_type, rope_theta
from .moe import softmax_topk

MODEL_TYPES = ("qwen3_next",)


@dataclass(frozen=True)
class ModelArgs:
    """The config fields a hybrid Qwen model uses (names as Hugging Face spells them).

    ``fused_projections`` is how the DeltaNet input projections are stored (Qwen3-Next:
    fused ``in_proj_qkvz``/``in_proj_ba``; Qwen3.5: four separate projections).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    intermediate_size: int | None
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    fused_projections: bool = True

    @classmethod
    def parse(cls, cfg: dict, family: str, **fixed) -> "ModelArgs":
        """Parse and check the (text) config dict ``cfg``; ``fixed`` overrides fields the family fixes.

        Raises:
            ConfigError: naming the bad field.
        """
        heads = positive(cfg, "num_attention_heads")
        hidden = positive(cfg, "hidden_size")
        layers = positive(cfg, "num_hidden_layers")
        experts = positive(cfg, "num_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for {family} (its experts use silu)")
        rope_type = rope_scaling_type(cfg)
        if rope_type != "default":
            raise ConfigError(f"rope type {rope_type!r} is not supported for {family} yet (only default)")
        head_dim = field(cfg, "head_dim", int, None) or hidden // heads
        rotary_dim = int(head_dim * rotary_fraction(cfg))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ConfigError(f"head_dim {head_dim} x partial_rotary_factor gives {rotary_dim} rotary dimensions; "
                              "expected an even number >= 2")
        only = field(cfg, "mlp_only_layers", list, [])
        if not all(isinstance(i, int) for i in only):
            raise ConfigError(f"mlp_only_layers {only!r} is not a list of layer indices")
        values = dict(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            layer_types=tuple(layer_types(cfg, layers)),
            linear_conv_kernel_dim=positive(cfg, "linear_conv_kernel_dim", 4),
            linear_key_head_dim=positive(cfg, "linear_key_head_dim"),
            linear_value_head_dim=positive(cfg, "linear_value_head_dim"),
            linear_num_key_heads=positive(cfg, "linear_num_key_heads"),
            linear_num_value_heads=positive(cfg, "linear_num_value_heads"),
            intermediate_size=field(cfg, "intermediate_size", int, None),
            moe_intermediate_size=positive(cfg, "moe_intermediate_size"),
            shared_expert_intermediate_size=positive(cfg, "shared_expert_intermediate_size"),
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=field(cfg, "norm_topk_prob", bool, True),
            decoder_sparse_step=positive(cfg, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(only),
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta(cfg),
            attention_bias=field(cfg, "attention_bias", bool, False),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )
        values.update(fixed)
        args = cls(**values)
        dense = [i for i in range(layers) if not args.is_moe_layer(i)]
        if dense and not args.intermediate_size:
            raise ConfigError(f"layers {dense[:5]} use a dense MLP, but field 'intermediate_size' is missing")
        return args

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a Qwen3-Next config.json dict. Raises ConfigError naming the bad field."""
        return cls.parse(cfg, "qwen3_next")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


class DecoderLayer(nn.Module):
    """Zero-centred RMSNorm -> Gated DeltaNet or gated attention -> residual ->
    zero-centred RMSNorm -> MoE with shared expert (or dense MLP) -> residual."""

    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.linear = a.layer_types[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                a.hidden_size, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                a.linear_value_head_dim, a.linear_conv_kernel_dim, a.rms_norm_eps, a.fused_projections,
            )
        else:
            self.self_attn = GatedAttention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rotary_dim,
                a.rms_norm_eps, bias=a.attention_bias,
            )
        self.post_attention_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.is_moe_layer(i):
            router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
            self.mlp = SharedExpertMoE(a.hidden_size, a.num_experts, i, router, a.shared_expert_intermediate_size,
                                       renormalize=a.norm_topk_prob)
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, h: torch.Tensor, cos, sin, kv: HybridCache, i: int, start: int) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.linear:
            x = self.linear_attn(x, kv, i, start)
        else:
            x = self.self_attn(x, cos, sin, kv, i, start)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    """Hybrid Qwen causal LM (Qwen3-Next layout: decoder at ``model``) with streamed experts."""

    def __init__(self, a: ModelArgs, prefix: str = "model", head: str = "lm_head"):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.rotary_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings, prefix=prefix, head=head,
        )
        self.args = a
        self.decoder.norm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.decoder.layers.extend(DecoderLayer(a, i) for i in range(a.num_hidden_layers))

    def new_kv_cache(self, capacity: int = 256) -> HybridCache:
        """Keys/values for attention layers, convolution and recurrent state for DeltaNet layers."""
        return HybridCache(len(self.decoder.layers), capacity)

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.moe_intermediate_size, self.args.hidden_size


def describe_skipped(unused: list[str]) -> tuple[str | None, list[str]]:
    """A one-line note naming the multi-token-prediction layer (``mtp.*``) when the
    checkpoint has one, and the unused tensor names it does not explain."""
    return skipped_note("qwen3_next", unused, {"mtp.": "the multi-token-prediction layer"})


def skipped_note(family: str, unused: list[str], parts: dict[str, str]) -> tuple[str | None, list[str]]:
    """Group ``unused`` tensor names by the prefixes of ``parts`` (prefix -> what it is).

    Returns (``"<family>: not loaded: <what> (<prefix>*, N tensors), ..."`` or None when no
    name matches, the names matching no prefix).
    """
    found, rest = [], list(unused)
    for prefix, what in parts.items():
        hits = [n for n in rest if n.startswith(prefix)]
        if hits:
            found.append(f"{what} ({prefix}*, {len(hits)} tensors)")
            rest = [n for n in rest if not n.startswith(prefix)]
    if not found:
        return None, rest
    return f"{family}: not loaded: {', '.join(found)}; moestream runs the text decoder only", rest


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers (``layer_types`` too), without the
    multi-token-prediction layer synth does not write (``mtp_num_hidden_layers`` 0)."""
    out = dict(cfg)
    out["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = cfg["layer_types"][:layers]
    out["mlp_only_layers"] = [i for i in cfg.get("mlp_only_layers") or [] if i < layers]
    if "mtp_num_hidden_layers" in out:  # synth writes no multi-token-prediction layer (mtp.*)
        out["mtp_num_hidden_layers"] = 0
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a Qwen3-Next checkpoint of ``cfg``'s shapes (per-expert experts; no MTP layer)."""
    a = ModelArgs.from_config(cfg)
    return hybrid_synth_tensors(a, "model", "lm_head")


def hybrid_synth_tensors(a: ModelArgs, prefix: str, head: str) -> list[SynthTensor]:
    """The tensors of a hybrid Qwen checkpoint with its decoder at ``prefix`` and LM head at ``head``."""
    h = a.hidden_size
    out = [SynthTensor(f"{prefix}.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        out += synth_layer_tensors(a, f"{prefix}.layers.{i}.", i, a.fused_projections)
    out.append(SynthTensor(f"{prefix}.norm.weight", (h,), "zeros"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor(f"{head}.weight", (a.vocab_size, h), "normal"))
    return out
