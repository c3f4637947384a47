"""DeepSeek-V3.2 (DeepSeek-V3.2-Exp, V3.2): ``model_type: deepseek_v32``.

Reference: transformers ``models/deepseek_v32/modeling_deepseek_v32.py``. DeepSeek-V3 (see
:mod:`moestream.models.deepseek`) with DeepSeek Sparse Attention: in every layer a
lightning indexer scores each earlier token for each query, and the query attends only
to the ``index_topk`` best (all of them while the context is at most ``index_topk``
tokens). The indexer's keys [index_head_dim] are kept per token in the KV cache beside
the MLA latent. As transformers, the indexer scores in float32 without the reference
kernel's Hadamard rotation (orthogonal: same dot products) and FP8 quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from . import deepseek, ops
from .base import SynthTensor, config_field, synth_tensors_of
from .layers import KVCache
from .mla import MLAttention
from .rope import apply_rotary, mla_softmax_scale

MODEL_TYPES = ("deepseek_v32",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(deepseek.ModelArgs):
    """DeepSeek-V3's fields plus the indexer's (``index_n_heads``, ``index_head_dim``, ``index_topk``)."""

    index_n_heads: int = config_field(64, minimum=1)
    index_head_dim: int = config_field(128, minimum=1)
    index_topk: int = config_field(2048, minimum=1)
    mlp_layer_types: tuple[str, ...] | None = None

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        if v["q_lora_rank"] is None:
            raise ConfigError("deepseek_v32 needs q_lora_rank (its indexer reads the low-rank query)")
        types, layers = v["mlp_layer_types"], v["num_hidden_layers"]
        if types is not None and (len(types) != layers or set(types) - {"dense", "sparse"}):
            raise ConfigError(f"mlp_layer_types {list(types)!r}: expected 'dense' or 'sparse' for each of "
                              f"{layers} layers")
        if v["index_head_dim"] < v["qk_rope_head_dim"]:
            raise ConfigError(f"index_head_dim {v['index_head_dim']} is below qk_rope_head_dim "
                              f"{v['qk_rope_head_dim']}")

    def is_moe_layer(self, i: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[i] == "sparse"
        return super().is_moe_layer(i)


class Indexer(nn.Module):
    """DeepSeek Sparse Attention's lightning indexer, as transformers' ``DeepseekV32Indexer``.

    For query t and key s: ``sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(D)) / sqrt(H)``, with
    ``q = wq_b(q_resid)`` [H, D] and ``k = LayerNorm(wk(x))`` [D] (rope, rotate-half, on their
    first ``rope_dim`` dims), ``w = weights_proj(x)`` in float32. Keys go to ``kv`` slot ``slot``.
    """

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int, topk: int,
                 slot: int):
        super().__init__()
        self.heads, self.head_dim, self.rope_dim, self.topk, self.slot = heads, head_dim, rope_dim, topk, slot
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def forward(self, x, q_resid, cos, sin, kv: KVCache, start: int, causal: torch.Tensor | None):
        """Boolean [T, start+T]: the causal keys among each query's ``index_topk`` best (None: all keys)."""
        t = x.shape[0]
        q = self.wq_b(q_resid).view(t, self.heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        q = apply_rotary(q, cos, sin)  # the first rope_dim (the cos width) dims rotate
        k = apply_rotary(self.k_norm(self.wk(x)), cos, sin)
        keys = kv.update(self.slot, start, k[None], k.new_empty(1, t, 0))[0][0]  # [S, D]
        s = keys.shape[0]
        if s <= self.topk:  # every key is among the top-k
            return causal
        w = ops.linear(x.float(), self.weights_proj.weight.float()) * self.heads**-0.5  # [T, H]
        if x.device.type == "cpu":
            # per head a linear over the keys (each score one fixed reduction), summed over heads in order
            kf = keys.float()
            index = None
            for h in range(self.heads):
                part = w[:, h : h + 1] * F.relu(ops.linear(q[h].float(), kf) * self.head_dim**-0.5)
                index = part if index is None else index + part
        else:
            scores = F.relu(torch.matmul(q.float(), keys.float().T) * self.head_dim**-0.5)  # [H, T, S]
            index = torch.matmul(w[:, None, :], scores.transpose(0, 1))[:, 0]  # [T, S]
        if causal is not None:
            index = index.masked_fill(~causal, float("-inf"))
        chosen = index.topk(self.topk, dim=-1).indices
        mask = torch.zeros(t, s, dtype=torch.bool, device=x.device).scatter_(1, chosen, True)
        return mask if causal is None else mask & causal


class SparseMLAttention(MLAttention):
    """MLA whose queries attend only to the keys the :class:`Indexer` (``self.indexer``) picks."""

    def __init__(self, a: ModelArgs, i: int):
        super().__init__(
            a.hidden_size, a.num_attention_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim, q_lora_rank=a.q_lora_rank, bias=a.attention_bias,
            scale=mla_softmax_scale(a.qk_nope_head_dim + a.qk_rope_head_dim, a.rope), rope="interleaved",
        )
        self.indexer = Indexer(a.hidden_size, a.q_lora_rank, a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim,
                               a.index_topk, slot=a.num_hidden_layers + i)

    def key_mask(self, x, q_resid, cos, sin, kv, layer, start, causal):
        return self.indexer(x, q_resid, cos, sin, kv, start, causal)


class Model(deepseek.Model):
    """DeepSeek-V3.2 causal LM: DeepSeek-V3 with sparse attention."""

    float32_parameters = deepseek.Model.float32_parameters + (".indexer.weights_proj.weight",)

    def make_layer(self, a: ModelArgs, i: int) -> nn.Module:
        layer = super().make_layer(a, i)
        layer.self_attn = SparseMLAttention(a, i)
        return layer

    def new_kv_cache(self, capacity: int = 256) -> KVCache:
        """Slots 0..L-1: MLA latents and rope keys; L..2L-1: the indexer's keys."""
        return KVCache(2 * len(self.decoder.layers), capacity)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes per token over all layers, the indexer's keys included."""
        return super().kv_bytes_per_token(itemsize) + len(self.decoder.layers) * self.args.index_head_dim * itemsize

    def synth_tensors(self) -> list[SynthTensor]:
        """DeepSeek-V3's tensors, then every layer's indexer (as synth has listed them)."""
        out = super().synth_tensors()
        return [t for t in out if ".indexer." not in t.name] + [t for t in out if ".indexer." in t.name]


def synth_config(cfg: dict, layers: int) -> dict:
    """As DeepSeek-V3's (:func:`moestream.models.deepseek.synth_config`), ``mlp_layer_types`` cut too."""
    out = deepseek.synth_config(cfg, layers)
    if isinstance(out.get("mlp_layer_types"), list):
        out["mlp_layer_types"] = out["mlp_layer_types"][:layers]
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)
