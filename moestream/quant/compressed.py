"""compressed-tensors checkpoints (``quantization_config.quant_method: compressed-tensors``), read as published.

The format of the vLLM project's quantization tools (llm-compressor). Its definitions are
taken from the ``compressed-tensors`` library itself, not re-derived here:

* scheme parsing: ``QuantizationConfig`` / ``TransformConfig`` (pydantic models of the
  ``quantization_config`` block), and which module a config group quantizes
  (``targets`` / ``ignore``, matched by the library's ``is_match``, ``re:`` patterns included);
* tensor names: the registered compressor of each group's format says which tensors a
  quantized linear stores (``compression_param_names``);
* packing and scale layout, checked against the tensors' shapes:

  - ``float-quantized`` with ``strategy: block`` (Laguna's FP8 releases): ``weight``
    float8_e4m3fn [out, in] and ``weight_scale`` [ceil(out/bn), ceil(in/bk)] for
    ``block_structure`` [bn, bk]; ``w = float(weight) * weight_scale`` per block. The
    same math as DeepSeek's ``weight_scale_inv``, so :mod:`.fp8` computes it. ``strategy:
    channel`` (``weight_scale`` [out, 1]) and ``tensor`` ([1]) are its one-block-per-row and
    one-block forms.
  - ``mxfp4-pack-quantized`` (Kimi K3's routed experts): ``weight_packed`` uint8
    [out, in/2], two e2m1 codes per byte, the low nibble first (the library's
    ``pack_fp4_to_uint8``), and ``weight_scale`` uint8 [out, in/32], an e8m0 exponent
    ``2^(s - 127)`` per 32 values (``compress_mx_scale``). The same bytes as gpt-oss's
    ``_blocks`` / ``_scales``, so :mod:`.mxfp4` computes it.

Only weights are read quantized. A scheme's ``input_activations`` (vLLM quantizes
activations on the fly for its fp8 kernels) and ``kv_cache_scheme`` are not emulated:
activations and the KV cache stay in the compute dtype, so the output is the model with
the decompressed weights. Any other format, strategy, bit width or an asymmetric scheme is
refused with a :class:`~.formats.QuantError` naming it.

``transform_config`` (Hadamard and other rotations): the library's ``TransformLocation``
says which are online. ``weight_input`` / ``weight_output`` transforms were fused into the
weights when the checkpoint was compressed, so nothing is applied at run time; an online
transform (``input``, ``output``, ``q_attn``, ``k_cache``) would have to be applied to
activations at run time, and is refused (not implemented).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import registry
from .formats import ExpertFormat, LinearFormat, QuantConfig, QuantError, Scheme
from .fp8 import block_scales_shape
from .registry import StoredFormat

FLOAT_QUANTIZED = "float-quantized"
MXFP4_PACKED = "mxfp4-pack-quantized"
SUPPORTED = (FLOAT_QUANTIZED, MXFP4_PACKED)
MX_GROUP = 32


@dataclass(frozen=True)
class Group:
    """One ``config_groups`` entry: its name, the library's scheme, ours, and its tensor names."""

    name: str
    targets: tuple[str, ...]
    scheme: Scheme
    format: str
    weight_name: str  # ``weight`` or ``weight_packed``


def _library():
    try:
        import compressed_tensors.quantization as q  # noqa: F401
    except ImportError as e:  # pragma: no cover - a runtime dependency
        raise QuantError(f"reading a compressed-tensors checkpoint needs the compressed-tensors package ({e})") from e
    return q


