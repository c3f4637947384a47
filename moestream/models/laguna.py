"""Laguna (poolside Laguna-XS.2, Laguna-S-2.1): ``model_type: laguna``.

Reference: transformers ``models/laguna/modeling_laguna.py``. Pre-norm decoder layers:

* attention with a per-layer head count (``num_attention_heads_per_layer``), per-head
  q/k RMSNorm, partial rotary embeddings with one set of rope parameters per layer type
  (``full_attention``: YaRN on half of each head; ``sliding_attention``: a window of
  ``sliding_window``), and an output gate: the attention output is multiplied by
  ``softplus(g_proj(x))``, per head (``gating`` true or ``"per-head"``) or per element;
* a feed-forward block per ``mlp_layer_types``: a dense SwiGLU MLP, or a MoE block with
  sigmoid routing (:func:`laguna_sigmoid_topk`: top-k chosen by score plus
  ``e_score_correction_bias``, weighted by the scores renormalized), the routed sum times
  ``moe_routed_scaling_factor``, plus a shared expert.

Checkpoint names are those on disk (what transformers 5 ``save_pretrained`` writes):
``mlp.experts.E.{gate,up,down}_proj.weight``, ``mlp.experts.e_score_correction_bias``,
``mlp.shared_expert.*``. The published checkpoints are FP8 (``quantization_config``),
read as stored by :mod:`moestream.quant` (compressed-tensors block FP8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from . import ops
from .base import CausalLM, DecoderArgs, check_top_k, config_field, derived, field, synth_tensors_of
from .layers import MLP, DecoderLayer
from .moe import StreamedMoE
from .rope import PerTypeRope, make_rope
from .variants import VariantAttention

MODEL_TYPES = ("laguna",)
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' LagunaConfig defaults when a config names no rope parameters
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields Laguna uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "laguna"
    rope_types = None  # one set of rope parameters per layer type, read by the model

    rope_theta: float | None = derived()  # per layer type, in rope_parameters
    num_attention_heads_per_layer: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    intermediate_size: int = config_field(minimum=1)
    moe_intermediate_size: int = config_field(minimum=1)
    shared_expert_intermediate_size: int = config_field(minimum=1)
    num_experts: int = config_field(minimum=1)
    num_experts_per_tok: int = config_field(minimum=1)
    moe_routed_scaling_factor: float = 1.0
    moe_router_logit_softcapping: float = 0.0
    gating: bool | str = True
    gate_per_head: bool = derived()
    sliding_window: int = config_field(512, minimum=1)
    rope_parameters: dict = config_field(DEFAULT_ROPE)
    attention_bias: bool = False

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        layers, heads, kv = v["num_hidden_layers"], v["num_attention_heads"], v["num_key_value_heads"]
        check_top_k(v["num_experts_per_tok"], v["num_experts"])
        per_layer = _per_layer(v, "num_attention_heads_per_layer", [heads] * layers, int)
        if any(h < 1 or h % kv for h in per_layer):
            raise ConfigError(f"num_attention_heads_per_layer {list(per_layer)} must be multiples of {kv} kv heads")
        types = _per_layer(v, "layer_types", ["full_attention"] * layers, str, LAYER_TYPES)
        _per_layer(v, "mlp_layer_types", ["dense"] + ["sparse"] * (layers - 1), str, ("dense", "sparse"))
        if field(cfg, "moe_apply_router_weight_on_input", bool, False):
            raise ConfigError("moe_apply_router_weight_on_input true is not supported (nor by transformers' Laguna)")
        gating = v["gating"]
        if gating not in (True, False, "per-head", "per-element"):
            raise ConfigError(f"gating {gating!r}: expected true, false, 'per-head' or 'per-element'")
        # as the reference: any gating but true / "per-head" gates per element
        v["gate_per_head"] = gating is True or gating == "per-head"
        for t in set(types):
            if not isinstance(v["rope_parameters"].get(t), dict):
                raise ConfigError(f"rope_parameters has no entry for layer type {t!r}")

    def rope_dim(self, layer_type: str) -> int:
        """Rotated dimensions per head for a layer type: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.rope_parameters[layer_type].get("partial_rotary_factor", 1.0))


