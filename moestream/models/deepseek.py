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
from .base import CausalLM, SynthTensor, field, positive
from .layers import MLP, KVCache, RMSNorm
from .mla import MLAttention
from .moe import Float32Router, StreamedMoE, sigmoid_group_topk, softmax_group_topk
from .rope import ScaledRotaryEmbedding, mla_softmax_scale, rope_inv_freq, rope_parameters

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields DeepSeek V2/V3 and Kimi K2 use (names as Hugging Face spells them)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope: dict
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        mt = field(cfg, "model_type", str)
        v2 = mt == "deepseek_v2"
        experts = field(cfg, "n_routed_experts", int, None)
        if experts is None:  # transformers' attribute names
            experts = positive(cfg, "num_local_experts" if "num_local_experts" in cfg else "num_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        if experts < 1 or top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and n_routed_experts {experts}")
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for {mt} (its experts use silu)")
        if field(cfg, "mlp_bias", bool, False):
            raise ConfigError(f"mlp_bias true is not supported for {mt}")
        scoring = field(cfg, "scoring_func", str, "softmax" if v2 else "sigmoid")
        method = field(cfg, "topk_method", str, "greedy" if v2 else "noaux_tc")
        if v2 and (scoring, method) not in (("softmax", "greedy"), ("softmax", "group_limited_greedy")):
            raise ConfigError(f"scoring_func {scoring!r} with topk_method {method!r} is not supported for {mt} "
                              "(softmax with greedy or group_limited_greedy)")
        if not v2 and (scoring, method) != ("sigmoid", "noaux_tc"):
            raise ConfigError(f"scoring_func {scoring!r} with topk_method {method!r} is not supported for {mt} "
                              "(sigmoid with noaux_tc)")
        grouped = method != "greedy"
        n_group = positive(cfg, "n_group", 1) if grouped else 1
        topk_group = positive(cfg, "topk_group", n_group) if grouped else 1
        if experts % n_group or topk_group > n_group:
            raise ConfigError(f"n_group {n_group} must divide n_routed_experts {experts} and be >= topk_group "
                              f"{topk_group}")
        if not v2 and n_group > 1 and experts // n_group < 2:
            raise ConfigError(f"noaux_tc scores each group by its best two experts; n_group {n_group} leaves fewer")
        if topk_group * (experts // n_group) < top_k:
            raise ConfigError(f"topk_group {topk_group} groups hold fewer than num_experts_per_tok {top_k} experts")
        norm = field(cfg, "norm_topk_prob", bool, False)
        if v2 and norm:  # transformers' DeepseekV2TopkRouter has no renormalization
            raise ConfigError("norm_topk_prob true is not supported for deepseek_v2")
        rope = rope_parameters(cfg)
        if rope["rope_type"] not in ("default", "yarn"):
            raise ConfigError(f"rope type {rope['rope_type']!r} is not supported for {mt} (default or yarn)")
        q_lora = field(cfg, "q_lora_rank", int, None)
        if q_lora is not None and q_lora < 1:
            raise ConfigError(f"field 'q_lora_rank' = {q_lora} must be at least 1 or null")
        heads = positive(cfg, "num_attention_heads")
        kv_heads = field(cfg, "num_key_value_heads", int, heads)
        if kv_heads != heads:  # MLA has one latent; transformers' MLA repeats kv heads, which has no effect here
            raise ConfigError(f"num_key_value_heads {kv_heads} must equal num_attention_heads {heads} for MLA")
        return cls(
            model_type=mt,
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=positive(cfg, "hidden_size"),
            num_hidden_layers=positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            intermediate_size=positive(cfg, "intermediate_size"),
            moe_intermediate_size=positive(cfg, "moe_intermediate_size"),
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=field(cfg, "n_shared_experts", int, 0),
            first_k_dense_replace=field(cfg, "first_k_dense_replace", int, 0),
            moe_layer_freq=positive(cfg, "moe_layer_freq", 1),
            q_lora_rank=q_lora,
            kv_lora_rank=positive(cfg, "kv_lora_rank"),
            qk_nope_head_dim=field(cfg, "qk_nope_head_dim", int),
            qk_rope_head_dim=field(cfg, "qk_rope_head_dim", int),
            v_head_dim=positive(cfg, "v_head_dim"),
            scoring_func=scoring,
            topk_method=method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm,
            routed_scaling_factor=field(cfg, "routed_scaling_factor", float, 1.0),
            rms_norm_eps=field(cfg, "rms_norm_eps", float, 1e-6),
            rope=rope,
            # DeepSeek checkpoints store rotary dims in interleaved pairs (V2's complex rope is the same)
            rope_interleave=True if v2 else field(cfg, "rope_interleave", bool, True),
            attention_bias=field(cfg, "attention_bias", bool, False),
            tie_word_embeddings=field(cfg, "tie_word_embeddings", bool, False),
            max_position_embeddings=field(cfg, "max_position_embeddings", int, None),
        )

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def router(self):
        """The routing function for :class:`SharedExpertMoE` (see the module docstring)."""
        if self.scoring_func == "softmax":
            return partial(softmax_group_topk, top_k=self.num_experts_per_tok, n_group=self.n_group,
                           topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)
        return partial(sigmoid_group_topk, top_k=self.num_experts_per_tok, n_group=self.n_group,
                       topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                       routed_scaling_factor=self.routed_scaling_factor)


class SharedExpertMoE(StreamedMoE):
    """A streamed MoE block with a float32 router, an optional ``e_score_correction_bias``
    and resident shared experts: ``routed(x) + shared_experts(x)``, x [T, H] -> [T, H].

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


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(
            a.hidden_size, a.num_attention_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim, q_lora_rank=a.q_lora_rank, bias=a.attention_bias,
            scale=mla_softmax_scale(a.qk_nope_head_dim + a.qk_rope_head_dim, a.rope),
            rope="interleaved" if a.rope_interleave else "half",
        )
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.is_moe_layer(i):
            self.mlp = SharedExpertMoE(
                a.hidden_size, a.n_routed_experts, i, a.router(), a.moe_intermediate_size * a.n_shared_experts,
                correction_bias=a.scoring_func == "sigmoid", renormalize=a.norm_topk_prob,
            )
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, i, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    """DeepSeek V2/V3 / Kimi K2 causal LM with streamed experts and a latent KV cache."""

    # as transformers' _keep_in_fp32_modules_strict: routing is computed in float32
    float32_parameters = (".gate.weight", ".gate.e_score_correction_bias")

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.qk_rope_head_dim, a.rope["rope_theta"],
            a.tie_word_embeddings, max_context=a.max_position_embeddings,
        )
        self.args = a
        # experts of layers past the decoder (multi-token prediction) are not streamed
        self.unloaded_layers_from = a.num_hidden_layers
        with torch.device("cpu"):
            self.rotary = ScaledRotaryEmbedding(*rope_inv_freq(a.rope, a.qk_rope_head_dim, a.max_position_embeddings))
        self.decoder.layers.extend(DecoderLayer(a, i) for i in range(a.num_hidden_layers))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.moe_intermediate_size, self.args.hidden_size

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


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a checkpoint of ``cfg``'s shapes, with per-expert experts as on the Hub."""
    a = ModelArgs.from_config(cfg)
    h = a.hidden_size
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        out += [SynthTensor(p + "input_layernorm.weight", (h,), "norm")]
        if a.q_lora_rank is None:
            out.append(SynthTensor(s + "q_proj.weight", (a.num_attention_heads * qk, h), "normal"))
        else:
            out += [
                SynthTensor(s + "q_a_proj.weight", (a.q_lora_rank, h), "normal"),
                SynthTensor(s + "q_a_layernorm.weight", (a.q_lora_rank,), "norm"),
                SynthTensor(s + "q_b_proj.weight", (a.num_attention_heads * qk, a.q_lora_rank), "normal"),
            ]
        out += [
            SynthTensor(s + "kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, h), "normal"),
            SynthTensor(s + "kv_a_layernorm.weight", (a.kv_lora_rank,), "norm"),
            SynthTensor(s + "kv_b_proj.weight",
                        (a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), "normal"),
            SynthTensor(s + "o_proj.weight", (h, a.num_attention_heads * a.v_head_dim), "out"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
        if a.attention_bias:
            if a.q_lora_rank is not None:
                out.append(SynthTensor(s + "q_a_proj.bias", (a.q_lora_rank,), "zeros"))
            out += [SynthTensor(s + "kv_a_proj_with_mqa.bias", (a.kv_lora_rank + a.qk_rope_head_dim,), "zeros"),
                    SynthTensor(s + "o_proj.bias", (h,), "zeros")]
        m = p + "mlp."
        if a.is_moe_layer(i):
            out += moe_synth_tensors(m, h, a.n_routed_experts, a.moe_intermediate_size,
                                     a.moe_intermediate_size * a.n_shared_experts, a.scoring_func == "sigmoid")
        else:
            out += mlp_synth_tensors(m, h, a.intermediate_size)
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out


def mlp_synth_tensors(prefix: str, hidden: int, inter: int) -> list[SynthTensor]:
    """A dense SwiGLU MLP's tensors under ``prefix`` (``...mlp.``)."""
    return [
        SynthTensor(prefix + "gate_proj.weight", (inter, hidden), "normal"),
        SynthTensor(prefix + "up_proj.weight", (inter, hidden), "normal"),
        SynthTensor(prefix + "down_proj.weight", (hidden, inter), "out"),
    ]


def moe_synth_tensors(
    prefix: str, hidden: int, experts: int, inter: int, shared_inter: int, bias: bool
) -> list[SynthTensor]:
    """A :class:`SharedExpertMoE` block's tensors under ``prefix``: router, correction bias, shared and
    per-expert routed experts."""
    out = [SynthTensor(prefix + "gate.weight", (experts, hidden), "normal")]
    if bias:
        out.append(SynthTensor(prefix + "gate.e_score_correction_bias", (experts,), "zeros"))
    if shared_inter:
        out += mlp_synth_tensors(prefix + "shared_experts.", hidden, shared_inter)
    for e in range(experts):
        out += mlp_synth_tensors(f"{prefix}experts.{e}.", hidden, inter)
    return out
