"""Qwen3-Next (Qwen3-Next-80B-A3B): ``model_type: qwen3_next``.

Reference: transformers ``models/qwen3_next/modeling_qwen3_next.py`` (torch fallback path).
A hybrid decoder: per ``layer_types`` (default: every ``full_attention_interval``-th
layer full attention), each layer mixes tokens with Gated DeltaNet linear attention or
with gated full attention (output gate, zero-centred q/k norms, partial rotary), then a
MoE block of softmax top-k routed experts (renormalized when ``norm_topk_prob``) plus a
resident shared expert behind a sigmoid gate. Norms are zero-centred (``1 + weight``).
Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid use a dense MLP.

The cache (:class:`~moestream.models.layers.HybridCache`) holds keys and values for the
attention layers and the convolution window and recurrent state for the DeltaNet layers.
Checkpoints may carry a multi-token-prediction layer (``mtp.*``); it is not loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from ..checkpoint import TensorInfo
from ..errors import CheckpointError, ConfigError
from ..gguf_format import (
    ATTN,
    DELTANET,
    QK_NORM,
    ROUTED,
    SHARED_EXPERT,
    GGUFArchitecture,
    GGUFFormat,
    as_float32,
    base_config,
    bools,
    derive,
    float_weight,
    logical_shape,
    meta_value,
    moe_checks,
    one_head_dim,
    take_rows,
)
from ..quant import ggml
from .base import CausalLM, DecoderArgs, check_top_k, config_field, derived, synth_tensors_of
from .hybrid import (
    GatedAttention,
    GatedDeltaNet,
    GatedSharedExpertMoE,
    HybridCache,
    ZeroCenteredRMSNorm,
    layer_types,
    rotary_fraction,
)
from .layers import MLP
from .moe import softmax_topk
from .rope import RotaryEmbedding, make_rope

MODEL_TYPES = ("qwen3_next",)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """The config fields a hybrid Qwen model uses beyond :class:`DecoderArgs` (names as Hugging Face spells them).

    ``fused_projections`` is how the DeltaNet input projections are stored (Qwen3-Next:
    fused ``in_proj_qkvz``/``in_proj_ba``; Qwen3.5: four separate projections).
    """

    family = "qwen3_next"
    rope_refusal = "yet (only default)"
    # fields a family fixes whatever its config says (Qwen3.5: every layer MoE, renormalized)
    fixed: ClassVar[dict] = {}

    rotary_dim: int = derived()
    layer_types: tuple[str, ...] = derived()
    linear_conv_kernel_dim: int = config_field(4, minimum=1)
    linear_key_head_dim: int = config_field(minimum=1)
    linear_value_head_dim: int = config_field(minimum=1)
    linear_num_key_heads: int = config_field(minimum=1)
    linear_num_value_heads: int = config_field(minimum=1)
    intermediate_size: int | None = None
    moe_intermediate_size: int = config_field(minimum=1)
    shared_expert_intermediate_size: int = config_field(minimum=1)
    num_experts: int = config_field(minimum=1)
    num_experts_per_tok: int = config_field(minimum=1)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = config_field(1, minimum=1)
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    fused_projections: bool = derived(True)

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        check_top_k(v["num_experts_per_tok"], v["num_experts"])
        head_dim = v["head_dim"]
        v["rotary_dim"] = rotary_dim = int(head_dim * rotary_fraction(cfg))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ConfigError(f"head_dim {head_dim} x partial_rotary_factor gives {rotary_dim} rotary dimensions; "
                              "expected an even number >= 2")
        if not all(isinstance(i, int) for i in v["mlp_only_layers"]):
            raise ConfigError(f"mlp_only_layers {list(v['mlp_only_layers'])!r} is not a list of layer indices")
        v["layer_types"] = tuple(layer_types(cfg, v["num_hidden_layers"]))
        v.update(cls.fixed)
        dense = [i for i in range(v["num_hidden_layers"])
                 if i in v["mlp_only_layers"] or (i + 1) % v["decoder_sparse_step"]]
        if dense and not v["intermediate_size"]:
            raise ConfigError(f"layers {dense[:5]} use a dense MLP, but field 'intermediate_size' is missing")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


class DecoderLayer(nn.Module):
    """Zero-centred RMSNorm -> Gated DeltaNet or gated attention -> residual ->
    zero-centred RMSNorm -> MoE with shared expert (or dense MLP) -> residual."""

    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.linear = a.layer_types[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                a.hidden_size, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                a.linear_value_head_dim, a.linear_conv_kernel_dim, a.rms_norm_eps, a.fused_projections,
            )
        else:
            self.self_attn = GatedAttention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps,
                bias=a.attention_bias,
            )
        if a.is_moe_layer(i):
            router = partial(softmax_topk, top_k=a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob)
            self.mlp = GatedSharedExpertMoE(a.hidden_size, a.num_experts, i, router, a.shared_expert_intermediate_size,
                                       renormalize=a.norm_topk_prob)
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(self, h: torch.Tensor, cos, sin, kv: HybridCache, i: int, start: int) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.linear:
            x = self.linear_attn(x, kv, i, start)
        else:
            x = self.self_attn(x, cos, sin, kv, i, start)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    """Hybrid Qwen causal LM (Qwen3-Next layout: decoder at ``model``) with streamed experts."""

    Norm = ZeroCenteredRMSNorm

    def make_rotary(self, a: ModelArgs) -> RotaryEmbedding:
        return make_rope(a.rotary_dim, a.rope_theta)

    def make_layer(self, a: ModelArgs, i: int) -> DecoderLayer:
        return DecoderLayer(a, i)

    def new_kv_cache(self, capacity: int = 256) -> HybridCache:
        """Keys/values for attention layers, convolution and recurrent state for DeltaNet layers."""
        return HybridCache(len(self.decoder.layers), capacity)

    def synth_rank(self, name: str) -> int:
        """synth lists a MoE layer's routed experts right after the router, before the shared expert."""
        if name.startswith("mlp.") and not name.startswith("mlp.gate."):
            return 3 if name.startswith("mlp.experts.") else 4
        return super().synth_rank(name)


