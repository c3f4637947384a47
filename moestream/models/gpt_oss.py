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
published checkpoints store experts as MXFP4 (``_blocks``/``_scales``), read as stored by
:mod:`moestream.quant` (this module sees them through its expert function).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..checkpoint import TensorInfo
from ..errors import CheckpointError, ConfigError
from ..gguf_format import ATTN, GGUFArchitecture, GGUFFormat, base_config, bools, meta_value, moe_checks, one_head_dim
from ..pipeline import ExpertSpec, declares
from ..quant import native
from . import ops
from .base import CausalLM, DecoderArgs, SynthTensor, check_top_k, config_field, synth_tensors_of
from .layers import DecoderLayer, RMSNorm
from .linear import linear
from .moe import StreamedMoE
from .rope import RotaryEmbedding, make_rope
from .variants import VariantAttention

MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig defaults when a config names no rope parameters
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def _rope_parameters(cfg: dict) -> dict:
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_ROPE)


def _rope_theta(cfg: dict) -> float:
    return float(_rope_parameters(cfg).get("rope_theta", cfg.get("rope_theta", 150000.0)))


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields gpt-oss uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "gpt_oss"
    hidden_acts = ()  # its experts' clamped SwiGLU is fixed
    rope_types = None  # YaRN by default: read by the rope itself

    intermediate_size: int = config_field(minimum=1)
    num_local_experts: int = config_field(minimum=1, aliases=("num_experts",))
    num_experts_per_tok: int = config_field(minimum=1)
    rms_norm_eps: float = 1e-5
    rope_theta: float = config_field(read=_rope_theta)
    rope_parameters: dict = config_field(read=_rope_parameters)
    sliding_window: int | None = config_field(None, minimum=1)  # null: sliding layers see everything
    layer_types: tuple[str, ...] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        layers = v["num_hidden_layers"]
        check_top_k(v["num_experts_per_tok"], v["num_local_experts"], experts_name="num_local_experts")
        types = v["layer_types"]
        if types is None:  # as GptOssConfig: sliding, full, sliding, ...
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        if len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"layer_types must list {layers} of {', '.join(LAYER_TYPES)}; found {list(types)!r}")
        v["layer_types"] = tuple(types)


class GptOssRMSNorm(RMSNorm):
    """RMSNorm that scales before casting back, as transformers' ``GptOssRMSNorm``: ``(w * x_norm).to(dtype)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, "weight_f32")


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing, as transformers' ``GptOssTopKRouter``: the top-k logits, then a softmax over those k.

    ``logits`` [T, E] (router bias included) -> ``(weights [T, K] in logits.dtype, indices [T, K] int64)``.
    """
    values, idx = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), idx


@declares("clamped_swiglu", "gate_up")
def clamped_swiglu_expert(x: torch.Tensor, w: dict[str, torch.Tensor], alpha: float, limit: float) -> torch.Tensor:
    """One gpt-oss expert on ``x`` [n, H] -> [n, H], as transformers' ``GptOssExperts``.

    ``w`` holds ``gate_up`` [H, 2I] (gate in even columns, up in odd), ``gate_up.bias``
    [2I], ``down`` [I, H] and ``down.bias`` [H].
    """
    gate_up = ops.matmul_t(x, w["gate_up"], w["gate_up.bias"])
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * ops.sigmoid(gate * alpha)
    return ops.matmul_t((up + 1) * glu, w["down"], w["down.bias"])


@declares("clamped_swiglu")
def clamped_swiglu_linear_expert(x: torch.Tensor, w: dict[str, torch.Tensor], alpha: float, limit: float,
                                 ) -> torch.Tensor:
    """:func:`clamped_swiglu_expert` on experts stored as mlx-lm writes them (``moestream.mlx_format``).

    ``w`` holds ``gate``, ``up`` [I, H] and ``down`` [H, I] (nn.Linear orientation; gate and
    up are the reference's even and odd ``gate_up`` columns) with biases ``gate.bias``,
    ``up.bias`` [I] and ``down.bias`` [H].
    """
    if x.device.type == "cpu":  # one call of the compiled kernels (float32 intermediate)
        y = native.float_expert(x, w["gate"], w["up"], w["down"], "clamped", (alpha, limit),
                                biases=(w["gate.bias"], w["up.bias"], w["down.bias"]))
        if y is not None:
            return y
    gate = linear(x, w["gate"], w["gate.bias"]).clamp(min=None, max=limit)
    up = linear(x, w["up"], w["up.bias"]).clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return linear((up + 1) * glu, w["down"], w["down.bias"])


