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

from ..checkpoint import TensorInfo
from ..errors import CheckpointError, ConfigError
from ..gguf_format import (
    DENSE,
    MLA,
    ROUTED,
    SHARED_EXPERTS,
    GGUFArchitecture,
    GGUFFormat,
    as_float32,
    base_config,
    expert_count,
    float_weight,
    logical_shape,
    meta_value,
)
from ..quant import ggml
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
    attention_bias: bool = False  # MLA's: biases on q_a_proj, kv_a_proj_with_mqa and o_proj

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


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_moe_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """:func:`base_config` and the routed-expert fields DeepSeek-V3's config has (and GLM-4.5's, which copies
    it): routed and shared experts, their width, the leading dense blocks, the routing weights' scale and
    renormalization, expert groups, and YaRN.

    Raises:
        CheckpointError: a required key missing or of the wrong type, no embedding, no experts.
    """
    p = spec.name + "."
    cfg = base_config(meta, tensors, where, spec)
    experts = expert_count(meta, p, where)
    cfg.update({
        "n_routed_experts": experts,
        "moe_intermediate_size": meta_value(meta, p + "expert_feed_forward_length", where, minimum=1),
        "n_shared_experts": meta_value(meta, p + "expert_shared_count", where, minimum=0),
        "first_k_dense_replace": meta_value(meta, p + "leading_dense_block_count", where, minimum=0),
        # llama.cpp's defaults where the converter leaves a key out: no scaling, no renormalization, one group
        "routed_scaling_factor": meta_value(meta, p + "expert_weights_scale", where, float, default=1.0),
        "norm_topk_prob": meta_value(meta, p + "expert_weights_norm", where, bool, default=False),
        "n_group": meta_value(meta, p + "expert_group_count", where, default=1, minimum=1),
    })
    cfg["topk_group"] = meta_value(meta, p + "expert_group_used_count", where, default=cfg["n_group"], minimum=1)
    # the dense layers' width: the leading dense blocks need it
    dense = cfg["first_k_dense_replace"]
    cfg["intermediate_size"] = meta_value(meta, p + "feed_forward_length", where, required=dense > 0,
                                          default=None if dense else cfg["moe_intermediate_size"], minimum=1)
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {
            "rope_type": scaling, "factor": meta_value(meta, p + "rope.scaling.factor", where, float),
            "original_max_position_embeddings": meta_value(meta, p + "rope.scaling.original_context_length", where),
            # llama.cpp's YaRN defaults, as transformers'
            "beta_fast": meta_value(meta, p + "rope.scaling.yarn_beta_fast", where, float, default=32.0),
            "beta_slow": meta_value(meta, p + "rope.scaling.yarn_beta_slow", where, float, default=1.0)}
    return cfg


def gguf_gating(meta: dict, p: str, where, default: int) -> str:
    """``expert_gating_func`` as transformers' ``scoring_func`` (llama.cpp: 1 softmax, 2 sigmoid)."""
    gating = meta_value(meta, p + "expert_gating_func", where, default=default)
    if gating not in (1, 2):
        raise CheckpointError(f"{where}: metadata {p}expert_gating_func {gating}: moestream routes by softmax (1) or "
                              "sigmoid (2)")
    return "softmax" if gating == 1 else "sigmoid"


