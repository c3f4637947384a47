"""``moestream inspect``: what a checkpoint (or a config, at its real size) holds and whether it streams.

For a checkpoint folder the figures come from its safetensors headers; for a bare
config.json they come from the tensors the family would hold at the config's real shape
(the same plan ``moestream synth`` writes), so a 1-trillion-parameter model can be sized
without its weights. Nothing is read but headers and the config.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .budget import GB
from .checkpoint import Checkpoint, TensorInfo, resolve_model, safetensors_dtype
from .decode_graph import graph_unsupported
from .errors import ConfigError, LayoutError, MoestreamError
from .gguf_format import UNSUPPORTED, is_gguf
from .layout import ExpertLayout, discover_experts
from .models import family_for, supported_model_types
from .models.base import check_layer_count
from .models.moe import swiglu_expert
from .quant import model as quant
from .quant.resident import QuantEmbedding, QuantLinear
from .sources import open_checkpoint, open_gguf
from .synth import DTYPES, plan_synth

MB = 1e6

# Architectures that route tokens to experts but gain nothing from streaming them.
_DIFFUSION_MARKERS = ("diffusion", "llada", "dream")
_DIFFUSION_REASON = (
    "a diffusion language model: every denoising step runs the whole block of positions through every layer, "
    "so nearly every expert is touched at every step and no cache can hold back reads; streaming would read "
    "the whole model per step"
)


@dataclass
class Inspection:
    """What ``moestream inspect`` reports. Sizes in bytes; ``can_stream`` with ``reason`` when not.

    ``bytes_per_expert`` is one routed expert's bytes as stored (gate, up and down);
    ``active_expert_bytes`` the routed-expert bytes one token needs (top-k x MoE layers
    x bytes per expert), the most a decoded token reads from disk on a cold cache.
    """

    source: str
    model_type: str | None
    family: str | None
    can_stream: bool
    reason: str = ""
    layers: int = 0
    moe_layers: int = 0
    experts_per_layer: int = 0
    top_k: int = 0
    bytes_per_expert: int = 0
    expert_bytes: int = 0
    resident_bytes: int = 0
    unused_bytes: int = 0
    active_expert_bytes: int = 0
    expert_layout: str = ""
    quantization: str = ""  # format, bits per layer kind and group size of a quantized checkpoint
    unused_examples: list[str] = field(default_factory=list)
    checkpoint_format: str = ""  # an MLX build: its naming rules and quantization (moestream.mlx_format)
    quant_format: str = ""
    quantized_modules: list[str] = field(default_factory=list)
    gpu_kernel: str = ""  # the expert kernel and decode path with --device cuda
    tensor_types: dict[str, str] = field(default_factory=dict)  # a GGUF file: tensor kind -> its ggml types

    def to_text(self) -> str:
        lines = [f"source:             {self.source}", f"model_type:         {self.model_type}"]
        if self.family:
            lines.append(f"family module:      {self.family}")
        if not self.can_stream:
            lines += self._format_lines()
            lines.append(f"can stream:         no: {self.reason}")
            return "\n".join(lines)
        total = self.expert_bytes + self.resident_bytes
        lines += self._format_lines()
        lines += [
            f"decoder layers:     {self.layers} ({self.moe_layers} MoE)",
            f"experts per layer:  {self.experts_per_layer}, top-k {self.top_k} ({self.expert_layout} layout)",
            f"bytes per expert:   {self.bytes_per_expert / MB:.2f} MB ({self.bytes_per_expert:,} bytes as stored)",
            f"expert weights:     {self.expert_bytes / GB:.2f} GB ({100 * self.expert_bytes / max(total, 1):.1f}%)",
            f"resident weights:   {self.resident_bytes / GB:.2f} GB",
            f"experts per token:  {self.active_expert_bytes / GB:.3f} GB at most (top-k x MoE layers)",
        ]
        if self.quantization or self.quant_format:  # the config's summary where it has one (turboquant)
            lines.append(f"quantization:       {self.quantization or self.quant_format}")
            lines += [f"  quantized:        {m}" for m in self.quantized_modules]
        if self.unused_bytes:
            lines.append(
                f"not loaded:         {self.unused_bytes / GB:.2f} GB, such as {', '.join(self.unused_examples)}"
            )
        if self.gpu_kernel:
            lines.append(f"on a GPU:           {self.gpu_kernel}")
        lines.append("can stream:         yes")
        return "\n".join(lines)

    def _format_lines(self) -> list[str]:
        lines = [f"format:             {self.checkpoint_format}"] if self.checkpoint_format else []
        if self.tensor_types:
            lines.append("tensor types:       " + ", ".join(f"{k} {v}" for k, v in self.tensor_types.items()))
        return lines

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _text_config(cfg: dict) -> dict:
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) else cfg


def _top_k(cfg: dict) -> int:
    for c in (cfg, _text_config(cfg)):
        for name in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "experts_per_token"):
            value = c.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return 0


def _not_streamable(cfg: dict) -> str | None:
    """Why a config's architecture cannot stream, or None."""
    names = [cfg.get("model_type") or "", *(cfg.get("architectures") or [])]
    if any(m in str(n).lower() for n in names for m in _DIFFUSION_MARKERS):
        return _DIFFUSION_REASON
    return None


