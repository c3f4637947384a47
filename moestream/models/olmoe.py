"""OLMoE (OLMoE-1B-7B): ``model_type: olmoe``.

Reference: transformers ``models/olmoe/modeling_olmoe.py``. Pre-norm decoder layers of
grouped-query attention whose q and k are RMS-normalized over the whole projection
(not per head) before rotary, optionally clamped to ``clip_qkv``, and a sparse MoE
block: softmax router, top-k, renormalized only when ``norm_topk_prob`` (false by
default), SwiGLU experts (per expert on disk, as transformers 5 ``save_pretrained`` writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..checkpoint import TensorInfo
from ..errors import ConfigError
from ..gguf_format import ATTN, QK_NORM, ROUTED, GGUFArchitecture, meta_value, softmax_moe_config
from .base import CausalLM, DecoderArgs, check_top_k, config_field, synth_tensors_of
from .layers import DecoderLayer
from .moe import StreamedMoE, softmax_topk
from .variants import VariantAttention

MODEL_TYPES = ("olmoe",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields OLMoE uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "olmoe"

    intermediate_size: int = config_field(minimum=1)
    num_experts: int = config_field(minimum=1)
    num_experts_per_tok: int = config_field(minimum=1)
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    clip_qkv: float | None = None

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        hidden, heads = v["hidden_size"], v["num_attention_heads"]
        check_top_k(v["num_experts_per_tok"], v["num_experts"])
        head_dim = hidden // heads if v["head_dim"] is None else v["head_dim"]
        if hidden % heads or head_dim != hidden // heads:
            raise ConfigError(f"head_dim must be hidden_size / num_attention_heads ({hidden} / {heads}) for olmoe")
        super().check(cfg, v)
        if v["clip_qkv"] is not None and v["clip_qkv"] <= 0:
            raise ConfigError(f"field 'clip_qkv' = {v['clip_qkv']} must be above 0 or null")


class Model(CausalLM):
    """OLMoE causal LM with streamed experts."""

    synth_biases_after = "router"

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = VariantAttention.of(a, bias=a.attention_bias, qk_norm="full", clip_qkv=a.clip_qkv)
        router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
        moe = StreamedMoE(a.hidden_size, a.num_experts, i, router, renormalize=a.norm_topk_prob)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, moe)


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    return dict(cfg, num_hidden_layers=layers)


synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """OLMoE (``olmoe``): softmax routing, full rotary, every layer MoE
    (:func:`moestream.gguf_format.softmax_moe_config`). ``OlmoeModel`` writes the experts' width as
    ``feed_forward_length``; llama.cpp's graph renormalizes the top-k weights only when told
    (``expert_weights_norm``, default false). q and k are stored as Hugging Face has them."""
    cfg, experts = softmax_moe_config(meta, tensors, where, spec)
    p = spec.name + "."
    cfg["num_experts"] = experts
    cfg["norm_topk_prob"] = meta_value(meta, p + "expert_weights_norm", where, bool, default=False)
    ff = meta_value(meta, p + "feed_forward_length", where, required=False, minimum=1)
    cfg["intermediate_size"] = meta_value(meta, p + "expert_feed_forward_length", where, default=ff, minimum=1)
    return cfg


GGUF = GGUFArchitecture("olmoe", "olmoe", "OlmoeForCausalLM",
                        ATTN + QK_NORM + ROUTED,  # q_norm and k_norm over the whole projection, as HF
                        gguf_config, added=3)
