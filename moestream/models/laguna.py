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
which this module does not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .layers import MLP, RMSNorm
from .moe import StreamedMoE
from .variants import DecoderLayer, PerTypeRope, Rope, VariantAttention

MODEL_TYPES = ("laguna",)
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' LagunaConfig defaults when a config names no rope parameters
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields Laguna uses (names as Hugging Face spells them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    heads_per_layer: tuple[int, ...]
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_routed_scaling_factor: float
    moe_router_logit_softcapping: float
    gate_per_head: bool
    sliding_window: int
    rope_parameters: dict
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        layers, heads = positive(cfg, "num_hidden_layers"), positive(cfg, "num_attention_heads")
        kv = positive(cfg, "num_key_value_heads", heads)
        experts, top_k = positive(cfg, "num_experts"), positive(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
        per_layer = _list(cfg, "num_attention_heads_per_layer", layers, [heads] * layers, int)
        if any(h < 1 or h % kv for h in per_layer):
            raise ConfigError(f"num_attention_heads_per_layer {per_layer} must be multiples of {kv} kv heads")
        types = _list(cfg, "layer_types", layers, ["full_attention"] * layers, str, LAYER_TYPES)
        mlp_types = _list(cfg, "mlp_layer_types", layers, ["dense"] + ["sparse"] * (layers - 1), str,
                          ("dense", "sparse"))
        if field(cfg, "moe_apply_router_weight_on_input", bool, False):
            raise ConfigError("moe_apply_router_weight_on_input true is not supported (nor by transformers' Laguna)")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for laguna (its experts use silu)")
        gating = field(cfg, "gating", (bool, str), True)
        if gating not in (True, False, "per-head", "per-element"):
            raise ConfigError(f"gating {gating!r}: expected true, false, 'per-head' or 'per-element'")
        rope = field(cfg, "rope_parameters", dict, DEFAULT_ROPE)
        for t in set(types):
            if not isinstance(rope.get(t), dict):
                raise ConfigError(f"rope_parameters has no entry for layer type {t!r}")
        hidden = positive(cfg, "hidden_size")
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_key_value_heads=kv,
            head_dim=field(cfg, "head_dim", int, None) or hidden // heads,
            heads_per_layer=tuple(per_layer),
            layer_types=tuple(types),
            mlp_layer_types=tuple(mlp_types),
            intermediate_size=positive(cfg, "intermediate_size"),
            moe_intermediate_size=positive(cfg, "moe_intermediate_size"),
            shared_expert_intermediate_size=positive(cfg, "shared_expert_intermediate_size"),
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_routed_scaling_factor=field(cfg, "moe_routed_scaling_factor", float, 1.0),
            moe_router_logit_softcapping=field(cfg, "moe_router_logit_softcapping", float, 0.0),
            # as the reference: any gating but true / "per-head" gates per element
            gate_per_head=gating is True or gating == "per-head",
            sliding_window=positive(cfg, "sliding_window", 512),
            rope_parameters=rope,
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-6),
            attention_bias=field(cfg, "attention_bias", bool, False),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )

    def rope_dim(self, layer_type: str) -> int:
        """Rotated dimensions per head for a layer type: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.rope_parameters[layer_type].get("partial_rotary_factor", 1.0))


def _list(cfg: dict, name: str, n: int, default: list, kind: type, allowed: tuple | None = None) -> list:
    value = field(cfg, name, list, default)
    if len(value) != n or not all(isinstance(v, kind) and (allowed is None or v in allowed) for v in value):
        what = f"one of {', '.join(allowed)}" if allowed else kind.__name__
        raise ConfigError(f"field {name!r} must list {n} values, each {what}; found {value!r}")
    return value


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
    scores = torch.sigmoid(logits)
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

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, 10000.0, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        # transformers reads YaRN's truncate from the top level of rope_parameters (True when absent)
        truncate = a.rope_parameters.get("truncate", True)
        with torch.device("cpu"):
            self.rotary = PerTypeRope({
                t: Rope(a.rope_dim(t), float(a.rope_parameters[t].get("rope_theta", 10000.0)),
                        a.rope_parameters[t], truncate)
                for t in sorted(set(a.layer_types))
            })
        for i in range(a.num_hidden_layers):
            kind = a.layer_types[i]
            attn = VariantAttention(
                a.hidden_size, a.heads_per_layer[i], a.num_key_value_heads, a.head_dim, bias=a.attention_bias,
                window=a.sliding_window if kind == "sliding_attention" else None, qk_norm="head",
                norm_eps=a.rms_norm_eps, gate="per-head" if a.gate_per_head else "per-element",
            )
            mlp = LagunaMoE(a, i) if a.mlp_layer_types[i] == "sparse" else MLP(a.hidden_size, a.intermediate_size)
            self.decoder.layers.append(DecoderLayer(
                RMSNorm(a.hidden_size, a.rms_norm_eps), attn, RMSNorm(a.hidden_size, a.rms_norm_eps), mlp,
                rope_key=kind,
            ))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.moe_intermediate_size, self.args.hidden_size


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


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a Laguna checkpoint of ``cfg``'s shapes, with the names transformers 5 writes."""
    a = ModelArgs.from_config(cfg)
    h, hd, kv = a.hidden_size, a.head_dim, a.num_key_value_heads * a.head_dim
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]

    def mlp(prefix: str, inter: int) -> list[SynthTensor]:
        return [SynthTensor(prefix + "gate_proj.weight", (inter, h), "normal"),
                SynthTensor(prefix + "up_proj.weight", (inter, h), "normal"),
                SynthTensor(prefix + "down_proj.weight", (h, inter), "out")]

    for i in range(a.num_hidden_layers):
        p, q = f"model.layers.{i}.", a.heads_per_layer[i] * hd
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (q, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, q), "out"),
            SynthTensor(p + "self_attn.q_norm.weight", (hd,), "norm"),
            SynthTensor(p + "self_attn.k_norm.weight", (hd,), "norm"),
            SynthTensor(p + "self_attn.g_proj.weight", (a.heads_per_layer[i] if a.gate_per_head else q, h), "normal"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
        if a.attention_bias:
            out += [SynthTensor(p + f"self_attn.{n}_proj.bias", (d,), "zeros")
                    for n, d in (("q", q), ("k", kv), ("v", kv), ("o", h))]
        if a.mlp_layer_types[i] == "dense":
            out += mlp(p + "mlp.", a.intermediate_size)
            continue
        out += [SynthTensor(p + "mlp.gate.weight", (a.num_experts, h), "normal"),
                SynthTensor(p + "mlp.experts.e_score_correction_bias", (a.num_experts,), "zeros")]
        out += mlp(p + "mlp.shared_expert.", a.shared_expert_intermediate_size)
        for e in range(a.num_experts):
            out += mlp(f"{p}mlp.experts.{e}.", a.moe_intermediate_size)
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
