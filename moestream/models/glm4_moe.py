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

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .base import CausalLM, SynthTensor, field, positive
from .deepseek import SharedExpertMoE, mlp_synth_tensors, moe_synth_tensors
from .layers import MLP, Attention, KVCache, RMSNorm, apply_rotary, attention_mask
from .moe import sigmoid_group_topk
from .rope import ScaledRotaryEmbedding, rope_inv_freq, rope_parameters

MODEL_TYPES = ("glm4_moe",)


class ModelArgs:
    """The config.json fields GLM-4.5 uses (names as Hugging Face spells them), parsed by :meth:`from_config`."""

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict. Raises ConfigError naming the bad field."""
        a = cls()
        a.vocab_size = positive(cfg, "vocab_size")
        a.hidden_size = positive(cfg, "hidden_size")
        a.num_hidden_layers = positive(cfg, "num_hidden_layers")
        a.num_attention_heads = positive(cfg, "num_attention_heads")
        a.num_key_value_heads = positive(cfg, "num_key_value_heads", a.num_attention_heads)
        a.head_dim = field(cfg, "head_dim", int, None) or a.hidden_size // a.num_attention_heads
        a.intermediate_size = positive(cfg, "intermediate_size")
        a.moe_intermediate_size = positive(cfg, "moe_intermediate_size")
        experts = field(cfg, "n_routed_experts", int, None)
        a.n_routed_experts = experts if experts is not None else positive(cfg, "num_local_experts")
        a.num_experts_per_tok = positive(cfg, "num_experts_per_tok")
        if a.num_experts_per_tok > a.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok {a.num_experts_per_tok} exceeds n_routed_experts {experts}")
        a.n_shared_experts = field(cfg, "n_shared_experts", int, 0)
        a.first_k_dense_replace = field(cfg, "first_k_dense_replace", int, 0)
        a.n_group = positive(cfg, "n_group", 1)
        a.topk_group = positive(cfg, "topk_group", a.n_group)
        if a.n_routed_experts % a.n_group or a.topk_group > a.n_group or (
            a.n_group > 1 and a.n_routed_experts // a.n_group < 2
        ):
            raise ConfigError(f"n_group {a.n_group} / topk_group {a.topk_group} do not fit n_routed_experts "
                              f"{a.n_routed_experts} (equal groups of at least 2, topk_group <= n_group)")
        a.norm_topk_prob = field(cfg, "norm_topk_prob", bool, True)
        a.routed_scaling_factor = field(cfg, "routed_scaling_factor", float, 1.0)
        a.rms_norm_eps = field(cfg, "rms_norm_eps", float, 1e-5)
        a.attention_bias = field(cfg, "attention_bias", bool, False)
        a.use_qk_norm = field(cfg, "use_qk_norm", bool, False)
        a.tie_word_embeddings = field(cfg, "tie_word_embeddings", bool, False)
        a.max_position_embeddings = field(cfg, "max_position_embeddings", int, None)
        act = field(cfg, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported for glm4_moe (its experts use silu)")
        a.rope = rope_parameters(cfg)
        factor = a.rope.get("partial_rotary_factor", 0.5)  # transformers' default for glm4_moe
        a.rotary_dim = int(a.head_dim * factor)
        if a.rotary_dim < 2 or a.rotary_dim % 2 or a.rotary_dim > a.head_dim:
            raise ConfigError(f"partial_rotary_factor {factor} gives {a.rotary_dim} rotary dims of head_dim "
                              f"{a.head_dim}; expected an even number from 2 to head_dim")
        if a.num_attention_heads % a.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {a.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {a.num_key_value_heads}")
        return a

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


class GlmAttention(Attention):
    """Grouped-query attention with partial rotary, as transformers' ``Glm4MoeAttention``.

    Rotary (rotate-half) on the first ``rotary_dim`` dims of each q/k head, the rest passed
    through; q/k/v biases when ``bias`` (o has none); per-head q/k RMSNorm when
    ``qk_norm_eps`` is set. x [T, H] -> [T, H].
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, bias: bool,
                 qk_norm_eps: float | None):
        super().__init__(hidden, heads, kv_heads, head_dim, bias=bias, qk_norm_eps=qk_norm_eps)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.rotary_dim = rotary_dim

    def forward(self, x: torch.Tensor, cos, sin, kv: KVCache, layer: int, start: int) -> torch.Tensor:
        t, r = x.shape[0], self.rotary_dim
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        q = torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        keys, values = kv.update(layer, start, k, v)
        mask = attention_mask(start, t, None, x.device)
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=self.scale,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(t, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = GlmAttention(
            a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rotary_dim,
            a.attention_bias, a.rms_norm_eps if a.use_qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.is_moe_layer(i):
            route = _router(a)
            self.mlp = SharedExpertMoE(
                a.hidden_size, a.n_routed_experts, i, route, a.moe_intermediate_size * a.n_shared_experts,
                correction_bias=True, renormalize=a.norm_topk_prob,
            )
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, i, start)
        return h + self.mlp(self.post_attention_layernorm(h))


def _router(a: ModelArgs):
    """sigmoid_group_topk with the config's settings; the correction bias is passed at call time."""

    def route(logits: torch.Tensor, bias: torch.Tensor):
        return sigmoid_group_topk(logits, a.num_experts_per_tok, bias, a.n_group, a.topk_group, a.norm_topk_prob,
                                  a.routed_scaling_factor)
    return route


class Model(CausalLM):
    """GLM-4.5 causal LM with streamed experts."""

    float32_parameters = (".gate.weight", ".gate.e_score_correction_bias")

    def __init__(self, a: ModelArgs):
        super().__init__(
            a.vocab_size, a.hidden_size, a.rms_norm_eps, a.rotary_dim, a.rope["rope_theta"], a.tie_word_embeddings,
            max_context=a.max_position_embeddings,
        )
        self.args = a
        self.unloaded_layers_from = a.num_hidden_layers  # the MTP layers follow the decoder layers
        with torch.device("cpu"):
            self.rotary = ScaledRotaryEmbedding(*rope_inv_freq(a.rope, a.rotary_dim, a.max_position_embeddings))
        self.decoder.layers.extend(DecoderLayer(a, i) for i in range(a.num_hidden_layers))

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden) of one routed expert's gate projection."""
        return self.args.moe_intermediate_size, self.args.hidden_size


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers, without MTP layers or quantization."""
    out = dict(cfg)
    out["num_hidden_layers"] = layers
    out.pop("quantization_config", None)
    if "num_nextn_predict_layers" in out:
        out["num_nextn_predict_layers"] = 0
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a GLM-4.5 checkpoint of ``cfg``'s shapes, with per-expert experts as on the Hub."""
    a = ModelArgs.from_config(cfg)
    h, hd = a.hidden_size, a.head_dim
    out = [SynthTensor("model.embed_tokens.weight", (a.vocab_size, h), "embed")]
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        out += [
            SynthTensor(p + "input_layernorm.weight", (h,), "norm"),
            SynthTensor(s + "q_proj.weight", (a.num_attention_heads * hd, h), "normal"),
            SynthTensor(s + "k_proj.weight", (a.num_key_value_heads * hd, h), "normal"),
            SynthTensor(s + "v_proj.weight", (a.num_key_value_heads * hd, h), "normal"),
            SynthTensor(s + "o_proj.weight", (h, a.num_attention_heads * hd), "out"),
            SynthTensor(p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
        if a.attention_bias:
            for proj, n in (("q", a.num_attention_heads), ("k", a.num_key_value_heads), ("v", a.num_key_value_heads)):
                out.append(SynthTensor(s + f"{proj}_proj.bias", (n * hd,), "zeros"))
        if a.use_qk_norm:
            out += [SynthTensor(s + "q_norm.weight", (hd,), "norm"), SynthTensor(s + "k_norm.weight", (hd,), "norm")]
        if a.is_moe_layer(i):
            out += moe_synth_tensors(p + "mlp.", h, a.n_routed_experts, a.moe_intermediate_size,
                                     a.moe_intermediate_size * a.n_shared_experts, True)
        else:
            out += mlp_synth_tensors(p + "mlp.", h, a.intermediate_size)
    out.append(SynthTensor("model.norm.weight", (h,), "norm"))
    if not a.tie_word_embeddings:
        out.append(SynthTensor("lm_head.weight", (a.vocab_size, h), "normal"))
    return out
