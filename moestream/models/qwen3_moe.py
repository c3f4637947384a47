"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): ``model_type: qwen3_moe``.

Reference: transformers ``models/qwen3_moe/modeling_qwen3_moe.py``. Pre-norm decoder
layers of grouped-query attention (per-head RMSNorm on q and k, rotary embeddings) and
a sparse MoE block: softmax router, top-k experts (renormalized when
``norm_topk_prob``), SwiGLU experts. Layers listed in ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid use a dense SwiGLU MLP instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..checkpoint import TensorInfo
from ..errors import ConfigError
from ..gguf_format import ATTN, QK_NORM, ROUTED, GGUFArchitecture, meta_value, softmax_moe_config
from .base import CausalLM, DecoderArgs, check_top_k, config_field, derived, positive, synth_tensors_of
from .layers import MLP, Attention, DecoderLayer
from .moe import StreamedMoE, softmax_topk

MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields Qwen3-MoE uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "qwen3_moe"
    rope_refusal = "yet (only default)"

    intermediate_size: int = config_field(minimum=1)
    moe_intermediate_size: int = config_field(minimum=1)
    # transformers 5 writes num_local_experts; published configs say num_experts
    num_experts: int = config_field(minimum=1, aliases=("num_local_experts",))
    num_experts_per_tok: int = config_field(minimum=1)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = config_field(1, minimum=1)
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = derived()  # read only with use_sliding_window

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        check_top_k(v["num_experts_per_tok"], v["num_experts"])
        if v["use_sliding_window"]:
            v["sliding_window"] = positive(cfg, "sliding_window")
        if not all(isinstance(i, int) for i in v["mlp_only_layers"]):
            raise ConfigError(f"mlp_only_layers {list(v['mlp_only_layers'])!r} is not a list of layer indices")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


class Model(CausalLM):
    """Qwen3-MoE causal LM with streamed experts."""

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                         bias=a.attention_bias, qk_norm_eps=a.rms_norm_eps, window=a.sliding_window)
        if a.is_moe_layer(i):
            router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
            mlp = StreamedMoE(a.hidden_size, a.num_experts, i, router, renormalize=a.norm_topk_prob)
        else:
            mlp = MLP(a.hidden_size, a.intermediate_size)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, mlp)


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    out = dict(cfg)
    out["num_hidden_layers"] = layers
    if "max_window_layers" in out:
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    out["mlp_only_layers"] = [i for i in cfg.get("mlp_only_layers", []) if i < layers]
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """Qwen3-MoE (``qwen3moe``): softmax routing, full rotary, every layer MoE
    (:func:`moestream.gguf_format.softmax_moe_config`); the experts' width is ``expert_feed_forward_length``.
    llama.cpp's graph always renormalizes the top-k router weights (``norm_topk_prob``), which the metadata
    does not say. q and k are stored as Hugging Face has them: nothing is undone."""
    cfg, experts = softmax_moe_config(meta, tensors, where, spec)
    p = spec.name + "."
    cfg["num_experts"] = experts
    cfg["moe_intermediate_size"] = meta_value(meta, p + "expert_feed_forward_length", where, minimum=1)
    cfg["norm_topk_prob"] = meta_value(meta, p + "expert_weights_norm", where, bool, default=True)
    # feed_forward_length is the dense MLP's width (unused while every layer is MoE)
    cfg["intermediate_size"] = meta_value(meta, p + "feed_forward_length", where,
                                          default=cfg["moe_intermediate_size"], minimum=1)
    return cfg


GGUF = GGUFArchitecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", ATTN + QK_NORM + ROUTED, gguf_config, added=1)
