"""GLM-4.5 / GLM-4.6 (GLM-4.5-Air, ...): ``model_type: glm4_moe``.

Reference: transformers ``models/glm4_moe/modeling_glm4_moe.py``. Pre-norm decoder layers
of grouped-query attention (biases on q/k/v but not o when ``attention_bias``, optional
per-head q/k RMSNorm when ``use_qk_norm``, rotary embedding on the first
``partial_rotary_factor`` of each head's dims) and, from layer ``first_k_dense_replace``
on, an MoE block as DeepSeek-V3's: float32 sigmoid router with ``e_score_correction_bias``
and group-limited top-k (:func:`~moestream.models.moe.sigmoid_group_topk`), resident shared
experts, SwiGLU routed experts. The first layers use a dense SwiGLU MLP. The
multi-token-prediction layers (``num_nextn_predict_layers``) are not loaded; their
tensors are reported as unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..checkpoint import TensorInfo
from ..errors import CheckpointError, ConfigError
from ..gguf_format import ATTN, DENSE, QK_NORM, ROUTED, SHARED_EXPERTS, GGUFArchitecture, meta_value
from . import deepseek
from .base import CausalLM, DecoderArgs, config_field, derived, synth_tensors_of
from .deepseek import SummedSharedExpertsMoE, gguf_gating, gguf_moe_config
from .layers import MLP, Attention, DecoderLayer
from .moe import sigmoid_group_topk
from .rope import RotaryEmbedding, make_rope, rope_parameters

MODEL_TYPES = ("glm4_moe",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields GLM-4.5 uses beyond :class:`DecoderArgs` (names as Hugging Face spells them).

    ``rope`` is the config's RoPE settings (:func:`~moestream.models.rope.rope_parameters`);
    ``rotary_dim`` the rotated dimensions per head (``partial_rotary_factor``, 0.5 by default).
    """

    family = "glm4_moe"
    rope_types = None  # default or yarn, checked by the rope

    rope_theta: float | None = derived()  # in rope
    rope: dict = config_field(read=rope_parameters)
    rotary_dim: int = derived()
    intermediate_size: int = config_field(minimum=1)
    moe_intermediate_size: int = config_field(minimum=1)
    n_routed_experts: int = config_field(minimum=1, aliases=("num_local_experts",))
    num_experts_per_tok: int = config_field(minimum=1)
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = config_field(1, minimum=1)
    topk_group: int = config_field(minimum=1, default_from="n_group")
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    use_qk_norm: bool = False

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        experts, groups, topk_group = v["n_routed_experts"], v["n_group"], v["topk_group"]
        if v["num_experts_per_tok"] > experts:
            raise ConfigError(f"num_experts_per_tok {v['num_experts_per_tok']} exceeds n_routed_experts {experts}")
        if experts % groups or topk_group > groups or (groups > 1 and experts // groups < 2):
            raise ConfigError(f"n_group {groups} / topk_group {topk_group} do not fit n_routed_experts "
                              f"{experts} (equal groups of at least 2, topk_group <= n_group)")
        factor = v["rope"].get("partial_rotary_factor", 0.5)  # transformers' default for glm4_moe
        v["rotary_dim"] = rot = int(v["head_dim"] * factor)
        if rot < 2 or rot % 2 or rot > v["head_dim"]:
            raise ConfigError(f"partial_rotary_factor {factor} gives {rot} rotary dims of head_dim "
                              f"{v['head_dim']}; expected an even number from 2 to head_dim")
        if v["num_attention_heads"] % v["num_key_value_heads"]:
            raise ConfigError(f"num_attention_heads {v['num_attention_heads']} is not a multiple of "
                              f"num_key_value_heads {v['num_key_value_heads']}")

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


class GlmAttention(Attention):
    """Grouped-query attention with partial rotary, as transformers' ``Glm4MoeAttention``: rotary
    (rotate-half) on the first ``rotary_dim`` dims of each q/k head (the width of the model's cos/sin),
    the rest passed through; q/k/v biases when ``bias`` (o has none); per-head q/k RMSNorm when
    ``qk_norm_eps`` is set. x [T, H] -> [T, H].
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm_eps: float | None):
        super().__init__(hidden, heads, kv_heads, head_dim, bias=bias, qk_norm_eps=qk_norm_eps)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


def _router(a: ModelArgs):
    """sigmoid_group_topk with the config's settings; the correction bias is passed at call time."""

    def route(logits, bias):
        return sigmoid_group_topk(logits, a.num_experts_per_tok, bias, a.n_group, a.topk_group, a.norm_topk_prob,
                                  a.routed_scaling_factor)
    return route


class Model(CausalLM):
    """GLM-4.5 causal LM with streamed experts."""

    float32_parameters = (".gate.weight", ".gate.e_score_correction_bias")

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        self.unloaded_layers_from = a.num_hidden_layers  # the MTP layers follow the decoder layers

    def make_rotary(self, a: ModelArgs) -> RotaryEmbedding:
        return make_rope(a.rotary_dim, a.rope["rope_theta"], a.rope, a.max_position_embeddings)

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = GlmAttention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                            a.attention_bias, a.rms_norm_eps if a.use_qk_norm else None)
        if a.is_moe_layer(i):
            mlp = SummedSharedExpertsMoE(a.hidden_size, a.n_routed_experts, i, _router(a),
                                  a.moe_intermediate_size * a.n_shared_experts, correction_bias=True,
                                  renormalize=a.norm_topk_prob)
        else:
            mlp = MLP(a.hidden_size, a.intermediate_size)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, mlp)

    def synth_rank(self, name: str) -> int:
        """synth lists the q/k norms after the attention biases."""
        return 2 if name.startswith(("self_attn.q_norm.", "self_attn.k_norm.")) else super().synth_rank(name)


