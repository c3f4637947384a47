"""Compress a float checkpoint with the compressed-tensors library, as llm-compressor writes one.

The float checkpoint's tensors become a module tree under their checkpoint names (every
2-D ``weight`` a ``Linear``, but embeddings and, where the published code says so, MoE
routers); the library then folds the ``transform_config`` (``apply_transform_config``),
attaches the schemes (``apply_quantization_config``: its own ``targets`` / ``ignore``
matching), takes each weight's scales from its min and max (``calculate_qparams``, what
llm-compressor's min-max observers feed it) and compresses
(``ModelCompressor.compress_model``). The decompressed weights
(``ModelCompressor.decompress_model``) are the float reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def _tree(tensors: dict[str, torch.Tensor], linear_router: bool) -> nn.Module:
    root = nn.Module()

    def module(path: str, make) -> nn.Module:
        parent = root
        parts = path.split(".")
        for i, p in enumerate(parts):
            child = parent._modules.get(p)
            if child is None:
                child = make() if i == len(parts) - 1 else nn.Module()
                parent.add_module(p, child)
            parent = child
        return parent

    for name, t in tensors.items():  # weights first: they decide the module's class
        path, param = name.rsplit(".", 1)
        if param == "weight" and t.dim() == 2:
            last = path.rsplit(".", 1)[-1]
            if last == "embed_tokens":
                m = module(path, lambda t=t: nn.Embedding(*t.shape))
            elif last == "gate" and not linear_router:
                m = module(path, nn.Module)
            else:
                m = module(path, lambda t=t, b=path + ".bias" in tensors: nn.Linear(t.shape[1], t.shape[0], bias=b))
            m._parameters["weight"] = nn.Parameter(t.clone(), requires_grad=False)
    for name, t in tensors.items():
        path, param = name.rsplit(".", 1)
        m = module(path, nn.Module)
        if param not in m._parameters or m._parameters[param] is None:
            m._parameters[param] = nn.Parameter(t.clone(), requires_grad=False)
        else:
            m._parameters[param].data.copy_(t)
    return root


def _calibrate(root: nn.Module) -> int:
    """Set every quantized module's ``weight_scale`` from its weight's min and max per block or group."""
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    n = 0
    for _, m in root.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w = scheme.weights, m.weight.detach()
        strategy = str(getattr(args.strategy, "value", args.strategy))
        if strategy == "block":
            bn, bk = args.block_structure
            p = maybe_pad_tensor_for_block_quant(w, (bn, bk))
            v = p.view(p.shape[0] // bn, bn, p.shape[1] // bk, bk)
            lo, hi = v.amin((1, 3)), v.amax((1, 3))
        elif strategy == "group":
            v = w.view(w.shape[0], -1, args.group_size)
            lo, hi = v.amin(-1), v.amax(-1)
        elif strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:
            raise ValueError(f"strategy {strategy} not handled by this test helper")
        scale, _ = calculate_qparams(lo, hi, args)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        n += 1
    return n


def compress(src: Path, dst: Path, ref: Path, quantization_config: dict, text_config: bool = False,
             linear_router: bool = False) -> int:
    """Write ``src`` (float checkpoint) compressed into ``dst`` and its decompressed weights into ``ref``.

    ``quantization_config`` (a published block) is written to ``dst``'s config.json as it is
    (under ``text_config`` when ``text_config``). ``linear_router``: the MoE router
    (``...gate``) is an ``nn.Linear`` (Laguna's code; its config ignores and rotates
    ``mlp.gate``), else a plain module (Kimi's ``MoEGate``). Returns the number of modules quantized.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    root = _tree(tensors, linear_router)
    body = {k: v for k, v in quantization_config.items()
            if k not in ("transform_config", "sparsity_config", "version", "quant_method")}
    qcfg = QuantizationConfig.model_validate(body)
    tcfg = None
    if quantization_config.get("transform_config"):
        tcfg = TransformConfig.model_validate(quantization_config["transform_config"])
        apply_transform_config(root, tcfg)
    qcfg.kv_cache_scheme = None  # the KV scales need calibration on attention; moestream ignores them anyway
    qcfg.quantization_status = QuantizationStatus.FROZEN
    apply_quantization_config(root, qcfg)
    n = _calibrate(root)
    compressor = ModelCompressor(quantization_config=qcfg, transform_config=tcfg)
    compressor.compress_model(root)
    for d in (dst, ref):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, d / f.name)
    save_file({k: v.contiguous() for k, v in root.state_dict().items()}, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (cfg["text_config"] if text_config else cfg)["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    compressor.decompress_model(root)
    state = root.state_dict()
    save_file({k: state[k].to(tensors[k].dtype).contiguous() for k in tensors}, ref / "model.safetensors")
    return n
