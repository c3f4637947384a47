"""Which quantization a checkpoint uses, per linear, and checks of its tensors against it.

Three published formats are read as they are, never dequantized on disk:

* ``affine`` -- MLX affine quantization (:mod:`moestream.quant.affine`): config.json
  ``quantization: {group_size, bits}`` plus per-module overrides (a module path mapped to
  ``{group_size, bits}``, or ``false`` for a module left in float); tensors ``weight``
  (uint32), ``scales`` and ``biases``.
* ``fp8`` -- FP8 e4m3 with block scales (:mod:`moestream.quant.fp8`): config.json
  ``quantization_config: {quant_method: "fp8", weight_block_size: [bn, bk]}``; tensors
  ``weight`` (F8_E4M3) and ``weight_scale_inv``.
* ``mxfp4`` -- MXFP4 (:mod:`moestream.quant.mxfp4`): ``quantization_config: {quant_method:
  "mxfp4"}``; tensors ``<name>_blocks`` and ``<name>_scales`` (gpt-oss experts).
* ``gguf`` -- ggml block types (:mod:`moestream.quant.ggml`) of a GGUF file
  (:mod:`moestream.gguf_format`): one tensor of raw block bytes per weight, its type in its
  dtype name (``GGML_Q4_K``); no config entry, every tensor carries its own type.

A tensor is taken as quantized by what the checkpoint holds (a uint32 weight with
scales, an fp8 weight, blocks); the config says how, and every disagreement -- a
missing scale tensor, a shape that does not match the config's group size or bits, a
quantized tensor the config does not declare -- is a :class:`QuantError` naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatch

import torch

from ..errors import CheckpointError
from . import affine, fp8, ggml, mxfp4, registry
from .fp8 import block_scales_shape
from .registry import CpuKernel, GgmlFormat, StoredFormat


class QuantError(CheckpointError):
    """A checkpoint's quantization metadata disagrees with its tensors (names the tensor)."""


@dataclass(frozen=True)
class Scheme:
    """How one linear is quantized.

    ``method``: ``"affine"``, ``"fp8"``, ``"mxfp4"`` or ``"gguf"``; ``bits``: bits per weight code
    (affine 2-8; fp8 8; mxfp4 4; gguf the type's nominal bits); ``group_size``: values sharing one
    scale along the input dimension (affine group, fp8 block width, mxfp4 32, a ggml block);
    ``block``: fp8 (rows, cols). ``scale``: the name of the scale tensor beside the weight when
    it is not the method's own (``weight_scale`` in compressed-tensors checkpoints,
    :mod:`.compressed`). ``ggml``: the ggml block type of a gguf weight (``"Q4_K"``). ``act``: how a gguf or
    affine weight's input is multiplied: ``"float"`` (float32, the default) or ``"q8"`` (8-bit activation
    blocks and integer dot products, llama.cpp's for gguf, ``--activations q8``: :func:`with_activations`).
    """

    method: str
    bits: int
    group_size: int
    block: tuple[int, int] | None = None
    scale: str | None = None
    ggml: str | None = None
    act: str = "float"

    @property
    def format(self) -> StoredFormat | None:
        """Its entry in the stored-format registry (:mod:`.registry`), or None for a method it does not know."""
        return registry.FORMATS.get(self.ggml or self.method)

    @property
    def scale_param(self) -> str:
        """The scale tensor's parameter name: the format's (``weight_scale_inv`` fp8, ``scales`` mxfp4 and
        affine) unless the checkpoint names its own (:attr:`scale`)."""
        if self.scale is not None:
            return self.scale
        fmt = self.format
        return fmt.scale if fmt is not None and fmt.scale else "scales"

    @property
    def tag(self) -> str:
        fmt = self.format
        return fmt.tag(self) if fmt is not None and fmt.tag else f"{self.method} {self.bits}-bit"


def ggml_scheme(dtype: str) -> Scheme | None:
    """The :class:`Scheme` of a tensor stored as ggml blocks (dtype name ``GGML_<type>``), else None.

    Raises:
        QuantError: a ggml type :mod:`.ggml` does not compute on.
    """
    t = ggml.block_type(dtype)
    if t is None:
        return None
    if t not in ggml.TYPES:
        raise QuantError(f"ggml type {t} is not supported (moestream reads {', '.join(ggml.TYPES)})")
    block, _, bits = ggml.TYPES[t]
    return Scheme("gguf", bits, block, ggml=t)