class CompressedConfig(QuantConfig):
    """A compressed-tensors ``quantization_config``, looked up per module path.

    Attributes:
        groups: the supported config groups, in the config's order.
        ignore: the ``ignore`` list (module names or ``re:`` patterns) kept unquantized.
        transforms: one line per ``transform_config`` application, saying what is done with it.
        notes: what is read differently from vLLM (activation and KV cache schemes).
        format: the top-level ``format``.
    """

    def __init__(self, groups: list[Group], ignore: list[str], fmt: str, transforms: list[str], notes: list[str]):
        super().__init__("compressed-tensors", groups[0].scheme if groups else None, {})
        self.groups, self.ignore, self.format = groups, ignore, fmt
        self.transforms, self.notes = transforms, notes

    own_layer_rules = True

    def layer_format(self, lay, shape: tuple[int, int], where) -> ExpertFormat | None:
        """A MoE layer's :class:`ExpertFormat` by compressed-tensors' rules (:func:`expert_format`)."""
        return expert_format(lay, self, shape, where)

    @classmethod
    def from_quantization_config(cls, qc: dict, where: str = "config.json") -> "CompressedConfig":
        """Parse a ``quantization_config`` block with the compressed-tensors library and check we read it.

        Raises:
            QuantError: a malformed block, or a scheme, format, strategy, sparsity or
                online transform moestream does not read, naming the field and the value.
        """
        lib = _library()
        from compressed_tensors.compressors import BaseCompressor

        field = f"{where}{'' if where.endswith('config.json') else '/config.json'}: quantization_config"
        body = {k: v for k, v in qc.items() if k not in ("transform_config", "sparsity_config", "version",
                                                          "quant_method")}
        try:
            parsed = lib.QuantizationConfig.model_validate(body)
        except Exception as e:  # pydantic's ValidationError names the field
            raise QuantError(f"{field} is not a valid compressed-tensors config: {e}") from None
        # quantization_status is not checked: the tensors say what is stored (float tensors load as float,
        # as `moestream synth` writes them under a published config)
        if qc.get("sparsity_config"):
            raise QuantError(f"{field}.sparsity_config: sparse compressed-tensors checkpoints are not supported")
        groups = []
        for name, g in parsed.config_groups.items():
            gfield = f"{field}.config_groups.{name}"
            fmt = str(getattr(g.format, "value", g.format) or parsed.format)
            if fmt not in SUPPORTED:
                raise QuantError(f"{gfield}: compressed-tensors format {fmt!r} is not supported; moestream reads "
                                 f"{' and '.join(map(repr, SUPPORTED))}")
            w = g.weights
            if w is None:
                raise QuantError(f"{gfield}: no weights scheme; moestream reads weight-quantized checkpoints")
            scheme = _scheme(fmt, w, gfield)
            names = BaseCompressor.get_value_from_registry(fmt).compression_param_names(g)
            extra = [n for n in names if n not in ("weight", "weight_packed", "weight_scale")]
            if extra:
                raise QuantError(f"{gfield}: format {fmt!r} here stores {extra}; moestream reads weight and "
                                 "weight_scale only (symmetric weights, dynamic or no activation scales)")
            groups.append(Group(name, tuple(g.targets), Scheme(scheme.method, scheme.bits, scheme.group_size,
                                                                 scheme.block, names[1]), fmt, names[0]))
        notes = []
        acts = {str(g.input_activations.type) + f" {g.input_activations.num_bits}-bit"
                for g in parsed.config_groups.values() if g.input_activations is not None}
        if acts:
            notes.append(f"input activations declared {', '.join(sorted(acts))} are computed in the compute dtype "
                         "(weights are dequantized exactly; activations are not quantized)")
        if parsed.kv_cache_scheme is not None:
            notes.append("kv_cache_scheme ignored: the KV cache stays in the compute dtype")
        return cls(groups, list(parsed.ignore or []), str(getattr(parsed.format, "value", parsed.format)),
                   _transforms(qc.get("transform_config"), field), notes)

    def group_for(self, module: str, linear: bool = True) -> Group | None:
        """The config group quantizing module ``module`` (a Linear when ``linear``), or None.

        Matching is the library's (``compressed_tensors.utils.match``): a target or ignore
        entry matches a module's name (exactly, or as ``re:`` regex) or its class (``Linear``).
        """
        from compressed_tensors.utils.match import match_name

        def hit(entry: str) -> bool:
            return match_name(module, entry) or (linear and entry == "Linear")

        if any(hit(e) for e in self.ignore):
            return None
        return next((g for g in self.groups if any(hit(t) for t in g.targets)), None)

    def scheme(self, module: str, *aliases: str) -> Scheme | None:
        g = self.group_for(module)
        return None if g is None else g.scheme

    @property
    def tag(self) -> str:
        """``compressed-tensors <format>: <scheme>`` for messages and ``moestream inspect``."""
        schemes = "; ".join(sorted({g.scheme.tag for g in self.groups}))
        return f"compressed-tensors {self.format} ({schemes})"

    def load_notes(self) -> list[str]:
        """What a load says about this checkpoint: transforms (folded or not) and what is not emulated."""
        return [f"{self.tag}: ignore list kept unquantized: {self.ignore}", *self.transforms, *self.notes]


