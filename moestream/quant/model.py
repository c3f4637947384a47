"""Quantized models: the experts' formats of a checkpoint, its quantized resident linears swapped in on
the meta-device model, and each quantized layer's expert function (what the engine wires in).

The formats and their math live in the modules beside this one (:mod:`.formats`, :mod:`.affine`,
:mod:`.fp8`, :mod:`.mxfp4`, :mod:`.turboquant`, :mod:`.compressed`, the compiled kernels
:mod:`.native`); this module adapts a family's model to them.
"""


from __future__ import annotations

import sys

import torch

from .. import fused_moe
from ..checkpoint import torch_dtype
from ..convert import padding_tensors  # noqa: F401  (the engine skips convert's padding tensors)
from . import turboquant
from .compressed import module_pattern
from .expert import QuantizedSwiGLU, expert_fn_for
from .formats import (
    Q8_ACTIVATION_TYPES,
    ExpertFormat,
    QuantConfig,
    QuantError,
    expert_format,
    expert_with_activations,
)
from .resident import QuantEmbedding, QuantLinear, quantize_resident
from .turboquant import TQExpertFormat, TQExperts, TQLinear
from .turboquant import describe as tq_describe
from .turboquant import quantize_resident as tq_resident

__all__ = ["Q8_ACTIVATION_TYPES", "attach", "describe", "expert_formats", "expert_functions", "float_dtype",
           "padding_tensors", "quantize_model", "summary"]


def expert_formats(ckpt, layout, shape: tuple[int, int], where, activations: str = "float",
                   fallback: list | None = None) -> dict[int, ExpertFormat]:
    """layer -> :class:`ExpertFormat` for every MoE layer whose experts are quantized.

    ``activations``: ``"q8"`` marks the gguf linears q8 mode covers (:func:`.formats.with_activations`);
    ``(tensor, type)`` of the others are appended to ``fallback``.
    Raises QuantError (naming the tensor) when pieces and config disagree.
    """
    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    for note in getattr(qcfg, "load_notes", lambda: [])():  # compressed-tensors: transforms, what is not emulated
        print(f"note: {note}", file=sys.stderr)
    out = {}
    for i, lay in layout.layers.items():
        if qcfg is not None and qcfg.method == "turboquant":
            out[i] = turboquant.expert_format(lay, ckpt.tensors, qcfg, shape, where)
            continue
        fmt = expert_format(lay, qcfg, shape, where)
        if fmt is not None:
            out[i] = expert_with_activations(fmt, activations, fallback, f"layer {i} experts' ")
    return out


def quantize_model(net, ckpt, where, activations: str = "float", fallback: list | None = None) -> list[str]:
    """Swap the resident modules ``ckpt`` stores quantized (see :func:`.resident.quantize_resident`; ``activations``
    and ``fallback`` as :func:`expert_formats`)."""
    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    swapped = []
    if qcfg is not None and qcfg.method == "turboquant":  # codebook linears first; affine extras below
        swapped = tq_resident(net, ckpt.tensors, qcfg, where)
    return swapped + quantize_resident(net, ckpt.tensors, qcfg, where, activations, fallback)


def summary(ckpt, where) -> str:
    """Bits and group size per layer kind of a turboquant build, in one line for ``moestream inspect``.

    "" for any other checkpoint: :func:`describe` gives their format and quantized modules.
    """
    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    if qcfg is None or qcfg.method != "turboquant":
        return ""
    return tq_describe(ckpt.tensors, qcfg)


def describe(ckpt, layout, net) -> tuple[str, list[str]]:
    """(format, quantized modules) of a checkpoint for ``moestream inspect``; ("", []) when it is float.

    ``net`` is the model after :func:`quantize_model` (its quantized resident linears swapped).
    Modules are listed as patterns, layer and expert numbers as ``*``.
    """
    qcfg = QuantConfig.from_config(ckpt.config, str(ckpt.path))
    formats = expert_formats(ckpt, layout, net.expert_shape(), ckpt.path) if layout.layers else {}
    names = [p.source for i in formats for p in layout.layers[i].experts[0]
             if formats[i].linears.get(p.role) is not None and formats[i].linears[p.role].scheme is not None]
    rename = getattr(net, "checkpoint_name", lambda n, t: n)  # report the checkpoint's own names
    names += [rename(f"{n}.{getattr(m, 'weight_name', 'weight')}", ckpt.tensors) for n, m in net.named_modules()
              if isinstance(m, (QuantLinear, QuantEmbedding, TQLinear))]
    if not names:
        return "", []
    if qcfg is not None and hasattr(qcfg, "tag"):
        fmt = qcfg.tag
    else:
        tags = sorted({f.tag for f in formats.values()})
        method = qcfg.method if qcfg else getattr(ckpt.source_format, "name", None) or "quantized"
        if tags and all(t.startswith(method) for t in tags):  # "affine 4-bit, group 32", not "affine (affine ...)"
            fmt = "; ".join(tags)
        else:
            fmt = method + (f" ({'; '.join(tags)})" if tags else "")
    return fmt, sorted({module_pattern(n) for n in names})