def check_ggml(name: str, scheme: Scheme, shape: tuple[int, ...], where) -> tuple[int, int]:
    """[out, in] of a ggml weight stored as bytes [out, row bytes]; QuantError naming ``name`` when the row
    is not whole blocks."""
    inn = ggml.in_features(scheme.ggml, shape[-1])
    if len(shape) < 2 or inn is None:
        raise QuantError(f"{where}: tensor {name!r} {list(shape)} is not whole {scheme.ggml} blocks "
                         f"of {ggml.TYPES[scheme.ggml][1]} bytes per row")
    return shape[-2], inn


def _affine_scheme(entry: dict, where: str) -> Scheme:
    bits, gs = entry.get("bits"), entry.get("group_size")
    mode = entry.get("mode", "affine")
    if mode != "affine":
        raise QuantError(f"{where}: quantization mode {mode!r} is not supported "
                         "(moestream reads mlx 'affine' and 'turboquant')")
    if bits not in affine.BITS:
        raise QuantError(f"{where}: quantization bits {bits!r} must be one of {affine.BITS}")
    if not isinstance(gs, int) or isinstance(gs, bool) or gs < 1 or gs % 32:
        raise QuantError(f"{where}: quantization group_size {gs!r} must be a positive multiple of 32")
    return Scheme("affine", bits, gs)


class QuantConfig:
    """The quantization a config.json declares, looked up per module path.

    Build with :meth:`from_config`; None when the config declares none. Which format a config selects is
    the stored-format registry's (:mod:`.registry`): the entry whose ``quant_method`` is the
    ``quantization_config.quant_method`` (fp8, mxfp4, compressed-tensors) or whose ``mode`` is the mlx
    ``quantization.mode`` (affine, turboquant) parses it.
    """

    # a subclass whose experts follow rules of their own sets this and defines layer_format(lay, shape, where)
    own_layer_rules = False

    def __init__(self, method: str, default: Scheme | None, overrides: dict[str, Scheme | None],
                 skip: tuple[str, ...] = ()):
        self.method = method
        self.default = default
        self.overrides = overrides
        self.skip = skip

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> "QuantConfig | None":
        """Parse ``quantization`` (mlx) or ``quantization_config`` (fp8, mxfp4, or mlx's copy).

        Raises:
            QuantError: an unsupported method or a malformed field, naming it.
        """
        if "quantization" not in cfg and "quantization_config" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]  # a multimodal config (Kimi K3) declares the text model's quantization there
        q = cfg.get("quantization")
        if q is None and isinstance(cfg.get("quantization_config"), dict):
            qc = cfg["quantization_config"]
            method = qc.get("quant_method")
            fmt = registry.by_quant_method(method)
            if method is None and "bits" in qc:
                q = qc  # mlx-lm writes the same dict under both names
            elif fmt is not None:  # fp8, mxfp4, compressed-tensors: the format's own parse
                return fmt.parse(qc, where)
            elif method is not None:
                # another method (compressed-tensors, ...): harmless while the tensors are float
                # (as `moestream synth` writes them); a quantized tensor is refused when met
                return cls(str(method), None, {})
        if q is None:
            return None
        if not isinstance(q, dict):
            raise QuantError(f"{where}: quantization is not an object")
        fmt = registry.by_mode(q.get("mode", "affine"))  # affine, or turboquant-mlx tq* builds (.turboquant)
        if fmt is None:
            _affine_scheme(q, f"{where}: quantization")  # refuses the mode, naming it
        return fmt.parse(q, where)

    def scheme(self, module: str, *aliases: str) -> Scheme | None:
        """The scheme of the linear at ``module`` (or the first of ``aliases`` with an override)."""
        for name in (module, *aliases):
            if name in self.overrides:
                return self.overrides[name]
        if any(fnmatch(module, s) or fnmatch(module, s + ".*") or s in module.split(".") for s in self.skip):
            return None
        return self.default


@dataclass(frozen=True)
class LinearFormat:
    """One quantized (or float) linear of an expert: its role and logical shape [out, in]."""

    role: str
    scheme: Scheme | None
    out_features: int
    in_features: int


@dataclass(frozen=True)
class ExpertFormat:
    """How one MoE layer's experts are stored: a :class:`LinearFormat` per weight role.

    ``fused_gate_up``: gate and up are one interleaved ``gate_up`` linear [2I, H] (gpt-oss).
    """

    linears: dict[str, LinearFormat]
    fused_gate_up: bool = False

    @property
    def tag(self) -> str:
        tags = sorted({lf.scheme.tag for lf in self.linears.values() if lf.scheme is not None})
        return "; ".join(tags) or "float"