def _per_layer(v: dict, name: str, default: list, kind: type, allowed: tuple | None = None) -> tuple:
    """Field ``name`` of ``v`` (``default`` when absent) checked to hold one ``kind`` per layer, as a tuple."""
    n = v["num_hidden_layers"]
    value = default if v[name] is None else list(v[name])
    if len(value) != n or not all(isinstance(x, kind) and (allowed is None or x in allowed) for x in value):
        what = f"one of {', '.join(allowed)}" if allowed else kind.__name__
        raise ConfigError(f"field {name!r} must list {n} values, each {what}; found {value!r}")
    v[name] = tuple(value)
    return v[name]


def laguna_sigmoid_topk(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Laguna routing, as transformers' ``LagunaTopKRouter``.

    ``logits`` [T, E] in float32 (tanh-softcapped when ``softcap`` > 0), scores =
    sigmoid(logits); the top-k experts by ``scores + correction_bias`` [E]; their weights
    are the scores (without the bias) renormalized to sum to 1. Returns
    ``(weights [T, K] float32, indices [T, K] int64)``; the caller casts the weights.
    """
    logits = logits.float()
    if softcap > 0.0:
        logits = torch.tanh(logits / softcap) * softcap
    scores = ops.sigmoid(logits)
    _, idx = torch.topk(scores + correction_bias.to(scores.dtype), top_k, dim=-1)
    weights = scores.gather(-1, idx)
    return weights / weights.sum(dim=-1, keepdim=True), idx


class LagunaMoE(StreamedMoE):
    """Laguna's MoE block: router ``gate``, correction bias ``experts.e_score_correction_bias`` [E],
    routed experts streamed and scaled by ``moe_routed_scaling_factor``, plus ``shared_expert``."""

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__(a.hidden_size, a.num_experts, layer, self._route, renormalize=True)
        self.top_k, self.softcap = a.num_experts_per_tok, a.moe_router_logit_softcapping
        self.scaling = a.moe_routed_scaling_factor
        self.experts = nn.Module()
        self.experts.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts), requires_grad=False)
        self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, idx = laguna_sigmoid_topk(logits, self.experts.e_score_correction_bias, self.top_k, self.softcap)
        return weights.to(logits.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: shared expert plus scaled routed experts, in the reference's order."""
        shared = self.shared_expert(x)
        return self.routed(x) * self.scaling + shared


class Model(CausalLM):
    """Laguna causal LM with streamed experts."""

    def make_rotary(self, a: ModelArgs) -> PerTypeRope:
        # transformers reads YaRN's truncate from the top level of rope_parameters (True when absent)
        truncate = a.rope_parameters.get("truncate", True)
        return PerTypeRope({
            t: make_rope(a.rope_dim(t), a.rope_parameters[t].get("rope_theta", 10000.0),
                         dict(a.rope_parameters[t], truncate=truncate))
            for t in sorted(set(a.layer_types))
        })

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        kind = a.layer_types[i]
        attn = VariantAttention(
            a.hidden_size, a.num_attention_heads_per_layer[i], a.num_key_value_heads, a.head_dim,
            bias=a.attention_bias, window=a.sliding_window if kind == "sliding_attention" else None,
            qk_norm="head", norm_eps=a.rms_norm_eps, gate="per-head" if a.gate_per_head else "per-element",
        )
        mlp = LagunaMoE(a, i) if a.mlp_layer_types[i] == "sparse" else MLP(a.hidden_size, a.intermediate_size)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, mlp, rope_key=kind)


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers, in bf16: the FP8 ``quantization_config`` is dropped."""
    out = dict(cfg, num_hidden_layers=layers)
    out.pop("quantization_config", None)
    for name in ("num_attention_heads_per_layer", "layer_types", "mlp_layer_types", "gating_types"):
        if isinstance(cfg.get(name), list):
            out[name] = cfg[name][:layers]
    if isinstance(cfg.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)