def _synth_index(config: Path, dtype: str) -> tuple[dict, dict[str, TensorInfo]]:
    """The config (as synth would write it) and a header-like index of its tensors at full size."""
    plan = plan_synth(config, None, dtype)
    itemsize = plan.itemsize
    st_dtype = safetensors_dtype(DTYPES[dtype])
    index, offset = {}, 0
    for t in plan.tensors:
        nbytes = math.prod(t.shape) * itemsize
        index[t.name] = TensorInfo(t.name, config, offset, nbytes, st_dtype, tuple(t.shape))
        offset += nbytes
    return plan.config, index


def inspect(model: str | None = None, config: str | Path | None = None, dtype: str = "bf16") -> Inspection:
    """Inspect a checkpoint (``model``: folder or Hub id) or a bare ``config`` at its real size.

    ``dtype`` (bf16, fp16, fp32) is the storage assumed for a bare config.

    Raises:
        CheckpointError, ConfigError, LayoutError: a checkpoint or config that cannot be read, naming
        the file or field. An unsupported or unstreamable architecture is not an error: the
        result says ``can_stream = False`` and why.
    """
    if (model is None) == (config is None):
        raise MoestreamError("give exactly one of --model or --config")
    if config is not None:
        path = Path(config)
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read a JSON config ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a JSON object")
        source, ckpt = str(path), None
    else:
        path = resolve_model(model)
        # a GGUF file is described even when some tensor has a type moestream does not compute on
        ckpt = open_gguf(path, inspect_only=True) if is_gguf(path) else open_checkpoint(path)
        raw, source = ckpt.config, str(ckpt.path)
    try:
        return _inspect(raw, source, ckpt, config, dtype)
    finally:
        if ckpt is not None:
            ckpt.close()


def _inspect(raw: dict, source: str, ckpt: Checkpoint | None, config, dtype: str) -> Inspection:
    model_type = raw.get("model_type") if isinstance(raw.get("model_type"), str) else None
    why = _not_streamable(raw)
    if why:
        return Inspection(source, model_type, None, False, why)
    try:
        family = family_for(raw, source)
    except ConfigError:
        reason = (
            f"model_type {model_type!r} is not supported; moestream streams {', '.join(supported_model_types())}"
            if model_type else "config.json has no model_type"
        )
        return Inspection(source, model_type, None, False, reason)
    unsupported = getattr(ckpt.source_format, "unsupported", None) if ckpt is not None else None
    if unsupported:
        (name, kind), more = unsupported[0], len(unsupported) - 1
        kinds = sorted({k for _, k in unsupported})
        return Inspection(
            source, model_type, family.__name__, False,
            f"tensor {name!r} is {kind}, {UNSUPPORTED}"
            + (f" ({more} more tensors of types {', '.join(kinds)})" if more else ""),
            checkpoint_format=ckpt.source_format.describe(raw),
            tensor_types={k: "/".join(v) for k, v in ckpt.source_format.types.items()},
        )
    if ckpt is None:
        cfg, tensors = _synth_index(Path(config), dtype)
    else:
        cfg, tensors = raw, ckpt.tensors
    if ckpt is not None:  # before a model of the config's size is built
        try:
            check_layer_count(cfg, tensors)
        except ConfigError as e:
            raise ConfigError(f"{ckpt.path / 'config.json' if ckpt.path.is_dir() else ckpt.path}: {e}") from None
    try:
        args = family.ModelArgs.from_config(cfg)
        with torch.device("meta"):
            net = family.Model(args)  # its layers check what they take (head counts): named by source too
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    adapt = getattr(family, "adapt_to_source", None)  # a layout the family follows (gpt-oss from MLX or GGUF)
    if ckpt is not None and ckpt.source_format is not None and adapt is not None:
        adapt(net, ckpt.source_format)
    if ckpt is not None:
        quant.quantize_model(net, ckpt, ckpt.path)  # quantized resident linears: their scales are resident too
    layout = discover_experts(tensors)
    adapt = getattr(family, "adapt_to_layout", None)  # gpt-oss: separate gate and up experts (moestream convert)
    if adapt is not None:
        adapt(net, layout)
    first = getattr(net, "unloaded_layers_from", None)
    if first is not None:  # multi-token-prediction layers after the decoder (DeepSeek-V3, GLM-4.5): not streamed
        layout = ExpertLayout({i: lay for i, lay in layout.layers.items() if i < first}, layout.expert_tensors -
                              {p.source for i, lay in layout.layers.items() if i >= first for ex in lay.experts
                               for p in ex})
    qfmt, qmods = "", []
    if ckpt is not None and layout.layers:
        qfmt, qmods = quant.describe(ckpt, layout, net)
    blocks = net.moe_blocks()
    if not blocks or not layout.layers:
        return Inspection(
            source, model_type, family.__name__, False,
            "no routed experts: a dense model has nothing to stream (run it whole with a dense runner)",
        )
    if len(blocks) != len(layout.layers):
        raise LayoutError(
            f"{source}: the config makes {len(blocks)} MoE layers, the checkpoint holds experts for "
            f"{len(layout.layers)}"
        )
    params = {n for n, _ in net.named_parameters(remove_duplicate=False)}
    if getattr(net, "tie_word_embeddings", False):
        params.discard(net.head_name)
    resident = sum(tensors[n].nbytes for n in params if n in tensors)
    padding, quantization = set(), ""
    if ckpt is not None:
        padding = quant.padding_tensors(tensors)  # alignment filler that `moestream convert` writes
        quantization = quant.summary(ckpt, ckpt.path)
    unused = sorted(n for n in tensors if n not in params and n not in layout.expert_tensors and n not in padding)
    first = next(iter(layout.layers.values()))
    per_expert = layout.expert_nbytes(first.layer, 0)
    top_k = _top_k(cfg)
    active = sum(top_k * layout.expert_nbytes(i, 0) for i in layout.layers)
    return Inspection(
        gpu_kernel=gpu_kernel(net, _quantized_fns(ckpt, layout, net) if (qfmt or quantization) else None,
                              per_expert, active),
        source=source, model_type=model_type, family=family.__name__, can_stream=True,
        layers=len(net.decoder.layers), moe_layers=len(layout.layers), experts_per_layer=first.num_experts,
        top_k=top_k, bytes_per_expert=per_expert, expert_bytes=layout.total_bytes, resident_bytes=resident,
        unused_bytes=sum(tensors[n].nbytes for n in unused), active_expert_bytes=active,
        expert_layout=first.kind, unused_examples=unused[:3], quantization=quantization,
        checkpoint_format=ckpt.source_format.describe(cfg) if ckpt is not None and ckpt.source_format else "",
        quant_format=qfmt, quantized_modules=qmods,
        tensor_types={k: "/".join(v) for k, v in getattr(ckpt.source_format, "types", {}).items()} if ckpt else {},
    )