def adapt_to_source(net: "Model", source) -> None:
    """Follow a source format's expert layout: an mlx-lm build (``source.name == "mlx"``) and a GGUF file
    (``"gguf"``: llama.cpp's converter de-interleaves gate_up the same way) store gate, up and down in
    nn.Linear orientation, each with a bias (:func:`clamped_swiglu_linear_expert`). Called by the engine on
    the meta-device model, before its expert kernels are chosen."""
    if source.name in ("mlx", "gguf"):
        _linear_experts(net)


def adapt_to_layout(net: "Model", layout) -> None:
    """Follow the checkpoint's expert layout (a :class:`moestream.layout.ExpertLayout`): experts stored as
    separate gate, up and down linears in any format -- what ``moestream convert`` writes of gpt-oss, an mlx-lm
    build, a GGUF file -- run as :func:`clamped_swiglu_linear_expert`; transformers' fused ``gate_up`` (and the
    MXFP4 release) as :func:`clamped_swiglu_expert`. Called by the engine on the meta-device model."""
    first = next(iter(layout.layers.values()), None)
    if first is not None and first.experts and first.experts[0][0].role == "gate":
        _linear_experts(net)


def _linear_experts(net: "Model") -> None:
    a = net.args
    net.expert_roles = ("gate", "up", "down", "down.bias", "gate.bias", "up.bias")
    net.expert_shape = lambda: (a.intermediate_size, a.hidden_size)
    spec = ExpertSpec.of(partial(clamped_swiglu_linear_expert, alpha=a.swiglu_alpha, limit=a.swiglu_limit))
    for block in net.moe_blocks():
        block.expert = spec


