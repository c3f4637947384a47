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
from .budget import GB, BudgetPlan, context_tokens_for, resident_bytes
from .cache import ExpertCache
from .checkpoint import Checkpoint, resolve_model
from .decode_graph import DecodeRunner
from .errors import EngineClosedError, MoestreamError
from .host_tier import PinnedBufferPool
from .io_setup import IOSettings
from .layout import ExpertLayout
from .load_plan import LoadPlan, Opened, plan_load
from .memory import reset_peak_rss
from .models.base import CausalLM, load_resident
from .models.layers import Attention, KVPool, RMSNorm
from .models.linear import use_fast_linear
from .models.moe import softmax_topk
from .models.rope import RotaryEmbedding
from .options import DEFAULT_BUDGET_GB, EngineOptions
from .pipeline import ExpertPipeline
from .policies import make_policy
from .prefix_cache import PrefixCache, prefix_cache_for
from .quant import model as quant
from .quant import native
from .quant.resident import dequantize_resident
from .quant.turboquant import set_fast
from .sources import open_checkpoint
from .store import ExpertStore
from .tiered_cache import TieredExpertCache
from .tokenizer import load_tokenizer
from .usage import setup_cache_policy


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
    pipeline: ExpertPipeline | None = None  # every MoE layer's expert work
    options: EngineOptions | None = None  # the options it was loaded with
    budget: BudgetPlan | None = None  # the cache budget as sized (auto's numbers, the reserve, the host tier)
    closed: bool = False  # close() was called: generating raises EngineClosedError
    prefix_cache: PrefixCache | None = None  # KV blocks of computed prefixes (--prefix-cache-gb; CPU, plain KV)
    plan: LoadPlan | None = None  # what load decided (moestream.load_plan), before any weight was read

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
    with a warning naming it (:mod:`moestream.usage`); a pin file that does not exist is a ConfigError
    (raised with the options). Errors name the options by these keywords (``context_tokens=``); the CLI's
    options (:meth:`EngineOptions.from_args`) by its flags.

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
        # every decision, from headers and the config (moestream.load_plan); what it refuses is raised here
        plan = plan_load(ckpt, options, None if parallel is None else parallel.device,
                         place=None if parallel is None else functools.partial(_place, parallel, ckpt, options))
        plan.check()
        opened, dev, io, net = plan.opened, plan.device, plan.io, plan.opened.net
        if dev.type == "cuda":
            # cuDNN's attention kernels gave different bits from run to run for the same inputs on an H200
            # (torch 2.11, measured by benchmarks/gpu_tiers.py); flash / memory-efficient attention did not
            torch.backends.cuda.enable_cudnn_sdp(False)
        # tiered: the store reads into (pinned) host buffers; the cache copies them to the device
        store = ExpertStore(ckpt, opened.layout, opened.dtype, "cpu" if plan.tiered else dev, options.workers,
                            reader=io.reader)
        if dev.type == "cuda":
            store.pool = PinnedBufferPool(max_free=2 * options.workers)
        if options.fast:
            _set_fast(net)
        keys = list(plan.keys)
        budget = plan.budget
        tok = None
        if tokenizer:
            tok = load_tokenizer(ckpt.path if tokenizer is True else tokenizer)
        unused = _load_resident(ckpt, opened, progress, io)
        if dev.type == "cuda" and opened.quantized_resident:
            dequantize_resident(net, opened.dtype)  # stored-form GEMVs on the GPU: not yet (docs/gpu.md)
        net.to(dev).eval()
        use_fast_linear(net)  # wide bf16 matmuls in float32 on CPUs without native bf16 (models/linear.py)
        cache = _make_cache(store, plan, options)
        owns = None if parallel is None else parallel.owns
        io.start(ckpt, net, store, cache, owns=owns)
        if budget.budget is None:
            need = sum(store.cached_nbytes(k) for k in keys)
            with progress_bar(need, "preloading every expert", progress) as bar:
                cache.preload(keys, bar.update)
        # every rank routes the same tokens: rank 0's trace is the whole trace
        trace = options.trace if parallel is None or parallel.rank == 0 else None
        usage_state = setup_cache_policy(ckpt, net, cache, opened.num_experts, options, trace=trace, owns=owns)
        pipeline = ExpertPipeline(cache, dict(plan.kernels), options.max_active_experts, io.prefetcher, parallel,
                                  usage_state.trace, lookahead=plan.lookahead, blocks=net.moe_blocks())
        for block in net.moe_blocks():
            block.attach(pipeline)
        if plan.decode_runner:  # decode steps through static buffers (CUDA graphs on the GPU)
            _attach_decode_runner(net, pipeline, cache, plan, options)
        if plan.fused:  # the norms in one launch each, as the fused experts (fewer kernels per decode step)
            _fuse_norms(net)
        if plan.prefix_cache_why is not None:
            print(f"moestream: note: --prefix-cache-gb is off: {plan.prefix_cache_why}", file=sys.stderr)
        return Engine(
            checkpoint=ckpt, layout=opened.layout, store=store, cache=cache, model=net, family=opened.family,
            dtype=opened.dtype, device=dev, resident_bytes=resident_bytes(net),
            load_seconds=time.perf_counter() - t0, tokenizer=tok, unused_tensors=unused, io=io, usage=usage_state,
            parallel=parallel, pipeline=pipeline, options=options, budget=budget, threads=torch.get_num_threads(),
            prefix_cache=None if parallel is not None else prefix_cache_for(net, dev, options.prefix_cache),
            plan=plan,
        )
    except BaseException:
        if store is not None:
            store.close()
        ckpt.close()
        raise


