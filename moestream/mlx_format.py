"""MLX-format checkpoints: mlx-lm's tensor names and layouts mapped onto the Hugging Face names
moestream's families use, by rule, when a checkpoint is opened.

mlx-lm (``mlx_lm/models/<family>.py``) loads a Hugging Face checkpoint through each model's
``sanitize(weights)`` and saves the result (``mlx_lm.convert``, with safetensors metadata
``{"format": "mlx"}``), so an MLX build holds mlx-lm's module paths and layouts, not the
Hugging Face ones. :func:`adapt` undoes what ``sanitize`` did, family by family, on the
checkpoint's tensor index (:class:`~moestream.checkpoint.Checkpoint` calls it once, at open),
so the expert layout, the quantization checks, the families and ``inspect`` see Hugging Face
names. A pure rename or a reshape of a tensor whose bytes are already in the order wanted
costs nothing (same bytes, new name or shape). Tensors whose values differ (norm weights
stored shifted, DeepSeek's split ``kv_b_proj``, quantized routers) become *derived*
tensors, computed from the stored ones when the resident weights are read. Routed experts
are never derived: they stream as stored.

Rules (mlx-lm name -> moestream name), besides the ones every family shares (stacked
experts ``<block>.switch_mlp.{gate,up,down}_proj.{weight,scales,biases,bias}`` [E, out, in],
read as they are by :mod:`moestream.layout`; ``lm_head`` absent when tied; mlx-lm's
per-module quantization overrides renamed with the tensors):

* ``qwen3_next``: norm weights ``input_layernorm``, ``post_attention_layernorm``,
  ``model.norm``, ``q_norm``, ``k_norm`` (1-D) are stored ``1 + w``: read as ``stored - 1``;
  ``linear_attn.conv1d.weight`` [C, K, 1] (mlx's conv axis order) read as [C, 1, K] (same
  bytes for a depthwise convolution). mlx-lm shifts the norms exactly when it reorders the
  convolution, so the conv shape decides.
* ``qwen3_5_moe``: as ``qwen3_next``, plus the prefixes ``language_model.model.`` ->
  ``model.language_model.``, ``language_model.lm_head.`` -> ``lm_head.``,
  ``language_model.mtp.`` -> ``mtp.`` (the vision tower is not in mlx-lm builds).
* ``deepseek_v3``, ``kimi_k2``, ``deepseek_v32``: ``self_attn.embed_q.weight`` [heads,
  kv_lora_rank, qk_nope] and ``self_attn.unembed_out.weight`` [heads, v_head, kv_lora_rank]
  (affine-quantized or not) -> ``self_attn.kv_b_proj.weight`` [heads * (qk_nope + v_head),
  kv_lora_rank], per head the transposed ``embed_q`` rows then the ``unembed_out`` rows
  (dequantized, held in float). Builds from mlx-lm versions that kept ``kv_b_proj`` need nothing.
* ``laguna``: ``mlp.gate.proj.weight`` -> ``mlp.gate.weight`` (mlx-lm's router module),
  ``mlp.gate.e_score_correction_bias`` -> ``mlp.experts.e_score_correction_bias``.
* ``gpt_oss``: ``mlp.experts.{gate,up,down}_proj.{weight,bias,scales,biases}`` (stacked,
  [E, out, in], gate and up de-interleaved) -> the stacked layout; the family's experts then
  run on separate gate and up (:func:`moestream.models.gpt_oss.clamped_swiglu_linear_expert`).
* ``kimi_linear``: ``mlp.{switch_mlp,shared_experts,gate}.`` of MoE layers ->
  ``block_sparse_moe.*``, ``mlp.e_score_correction_bias`` ->
  ``block_sparse_moe.gate.e_score_correction_bias``, ``self_attn.{q,k,v}_conv.conv.weight``
  [C, K, 1] -> ``self_attn.{q,k,v}_conv1d.weight`` [C, 1, K], ``A_log`` [H] -> [1, 1, H, 1],
  ``self_attn.kv_a_proj`` -> ``kv_a_proj_with_mqa``, ``self_attn.kv_a_norm`` -> ``kv_a_layernorm``.
* ``qwen3_moe``, ``olmoe``, ``mixtral``, ``minimax_m2``, ``glm4_moe``, ``deepseek_v2``,
  ``hunyuan_v1_moe``: the shared rules only (mlx-lm's ``hunyuan`` module keeps the Hugging
  Face names ``mlp.gate.wg``, ``shared_mlp``, ``query_layernorm``).
* ``kimi_k3``: mlx-lm has no such model; an MLX-format checkpoint of it is refused.

Routers stored affine-quantized (mlx-lm quantizes ``mlp.gate`` and the like, often at 8
bits) are dequantized once at load into float weights: several families compute routing
from a float (or float32) router weight.

Source of the rules: mlx-lm's ``sanitize`` methods (ml-explore/mlx-lm, ``mlx_lm/models/``).
They were checked against test checkpoints written from those rules, not downloaded builds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from .checkpoint import TensorInfo, dtype_size, torch_dtype
from .errors import CheckpointError
from .quant import affine
from .quant.formats import QuantConfig, check_affine

FORMAT = "mlx"  # safetensors __metadata__ "format" that mlx's save writes

# per family, names that only an mlx-lm build holds (Kimi K3's Hugging Face release also uses language_model.model.)
_MLX_ONLY = {
    "qwen3_5_moe": re.compile(r"^language_model\.model\."),
    "deepseek_v3": re.compile(r"\.self_attn\.(embed_q|unembed_out)\."),
    "gpt_oss": re.compile(r"\.mlp\.experts\.(gate|up)_proj\.(weight|scales)$"),
    "kimi_linear": re.compile(r"\.self_attn\.[qkv]_conv\.conv\."),
    "laguna": re.compile(r"\.mlp\.gate\.proj\."),
}
_MLX_ONLY["kimi_k2"] = _MLX_ONLY["deepseek_v32"] = _MLX_ONLY["deepseek_v3"]
# routers: module paths (Hugging Face names) whose weight must be float for the families
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|router|gate\.wg|shared_expert_gate)$|\.indexer\.weights_proj$")
# norm weights mlx-lm stores as 1 + w for the zero-centred Qwen3-Next/Qwen3.5 norms (matched on mlx names)
_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                  ".q_norm.weight", ".k_norm.weight")
_HYBRID = ("qwen3_next", "qwen3_5_moe")
_MLA_SPLIT = ("deepseek_v3", "kimi_k2", "deepseek_v32")
_SHARED_ONLY = ("qwen3_moe", "olmoe", "mixtral", "minimax_m2", "glm4_moe", "deepseek_v2", "hunyuan_v1_moe")
_NO_MLX_MODEL = {"kimi_k3": "mlx-lm has no Kimi K3 model, so there is no MLX naming to map from"}

_RENAMES: dict[str, list[tuple[re.Pattern, str]]] = {
    "qwen3_5_moe": [(re.compile(r"^language_model\.model\."), "model.language_model."),
                    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
                    (re.compile(r"^language_model\.mtp\."), "mtp.")],
    "laguna": [(re.compile(r"\.mlp\.gate\.proj\."), ".mlp.gate."),
               (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.experts.e_score_correction_bias")],
    "gpt_oss": [(re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)\."), r".mlp.switch_mlp.\1.")],
    "kimi_linear": [
        (re.compile(r"\.mlp\.(switch_mlp|shared_experts|gate)\."), r".block_sparse_moe.\1."),
        (re.compile(r"\.mlp\.e_score_correction_bias$"), ".block_sparse_moe.gate.e_score_correction_bias"),
        (re.compile(r"\.self_attn\.([qkv])_conv\.conv\.weight$"), r".self_attn.\1_conv1d.weight"),
        (re.compile(r"\.self_attn\.kv_a_proj\."), ".self_attn.kv_a_proj_with_mqa."),
        (re.compile(r"\.self_attn\.kv_a_norm\."), ".self_attn.kv_a_layernorm."),
    ],
}

RULES = {
    "shared": "stacked switch_mlp experts read as stored; quantization overrides renamed with the tensors",
    "qwen3_next": "norms stored 1 + w read as w; conv1d [C, K, 1] read as [C, 1, K]",
    "qwen3_5_moe": "language_model.model. -> model.language_model.; norms stored 1 + w read as w; "
                   "conv1d [C, K, 1] read as [C, 1, K]",
    "deepseek_v3": "embed_q + unembed_out -> kv_b_proj",
    "laguna": "mlp.gate.proj -> mlp.gate; mlp.gate.e_score_correction_bias -> mlp.experts.e_score_correction_bias",
    "gpt_oss": "mlp.experts.{gate,up,down}_proj (stacked, de-interleaved) -> separate gate and up experts",
    "kimi_linear": "mlp.* of MoE layers -> block_sparse_moe.*; {q,k,v}_conv.conv [C, K, 1] -> {q,k,v}_conv1d "
                   "[C, 1, K]; A_log [H] -> [1, 1, H, 1]; kv_a_proj/kv_a_norm -> kv_a_proj_with_mqa/kv_a_layernorm",
}
RULES["kimi_k2"] = RULES["deepseek_v32"] = RULES["deepseek_v3"]


@dataclass
class MLXFormat:
    """What :func:`adapt` found and did for one checkpoint (``Checkpoint.source_format``).

    ``model_type``: the family; ``rules``: the rules applied (text, for ``inspect``);
    ``renamed``: tensors given another name or shape; ``derived``: tensors computed at read.
    """

    model_type: str
    rules: list[str] = field(default_factory=list)
    renamed: int = 0
    derived: list[str] = field(default_factory=list)

    name = "mlx"  # what a family's ``adapt_to_source`` is told

    def describe(self, config: dict) -> str:
        """One line naming the format and its quantization, e.g. ``MLX (mlx-lm names); affine 4-bit, group 64``."""
        text = "MLX (mlx-lm names, mapped by rule: " + "; ".join(self.rules) + ")"
        try:
            q = QuantConfig.from_config(config)
        except CheckpointError:  # a quantization moestream.quant does not read: name its mode
            return text + f"; quantization mode {(config.get('quantization') or {}).get('mode')!r}"
        if q is not None and q.method == "affine":
            text += f"; {q.default.tag}"
            other = sorted({s.tag for s in q.overrides.values() if s is not None and s != q.default})
            if other:
                text += " (per-module overrides: " + ", ".join(other) + ")"
        return text


def is_mlx(ckpt) -> bool:
    """Whether a checkpoint was written by mlx: shard metadata ``format: mlx``, names only mlx-lm writes for
    its family, or convolution weights in mlx's axis order [C, K, 1]."""
    if any(m.get("format") == FORMAT for m in ckpt.metadata.values()):
        return True
    names = _MLX_ONLY.get(_model_type(ckpt.config))
    if names is not None and any(names.search(n) for n in ckpt.tensors):
        return True
    return any(n.endswith("conv1d.weight") and len(t.shape) == 3 and t.shape[-1] == 1 and t.shape[1] > 1
               for n, t in ckpt.tensors.items())