class GptOssMoE(StreamedMoE):
    """gpt-oss's MoE block: the router is ``mlp.router`` (weight [E, H] and bias [E]), experts stream.

    ``gate`` is kept as an alias of the router so the engine's checks find the expert count.
    """

    def __init__(self, a: ModelArgs, layer: int):
        expert = ExpertSpec.of(partial(clamped_swiglu_expert, alpha=a.swiglu_alpha, limit=a.swiglu_limit))
        super().__init__(a.hidden_size, a.num_local_experts, layer, partial(topk_softmax, top_k=a.num_experts_per_tok),
                         expert, renormalize=True)
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
    Norm = GptOssRMSNorm
    synth_biases_after = "end"

    def make_rotary(self, a: ModelArgs) -> RotaryEmbedding:
        return make_rope(a.head_dim, a.rope_theta, a.rope_parameters)

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        window = a.sliding_window if a.layer_types[i] == "sliding_attention" else None
        attn = VariantAttention.of(a, bias=a.attention_bias, window=window, sinks=True)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, GptOssMoE(a, i), norm=GptOssRMSNorm)

    def expert_shape(self) -> tuple[int, int]:
        """Shape of one routed expert's first piece, ``gate_up`` [H, 2I] (stored for ``x @ W``)."""
        return self.args.hidden_size, 2 * self.args.intermediate_size

    def synth_experts(self, block: str, num_experts: int) -> list[SynthTensor]:
        """The fused experts as transformers 5 writes them: ``gate_up_proj`` [E, H, 2I] and ``down_proj``
        [E, I, H], each with its bias."""
        h, inter, e, x = self.args.hidden_size, self.args.intermediate_size, num_experts, block + ".experts."
        return [SynthTensor(x + "gate_up_proj", (e, h, 2 * inter), "normal"),
                SynthTensor(x + "gate_up_proj_bias", (e, 2 * inter), "zeros"),
                SynthTensor(x + "down_proj", (e, inter, h), "out"),
                SynthTensor(x + "down_proj_bias", (e, h), "zeros")]


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers; float experts, so no MXFP4 ``quantization_config``."""
    out = dict(cfg, num_hidden_layers=layers)
    out.pop("quantization_config", None)
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = cfg["layer_types"][:layers]
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_config(meta: dict, tensors: dict, where, spec: GGUFArchitecture) -> dict:
    """gpt-oss (``gpt-oss``): GptOssModel.set_gguf_parameters' keys. The sliding layers follow
    ``attention.sliding_window_pattern`` (bools, or a period n: layer i slides when ``i % n < n - 1``),
    default 2, as llama.cpp (sliding, full, ...). The YaRN parameters come from ``rope.scaling.*``;
    ``truncate`` is false, as the published configs and OpenAI's reference (ggml's YaRN rounds the
    correction range, a difference from llama.cpp). The clamped SwiGLU's alpha 1.702 and limit 7.0 are
    fixed in llama.cpp's graph, so the config holds those.
    """
    p = "gpt-oss."
    cfg = base_config(meta, tensors, where, spec)
    one_head_dim(meta, p, where, cfg)
    layers = cfg["num_hidden_layers"]
    experts = moe_checks(meta, p, where, "gpt_oss")
    rot = meta_value(meta, p + "rope.dimension_count", where, required=False, minimum=1)
    if rot is not None and rot != cfg["head_dim"]:
        raise CheckpointError(f"{where}: metadata {p}rope.dimension_count {rot} is not the head dim "
                              f"{cfg['head_dim']}: partial rotary embeddings are not supported for gpt_oss")
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = bools(meta, p + "attention.sliding_window_pattern", where, layers)
    else:
        n = meta_value(meta, p + "attention.sliding_window_pattern", where, default=2, required=False, minimum=0)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    scaling = meta.get(p + "rope.scaling.type")
    theta = cfg["rope_theta"]
    if scaling in (None, "none"):
        rope = {"rope_type": "default", "rope_theta": theta}
    elif scaling == "yarn":
        for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
            if meta.get(p + key) is not None:
                raise CheckpointError(f"{where}: metadata {p}{key} is set; gpt_oss computes YaRN's default "
                                      "extrapolation and attention factors only")
        rope = {"rope_type": "yarn", "rope_theta": theta,
                "factor": meta_value(meta, p + "rope.scaling.factor", where, float),
                "original_max_position_embeddings": meta_value(meta, p + "rope.scaling.original_context_length", where),
                "beta_fast": meta_value(meta, p + "rope.scaling.yarn_beta_fast", where, float, default=32.0),
                "beta_slow": meta_value(meta, p + "rope.scaling.yarn_beta_slow", where, float, default=1.0),
                "truncate": False}
    else:
        raise CheckpointError(f"{where}: metadata {p}rope.scaling.type {scaling!r}: gpt_oss computes YaRN or "
                              "the default rotary embedding")
    cfg.update({
        "num_hidden_layers": layers,
        "intermediate_size": meta_value(meta, p + "expert_feed_forward_length", where, minimum=1),
        "num_local_experts": experts,
        "sliding_window": meta_value(meta, p + "attention.sliding_window", where, minimum=1),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": rope,
        "swiglu_limit": 7.0, "attention_bias": True,
    })
    return cfg


def gguf_tensors(tensors: dict[str, TensorInfo], cfg: dict, derived: dict, where, fmt: GGUFFormat) -> None:
    """GptOssModel's renames undone: ``attn_sinks.weight`` is the bare ``self_attn.sinks``. Its other
    transformations (gate_up de-interleaved into ``ffn_gate_exps``/``ffn_up_exps`` with their biases, ``down``
    transposed into nn.Linear orientation) give the stacked layout the family reads through its
    ``adapt_to_source`` (separate gate and up experts), so nothing else is undone.

    Raises:
        CheckpointError: fused gate/up experts (a converter option moestream does not read).
    """
    for name in list(tensors):
        if name.endswith(".self_attn.sinks.weight"):
            tensors[name[: -len(".weight")]] = tensors.pop(name)
        elif ".ffn_gate_up_exps." in name:
            raise CheckpointError(f"{where}: tensor {name!r}: gate and up experts fused into one tensor "
                                  "(convert_hf_to_gguf.py's fuse option) are not read yet")


# GptOssModel: experts de-interleaved into gate and up, each with its bias; the router is mlp.router
GGUF = GGUFArchitecture("gpt-oss", "gpt_oss", "GptOssForCausalLM",
                        ATTN + ("self_attn.sinks", "mlp.router", "mlp.experts.gate_proj", "mlp.experts.up_proj",
                                "mlp.experts.down_proj"),
                        gguf_config, gguf_tensors, added=8)