def float_dtype(ckpt, embed_name: str, dtype: torch.dtype) -> torch.dtype:
    """The compute dtype by default: a source format's own (a GGUF file's ``compute_dtype``: bf16 unless every
    tensor is F32, :class:`moestream.gguf_format.GGUFFormat`),
    else ``dtype`` (the embedding's) when it is float, else the embedding scales' dtype (mlx)."""
    own = getattr(ckpt.source_format, "compute_dtype", None)
    if own is not None:
        return own
    if dtype.is_floating_point and dtype.itemsize > 1:
        return dtype
    scales = ckpt.tensors.get(embed_name[: -len("weight")] + "scales")
    if scales is not None:
        return torch_dtype(scales.dtype)
    raise QuantError(f"{ckpt.path}: tensor {embed_name!r} is {dtype} and no scales tell the compute dtype; "
                     "pass dtype explicitly")


def attach(net, formats: dict[int, ExpertFormat], dtype: torch.dtype) -> dict:
    """The expert function of each quantized MoE layer of ``net``.

    Returns layer -> expert function (``fn(x [n, H], tensors) -> [n, H]`` on the expert's
    pieces as the store read them; no per-read preparation) for every layer in ``formats``:
    the compiled kernels' SwiGLU, turboquant's :class:`~.turboquant.TQExperts`, or the family's
    float function on dequantized weights (:mod:`.expert`). Sets the compute dtype of
    quantized embeddings.
    """
    for m in net.modules():
        if isinstance(m, QuantEmbedding):
            m.dtype = dtype
    fns = expert_functions(net, formats)  # turboquant layers
    for block in net.moe_blocks():
        fmt = formats.get(block.layer)
        if fmt is None or isinstance(fmt, TQExpertFormat):
            continue
        fns[block.layer] = expert_fn_for(block.expert, fmt)
    return fns


def expert_functions(model, formats: dict) -> dict:
    """layer -> the :class:`~.turboquant.TQExperts` function of each MoE block whose layer's format is turboquant."""
    paths = {id(m): n for n, m in model.named_modules()}
    out = {}
    for block in model.moe_blocks():
        fmt = formats.get(block.layer)
        if not isinstance(fmt, TQExpertFormat):
            continue
        base = paths[id(block)]
        holders = {}
        for role, module in fmt.shared.items():
            if not module.startswith(base + "."):
                raise QuantError(f"turboquant experts {module!r} lie outside their MoE block {base!r}")
            holders[role] = block.get_submodule(module[len(base) + 1:])
        spec = block.expert  # SwiGLU on the codebooks; any other kind its float function on dequantized weights
        out[block.layer] = TQExperts(fmt, holders, None if spec.kind == "swiglu" else spec.fn)
    return out


def gpu_unsupported(fns: dict) -> str | None:
    """Why the quantized expert layers ``fns`` (layer -> expert function, from :func:`attach`) cannot run on
    the GPU tier's fused kernel, or None when they can: SwiGLU experts (:class:`~.expert.QuantizedSwiGLU`)
    in a format it dequantizes in registers (:func:`moestream.fused_moe.gpu_format`: MLX affine 2-8 bit,
    fp8 e4m3, MXFP4)."""
    for layer, fn in sorted(fns.items()):
        if isinstance(fn, TQExperts):
            return (f"layer {layer}: turboquant codebook experts have no GPU kernel (a per-expert input rotation "
                    "and codebook lookups)")
        if not isinstance(fn, QuantizedSwiGLU):
            fmt = getattr(fn, "fmt", None)
            what = getattr(fmt, "tag", None) or type(fn).__name__
            return (f"layer {layer}'s experts ({what}) are not SwiGLU experts in a format the fused GPU kernel "
                    "reads (MLX affine 2-8 bit, fp8 e4m3, MXFP4)")
        for lf in fn.fmt.linears.values():
            why = fused_moe.gpu_format(lf.scheme)
            if why is not None:
                return f"layer {layer}: {why}"
        lin = fn.fmt.linears
        if "gate" in lin and lin["gate"].scheme != lin["up"].scheme:  # the kernel reads both one way
            return f"layer {layer}: gate and up are stored in different formats (the fused GPU kernel reads one)"
        gu = fn.fmt.linears.get("gate_up")
        if fn.fmt.fused_gate_up and gu is not None and gu.scheme is not None and gu.scheme.method == "fp8":
            return f"layer {layer}: an interleaved gate_up in fp8 blocks has no GPU kernel"
    return None
