"""Kimi-Linear (``model_type: kimi_linear``) and Kimi K3 (``model_type: kimi_k3``).

Kimi-Linear (reference: transformers ``models/kimi_linear/modeling_kimi_linear.py``, its
torch path) is a hybrid decoder: most layers use Kimi Delta Attention (linear attention
with a recurrent state, :mod:`moestream.models.kda`), the others multi-head latent
attention (MLA) without rotary embeddings; after the first ``first_k_dense_replace``
dense layers every MLP is a MoE block with a sigmoid router (``e_score_correction_bias``
used for choosing only, grouped top-k, renormalized and scaled by
``routed_scaling_factor``), routed SwiGLU experts and shared experts on the same input.

Kimi K3 (``KimiK3ForConditionalGeneration``: a text model under ``text_config`` and a
vision tower, not loaded) has no transformers class. It is built from its published config
and public ports of Moonshot's released ``modeling_kimi_linear.py`` (read, not copied):

* latent MoE (``routed_expert_hidden_size``): the router and the shared experts see the
  full hidden state; the routed experts run in a latent width, between the resident
  projections ``routed_expert_down_proj`` [L, H] and ``routed_expert_up_proj`` [H, L],
  with an RMSNorm on the summed latent (``latent_moe_use_norm``);
* SiTU-GLU activation (``hidden_act: situ``) in every MLP and expert:
  ``beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)``, in float32;
* attention residuals (``attn_res_block_size``): each sublayer's input is a softmax
  mixture, over depth, of block snapshots of the residual stream and the running sum;
* MLA with a sigmoid output gate (``mla_use_output_gate``), KDA with a full-rank output
  gate (``use_full_rank_gate``) and the bounded "safe" forget gate (``gate_lower_bound``).

Checkpoint names: Kimi-Linear under ``model.`` (MoE blocks ``block_sparse_moe``, experts
``experts.E.w1/w3/w2``; the dense MLP is ``mlp`` on the Hub and ``block_sparse_moe`` as
transformers 5 saves it, both read), Kimi K3 under ``language_model.model.`` and
``language_model.lm_head``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..pipeline import ExpertSpec, declares
from ..quant import native
from . import ops
from .base import CausalLM, DecoderArgs, SynthTensor, check_top_k, config_field, derived, field, meta_model, positive
from .kda import HybridCache, KimiDeltaAttention
from .layers import RMSNorm
from .linear import linear
from .mla import MLAttention
from .moe import SWIGLU, Float32Router, StreamedMoE, sigmoid_group_topk

MODEL_TYPES = ("kimi_linear", "kimi_k3")

log = logging.getLogger(__name__)


def _top_k(cfg: dict) -> int:
    return field(cfg, "num_experts_per_token", int, None) or positive(cfg, "num_experts_per_tok")


def _groups(cfg: dict) -> int:
    return field(cfg, "num_expert_group", int, None) or positive(cfg, "n_group", 1)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config fields Kimi-Linear and Kimi K3 use beyond :class:`DecoderArgs` (Hugging Face names; K3's
    from ``text_config``; the KDA shape from ``linear_attn_config`` or the top level)."""

    hidden_acts = ()  # silu or situ, checked below
    rope_types = None  # no rotary embedding: MLA without rope

    model_type: str = derived("kimi_linear")
    has_vision: bool = derived(False)
    num_key_value_heads: int | None = derived()  # MLA and KDA: not read
    head_dim: int | None = derived()
    rope_theta: float | None = derived()
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int | None = config_field(None, aliases=("model_max_length",))
    intermediate_size: int = config_field(minimum=1)
    layer_types: tuple[str, ...] = derived()  # "linear_attention" | "full_attention"
    mlp_layer_types: tuple[str, ...] = derived()  # "dense" | "sparse"
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = config_field(minimum=1)
    qk_nope_head_dim: int = config_field(minimum=1)
    qk_rope_head_dim: int = 0
    v_head_dim: int = config_field(minimum=1)
    mla_use_output_gate: bool = False
    # KDA
    linear_num_heads: int = derived()
    linear_head_dim: int = derived()
    linear_conv_kernel_dim: int = derived()
    use_full_rank_gate: bool = derived(False)
    gate_lower_bound: float | None = derived()
    # MoE
    num_experts: int = config_field(minimum=1, aliases=("num_local_experts",))
    num_experts_per_tok: int = config_field(read=_top_k)
    moe_intermediate_size: int = config_field(minimum=1)
    num_shared_experts: int = config_field(1, aliases=("n_shared_experts",))
    moe_renormalize: bool = config_field(True, aliases=("norm_topk_prob",))
    routed_scaling_factor: float = 2.446  # transformers' KimiLinearConfig default
    num_expert_group: int = config_field(read=_groups)
    topk_group: int = config_field(1, minimum=1)
    # activation and K3-only
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    attn_res_block_size: int | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a config dict (K3: its ``text_config``). Raises ConfigError naming the bad field."""
        mt = cfg.get("model_type", "kimi_linear")
        if mt != "kimi_k3":
            return super().from_config(cfg, model_type=mt)
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("kimi_k3 config has no text_config object")
        return super().from_config(text, model_type=mt, has_vision=bool(cfg.get("vision_config")))

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        layers = v["num_hidden_layers"]
        lin = field(cfg, "linear_attn_config", dict, {})
        v["layer_types"] = _layer_types(cfg, lin, layers)
        mlp_types = field(cfg, "mlp_layer_types", list, None)
        if mlp_types is None:
            dense = field(cfg, "first_k_dense_replace", int, 1)
            freq = positive(cfg, "moe_layer_freq", 1)
            mlp_types = ["sparse" if i >= dense and i % freq == 0 else "dense" for i in range(layers)]
        if len(mlp_types) != layers or not set(mlp_types) <= {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types {mlp_types!r} is not {layers} of dense / sparse")
        v["mlp_layer_types"] = tuple(mlp_types)
        experts, top_k, groups, topk_group = v["num_experts"], v["num_experts_per_tok"], v["num_expert_group"], \
            v["topk_group"]
        check_top_k(top_k, experts, name="num_experts_per_token")
        if experts % groups or topk_group > groups or top_k > topk_group * (experts // groups):
            raise ConfigError(f"num_expert_group {groups} / topk_group {topk_group} do not fit {experts} experts, "
                              f"top-{top_k}")
        router = field(cfg, "moe_router_activation_func", str, "sigmoid")
        if router != "sigmoid":
            raise ConfigError(f"moe_router_activation_func {router!r} is not supported (only sigmoid)")
        if v["hidden_act"] not in ("silu", "situ"):
            raise ConfigError(f"hidden_act {v['hidden_act']!r} is not supported for Kimi models (silu or situ)")
        if not field(cfg, "mla_use_nope", bool, True):
            raise ConfigError("mla_use_nope false (MLA with rotary embeddings) is not supported for Kimi models")
        for name in ("routed_expert_hidden_size", "attn_res_block_size"):
            if v[name] is not None and v[name] < 1:
                raise ConfigError(f"{name} {v[name]} must be at least 1")
        bound = lin.get("gate_lower_bound")
        if bound is not None and not isinstance(bound, (int, float)):
            raise ConfigError(f"linear_attn_config.gate_lower_bound {bound!r} is not a number")
        v["linear_num_heads"] = positive(lin, "num_heads", positive(cfg, "linear_num_heads", 32))
        v["linear_head_dim"] = positive(lin, "head_dim", positive(cfg, "linear_head_dim", 128))
        kernel = positive(cfg, "linear_conv_kernel_dim", 4)
        v["linear_conv_kernel_dim"] = positive(lin, "short_conv_kernel_size", kernel)
        v["use_full_rank_gate"] = field(lin, "use_full_rank_gate", bool, False)
        v["gate_lower_bound"] = None if bound is None else float(bound)
        v["activation_situ_beta"] = v["activation_situ_beta"] or 1.0

    @property
    def expert_width(self) -> int:
        """The width routed experts work in: the latent width for a latent MoE, else hidden_size."""
        return self.routed_expert_hidden_size or self.hidden_size


def _layer_types(cfg: dict, lin: dict, layers: int) -> tuple[str, ...]:
    """``layer_types``, else from ``linear_attn_config``'s 1-indexed layer lists, else transformers' default
    (full attention every 4th layer)."""
    layer_types = field(cfg, "layer_types", list, None)
    if layer_types is None:
        if "full_attn_layers" in lin and "kda_layers" in lin:
            layer_types = [None] * layers
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for n in lin[key]:  # 1-indexed in published configs
                    if not isinstance(n, int) or not 1 <= n <= layers:
                        raise ConfigError(f"linear_attn_config.{key} holds {n!r}, not a layer number 1..{layers}")
                    layer_types[n - 1] = kind
            if None in layer_types:
                raise ConfigError(f"linear_attn_config names no attention kind for layer {layer_types.index(None)}")
        else:
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if len(layer_types) != layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
        raise ConfigError(f"layer_types {layer_types!r} is not {layers} of full_attention / linear_attention")
    return tuple(layer_types)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU (Kimi K3): ``beta tanh(gate/beta) sigmoid(gate) * linear_beta tanh(up/linear_beta)``.

    Computed in float32 and cast back to ``gate``'s dtype, as Moonshot's ``SituAndMul``;
    without ``linear_beta`` the up half is used as is.
    """
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * ops.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