def _quantized_fns(ckpt, layout, net) -> dict:
    """layer -> expert function of a quantized checkpoint's MoE layers, as the engine would pick (on meta)."""
    return quant.attach(net, quant.expert_formats(ckpt, layout, net.expert_shape(), ckpt.path), torch.float32)


def gpu_kernel(net, quant_fns: dict | None = None, per_expert: int = 0, per_token: int = 0) -> str:
    """What runs a model's routed experts with ``--device cuda``: the fused Triton kernel for the plain SwiGLU
    expert (with decode steps as CUDA graphs where the family is plain), on a quantized checkpoint's stored
    bytes where the kernel reads its format (``quant_fns``: layer -> expert function, None for float
    experts; then the VRAM bytes per expert and the most bytes one token moves over PCIe), the family's
    own function otherwise."""
    if quant_fns:
        why = quant.gpu_unsupported(quant_fns)
        tags = {fn.fmt.tag for fn in quant_fns.values() if getattr(fn, "fmt", None) is not None}
        if why is None and len(tags) > 1:  # one VRAM slot pool holds one expert layout
            why = f"its MoE layers store experts in more than one layout ({'; '.join(sorted(tags))})"
        if why is not None:
            return f"not on the GPU tier ({why}; use --device cpu)"
        why = graph_unsupported(net, also_allowed=(QuantLinear, QuantEmbedding))  # dequantized at load on CUDA
        steps = "decode steps as CUDA graphs" if why is None else f"decode steps eager ({why})"
        return (f"experts by the fused SwiGLU kernel on their stored bytes ({tags.pop()}, dequantized in registers), "
                f"{steps}; {per_expert / MB:.2f} MB of VRAM per expert, at most {per_token / GB:.3f} GB over "
                "PCIe per token (every routed expert a miss); quantized resident linears dequantized once at load")
    blocks = net.moe_blocks()
    if blocks and all(b.expert_fn is swiglu_expert for b in blocks):
        why = graph_unsupported(net, also_allowed=(QuantLinear, QuantEmbedding))
        steps = "decode steps as CUDA graphs" if why is None else f"decode steps eager ({why})"
        return ("experts by the fused SwiGLU kernel (Triton, in place from VRAM slots), " + steps +
                "; the batched SwiGLU chain (torch.bmm) under expert parallelism or without Triton")
    fn = next((b.expert_fn for b in blocks if b.expert_fn is not swiglu_expert), None)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", type(fn).__name__)
    return f"experts one by one with the family's own function ({name}): the fused kernels cover plain SwiGLU only"
