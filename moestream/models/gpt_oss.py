"""gpt-oss (gpt-oss-20b, gpt-oss-120b): ``model_type: gpt_oss``.

Reference: transformers ``models/gpt_oss/modeling_gpt_oss.py``. Pre-norm decoder layers
alternating sliding-window and full attention (``layer_types``), attention with biases
and one learned sink logit per head, YaRN rotary embeddings; a MoE block whose router
has a bias and takes the top-k logits, then a softmax over those k; experts with biases
and a clamped SwiGLU: ``gate_up = x @ W + b`` with gate and up in interleaved columns,
``gate`` clamped above at ``swiglu_limit``, ``up`` to [-limit, limit],
``(up + 1) * gate * sigmoid(alpha * gate)``, then ``@ W_down + b_down``.

On disk (what transformers 5 ``save_pretrained`` writes) the experts are fused for
``x @ W``: ``mlp.experts.gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias`` [E, 2I],
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; ``moestream.layout`` turns each
expert into the pieces ``gate_up``, ``down``, ``down.bias``, ``gate_up.bias``. The
published checkpoints store experts as MXFP4 (``_blocks``/``_scales``), which this module
does not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .layers import RMSNorm
from .linear import linear
from .moe import StreamedMoE
from .variants import DecoderLayer, Rope, VariantAttention, optional_positive

MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig defaults when a config names no rope parameters
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields gpt-oss uses (names as Hugging Face spells them)."""

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
    rope_parameters: dict
    sliding_window: int | None
    layer_types: tuple[str, ...]
    swiglu_alpha: float
    swiglu_limit: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        heads, hidden = positive(cfg, "num_attention_heads"), positive(cfg, "hidden_size")
        layers = positive(cfg, "num_hidden_layers")
        experts = field(cfg, "num_local_experts", int, None) or positive(cfg, "num_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        if experts < 1 or top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts {experts}")
        types = field(cfg, "layer_types", list, None)
        if types is None:  # as GptOssConfig: sliding, full, sliding, ...
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        if len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"layer_types must list {layers} of {', '.join(LAYER_TYPES)}; found {types!r}")
        window = optional_positive(cfg, "sliding_window")  # null: sliding layers see everything, as the reference
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_ROPE)
        theta = params.get("rope_theta", cfg.get("rope_theta", 150000.0))
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=positive(cfg, "num_key_value_heads", heads),
            head_dim=field(cfg, "head_dim", int, None) or hidden // heads,
            intermediate_size=positive(cfg, "intermediate_size"),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-5),
            rope_theta=float(theta),
            rope_parameters=params,
            sliding_window=window,
            layer_types=tuple(types),
            swiglu_alpha=field(cfg, "swiglu_alpha", float, 1.702),
            swiglu_limit=field(cfg, "swiglu_limit", float, 7.0),
            attention_bias=field(cfg, "attention_bias", bool, True),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )


class GptOssRMSNorm(RMSNorm):
    """RMSNorm that scales before casting back, as transformers' ``GptOssRMSNorm``: ``(w * x_norm).to(dtype)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing, as transformers' ``GptOssTopKRouter``: the top-k logits, then a softmax over those k.

    ``logits`` [T, E] (router bias included) -> ``(weights [T, K] in logits.dtype, indices [T, K] int64)``.
    """
    values, idx = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), idx


def clamped_swiglu_expert(x: torch.Tensor, w: dict[str, torch.Tensor], alpha: float, limit: float) -> torch.Tensor:
    """One gpt-oss expert on ``x`` [n, H] -> [n, H], as transformers' ``GptOssExperts``.

    ``w`` holds ``gate_up`` [H, 2I] (gate in even columns, up in odd), ``gate_up.bias``
    [2I], ``down`` [I, H] and ``down.bias`` [H].
    """
    gate_up = x @ w["gate_up"] + w["gate_up.bias"]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return ((up + 1) * glu) @ w["down"] + w["down.bias"]


def clamped_swiglu_linear_expert(x: torch.Tensor, w: dict[str, torch.Tensor], alpha: float, limit: float,
                                 ) -> torch.Tensor:
    """:func:`clamped_swiglu_expert` on experts stored as mlx-lm writes them (``moestream.mlx_format``).

    ``w`` holds ``gate``, ``up`` [I, H] and ``down`` [H, I] (nn.Linear orientation; gate and
    up are the reference's even and odd ``gate_up`` columns) with biases ``gate.bias``,
    ``up.bias`` [I] and ``down.bias`` [H].
    """
    gate = linear(x, w["gate"], w["gate.bias"]).clamp(min=None, max=limit)
    up = linear(x, w["up"], w["up.bias"]).clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return linear((up + 1) * glu, w["down"], w["down.bias"])