@declares("situ_glu")
def situ_expert(x: torch.Tensor, w: dict[str, torch.Tensor], beta: float, linear_beta: float | None) -> torch.Tensor:
    """One SiTU-GLU expert on x [n, L]: ``down(situ(gate x, up x))`` -> [n, L] (nn.Linear orientation)."""
    if x.device.type == "cpu":  # one call of the compiled kernels (float32 intermediate)
        y = native.float_expert(x, w["gate"], w["up"], w["down"], "situ",
                                (beta, float("nan") if linear_beta is None else linear_beta))
        if y is not None:
            return y
    return linear(situ(linear(x, w["gate"]), linear(x, w["up"]), beta, linear_beta), w["down"])


class GatedMLP(nn.Module):
    """Dense gated MLP ``down(act(gate x, up x))`` with SwiGLU (``silu``) or SiTU-GLU (``situ``).

    As transformers' ``KimiLinearMLP`` (silu) and Moonshot's ``KimiMLP`` (situ).
    """

    def __init__(self, hidden: int, intermediate: int, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act, self.beta, self.linear_beta = a.hidden_act, a.activation_situ_beta, a.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if x.device.type == "cpu" and all(isinstance(p, nn.Linear) and p.bias is None for p in projs):
            lb = float("nan") if self.linear_beta is None else self.linear_beta
            y = native.float_expert(x, *(p.weight for p in projs), self.act, (self.beta, lb))
            if y is not None:
                return y
        if self.act == "situ":
            return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KimiMoE(StreamedMoE):
    """Kimi MoE block: sigmoid router, streamed routed experts, resident shared experts.

    Routing is transformers' ``KimiLinearTopkRouter`` (= DeepSeek-V3's, :func:`sigmoid_group_topk`):
    float32 logits, sigmoid scores, experts chosen by ``scores + e_score_correction_bias``
    within the best groups, weights renormalized (``moe_renormalize``) and scaled by
    ``routed_scaling_factor``.

    With ``routed_expert_hidden_size`` (Kimi K3's latent MoE) the routed experts work on
    ``routed_expert_down_proj(x)`` [T, L], their routing-weighted sum is normalized
    (``routed_expert_norm``, when ``latent_moe_use_norm``) and projected back by
    ``routed_expert_up_proj``. Output: routed part + ``shared_experts(x)``, [T, H].
    """

    synth_init = {"routed_expert_up_proj.weight": "out"}  # back into the residual stream

    def __init__(self, a: ModelArgs, layer: int):
        router = partial(sigmoid_group_topk, top_k=a.num_experts_per_tok, n_group=a.num_expert_group,
                         topk_group=a.topk_group, norm_topk_prob=a.moe_renormalize,
                         routed_scaling_factor=a.routed_scaling_factor)
        if a.hidden_act == "situ":
            expert = ExpertSpec.of(partial(situ_expert, beta=a.activation_situ_beta,
                                           linear_beta=a.activation_situ_linear_beta))
        else:
            expert = SWIGLU
        super().__init__(a.hidden_size, a.num_experts, layer, router, expert, renormalize=a.moe_renormalize)
        self.gate = Float32Router(a.hidden_size, a.num_experts, bias=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts), requires_grad=False)
        self.shared_experts = (
            GatedMLP(a.hidden_size, a.moe_intermediate_size * a.num_shared_experts, a)
            if a.num_shared_experts else None
        )
        self.latent = a.routed_expert_hidden_size
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(a.hidden_size, self.latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(self.latent, a.hidden_size, bias=False)
            self.routed_expert_norm = RMSNorm(self.latent, a.rms_norm_eps) if a.latent_moe_use_norm else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights, experts chosen with the correction bias."""
        return self.router(self.gate(x), bias=self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if self.latent:
            y = self.routed(x, self.routed_expert_down_proj(x))
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.routed(x)
        return y if self.shared_experts is None else y + self.shared_experts(x)


def attn_res(prefix: torch.Tensor, blocks: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """Kimi K3 attention residual: a softmax mixture over depth of ``blocks + [prefix]``, each [T, H].

    Each candidate ``v`` is scored ``<RMSNorm(v), proj.weight>`` (``norm`` with its weight);
    the result is ``sum softmax(scores) * v``, in float32, cast back to ``prefix``'s dtype.
    With no blocks it is ``prefix``. (Moonshot's ``_apply_attn_res``, read via public ports.)
    """
    if not blocks:
        return prefix
    v = torch.stack([*blocks, prefix], dim=1).float()  # [T, n+1, H]
    k = ops.rms_norm(v, norm.weight.float(), norm.eps)
    # a quantized checkpoint may store the query quantized (moestream.quant QuantLinear): its float value
    w = proj.dense_weight() if hasattr(proj, "dense_weight") else proj.weight.float()
    probs = ops.linear(k, w.reshape(1, -1))[..., 0].softmax(-1)  # [T, n+1]
    out = probs[:, 0:1] * v[:, 0]
    for i in range(1, v.shape[1]):  # the mixture summed over candidates in order
        out = out + probs[:, i : i + 1] * v[:, i]
    return out.to(prefix.dtype)


class DecoderLayer(nn.Module):
    """Norms, (K3) attention-residual queries, KDA or MLA, dense MLP or MoE, declared in checkpoint order."""

    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.block = a.attn_res_block_size
        if self.block:
            for name in ("self_attention_res", "mlp_res"):
                setattr(self, f"{name}_norm", RMSNorm(a.hidden_size, a.rms_norm_eps))
                setattr(self, f"{name}_proj", nn.Linear(a.hidden_size, 1, bias=False))
        self.linear = a.layer_types[i] == "linear_attention"
        if self.linear:
            self.self_attn = KimiDeltaAttention(
                a.hidden_size, a.linear_num_heads, a.linear_head_dim, a.linear_conv_kernel_dim, a.rms_norm_eps,
                full_rank_gate=a.use_full_rank_gate, lower_bound=a.gate_lower_bound,
                a_log_size=a.linear_head_dim if a.model_type == "kimi_k3" else None,
            )
        else:  # MLA without rotary embeddings (mla_use_nope): the rope dims are a plain shared key part
            self.self_attn = MLAttention(
                a.hidden_size, a.num_attention_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
                a.v_head_dim, a.q_lora_rank, rope=None, output_gate=a.mla_use_output_gate,
            )
        if a.mlp_layer_types[i] == "sparse":
            self.block_sparse_moe = KimiMoE(a, i)
        else:
            self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a)
        self.index = i

    def forward(self, h: torch.Tensor, kv: HybridCache, start: int, blocks: list[torch.Tensor]) -> torch.Tensor:
        """h [T, H] -> [T, H]. ``blocks``: K3's block snapshots of the residual stream (appended to here)."""
        i = self.index
        ffn = self.mlp if hasattr(self, "mlp") else self.block_sparse_moe
        attend = partial(self.self_attn, kv=kv, layer=i, start=start) if self.linear else partial(
            self.self_attn, cos=None, sin=None, kv=kv, layer=i, start=start)
        if not self.block:
            h = h + attend(self.input_layernorm(h))
            return h + ffn(self.post_attention_layernorm(h))
        # attention residuals (Kimi K3): a new block starts every attn_res_block_size layers
        x = self.input_layernorm(attn_res(h, blocks, self.self_attention_res_proj, self.self_attention_res_norm))
        write = i % self.block == 0
        if write:
            blocks.append(h)
        out = attend(x)
        h = out if write else h + out
        x = self.post_attention_layernorm(attn_res(h, blocks, self.mlp_res_proj, self.mlp_res_norm))
        return h + ffn(x)


class Model(CausalLM):
    """Kimi-Linear / Kimi K3 causal LM with streamed experts and a :class:`HybridCache`."""

    expert_names = ("w1", "w3", "w2")

    # kept in float32, as transformers' _keep_in_fp32_modules_strict for Kimi-Linear
    float32_parameters = (".gate.weight", ".gate.e_score_correction_bias", ".dt_bias")

    def __init__(self, a: ModelArgs):
        k3 = a.model_type == "kimi_k3"
        super().__init__(a, prefix="language_model.model" if k3 else "model",
                         head="language_model.lm_head" if k3 else "lm_head")
        if a.attn_res_block_size:
            self.decoder.output_attn_res_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
            self.decoder.output_attn_res_proj = nn.Linear(a.hidden_size, 1, bias=False)
        if a.has_vision:
            log.warning("Kimi K3: the vision tower (vision_config) is not loaded; moestream runs the text model only")

    def make_rotary(self, a: ModelArgs) -> None:
        return None  # MLA without rope, KDA

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        return DecoderLayer(a, i)

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, width) of one routed expert's gate projection (width: the latent width for K3)."""
        return self.args.moe_intermediate_size, self.args.expert_width

    def new_kv_cache(self, capacity: int = 256) -> HybridCache:
        return HybridCache(len(self.decoder.layers), capacity)

    def checkpoint_name(self, name: str, tensors) -> str:
        """The checkpoint tensor holding parameter ``name``: a dense MLP saved by transformers 5 is
        ``block_sparse_moe.*`` (its save reverses its ``block_sparse_moe -> mlp`` load renaming)."""
        if name not in tensors and ".mlp." in name:
            alt = name.replace(".mlp.", ".block_sparse_moe.", 1)
            if alt in tensors:
                return alt
        return name

    def forward(self, ids: torch.Tensor, start: int, kv: HybridCache, all_logits: bool = False) -> torch.Tensor:
        """Logits for token ids ``ids`` [T] (int64) at positions ``start..start+T``.

        Advances ``kv`` (MLA latents; KDA convolution and recurrent states) by the chunk.
        Returns [T, vocab] when ``all_logits``, else [1, vocab], in the model's dtype.
        """
        decoder = self.decoder
        h = decoder.embed_tokens(ids)
        blocks: list[torch.Tensor] = []
        for layer in decoder.layers:
            h = layer(h, kv, start, blocks)
        if self.args.attn_res_block_size:
            h = attn_res(h, blocks, decoder.output_attn_res_proj, decoder.output_attn_res_norm)
        if not all_logits:
            h = h[-1:]
        kv.length = start + ids.shape[0]
        return self.head(decoder.norm(h))


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers; K3's experts written unquantized.

    Raises:
        ConfigError: ``layers`` outside 1..the config's layer count.
    """
    out = dict(cfg)
    text = dict(cfg["text_config"]) if cfg.get("model_type") == "kimi_k3" else out
    total = text.get("num_hidden_layers")
    if isinstance(total, int) and not 1 <= layers <= total:
        raise ConfigError(f"--layers {layers}: must be between 1 and the config's {total} layers")
    text["num_hidden_layers"] = layers
    lin = dict(text.get("linear_attn_config") or {})
    for key in ("full_attn_layers", "kda_layers"):
        if key in lin:
            lin[key] = [n for n in lin[key] if n <= layers]
    if lin:
        text["linear_attn_config"] = lin
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(text.get(key), list):
            text[key] = text[key][:layers]
    text.pop("quantization_config", None)  # synth writes plain float experts
    if text is not out:
        out["text_config"] = text
    return out


def synth_tensors(cfg: dict) -> list[SynthTensor]:
    """Every tensor of a checkpoint of ``cfg``'s shapes, named as the Hub's (per-expert ``w1/w3/w2``)."""
    cfg = synth_config(cfg, (cfg.get("text_config") or cfg).get("num_hidden_layers", 1))  # drop quantization
    a = dataclasses.replace(ModelArgs.from_config(cfg), has_vision=False)  # synth warns of no vision tower
    return meta_model(Model, a).synth_tensors()
