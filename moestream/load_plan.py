"""The load plan: every decision ``engine.load`` takes, made once from headers and the config.

:func:`plan_load` runs before any weight is read and returns a frozen :class:`LoadPlan`: the family and
its arguments, the expert layout, the stored formats, each MoE layer's expert kernel and why, the tiers
(CPU cache, VRAM cache, pinned host tier), the decode path (CUDA graphs or why not), the budget plan, and
the refusals (errors ``engine.load`` raises when it executes the plan, before any weight is read).
``engine.load`` executes it; ``moestream inspect`` prints :meth:`LoadPlan.describe`, so the two cannot
disagree. The kernel choice is here too (:func:`choose_kernel`): by the family's declared
:class:`~moestream.pipeline.ExpertSpec`, the stored format and the device.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from . import fused_moe
from .budget import GB, BudgetPlan, plan_cpu_budget, plan_device_budget, plan_host_budget
from .checkpoint import Checkpoint
from .decode_graph import graph_unsupported
from .errors import ConfigError, LayoutError, MoestreamError, given
from .gguf_format import GGUFFormat
from .io_setup import IOSettings, plan_io
from .layout import ExpertLayout, discover_experts
from .models import family_for
from .models.base import CausalLM, check_layer_count, checkpoint_dtype
from .options import EngineOptions
from .pipeline import (
    BatchedSwiGLUKernel,
    ExpertKernel,
    ExpertSpec,
    FusedSwiGLUKernel,
    NativeMoEKernel,
    PerExpertKernel,
)
from .prefix_cache import prefix_cache_supported
from .quant import model as quant
from .quant import native
from .quant.expert import QuantizedGLU, QuantizedSwiGLU
from .quant.formats import AFFINE_Q8_BITS, QuantConfig
from .quant.resident import QuantEmbedding, QuantLinear, dense_extra_bytes
from .slot_pool import expert_slot_layout
from .store import ExpertStore, PreadReader
from .tiered_cache import device_free_bytes, resolve_device

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


# -- the model on the meta device -----------------------------------------------------------------------------

@dataclass
class Opened:
    """A checkpoint's model before any weight is read: its family, the meta-device model (quantized
    resident linears swapped in), the expert layout checked against the config, the experts'
    formats, the compute dtype and the device the options name."""

    family: ModuleType
    net: CausalLM
    layout: ExpertLayout
    formats: dict
    quantized_resident: list
    num_experts: dict
    dtype: torch.dtype
    device: torch.device


def open_model(ckpt: Checkpoint, options: EngineOptions) -> Opened:
    """The family, model (on the meta device), layout and formats of an opened checkpoint.

    Raises ConfigError, LayoutError, QuantError naming the file, field or tensor.
    """
    cfg_path = ckpt.path / "config.json" if ckpt.path.is_dir() else ckpt.path  # a GGUF file: its metadata
    family = family_for(ckpt.config, str(cfg_path))
    try:
        check_layer_count(ckpt.config, ckpt.tensors)  # before a model of the config's size is built
        args = family.ModelArgs.from_config(ckpt.config)
        with torch.device("meta"):
            net = family.Model(args)  # its layers check what they take (head counts): named by file too
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None
    layout = discover_experts(ckpt.tensors)
    adapt = getattr(family, "adapt_to_source", None)  # an MLX build whose layout the family follows (gpt-oss)
    if ckpt.source_format is not None and adapt is not None:
        adapt(net, ckpt.source_format)
    adapt = getattr(family, "adapt_to_layout", None)  # gpt-oss: separate gate and up experts (moestream convert)
    if adapt is not None:
        adapt(net, layout)
    check_activations(ckpt, options)
    fallback: list = []  # (tensor, type) that q8 mode leaves with float activations
    formats = quant.expert_formats(ckpt, layout, net.expert_shape(), ckpt.path, options.activations,
                                   fallback)  # quantized experts
    quantized_resident = quant.quantize_model(net, ckpt, ckpt.path, options.activations,
                                              fallback)  # quantized resident linears, on meta
    if fallback:
        kinds = sorted({t for _, t in fallback})
        print(f"note: --activations q8 covers {', '.join(quant.Q8_ACTIVATION_TYPES)} and affine "
              f"{' and '.join(f'{b}-bit' for b in AFFINE_Q8_BITS)}; {len(fallback)} tensor"
              f"{'s' if len(fallback) > 1 else ''} of type {', '.join(kinds)} keep float activations "
              f"({fallback[0][0]}, ...)", file=sys.stderr)
    if options.dtype == "auto":
        dtype = quant.float_dtype(ckpt, net.embed_name, checkpoint_dtype(ckpt, net.embed_name))
    else:
        dtype = _DTYPES[options.dtype]
    if getattr(net, "unloaded_layers_from", None) is not None:
        layout = drop_layers_from(layout, net.unloaded_layers_from)
    num_experts = check_layout(net, layout, ckpt.path, formats)
    return Opened(family, net, layout, formats, quantized_resident, num_experts, dtype,
                  resolve_device(options.device, options.name("device")))


def check_layout(model: CausalLM, layout: ExpertLayout, where, quantized: dict | None = None) -> dict[int, int]:
    """Check the checkpoint's experts against the config; return layer -> experts.

    Layers in ``quantized`` (layer -> ExpertFormat) were checked by ``moestream.quant``.
    """
    blocks = {b.layer: b for b in model.moe_blocks()}
    if set(blocks) != set(layout.layers):
        raise LayoutError(
            f"{where}: the config makes layers {sorted(blocks)} MoE layers, but the checkpoint holds routed "
            f"experts for layers {sorted(layout.layers)}"
        )
    inter, hidden = model.expert_shape()
    for i, lay in layout.layers.items():
        want = blocks[i].num_experts
        if lay.num_experts != want:
            raise LayoutError(f"{where}: {lay.block} holds {lay.num_experts} experts; the config says {want}")
        if quantized and i in quantized:
            continue
        gate = lay.experts[0][0]
        if tuple(gate.shape) != (inter, hidden):
            raise LayoutError(
                f"{where}: {lay.block} experts have gate shape {list(gate.shape)}; "
                f"the config implies [{inter}, {hidden}]"
            )
        roles = tuple(p.role for p in lay.experts[0])
        if roles != model.expert_roles:
            raise LayoutError(
                f"{where}: {lay.block} experts hold {', '.join(roles)}; this family's experts have exactly "
                f"{', '.join(model.expert_roles)}"
            )
    return {i: lay.num_experts for i, lay in layout.layers.items()}


def check_activations(ckpt: Checkpoint, options: EngineOptions) -> None:
    """Refuse ``--activations q8`` where it cannot apply: a checkpoint that is neither a GGUF file (q8 mode is
    llama.cpp's numerics on ggml block types) nor MLX affine-quantized (8-bit activation blocks against its 4- and
    8-bit codes), another device than the CPU, or the PyTorch kernel path (q8 mode runs on the compiled kernels
    only).

    Raises:
        ConfigError: naming the flag and why.
    """
    if options.activations == "float":
        return
    name = options.name
    q8, float_ = given(name("activations"), options.activations), given(name("activations"), "float")
    qcfg = None if isinstance(ckpt.source_format, GGUFFormat) else QuantConfig.from_config(ckpt.config, str(ckpt.path))
    if not isinstance(ckpt.source_format, GGUFFormat) and (qcfg is None or qcfg.method != "affine"):
        what = "not quantized" if qcfg is None else f"{qcfg.method}-quantized"
        raise ConfigError(f"{q8} is llama.cpp's numerics for GGUF files and integer dot products for MLX affine 4- "
                          f"and 8-bit weights; {ckpt.path} is neither ({what}: use {float_})")
    if resolve_device(options.device, name("device")).type != "cpu":
        raise ConfigError(f"{q8} runs on the CPU's compiled kernels; use {given(name('device'), 'cpu')}")
    if native.selected() == "torch" or native.library() is None:
        why = "MOESTREAM_CPU_KERNELS=torch" if native.selected() == "torch" else "the CPU kernels are not built"
        raise ConfigError(f"{q8} runs on the CPU's compiled kernels, which are off here ({why})")


def drop_layers_from(layout: ExpertLayout, first: int) -> ExpertLayout:
    """The layout without layers ``first`` and beyond (DeepSeek's multi-token-prediction layers, which the
    model does not run); their tensors are then reported as unused."""
    keep = {i: lay for i, lay in layout.layers.items() if i < first}
    dropped = {p.source for i, lay in layout.layers.items() if i >= first for ex in lay.experts for p in ex}
    return ExpertLayout(keep, layout.expert_tensors - dropped)


# -- the expert kernels -----------------------------------------------------------------------------------------

def native_kernel(fn) -> NativeMoEKernel | None:
    """The CPU kernel computing a layer's experts several per call for ``fn``: a float expert's
    :class:`~moestream.pipeline.ExpertSpec` (or function, by :meth:`ExpertSpec.of`) of kind ``swiglu``,
    ``situ_glu`` (Kimi) or ``clamped_swiglu`` on linear pieces (gpt-oss), or a quantized expert function
    :class:`QuantizedSwiGLU` / :class:`QuantizedGLU`; None for another kind, or without compiled kernels (the
    per-expert :class:`PerExpertKernel` then). Chosen from the spec or function alone, so every budget gets
    the same."""
    if native.selected() == "torch":
        return None
    if isinstance(fn, QuantizedSwiGLU):
        return NativeMoEKernel(fn, fn.fmt)
    if isinstance(fn, QuantizedGLU):
        if fn.act != "situ":
            return None
        lb = fn.params.get("linear_beta")
        return NativeMoEKernel(fn, fn.fmt, "situ", (fn.params.get("beta", 1.0), float("nan") if lb is None else lb))
    spec = ExpertSpec.of(fn)
    p = spec.keywords
    if spec.kind == "swiglu":
        return NativeMoEKernel(spec.fn)
    if spec.kind == "situ_glu" and "beta" in p:
        lb = p.get("linear_beta")
        return NativeMoEKernel(spec.fn, None, "situ", (p["beta"], float("nan") if lb is None else lb))
    if spec.kind == "clamped_swiglu" and spec.layout == "linear" and "alpha" in p and "limit" in p:
        return NativeMoEKernel(spec.fn, None, "clamped", (p["alpha"], p["limit"]))
    return None


def choose_kernel(spec: ExpertSpec, fn, batched: bool, fused: bool, cpu: bool) -> tuple[ExpertKernel, str]:
    """The expert kernel of one MoE layer and why: ``spec`` the family's declared expert, ``fn`` the layer's
    quantized expert function (None for float experts); where ``fused`` and the layer's experts are SwiGLU the
    fused Triton kernel from VRAM slots (also on the CPU, where ``fused_experts=True`` asks for it under
    Triton's interpreter; quantized ones on their stored bytes); else the CPU's compiled layer kernel
    (``cpu``), else the batched SwiGLU chain where ``batched``; else the layer's function one expert at a time."""
    swiglu = spec.kind == "swiglu"
    if fn is not None and fused and isinstance(fn, QuantizedSwiGLU):
        return FusedSwiGLUKernel(fn.fmt), "quantized SwiGLU experts in a format the fused kernel reads"
    if cpu and not batched and not (fused and swiglu):
        nk = native_kernel(spec if fn is None else fn)
        if nk is not None:
            return nk, f"the compiled CPU kernels cover {spec.kind} experts" + (
                "" if fn is None else f" stored as {fn.fmt.tag}")
    if fn is not None:
        why = "quantized experts one at a time: " + (
            "no compiled CPU kernel path (MOESTREAM_CPU_KERNELS=torch)" if cpu and native.selected() == "torch"
            else "batched experts cover float SwiGLU only" if batched
            else f"{type(fn).__name__} on the stored pieces")
        return PerExpertKernel(fn), why
    if fused and swiglu:
        return FusedSwiGLUKernel(), "SwiGLU experts with the fused kernel on"
    if batched and swiglu:
        return BatchedSwiGLUKernel(), "SwiGLU experts, batched (the default on CUDA; --batched-experts)"
    if not swiglu and spec.kind != "custom" and not cpu:
        why = f"{spec.kind} experts: the fused and batched kernels cover plain SwiGLU only"
    elif spec.kind == "custom":
        why = f"the family's own expert function ({spec.name})"
    else:
        why = "no compiled CPU kernel path (MOESTREAM_CPU_KERNELS=torch)" if cpu else "no batched or fused kernel"
    return PerExpertKernel(spec.fn, spec.name), why


def expert_kernels(net: CausalLM, quant_fns: dict, batched: bool, fused: bool = False, cpu: bool = False) -> dict:
    """layer -> the expert kernel of each MoE block of ``net`` (:func:`choose_kernel`), chosen once."""
    return {b.layer: choose_kernel(b.expert, quant_fns.get(b.layer), batched, fused, cpu)[0]
            for b in net.moe_blocks()}


_FUSED_REFUSED = ("fused_experts: the fused MoE kernel needs Triton on a CUDA device (or TRITON_INTERPRET=1), "
                  "the GPU tier (--device cuda or a host tier), SwiGLU experts in bf16/fp16/fp32 or as MLX "
                  "affine, fp8 or MXFP4, and no expert parallelism")


def use_fused(net: CausalLM, options: EngineOptions, dev: torch.device, tiered: bool, parallel: bool,
              quant_fns: dict) -> tuple[bool, str | None]:
    """Whether the SwiGLU experts run on the fused Triton kernel from a VRAM slot pool: on CUDA when Triton is
    there (``fused_experts`` None), never under expert parallelism (its slot exchange needs the batched
    chain's shapes); quantized experts only as SwiGLU experts in a format it reads
    (:func:`moestream.quant.model.gpu_unsupported`). The second value: the refusal when ``fused_experts=True``
    where the kernel cannot run."""
    want = options.fused_experts
    if want is False:
        return False, None
    can = fused_moe.available(dev) and tiered and not parallel and quant.gpu_unsupported(quant_fns) is None and any(
        b.expert.kind == "swiglu" for b in net.moe_blocks())
    if want is None:  # by default on CUDA only: the CPU path keeps its per-expert kernels
        return can and dev.type == "cuda", None
    return can, None if can else _FUSED_REFUSED


def quantized_tier_refusal(opened: Opened, quant_fns: dict, fused: bool, pooled: bool) -> str | None:
    """Quantized experts on the GPU tier are computed only by the fused kernel, from the stored bytes in VRAM
    slots (no dequantized copy of an expert in VRAM): why they cannot run (``fused``: the fused kernel chosen;
    ``pooled``: one slot pool holds every expert), or None."""
    if not opened.formats or (fused and pooled):
        return None
    why = quant.gpu_unsupported(quant_fns)
    if why is None and fused_moe.triton is None:
        why = "the fused kernel needs Triton, which this PyTorch lacks"
    elif why is None and fused:
        why = "its MoE layers store experts in more than one layout (one slot pool holds one)"
    elif why is None:
        why = ("the fused kernel is not in use (it runs by default with --device cuda; fused_experts=False and "
               "expert parallelism turn it off)")
    return why


# -- the plan ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Refusal:
    """What the engine refuses to load, and why: ``error(message)`` raised by :meth:`LoadPlan.check`.
    ``stage``: ``device``, ``fused``, ``quantized tier`` or ``budget``; ``reason``: the why, without the path."""

    stage: str
    error: type
    message: str
    reason: str = ""

    def exception(self) -> MoestreamError:
        return self.error(self.message)


@dataclass(frozen=True)
class LayerPlan:
    """One MoE layer's expert computation: the family's expert spec (``expert``), its stored format
    (``stored``: a format tag or ``float``), the kernel (class name, kind, name) and why it was chosen."""

    layer: int
    expert: str
    stored: str
    kernel: str
    kind: str
    name: str
    why: str

    def line(self) -> str:
        return f"{self.kernel} ({self.kind}): {self.name}; {self.expert} experts, {self.stored}: {self.why}"


@dataclass(frozen=True)
class LoadPlan:
    """Every decision of loading one checkpoint on one device, made before any weight is read.

    Attributes:
        source: the checkpoint; family: the family module's name; args: its ``ModelArgs``.
        device, dtype: the compute device and dtype.
        layout: the expert layout's kind(s) (``per-expert``, ``fused``, ``stacked``); moe_layers: how many.
        formats: (layer, stored format) of each quantized MoE layer.
        layers: each MoE layer's :class:`LayerPlan`, ascending.
        tiered: the GPU tier's cache (:class:`~moestream.tiered_cache.TieredExpertCache`) rather than the CPU's.
        fused: the fused kernel on a VRAM slot pool; slots: the cache lays a slot pool out (asked before the pool
            is known; ``pooled``: it can: one slot layout holds every expert).
        batched: the batched SwiGLU chain where the fused kernel does not run.
        disk_ahead: layers the disk prefetcher reads ahead; lookahead: layers whose host-tier experts the
            pipeline stages into VRAM while a layer computes.
        decode_runner, graphs, graphs_why: decode steps through static buffers, as CUDA graphs, or why not.
        budget: the :class:`~moestream.budget.BudgetPlan` (None when it could not be sized: ``budget_note``).
        refusals: what loading refuses, in the order ``engine.load`` checks; the first is raised.
        prefix_cache_why: why ``--prefix-cache-gb`` is off for this model and device, or None.
        notes: what else is worth saying (the read path).
    The execution objects (``opened``, ``io``, ``quant_fns``, ``kernels``, ``keys``) ride along, unrepresented.
    """

    source: str
    family: str
    args: object
    device: torch.device
    dtype: torch.dtype
    layout: str
    moe_layers: int
    formats: tuple[tuple[int, str], ...]
    layers: tuple[LayerPlan, ...]
    tiered: bool
    fused: bool
    slots: bool
    pooled: bool
    batched: bool
    disk_ahead: int
    lookahead: int
    decode_runner: bool
    graphs: bool
    graphs_why: str
    budget: BudgetPlan | None
    budget_note: str
    refusals: tuple[Refusal, ...]
    prefix_cache_why: str | None
    notes: tuple[str, ...] = ()
    opened: Opened | None = field(default=None, compare=False, repr=False)
    io: IOSettings | None = field(default=None, compare=False, repr=False)
    quant_fns: dict = field(default_factory=dict, compare=False, repr=False)
    kernels: dict = field(default_factory=dict, compare=False, repr=False)
    keys: tuple = field(default=(), compare=False, repr=False)

    def check(self) -> None:
        """Raise the first refusal (what ``engine.load`` refuses before any weight is read)."""
        if self.refusals:
            raise self.refusals[0].exception()

    def refusal(self, stage: str) -> Refusal | None:
        return next((r for r in self.refusals if r.stage == stage), None)

    def tiers(self) -> str:
        """The caches an expert passes through, in one line."""
        b = self.budget
        size = ("not sized here" if b is None else "every expert resident" if b.budget is None
                else _size(b.budget) + (" (auto)" if b.auto is not None else "")
                + (f", capped at every expert, {_size(b.experts)}" if 0 < b.experts < b.budget else ""))
        if not self.tiered:
            return f"CPU expert cache ({size}) over the checkpoint's shards"
        where = "VRAM" if self.device.type == "cuda" else f"{self.device.type} device tier"
        host = "" if b is None or not b.host else f", pinned host tier {_size(b.host)}"
        pool = ", one slot pool" if self.fused else ""
        return f"{where} expert cache ({size}{pool}){host} over the checkpoint's shards"

    def decode(self) -> str:
        """The decode path in one line."""
        if self.graphs:
            return "decode steps as CUDA graphs"
        return f"decode steps eager ({self.graphs_why})"

    def describe(self) -> list[str]:
        """The plan as ``moestream inspect`` prints it: one line per decision (layers with one kernel together)."""
        fmts = sorted({f for _, f in self.formats})
        lines = [
            f"load plan:          on {self.device}, {str(self.dtype).removeprefix('torch.')}; family "
            f"{self.family.rsplit('.', 1)[-1]} ({type(self.args).__qualname__})",
            f"  experts:          {self.moe_layers} MoE layers, {self.layout} layout, "
            + ("stored " + "; ".join(fmts) if fmts else "float"),
        ]
        groups: list[tuple[list[int], str]] = []
        for lp in self.layers:
            if groups and groups[-1][1] == lp.line():
                groups[-1][0].append(lp.layer)
            else:
                groups.append(([lp.layer], lp.line()))
        for layers, text in groups:
            span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
            lines.append(f"  kernel:           {span}: {text}")
        lines.append(f"  tiers:            {self.tiers()}")
        if self.budget is not None and self.budget.auto is not None:
            lines.append(f"  budget:           {self.budget.auto.describe()}")
        elif self.budget_note:
            lines.append(f"  budget:           {self.budget_note}")
        lines.append(f"  decode:           {self.decode()}")
        lines += [f"  note:             {n}" for n in self.notes]
        lines += [f"  refused:          {r.message}" for r in self.refusals]
        return lines


def _size(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.01 * GB else f"{nbytes / 1e6:.2f} MB"


def _layout_kind(layout: ExpertLayout) -> str:
    return "/".join(sorted({lay.kind for lay in layout.layers.values()})) or "no"


def _plan_budget(net: CausalLM, sizes: ExpertStore, keys: list, dtype: torch.dtype, dev: torch.device,
                 tiered: bool, io: IOSettings, options: EngineOptions, share: int) -> BudgetPlan | None:
    """The cache budget (and host tier) of this model's experts ``keys`` (:mod:`moestream.budget`; its
    BudgetError when it cannot fit). None: a CUDA device's free memory is unknown here (no CUDA)."""
    one_each = [sizes.cached_nbytes(k) for k in keys]
    experts, one = sum(one_each), max(one_each, default=0)
    if dev.type == "cuda":  # quantized resident linears are dequantized at load there (engine.load)
        if not torch.cuda.is_available():
            return None
        plan = plan_device_budget(net, options.cache_budget, dtype, experts, one, device_free_bytes(dev), dev,
                                  options.context_tokens, extra_resident=dense_extra_bytes(net, dtype),
                                  sequences=options.max_batch, name=options.name)
    else:
        plan = plan_cpu_budget(net, options.cache_budget, dtype, experts, one, options.workers, io.use_page_cache,
                               options.prefetch_ahead, options.context_tokens, share, sizes.read_buffers(keys),
                               options.wire_memory, chunk_window=io.chunk_window, sequences=options.max_batch,
                               prefix_cache=options.prefix_cache if prefix_cache_supported(net, dev) is None else 0,
                               name=options.name)
    if tiered:
        plan.host = plan_host_budget(options.host_cache, experts, one, options.workers, share, name=options.name)
    if options.context_tokens and net.max_context and options.context_tokens > net.max_context:  # once it fits
        print(f"note: a context of {options.context_tokens} tokens ({options.name('context_tokens')}) is above the "
              f"model's (max_position_embeddings {net.max_context} in its config): positions past it are beyond "
              "what it was trained on", file=sys.stderr)
    return plan


def plan_load(ckpt: Checkpoint, options: EngineOptions, device: torch.device | None = None, *,
              place: Callable[[CausalLM, dict], tuple[Callable, int]] | None = None) -> LoadPlan:
    """Plan loading ``ckpt`` with ``options`` on ``device`` (None: the device the options name), from its
    headers and config only: no weight is read, nothing is allocated but the meta-device model.

    ``place`` (expert parallelism): called with the meta model and layer -> experts once the kernels are
    known, returns ``(owns, share)`` -- which experts this rank holds and how many local ranks split the
    machine's memory -- for the budget; ``engine.load`` passes :meth:`ExpertParallel.place` there (a
    collective: the one step that is not pure).

    Raises:
        CheckpointError, ConfigError, LayoutError, QuantError: a checkpoint that cannot be loaded at all (naming
        the file, field or tensor). What loading refuses on this device with these options is not raised: it is
        in :attr:`LoadPlan.refusals` (``engine.load`` raises the first).
    """
    opened = open_model(ckpt, options)
    net = opened.net
    dev = opened.device if device is None else torch.device(device)
    tiered = dev.type == "cuda" or options.host_cache is not None or bool(options.fused_experts)
    parallel = place is not None
    refusals: list[Refusal] = []
    if tiered and options.wire_memory:
        name = options.name
        msg = (f"{given(name('wire_memory'), True)} applies to the CPU expert cache; with "
               f"{given(name('device'), 'cuda')} use {name('host_cache')}")
        refusals.append(Refusal("device", ConfigError, msg, msg))
    disk_ahead = options.prefetch_ahead
    if dev.type == "cuda":
        # on CUDA with the fused kernel --prefetch-ahead stages host-tier experts beside compute inside the decode
        # graphs (the pipeline's lookahead); the disk read-ahead would need the host inside every step
        fused0, refused = use_fused(net, options, dev, tiered, parallel, {})
        if refused:
            refusals.append(Refusal("fused", ConfigError, refused, refused))
        disk_ahead = 0 if fused0 else options.prefetch_ahead
    io = plan_io(ckpt, options.workers, options.use_page_cache, disk_ahead, options.wire_memory,
                 chunk_reads=not tiered)
    quant_fns = quant.attach(net, opened.formats, opened.dtype)  # layer -> expert function on stored pieces
    keys = [(i, e) for i, lay in opened.layout.layers.items() for e in range(lay.num_experts)]
    share = 1
    if parallel and not refusals:  # this rank's experts only; rank 0 places them
        owns, share = place(net, opened.num_experts)
        keys = [key for key in keys if owns(key)]
    fused, refused = use_fused(net, options, dev, tiered, parallel, quant_fns)
    if refused and not any(r.stage == "fused" for r in refusals):
        refusals.append(Refusal("fused", ConfigError, refused, refused))
    sizes = ExpertStore(ckpt, opened.layout, opened.dtype, "cpu", options.workers, reader=PreadReader())
    try:
        all_keys = [(layer, e) for layer, n in opened.num_experts.items() for e in range(n)]
        pooled = tiered and fused and expert_slot_layout(sizes, all_keys) is not None
        # quantized experts the GPU tier cannot compute: refused before any weight is read (whether one slot
        # pool holds them all is asked after the budget, as the cache would find it)
        why = quantized_tier_refusal(opened, quant_fns, fused, True) if tiered else None
        if why is not None:
            refusals.append(_tier_refusal(ckpt, why, options))
        budget, note = None, ""
        try:
            budget = _plan_budget(net, sizes, keys, opened.dtype, dev, tiered, io, options, share)
            if budget is None:
                note = f"not sized here: {dev} is not available to this PyTorch"
        except MoestreamError as e:
            refusals.append(Refusal("budget", type(e), str(e), str(e)))
            note = "refused"
        why = quantized_tier_refusal(opened, quant_fns, fused, pooled) if tiered and fused and not pooled else None
        if why is not None and not any(r.stage == "quantized tier" for r in refusals):
            refusals.append(_tier_refusal(ckpt, why, options))
    finally:
        sizes.close()
    slots = fused
    fused = fused and (pooled or not tiered)  # experts of more than one layout: no slot pool
    batched = dev.type == "cuda" if options.batched_experts is None else options.batched_experts
    cpu = dev.type == "cpu"
    kernels, layers = {}, []
    for block in net.moe_blocks():
        fn = quant_fns.get(block.layer)
        kernel, why = choose_kernel(block.expert, fn, batched, fused, cpu)
        kernels[block.layer] = kernel
        fmt = opened.formats.get(block.layer)
        stored = "float" if fmt is None else getattr(fmt, "tag", type(fmt).__name__)
        layers.append(LayerPlan(block.layer, block.expert.describe(), stored, type(kernel).__name__, kernel.kind,
                                kernel.name, why))
    lookahead = options.prefetch_ahead if fused else 0
    runner, graphs, graphs_why = _plan_decode(net, kernels, options, dev, disk_ahead, opened)
    notes = (io.describe(),)
    return LoadPlan(
        source=str(ckpt.path), family=opened.family.__name__, args=net.args if hasattr(net, "args") else None,
        device=dev, dtype=opened.dtype, layout=_layout_kind(opened.layout), moe_layers=len(opened.layout.layers),
        formats=tuple((lp.layer, lp.stored) for lp in layers if lp.stored != "float"),
        layers=tuple(layers), tiered=tiered, fused=fused, slots=slots, pooled=pooled, batched=batched,
        disk_ahead=disk_ahead, lookahead=lookahead, decode_runner=runner, graphs=graphs, graphs_why=graphs_why,
        budget=budget, budget_note=note, refusals=tuple(refusals),
        prefix_cache_why=prefix_cache_supported(net, dev) if options.prefix_cache else None, notes=notes,
        opened=opened, io=io, quant_fns=quant_fns, kernels=kernels, keys=tuple(keys),
    )


def _tier_refusal(ckpt: Checkpoint, why: str, options: EngineOptions) -> Refusal:
    return Refusal("quantized tier", ConfigError, f"{ckpt.path}: quantized experts on the GPU tier: {why}; use "
                   f"{given(options.name('device'), 'cpu')}", why)


def _plan_decode(net: CausalLM, kernels: dict, options: EngineOptions, dev: torch.device, disk_ahead: int,
                 opened: Opened) -> tuple[bool, bool, str]:
    """(a decode runner, CUDA graphs, why not): decode steps through static buffers when every MoE layer runs
    the fused kernel and the family is plain (:func:`moestream.decode_graph.graph_unsupported`; on CUDA the
    quantized resident linears are dequantized at load, so they count as plain). Graphs stay off while the host
    must act inside a step: a disk prefetcher or a routing trace (the lookahead's host-tier copies are staged
    between the graph segments)."""
    if not kernels or not all(k.kind == "in_slots" for k in kernels.values()):
        kinds = sorted({k.kind for k in kernels.values()})
        return False, False, f"the plain path: the expert kernels are {', '.join(kinds) or 'none'}, not in_slots"
    also = (QuantLinear, QuantEmbedding) if dev.type == "cuda" and opened.quantized_resident else ()
    why = graph_unsupported(net, also_allowed=also)
    if why is not None:
        return False, False, why
    if not options.cuda_graphs:
        return True, False, "--no-cuda-graphs"
    if dev.type != "cuda":
        return True, False, f"static buffers on {dev.type}: graphs are CUDA's"
    if disk_ahead:
        return True, False, "the disk read-ahead (--prefetch-ahead) needs the host inside every step"
    if options.trace is not None:
        return True, False, "a routing trace (--trace) is written from the host inside every step"
    return True, True, ""
