"""MiniMax-M2: ``model_type: minimax_m2``.

Reference: transformers ``models/minimax_m2/modeling_minimax_m2.py``. Pre-norm decoder
layers of full attention whose q and k are RMS-normalized over the whole projection,
with partial rotary embeddings (``rotary_dim`` or ``partial_rotary_factor``), and a MoE
block ``block_sparse_moe``: sigmoid routing with a correction bias for the top-k choice
and the chosen scores renormalized, kept in float32 (as Laguna's,
:func:`~moestream.models.laguna.laguna_sigmoid_topk`, without softcapping), SwiGLU
experts stored per expert as ``w1``/``w3``/``w2``, the bias as
``block_sparse_moe.e_score_correction_bias`` (what transformers 5 ``save_pretrained`` writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, DecoderArgs, check_top_k, config_field, synth_tensors_of
from .laguna import laguna_sigmoid_topk
from .layers import DecoderLayer
from .moe import StreamedMoE
from .rope import RotaryEmbedding, make_rope
from .variants import VariantAttention

MODEL_TYPES = ("minimax_m2",)


def _rope(cfg: dict) -> dict:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict) -> float:
    return float(_rope(cfg).get("rope_theta", cfg.get("rope_theta", 5000000.0)))


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config.json fields MiniMax-M2 uses beyond :class:`DecoderArgs` (names as Hugging Face spells them).

    ``rotary_dim`` is the rotated dimensions per head: ``partial_rotary_factor`` of ``head_dim``
    when the config gives a factor, else its ``rotary_dim``, else all.
    """

    family = "minimax_m2"

    rotary_dim: int | None = None
    intermediate_size: int = config_field(minimum=1)
    num_local_experts: int = config_field(minimum=1, aliases=("num_experts",))
    num_experts_per_tok: int = config_field(minimum=1)
    rope_theta: float = config_field(read=_rope_theta)

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        check_top_k(v["num_experts_per_tok"], v["num_local_experts"], experts_name="num_local_experts")
        head_dim, rotary = v["head_dim"], v["rotary_dim"]
        factor = _rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if factor is None:
            factor = rotary / head_dim if rotary else 1.0
        v["rotary_dim"] = rot = int(head_dim * factor)
        if rot < 2 or rot > head_dim or rot % 2:
            raise ConfigError(f"rotary_dim {rot} must be even and between 2 and head_dim {head_dim}")


class MiniMaxM2MoE(StreamedMoE):
    """MiniMax-M2's MoE block: router ``gate``, ``e_score_correction_bias`` [E], experts streamed."""

    synth_params_after = "gate"  # the correction bias follows the router in the checkpoint

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__(a.hidden_size, a.num_local_experts, layer, self._route, renormalize=True)
        self.top_k = a.num_experts_per_tok
        self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_local_experts), requires_grad=False)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the weights stay float32, as the reference's
        return laguna_sigmoid_topk(logits, self.e_score_correction_bias, self.top_k)


class Model(CausalLM):
    """MiniMax-M2 causal LM with streamed experts."""

    expert_names = ("w1", "w3", "w2")

    def make_rotary(self, a: ModelArgs) -> RotaryEmbedding:
        return make_rope(a.rotary_dim, a.rope_theta)

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        attn = VariantAttention.of(a, qk_norm="full")
        return DecoderLayer(a.hidden_size, a.rms_norm_eps, attn, MiniMaxM2MoE(a, i), mlp_name="block_sparse_moe")


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers (float weights: no ``quantization_config``)."""
    out = dict(cfg, num_hidden_layers=layers)
    out.pop("quantization_config", None)
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)