def check_affine(name: str, scheme: Scheme, shape: tuple[int, ...], scales: tuple[int, ...] | None,
                 biases: tuple[int, ...] | None, in_features: int | None, where: str) -> tuple[int, int]:
    """Check an affine weight's shapes against ``scheme``; return its logical [out, in].

    ``in_features`` (from the model config) is checked when given. Raises QuantError naming ``name``.
    """
    if scales is None:
        raise QuantError(f"{where}: tensor {name!r} is quantized (uint32) but {name[:-len('weight')]}scales "
                         "is missing")
    if biases is None:
        raise QuantError(f"{where}: tensor {name!r} is affine-quantized but {name[:-len('weight')]}biases "
                         "is missing")
    inn = shape[-1] * 32 // scheme.bits
    if shape[-1] * 32 % scheme.bits or shape[:-1] != scales[:-1] or scales != biases:
        raise QuantError(f"{where}: tensor {name!r} {list(shape)} with scales {list(scales)} and biases "
                         f"{list(biases)} is not {scheme.tag}")
    if scales[-1] * scheme.group_size != inn:
        raise QuantError(
            f"{where}: tensor {name!r} holds {inn} inputs at {scheme.bits} bits but its scales have "
            f"{scales[-1]} groups; the config's group_size {scheme.group_size} implies {inn // scheme.group_size} "
            f"(wrong group_size or bits in config.json?)"
        )
    if in_features is not None and inn != in_features:
        raise QuantError(f"{where}: tensor {name!r} unpacks to {inn} inputs at {scheme.bits} bits; the model "
                         f"config implies {in_features} (wrong bits in config.json?)")
    return shape[-2], inn


def check_fp8(name: str, scheme: Scheme, shape: tuple[int, ...], scale_inv: tuple[int, ...] | None,
              where: str) -> tuple[int, int]:
    """Check an fp8 weight's block-scale shape; return [out, in]. Raises QuantError naming ``name``."""
    if scale_inv is None:
        raise QuantError(f"{where}: tensor {name!r} is fp8 but {name}_scale_inv is missing")
    want = block_scales_shape(shape[-2:], scheme.block)
    if tuple(scale_inv[-2:]) != want:
        raise QuantError(f"{where}: tensor {name}_scale_inv has shape {list(scale_inv)}; a {list(shape)} weight "
                         f"in {scheme.block[0]}x{scheme.block[1]} blocks needs {list(want)}")
    return shape[-2], shape[-1]


def check_mxfp4(name: str, shape: tuple[int, ...], scales: tuple[int, ...] | None, where: str) -> tuple[int, int]:
    """Check MXFP4 blocks [out, in/32, 16] against scales [out, in/32]; return [out, in]."""
    if scales is None:
        raise QuantError(f"{where}: tensor {name!r} is mxfp4 but {name[: -len('blocks')]}scales is missing")
    if len(shape) < 3 or shape[-1] != 16 or tuple(scales) != tuple(shape[:-1]):
        raise QuantError(f"{where}: tensor {name!r} {list(shape)} with scales {list(scales)} is not mxfp4 "
                         "blocks [out, in/32, 16] and scales [out, in/32]")
    return shape[-3], shape[-2] * 32


# -- the stored formats this module owns (registry entries: :mod:`.registry`) ----------------------------

def _parse_affine(q: dict, where: str) -> QuantConfig:
    default = _affine_scheme(q, f"{where}: quantization")
    overrides: dict[str, Scheme | None] = {}
    for k, v in q.items():
        if isinstance(v, dict):
            overrides[k] = _affine_scheme(v, f"{where}: quantization[{k!r}]")
        elif v is False:
            overrides[k] = None
    return QuantConfig("affine", default, overrides)


def _parse_fp8(qc: dict, where: str) -> QuantConfig:
    blk = qc.get("weight_block_size")
    if not (isinstance(blk, list) and len(blk) == 2 and all(isinstance(b, int) and b > 0 for b in blk)):
        raise QuantError(f"{where}: quantization_config.weight_block_size {blk!r} is not [rows, cols]")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantError(f"{where}: quantization_config.fmt {fmt!r}: only e4m3 is supported")
    skip = tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig("fp8", Scheme("fp8", 8, blk[1], (blk[0], blk[1])), {}, skip)


def _parse_mxfp4(qc: dict, where: str) -> QuantConfig:
    return QuantConfig("mxfp4", Scheme("mxfp4", 4, 32), {}, tuple(qc.get("modules_to_not_convert") or ()))