def gguf_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """DeepSeek-V2/V2.5/V3/R1 and Kimi K2 (``deepseek2``), as convert_hf_to_gguf.py's ``DeepseekV2Model`` writes
    them: family ``deepseek_v3`` when the experts are chosen by sigmoid (``expert_gating_func`` 2, with
    ``exp_probs_b`` = ``e_score_correction_bias``, ``noaux_tc``), else ``deepseek_v2`` (softmax, the default for
    V2 files without the key; greedy, or group-limited with ``expert_group_count`` > 1).

    MLA: ``attention.kv_lora_rank``, ``q_lora_rank`` (absent: a plain ``q_proj``, V2-Lite), ``rope.dimension_count``
    (the rope head dim) and the per-head q/k and v widths ``attention.key_length_mla`` / ``value_length_mla``
    (files from before llama.cpp's absorbed MLA give them as ``key_length`` / ``value_length``; the new ones hold
    the latent's widths there and ``head_count_kv`` 1). YaRN: llama.cpp keeps only ``yarn_log_multiplier``
    (0.1 * ``mscale_all_dim``) and assumes ``mscale`` = ``mscale_all_dim``, so the rotary cos/sin are unscaled
    and the softmax scale takes ``mscale(factor, mscale_all_dim)^2``, as transformers when the two are equal.

    Raises:
        CheckpointError: a required key (the MLA widths, expert widths and counts, ``leading_dense_block_count``)
            missing or of the wrong type, naming the file and key.
    """
    p = "deepseek2."
    cfg = gguf_moe_config(meta, tensors, where, spec)
    rope_dim = meta_value(meta, p + "rope.dimension_count", where, minimum=1)
    qk = meta_value(meta, p + "attention.key_length_mla", where, required=False, minimum=1)
    if qk is not None:
        v = meta_value(meta, p + "attention.value_length_mla", where, minimum=1)
    else:
        qk = meta_value(meta, p + "attention.key_length", where, minimum=1)
        v = meta_value(meta, p + "attention.value_length", where, minimum=1)
    if qk <= rope_dim:
        raise CheckpointError(f"{where}: metadata {p}attention.key_length_mla {qk} leaves no unrotated key dims "
                              f"beside rope.dimension_count {rope_dim}")
    scoring = gguf_gating(meta, p, where, default=1)
    groups = cfg["n_group"]
    cfg.update({
        "model_type": "deepseek_v3" if scoring == "sigmoid" else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if scoring == "sigmoid" else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": cfg["num_attention_heads"],  # the converter writes MLA's latent as one kv head
        "q_lora_rank": meta_value(meta, p + "attention.q_lora_rank", where, required=False, minimum=1),
        "kv_lora_rank": meta_value(meta, p + "attention.kv_lora_rank", where, minimum=1),
        "qk_nope_head_dim": qk - rope_dim, "qk_rope_head_dim": rope_dim, "v_head_dim": v,
        "scoring_func": scoring,
        "topk_method": "noaux_tc" if scoring == "sigmoid" else "group_limited_greedy" if groups > 1 else "greedy",
        "moe_layer_freq": 1,  # llama.cpp's deepseek2 graph: every layer from leading_dense_block_count on is MoE
        # DeepseekV2Model does not permute q/k: the rope dims stay in DeepSeek's interleaved pairs (llama.cpp
        # ropes deepseek2 as LLAMA_ROPE_TYPE_NORM, adjacent pairs)
        "rope_interleave": True,
    })
    cfg.pop("head_dim")  # key_length is the latent's width here; MLA's head dims are the fields above
    rope = cfg.get("rope_scaling")
    if rope is not None and rope["rope_type"] == "yarn":
        log_mul = meta_value(meta, p + "rope.scaling.yarn_log_multiplier", where, float, default=0.0)
        rope.update(mscale=log_mul / 0.1, mscale_all_dim=log_mul / 0.1, attention_factor=1.0)
    return cfg


def _kv_b(k_b: TensorInfo, v_b: TensorInfo, ckpt) -> torch.Tensor:
    """``kv_b_proj`` [H * (nope + v), rank] float32 from llama.cpp's ``attn_k_b`` [H, rank, nope] and ``attn_v_b``
    [H, v, rank]: per head the key rows (k_b transposed back) then the value rows."""
    wk, wv = float_weight(k_b, ckpt), float_weight(v_b, ckpt)
    return torch.cat([wk.transpose(1, 2), wv], dim=1).reshape(-1, wk.shape[1]).contiguous()


def gguf_tensors(tensors: dict[str, TensorInfo], cfg: dict, derived: dict, where, fmt: GGUFFormat) -> None:
    """``kv_b_proj`` back as transformers has it, a derived float32 tensor (MLA reads its rows directly, so it is
    never a quantized linear):

    * from ``attn_k_b`` + ``attn_v_b``: convert_hf_to_gguf.py's ``DeepseekV2Model`` (llama.cpp's absorbed MLA,
      2025 on) views ``kv_b_proj`` [H * (nope + v), rank] as [H, nope + v, rank], splits it into k_b [H, nope,
      rank] and v_b [H, v, rank] and stores k_b transposed, [H, rank, nope] (quantized along nope);
    * from ``attn_kv_b`` (older files), dequantized when it is block-quantized.

    Raises:
        CheckpointError: a layer with one half of the split, or a shape the config does not imply.
    """
    heads, rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for k_name in [n for n in tensors if n.endswith(".self_attn.k_b_proj.weight")]:
        attn = k_name[: -len(".k_b_proj.weight")]
        v_name, kv_name = attn + ".v_b_proj.weight", attn + ".kv_b_proj.weight"
        if v_name not in tensors:
            raise CheckpointError(f"{where}: tensor {tensors[k_name].name!r} has no attn_v_b beside it")
        k_b, v_b = tensors.pop(k_name), tensors.pop(v_name)
        if kv_name in tensors:  # a file holding both forms: the stored kv_b_proj is read (below)
            continue
        for info, want in ((k_b, (heads, rank, nope)), (v_b, (heads, v, rank))):
            if logical_shape(info) != want:
                raise CheckpointError(f"{info.file}: tensor {info.name!r} is {list(logical_shape(info))}; the "
                                      f"metadata (heads, kv_lora_rank, qk_nope, v) implies {list(want)}")
        tensors[kv_name] = as_float32(k_b, kv_name, (heads * (nope + v), rank))
        derived[kv_name] = partial(_kv_b, k_b, v_b)
    for name, info in list(tensors.items()):
        if name.endswith(".self_attn.kv_b_proj.weight") and name not in derived and ggml.block_type(info.dtype):
            tensors[name] = as_float32(info, name, logical_shape(info))
            derived[name] = partial(float_weight, info)


GGUF = GGUFArchitecture(
    "deepseek2", "deepseek_v3", "DeepseekV3ForCausalLM",  # deepseek_v2 when it routes by softmax (gguf_config)
    ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.o_proj", *MLA, *ROUTED, *DENSE,
     *SHARED_EXPERTS),
    gguf_config, gguf_tensors, own_head_dims=True, added=4)