def _scheme(fmt: str, w, field: str) -> Scheme:
    """Our :class:`Scheme` of a library ``QuantizationArgs`` ``w`` under format ``fmt``; refuses what we do not read."""
    kind = str(getattr(w.type, "value", w.type))
    strategy = str(getattr(w.strategy, "value", w.strategy))
    desc = f"{kind} {w.num_bits}-bit, strategy {strategy!r}"
    if not w.symmetric:
        raise QuantError(f"{field}.weights: asymmetric {desc} is not supported (symmetric only)")
    if w.dynamic:
        raise QuantError(f"{field}.weights: dynamic weight quantization ({desc}) is not supported")
    if fmt == FLOAT_QUANTIZED:
        blk = w.block_structure
        if kind == "float" and w.num_bits == 8 and strategy in ("channel", "tensor"):
            # one scale per output row / one for the weight: fp8 blocks of (1, in) / (out, in)
            return Scheme("fp8", 8, 0, (1, 0) if strategy == "channel" else (0, 0))
        if kind != "float" or w.num_bits != 8 or strategy != "block" or not blk or len(blk) != 2:
            raise QuantError(f"{field}.weights: {fmt} scheme {desc} is not supported; moestream reads "
                             "float 8-bit with strategy 'block' (and a block_structure [rows, cols]), "
                             "'channel' or 'tensor'")
        return Scheme("fp8", 8, int(blk[1]), (int(blk[0]), int(blk[1])))
    scale_dtype = str(w.scale_dtype) if w.scale_dtype is not None else "torch.uint8"
    if kind != "float" or w.num_bits != 4 or strategy != "group" or w.group_size != MX_GROUP \
            or scale_dtype != "torch.uint8":
        raise QuantError(f"{field}.weights: {fmt} scheme {desc}, group_size {w.group_size}, scale_dtype "
                         f"{scale_dtype} is not supported; moestream reads float 4-bit groups of 32 with uint8 scales")
    return Scheme("mxfp4", 4, MX_GROUP)


def _transforms(tc, field: str) -> list[str]:
    """One line per transform application of ``transform_config``: folded (nothing to do) or refused (online)."""
    if not tc:
        return []
    from compressed_tensors.transform import TransformConfig

    try:
        parsed = TransformConfig.model_validate(tc)
    except Exception as e:
        raise QuantError(f"{field}.transform_config is not a valid compressed-tensors transform config: {e}") from None
    lines = []
    for name, s in parsed.config_groups.items():
        kind = f"{s.type}" + (f" (blocks of {s.head_dim})" if s.head_dim else "")
        for a in s.apply:
            loc = str(getattr(a.location, "value", a.location))
            what = (f"transform {name} ({kind}, {loc}{', inverse' if a.inverse else ''}) on "
                    f"{', '.join(a.targets)}")
            if a.is_online():
                raise QuantError(f"{field}.transform_config.config_groups.{name}: {what} is an online transform "
                                 "(applied to activations at run time); moestream does not apply online "
                                 "transforms yet")
            lines.append(f"{what}: folded into the weights when compressed, nothing to apply at run time")
    return lines