def _dequantize_affine(t: dict, lf, r0: int, r1: int) -> torch.Tensor:
    s, role = lf.scheme, lf.role
    return affine.dequantize(t[role][r0:r1], t[role + ".scales"][r0:r1], t[role + ".biases"][r0:r1],
                             s.bits, s.group_size, torch.float32)


def _dequantize_fp8(t: dict, lf, r0: int, r1: int) -> torch.Tensor:
    s, role = lf.scheme, lf.role
    return fp8.dequantize_rows(t[role], t[role + "." + s.scale_param], s.block, r0, r1, torch.float32)


def _dequantize_mxfp4(t: dict, lf, r0: int, r1: int) -> torch.Tensor:
    # gpt-oss blocks [out, in/32, 16] or compressed-tensors' packed [out, in/2]: the same bytes
    blocks = t[lf.role][r0:r1]
    return mxfp4.dequantize(blocks.reshape(blocks.shape[0], -1, 16), t[lf.role + "." + lf.scheme.scale_param][r0:r1],
                            torch.float32)


def _dequantize_ggml(t: dict, lf, r0: int, r1: int) -> torch.Tensor:
    return ggml.dequantize(t[lf.role][r0:r1], lf.scheme.ggml, lf.in_features)  # rows of blocks [out, row bytes]


def _fp8_tag(s: Scheme) -> str:
    if s.block == (1, 0):
        return "fp8 e4m3, per-channel scales"
    if s.block == (0, 0):
        return "fp8 e4m3, per-tensor scale"
    return f"fp8 e4m3, blocks {s.block[0]}x{s.block[1]}"


_SCALE_DTYPES = ("BF16", "F16", "F32")
registry.register(StoredFormat(
    name="affine", method="affine", summary="MLX affine, 2-8 bits (w = scale * q + bias per group)",
    selected_by="config.json quantization: {group_size, bits} (mode affine), per-module overrides",
    weight=("U32",), params=(("scales", _SCALE_DTYPES), ("biases", _SCALE_DTYPES)), scale="scales",
    parse=_parse_affine, check=check_affine, dequantize=_dequantize_affine,
    tag=lambda s: f"affine {s.bits}-bit, group {s.group_size}" + (", q8 activations" if s.act == "q8" else ""),
    cpu=CpuKernel("affine"),
    gpu_bits=affine.BITS, mode="affine"))
registry.register(StoredFormat(
    name="fp8", method="fp8", summary="FP8 e4m3 with block, per-channel or per-tensor scales",
    selected_by="quantization_config.quant_method fp8 with weight_block_size",
    weight=("F8_E4M3",), params=(("weight_scale_inv", _SCALE_DTYPES),), scale="weight_scale_inv",
    parse=_parse_fp8, check=check_fp8, dequantize=_dequantize_fp8, tag=_fp8_tag, cpu=CpuKernel("fp8"),
    gpu_bits=(8,), quant_method="fp8"))
registry.register(StoredFormat(
    name="mxfp4", method="mxfp4", summary="MXFP4: 32 e2m1 values with an e8m0 scale (gpt-oss experts)",
    selected_by="quantization_config.quant_method mxfp4; tensors <name>_blocks and <name>_scales",
    weight=("U8",), params=(("scales", ("U8",)),), scale="scales", parse=_parse_mxfp4, check=check_mxfp4,
    dequantize=_dequantize_mxfp4, tag=lambda s: "mxfp4", cpu=CpuKernel("mxfp4"), gpu_bits=(4,),
    quant_method="mxfp4"))

