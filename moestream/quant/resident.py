"""Quantized resident weights: linears (attention, routers, dense MLPs, LM head) and
embeddings that a checkpoint stores quantized stay quantized in memory.

:func:`quantize_resident` swaps each such ``nn.Linear`` / ``nn.Embedding`` of a model (on
the meta device, before loading) for a :class:`QuantLinear` / :class:`QuantEmbedding`
whose parameters carry the checkpoint's own names and dtypes (``weight``, ``scales``,
``biases``; or ``weight``, ``weight_scale_inv``), so ``load_resident`` fills them by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import torch_dtype
from . import affine, ggml, native
from .compressed import linear_format
from .formats import (
    LinearFormat,
    QuantConfig,
    QuantError,
    check_affine,
    check_fp8,
    check_ggml,
    ggml_scheme,
    with_activations,
)
from .kernels import dequantize_linear, qlinear


def _param(shape, st_dtype: str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch_dtype(st_dtype)), requires_grad=False)


class QuantLinear(nn.Module):
    """A linear whose weight [out, in] is stored quantized: ``x`` [..., in] -> [..., out] in x.dtype.

    Parameters are the checkpoint's tensors (packed ``weight`` with ``scales`` and
    ``biases``, or fp8 ``weight`` with ``weight_scale_inv``) plus an optional float ``bias``;
    the product runs through :func:`moestream.quant.kernels.qlinear` on them as stored.
    """

    def __init__(self, fmt: LinearFormat, shapes: dict[str, tuple[tuple[int, ...], str]], bias: bool):
        super().__init__()
        self.fmt = LinearFormat("weight", fmt.scheme, fmt.out_features, fmt.in_features)
        for name, (shape, dt) in shapes.items():
            setattr(self, name, _param(shape, dt))
        # compressed-tensors stores packed 4-bit weights as ``weight_packed``
        self.weight_name = "weight_packed" if "weight_packed" in shapes else "weight"
        self.extra = tuple(n for n in shapes if n != self.weight_name)
        self.bias = nn.Parameter(torch.empty(fmt.out_features), requires_grad=False) if bias else None

    def _pieces(self) -> dict[str, torch.Tensor]:
        return {"weight": getattr(self, self.weight_name), **{f"weight.{n}": getattr(self, n) for n in self.extra}}

    def kernel_spec(self):
        """The compiled kernels' view of the stored pieces (made once: they do not move), or None."""
        if getattr(self, self.weight_name).device.type != "cpu":
            return None
        return native.spec_of(getattr(self, self.weight_name), lambda _: native.linear_spec(self.fmt, self._pieces()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = None
        if x.device.type == "cpu":
            spec = self.kernel_spec()
            if spec is not None:
                y = native.linear(x2, self._pieces(), self.fmt, spec=spec)
        if y is None:
            y = qlinear(x2, self._pieces(), self.fmt)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] in ``dtype``, for a family that uses a linear's weight as a vector."""
        return dequantize_linear(self._pieces(), self.fmt, dtype)


class QuantEmbedding(nn.Module):
    """A quantized embedding: ids [T] -> [T, H], rows dequantized on lookup: mlx affine (in the scales'
    dtype) or ggml blocks (float32), then cast to the compute dtype."""

    def __init__(self, fmt: LinearFormat, shapes: dict[str, tuple[tuple[int, ...], str]]):
        super().__init__()
        self.fmt = fmt
        self.dtype: torch.dtype | None = None  # the compute dtype (set by moestream.quant.attach)
        for name, (shape, dt) in shapes.items():
            setattr(self, name, _param(shape, dt))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = self.fmt.scheme
        if s.method == "gguf":
            w = ggml.dequantize(self.weight[ids], s.ggml, self.fmt.in_features)
        else:
            w = affine.dequantize(self.weight[ids], self.scales[ids], self.biases[ids], s.bits, s.group_size)
        return w if self.dtype is None else w.to(self.dtype)


def _format(path: str, tensors: dict, qcfg: QuantConfig | None, shape: tuple[int, int], where) -> tuple | None:
    """(LinearFormat, {param: (shape, dtype)}) for module ``path`` if the checkpoint stores it quantized."""
    if qcfg is not None and qcfg.method == "compressed-tensors":
        return linear_format(path, tensors, qcfg, shape, where)
    w = tensors.get(path + ".weight")
    if w is None:
        return None
    name = f"{path}.weight"
    if ggml.block_type(w.dtype):  # a GGUF file's block bytes [out, row bytes]
        try:
            scheme = ggml_scheme(w.dtype)
        except QuantError as e:
            raise QuantError(f"{where}: tensor {name!r}: {e}") from None
        got = check_ggml(name, scheme, w.shape, where)
        if got != shape:
            raise QuantError(f"{where}: tensor {name!r} is {list(got)} once unpacked; the model config implies "
                             f"{list(shape)}")
    elif w.dtype == "U32" or path + ".scales" in tensors:
        # affine, or a turboquant build's affine extras
        scheme = qcfg.scheme(path) if qcfg is not None and qcfg.method in ("affine", "turboquant") else None
        if scheme is None:
            raise QuantError(f"{where}: tensor {name!r} is quantized but config.json declares no mlx affine "
                             "quantization for it")
        sc, bi = tensors.get(path + ".scales"), tensors.get(path + ".biases")
        check_affine(name, scheme, w.shape, sc and sc.shape, bi and bi.shape, shape[1], where)
    elif w.dtype == "F8_E4M3":
        if qcfg is None or qcfg.method != "fp8":
            raise QuantError(f"{where}: tensor {name!r} is fp8 but config.json declares no fp8 quantization_config")
        scheme = qcfg.default
        si = tensors.get(path + ".weight_scale_inv")
        check_fp8(name, scheme, w.shape, si and si.shape, where)
    else:
        return None
    shapes = {"weight": (w.shape, w.dtype)}
    for suffix in scheme.format.roles:  # the pieces its stored format keeps beside the weight
        info = tensors[f"{path}.{suffix}"]
        shapes[suffix] = (info.shape, info.dtype)
    return LinearFormat("weight", scheme, shape[0], shape[1]), shapes


def quantize_resident(model: nn.Module, tensors: dict, qcfg: QuantConfig | None, where, activations: str = "float",
                      fallback: list | None = None) -> list[str]:
    """Swap the model's linears and embeddings that ``tensors`` (a checkpoint index) stores quantized.

    Run on the meta-device model before loading. Returns the module paths swapped. ``activations``: the
    linears' input mode (``"q8"``: :func:`.formats.with_activations`, the tensors it does not cover appended to
    ``fallback`` as (name, type)); embeddings are looked up, never multiplied, so they have none.

    Raises:
        QuantError: a quantized tensor the config does not declare, metadata that disagrees
            with the tensors (naming the tensor), a quantized embedding tied to the LM head, or a
            quantized linear holding more than a weight and bias (a router's correction bias).
    """
    swapped = []
    rename = getattr(model, "checkpoint_name", None)  # a family whose checkpoints name a module another way

    def stored(path: str) -> str:
        if rename is None:
            return path
        for param in ("weight", "weight_packed"):
            got = rename(f"{path}.{param}", tensors)
            if got in tensors:
                return got.rsplit(".", 1)[0]
        return path

    for path, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear):
            got = _format(stored(path), tensors, qcfg, (mod.out_features, mod.in_features), where)
            extra = sorted(set(mod._parameters) - {"weight", "bias"})
            if got is not None and extra:
                # e.g. a float32 sigmoid router with its e_score_correction_bias (DeepSeek-V3, GLM-4.5, Kimi)
                raise QuantError(f"{where}: tensor {stored(path)}.weight is quantized, but this linear also holds "
                                 f"{', '.join(extra)} and is read in float only (mlx-lm keeps such routers float)")
            if got is not None:
                lf = with_activations(got[0], activations, fallback, f"{stored(path)}.weight")
                model.set_submodule(path, QuantLinear(lf, got[1], bias=mod.bias is not None))
                swapped.append(path)
        elif isinstance(mod, nn.Embedding):
            got = _format(path, tensors, qcfg, (mod.num_embeddings, mod.embedding_dim), where)
            if got is not None:
                if got[0].scheme.method not in ("affine", "gguf"):
                    raise QuantError(f"{where}: tensor {path}.weight: only affine-quantized and ggml embeddings "
                                     "are supported")
                if getattr(model, "tie_word_embeddings", False):
                    raise QuantError(f"{where}: tensor {path}.weight is quantized and tied to the LM head; "
                                     "tied quantized embeddings are not supported yet")
                model.set_submodule(path, QuantEmbedding(*got))
                swapped.append(path)
    return swapped