def _model_type(cfg: dict) -> str | None:
    mt = cfg.get("model_type")
    return mt if isinstance(mt, str) else None


def adapt(ckpt) -> MLXFormat | None:
    """Map an MLX-format checkpoint's tensor index onto Hugging Face names, in place; None if not MLX.

    Rewrites ``ckpt.tensors`` (renames, reshapes, derived tensors registered in
    ``ckpt.derived``) and the per-module overrides of ``ckpt.config["quantization"]``, and sets
    ``ckpt.source_format`` to the returned :class:`MLXFormat`.

    Raises:
        CheckpointError: an MLX checkpoint of a family mlx-lm has no model for, or tensors
            that disagree with the config or with each other (naming the tensor).
    """
    if not is_mlx(ckpt):
        return None
    mt = _model_type(ckpt.config)
    where = ckpt.path
    if mt in _NO_MLX_MODEL:
        raise CheckpointError(f"{where}: an MLX-format checkpoint of model_type {mt!r}: {_NO_MLX_MODEL[mt]}; "
                              "use the Hugging Face release")
    fmt = MLXFormat(mt or "?", [RULES["shared"]])
    if mt in RULES:
        fmt.rules.append(RULES[mt])
    # parsed only where a quantized router or embed_q needs it (on mlx names, before the overrides are renamed)
    qcfg = partial(QuantConfig.from_config, dict(ckpt.config), str(where / "config.json"))
    old = ckpt.tensors
    renames = _RENAMES.get(mt, [])
    if mt == "kimi_linear":
        renames = _kimi_renames(old)

    def rename(name: str) -> str:
        for pat, repl in renames:
            name = pat.sub(repl, name)
        return name

    shift = mt in _HYBRID and _hybrid_is_shifted(old, where)
    new: dict[str, TensorInfo] = {}
    for name, info in old.items():
        hf = rename(name)
        shape = info.shape
        if mt in _HYBRID and name.endswith("conv1d.weight") and len(shape) == 3 and shape[-1] == 1:
            shape = (shape[0], 1, shape[1])  # mlx [C, K, 1] -> torch [C, 1, K]: same bytes
        if mt == "kimi_linear" and name.endswith(".A_log") and len(shape) == 1:
            shape = (1, 1, shape[0], 1)
        if mt == "kimi_linear" and hf.endswith("_conv1d.weight") and len(shape) == 3 and shape[-1] == 1:
            shape = (shape[0], 1, shape[1])
        if hf in new:
            raise CheckpointError(f"{info.file}: tensors {new[hf].name!r} and {name!r} both map to {hf!r}")
        if hf != name or shape != info.shape:
            fmt.renamed += 1
        new[hf] = replace(info, name=name, shape=shape) if shape != info.shape else info
        if shift and info.shape == (info.shape[0],) and name.endswith(_SHIFTED_NORMS):
            _derive(ckpt, fmt, new, hf, new[hf], partial(_unshift, new[hf]))
    if mt in _MLA_SPLIT:
        _merge_kv_b(ckpt, fmt, new, qcfg)
    _dequantize_routers(ckpt, fmt, new, qcfg, rename)
    ckpt.tensors = new
    _rename_overrides(ckpt.config, rename)
    ckpt.source_format = fmt
    return fmt