# each ggml type as the compiled kernels read it (csrc/traits.h has the same rows; native.py checks them at
# load): type code, weights per decoded sub-block, the q8 mode's activation block (None: float activations)
_GGML_CPU = {
    "Q4_0": (0, 32, "Q8_0"), "Q4_1": (1, 32, None), "Q5_0": (2, 32, "Q8_0"), "Q5_1": (3, 32, None),
    "Q8_0": (4, 32, "Q8_0"), "Q2_K": (5, 16, None), "Q3_K": (6, 16, None), "Q4_K": (7, 32, "Q8_K"),
    "Q5_K": (8, 32, "Q8_K"), "Q6_K": (9, 16, "Q8_K"), "IQ4_NL": (10, 32, "Q8_0"), "IQ4_XS": (11, 32, None),
    "MXFP4": (12, 32, None), "IQ2_XXS": (13, 32, None), "IQ2_XS": (14, 16, None), "IQ2_S": (15, 16, None),
    "IQ3_XXS": (16, 32, None), "IQ3_S": (17, 32, None), "IQ1_S": (18, 32, None), "IQ1_M": (19, 16, None),
    "TQ1_0": (20, 32, None), "TQ2_0": (21, 32, None),
}
for _t, (_block, _size, _bits) in ggml.TYPES.items():
    _code, _group, _q8 = _GGML_CPU[_t]
    registry.register(GgmlFormat(
        name=_t, method="gguf", summary=f"ggml {_t}: {_block} weights in {_size} bytes",
        selected_by=f"a GGUF tensor of type {_t} (dtype {ggml.dtype_name(_t)}); no config entry",
        weight=(ggml.dtype_name(_t),), check=check_ggml, dequantize=_dequantize_ggml,
        tag=lambda s: f"gguf {s.ggml}" + (", q8 activations" if s.act == "q8" else ""),
        cpu=CpuKernel("ggml", _code, _group, _q8),
        no_gpu="ggml blocks compute on the CPU (the fused GPU kernel reads MLX affine, fp8 and MXFP4)",
        block=_block, type_size=_size, bits=_bits))


