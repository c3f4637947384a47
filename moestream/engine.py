"""Loading: a checkpoint becomes a ready model with resident weights, an expert store and
an expert cache (and, when asked, its tokenizer).

``load()`` ties the layers together in their one-way order: checkpoint -> expert layout
-> expert store -> expert cache -> family model.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType

import torch

from . import quant
from .cache import ExpertCache, parse_budget
from .checkpoint import Checkpoint, resolve_model
from .errors import BudgetError, ConfigError, LayoutError, MoestreamError
from .io_setup import IOSettings, is_auto, plan_io
from .layout import ExpertLayout, discover_experts
from .memory import available_bytes, reset_peak_rss
from .models import family_for
from .models.base import CausalLM, checkpoint_dtype, load_resident, resident_nbytes
from .models.linear import use_fast_linear
from .policies import POLICIES, make_policy
from .store import ExpertStore

GB = 1e9
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def progress_bar(total: int, desc: str, enabled: bool | None = None):
    """A tqdm byte-progress bar shown only on a terminal (``enabled=None``)."""
    from tqdm.auto import tqdm

    disable = (not sys.stderr.isatty()) if enabled is None else not enabled
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=disable, leave=False)


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

    def close(self) -> None:
        """Save the usage profile (when learning), close the trace, stop prefetch and reader threads, close shards."""
        try:
            if self.parallel is not None and self.usage is not None:
                _merge_rank_usage(self)
            if self.usage is not None:
                self.usage.close(self.cache)
        finally:
            if self.io is not None and self.io.prefetcher is not None:
                self.io.prefetcher.close()
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
        want = blocks[i].gate.weight.shape[0]
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


def load(
    model: str | os.PathLike,
    cache_budget_gb: str | float | None = 3,
    workers: int = 8,
    device: str = "auto",
    dtype: str = "auto",
    tokenizer: bool = True,
    progress: bool | None = None,
    use_page_cache: bool | None = None,
    prefetch_ahead: int = 0,
    wire_memory: bool = False,
    context_tokens: int | None = None,
    max_active_experts: int = 0,
    hotlist: bool = True,
    pin_file: str | os.PathLike | None = None,
    usage_file: str | os.PathLike | None = None,
    learn_experts: bool = True,
    trace: str | os.PathLike | None = None,
    cache_policy: str = "lru",
    hot_fraction: float | None = None,
    fast: bool = False,
    host_cache_gb: str | float | None = None,
    parallel=None,
) -> Engine:
    """Open a checkpoint and make it ready to generate.

    Args:
        model: a checkpoint folder or a Hugging Face Hub id.
        cache_budget_gb: expert cache budget in GB (10^9 bytes), or ``"all"`` / None to
            keep every expert resident (preloaded here).
        workers: reader threads for expert reads.
        device: compute device: ``"auto"`` (CUDA when available, else the CPU), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``. On CUDA the resident weights and the KV cache live on
            the GPU, ``cache_budget_gb`` is the VRAM expert cache
            (:class:`~moestream.tiered_cache.TieredExpertCache`), expert reads land in pinned
            host buffers and go to the GPU on a side stream, and each layer's experts are one
            batched matmul chain; ``auto`` sizes the budget from the free VRAM.
        dtype: compute dtype (``"auto"``: the checkpoint's embedding dtype; or bf16, fp16,
            fp32). Another dtype than the checkpoint's changes the output.
        tokenizer: also load the checkpoint's tokenizer (before the weights, so a missing
            one fails fast).
        progress: show progress bars (None: only on a terminal).
        use_page_cache: read experts through the OS page cache (True), or bypass it with
            ``O_DIRECT`` into huge-page buffers (False; ``posix_fadvise(DONTNEED)`` after
            each read where ``O_DIRECT`` is refused); None: only when the checkpoint is
            under 0.6 of the memory available.
        prefetch_ahead: while layer L computes, read the experts layers L+1..L+N will
            likely need (0: off); see :mod:`moestream.prefetch`.
        wire_memory: lock the resident weights and the cached experts in RAM (mlock).
        context_tokens: tokens of context the KV cache must hold, for the ``auto``
            budget (default 4096, or the model's context if smaller).

        ``cache_budget_gb="auto"`` sizes the cache from the memory available (cgroup
        limits included) less resident weights, the KV cache and a runtime reserve
        (:meth:`moestream.io_setup.IOSettings.size_budget`; the numbers are in ``engine.io.auto``).
        max_active_experts: keep at most this many routed experts per token, the
            highest-weight ones, renormalized as the family does (0: the model's own
            routing). Below the model's top-k this changes the output (a warning says so).
        hotlist: preload and pin the experts of ``hot_experts.json`` in the model folder.
        pin_file: a ``{"pin": [[layer, expert], ...]}`` file of experts to preload and pin.
        usage_file: the usage profile to read and update (default: one per model in the
            user cache folder, :func:`moestream.usage.default_profile_path`).
        learn_experts: count which experts the traffic uses, save the profile on
            :meth:`Engine.close`, and (with ``hot_fraction``) pin the hottest ones from it at start.
        hot_fraction: share of the budget the hot list and the usage profile may pin
            (default :data:`moestream.usage.HOT_FRACTION`, 0: off, as measured on routing like
            trained models').
        trace: write the routing trace (JSON lines) to this file.
        cache_policy: eviction policy, ``lru`` (default), ``lfu`` or ``layer``
            (:mod:`moestream.policies`).
        fast: skip the QJL residual correction of turboquant linears (``--fast``; changes the
            output, with a note; :mod:`moestream.quant.turboquant`).
        host_cache_gb: the host-RAM tier behind the VRAM cache, in GB or ``"auto"`` (None:
            none); experts kept there in pinned memory cost a copy instead of a read. On the
            CPU it runs the same tier logic with a CPU "device" tier (for tests); the output
            is unchanged either way.
        parallel: a :class:`moestream.parallel.ExpertParallel` (torchrun): this process owns a
            share of each layer's experts (placed by rank 0, balanced from the usage profile
            when one exists); the budget, preloads, pins and read-ahead cover owned experts
            only; ``auto`` takes this rank's share of the machine's memory; ``device`` is the
            rank's (``cuda:LOCAL_RANK`` or the CPU). Only rank 0 writes the trace and saves the
            usage profile (the ranks' counts summed at close).
        None of these but ``max_active_experts`` and ``fast`` changes the output. Pins take at most the
        budget (pin file) or half of it (hot list and usage profile, after the pin file);
        a bad profile, hot list or pin file is ignored with a warning naming it
        (:mod:`moestream.usage`).

    A family that leaves checkpoint parts out on purpose (a vision tower, an MTP layer)
    names them in one note on stderr (its ``describe_skipped``); they are not listed in
    ``Engine.unused_tensors``.

    Raises:
        CheckpointError, ConfigError, LayoutError: naming the file, field or tensor at fault.
        BudgetError: when resident weights plus the cache budget (or every expert, for
            ``all``) exceed the memory available to this process (cgroup limits
            included), checked before any weight is read, with the numbers.
    """
    t0 = time.perf_counter()
    reset_peak_rss()
    auto = is_auto(cache_budget_gb)
    budget = None if auto else parse_budget(cache_budget_gb)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if prefetch_ahead < 0:
        raise ValueError(f"prefetch_ahead must be at least 0, got {prefetch_ahead}")
    if hot_fraction is not None and not 0 <= hot_fraction <= 1:
        raise ValueError(f"hot_fraction must be between 0 and 1, got {hot_fraction}")
    if cache_policy not in POLICIES:
        raise ConfigError(f"cache policy {cache_policy!r}: expected one of {', '.join(POLICIES)}")
    if not isinstance(max_active_experts, int) or max_active_experts < 0:
        raise ConfigError(f"max_active_experts must be an integer >= 0, got {max_active_experts!r}")
    ckpt = Checkpoint(resolve_model(model))
    store = None
    try:
        cfg_path = ckpt.path / "config.json"
        family = family_for(ckpt.config, str(cfg_path))
        try:
            args = family.ModelArgs.from_config(ckpt.config)
        except ConfigError as e:
            raise ConfigError(f"{cfg_path}: {e}") from None
        layout = discover_experts(ckpt.tensors)
        with torch.device("meta"):
            net = family.Model(args)
        if ckpt.source_format is not None:  # an MLX build whose layout the family must follow (gpt-oss experts)
            ckpt.source_format.adapt_model(net)
        formats = quant.expert_formats(ckpt, layout, net.expert_shape(), ckpt.path)  # quantized experts
        quantized_resident = quant.quantize_model(net, ckpt, ckpt.path)  # quantized resident linears, on meta
        if dtype == "auto":
            compute_dtype = quant.float_dtype(ckpt, net.embed_name, checkpoint_dtype(ckpt, net.embed_name))
        elif dtype in _DTYPES:
            compute_dtype = _DTYPES[dtype]
        else:
            raise ConfigError(f"dtype {dtype!r}: expected auto, bf16, fp16 or fp32")
        from .tiered_cache import PinnedBufferPool, TieredExpertCache, parse_host_budget, resolve_device

        dev = resolve_device(device) if parallel is None else parallel.device
        tiered = dev.type == "cuda" or host_cache_gb is not None
        if tiered and (formats or quantized_resident):
            raise ConfigError(f"{ckpt.path}: quantized weights are not supported on the GPU tier yet; use --device cpu")
        if tiered and wire_memory:
            raise ConfigError("--wire-memory applies to the CPU expert cache; with --device cuda use --host-cache-gb")
        if dev.type == "cuda":
            # cuDNN's attention kernels gave different bits from run to run for the same inputs on an H200
            # (torch 2.11, measured by benchmarks/gpu_tiers.py); flash / memory-efficient attention did not
            torch.backends.cuda.enable_cudnn_sdp(False)
        if getattr(net, "unloaded_layers_from", None) is not None:
            layout = _drop_layers_from(layout, net.unloaded_layers_from)
        num_experts = _check_layout(net, layout, ckpt.path, formats)
        io = plan_io(ckpt, workers, use_page_cache, prefetch_ahead, wire_memory)
        # tiered: the store reads into (pinned) host buffers; the cache copies them to the device
        store = ExpertStore(ckpt, layout, compute_dtype, "cpu" if tiered else dev, workers, reader=io.reader)
        if dev.type == "cuda":
            store.pool = PinnedBufferPool(max_free=2 * workers)
        quant.attach(net, store, formats, compute_dtype)
        if fast:
            from .quant.turboquant import set_fast

            n = set_fast(net, True)
            print(f"note: --fast: the QJL residual correction of {n} linears is off; this changes the output"
                  if n else "note: --fast has no effect: this checkpoint stores no QJL residuals", file=sys.stderr)
        keys = [(i, e) for i, lay in layout.layers.items() for e in range(lay.num_experts)]
        share = 1
        if parallel is not None:  # this rank's experts only; rank 0 places them
            parallel.place(ckpt, net, num_experts, usage_file, learn_experts)
            keys = [key for key in keys if parallel.owns(key)]
            share = parallel.local_world
            if parallel.rank != 0:
                trace = None  # every rank routes the same tokens: rank 0's trace is the whole trace
        if dev.type == "cuda":
            budget = _device_budget(net, store, keys, budget, compute_dtype, auto, dev, context_tokens)
            io.budget = budget
        else:
            budget = io.size_budget(net, store, keys, budget, compute_dtype, auto, context_tokens, share)
            _check_fit(net, store, keys, budget, compute_dtype, io.reserve_bytes, share)
        host_budget = 0
        if tiered:
            from .memory import RUNTIME_RESERVE

            experts_bytes = sum(store.cached_nbytes(k) for k in keys)
            host_budget = parse_host_budget(host_cache_gb, experts_bytes, RUNTIME_RESERVE + 2 * 2 * workers * max(
                (store.cached_nbytes(k) for k in keys), default=0))
            if host_budget and share > 1 and is_auto(host_cache_gb):
                host_budget //= share  # the ranks of this machine share its host RAM
        tok = None
        if tokenizer:
            from .tokenizer import load_tokenizer

            tok = load_tokenizer(ckpt.path)
        resident_names = [n for n, _ in net.named_parameters()]
        total = sum(ckpt.tensors[n].nbytes for n in resident_names if n in ckpt.tensors)
        with progress_bar(total, "loading resident weights", progress) as bar:
            skip = layout.expert_tensors | quant.padding_tensors(ckpt.tensors)  # padding: see quant.convert
            unused = load_resident(net, ckpt, skip, compute_dtype, bar.update)
        describe = getattr(family, "describe_skipped", None)  # parts a family leaves out on purpose
        if describe is not None:
            note, unused = describe(unused)
            if note:
                print(f"note: {note}", file=sys.stderr)
        net.to(dev).eval()
        use_fast_linear(net)  # wide bf16 matmuls in float32 on CPUs without native bf16 (models/linear.py)
        from .usage import setup_cache_policy

        policy = make_policy(cache_policy, half_life=sum(num_experts.values()))
        if tiered:
            cache = TieredExpertCache(store, budget, num_experts, policy=policy, device=dev,
                                      host_budget_bytes=host_budget)
        else:
            cache = ExpertCache(store, budget, num_experts, policy=policy)
        for block in net.moe_blocks():
            block.attach(cache)
            block.batched = dev.type == "cuda"
        io.start(ckpt, net, store, cache)
        if parallel is not None:
            parallel.attach(net, io.prefetcher)
        if budget is None:
            need = sum(store.cached_nbytes(k) for k in keys)
            with progress_bar(need, "preloading every expert", progress) as bar:
                cache.preload(keys, bar.update)
        usage_state = setup_cache_policy(
            ckpt, net, cache, num_experts, max_active_experts=max_active_experts, hotlist=hotlist,
            pin_file=pin_file, usage_file=usage_file, learn_experts=learn_experts, trace=trace,
            **({} if hot_fraction is None else {"hot_fraction": hot_fraction}),
            owns=None if parallel is None else parallel.owns,
        )
        return Engine(
            checkpoint=ckpt, layout=layout, store=store, cache=cache, model=net, family=family,
            dtype=compute_dtype, device=dev, resident_bytes=resident_nbytes(net),
            load_seconds=time.perf_counter() - t0, tokenizer=tok, unused_tensors=unused, io=io, usage=usage_state,
            parallel=parallel,
        )
    except BaseException:
        if store is not None:
            store.close()
        ckpt.close()
        raise


def _device_budget(net: CausalLM, store: ExpertStore, keys: list, budget: int | None, dtype: torch.dtype,
                   auto: bool, dev: torch.device, context_tokens: int | None) -> int | None:
    """The VRAM expert budget on a CUDA device: ``budget`` as given (refused, before any weight is
    read, when resident weights plus it exceed the free device memory), or for ``auto`` the free
    memory less resident weights, the KV cache (twice its size for ``context_tokens``, default
    4096) and a reserve (1 GB plus four layers' worth of experts for stacking and activations)."""
    from .io_setup import DEFAULT_CONTEXT_TOKENS, _kv_bytes_per_token
    from .tiered_cache import device_free_bytes

    itemsize = torch.tensor([], dtype=dtype).element_size()
    seen, resident = set(), 0
    for p in net.parameters():  # on the meta device: shapes only
        if id(p) not in seen:
            seen.add(id(p))
            resident += p.numel() * (itemsize if p.is_floating_point() else p.element_size())
    experts = sum(store.cached_nbytes(k) for k in keys)
    one = max((store.cached_nbytes(k) for k in keys), default=0)
    top_k = getattr(getattr(net, "args", None), "num_experts_per_tok", 8)
    ctx = context_tokens or min(DEFAULT_CONTEXT_TOKENS, net.max_context or DEFAULT_CONTEXT_TOKENS)
    reserve = int(1e9) + 4 * top_k * one + 2 * ctx * _kv_bytes_per_token(net, dtype)
    free = device_free_bytes(dev)
    if auto:
        left = free - resident - reserve
        if left <= 0:
            raise BudgetError(
                f"--cache-budget-gb auto: {dev} has {free / GB:.2f} GB free; resident weights ({resident / GB:.2f} GB) "
                f"and a {reserve / GB:.2f} GB reserve leave nothing for experts"
            )
        return min(left, experts)
    cached = experts if budget is None else min(budget, experts)
    if resident + cached > free:
        what = "every expert (--cache-budget-gb all)" if budget is None else f"a {budget / GB:.3g} GB cache budget"
        raise BudgetError(
            f"resident weights ({resident / GB:.2f} GB) plus {what} ({cached / GB:.2f} GB) need "
            f"{(resident + cached) / GB:.2f} GB, but {dev} has {free / GB:.2f} GB free; "
            "give a smaller --cache-budget-gb"
        )
    return budget


def _drop_layers_from(layout: ExpertLayout, first: int) -> ExpertLayout:
    """The layout without layers ``first`` and beyond (DeepSeek's multi-token-prediction layers, which the
    model does not run); their tensors are then reported as unused."""
    keep = {i: lay for i, lay in layout.layers.items() if i < first}
    dropped = {p.source for i, lay in layout.layers.items() if i >= first for ex in lay.experts for p in ex}
    return ExpertLayout(keep, layout.expert_tensors - dropped)


def _check_fit(net: CausalLM, store: ExpertStore, keys: list, budget: int | None, dtype: torch.dtype,
               reserve: int = 0, share: int = 1) -> None:
    """Refuse, before reading weights, a budget that cannot fit in the memory available.

    Counts the resident weights, the cached experts (``budget``, or every expert for
    None) and ``reserve`` bytes (the runtime, read buffers and prefetch staging the auto
    budget also sets aside, :meth:`moestream.io_setup.IOSettings.size_budget`): a budget
    that leaves no room for them is OOM-killed inside a cgroup cap during prefill.
    ``share``: processes of this machine (expert parallelism) that split its memory.

    Raises:
        BudgetError: with the numbers, in GB (10^9 bytes).
    """
    itemsize = torch.tensor([], dtype=dtype).element_size()
    seen, resident = set(), 0
    for p in net.parameters():  # on the meta device: shapes only
        if id(p) not in seen:
            seen.add(id(p))
            resident += p.numel() * (itemsize if p.is_floating_point() else p.element_size())
    experts = sum(store.cached_nbytes(k) for k in keys)
    cached = experts if budget is None else min(budget, experts)
    avail = available_bytes() // share
    if resident + cached + reserve > avail:
        what = "every expert (--cache-budget-gb all)" if budget is None else f"a {budget / GB:.3g} GB cache budget"
        raise BudgetError(
            f"resident weights ({resident / GB:.2f} GB) plus {what} ({cached / GB:.2f} GB) plus the runtime and "
            f"read buffers ({reserve / GB:.2f} GB) need {(resident + cached + reserve) / GB:.2f} GB, but only "
            f"{avail / GB:.2f} GB of memory is available to this "
            "process (cgroup limit included" + (f"; this rank's share of {share} on this machine" if share > 1 else "")
            + "); give a smaller --cache-budget-gb, or auto"
        )


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
