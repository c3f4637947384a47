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
from typing import ClassVar

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, DecoderArgs, check_top_k, config_field, derived, synth_tensors_of
from .hybrid import (
    GatedAttention,
    GatedDeltaNet,
    GatedSharedExpertMoE,
    HybridCache,
    ZeroCenteredRMSNorm,
    layer_types,
    rotary_fraction,
)
from .layers import MLP
from .moe import softmax_topk
from .rope import RotaryEmbedding, make_rope

MODEL_TYPES = ("qwen3_next",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config fields a hybrid Qwen model uses beyond :class:`DecoderArgs` (names as Hugging Face spells them).

    ``fused_projections`` is how the DeltaNet input projections are stored (Qwen3-Next:
    fused ``in_proj_qkvz``/``in_proj_ba``; Qwen3.5: four separate projections).
    """

    family = "qwen3_next"
    rope_refusal = "yet (only default)"
    # fields a family fixes whatever its config says (Qwen3.5: every layer MoE, renormalized)
    fixed: ClassVar[dict] = {}

    rotary_dim: int = derived()
    layer_types: tuple[str, ...] = derived()
    linear_conv_kernel_dim: int = config_field(4, minimum=1)
    linear_key_head_dim: int = config_field(minimum=1)
    linear_value_head_dim: int = config_field(minimum=1)
    linear_num_key_heads: int = config_field(minimum=1)
    linear_num_value_heads: int = config_field(minimum=1)
    intermediate_size: int | None = None
    moe_intermediate_size: int = config_field(minimum=1)
    shared_expert_intermediate_size: int = config_field(minimum=1)
    num_experts: int = config_field(minimum=1)
    num_experts_per_tok: int = config_field(minimum=1)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = config_field(1, minimum=1)
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    fused_projections: bool = derived(True)

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        check_top_k(v["num_experts_per_tok"], v["num_experts"])
        head_dim = v["head_dim"]
        v["rotary_dim"] = rotary_dim = int(head_dim * rotary_fraction(cfg))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ConfigError(f"head_dim {head_dim} x partial_rotary_factor gives {rotary_dim} rotary dimensions; "
                              "expected an even number >= 2")
        if not all(isinstance(i, int) for i in v["mlp_only_layers"]):
            raise ConfigError(f"mlp_only_layers {list(v['mlp_only_layers'])!r} is not a list of layer indices")
        v["layer_types"] = tuple(layer_types(cfg, v["num_hidden_layers"]))
        v.update(cls.fixed)
        dense = [i for i in range(v["num_hidden_layers"])
                 if i in v["mlp_only_layers"] or (i + 1) % v["decoder_sparse_step"]]
        if dense and not v["intermediate_size"]:
            raise ConfigError(f"layers {dense[:5]} use a dense MLP, but field 'intermediate_size' is missing")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


class DecoderLayer(nn.Module):
    """Zero-centred RMSNorm -> Gated DeltaNet or gated attention -> residual ->
    zero-centred RMSNorm -> MoE with shared expert (or dense MLP) -> residual."""

    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.linear = a.layer_types[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                a.hidden_size, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                a.linear_value_head_dim, a.linear_conv_kernel_dim, a.rms_norm_eps, a.fused_projections,
            )
        else:
            self.self_attn = GatedAttention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps,
                bias=a.attention_bias,
            )
        if a.is_moe_layer(i):
            router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
            self.mlp = GatedSharedExpertMoE(a.hidden_size, a.num_experts, i, router, a.shared_expert_intermediate_size,
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

    Norm = ZeroCenteredRMSNorm

    def make_rotary(self, a: ModelArgs) -> RotaryEmbedding:
        return make_rope(a.rotary_dim, a.rope_theta)

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        return DecoderLayer(a, i)

    def new_kv_cache(self, capacity: int = 256) -> HybridCache:
        """Keys/values for attention layers, convolution and recurrent state for DeltaNet layers."""
        return HybridCache(len(self.decoder.layers), capacity)

    def synth_rank(self, name: str) -> int:
        """synth lists a MoE layer's routed experts right after the router, before the shared expert."""
        if name.startswith("mlp.") and not name.startswith("mlp.gate."):
            return 3 if name.startswith("mlp.experts.") else 4
        return super().synth_rank(name)


def adapt_to_source(net: "Model", source) -> None:
    """Follow a source format's stored input orders (``source.input_orders``: a GGUF file's ``out_proj``
    whose quantized blocks straddle its tiled value heads, see :mod:`moestream.gguf_format`): each such
    DeltaNet layer permutes its ``out_proj`` input to the stored order. Called by the engine on the
    meta-device model. Raises ConfigError naming a path that is not a DeltaNet ``out_proj``."""
    for path, order in getattr(source, "input_orders", {}).items():
        mixer = net.get_submodule(path.removesuffix(".out_proj")) if path.endswith(".linear_attn.out_proj") else None
        if not isinstance(mixer, GatedDeltaNet) or sorted(order) != list(range(mixer.out_proj.in_features)):
            raise ConfigError(f"{path}: not a DeltaNet out_proj taking a permutation of its "
                              f"{getattr(getattr(mixer, 'out_proj', None), 'in_features', '?')} inputs")
        mixer.out_order = tuple(order)


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


synth_tensors = synth_tensors_of(Model, ModelArgs)
