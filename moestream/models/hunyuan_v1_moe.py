"""HunYuan MoE V1 (Hunyuan-A13B as transformers implements it): ``model_type: hunyuan_v1_moe``.

Reference: transformers ``models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py``. Pre-norm
decoder layers of grouped-query attention with per-head q/k RMSNorm applied after
rotary (``query_layernorm``, ``key_layernorm``), and a MoE block: router ``gate.wg`` on
float32 hidden states, softmax top-k (``moe_topk``) renormalized, SwiGLU experts plus a
shared MLP ``shared_mlp`` of the same width (``intermediate_size``), added after.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from .base import CausalLM, DecoderArgs, check_top_k, config_field, positive, synth_tensors_of
from .layers import MLP, DecoderLayer
from .moe import StreamedMoE, softmax_topk
from .variants import VariantAttention

MODEL_TYPES = ("hunyuan_v1_moe",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields HunYuan MoE V1 uses beyond :class:`DecoderArgs` (names as Hugging Face spells them)."""

    family = "hunyuan_v1_moe"

    intermediate_size: int = config_field(minimum=1)
    num_experts: int = config_field(read=lambda cfg: _one(cfg, "num_experts"))
    moe_topk: int = config_field(read=lambda cfg: _one(cfg, "moe_topk"))
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        check_top_k(v["moe_topk"], v["num_experts"], name="moe_topk")


def _one(cfg: dict, name: str) -> int:
    """An int field, or a per-layer list of one repeated value (the reference's experts take one count)."""
    value = cfg.get(name)
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        return positive({name: value[0]}, name)
    return positive(cfg, name)


class _WgGate(nn.Module):
    """The router ``gate.wg`` [E, H]: x [T, H] -> logits [T, E] through the router's own forward
    (in the compute dtype, which its weight is loaded in; a quantized ``wg`` holds packed words)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(x)


class HunYuanMoE(StreamedMoE):
    """Routed experts streamed, plus the resident ``shared_mlp``."""

    def __init__(self, a: ModelArgs, layer: int):
        router = partial(softmax_topk, top_k=a.moe_topk, norm_topk_prob=True)
        super().__init__(a.hidden_size, a.num_experts, layer, router, renormalize=True)
        self.gate = _WgGate(a.hidden_size, a.num_experts)
        self.shared_mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: routed experts plus the shared MLP (added after, as the reference)."""
        shared = self.shared_mlp(x)
        return super().forward(x) + shared


class Model(CausalLM):
    """HunYuan MoE V1 causal LM with streamed experts."""

    synth_biases_after = "router"

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = VariantAttention.of(a, bias=a.attention_bias, qk_norm="head", norm_after_rope=True,
                                   norm_names=("query_layernorm", "key_layernorm"))
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, HunYuanMoE(a, i))

    @property
    def top_k(self) -> int:
        """HunYuan names top-k ``moe_topk``."""
        return self.args.moe_topk


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers."""
    out = dict(cfg, num_hidden_layers=layers)
    for name in ("num_experts", "moe_topk"):
        if isinstance(cfg.get(name), list):
            out[name] = cfg[name][:layers]
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)
