"""DeepSeek-V2, DeepSeek-V3 and Kimi K2: ``model_type`` ``deepseek_v2``, ``deepseek_v3``, ``kimi_k2``.

References: transformers ``models/deepseek_v2/modeling_deepseek_v2.py`` and
``models/deepseek_v3/modeling_deepseek_v3.py`` (Kimi K2 is the DeepSeek-V3 architecture:
``architectures: DeepseekV3ForCausalLM``). Pre-norm decoder layers of Multi-head Latent
Attention (:mod:`moestream.models.mla`, YaRN rope with its softmax mscale) and, from layer
``first_k_dense_replace`` on (every ``moe_layer_freq``-th layer, as DeepSeek's own code),
an MoE block: a float32 router, ``n_shared_experts`` resident shared experts added to the
routed experts' sum, and SwiGLU routed experts. Routing: V2 softmax with greedy or
group-limited greedy top-k (:func:`~moestream.models.moe.softmax_group_topk`); V3/K2
sigmoid with ``e_score_correction_bias`` and group-limited top-k (``noaux_tc``,
:func:`~moestream.models.moe.sigmoid_group_topk`). The other layers use a dense SwiGLU MLP.

The multi-token-prediction layers (``num_nextn_predict_layers``, stored after the decoder
layers, e.g. ``model.layers.61`` of DeepSeek-V3) are not loaded: generation does not use
them, and their tensors are reported as unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import ConfigError
from .base import (
    CausalLM,
    DecoderArgs,
    check_top_k,
    config_field,
    derived,
    field,
    positive,
    synth_tensors_of,
)
from .layers import MLP, DecoderLayer
from .mla import MLAttention
from .moe import Float32Router, StreamedMoE, sigmoid_group_topk, softmax_group_topk
from .rope import RotaryEmbedding, make_rope, mla_softmax_scale, rope_parameters

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields DeepSeek V2/V3 and Kimi K2 use beyond :class:`DecoderArgs` (names as Hugging
    Face spells them). ``rope`` is the config's RoPE settings (:func:`~moestream.models.rope.rope_parameters`);
    the routing settings default by version (V2: softmax, greedy; V3: sigmoid, ``noaux_tc``)."""

    rope_types = None  # default or yarn, checked below

    model_type: str = config_field()
    head_dim: int | None = derived()  # MLA's head dims are its own fields
    rope_theta: float | None = derived()  # in rope
    rope: dict = config_field(read=rope_parameters)
    intermediate_size: int = config_field(minimum=1)
    moe_intermediate_size: int = config_field(minimum=1)
    # transformers' attribute names: num_local_experts, num_experts
    n_routed_experts: int = config_field(minimum=1, aliases=("num_local_experts", "num_experts"))
    num_experts_per_tok: int = config_field(minimum=1)
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = config_field(1, minimum=1)
    q_lora_rank: int | None = config_field(None, minimum=1)
    kv_lora_rank: int = config_field(minimum=1)
    qk_nope_head_dim: int = config_field()
    qk_rope_head_dim: int = config_field()
    v_head_dim: int = config_field(minimum=1)
    scoring_func: str = derived()
    topk_method: str = derived()
    n_group: int = derived(1)
    topk_group: int = derived(1)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = derived(True)
    attention_bias: bool = False

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        mt, experts, top_k = v["model_type"], v["n_routed_experts"], v["num_experts_per_tok"]
        v2 = mt == "deepseek_v2"
        check_top_k(top_k, experts, experts_name="n_routed_experts")
        if field(cfg, "mlp_bias", bool, False):
            raise ConfigError(f"mlp_bias true is not supported for {mt}")
        v["scoring_func"] = scoring = field(cfg, "scoring_func", str, "softmax" if v2 else "sigmoid")
        v["topk_method"] = method = field(cfg, "topk_method", str, "greedy" if v2 else "noaux_tc")
        if v2 and (scoring, method) not in (("softmax", "greedy"), ("softmax", "group_limited_greedy")):
            raise ConfigError(f"scoring_func {scoring!r} with topk_method {method!r} is not supported for {mt} "
                              "(softmax with greedy or group_limited_greedy)")
        if not v2 and (scoring, method) != ("sigmoid", "noaux_tc"):
            raise ConfigError(f"scoring_func {scoring!r} with topk_method {method!r} is not supported for {mt} "
                              "(sigmoid with noaux_tc)")
        if method != "greedy":
            v["n_group"] = positive(cfg, "n_group", 1)
            v["topk_group"] = positive(cfg, "topk_group", v["n_group"])
        n_group, topk_group = v["n_group"], v["topk_group"]
        if experts % n_group or topk_group > n_group:
            raise ConfigError(f"n_group {n_group} must divide n_routed_experts {experts} and be >= topk_group "
                              f"{topk_group}")
        if not v2 and n_group > 1 and experts // n_group < 2:
            raise ConfigError(f"noaux_tc scores each group by its best two experts; n_group {n_group} leaves fewer")
        if topk_group * (experts // n_group) < top_k:
            raise ConfigError(f"topk_group {topk_group} groups hold fewer than num_experts_per_tok {top_k} experts")
        if v2 and v["norm_topk_prob"]:  # transformers' DeepseekV2TopkRouter has no renormalization
            raise ConfigError("norm_topk_prob true is not supported for deepseek_v2")
        if v["rope"]["rope_type"] not in ("default", "yarn"):
            raise ConfigError(f"rope type {v['rope']['rope_type']!r} is not supported for {mt} (default or yarn)")
        if v["num_key_value_heads"] != v["num_attention_heads"]:
            # MLA has one latent; transformers' MLA repeats kv heads, which has no effect here
            raise ConfigError(f"num_key_value_heads {v['num_key_value_heads']} must equal num_attention_heads "
                              f"{v['num_attention_heads']} for MLA")
        # DeepSeek checkpoints store rotary dims in interleaved pairs (V2's complex rope is the same)
        v["rope_interleave"] = True if v2 else field(cfg, "rope_interleave", bool, True)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def router(self):
        """The routing function for :class:`SummedSharedExpertsMoE` (see the module docstring)."""
        if self.scoring_func == "softmax":
            return partial(softmax_group_topk, top_k=self.num_experts_per_tok, n_group=self.n_group,
                           topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)
        return partial(sigmoid_group_topk, top_k=self.num_experts_per_tok, n_group=self.n_group,
                       topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                       routed_scaling_factor=self.routed_scaling_factor)


class SummedSharedExpertsMoE(StreamedMoE):
    """A streamed MoE block with a float32 router, an optional ``e_score_correction_bias``
    and resident shared experts summed ungated: ``routed(x) + shared_experts(x)``, x [T, H] -> [T, H]
    (Qwen-Next's one shared expert behind a sigmoid gate is :class:`moestream.models.hybrid.GatedSharedExpertMoE`).

    As transformers' ``DeepseekV3MoE`` / ``Glm4MoeMoE``. ``route`` is a routing function
    taking ``(logits [T, E] float32, bias=...)`` when ``correction_bias``, else ``logits`` alone.
    Checkpoint names: ``gate.weight`` [E, H], ``gate.e_score_correction_bias`` [E],
    ``shared_experts.{gate,up,down}_proj.weight``.
    """

    def __init__(
        self, hidden: int, num_experts: int, layer: int, route, shared_intermediate: int, correction_bias: bool,
        renormalize: bool,
    ):
        super().__init__(hidden, num_experts, layer, route, renormalize=renormalize)
        self.gate = Float32Router(hidden, num_experts, bias=False)
        if correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
            # read at call time: loading replaces the parameter object
            self.router = lambda logits: route(logits, bias=self.gate.e_score_correction_bias)
        self.shared_experts = MLP(hidden, shared_intermediate) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Model(CausalLM):
    """DeepSeek V2/V3 / Kimi K2 causal LM with streamed experts and a latent KV cache."""

    # as transformers' _keep_in_fp32_modules_strict: routing is computed in float32
    float32_parameters = (".gate.weight", ".gate.e_score_correction_bias")

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        # experts of layers past the decoder (multi-token prediction) are not streamed
        self.unloaded_layers_from = a.num_hidden_layers

    def make_rotary(self, a: ModelArgs) -> RotaryEmbedding:
        return make_rope(a.qk_rope_head_dim, a.rope["rope_theta"], a.rope, a.max_position_embeddings)

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = MLAttention(
            a.hidden_size, a.num_attention_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim, q_lora_rank=a.q_lora_rank, bias=a.attention_bias,
            scale=mla_softmax_scale(a.qk_nope_head_dim + a.qk_rope_head_dim, a.rope),
            rope="interleaved" if a.rope_interleave else "half",
        )
        if a.is_moe_layer(i):
            mlp = SummedSharedExpertsMoE(
                a.hidden_size, a.n_routed_experts, i, a.router(), a.moe_intermediate_size * a.n_shared_experts,
                correction_bias=a.scoring_func == "sigmoid", renormalize=a.norm_topk_prob,
            )
        else:
            mlp = MLP(a.hidden_size, a.intermediate_size)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, mlp)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes per token over all layers: ``layers * (kv_lora_rank + qk_rope_head_dim) * itemsize``."""
        return sum(layer.self_attn.cache_bytes_per_token(itemsize) for layer in self.decoder.layers)


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers, without MTP layers or FP8 quantization (synth writes
    bf16/fp16/fp32)."""
    out = dict(cfg)
    out["num_hidden_layers"] = layers
    out.pop("quantization_config", None)
    if "num_nextn_predict_layers" in out:
        out["num_nextn_predict_layers"] = 0
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)