def _derive(ckpt, fmt: MLXFormat, index: dict, name: str, info: TensorInfo, make: Callable) -> None:
    """Register ``name`` (described by ``info``) as computed by ``make(ckpt)`` when read."""
    index[name] = info
    ckpt.derived[name] = make
    fmt.derived.append(name)


def _unshift(info: TensorInfo, ckpt) -> torch.Tensor:
    """A norm weight mlx-lm stored as ``1 + w``: ``w`` in float32 (exact while ``1 + w`` >= 0.5)."""
    return ckpt.read_info(info).float() - 1.0


def _hybrid_is_shifted(tensors: dict, where) -> bool:
    """Whether a Qwen3-Next/Qwen3.5 MLX checkpoint stores its norms shifted: its conv weights are in mlx order.

    mlx-lm adds 1 to the norms in the same step that moves the conv axis, so the two go together.

    Raises:
        CheckpointError: conv weights in both orders.
    """
    convs = {n: t.shape for n, t in tensors.items() if n.endswith("conv1d.weight") and len(t.shape) == 3}
    mlx = {n for n, s in convs.items() if s[-1] == 1 and s[1] > 1}
    torch_order = set(convs) - mlx
    if mlx and torch_order:
        raise CheckpointError(f"{where}: conv weights in mlx order [C, K, 1] ({sorted(mlx)[0]}) and in torch order "
                              f"[C, 1, K] ({sorted(torch_order)[0]}) in one checkpoint; it is neither an mlx-lm "
                              "build nor a Hugging Face release")
    return bool(mlx)


