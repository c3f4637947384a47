"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): ``model_type: mixtral``.

Reference: transformers ``models/mixtral/modeling_mixtral.py``. Pre-norm decoder layers of
grouped-query attention (rotary, no biases, a sliding window over every layer when
``sliding_window`` is set) and a sparse MoE block ``block_sparse_moe``: softmax router in
float32, top-k, always renormalized, SwiGLU experts stored per expert as ``w1`` (gate),
``w3`` (up) and ``w2`` (down), which is also what transformers 5 ``save_pretrained`` writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch

from ..checkpoint import TensorInfo
from ..gguf_format import ATTN, GGUFArchitecture, GGUFFormat, meta_value, softmax_moe_config
from .base import CausalLM, DecoderArgs, check_top_k, config_field, synth_tensors_of
from .layers import Attention, DecoderLayer
from .moe import StreamedMoE, softmax_topk

MODEL_TYPES = ("mixtral",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields Mixtral uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "mixtral"

    intermediate_size: int = config_field(minimum=1)  # each expert's width (every layer is MoE)
    num_local_experts: int = config_field(minimum=1)
    num_experts_per_tok: int = config_field(minimum=1)
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = config_field(None, minimum=1)

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        check_top_k(v["num_experts_per_tok"], v["num_local_experts"], experts_name="num_local_experts")


def mixtral_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing, as transformers' ``MixtralTopKRouter``: softmax in float32, top-k, renormalized.

    Returns ``(weights [T, K] float32, indices [T, K] int64)``; the weights stay float32
    as in the reference (the expert output is scaled in float32, then cast).
    """
    return softmax_topk(logits.float(), top_k, True)


class Model(CausalLM):
    """Mixtral causal LM with streamed experts."""

    expert_names = ("w1", "w3", "w2")

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                         window=a.sliding_window)
        moe = StreamedMoE(a.hidden_size, a.num_local_experts, i, partial(mixtral_route, top_k=a.num_experts_per_tok),
                          renormalize=True)
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, moe, mlp_name="block_sparse_moe")


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    return dict(cfg, num_hidden_layers=layers)


synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """Mixtral (``llama`` with experts): softmax routing, full rotary, every layer MoE
    (:func:`moestream.gguf_format.softmax_moe_config`); convert_hf_to_gguf.py writes the experts' width as
    ``feed_forward_length``."""
    cfg, experts = softmax_moe_config(meta, tensors, where, spec)
    p = spec.name + "."
    cfg["num_local_experts"] = experts
    ff = meta_value(meta, p + "feed_forward_length", where, required=False, minimum=1)
    cfg["intermediate_size"] = meta_value(meta, p + "expert_feed_forward_length", where, default=ff, minimum=1)
    return cfg


def _unpermute(info: TensorInfo, heads: int, ckpt) -> torch.Tensor:
    """q or k rows [heads * D, ...] back in Hugging Face order from llama.cpp's (``LlamaModel.permute``
    stores row ``(h, i, j)`` of each head's pairs for Hugging Face row ``(h, j, i)``; j in 0..1, i < D/2).
    Whole rows move, so it holds for block-quantized rows too."""
    t = ckpt.read_info(info)
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def gguf_tensors(tensors: dict[str, TensorInfo], cfg: dict, derived: dict, where, fmt: GGUFFormat) -> None:
    """Mixtral (``llama``): the q and k rows convert_hf_to_gguf.py permutes (``LlamaModel.permute``, for llama.cpp's
    interleaved rotary embedding) read back into Hugging Face order (:func:`_unpermute`; whole rows move, any type)."""
    for hf, info in tensors.items():
        m = re.match(r"^model\.layers\.\d+\.self_attn\.([qk])_proj\.(weight|bias)$", hf)
        if m:
            heads = cfg["num_attention_heads"] if m[1] == "q" else cfg["num_key_value_heads"]
            derived[hf] = partial(_unpermute, info, heads)


# Names gguf's map no longer lists: Mixtral conversions from before llama.cpp stacked the experts (early 2024),
# one tensor per expert (llama.cpp still reads them)
GGUF = GGUFArchitecture(
    "llama", "mixtral", "MixtralForCausalLM",
    ATTN + ("block_sparse_moe.gate", "block_sparse_moe.experts.w1", "block_sparse_moe.experts.w3",
            "block_sparse_moe.experts.w2"),  # Mixtral: llama with experts
    gguf_config, gguf_tensors, added=2,
    extra_names=(("blk.{i}.ffn_gate.{e}", "model.layers.{i}.block_sparse_moe.experts.{e}.w1"),
                 ("blk.{i}.ffn_up.{e}", "model.layers.{i}.block_sparse_moe.experts.{e}.w3"),
                 ("blk.{i}.ffn_down.{e}", "model.layers.{i}.block_sparse_moe.experts.{e}.w2")))
