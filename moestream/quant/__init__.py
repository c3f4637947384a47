"""Quantized experts and resident weights: published formats read as they are, kernels, ``moestream convert``.

Formats (:mod:`.formats`): MLX affine (:mod:`.affine`, 2-8 bits), FP8 e4m3 with block
scales (:mod:`.fp8`), MXFP4 (:mod:`.mxfp4`). Expert pieces stay packed on disk and in the
cache; :mod:`.kernels` multiplies on them; :mod:`.expert` picks the expert function by
the pieces' format; :mod:`.resident` keeps quantized attention, routers and embeddings
quantized; :mod:`.convert` writes moestream's own quantized checkpoints.
"""

from __future__ import annotations

import sys

import torch

from ..checkpoint import torch_dtype
from .convert import padding_tensors
from .formats import ExpertFormat, LinearFormat, QuantConfig, QuantError, Scheme, expert_format

__all__ = ["ExpertFormat", "LinearFormat", "QuantConfig", "QuantError", "Scheme", "expert_format",
           "describe", "expert_formats", "float_dtype", "padding_tensors", "quantize_model"]


def expert_formats(ckpt, layout, shape: tuple[int, int], where) -> dict[int, ExpertFormat]:
    """layer -> :class:`ExpertFormat` for every MoE layer whose experts are quantized.

    Raises QuantError (naming the tensor) when pieces and config disagree.
    """
    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    for note in getattr(qcfg, "load_notes", lambda: [])():  # compressed-tensors: transforms, what is not emulated
        print(f"note: {note}", file=sys.stderr)
    out = {}
    for i, lay in layout.layers.items():
        if qcfg is not None and qcfg.method == "turboquant":
            from . import turboquant

            out[i] = turboquant.expert_format(lay, ckpt.tensors, qcfg, shape, where)
            continue
        fmt = expert_format(lay, qcfg, shape, where)
        if fmt is not None:
            out[i] = fmt
    return out


def quantize_model(net, ckpt, where) -> list[str]:
    """Swap the resident modules ``ckpt`` stores quantized (see :func:`.resident.quantize_resident`)."""
    from .resident import quantize_resident

    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    swapped = []
    if qcfg is not None and qcfg.method == "turboquant":  # codebook linears first; affine extras below
        from .turboquant import quantize_resident as tq_resident

        swapped = tq_resident(net, ckpt.tensors, qcfg, where)
    return swapped + quantize_resident(net, ckpt.tensors, qcfg, where)


def summary(ckpt, where) -> str:
    """Bits and group size per layer kind of a turboquant build, in one line for ``moestream inspect``.

    "" for any other checkpoint: :func:`describe` gives their format and quantized modules.
    """
    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    if qcfg is None or qcfg.method != "turboquant":
        return ""
    from .turboquant import describe as tq_describe

    return tq_describe(ckpt.tensors, qcfg)


def describe(ckpt, layout, net) -> tuple[str, list[str]]:
    """(format, quantized modules) of a checkpoint for ``moestream inspect``; ("", []) when it is float.

    ``net`` is the model after :func:`quantize_model` (its quantized resident linears swapped).
    Modules are listed as patterns, layer and expert numbers as ``*``.
    """
    from .compressed import module_pattern
    from .resident import QuantEmbedding, QuantLinear
    from .turboquant import TQLinear

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
        method = qcfg.method if qcfg else "quantized"
        if tags and all(t.startswith(method) for t in tags):  # "affine 4-bit, group 32", not "affine (affine ...)"
            fmt = "; ".join(tags)
        else:
            fmt = method + (f" ({'; '.join(tags)})" if tags else "")
    return fmt, sorted({module_pattern(n) for n in names})


def float_dtype(ckpt, embed_name: str, dtype: torch.dtype) -> torch.dtype:
    """The compute dtype when the embedding is quantized: its scales' dtype (mlx), else ``dtype``."""
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
    from .expert import expert_fn_for
    from .resident import QuantEmbedding

    for m in net.modules():
        if isinstance(m, QuantEmbedding):
            m.dtype = dtype
    from .turboquant import TQExpertFormat, expert_functions

    fns = expert_functions(net, formats)  # turboquant layers
    for block in net.moe_blocks():
        fmt = formats.get(block.layer)
        if fmt is None or isinstance(fmt, TQExpertFormat):
            continue
        fns[block.layer] = expert_fn_for(block.expert_fn, fmt)
    return fns