def adapt_to_source(net: "Model", source) -> None:
    """Follow a source format's stored input orders (``source.input_orders``: a GGUF file's ``out_proj``
    whose quantized blocks straddle its tiled value heads, see :mod:`moestream.gguf_format`): each such
    DeltaNet layer permutes its ``out_proj`` input to the stored order. Called by the engine on the
    meta-device model. Raises ConfigError naming a path that is not a DeltaNet ``out_proj``."""
    for path, order in getattr(source, "input_orders", {}).items():
        mixer = net.get_submodule(path.removesuffix(".out_proj")) if path.endswith(".linear_attn.out_proj") else None
        if not isinstance(mixer, GatedDeltaNet) or sorted(order) != list(range(mixer.out_proj.in_features)):
            raise ConfigError(f"{path}: not a DeltaNet out_proj taking a permutation of its "
                              f"{getattr(getattr(mixer, 'out_proj', None), 'in_features', '?')} inputs")
        mixer.out_order = tuple(order)


def describe_skipped(unused: list[str]) -> tuple[str | None, list[str]]:
    """A one-line note naming the multi-token-prediction layer (``mtp.*``) when the
    checkpoint has one, and the unused tensor names it does not explain."""
    return skipped_note("qwen3_next", unused, {"mtp.": "the multi-token-prediction layer"})