def _kimi_renames(tensors: dict) -> list[tuple[re.Pattern, str]]:
    """Kimi-Linear's renames; ``mlp.`` -> ``block_sparse_moe.`` only in MoE layers (dense ones keep ``mlp``)."""
    moe_layers = {m[1] for n in tensors if (m := re.match(r"^(model\.layers\.\d+)\.mlp\.switch_mlp\.", n))}
    out = []
    for pat, repl in _RENAMES["kimi_linear"]:
        if pat.pattern.startswith(r"\.mlp\."):
            layers = "|".join(re.escape(p) for p in sorted(moe_layers)) or "(?!)"
            pat = re.compile(rf"^(?P<L>{layers}){pat.pattern}")
            repl = r"\g<L>" + repl.replace(r"\1", r"\2")  # group 1 is now the layer
        out.append((pat, repl))
    return out


def _quant_scheme(qcfg, mlx_path: str, info: TensorInfo, index: dict, path: str, where):
    """The affine scheme of module ``mlx_path``, checked against its tensors' shapes."""
    qcfg = qcfg()
    scheme = qcfg.scheme(mlx_path) if qcfg is not None and qcfg.method == "affine" else None
    if scheme is None:
        raise CheckpointError(f"{where}: tensor {info.name!r} is packed uint32 but config.json declares no mlx "
                              "affine quantization for it ('quantization': {group_size, bits})")
    sc, bi = index.get(path + ".scales"), index.get(path + ".biases")
    check_affine(info.name, scheme, info.shape, sc and sc.shape, bi and bi.shape, None, where)
    return scheme


