"""Quantized experts and resident weights: published formats read as they are, kernels, ``moestream convert``.

Formats (:mod:`.formats`): MLX affine (:mod:`.affine`, 2-8 bits), FP8 e4m3 with block
scales (:mod:`.fp8`), MXFP4 (:mod:`.mxfp4`). Expert pieces stay packed on disk and in the
cache; :mod:`.kernels` multiplies on them; :mod:`.expert` picks the expert function by
the pieces' format; :mod:`.resident` keeps quantized attention, routers and embeddings
quantized; :mod:`.convert` writes moestream's own quantized checkpoints.
"""

from __future__ import annotations

import torch

from ..checkpoint import torch_dtype
from .convert import padding_tensors
from .formats import ExpertFormat, LinearFormat, QuantConfig, QuantError, Scheme, expert_format

__all__ = ["ExpertFormat", "LinearFormat", "QuantConfig", "QuantError", "Scheme", "expert_format",
           "expert_formats", "float_dtype", "padding_tensors", "quantize_model"]


def expert_formats(ckpt, layout, shape: tuple[int, int], where) -> dict[int, ExpertFormat]:
    """layer -> :class:`ExpertFormat` for every MoE layer whose experts are quantized.

    Raises QuantError (naming the tensor) when pieces and config disagree.
    """
    qcfg = QuantConfig.from_config(ckpt.config, str(where))
    out = {}
    for i, lay in layout.layers.items():
        fmt = expert_format(lay, qcfg, shape, where)
        if fmt is not None:
            out[i] = fmt
    return out


def quantize_model(net, ckpt, where) -> list[str]:
    """Swap the resident modules ``ckpt`` stores quantized (see :func:`.resident.quantize_resident`)."""
    from .resident import quantize_resident

    return quantize_resident(net, ckpt.tensors, QuantConfig.from_config(ckpt.config, str(where)), where)


def float_dtype(ckpt, embed_name: str, dtype: torch.dtype) -> torch.dtype:
    """The compute dtype when the embedding is quantized: its scales' dtype (mlx), else ``dtype``."""
    if dtype.is_floating_point and dtype.itemsize > 1:
        return dtype
    scales = ckpt.tensors.get(embed_name[: -len("weight")] + "scales")
    if scales is not None:
        return torch_dtype(scales.dtype)
    raise QuantError(f"{ckpt.path}: tensor {embed_name!r} is {dtype} and no scales tell the compute dtype; "
                     "pass dtype explicitly")


def attach(net, store, formats: dict[int, ExpertFormat], dtype: torch.dtype) -> None:
    """Give each MoE block of ``net`` the expert function of its layer's format, and ``store`` its prepare hook."""
    from .expert import DequantizedExpert, expert_fn_for
    from .resident import QuantEmbedding

    for m in net.modules():
        if isinstance(m, QuantEmbedding):
            m.dtype = dtype
    swiglu = {}  # layers whose experts run on the quantized kernels (the others dequantize, see .expert)
    for block in net.moe_blocks():
        block.expert_fn = expert_fn_for(block.expert_fn, formats.get(block.layer))
        if block.layer in formats and not isinstance(block.expert_fn, DequantizedExpert):
            swiglu[block.layer] = formats[block.layer]
    if swiglu:
        from .kernels import Prepare

        prep = Prepare(store.layout, swiglu, dtype)
        if prep.active:
            store.prepare = prep
