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
from .errors import ConfigError, LayoutError, MoestreamError
from .gguf_format import UNSUPPORTED, is_gguf
from .layout import ExpertLayout, discover_experts
from .load_plan import LoadPlan, plan_load
from .models import family_for, supported_model_types
from .models.base import check_layer_count
from .options import DEFAULT_BUDGET_GB, EngineOptions
from .quant import model as quant
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
    gpu_kernel: str = ""  # the expert kernel and decode path with --device cuda (from its load plan)
    load_plan: list[str] = field(default_factory=list)  # moestream.load_plan's plan on this machine's device
    loads_here: bool = True  # that plan was made (False: refused with these options on this machine)
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
        lines += self.load_plan
        lines.append("can stream:         yes" if self.loads_here else
                     "can stream:         yes, but not here with these options (the load plan says why)")
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


def inspect(model: str | None = None, config: str | Path | None = None, dtype: str = "bf16",
            options: EngineOptions | None = None) -> Inspection:
    """Inspect a checkpoint (``model``: folder or Hub id) or a bare ``config`` at its real size.

    ``dtype`` (bf16, fp16, fp32) is the storage assumed for a bare config. ``options``: the engine options
    the load plan is made for (default: ``moestream.load``'s defaults); the plan is ``engine.load``'s own
    (:func:`moestream.load_plan.plan_load`) on this machine's device, and on a CUDA device for ``on a GPU``.

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
        return _inspect(raw, source, ckpt, config, dtype, options or EngineOptions.make(DEFAULT_BUDGET_GB))
    finally:
        if ckpt is not None:
            ckpt.close()


def _inspect(raw: dict, source: str, ckpt: Checkpoint | None, config, dtype: str,
             options: EngineOptions) -> Inspection:
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
    planned = _ConfigCheckpoint(Path(source), cfg, tensors) if ckpt is None else ckpt
    here, on_gpu = _plan(planned, options, None), _plan(planned, options, torch.device("cuda"))
    return Inspection(
        gpu_kernel=on_gpu if isinstance(on_gpu, str) else gpu_kernel(on_gpu, per_expert, active),
        load_plan=[here] if isinstance(here, str) else here.describe(),
        loads_here=not isinstance(here, str) and not here.refusals,
        source=source, model_type=model_type, family=family.__name__, can_stream=True,
        layers=len(net.decoder.layers), moe_layers=len(layout.layers), experts_per_layer=first.num_experts,
        top_k=top_k, bytes_per_expert=per_expert, expert_bytes=layout.total_bytes, resident_bytes=resident,
        unused_bytes=sum(tensors[n].nbytes for n in unused), active_expert_bytes=active,
        expert_layout=first.kind, unused_examples=unused[:3], quantization=quantization,
        checkpoint_format=ckpt.source_format.describe(cfg) if ckpt is not None and ckpt.source_format else "",
        quant_format=qfmt, quantized_modules=qmods,
        tensor_types={k: "/".join(v) for k, v in getattr(ckpt.source_format, "types", {}).items()} if ckpt else {},
    )


@dataclass
class _ConfigCheckpoint:
    """A bare config as :func:`moestream.load_plan.plan_load` reads a checkpoint: its config and a header-like
    index of the tensors the family would hold at the config's real size (no shards)."""

    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    shards: list = field(default_factory=list)
    source_format: object = None


def _plan(ckpt, options: EngineOptions, device: torch.device | None) -> LoadPlan | str:
    """``engine.load``'s plan for ``ckpt`` on ``device`` (None: this machine's), or a line saying why there is
    none (a checkpoint the engine cannot load at all)."""
    try:
        return plan_load(ckpt, options, device)
    except MoestreamError as e:
        return f"load plan:          none: {e}" if device is None else f"cannot load ({e})"


def gpu_kernel(plan: LoadPlan, per_expert: int = 0, per_token: int = 0) -> str:
    """What runs a model's routed experts with ``--device cuda``, from its load plan on a CUDA device: the fused
    Triton kernel for the plain SwiGLU expert (with decode steps as CUDA graphs where the family is plain), on
    a quantized checkpoint's stored bytes where the kernel reads its format (then the VRAM bytes per expert,
    ``per_expert``, and the most bytes one token moves over PCIe, ``per_token``), else what the plan chose."""
    refused = plan.refusal("quantized tier")
    if refused is not None:
        return f"not on the GPU tier ({refused.reason}; use --device cpu)"
    if plan.formats and plan.fused:
        tags = sorted({f for _, f in plan.formats})
        return (f"experts by the fused SwiGLU kernel on their stored bytes ({'; '.join(tags)}, dequantized in "
                f"registers), {plan.decode()}; {per_expert / MB:.2f} MB of VRAM per expert, at most "
                f"{per_token / GB:.3f} GB over PCIe per token (every routed expert a miss); quantized resident "
                "linears dequantized once at load")
    if plan.layers and all(lp.kind == "in_slots" for lp in plan.layers):
        return ("experts by the fused SwiGLU kernel (Triton, in place from VRAM slots), " + plan.decode() +
                "; the batched SwiGLU chain (torch.bmm) under expert parallelism or without Triton")
    other = next((lp for lp in plan.layers if lp.kind != "in_slots"), None)
    if other is None:
        return ""
    if other.kind == "per_layer":
        return f"experts by the batched SwiGLU chain (torch.bmm): {other.why}; {plan.decode()}"
    return f"experts one by one with {other.name} ({other.expert}): {other.why}"