def _place(parallel, ckpt: Checkpoint, options: EngineOptions, net: CausalLM, num_experts: dict):
    """Expert parallelism's placement for :func:`moestream.load_plan.plan_load`: rank 0 places each layer's experts
    (a collective); returns which experts this rank owns and how many local ranks split the machine's memory."""
    parallel.place(ckpt, net, num_experts, options.usage_file, options.learn_experts)
    return parallel.owns, parallel.local_world


def _set_fast(net: CausalLM) -> None:
    """``--fast``: turboquant's QJL residual correction off, said on stderr."""
    n = set_fast(net, True)
    print(f"note: --fast: the QJL residual correction of {n} linears is off; this changes the output"
          if n else "note: --fast has no effect: this checkpoint stores no QJL residuals", file=sys.stderr)


def _make_cache(store: ExpertStore, plan: LoadPlan, options: EngineOptions) -> ExpertCache:
    """The expert cache the plan names: the GPU tier's (a slot pool where the fused kernel asked) or the CPU's."""
    num_experts = plan.opened.num_experts
    policy = make_policy(options.cache_policy, half_life=sum(num_experts.values()))
    if plan.tiered:
        return TieredExpertCache(store, plan.budget.budget, num_experts, policy=policy, device=plan.device,
                                 host_budget_bytes=plan.budget.host, slots=plan.slots)
    return ExpertCache(store, plan.budget.budget, num_experts, policy=policy)


def _attach_decode_runner(net: CausalLM, pipeline: ExpertPipeline, cache, plan: LoadPlan,
                          options: EngineOptions) -> None:
    """Decode steps through static buffers, as CUDA graphs where the plan says (``plan.graphs``). With graphs, the
    KV storage is kept for the engine's life (:class:`~moestream.models.layers.KVPool`): every request replays the
    graphs captured for the first."""
    net.decode_runner = DecodeRunner(net, pipeline, cache, plan.graphs)
    if net.decode_runner.graphs:
        # a set per sequence the scheduler may run (the budget plan counts them), two at least (a request's
        # cache may outlive it while the next one starts)
        net.kv_pool = KVPool(context_tokens_for(net, options.context_tokens), sets=max(2, options.max_batch))


def _load_resident(ckpt: Checkpoint, opened: Opened, progress, io: IOSettings) -> list[str]:
    """Read the resident weights into the model; the checkpoint tensors it does not use (reported once).
    (Their page cache is dropped as they load when expert reads bypass it: ``io.resident_progress``.)"""
    net, layout = opened.net, opened.layout
    total = sum(ckpt.tensors[n].nbytes for n, _ in net.named_parameters() if n in ckpt.tensors)
    with progress_bar(total, "loading resident weights", progress) as bar:
        skip = layout.expert_tensors | quant.padding_tensors(ckpt.tensors)  # padding: see moestream.convert
        unused = load_resident(net, ckpt, skip, opened.dtype, io.resident_progress(ckpt, bar.update))
    describe = getattr(opened.family, "describe_skipped", None)  # parts a family leaves out on purpose
    if describe is not None:
        note, unused = describe(unused)
        if note:
            print(f"note: {note}", file=sys.stderr)
    return unused


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