def _check(name: str, g: Group, w, scale, out_in: tuple[int, int] | None, where) -> tuple[int, int]:
    """Check one quantized weight ``name`` (TensorInfo ``w``, ``scale``) against group ``g``; return [out, in]."""
    s = g.scheme
    sname = name.rsplit(".", 1)[0] + "." + s.scale_param
    if scale is None:
        raise QuantError(f"{where}: tensor {name!r} is quantized ({g.format}) but {sname} is missing")
    if len(w.shape) != 2:
        raise QuantError(f"{where}: tensor {name!r} has shape {list(w.shape)}; expected a 2-D weight")
    if g.format == FLOAT_QUANTIZED:
        if w.dtype != "F8_E4M3":
            raise QuantError(f"{where}: tensor {name!r} is {w.dtype}; {g.format} ({g.name}) stores float8_e4m3fn")
        out, inn = w.shape
        want = block_scales_shape((out, inn), s.block)
        per_tensor = s.block == (0, 0) and tuple(scale.shape) in ((), (1,))
        if tuple(scale.shape) != want and not per_tensor:
            raise QuantError(f"{where}: tensor {sname} has shape {list(scale.shape)}; a {[out, inn]} weight "
                             f"({s.tag}) needs {list(want)}")
        if not scale.dtype.startswith(("F", "BF")):
            raise QuantError(f"{where}: tensor {sname} is {scale.dtype}; block scales are floats")
    else:
        if w.dtype != "U8" or scale.dtype != "U8":
            raise QuantError(f"{where}: tensors {name!r} ({w.dtype}) and {sname} ({scale.dtype}) must be uint8 "
                             f"for {g.format}")
        out, inn = w.shape[0], w.shape[1] * 2
        if inn % MX_GROUP or tuple(scale.shape) != (out, inn // MX_GROUP):
            raise QuantError(f"{where}: tensor {name!r} {list(w.shape)} packs [{out}, {inn}] with scales "
                             f"{list(scale.shape)}; groups of {MX_GROUP} need [{out}, {inn // MX_GROUP}]")
    if out_in is not None and (out, inn) != tuple(out_in):
        raise QuantError(f"{where}: tensor {name!r} is [{out}, {inn}] once unpacked; the model config implies "
                         f"{list(out_in)}")
    return out, inn


def _quantized_weight(tensors: dict, path: str):
    """(name, TensorInfo) of module ``path``'s stored weight when it is quantized, else None."""
    packed = tensors.get(path + ".weight_packed")
    if packed is not None:
        return path + ".weight_packed", packed
    w = tensors.get(path + ".weight")
    if w is not None and (w.dtype == "F8_E4M3" or path + ".weight_scale" in tensors):
        return path + ".weight", w
    return None


def _group_of(qcfg: CompressedConfig, path: str, name: str, where) -> Group:
    g = qcfg.group_for(path)
    if g is None:
        raise QuantError(f"{where}: tensor {name!r} is stored quantized but quantization_config leaves module "
                         f"{path!r} unquantized (its ignore list or targets)")
    if not name.endswith("." + g.weight_name):
        raise QuantError(f"{where}: tensor {name!r}: {g.format} ({g.name}) stores the weight as "
                         f"{path}.{g.weight_name}")
    return g


def linear_format(path: str, tensors: dict, qcfg: CompressedConfig, shape: tuple[int, int], where):
    """(LinearFormat, {param: (shape, dtype)}) of resident module ``path`` if it is stored quantized, else None.

    ``shape`` is the module's [out, in] from the model. Raises QuantError naming the tensor.
    """
    got = _quantized_weight(tensors, path)
    if got is None:
        return None
    name, w = got
    g = _group_of(qcfg, path, name, where)
    scale = tensors.get(f"{path}.{g.scheme.scale_param}")
    _check(name, g, w, scale, shape, where)
    shapes = {g.weight_name: (w.shape, w.dtype), g.scheme.scale_param: (scale.shape, scale.dtype)}
    return LinearFormat("weight", g.scheme, shape[0], shape[1]), shapes


def expert_format(lay, qcfg: CompressedConfig, shape: tuple[int, int], where) -> ExpertFormat | None:
    """The :class:`ExpertFormat` of one MoE layer's experts in a compressed-tensors checkpoint (None: float).

    Args:
        lay: a :class:`~moestream.layout.MoELayerLayout` (per-expert tensors, as published).
        shape: (intermediate, hidden) of one expert from the model config.

    Raises:
        QuantError: naming the tensor that disagrees with the config or the model shape.
    """
    pieces = {p.role: p for p in lay.experts[0]}
    inter, hidden = shape
    logical = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    quantized = [r for r in ("gate", "up", "down") if r in pieces and (
        pieces[r].dtype in ("F8_E4M3", "U8") or r + ".weight_scale" in pieces)]
    if not quantized:
        return None
    if lay.kind != "per-expert" or "gate_up" in pieces:
        raise QuantError(f"{where}: {lay.block}: compressed-tensors experts are read per expert "
                         f"(...experts.E.<proj>.weight[_packed]); found a {lay.kind} layout")
    linears = {}
    for role in ("gate", "up", "down"):
        p = pieces[role]
        path = p.source.rsplit(".", 1)[0]
        if role not in quantized:
            if (p.shape[0], p.shape[1]) != logical[role]:
                raise QuantError(f"{where}: tensor {p.source!r} is {list(p.shape)}; the model config implies "
                                 f"{list(logical[role])}")
            linears[role] = LinearFormat(role, None, *logical[role])
            continue
        g = _group_of(qcfg, path, p.source, where)
        sc = pieces.get(f"{role}.{g.scheme.scale_param}")
        _check(p.source, g, p, sc, logical[role], where)
        linears[role] = LinearFormat(role, g.scheme, *logical[role])
    return ExpertFormat(linears)


def module_pattern(name: str) -> str:
    """A tensor's module path with layer and expert numbers as ``*`` (to list quantized modules briefly)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name.rsplit(".", 1)[0])


registry.register(StoredFormat(
    name="compressed-tensors", method="compressed-tensors",
    summary="compressed-tensors checkpoints: fp8 (float-quantized) and MXFP4 (mxfp4-pack-quantized) groups",
    selected_by="quantization_config.quant_method compressed-tensors (config groups, targets, ignore)",
    weight=("F8_E4M3", "U8"), params=(("weight_scale", ("BF16", "F16", "F32", "U8")),), scale="weight_scale",
    parse=CompressedConfig.from_quantization_config, check=_check,
    dequantize=lambda t, lf, r0, r1: registry.of(lf.scheme).dequantize(t, lf, r0, r1),
    no_cpu="its linears are fp8 or mxfp4 schemes (scale weight_scale): those formats' kernels compute them",
    no_gpu="its linears are fp8 or mxfp4 schemes: those formats' GPU projections read them",
    quant_method="compressed-tensors"))