def expert_format(lay, qcfg: QuantConfig | None, shape: tuple[int, int], where) -> ExpertFormat | None:
    """The :class:`ExpertFormat` of one MoE layer's experts, or None when they are plain float.

    Args:
        lay: a :class:`~moestream.layout.MoELayerLayout`.
        qcfg: the checkpoint's :class:`QuantConfig` (None if its config declares none).
        shape: (intermediate, hidden) of one expert from the model config.

    Raises:
        QuantError: naming the tensor whose pieces disagree with the config or the model shape.
    """
    if qcfg is not None and qcfg.own_layer_rules:  # compressed-tensors
        return qcfg.layer_format(lay, shape, where)
    pieces = {p.role: p for p in lay.experts[0]}
    inter, hidden = shape
    fused = "gate_up" in pieces
    weights = ("gate_up", "down") if fused else ("gate", "up", "down")
    logical = {"gate": (inter, hidden), "up": (inter, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    quantized = any(
        p.dtype in ("U32", "F8_E4M3") or ggml.block_type(p.dtype)
        or "." in r and r.split(".", 1)[1] in ("scales", "weight_scale_inv", "blocks")
        for r, p in pieces.items()
    )
    if not quantized:
        return None
    linears = {}
    for role in weights:
        w = pieces[role]
        name = w.source
        proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj", "gate_up": "gate_up_proj"}[role]
        module = f"{lay.block}.{'switch_mlp' if lay.kind == 'stacked' else 'experts'}.{proj}"
        if lay.kind == "per-expert":
            module = name.rsplit(".", 1)[0]
        alias = f"{lay.block}.switch_mlp.{proj}"
        what = f"{name} (layer {lay.layer}, expert 0)" if lay.kind != "per-expert" else name
        out_in = logical[role]
        if ggml.block_type(w.dtype):  # a GGUF file's block bytes: the type is the dtype's
            try:
                scheme = ggml_scheme(w.dtype)
            except QuantError as e:
                raise QuantError(f"{where}: tensor {what!r}: {e}") from None
            got = check_ggml(what, scheme, w.shape, where)
        elif w.dtype == "U32":
            scheme = qcfg.scheme(module, alias) if qcfg and qcfg.method == "affine" else None
            if scheme is None:
                raise QuantError(f"{where}: tensor {what!r} is packed uint32 but config.json declares no mlx affine "
                                 "quantization for it ('quantization': {group_size, bits})")
            sc, bi = pieces.get(role + ".scales"), pieces.get(role + ".biases")
            got = check_affine(what, scheme, w.shape, sc and sc.shape, bi and bi.shape, out_in[1], where)
        elif w.dtype == "F8_E4M3":
            if qcfg is None or qcfg.method != "fp8":
                raise QuantError(f"{where}: tensor {what!r} is fp8 but config.json declares no quantization_config "
                                 f"with quant_method 'fp8' (it declares {qcfg and qcfg.method})")
            scheme = qcfg.default
            si = pieces.get(role + ".weight_scale_inv")
            got = check_fp8(what, scheme, w.shape, si and si.shape, where)
        elif w.dtype == "U8" and len(w.shape) == 3:
            if qcfg is None or qcfg.method != "mxfp4":
                raise QuantError(f"{where}: tensor {what!r} holds mxfp4 blocks but config.json declares no "
                                 "quantization_config with quant_method 'mxfp4'")
            scheme = qcfg.default
            sc = pieces.get(role + ".scales")
            got = check_mxfp4(what, w.shape, sc and sc.shape, where)
        else:
            scheme, got = None, tuple(w.shape)
            if qcfg is not None and qcfg.method == "affine" and qcfg.scheme(module, alias) is not None:
                if role + ".scales" not in pieces:
                    raise QuantError(f"{where}: config.json quantizes {module} but tensor {what!r} is "
                                     f"{w.dtype} and its scales are missing")
        if tuple(got) != out_in:
            raise QuantError(f"{where}: tensor {what!r} is [{got[0]}, {got[1]}] once unpacked; the model config "
                             f"implies {list(out_in)}")
        linears[role] = LinearFormat(role, scheme, *out_in)
    return ExpertFormat(linears, fused)


def expert_nbytes_per_param(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Bytes per weight of affine ``bits``/``group_size`` storage with float scales and biases."""
    return bits / 8 + 2 * scale_bytes / group_size


def is_quant_param(role: str) -> bool:
    """Whether an expert piece ``role`` holds quantization parameters kept in their stored dtype (a role
    some registered format declares: :func:`.registry.quant_params`)."""
    return "." in role and role.split(".", 1)[1] in registry.quant_params()


__all__ = ["QuantError", "Scheme", "QuantConfig", "LinearFormat", "ExpertFormat", "expert_format", "ggml_scheme"]


# The ggml types the q8 activation mode computes on (moestream/quant/csrc/q8.h; their entries' CpuKernel.q8):
# what Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q5_0 and IQ4_NL files hold for their experts and linears, those taking
# Q8_K activations first. A tensor of another type keeps float activations.
Q8_ACTIVATION_TYPES = tuple(sorted((t for t, f in registry.ggml_formats().items() if f.cpu.q8),
                                   key=lambda t: registry.get(t).cpu.q8 != "Q8_K"))


# The MLX affine code widths q8 mode computes on (csrc/q8.h Q8_A4, Q8_A8: a byte's two nibbles or one code per
# byte against 8-bit activations), with inputs in whole 64-value chunks and groups of 32 or multiples of 64; other
# linears keep float activations.
AFFINE_Q8_BITS = (4, 8)


def with_activations(lf: LinearFormat | None, activations: str, fallback: list | None = None,
                     name: str = "") -> LinearFormat | None:
    """``lf`` with its input multiplied in ``activations`` mode (``"float"`` or ``"q8"``). In q8 mode a gguf
    weight of a type in :data:`Q8_ACTIVATION_TYPES`, and an MLX affine weight of :data:`AFFINE_Q8_BITS` whose
    input width is a multiple of 64, becomes ``act="q8"``; a gguf or affine weight of another type or width stays
    float and ``(name, type)`` is appended to ``fallback``; anything else (float, other methods) is returned as
    it is."""
    s = None if lf is None else lf.scheme
    if activations != "q8" or s is None:
        return lf
    if s.method == "affine" and s.format is not None and s.format.name == "affine":
        if s.bits not in AFFINE_Q8_BITS:
            why = f"affine {s.bits}-bit"
        elif lf.in_features % 64 or lf.in_features % s.group_size:
            why = f"affine {s.bits}-bit with {lf.in_features} inputs (not whole 64-value chunks)"
        elif s.group_size != 32 and s.group_size % 64:
            why = f"affine {s.bits}-bit in groups of {s.group_size} (q8 takes 32 or multiples of 64)"
        else:
            return replace(lf, scheme=replace(s, act="q8"))
        if fallback is not None:
            fallback.append((name or lf.role, why))
        return lf
    if not isinstance(s.format, GgmlFormat):
        return lf
    if s.format.cpu.q8 is None:
        if fallback is not None:
            fallback.append((name or lf.role, s.ggml))
        return lf
    return replace(lf, scheme=replace(s, act="q8"))


def expert_with_activations(fmt: ExpertFormat | None, activations: str, fallback: list | None = None,
                            name: str = "") -> ExpertFormat | None:
    """``fmt`` with each linear's input in ``activations`` mode (:func:`with_activations`); ``name`` prefixes
    the roles reported in ``fallback``."""
    if fmt is None or activations != "q8" or not isinstance(fmt, ExpertFormat):
        return fmt
    lin = {r: with_activations(lf, activations, fallback, f"{name}{r}") for r, lf in fmt.linears.items()}
    return replace(fmt, linears=lin)
