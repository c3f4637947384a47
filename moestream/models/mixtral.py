"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): ``model_type: mixtral``.

Reference: transformers ``models/mixtral/modeling_mixtral.py``. Pre-norm decoder layers of
grouped-query attention (rotary, no biases, a sliding window over every layer when
``sliding_window`` is set) and a sparse MoE block ``block_sparse_moe``: softmax router in
float32, top-k, always renormalized, SwiGLU experts stored per expert as ``w1`` (gate),
``w3`` (up) and ``w2`` (down), which is also what transformers 5 ``save_pretrained`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from .base import CausalLM, DecoderArgs, check_top_k, config_field, synth_tensors_of
from .layers import Attention, DecoderLayer
from .moe import StreamedMoE, softmax_topk

MODEL_TYPES = ("mixtral",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields Mixtral uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "mixtral"

    intermediate_size: int = config_field(minimum=1)
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