def skipped_note(family: str, unused: list[str], parts: dict[str, str]) -> tuple[str | None, list[str]]:
    """Group ``unused`` tensor names by the prefixes of ``parts`` (prefix -> what it is).

    Returns (``"<family>: not loaded: <what> (<prefix>*, N tensors), ..."`` or None when no
    name matches, the names matching no prefix).
    """
    found, rest = [], list(unused)
    for prefix, what in parts.items():
        hits = [n for n in rest if n.startswith(prefix)]
        if hits:
            found.append(f"{what} ({prefix}*, {len(hits)} tensors)")
            rest = [n for n in rest if not n.startswith(prefix)]
    if not found:
        return None, rest
    return f"{family}: not loaded: {', '.join(found)}; moestream runs the text decoder only", rest


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` cut to its first ``layers`` decoder layers (``layer_types`` too), without the
    multi-token-prediction layer synth does not write (``mtp_num_hidden_layers`` 0)."""
    out = dict(cfg)
    out["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = cfg["layer_types"][:layers]
    out["mlp_only_layers"] = [i for i in cfg.get("mlp_only_layers") or [] if i < layers]
    if "mtp_num_hidden_layers" in out:  # synth writes no multi-token-prediction layer (mtp.*)
        out["mtp_num_hidden_layers"] = 0
    return out


synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
def gguf_config(meta: dict, tensors: dict, where, spec: GGUFArchitecture) -> dict:
    """Qwen3-Next (``qwen3next``) or Qwen3.5/3.6 MoE (``qwen35moe``, the text model ``qwen3_5_moe_text``).

    The DeltaNet shapes come from the ``ssm.*`` keys as Qwen3NextModel.set_gguf_parameters writes them:
    ``conv_kernel`` (linear_conv_kernel_dim), ``state_size`` (linear_key_head_dim), ``group_count``
    (linear_num_key_heads), ``time_step_rank`` (linear_num_value_heads), ``inner_size`` (value head dim x
    value heads). The layer kinds come from ``attention.recurrent_layers`` (true: DeltaNet), else
    ``full_attention_interval`` (default 4, as llama.cpp). ``rope.dimension_count`` gives the partial
    rotary factor. Blocks past ``block_count - nextn_predict_layers`` are the multi-token-prediction
    layer. llama.cpp's graph renormalizes the top-k weights and runs every layer as MoE.
    """
    p = spec.name + "."
    cfg = base_config(meta, tensors, where, spec)
    one_head_dim(meta, p, where, cfg)
    family = cfg["model_type"]
    blocks = cfg["num_hidden_layers"]  # block_count, the multi-token-prediction blocks included
    mtp = meta_value(meta, p + "nextn_predict_layers", where, default=0, required=False, minimum=0)
    layers = blocks - mtp
    if layers < 1:
        raise CheckpointError(f"{where}: metadata {p}block_count {blocks} leaves no layer beside "
                              f"{p}nextn_predict_layers {mtp}")
    experts = moe_checks(meta, p, where, family)
    head_dim = cfg["head_dim"]
    rot = meta_value(meta, p + "rope.dimension_count", where, default=head_dim, minimum=1)
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{where}: metadata {p}rope.scaling.type {scaling!r}: {family} computes the "
                              "default rotary embedding only")
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"], "partial_rotary_factor": rot / head_dim}
    if spec.name == "qwen35moe":  # interleaved M-RoPE: for text every section sees the same position
        sections = meta.get(p + "rope.dimension_sections")
        if isinstance(sections, list) and all(isinstance(x, int) for x in sections):
            rope.update(mrope_section=sections[:3], mrope_interleaved=True)
    value_heads = meta_value(meta, p + "ssm.time_step_rank", where, minimum=1)
    inner = meta_value(meta, p + "ssm.inner_size", where, minimum=1)
    if value_heads < 1 or inner % value_heads:
        raise CheckpointError(f"{where}: metadata {p}ssm.inner_size {inner} is not a multiple of "
                              f"{p}ssm.time_step_rank {value_heads} (the value heads)")
    recurrent = bools(meta, p + "attention.recurrent_layers", where, layers)
    if recurrent is None:
        interval = meta_value(meta, p + "full_attention_interval", where, default=4, required=False)
        if interval < 1:
            raise CheckpointError(f"{where}: metadata {p}full_attention_interval {interval} must be at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    moe = meta_value(meta, p + "expert_feed_forward_length", where, minimum=1)
    ff = meta_value(meta, p + "feed_forward_length", where, required=False, minimum=1)
    cfg.update({
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "rope_parameters": rope, "partial_rotary_factor": rot / head_dim,
        "num_experts": experts,
        "moe_intermediate_size": moe,
        # llama.cpp's default when the key is missing: the dense width
        "shared_expert_intermediate_size": meta_value(meta, p + "expert_shared_feed_forward_length", where, default=ff,
                                                 minimum=1),
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "linear_conv_kernel_dim": meta_value(meta, p + "ssm.conv_kernel", where, minimum=1),
        "linear_key_head_dim": meta_value(meta, p + "ssm.state_size", where, minimum=1),
        "linear_num_key_heads": meta_value(meta, p + "ssm.group_count", where, minimum=1),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
    })
    if ff is not None:
        cfg["intermediate_size"] = ff
    if mtp:
        cfg["mtp_num_hidden_layers"] = mtp
    return cfg


def _v_heads(k_heads: int, per: int, width: int) -> torch.Tensor:
    """Index ``perm`` with ``hf = file[perm]`` for value heads stored tiled (``_LinearAttentionVReorderBase``:
    file position ``(j, g, d)`` holds Hugging Face's ``(g, j, d)``, g the key head, j < per its value heads)."""
    return torch.arange(k_heads * per * width).reshape(per, k_heads, width).permute(1, 0, 2).reshape(-1)


def _take_columns(info: TensorInfo, perm: torch.Tensor, block: int, ckpt) -> torch.Tensor:
    """Columns of ``info`` reordered (``out[:, c] = stored[:, perm[c]]``): block-quantized rows move whole
    blocks (``block`` values; ``perm`` moves runs of whole blocks), float rows move values."""
    t = ckpt.read_info(info)
    if block == 1:
        return t[:, perm].contiguous()
    size = t.shape[-1] // (perm.numel() // block)
    blocks = perm.reshape(-1, block)[:, 0] // block
    return t.reshape(t.shape[0], -1, size)[:, blocks].reshape(t.shape).contiguous()


def _unshift(info: TensorInfo, ckpt) -> torch.Tensor:
    """A norm weight stored as ``1 + w`` (Qwen3NextModel adds 1): ``w`` in float32 (``1 + w`` gives back the
    stored value exactly while it is >= 0.5, by Sterbenz's lemma)."""
    return float_weight(info, ckpt) - 1.0


def _a_log(info: TensorInfo, perm: torch.Tensor | None, ckpt) -> torch.Tensor:
    """``A_log`` [V] from llama.cpp's ``ssm_a = -exp(A_log)``: ``log(-ssm_a)`` in float64, rounded to float32.

    Raises:
        CheckpointError: a value >= 0 (no A_log gives one).
    """
    a = float_weight(info, ckpt).double()
    if perm is not None:
        a = a[perm]
    if not bool((a < 0).all()):
        raise CheckpointError(f"{info.file}: tensor {info.name!r} holds a value >= 0; llama.cpp stores "
                              "ssm_a = -exp(A_log), which is negative")
    return torch.log(-a).float()


def _conv(info: TensorInfo, perm: torch.Tensor | None, ckpt) -> torch.Tensor:
    """``conv1d.weight`` [C, 1, K] from the squeezed ``ssm_conv1d`` [C, K] (channels reordered by ``perm``)."""
    w = float_weight(info, ckpt)
    if perm is not None:
        w = w[perm]
    return w.reshape(w.shape[0], 1, -1).contiguous()


def _cat_rows(first: TensorInfo, second: TensorInfo, perm: torch.Tensor, same: bool, ckpt) -> torch.Tensor:
    """Rows of ``first`` then ``second``, reordered (``out = cat[perm]``): as stored when both are stored
    alike (``same``), else as float32."""
    read = ckpt.read_info if same else partial(float_weight, ckpt=ckpt)
    return torch.cat([read(first), read(second)])[perm].contiguous()


def _qkvz_rows(k_heads: int, dk: int, vdim: int) -> torch.Tensor:
    """Index into ``cat(attn_qkv, attn_gate)`` rows giving Hugging Face's ``in_proj_qkvz`` rows: per key
    head g its q, k, v (``vdim`` = its value heads x value dim) and z rows (Qwen3NextModel's split, undone)."""
    kd = k_heads * dk
    conv = 2 * kd + k_heads * vdim
    out = []
    for g in range(k_heads):
        out += [torch.arange(g * dk, (g + 1) * dk), torch.arange(kd + g * dk, kd + (g + 1) * dk),
                torch.arange(2 * kd + g * vdim, 2 * kd + (g + 1) * vdim),
                torch.arange(conv + g * vdim, conv + (g + 1) * vdim)]
    return torch.cat(out)


def gguf_tensors(tensors: dict[str, TensorInfo], cfg: dict, derived: dict, where, fmt: GGUFFormat) -> None:
    """Undo Qwen3NextModel's (and Qwen3_5MoeTextModel's) transformations, so the family reads the Hugging
    Face tensors (see the module doc): zero-centred norms stored ``+ 1``; ``A_log`` as ``ssm_a = -exp(A_log)``;
    ``dt_bias`` as ``ssm_dt.bias``; ``conv1d`` squeezed to [C, K]; Qwen3-Next's ``in_proj_qkvz`` split into
    ``attn_qkv`` (q, k, v of all heads) and ``attn_gate`` (z); for Qwen3.5 with fewer key than value heads,
    the value heads reordered from grouped to tiled (``_LinearAttentionVReorderBase``) in ``in_proj_qkv``'s v
    rows, ``in_proj_z``, ``in_proj_b``/``in_proj_a``, ``A_log``, ``dt_bias``, the conv's v channels and
    ``out_proj``'s columns. Blocks past the decoder (``nextn_predict_layers``) go under ``mtp.``.

    Raises:
        CheckpointError: a tensor a DeltaNet layer needs missing, fused gate/up experts or a fused
            q/k/v attention (converter options moestream does not read), shapes the config does not give.
    """
    layers = cfg["num_hidden_layers"]
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if v_heads % k_heads:
        raise CheckpointError(f"{where}: ssm.time_step_rank {v_heads} (value heads) is not a multiple of "
                              f"ssm.group_count {k_heads} (key heads)")
    per = v_heads // k_heads
    qwen35 = cfg["model_type"] == "qwen3_5_moe_text"
    tiled = qwen35 and per > 1  # _LinearAttentionVReorderBase reorders only when the head counts differ
    for name in list(tensors):  # the multi-token-prediction blocks (under their llama.cpp names)
        m = re.match(r"^(?:model\.layers|blk)\.(\d+)\.", name)
        if m and int(m[1]) >= layers:
            info = tensors.pop(name)
            tensors["mtp." + info.name] = info
        elif ".ffn_gate_up_exps." in name:
            raise CheckpointError(f"{where}: tensor {name!r}: gate and up experts fused into one tensor "
                                  "(convert_hf_to_gguf.py's fuse option) are not read yet")

    def need(name: str) -> TensorInfo:
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name!r} (a Hugging Face name) in a linear-attention layer")
        return tensors[name]

    def unshift(name: str) -> None:
        if name in tensors:
            info = tensors[name]
            derive(tensors, derived, name, as_float32(info, name, info.shape), partial(_unshift, info))

    unshift("model.norm.weight")
    for i in range(layers):
        pre, gguf = f"model.layers.{i}.", f"blk.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            unshift(pre + n + ".weight")
        gate = tensors.get(pre + "mlp.shared_expert_gate.weight")
        if gate is not None and len(gate.shape) == 1:  # [H] -> the [1, H] linear Hugging Face has
            tensors[pre + "mlp.shared_expert_gate.weight"] = TensorInfo(
                gate.name, gate.file, gate.offset, gate.nbytes, gate.dtype, (1, *gate.shape))
        la = pre + "linear_attn."
        if cfg["layer_types"][i] != "linear_attention":
            if la + "in_proj_qkv.weight" in tensors:
                raise CheckpointError(f"{where}: tensor {gguf}attn_qkv.weight in full-attention layer {i}: fused "
                                      "q/k/v attention (convert_hf_to_gguf.py's fuse option) is not read yet")
            continue
        vperm = _v_heads(k_heads, per, 1) if tiled else None
        a = tensors.pop(gguf + "ssm_a", None)
        if a is None:
            raise CheckpointError(f"{where}: no tensor '{gguf}ssm_a' (-exp(A_log)) in linear-attention layer {i}")
        derive(tensors, derived, la + "A_log", as_float32(a, la + "A_log", a.shape), partial(_a_log, a, vperm))
        dt = tensors.pop(la + "dt_proj.bias", None)  # convert_hf_to_gguf renames dt_bias to dt_proj.bias
        if dt is None:
            raise CheckpointError(f"{where}: no tensor '{gguf}ssm_dt.bias' (dt_bias) in linear-attention layer {i}")
        if vperm is None:
            tensors[la + "dt_bias"] = dt
        else:
            derive(tensors, derived, la + "dt_bias", dt, partial(take_rows, dt, vperm))
        conv = need(la + "conv1d.weight")
        cperm = None
        if tiled:
            qk = 2 * k_heads * dk
            cperm = torch.cat([torch.arange(qk), qk + _v_heads(k_heads, per, dv)])
        derive(tensors, derived, la + "conv1d.weight",  # stored squeezed [C, K] (or already [C, 1, K])
                as_float32(conv, la + "conv1d.weight", (conv.shape[0], 1, logical_shape(conv)[-1])),
                partial(_conv, conv, cperm))
        if qwen35:
            if tiled:
                _adapt_tiled(tensors, derived, la, k_heads, per, dk, dv, where, fmt)
        elif la + "in_proj_qkvz.weight" not in tensors:  # attn_qkv + attn_gate: back into one tensor
            qkv, z = need(la + "in_proj_qkv.weight"), need(la + "in_proj_z.weight")
            del tensors[la + "in_proj_qkv.weight"], tensors[la + "in_proj_z.weight"]
            perm = _qkvz_rows(k_heads, dk, per * dv)
            rows = qkv.shape[0] + z.shape[0]
            if perm.numel() != rows:
                raise CheckpointError(f"{where}: {gguf}attn_qkv and attn_gate hold {rows} rows; the ssm.* metadata "
                                      f"gives {perm.numel()}")
            same = qkv.dtype == z.dtype and qkv.shape[1:] == z.shape[1:]
            name = la + "in_proj_qkvz.weight"
            info = (TensorInfo(name, qkv.file, qkv.offset, qkv.nbytes + z.nbytes, qkv.dtype, (rows, *qkv.shape[1:]))
                    if same else as_float32(qkv, name, (rows, logical_shape(qkv)[-1])))
            derive(tensors, derived, name, info, partial(_cat_rows, qkv, z, perm, same))


def _adapt_tiled(tensors: dict, derived: dict, la: str, k_heads: int, per: int, dk: int, dv: int, where,
                 fmt: GGUFFormat) -> None:
    """Qwen3.5's value heads back from tiled to grouped order in one DeltaNet layer's projections: rows as
    stored; ``out_proj``'s columns as whole blocks when a value head is whole blocks (or float values), else
    (K-quants with head dim 128) kept as stored and the order recorded in ``fmt.input_orders``: the family
    feeds that out_proj its input in the stored order, so no weight is dequantized."""
    for proj, width, offset in (("in_proj_qkv", dv, 2 * k_heads * dk), ("in_proj_z", dv, 0),
                                ("in_proj_b", 1, 0), ("in_proj_a", 1, 0)):
        name = la + proj + ".weight"
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name!r}")
        info = tensors[name]
        perm = torch.cat([torch.arange(offset), offset + _v_heads(k_heads, per, width)])
        if perm.numel() != info.shape[0]:
            raise CheckpointError(f"{info.file}: tensor {info.name!r} has {info.shape[0]} rows; the ssm.* metadata "
                                  f"gives {perm.numel()}")
        derive(tensors, derived, name, info, partial(take_rows, info, perm))
    name = la + "out_proj.weight"
    info = tensors.get(name)
    if info is None:
        raise CheckpointError(f"{where}: no tensor {name!r}")
    perm = _v_heads(k_heads, per, dv)
    qtype = ggml.block_type(info.dtype)
    block = 1 if qtype is None else ggml.TYPES[qtype][0]
    values = logical_shape(info)[-1]
    if values != perm.numel():
        raise CheckpointError(f"{info.file}: tensor {info.name!r} has rows of {values} values; the ssm.* "
                              f"metadata gives {perm.numel()}")
    if dv % block == 0:  # whole blocks move
        derive(tensors, derived, name, info, partial(_take_columns, info, perm, block))
    else:  # a block holds parts of two heads: the input moves instead (input[:, order] @ stored.T)
        fmt.input_orders[name.removesuffix(".weight")] = torch.argsort(perm).tolist()


# the hybrid Qwens (Qwen3NextModel, Qwen3_5MoeTextModel): the names the converter writes, before what gguf_tensors
# undoes (dt_bias written as dt_proj.bias; in_proj_qkvz split into in_proj_qkv + in_proj_z)
GGUF = GGUFArchitecture("qwen3next", "qwen3_next", "Qwen3NextForCausalLM",
                        ATTN + QK_NORM + ROUTED + DELTANET + SHARED_EXPERT + (
                            "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"),  # conversions before attn_qkv
                        gguf_config, gguf_tensors, added=6)  # + attn_gate: ssm_in