def _merge_kv_b(ckpt, fmt: MLXFormat, index: dict, qcfg) -> None:
    """DeepSeek-V3-style ``embed_q`` + ``unembed_out`` -> one derived ``kv_b_proj`` per layer (see module doc)."""
    cfg = ckpt.config
    heads, rank = cfg.get("num_attention_heads"), cfg.get("kv_lora_rank")
    nope, v = cfg.get("qk_nope_head_dim"), cfg.get("v_head_dim")
    where = ckpt.path
    for name in [n for n in index if n.endswith(".self_attn.embed_q.weight")]:
        attn = name[: -len(".embed_q.weight")]
        q_path, o_path = attn + ".embed_q", attn + ".unembed_out"
        if o_path + ".weight" not in index:
            raise CheckpointError(f"{where}: tensor {name!r} has no {o_path}.weight beside it")
        parts = {}
        for path, want in ((q_path, (heads, rank, nope)), (o_path, (heads, v, rank))):
            info = index.pop(path + ".weight")
            scheme = None
            if info.dtype == "U32":
                scheme = _quant_scheme(qcfg, path, info, index, path, where)
                shape = (*info.shape[:-1], info.shape[-1] * 32 // scheme.bits)
                dtype = index[path + ".scales"].dtype
            else:
                shape, dtype = info.shape, info.dtype
            if tuple(shape) != want:
                raise CheckpointError(f"{info.file}: tensor {info.name!r} is {list(shape)} once unpacked; the config "
                                      f"(heads, kv_lora_rank, qk_nope_head_dim, v_head_dim) implies {list(want)}")
            extra = {s: index.pop(f"{path}.{s}") for s in ("scales", "biases") if f"{path}.{s}" in index}
            parts[path] = (info, scheme, extra, dtype)
        dtype = parts[q_path][3]
        kv_b = TensorInfo(attn + ".kv_b_proj.weight", parts[q_path][0].file, parts[q_path][0].offset,
                          heads * (nope + v) * rank * dtype_size(dtype), dtype, (heads * (nope + v), rank))
        _derive(ckpt, fmt, index, kv_b.name, kv_b, partial(_kv_b, parts[q_path], parts[o_path], torch_dtype(dtype)))


def _kv_b(q_part, o_part, dtype: torch.dtype, ckpt) -> torch.Tensor:
    """kv_b_proj [H * (nope + v), rank] from embed_q [H, rank, nope] and unembed_out [H, v, rank]."""
    def read(part):
        info, scheme, extra, _ = part
        w = ckpt.read_info(info)
        if scheme is None:
            return w
        return affine.dequantize(w, ckpt.read_info(extra["scales"]), ckpt.read_info(extra["biases"]),
                                 scheme.bits, scheme.group_size)

    wk, wv = read(q_part).transpose(-1, -2), read(o_part)
    return torch.cat([wk, wv.to(wk.dtype)], dim=1).reshape(-1, wk.shape[-1]).to(dtype).contiguous()


def _dequantize_routers(ckpt, fmt: MLXFormat, index: dict, qcfg, rename) -> None:
    """Quantized routers become derived float weights (their scales and biases leave the index)."""
    mlx_path = {rename(n)[: -len(".weight")]: n[: -len(".weight")] for n in ckpt.tensors if n.endswith(".weight")}
    for name in [n for n in index if n.endswith(".weight") and index[n].dtype == "U32"]:
        path = name[: -len(".weight")]
        if not _ROUTER.search(path):
            continue
        info = index[name]
        scheme = _quant_scheme(qcfg, mlx_path.get(path, path), info, index, path, ckpt.path)
        sc, bi = index.pop(path + ".scales"), index.pop(path + ".biases")
        out_in = (info.shape[0], info.shape[1] * 32 // scheme.bits)
        flt = TensorInfo(name, info.file, info.offset, out_in[0] * out_in[1] * dtype_size(sc.dtype), sc.dtype, out_in)
        _derive(ckpt, fmt, index, name, flt, partial(_router, info, sc, bi, scheme))


def _router(w: TensorInfo, scales: TensorInfo, biases: TensorInfo, scheme, ckpt) -> torch.Tensor:
    """A router's float weight [E, H] from its affine-quantized tensors (computed in the scales' dtype, as mlx)."""
    return affine.dequantize(ckpt.read_info(w), ckpt.read_info(scales), ckpt.read_info(biases), scheme.bits,
                             scheme.group_size)


def _rename_overrides(cfg: dict, rename) -> None:
    """Rename mlx-lm's per-module quantization overrides (module paths) as the tensors were renamed."""
    for key in ("quantization", "quantization_config"):
        q = cfg.get(key)
        if isinstance(q, dict):
            cfg[key] = {(rename(k + ".weight")[: -len(".weight")] if isinstance(v, (dict, bool)) else k): v
                        for k, v in q.items()}


__all__ = ["FORMAT", "MLXFormat", "adapt", "is_mlx"]
