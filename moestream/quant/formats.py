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

from ..errors import CheckpointError
from . import affine, ggml
from .fp8 import block_scales_shape


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
    :mod:`.compressed`). ``ggml``: the ggml block type of a gguf weight (``"Q4_K"``). ``act``: how a gguf
    weight's input is multiplied: ``"float"`` (float32, the default) or ``"q8"`` (llama.cpp's 8-bit activation
    blocks and integer dot products, ``--activations q8``: :func:`with_activations`).
    """

    method: str
    bits: int
    group_size: int
    block: tuple[int, int] | None = None
    scale: str | None = None
    ggml: str | None = None
    act: str = "float"

    @property
    def scale_param(self) -> str:
        """The scale tensor's parameter name: ``weight_scale_inv`` (fp8), ``scales`` (mxfp4, affine) by default."""
        if self.scale is not None:
            return self.scale
        return "weight_scale_inv" if self.method == "fp8" else "scales"

    @property
    def tag(self) -> str:
        if self.method == "affine":
            return f"affine {self.bits}-bit, group {self.group_size}"
        if self.method == "fp8":
            if self.block == (1, 0):
                return "fp8 e4m3, per-channel scales"
            if self.block == (0, 0):
                return "fp8 e4m3, per-tensor scale"
            return f"fp8 e4m3, blocks {self.block[0]}x{self.block[1]}"
        if self.method == "gguf":
            return f"gguf {self.ggml}" + (", q8 activations" if self.act == "q8" else "")
        return "mxfp4"


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

    Build with :meth:`from_config`; None when the config declares none. A format with config rules
    of its own registers its parser here when its module is imported (the package imports them all):
    :data:`METHODS` for a ``quantization_config.quant_method`` (compressed-tensors), :data:`MODES` for
    an mlx ``quantization.mode`` (turboquant).
    """

    METHODS: dict = {}  # quant_method -> parser(quantization_config, where) -> QuantConfig
    MODES: dict = {}  # quantization.mode -> class(quantization, where)
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
            if method == "fp8":
                blk = qc.get("weight_block_size")
                if not (isinstance(blk, list) and len(blk) == 2 and all(isinstance(b, int) and b > 0 for b in blk)):
                    raise QuantError(f"{where}: quantization_config.weight_block_size {blk!r} is not [rows, cols]")
                fmt = qc.get("fmt", "e4m3")
                if fmt != "e4m3":
                    raise QuantError(f"{where}: quantization_config.fmt {fmt!r}: only e4m3 is supported")
                skip = tuple(qc.get("modules_to_not_convert") or ())
                return cls("fp8", Scheme("fp8", 8, blk[1], (blk[0], blk[1])), {}, skip)
            if method == "mxfp4":
                skip = tuple(qc.get("modules_to_not_convert") or ())
                return cls("mxfp4", Scheme("mxfp4", 4, 32), {}, skip)
            if method is None and "bits" in qc:
                q = qc  # mlx-lm writes the same dict under both names
            elif method in QuantConfig.METHODS:
                return QuantConfig.METHODS[method](qc, where)
            elif method is not None:
                # another method (compressed-tensors, ...): harmless while the tensors are float
                # (as `moestream synth` writes them); a quantized tensor is refused when met
                return cls(str(method), None, {})
        if q is None:
            return None
        if not isinstance(q, dict):
            raise QuantError(f"{where}: quantization is not an object")
        if q.get("mode") in QuantConfig.MODES:  # turboquant-mlx tq* builds (moestream.quant.turboquant)
            return QuantConfig.MODES[q["mode"]](q, where)
        default = _affine_scheme(q, f"{where}: quantization")
        overrides: dict[str, Scheme | None] = {}
        for k, v in q.items():
            if isinstance(v, dict):
                overrides[k] = _affine_scheme(v, f"{where}: quantization[{k!r}]")
            elif v is False:
                overrides[k] = None
        return cls("affine", default, overrides)

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
    """Whether an expert piece ``role`` holds quantization parameters kept in their stored dtype."""
    return "." in role and role.split(".", 1)[1] in ("scales", "biases", "weight_scale_inv", "weight_scale")


__all__ = ["QuantError", "Scheme", "QuantConfig", "LinearFormat", "ExpertFormat", "expert_format", "ggml_scheme"]


# The ggml types the q8 activation mode computes on (moestream/quant/csrc/q8.h): what Q4_K_M, Q5_K_M, Q6_K,
# Q8_0, Q4_0, Q5_0 and IQ4_NL files hold for their experts and linears. A tensor of another type keeps float
# activations.
Q8_ACTIVATION_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL")


def with_activations(lf: LinearFormat | None, activations: str, fallback: list | None = None,
                     name: str = "") -> LinearFormat | None:
    """``lf`` with its input multiplied in ``activations`` mode (``"float"`` or ``"q8"``). In q8 mode a gguf
    weight of a type in :data:`Q8_ACTIVATION_TYPES` becomes ``act="q8"``; a gguf weight of another type stays
    float and ``(name, type)`` is appended to ``fallback``; anything else (float, other methods) is returned as
    it is."""
    s = None if lf is None else lf.scheme
    if activations != "q8" or s is None or s.method != "gguf":
        return lf
    if s.ggml not in Q8_ACTIVATION_TYPES:
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