def adapt_to_source(net: "Model", source) -> None:
    """Follow a source format's expert layout: an mlx-lm build (``source.name == "mlx"``) stores gate, up
    and down in nn.Linear orientation, each with a bias (:func:`clamped_swiglu_linear_expert`). Called by
    the engine on the meta-device model, before its expert kernels are chosen."""
    if source.name != "mlx":
        return
    a = net.args
    net.expert_roles = ("gate", "up", "down", "down.bias", "gate.bias", "up.bias")
    net.expert_shape = lambda: (a.intermediate_size, a.hidden_size)
    fn = partial(clamped_swiglu_linear_expert, alpha=a.swiglu_alpha, limit=a.swiglu_limit)
    for block in net.moe_blocks():
        block.expert_fn = fn


class GptOssMoE(StreamedMoE):
    """gpt-oss's MoE block: the router is ``mlp.router`` (weight [E, H] and bias [E]), experts stream.

    ``gate`` is kept as an alias of the router so the engine's checks find the expert count.
    """

    def __init__(self, a: ModelArgs, layer: int):
        expert_fn = partial(clamped_swiglu_expert, alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        super().__init__(a.hidden_size, a.num_local_experts, layer, partial(topk_softmax, top_k=a.num_experts_per_tok),
                         expert_fn, renormalize=True)
        self.topk = self.router
        del self.gate
        self.router = nn.Linear(a.hidden_size, a.num_local_experts, bias=True)

    @property
    def gate(self) -> nn.Linear:
        return self.router

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits with bias (through the router's forward: it may be quantized), top-k, softmax over the k."""
        return self.topk(self.router(x))


class Model(CausalLM):
    """gpt-oss causal LM with streamed experts."""

    expert_roles = ("gate_up", "down", "down.bias", "gate_up.bias")

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.head_dim, a.rope_theta, a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        self.decoder.norm = GptOssRMSNorm(a.hidden_size, a.rms_norm_eps)
        with torch.device("cpu"):
            # transformers reads truncate from the rope parameters, True when absent
            self.rotary = Rope(a.head_dim, a.rope_theta, a.rope_parameters, a.rope_parameters.get("truncate", True))
        for i, kind in enumerate(a.layer_types):
            attn = VariantAttention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, bias=a.attention_bias,
                window=a.sliding_window if kind == "sliding_attention" else None, sinks=True,
            )
            self.decoder.layers.append(DecoderLayer(
                GptOssRMSNorm(a.hidden_size, a.rms_norm_eps), attn, GptOssRMSNorm(a.hidden_size, a.rms_norm_eps),
                GptOssMoE(a, i),
            ))

    def expert_shape(self) -> tuple[int, int]:
        """Shape of one routed expert's first piece, ``gate_up`` [H, 2I] (stored for ``x @ W``)."""
        return self.args.hidden_size, 2 * self.args.intermediate_size


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers; float experts, so no MXFP4 ``quantization_config``."""
    out = dict(cfg, num_hidden_layers=layers)
    out.pop("quantization_config", None)
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = cfg["layer_types"][:layers]
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a gpt-oss checkpoint of ``cfg``'s shapes, experts fused as transformers 5 writes them."""
    a = ModelArgs.from_config(cfg)
    h, hd, inter, e = a.hidden_size, a.head_dim, a.intermediate_size, a.num_local_experts
    q, kv = a.num_attention_heads * hd, a.num_key_value_heads * hd
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "self_attn.q_proj.weight", (q, h), "normal"),
            SynthTensor(p + "self_attn.k_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            SynthTensor(p + "self_attn.o_proj.weight", (h, q), "out"),
            SynthTensor(p + "self_attn.sinks", (a.num_attention_heads,), "normal"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
            SynthTensor(p + "mlp.router.weight", (e, h), "normal"),
            SynthTensor(p + "mlp.router.bias", (e,), "zeros"),
            SynthTensor(p + "mlp.experts.gate_up_proj", (e, h, 2 * inter), "normal"),
            SynthTensor(p + "mlp.experts.gate_up_proj_bias", (e, 2 * inter), "zeros"),
            SynthTensor(p + "mlp.experts.down_proj", (e, inter, h), "out"),
            SynthTensor(p + "mlp.experts.down_proj_bias", (e, h), "zeros"),
        ]
        if a.attention_bias:
            out += [SynthTensor(p + f"self_attn.{n}_proj.bias", (d,), "zeros")
                    for n, d in (("q", q), ("k", kv), ("v", kv), ("o", h))]
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