synth_config = deepseek.synth_config  # the same cut: no MTP layers, no quantization
synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """GLM-4.5 / GLM-4.6 (``glm4moe``), as convert_hf_to_gguf.py's ``Glm4MoeModel`` writes them: family
    ``glm4_moe``. ``block_count`` includes the ``nextn_predict_layers`` multi-token-prediction layers written
    after the decoder layers (loaded by no family: reported unused); ``rope.dimension_count`` is the rotated part
    of each head (``partial_rotary_factor``); the sigmoid router's bias is ``exp_probs_b``; ``attention_bias`` and
    ``use_qk_norm`` are read off the tensors (``attn_q.bias``, ``attn_q_norm``). Neither q nor k is permuted
    (llama.cpp ropes glm4moe NEOX-style, transformers' rotate-half).

    Raises:
        CheckpointError: a required key missing or of the wrong type (naming the file and key), softmax
            routing, or a rotary width the family cannot take.
    """
    p = "glm4moe."
    cfg = gguf_moe_config(meta, tensors, where, spec)
    if gguf_gating(meta, p, where, default=2) != "sigmoid":  # llama.cpp's default for glm4moe
        raise CheckpointError(f"{where}: metadata {p}expert_gating_func 1 (softmax): glm4_moe routes by sigmoid (2)")
    nextn = meta_value(meta, p + "nextn_predict_layers", where, default=0, minimum=0)
    head_dim = cfg["head_dim"]
    rot = meta_value(meta, p + "rope.dimension_count", where, default=head_dim, minimum=1)
    factor = rot / head_dim
    if int(head_dim * factor) != rot:  # the family rebuilds the rotary width as int(head_dim * factor)
        raise CheckpointError(f"{where}: metadata {p}rope.dimension_count {rot} of head dim {head_dim} is not a "
                              "rotary fraction glm4_moe can represent")
    if nextn >= cfg["num_hidden_layers"]:
        raise CheckpointError(f"{where}: metadata {p}nextn_predict_layers {nextn} leaves no decoder layers of "
                              f"block_count {cfg['num_hidden_layers']}")
    cfg.update({
        "num_hidden_layers": cfg["num_hidden_layers"] - nextn, "num_nextn_predict_layers": nextn,
        "partial_rotary_factor": factor,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "use_qk_norm": "model.layers.0.self_attn.q_norm.weight" in tensors,
    })
    return cfg


GGUF = GGUFArchitecture("glm4moe", "glm4_moe", "Glm4MoeForCausalLM",
                        ATTN + QK_NORM + ROUTED + DENSE + SHARED_EXPERTS,  # post_attention_layernorm is
                        # llama.cpp's post_attention_norm there (glm4moe has no ffn_norm)
                        gguf_config, added=5)
