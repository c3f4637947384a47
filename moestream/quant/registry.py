"""The stored-format registry: one :class:`StoredFormat` per quantized format moestream reads as stored.

An entry declares everything the rest of the code asks a format: how a checkpoint selects it (its config
parse), its pieces (the weight's stored dtypes, the extra roles beside it and theirs), its tensor checks,
its PyTorch reference dequantizer, its compiled CPU kernel (:class:`CpuKernel`: the kernels' kind and, for
a ggml type, its type code, decoded sub-block and q8 activation block), its GPU projection (the bits the
fused GPU kernel dequantizes in registers) or the reason it has none, and :meth:`StoredFormat.describe`.

Entries are declared by the module that owns the format and registered when it is imported (the package
imports them all): :mod:`.formats` (MLX affine, fp8, MXFP4 and the ggml types of GGUF files, one
:class:`GgmlFormat` each), :mod:`.compressed` (compressed-tensors) and :mod:`.turboquant`. This module
imports none of them; everything else looks a format up here: :func:`of` by a linear's
:class:`~moestream.quant.formats.Scheme`, :func:`get` by name, :func:`by_quant_method` / :func:`by_mode` by
a config's ``quantization_config.quant_method`` / mlx ``quantization.mode``.

The compiled kernels hold the ggml types' own table (``csrc/traits.h``, ggml's ``type_traits_cpu`` as the
model); :mod:`.native` checks it against :func:`ggml_formats` when it loads the library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# the compiled kernels' weight kinds (csrc/kernels.h Kind)
KINDS = {"affine": 0, "fp8": 1, "mxfp4": 2, "codebook": 3, "ggml": 4, "float": 5, "float_t": 6}


@dataclass(frozen=True)
class CpuKernel:
    """How the compiled CPU kernels (:mod:`.native`, ``csrc/``) read a format.

    ``kind``: a key of :data:`KINDS`. ggml types: ``type_code`` (``csrc/kernels.h`` GgmlType, a row of
    ``csrc/traits.h``), ``group`` (weights per decoded sub-block) and ``q8`` (the activation block of the q8
    mode's integer dot, ``"Q8_K"`` or ``"Q8_0"``; None: float activations only).
    """

    kind: str
    type_code: int | None = None
    group: int | None = None
    q8: str | None = None

    @property
    def kind_code(self) -> int:
        return KINDS[self.kind]

    def describe(self) -> str:
        if self.type_code is None:
            return f"compiled kind {self.kind}"
        q8 = f", q8 activations against {self.q8}" if self.q8 else ""
        return f"compiled ggml type {self.type_code} (sub-blocks of {self.group}{q8})"


@dataclass(frozen=True, kw_only=True)
class StoredFormat:
    """One stored quantized format.

    Attributes:
        name: the registry key (``"affine"``, ``"fp8"``, ``"mxfp4"``, ``"compressed-tensors"``, ``"turboquant"``,
            a ggml type such as ``"Q4_K"``).
        method: the ``Scheme.method`` of its linears (compressed-tensors: its config's; its linears are fp8
            or mxfp4).
        summary: one line on what it is.
        selected_by: how a checkpoint selects it.
        weight: the weight piece's stored dtypes (safetensors names; ``GGML_<type>`` for a ggml type).
        params: (role suffix, stored dtypes) of each piece beside the weight (``gate.scales``, ...): the
            quantization parameters, kept in their stored dtype by the store and ``load_resident``.
        scale: the scale piece's suffix (None: none).
        parse: ``parse(block, where) -> QuantConfig`` of the config block that selects it (None: no config).
        check: its tensor check (:mod:`.formats`' ``check_*``; QuantError naming the tensor).
        dequantize: ``dequantize(pieces, lf, r0, r1) -> float32 rows r0:r1`` of a linear ``lf``: the PyTorch
            reference every kernel is tested against.
        tag: ``tag(scheme) -> str``, a linear's format in words.
        cpu: its :class:`CpuKernel`, or None (then ``no_cpu`` says why).
        gpu_bits: the bits the fused GPU kernel dequantizes in registers (empty: none; ``no_gpu`` says why).
        quant_method, mode: the ``quantization_config.quant_method`` / mlx ``quantization.mode`` selecting it.
    """

    name: str
    method: str
    summary: str
    selected_by: str
    weight: tuple[str, ...]
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    scale: str | None = None
    parse: Callable | None = None
    check: Callable | None = None
    dequantize: Callable | None = None
    tag: Callable | None = None
    cpu: CpuKernel | None = None
    no_cpu: str | None = None
    gpu_bits: tuple[int, ...] = ()
    no_gpu: str | None = None
    quant_method: str | None = None
    mode: str | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        """The role suffixes of the pieces beside the weight (``scales``, ``biases``, ...)."""
        return tuple(r for r, _ in self.params)

    def gpu_reason(self, bits: int) -> str | None:
        """Why the fused GPU kernel cannot read this format at ``bits``, or None when it can."""
        if bits in self.gpu_bits:
            return None
        return self.no_gpu or f"{self.name} at {bits} bits has no GPU kernel"

    def describe(self) -> str:
        """The entry in words, a line a field (``moestream inspect``, docs, tests)."""
        params = ", ".join(f"{r} ({'/'.join(d)})" for r, d in self.params) or "none"
        gpu = f"fused kernel, {', '.join(map(str, self.gpu_bits))} bits" if self.gpu_bits else f"none: {self.no_gpu}"
        cpu = self.cpu.describe() if self.cpu is not None else f"none: {self.no_cpu}"
        return "\n".join((
            f"{self.name}: {self.summary}",
            f"  selected by: {self.selected_by}",
            f"  pieces: weight ({'/'.join(self.weight)}); beside it: {params}",
            f"  reference: {'yes' if self.dequantize else 'none'}; tensor check: {'yes' if self.check else 'none'}",
            f"  CPU kernel: {cpu}",
            f"  GPU: {gpu}",
        ))


@dataclass(frozen=True, kw_only=True)
class GgmlFormat(StoredFormat):
    """A ggml block type of GGUF files: ``block`` weights in ``type_size`` bytes, ``bits`` nominal bits per
    weight; its CPU kernel's type code, sub-block and q8 block as ``csrc/traits.h`` has them."""

    block: int
    type_size: int
    bits: int


FORMATS: dict[str, StoredFormat] = {}


def register(fmt: StoredFormat) -> StoredFormat:
    """Add ``fmt`` (its module does, when imported); a second entry of a name replaces the first."""
    FORMATS[fmt.name] = fmt
    return fmt


def get(name: str) -> StoredFormat:
    """The entry named ``name``. Raises KeyError naming the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"no stored format {name!r} (known: {', '.join(FORMATS)})") from None


def of(scheme) -> StoredFormat:
    """The entry of a linear's :class:`~moestream.quant.formats.Scheme` (a ggml weight: its type's)."""
    return get(scheme.ggml or scheme.method)


def by_quant_method(method) -> StoredFormat | None:
    """The entry a ``quantization_config.quant_method`` selects, or None."""
    return next((f for f in FORMATS.values() if f.quant_method is not None and f.quant_method == method), None)


def by_mode(mode) -> StoredFormat | None:
    """The entry an mlx ``quantization.mode`` selects, or None."""
    return next((f for f in FORMATS.values() if f.mode is not None and f.mode == mode), None)


def ggml_formats() -> dict[str, GgmlFormat]:
    """The ggml types, by name, in type-code order."""
    got = [f for f in FORMATS.values() if isinstance(f, GgmlFormat)]
    return {f.name: f for f in sorted(got, key=lambda f: f.cpu.type_code)}


def quant_params() -> tuple[str, ...]:
    """Every piece role suffix that holds quantization parameters (``scales``, ``biases``, ...), once each in
    the order the entries declare them: the one list the layout, the store and ``load_resident`` read."""
    return tuple(dict.fromkeys(r for f in FORMATS.values() for r in f.roles))


def describe_all() -> str:
    return "\n".join(f.describe() for f in FORMATS.values())


__all__ = ["CpuKernel", "FORMATS", "GgmlFormat", "KINDS", "StoredFormat", "by_mode", "by_quant_method",
           "describe_all", "get", "ggml_formats", "of", "quant_params", "register"]
