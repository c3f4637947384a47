"""Loading: a checkpoint becomes a ready model with resident weights, an expert store and
an expert cache (and, when asked, its tokenizer).

``load()`` ties the layers together in their one-way order: checkpoint -> expert layout
-> expert store -> expert cache -> family model.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType

import torch

from . import attention_kernel, fused_moe
from .budget import (
    GB,
    BudgetPlan,
    context_tokens_for,
    plan_cpu_budget,
    plan_device_budget,
    plan_host_budget,
    resident_bytes,
)
from .cache import ExpertCache
from .checkpoint import Checkpoint, resolve_model
from .decode_graph import DecodeRunner, graph_unsupported
from .errors import ConfigError, EngineClosedError, LayoutError, MoestreamError
from .gguf_format import GGUFFormat
from .host_tier import PinnedBufferPool
from .io_setup import IOSettings, plan_io
from .layout import ExpertLayout, discover_experts
from .memory import reset_peak_rss
from .models import family_for
from .models.base import CausalLM, check_layer_count, checkpoint_dtype, load_resident
from .models.gpt_oss import clamped_swiglu_linear_expert
from .models.kimi_linear import situ_expert
from .models.layers import Attention, KVPool, RMSNorm
from .models.linear import use_fast_linear
from .models.moe import softmax_topk, swiglu_expert
from .models.rope import RotaryEmbedding
from .options import DEFAULT_BUDGET_GB, EngineOptions
from .pipeline import BatchedSwiGLUKernel, ExpertKernel, ExpertPipeline, FusedSwiGLUKernel, NativeMoEKernel
from .policies import make_policy
from .prefix_cache import PrefixCache, prefix_cache_for, prefix_cache_supported
from .quant import model as quant
from .quant import native
from .quant.expert import QuantizedGLU, QuantizedSwiGLU
from .quant.resident import dense_extra_bytes, dequantize_resident
from .quant.turboquant import set_fast
from .sources import open_checkpoint
from .store import ExpertStore
from .tiered_cache import TieredExpertCache, device_free_bytes, resolve_device
from .tokenizer import load_tokenizer
from .usage import setup_cache_policy

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def progress_bar(total: int, desc: str, enabled: bool | None = None, log_lines: bool = False):
    """A tqdm byte-progress bar shown only on a terminal (``enabled=None``).

    With ``log_lines`` (long jobs: ``synth``, ``convert``), when stderr is not a terminal
    (a log file, a CI job, ``nohup``), progress goes to stderr as :class:`LineProgress`
    lines instead of nothing.
    """
    from tqdm.auto import tqdm

    if log_lines and enabled is None and not sys.stderr.isatty():
        return LineProgress(total, desc)
    disable = (not sys.stderr.isatty()) if enabled is None else not enabled
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=disable, leave=False)


class LineProgress:
    """Byte progress as plain lines on ``out`` (default stderr), for logs without a terminal.

    One line when the work starts, then at most one every ``interval`` seconds (done, total,
    percent, rate in MB/s, elapsed and remaining seconds), and one when it ends without an
    error. Used as tqdm is: a context manager with ``update(nbytes)``. GB = 10^9 bytes.
    """

    def __init__(self, total: int, desc: str, interval: float = 5.0, out=None, clock=time.monotonic):
        self.total, self.desc, self.interval = total, desc, interval
        self.out, self.clock = out, clock
        self.done = 0
        self.start = self.last = None

    def _print(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.out or sys.stderr, flush=True)

    def __enter__(self) -> "LineProgress":
        self.start = self.last = self.clock()
        self._print(f"{self.total / GB:.2f} GB to go")
        return self

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if now - self.last < self.interval:
            return
        self.last = now
        took = now - self.start
        rate = self.done / took if took > 0 else 0.0
        left = f", about {(self.total - self.done) / rate:.0f} s left" if rate and self.done < self.total else ""
        pct = self.done / self.total if self.total else 1.0
        self._print(f"{self.done / GB:.2f} of {self.total / GB:.2f} GB ({pct:.0%}), {rate / 1e6:.0f} MB/s, "
                    f"{took:.0f} s{left}")

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self._print(f"done, {self.done / GB:.2f} GB in {self.clock() - self.start:.0f} s")


@dataclass
class Engine:
    """A loaded streamed model.

    Attributes:
        checkpoint, layout, store, cache, model: the layers, in data-flow order.
        family: the family module; dtype: compute dtype; device: compute device.
        resident_bytes: bytes of weights held in memory besides the expert cache.
        load_seconds: wall time of :func:`load` (tokenizer included).
        tokenizer: a transformers tokenizer, or None when loaded without one.
        unused_tensors: checkpoint tensors the model does not use (reported once).
        threads: PyTorch's intra-op thread count when loaded; every forward pass computes
            with it (:meth:`hold_threads`).
    """

    checkpoint: Checkpoint
    layout: ExpertLayout
    store: ExpertStore
    cache: ExpertCache
    model: CausalLM
    family: ModuleType
    dtype: torch.dtype
    device: torch.device
    resident_bytes: int
    load_seconds: float = 0.0
    tokenizer: object = None
    unused_tensors: list[str] = field(default_factory=list)
    io: IOSettings | None = None  # the read path, prefetch, wiring and auto budget in use
    usage: object = None  # moestream.usage.UsageState: the usage profile to save, the trace to close
    parallel: object = None  # moestream.parallel.ExpertParallel under torchrun (this rank's experts only)
    pipeline: object = None  # moestream.pipeline.ExpertPipeline: every MoE layer's expert work
    options: EngineOptions | None = None  # the options it was loaded with
    budget: BudgetPlan | None = None  # the cache budget as sized (auto's numbers, the reserve, the host tier)
    closed: bool = False  # close() was called: generating raises EngineClosedError
    prefix_cache: PrefixCache | None = None  # KV blocks of computed prefixes (--prefix-cache-gb; CPU, plain KV)

    def __enter__(self) -> "Engine":
        """``with moestream.load(...) as engine:`` closes the engine when the block ends."""
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_open(self) -> None:
        """Raises EngineClosedError once :meth:`close` was called (every expert may be resident
        still, but the usage profile, the trace and the reader threads are gone)."""
        if self.closed:
            raise EngineClosedError(f"the engine of {self.checkpoint.path} is closed (close() was called, or its "
                                    "with block ended): load the model again")
    threads: int = 0  # 0: not held (an Engine built by hand)
    _threads_noted: bool = field(default=False, repr=False)

    def hold_threads(self) -> None:
        """Make the calling thread compute with :attr:`threads`, the intra-op count found at load.

        PyTorch's CPU kernels give other bits with another thread count (MKL's float32 matmul of
        5 to 11 rows, attention over the KV cache: ``docs/reliability.md``, "Exactness under
        timing"), and the count belongs to each thread: ``torch.set_num_threads`` after load
        changes it, and a fresh thread (the server's) runs its first matmuls with MKL's default
        until PyTorch sets the thread up, which ``torch.get_num_threads`` does. Called before
        every forward pass; says once on stderr when it had to set the count back.
        """
        if not self.threads or torch.get_num_threads() == self.threads:
            return
        if not self._threads_noted:
            self._threads_noted = True
            print(f"moestream: note: PyTorch's intra-op thread count is {torch.get_num_threads()} here, "
                  f"{self.threads} when the model was loaded; computing with {self.threads} "
                  "(another count gives other bits)", file=sys.stderr, flush=True)
        torch.set_num_threads(self.threads)

    def close(self) -> None:
        """Save the usage profile (when learning), close the trace, stop prefetch and reader threads, close shards.

        A second call does nothing.
        """
        if self.closed:
            return
        self.closed = True
        try:
            if self.parallel is not None and self.usage is not None:
                _merge_rank_usage(self)
            if self.usage is not None:
                self.usage.close(self.cache)
        finally:
            if self.io is not None and self.io.prefetcher is not None:
                self.io.prefetcher.close()
            runner = getattr(self.model, "decode_runner", None)
            if runner is not None:
                runner.close()
            self.cache.close()
            self.store.close()
            self.checkpoint.close()


def _check_layout(model: CausalLM, layout: ExpertLayout, where, quantized: dict | None = None) -> dict[int, int]:
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


def load(model: str | os.PathLike, cache_budget_gb: str | float | None = DEFAULT_BUDGET_GB, *,
         options: EngineOptions | None = None, tokenizer: bool | str | os.PathLike = True,
         progress: bool | None = None,
         parallel=None, **engine_options) -> Engine:
    """Open a checkpoint and make it ready to generate.

    Args:
        model: a checkpoint folder or a Hugging Face Hub id.
        cache_budget_gb: expert cache budget in GB (10^9 bytes), ``"all"`` / None to keep
            every expert resident (preloaded here), or ``"auto"`` to size it from the memory
            available (cgroup limits included) less resident weights, the KV cache and a
            reserve (:func:`moestream.budget.plan_cpu_budget`; the numbers are in
            ``engine.budget.auto``). On CUDA it is the VRAM expert cache.
        options: an :class:`~moestream.options.EngineOptions` (the CLI's and the server's way
            in); or give its fields as keywords (``workers=2``, ``prefetch_ahead=1``,
            ``host_cache_gb="auto"``, ...; see :meth:`EngineOptions.make`), not both.
        tokenizer: also load the checkpoint's tokenizer (before the weights, so a missing
            one fails fast); a path: load that tokenizer folder's instead (a GGUF file's
            default is the one transformers builds from its metadata).
        progress: show progress bars (None: only on a terminal).
        parallel: a :class:`moestream.parallel.ExpertParallel` (torchrun): this process owns a
            share of each layer's experts (placed by rank 0, balanced from the usage profile
            when one exists); the budget, preloads, pins and read-ahead cover owned experts
            only; ``auto`` takes this rank's share of the machine's memory; the device is the
            rank's (``cuda:LOCAL_RANK`` or the CPU). Only rank 0 writes the trace and saves the
            usage profile (the ranks' counts summed at close).

    On CUDA the resident weights and the KV cache live on the GPU, expert reads land in
    pinned host buffers and go to the GPU on a side stream
    (:class:`~moestream.tiered_cache.TieredExpertCache`), and each layer's experts are one
    batched matmul chain. None of the options but ``max_active_experts``, ``fast`` and
    ``dtype`` changes the output. Pins take at most the budget (pin file) or half of it (hot
    list and usage profile, after the pin file); a bad profile, hot list or pin file is ignored
    with a warning naming it (:mod:`moestream.usage`).

    A family that leaves checkpoint parts out on purpose (a vision tower, an MTP layer)
    names them in one note on stderr (its ``describe_skipped``); they are not listed in
    ``Engine.unused_tensors``.

    Raises:
        CheckpointError, ConfigError, LayoutError: naming the file, field or tensor at fault.
        BudgetError: when resident weights plus the cache budget (or every expert, for
            ``all``) exceed the memory available to this process (cgroup limits
            included), checked before any weight is read, with the numbers.
        TypeError: an unknown keyword, or both ``options`` and option keywords.
    """
    if options is None:
        options = EngineOptions.make(cache_budget_gb, **engine_options)
    elif engine_options or cache_budget_gb != DEFAULT_BUDGET_GB:
        raise TypeError("give load() either options= or option keywords, not both")
    t0 = time.perf_counter()
    reset_peak_rss()
    native.selected()  # a bad MOESTREAM_CPU_KERNELS is named before anything is read (KernelChoiceError)
    ckpt = open_checkpoint(resolve_model(model))  # an mlx-lm build's names mapped onto Hugging Face ones
    store = None
    try:
        opened = _open(ckpt, options)
        dev = opened.device if parallel is None else parallel.device
        tiered = dev.type == "cuda" or options.host_cache is not None or bool(options.fused_experts)
        _check_device(ckpt, opened, dev, tiered, options)
        # on CUDA with the fused kernel --prefetch-ahead stages host-tier experts beside compute inside the decode
        # graphs (the pipeline's lookahead); the disk read-ahead would need the host inside every step
        disk_ahead = 0 if dev.type == "cuda" and _use_fused(opened.net, options, dev, tiered, parallel, {}) else \
            options.prefetch_ahead
        io = plan_io(ckpt, options.workers, options.use_page_cache, disk_ahead, options.wire_memory,
                     chunk_reads=not tiered)
        # tiered: the store reads into (pinned) host buffers; the cache copies them to the device
        store = ExpertStore(ckpt, opened.layout, opened.dtype, "cpu" if tiered else dev, options.workers,
                            reader=io.reader)
        if dev.type == "cuda":
            store.pool = PinnedBufferPool(max_free=2 * options.workers)
        net = opened.net
        quant_fns = quant.attach(net, opened.formats, opened.dtype)  # layer -> expert function on stored pieces
        if options.fast:
            n = set_fast(net, True)
            print(f"note: --fast: the QJL residual correction of {n} linears is off; this changes the output"
                  if n else "note: --fast has no effect: this checkpoint stores no QJL residuals", file=sys.stderr)
        keys = [(i, e) for i, lay in opened.layout.layers.items() for e in range(lay.num_experts)]
        if parallel is not None:  # this rank's experts only; rank 0 places them
            parallel.place(ckpt, net, opened.num_experts, options.usage_file, options.learn_experts)
            keys = [key for key in keys if parallel.owns(key)]
        fused = _use_fused(net, options, dev, tiered, parallel, quant_fns)
        if tiered:  # quantized experts the GPU tier cannot compute: refused before any weight is read
            _check_quantized_tier(ckpt, opened, quant_fns, fused, True)
        plan = _plan_budget(net, store, keys, opened.dtype, dev, tiered, io, options, parallel)
        tok = None
        if tokenizer:
            tok = load_tokenizer(ckpt.path if tokenizer is True else tokenizer)
        unused = _load_resident(ckpt, opened, progress, io)
        if dev.type == "cuda" and opened.quantized_resident:
            dequantize_resident(net, opened.dtype)  # stored-form GEMVs on the GPU: not yet (docs/gpu.md)
        net.to(dev).eval()
        use_fast_linear(net)  # wide bf16 matmuls in float32 on CPUs without native bf16 (models/linear.py)
        policy = make_policy(options.cache_policy, half_life=sum(opened.num_experts.values()))
        if tiered:
            cache = TieredExpertCache(store, plan.budget, opened.num_experts, policy=policy, device=dev,
                                      host_budget_bytes=plan.host, slots=fused)
            _check_quantized_tier(ckpt, opened, quant_fns, fused, cache.pool is not None)
            fused = fused and cache.pool is not None  # experts of more than one layout: no slot pool
        else:
            cache = ExpertCache(store, plan.budget, opened.num_experts, policy=policy)
        owns = None if parallel is None else parallel.owns
        io.start(ckpt, net, store, cache, owns=owns)
        if plan.budget is None:
            need = sum(store.cached_nbytes(k) for k in keys)
            with progress_bar(need, "preloading every expert", progress) as bar:
                cache.preload(keys, bar.update)
        # every rank routes the same tokens: rank 0's trace is the whole trace
        trace = options.trace if parallel is None or parallel.rank == 0 else None
        usage_state = setup_cache_policy(ckpt, net, cache, opened.num_experts, options, trace=trace, owns=owns)
        batched = dev.type == "cuda" if options.batched_experts is None else options.batched_experts
        kernels = expert_kernels(net, quant_fns, batched, fused, cpu=dev.type == "cpu")
        lookahead = options.prefetch_ahead if fused else 0
        pipeline = ExpertPipeline(cache, kernels, options.max_active_experts, io.prefetcher, parallel,
                                  usage_state.trace, lookahead=lookahead, blocks=net.moe_blocks())
        for block in net.moe_blocks():
            block.attach(pipeline)
        _attach_decode_runner(net, pipeline, cache, kernels, options, dev, io, usage_state.trace, lookahead)
        if fused:  # the norms in one launch each, as the fused experts (fewer kernels per decode step)
            _fuse_norms(net)
        if options.prefix_cache and (why := prefix_cache_supported(net, dev)) is not None:
            print(f"moestream: note: --prefix-cache-gb is off: {why}", file=sys.stderr)
        return Engine(
            checkpoint=ckpt, layout=opened.layout, store=store, cache=cache, model=net, family=opened.family,
            dtype=opened.dtype, device=dev, resident_bytes=resident_bytes(net),
            load_seconds=time.perf_counter() - t0, tokenizer=tok, unused_tensors=unused, io=io, usage=usage_state,
            parallel=parallel, pipeline=pipeline, options=options, budget=plan, threads=torch.get_num_threads(),
            prefix_cache=None if parallel is not None else prefix_cache_for(net, dev, options.prefix_cache),
        )
    except BaseException:
        if store is not None:
            store.close()
        ckpt.close()
        raise


@dataclass
class _Opened:
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


def _open(ckpt: Checkpoint, options: EngineOptions) -> _Opened:
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
    _check_activations(ckpt, options)
    fallback: list = []  # (tensor, type) that q8 mode leaves with float activations
    formats = quant.expert_formats(ckpt, layout, net.expert_shape(), ckpt.path, options.activations,
                                   fallback)  # quantized experts
    quantized_resident = quant.quantize_model(net, ckpt, ckpt.path, options.activations,
                                              fallback)  # quantized resident linears, on meta
    if fallback:
        kinds = sorted({t for _, t in fallback})
        print(f"note: --activations q8 covers {', '.join(quant.Q8_ACTIVATION_TYPES)}; {len(fallback)} tensors of "
              f"type {', '.join(kinds)} keep float activations ({fallback[0][0]}, ...)", file=sys.stderr)
    if options.dtype == "auto":
        dtype = quant.float_dtype(ckpt, net.embed_name, checkpoint_dtype(ckpt, net.embed_name))
    else:
        dtype = _DTYPES[options.dtype]
    if getattr(net, "unloaded_layers_from", None) is not None:
        layout = _drop_layers_from(layout, net.unloaded_layers_from)
    num_experts = _check_layout(net, layout, ckpt.path, formats)
    return _Opened(family, net, layout, formats, quantized_resident, num_experts, dtype,
                   resolve_device(options.device))


def _check_activations(ckpt: Checkpoint, options: EngineOptions) -> None:
    """Refuse ``--activations q8`` where it cannot apply: a checkpoint that is no GGUF file (q8 mode is llama.cpp's
    numerics on ggml block types), another device than the CPU, or the PyTorch kernel path (q8 mode runs on the
    compiled kernels only).

    Raises:
        ConfigError: naming the flag and why.
    """
    if options.activations == "float":
        return
    if not isinstance(ckpt.source_format, GGUFFormat):
        raise ConfigError(f"--activations q8 is llama.cpp's numerics for GGUF files; {ckpt.path} is not one "
                          "(its quantized linears compute with float activations: use --activations float)")
    if resolve_device(options.device).type != "cpu":
        raise ConfigError("--activations q8 runs on the CPU's compiled kernels; use --device cpu")
    if native.selected() == "torch" or native.library() is None:
        why = "MOESTREAM_CPU_KERNELS=torch" if native.selected() == "torch" else "the CPU kernels are not built"
        raise ConfigError(f"--activations q8 runs on the CPU's compiled kernels, which are off here ({why})")


def _check_device(ckpt: Checkpoint, opened: _Opened, dev: torch.device, tiered: bool,
                  options: EngineOptions) -> None:
    """Refuse what the GPU tier does not do yet, and set what CUDA needs for exact bits."""
    if tiered and options.wire_memory:
        raise ConfigError("--wire-memory applies to the CPU expert cache; with --device cuda use --host-cache-gb")
    if dev.type == "cuda":
        # cuDNN's attention kernels gave different bits from run to run for the same inputs on an H200
        # (torch 2.11, measured by benchmarks/gpu_tiers.py); flash / memory-efficient attention did not
        torch.backends.cuda.enable_cudnn_sdp(False)


def _plan_budget(net: CausalLM, store: ExpertStore, keys: list, dtype: torch.dtype, dev: torch.device,
                 tiered: bool, io: IOSettings, options: EngineOptions, parallel) -> BudgetPlan:
    """The cache budget (and host tier) of this model's experts ``keys``, refused before any weight is read
    when it cannot fit (:mod:`moestream.budget`)."""
    sizes = [store.cached_nbytes(k) for k in keys]
    experts, one = sum(sizes), max(sizes, default=0)
    share = 1 if parallel is None else parallel.local_world
    if dev.type == "cuda":  # quantized resident linears are dequantized at load there (_load_resident)
        plan = plan_device_budget(net, options.cache_budget, dtype, experts, one, device_free_bytes(dev), dev,
                                  options.context_tokens, extra_resident=dense_extra_bytes(net, dtype),
                                  sequences=options.max_batch)
    else:
        plan = plan_cpu_budget(net, options.cache_budget, dtype, experts, one, options.workers, io.use_page_cache,
                               options.prefetch_ahead, options.context_tokens, share, store.read_buffers(keys),
                               options.wire_memory, chunk_window=io.chunk_window, sequences=options.max_batch,
                               prefix_cache=options.prefix_cache if prefix_cache_supported(net, dev) is None else 0)
    if tiered:
        plan.host = plan_host_budget(options.host_cache, experts, one, options.workers, share)
    return plan


def _load_resident(ckpt: Checkpoint, opened: _Opened, progress, io: IOSettings) -> list[str]:
    """Read the resident weights into the model; the checkpoint tensors it does not use (reported once).
    (Their page cache is dropped as they load when expert reads bypass it: ``io.resident_progress``.)"""
    net, layout = opened.net, opened.layout
    total = sum(ckpt.tensors[n].nbytes for n, _ in net.named_parameters() if n in ckpt.tensors)
    with progress_bar(total, "loading resident weights", progress) as bar:
        skip = layout.expert_tensors | quant.padding_tensors(ckpt.tensors)  # padding: see quant.convert
        unused = load_resident(net, ckpt, skip, opened.dtype, io.resident_progress(ckpt, bar.update))
    describe = getattr(opened.family, "describe_skipped", None)  # parts a family leaves out on purpose
    if describe is not None:
        note, unused = describe(unused)
        if note:
            print(f"note: {note}", file=sys.stderr)
    return unused


def expert_kernels(net: CausalLM, quant_fns: dict, batched: bool, fused: bool = False, cpu: bool = False) -> dict:
    """layer -> the expert kernel of each MoE block, chosen once: the quantized layers' functions on
    their stored pieces (``quant_fns``), or where ``fused`` and the layer's experts are SwiGLU the fused
    kernel on the stored pieces; for the plain SwiGLU expert the fused Triton kernel from VRAM
    slots where ``fused`` (also on the CPU, where ``fused_experts=True`` asks for it under Triton's
    interpreter), else the CPU's compiled layer kernel (``cpu``), else the batched SwiGLU chain where
    ``batched``; else the family's own expert function."""
    out = {}
    for block in net.moe_blocks():
        fn = quant_fns.get(block.layer)
        if fn is not None and fused and isinstance(fn, QuantizedSwiGLU):
            out[block.layer] = FusedSwiGLUKernel(fn.fmt)
        elif cpu and not batched and not (fused and block.expert_fn is swiglu_expert) \
                and native_kernel(block.expert_fn if fn is None else fn) is not None:
            out[block.layer] = native_kernel(block.expert_fn if fn is None else fn)
        elif fn is not None:
            out[block.layer] = ExpertKernel(fn)
        elif fused and block.expert_fn is swiglu_expert:
            out[block.layer] = FusedSwiGLUKernel()
        elif batched and block.expert_fn is swiglu_expert:
            out[block.layer] = BatchedSwiGLUKernel()
        else:
            out[block.layer] = ExpertKernel(block.expert_fn)
    return out


def native_kernel(fn) -> NativeMoEKernel | None:
    """The CPU kernel computing a layer's experts several per call for expert function ``fn`` (the plain
    SwiGLU expert, or its quantized form :class:`QuantizedSwiGLU` / :class:`QuantizedGLU`; Kimi's SiTU and
    gpt-oss's clamped SwiGLU as float experts), or None (another function, or no compiled kernels: the
    per-expert :class:`ExpertKernel` then). Chosen from the function alone, so every budget gets the same."""
    if native.selected() == "torch":
        return None
    if fn is swiglu_expert:
        return NativeMoEKernel(fn)
    if isinstance(fn, QuantizedSwiGLU):
        return NativeMoEKernel(fn, fn.fmt)
    if isinstance(fn, QuantizedGLU) and fn.act == "situ":
        lb = fn.params.get("linear_beta")
        return NativeMoEKernel(fn, fn.fmt, "situ", (fn.params.get("beta", 1.0), float("nan") if lb is None else lb))
    if isinstance(fn, functools.partial) and not fn.args:
        if fn.func is situ_expert:
            lb = fn.keywords.get("linear_beta")
            return NativeMoEKernel(fn, None, "situ", (fn.keywords["beta"], float("nan") if lb is None else lb))
        if fn.func is clamped_swiglu_linear_expert:
            return NativeMoEKernel(fn, None, "clamped", (fn.keywords["alpha"], fn.keywords["limit"]))
    return None


def _use_fused(net: CausalLM, options: EngineOptions, dev: torch.device, tiered: bool, parallel,
               quant_fns: dict) -> bool:
    """Whether the SwiGLU experts run on the fused Triton kernel from a VRAM slot pool: on CUDA when Triton is
    there (``fused_experts`` None), never under expert parallelism (its slot exchange needs the batched
    chain's shapes); quantized experts only as SwiGLU experts in a format it reads
    (:func:`moestream.quant.model.gpu_unsupported`).

    Raises:
        ConfigError: ``fused_experts=True`` where the kernel cannot run.
    """
    want = options.fused_experts
    if want is False:
        return False
    can = fused_moe.available(dev) and tiered and parallel is None and quant.gpu_unsupported(quant_fns) is None and any(
        b.expert_fn is swiglu_expert for b in net.moe_blocks())
    if want is None:  # by default on CUDA only: the CPU path keeps its per-expert kernels
        return can and dev.type == "cuda"
    if not can:
        raise ConfigError("fused_experts: the fused MoE kernel needs Triton on a CUDA device (or TRITON_INTERPRET=1), "
                          "the GPU tier (--device cuda or a host tier), SwiGLU experts in bf16/fp16/fp32 or as MLX "
                          "affine, fp8 or MXFP4, and no expert parallelism")
    return can


def _check_quantized_tier(ckpt: Checkpoint, opened: _Opened, quant_fns: dict, fused: bool, pooled: bool) -> None:
    # fused: the engine chose the fused kernel; pooled: the cache could lay every expert out in one slot pool
    """Quantized experts on the GPU tier are computed only by the fused kernel, from the stored bytes in VRAM
    slots (no dequantized copy of an expert in VRAM); refuse, naming why, where it cannot run.

    Raises:
        ConfigError: naming the checkpoint and the reason.
    """
    if not opened.formats or (fused and pooled):
        return
    why = quant.gpu_unsupported(quant_fns)
    if why is None and fused_moe.triton is None:
        why = "the fused kernel needs Triton, which this PyTorch lacks"
    elif why is None and fused:
        why = "its MoE layers store experts in more than one layout (one slot pool holds one)"
    elif why is None:
        why = ("the fused kernel is not in use (it runs by default with --device cuda; fused_experts=False and "
               "expert parallelism turn it off)")
    raise ConfigError(f"{ckpt.path}: quantized experts on the GPU tier: {why}; use --device cpu")


class GpuRouter:
    """A router of :func:`moestream.models.moe.softmax_topk` (a ``functools.partial`` of it) that computes on
    CUDA with :func:`moestream.fused_moe.softmax_topk` (one launch), elsewhere as before."""

    def __init__(self, router: functools.partial):
        self.router = router

    def __call__(self, logits: torch.Tensor):
        if logits.is_cuda:
            return fused_moe.softmax_topk(logits, **self.router.keywords)
        return self.router(logits)


def _fuse_norms(net: CausalLM) -> None:
    """The small ops of the token path in one GPU launch each (fewer kernels per decode step; each applies
    on CUDA only): every plain :class:`~moestream.models.layers.RMSNorm` of ``net`` computes with
    :func:`moestream.fused_moe.rms_norm` (subclasses, such as norms of ``1 + w``, keep theirs); plain
    attention layers' q/k norms and rotary with :func:`moestream.attention_kernel.qk_norm_rope` (the plain
    rope over the whole head); softmax top-k routers with :func:`moestream.fused_moe.softmax_topk`."""
    plain_rope = type(net.rotary) is RotaryEmbedding
    for m in net.modules():
        if type(m) is RMSNorm:
            m.fused = fused_moe.rms_norm
        elif (type(m) is Attention and plain_rope and net.rotary.inv_freq.numel() * 2 == m.head_dim
              and (m.q_norm is None or (type(m.q_norm) is RMSNorm and type(m.k_norm) is RMSNorm))):
            m.fused_rope = attention_kernel.qk_norm_rope
    for block in net.moe_blocks():
        r = block.router
        if isinstance(r, functools.partial) and r.func is softmax_topk and not r.args:
            block.router = GpuRouter(r)


def _attach_decode_runner(net: CausalLM, pipeline: ExpertPipeline, cache, kernels: dict, options: EngineOptions,
                          dev: torch.device, io: IOSettings, trace, lookahead: int) -> None:
    """Decode steps through static buffers (CUDA graphs on the GPU) when every MoE layer runs the fused
    kernel and the family is plain (:func:`moestream.decode_graph.graph_unsupported`). Graphs stay off
    while the host must act inside a step: a disk prefetcher or a routing trace (the lookahead's host-tier
    copies are staged between the graph segments). With graphs, the KV storage is kept for the engine's life
    (:class:`~moestream.models.layers.KVPool`): every request replays the graphs captured for the first."""
    if not kernels or not all(getattr(k, "slotted", False) for k in kernels.values()):
        return
    if graph_unsupported(net) is not None:
        return
    # the lookahead's copies are staged between the graph segments (DecodeRunner._replay): graphs stay on
    graphs = options.cuda_graphs and dev.type == "cuda" and io.prefetcher is None and trace is None
    net.decode_runner = DecodeRunner(net, pipeline, cache, graphs)
    if net.decode_runner.graphs:  # every request's KV cache on the same kept tensors: graphs captured once
        # a set per sequence the scheduler may run (the budget plan counts them), two at least (a request's
        # cache may outlive it while the next one starts)
        net.kv_pool = KVPool(context_tokens_for(net, options.context_tokens), sets=max(2, options.max_batch))


def _drop_layers_from(layout: ExpertLayout, first: int) -> ExpertLayout:
    """The layout without layers ``first`` and beyond (DeepSeek's multi-token-prediction layers, which the
    model does not run); their tensors are then reported as unused."""
    keep = {i: lay for i, lay in layout.layers.items() if i < first}
    dropped = {p.source for i, lay in layout.layers.items() if i >= first for ex in lay.experts for p in ex}
    return ExpertLayout(keep, layout.expert_tensors - dropped)


def _merge_rank_usage(engine: Engine) -> None:
    """Expert parallelism: sum the ranks' routing counts (each counts its own experts) so that rank 0
    saves the whole model's usage profile; the other ranks save none. Skipped after a failed
    collective or when closing on an error (the other ranks may be elsewhere, or dead)."""
    par = engine.parallel
    if par.failed or sys.exc_info()[0] is not None:  # closing on an error: the other ranks may not be here
        engine.usage.profile_path = None
        return
    try:
        par.merge_usage(engine.cache.usage)
    except MoestreamError as e:
        print(f"moestream: warning: the usage profile is not saved: {e}", file=sys.stderr)
        engine.usage.profile_path = None
    if par.rank != 0:
        engine.usage.profile_path = None