def dense_extra_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes that :func:`dequantize_resident` adds: each quantized linear or embedding's float weight
    [out, in] in ``dtype`` less its stored parameters (shapes only: works on the meta device)."""
    extra = 0
    for m in model.modules():
        if isinstance(m, QuantLinear | QuantEmbedding):
            stored = sum(p.numel() * p.element_size() for n, p in m.named_parameters(recurse=False) if n != "bias")
            extra += m.fmt.out_features * m.fmt.in_features * dtype.itemsize - stored
    return extra


def dequantize_resident(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every loaded :class:`QuantLinear` / :class:`QuantEmbedding` of ``model`` for a float
    ``nn.Linear`` / ``nn.Embedding`` in ``dtype`` holding its dequantized weight (the GPU tier: one
    dequantization at load, then cuBLAS; attention, routers, dense MLPs and the LM head are a few
    percent of an MoE model's bytes). Returns the number of modules swapped.

    The float weight is the CPU path's own dequantization (:meth:`QuantLinear.dense_weight`), rounded
    once to ``dtype``."""
    swaps = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    for name, m in swaps:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if isinstance(m, QuantLinear):
            dense = nn.Linear(m.fmt.in_features, m.fmt.out_features, bias=m.bias is not None, device="meta")
            dense.weight = nn.Parameter(m.dense_weight(dtype), requires_grad=False)
            if m.bias is not None:
                dense.bias = nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
        else:
            ids = torch.arange(m.fmt.out_features)
            w = torch.cat([m.forward(ids[i:i + 4096]).to(dtype) for i in range(0, len(ids), 4096)])
            dense = nn.Embedding(*w.shape, _weight=w, _freeze=True)  # no random init to throw away
        setattr(parent, name.rpartition(".")[2], dense)
    return len(swaps)
