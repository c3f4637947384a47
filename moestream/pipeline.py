"""The expert pipeline: one owner for a MoE layer's expert work in one forward pass.

For ``T`` tokens routed to ``K`` experts each (weights [T, K], expert ids [T, K]),
:class:`ExpertPipeline`:

1. keeps at most ``--max-active-experts`` experts per token (an opt-in approximation),
   records the routing trace and lets the prefetcher plan the next layers' reads;
2. groups the ``T*K`` slots by expert (:func:`group_slots`: one device -> host sync) and
   asks the expert cache for the layer's experts in order of first use (token-major,
   rank-minor), cached ones first while the missing ones are being read;
3. hands each expert's stored tensors, as the store read them, to the layer's
   **expert kernel** (chosen once at load for the family, format and device: per expert,
   :class:`PerExpertKernel`, or the whole layer at once, :class:`BatchedSwiGLUKernel`: each an
   :class:`ExpertKernel` of its kind), and
   writes each weighted output into its ``(t, k)`` slot of a ``[T*K, H]`` buffer;
4. under expert parallelism, computes only this rank's experts and exchanges the slots
   with the other ranks (the ``exchange`` object, :class:`moestream.parallel.ExpertParallel`);
5. sums the slots over ``k = 0..K-1`` in routing order (:func:`sum_slots`).

The order in which reads finish never reaches the arithmetic, and an expert's kernel
never depends on where the expert came from (cache, a read, a read ahead, a host tier),
so every budget, reader count, prefetch setting and rank count gives the same bits.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F

from .fused_moe import expert_projections, fused_moe
from .quant import native

if TYPE_CHECKING:
    from .slot_pool import SlotPool
    from .store import ExpertWeights

ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]

# What an expert computes, as a family declares it (:class:`ExpertSpec`): "swiglu" ``down(silu(gate x) * up x)``,
# "clamped_swiglu" (gpt-oss: alpha, limit), "situ_glu" (Kimi K3: beta, linear_beta); "custom": any other function
# (computed one expert at a time by the family's own function).
EXPERT_KINDS = ("swiglu", "clamped_swiglu", "situ_glu", "custom")


def declares(kind: str, layout: str = "linear"):
    """Mark a float expert function as computing ``kind`` on pieces laid out as ``layout`` (``"linear"``:
    ``gate``/``up`` [I, H] and ``down`` [H, I] in nn.Linear orientation, biases beside them; ``"gate_up"``:
    gpt-oss's fused ``gate_up`` [H, 2I] stored for ``x @ W``), so that :meth:`ExpertSpec.of` knows it (and a
    ``functools.partial`` of it, its keywords the parameters)."""
    if kind not in EXPERT_KINDS:
        raise ValueError(f"unknown expert kind {kind!r}; expected one of {', '.join(EXPERT_KINDS)}")

    def mark(fn):
        fn.expert_kind, fn.expert_layout = kind, layout
        return fn

    return mark


@dataclass(frozen=True)
class ExpertSpec:
    """What one routed expert of a MoE block computes, declared by its family (``StreamedMoE.expert``).

    The engine chooses each layer's expert kernel from this spec and the experts' stored format
    (:func:`moestream.load_plan.choose_kernel`), never from the identity of a function.

    Attributes:
        kind: one of :data:`EXPERT_KINDS`.
        fn: the float reference ``fn(x [n, H], tensors) -> [n, H]`` (the PyTorch path, and the fallback).
        params: the kind's parameters as ``(name, value)`` pairs (``alpha``/``limit``, ``beta``/``linear_beta``).
        layout: how the pieces are laid out (see :func:`declares`).
    """

    kind: str
    fn: ExpertFn
    params: tuple[tuple[str, float | None], ...] = ()
    layout: str = "linear"

    def __post_init__(self):
        if self.kind not in EXPERT_KINDS:
            raise ValueError(f"unknown expert kind {self.kind!r}; expected one of {', '.join(EXPERT_KINDS)}")

    @classmethod
    def of(cls, fn: "ExpertFn | ExpertSpec") -> "ExpertSpec":
        """The spec of ``fn``: a spec as it is; a function :func:`declares` marked (or a ``functools.partial``
        of one with keywords only: its keywords the parameters) as its kind; any other function ``custom``."""
        if isinstance(fn, ExpertSpec):
            return fn
        base, params = fn, ()
        if isinstance(fn, functools.partial):
            if fn.args:
                return cls("custom", fn)
            base, params = fn.func, tuple(fn.keywords.items())
        kind = getattr(base, "expert_kind", None)
        if kind is None:
            return cls("custom", fn)
        return cls(kind, fn, params, getattr(base, "expert_layout", "linear"))

    @property
    def keywords(self) -> dict[str, float | None]:
        """The parameters as a dict."""
        return dict(self.params)

    @property
    def name(self) -> str:
        """The float function's name (a partial's function's)."""
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return getattr(fn, "__name__", type(fn).__name__)

    def describe(self) -> str:
        """``swiglu``, ``situ_glu (beta 4, linear_beta 25)``, ``custom (its_function)``."""
        if self.kind == "custom":
            return f"custom ({self.name})"
        params = ", ".join(f"{k} {v:g}" if isinstance(v, float | int) else f"{k} {v}" for k, v in self.params)
        layout = "" if self.layout == "linear" else f", {self.layout} layout"
        return self.kind + (f" ({params}{layout})" if params or layout else "")


# How the pipeline drives a kernel: one expert per call on its rows (``compute``); several experts per
# compiled call, grouped on the host (``call_for`` + :func:`moestream.quant.native.moe`); the whole layer at
# once (``compute_layer``); the whole layer from the VRAM slot pool, summing over k itself (``compute_from_slots``).
KernelKind = Literal["per_expert", "grouped", "per_layer", "in_slots"]


@runtime_checkable
class ExpertKernel(Protocol):
    """What every expert kernel declares (chosen once at load for a layer's expert spec, format and device).

    Attributes:
        name: what ``moestream inspect`` and the stats call it.
        kind: how the pipeline drives it (:data:`KernelKind`); each kind has its method
            (:class:`PerExpertKernel`, :class:`NativeMoEKernel`, :class:`BatchedSwiGLUKernel`,
            :class:`FusedSwiGLUKernel`).
        reduces_k: whether it sums a token's k expert outputs itself (in routing order, k = 0 first);
            otherwise it writes each ``(t, k)`` slot and the pipeline sums them (:func:`sum_slots`).
    """

    name: str
    kind: KernelKind
    reduces_k: bool


class ExpertSource(Protocol):
    """The expert cache as the pipeline uses it: :class:`moestream.cache.ExpertCache` and its tiered form.

    ``fetch`` yields ``(expert id, ExpertWeights)`` for ``needed`` (distinct ids of ``layer``, with how many
    slots each has in ``counts``): held ones first, then each read one as it arrives. ``holds`` says whether
    an expert is held now (the CPU's grouped kernel computes the held ones in one call)."""

    def fetch(self, layer: int, needed: list[int], counts: list[int]) -> Iterable[tuple[int, "ExpertWeights"]]: ...

    def holds(self, key: tuple[int, int]) -> bool: ...


class SlotSource(ExpertSource, Protocol):
    """The tiered cache with its VRAM slot pool (:class:`moestream.tiered_cache.TieredExpertCache`), for
    :class:`FusedSwiGLUKernel` (kind ``in_slots``): the pool and table, routing counted from the device when
    every expert is resident, a layer's experts held in their slots while it computes, staging ahead."""

    pool: "SlotPool"

    @property
    def all_resident(self) -> bool: ...

    def log_routing(self, layer: int, idx: torch.Tensor) -> None: ...

    def hold(self, layer: int, needed: list[int]) -> None: ...

    def ready(self) -> None: ...

    def end_layer(self) -> None: ...

    def stage(self, keys: list[tuple[int, int]]) -> None: ...


@dataclass(frozen=True)
class SlotGroups:
    """A layer's routing slots grouped by expert.

    Attributes:
        t, k: tokens and experts per token; slot ``s = t_index * k + k_index``.
        order: int64 [T*K] on the routing's device: slot positions grouped by expert id
            (ascending), ascending position within an expert (a stable sort).
        counts: int64 [n] on the device: slots per distinct expert, ascending id.
        experts: the ``n`` distinct expert ids, ascending.
        sizes, starts: slots per distinct expert and where its run begins in ``order``.
        first_use: the distinct experts in order of first use in routing order.
    """

    t: int
    k: int
    order: torch.Tensor
    counts: torch.Tensor
    experts: list[int]
    sizes: list[int]
    starts: list[int]
    first_use: list[int]

    def span(self, i: int) -> torch.Tensor:
        """The slot positions of the ``i``-th distinct expert (ascending id order), ascending."""
        return self.order[self.starts[i] : self.starts[i] + self.sizes[i]]


def group_slots(idx: torch.Tensor) -> SlotGroups:
    """Group the slots of ``idx`` [T, K] (int64 expert ids) by expert, with one device -> host sync."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    n = ids.numel()
    rows = torch.repeat_interleave(torch.arange(n, device=flat.device), counts)  # each sorted slot's expert row
    # first routing position of each distinct expert: the smallest slot position in its run
    first = torch.full((n,), t * k, dtype=torch.int64, device=flat.device)
    first = first.scatter_reduce(0, rows, order, reduce="amin", include_self=True)
    meta = torch.cat([ids, counts, first]).tolist()
    experts, sizes, firstpos = meta[:n], meta[n : 2 * n], meta[2 * n :]
    starts, at = [], 0
    for c in sizes:
        starts.append(at)
        at += c
    first_use = [experts[i] for i in sorted(range(n), key=firstpos.__getitem__)]
    return SlotGroups(t, k, order, counts, experts, sizes, starts, first_use)


def sum_slots(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` [T, K, H] summed over k = 0..K-1 in that order -> [T, H] (a new tensor).

    The one place a layer's expert outputs are added up: always in routing order, so the
    result never depends on the order experts were computed in.
    """
    out = slots[:, 0].clone()
    for j in range(1, slots.shape[1]):
        out += slots[:, j]
    return out


class PerExpertKernel:
    """A per-expert kernel (kind ``per_expert``): computes one expert on the rows routed to it.

    Args:
        fn: ``fn(x [n, H], tensors) -> [n, H]`` on the expert's stored tensors (the dict the
            store hands out: ``gate``, ``up``, ``down``, quantization pieces...).
        name: what ``moestream inspect`` and the stats call it.
    """

    kind: KernelKind = "per_expert"
    reduces_k = False

    def __init__(self, fn: ExpertFn, name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def compute(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert on ``x`` [n, H] -> [n, H]."""
        return self.fn(x, tensors)


class NativeMoEKernel:
    """A layer's gated experts on the CPU's compiled kernels, several experts per call
    (:func:`moestream.quant.native.moe`): the experts the cache holds all at once (both cores split them),
    then each one read as it arrives. Each slot's bits are those of its expert on its token alone (the
    kernels' one reduction), so grouping experts into calls never changes the output.

    Args:
        fallback: the layer's expert function, for an expert whose pieces the kernels do not cover.
        fmt: the experts' :class:`~moestream.quant.formats.ExpertFormat` (None: float experts).
        act, params: the gated activation (``silu``; ``situ`` with (beta, linear_beta); ``clamped`` with
            (alpha, limit)), as :func:`moestream.quant.native.expert`.
        name: what ``moestream inspect`` and the stats call it.
    """

    kind: KernelKind = "grouped"
    reduces_k = False

    def __init__(self, fallback: ExpertFn, fmt=None, act: str = "silu",
                 params: tuple[float, float] = (1.0, float("nan")), name: str | None = None):
        self.fallback, self.fmt, self.act, self.params = fallback, fmt, act, params
        kind = "float" if fmt is None else fmt.tag
        self.name = name or f"compiled gated experts ({act}, {kind}), several per call"

    def call_for(self, ew):
        """The expert's packed kernel view, made once per cached expert (kept on its entry)."""
        got = getattr(ew, "_native_call", None)
        if got is None or got[0] is not self:
            got = (self, native.expert_call(ew.tensors, self.fmt))
            ew._native_call = got
        return got[1]


class NativeExpertTable:
    """One layer's experts as the compiled decoder layer (:func:`moestream.quant.native.decoder_layer`) finds them:
    a C array [2E] holding each cached expert's :class:`~moestream.quant.native.ExpertCall` arrays (fields,
    pointers), null where the cache does not hold it. Kept in step with the cache by the pipeline: an entry is
    set when the pipeline computes a cached expert, cleared by the cache's evict hook (before its buffer is
    released), so the compiled layer never reads an expert the cache let go of."""

    def __init__(self, num_experts: int, act: str, params: tuple[float, float]):
        import ctypes

        self.c = (ctypes.c_void_p * (2 * num_experts))()
        self.calls: dict[int, object] = {}  # keeps each entry's arrays alive
        self.act, self.params = act, params
        self._addr = ctypes.addressof

    def put(self, e: int, call) -> None:
        if self.calls.get(e) is not call:
            self.calls[e] = call
            self.c[2 * e], self.c[2 * e + 1] = self._addr(call.c_fields), self._addr(call.c_ptrs)

    def drop(self, e: int) -> None:
        if self.calls.pop(e, None) is not None:
            self.c[2 * e] = self.c[2 * e + 1] = None


class BatchedSwiGLUKernel:
    """A layer's SwiGLU experts as one batched matmul chain (the GPU path).

    The layer's experts (all fetched before any compute) are stacked into ``gate``/``up``
    [n, I, H] and ``down`` [n, H, I] in ascending expert id, and each expert's tokens are
    laid out in a zero-padded [n, m, H] block (``m`` = most slots any one expert got), so
    the layer is three ``torch.bmm`` launches. Each expert's result depends only on its
    weights, its tokens and the shapes (n, m), which the routing fixes -- never on which
    tier an expert came from. Experts not computed here (another rank's) enter as zero
    weights, so the shapes, and with them every computed slot's bits, are the whole
    layer's. Its bits differ from the per-expert chain's; a device uses one of the two for
    every budget.
    """

    kind: KernelKind = "per_layer"
    reduces_k = False
    name = "batched SwiGLU (torch.bmm)"

    def compute_layer(self, x: torch.Tensor, groups: SlotGroups, got: dict[int, dict[str, torch.Tensor]],
                      weights: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``weights[s] * expert(x[s // K])`` into ``slots`` [T*K, H] for every slot of an
        expert in ``got`` (id -> stored tensors), zeros for the others; ``weights`` is [T*K]
        (x's dtype or float32)."""
        if not got:
            return
        ids, n_e = groups.experts, len(groups.experts)
        ref = next(iter(got.values()))
        zero = {role: torch.zeros_like(ref[role]) for role in ("gate", "up", "down")} if len(got) < n_e else None
        gate = torch.stack([got.get(e, zero)["gate"] for e in ids])
        up = torch.stack([got.get(e, zero)["up"] for e in ids])
        down = torch.stack([got.get(e, zero)["down"] for e in ids])
        order, counts = groups.order, groups.counts
        dev = order.device
        rows = torch.repeat_interleave(torch.arange(n_e, device=dev), counts)
        starts = torch.cumsum(counts, 0) - counts
        cols = torch.arange(order.numel(), device=dev) - starts[rows]
        xin = x.new_zeros(n_e, max(groups.sizes), x.shape[1])
        xin[rows, cols] = x[order // groups.k]
        h = F.silu(torch.bmm(xin, gate.transpose(1, 2))) * torch.bmm(xin, up.transpose(1, 2))
        y = torch.bmm(h, down.transpose(1, 2))[rows, cols]  # [T*K, H], slots in sorted order
        # the slots of experts not in ``got`` hold zeros (their weights were zero); the exchange replaces them
        slots[order] = (y * weights[order, None]).to(slots.dtype)


class FusedSwiGLUKernel:
    """A layer's SwiGLU experts computed in place from their VRAM slots by the fused Triton kernel
    (:func:`moestream.fused_moe.fused_moe`): gate/up, SiLU, down, the routing weights and the sum
    over k in routing order, in three launches (plus the device-side grouping for a prefill chunk;
    a decode step runs the same kernels one slot per block). It reads the slot table on the device,
    so the pipeline needs no routing on the host when every expert is resident. Its bits depend only
    on the inputs, the routing and the model's shapes (never on the slot or tier an expert came from,
    nor on the other tokens of the call); they differ from the other kernels'. Needs the cache's
    :class:`~moestream.tiered_cache.SlotPool`.

    ``fmt``: the layer's :class:`~moestream.quant.formats.ExpertFormat` when its experts are stored
    quantized (MLX affine, fp8, MXFP4: the slots hold the stored bytes, dequantized in registers);
    None for float experts.
    """

    kind: KernelKind = "in_slots"
    reduces_k = True

    def __init__(self, fmt=None):
        self.fmt = fmt
        self._proj = None  # (the pool's views, their projections): the views never change

    @property
    def name(self) -> str:
        kind = "" if self.fmt is None else f" on {self.fmt.tag} as stored"
        return f"fused SwiGLU (Triton, in place from VRAM slots{kind})"

    def compute_from_slots(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, table: torch.Tensor,
                           views: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x`` [T, H], ``weights`` [T, K], ``idx`` [T, K] int64, ``table`` int32 [E] (expert -> slot),
        ``views`` the pool's pieces (``gate``/``up`` [S, I, H] and ``down`` [S, H, I], or their stored
        quantized pieces) -> [T, H] in x's dtype."""
        if self._proj is None or self._proj[0] is not views:
            self._proj = (views, expert_projections(views, self.fmt))
        return fused_moe(x.contiguous(), weights, idx, table, *self._proj[1])


def keep_top_experts(
    weights: torch.Tensor, idx: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each token's ``k`` highest-weight routed experts (``--max-active-experts``).

    Args:
        weights: [T, K] routing weights; idx: [T, K] expert indices (K > k >= 1).
        k: experts to keep per token.
        renormalize: whether the family renormalizes its top-k weights; if so the kept
            weights are rescaled (in float32) to sum to what the full top-k's weights
            summed (which also keeps any routed scaling factor); if not they are kept as
            they are, as the family would weigh them.

    Returns:
        ``(weights [T, k] in weights.dtype, idx [T, k] int64)``, the kept slots in their
        routing order. This changes the model's output: it is an approximation the user
        opts into.
    """
    pos = torch.topk(weights.float(), k, dim=-1).indices.sort(dim=-1).values  # routing order kept
    kept_w, kept_i = torch.gather(weights, 1, pos), torch.gather(idx, 1, pos)
    if renormalize:
        w = kept_w.float()
        kept_w = (w * (weights.float().sum(-1, keepdim=True) / w.sum(-1, keepdim=True))).to(weights.dtype)
    return kept_w, kept_i


class ExpertPipeline:
    """Every MoE layer's expert work, for one loaded model (see the module docstring).

    Args:
        cache: the expert cache (:class:`moestream.cache.ExpertCache` or its tiered form: an
            :class:`ExpertSource`; a :class:`SlotSource` for ``in_slots`` kernels).
        kernels: layer -> its :class:`ExpertKernel`, chosen once at load (:mod:`moestream.load_plan`).
        max_active: ``--max-active-experts`` (0: the model's own routing, exact).
        prefetcher: the :class:`moestream.prefetch.Prefetcher` (``--prefetch-ahead``), or None.
        exchange: expert parallelism's :class:`moestream.parallel.ExpertParallel`, or None.
        trace: a :class:`moestream.usage.TraceWriter` recording each layer's routing, or None.
    """

    def __init__(self, cache: ExpertSource, kernels: dict[int, ExpertKernel], max_active: int = 0, prefetcher=None,
                 exchange=None, trace=None, lookahead: int = 0, blocks: list | None = None):
        self.cache, self.kernels, self.max_active = cache, kernels, max_active
        self.prefetcher, self.exchange, self.trace = prefetcher, exchange, trace
        # CPU seconds in the expert kernels, outside the reader threads (the stats' split of CPU time)
        self.kernel_cpu_seconds = 0.0
        self._cpu = getattr(getattr(cache, "store", None), "compute_cpu_seconds", None) or time.process_time
        # slotted kernels: copy the host-tier experts the next ``lookahead`` layers' routers predict
        # into VRAM while this layer computes (TieredExpertCache.stage)
        order = list(blocks or [])
        self.following = {b.layer: order[i + 1 : i + 1 + lookahead] for i, b in enumerate(order)} if lookahead else {}
        self.capture = None  # a CUDA graph capture in progress (moestream.decode_graph): see _compute_in_slots
        self._route_input = None
        self._tables: dict[int, NativeExpertTable] = {}  # layer -> the compiled decoder layer's expert table

    def native_table(self, block, top_k: int, t: int) -> NativeExpertTable | None:
        """The expert table of ``block``'s layer for the compiled decoder layer on ``t`` tokens, or None where
        this pipeline's work on the layer is more than computing cached experts in routing order (expert
        parallelism, a routing trace, read-ahead planned or in flight, ``--max-active-experts`` below ``top_k``, a
        kernel other than the CPU's compiled gated experts, a cache that does not count compiled hits)."""
        layer = block.layer
        pf = self.prefetcher or getattr(self.cache, "prefetcher", None)
        if pf is not None and not pf.idle_for(t):
            return None
        got = self._tables.get(layer)
        if got is not None and self.exchange is None and self.trace is None:
            return got
        kernel = self.kernels.get(layer)
        if (type(kernel) is not NativeMoEKernel or self.exchange is not None or self.trace is not None
                or 0 < self.max_active < top_k or not getattr(self.cache, "serves_compiled_layers", False)):
            return None
        if not self._tables:
            self.cache.evict_hooks.append(self._evicted)
        got = self._tables[layer] = NativeExpertTable(block.num_experts, kernel.act, kernel.params)
        for e, ew in self.cache.held(layer):  # what the cache holds already (a preload, pins)
            call = kernel.call_for(ew)
            if call is not None:
                got.put(e, call)
        return got

    def _evicted(self, key: tuple[int, int]) -> None:
        table = self._tables.get(key[0])
        if table is not None:
            table.drop(key[1])

    def record_compiled(self, layer: int, experts: list[int], counts: list[int],
                        as_tensors: tuple[torch.Tensor, torch.Tensor], kernel_cpu_s: float) -> None:
        """Count a layer the compiled decoder layer computed from cached experts (``experts`` in order of first
        use, ``counts`` their slots): the cache's counters as a fetch that hit them all, the experts' CPU time."""
        self.cache.record_hits(layer, experts, counts, as_tensors)
        self.kernel_cpu_seconds += kernel_cpu_s

    def __call__(self, block, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 expert_input: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for MoE block ``block``'s tokens ``x`` [T, H].

        Args:
            block: the :class:`moestream.models.moe.StreamedMoE` (its ``layer``, ``renormalize``).
            x: [T, H], the router's input (the prefetcher predicts the next layers from it).
            weights: [T, K] routing weights (x's dtype, or float32); idx: [T, K] int64 expert ids.
            expert_input: what the experts compute on (default ``x``; Kimi K3's latent
                experts take a projection of it), [T, H'].

        Returns:
            [T, H'] in the expert input's dtype: ``sum_k weights[t, k] * expert_{idx[t, k]}(x[t])``,
            accumulated k = 0..K-1.

        Raises:
            ReadError: an expert read failed (naming the expert and file).
            ParallelError: under expert parallelism, a rank died or diverged.
        """
        layer = block.layer
        if 0 < self.max_active < idx.shape[1]:
            weights, idx = keep_top_experts(weights, idx, self.max_active, block.renormalize)
        if self.trace is not None:
            self.trace.route(layer, idx, x)
        if self.prefetcher is not None:  # read the next layers' likely experts while this one computes
            self.prefetcher.plan(layer, x)
        self._route_input = x  # what the next layers' routers guess from (lookahead)
        return self.compute(x if expert_input is None else expert_input, weights, idx, layer)

    def compute(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, layer: int) -> torch.Tensor:
        """The experts' part of :meth:`__call__` for ``layer``: group, fetch, compute, (exchange), sum.

        ``x`` [T, H] the expert input, ``weights`` [T, K], ``idx`` [T, K] int64 -> [T, H] in x's dtype.
        """
        kernel = self.kernels[layer]
        if kernel.kind == "in_slots" and self.exchange is None:
            return self._compute_in_slots(x, weights, idx, layer, cast(FusedSwiGLUKernel, kernel))
        if kernel.kind == "grouped" and self.exchange is None:  # the CPU: group on the host, no tensors
            t, k = idx.shape
            slots_of: dict[int, list[int]] = {}
            for s, e in enumerate(idx.reshape(-1).tolist()):
                slots_of.setdefault(e, []).append(s)  # first use order; each expert's slots ascending
            needed = list(slots_of)
            slots = x.new_empty(t * k, x.shape[1])
            self._compute_many(x, weights.reshape(-1), slots_of, k, layer, cast(NativeMoEKernel, kernel), needed,
                               [len(slots_of[e]) for e in needed], slots)
            return sum_slots(slots.view(t, k, -1))
        groups = group_slots(idx)
        owned = None if self.exchange is None else self.exchange.owned_ids(layer)
        slots = self.compute_slots(x, weights.reshape(-1), groups, layer, self.kernels[layer], owned)
        if self.exchange is not None:
            slots = self.exchange.gather_slots(slots, idx, layer)
        return sum_slots(slots.view(groups.t, groups.k, -1))

    def compute_slots(self, x: torch.Tensor, weights: torch.Tensor, groups: SlotGroups, layer: int,
                      kernel: ExpertKernel, owned: set[int] | None = None) -> torch.Tensor:
        """The weighted slot outputs [T*K, H] in x's dtype: slot ``s`` holds
        ``weights[s] * expert_{idx[s]}(x[s // K])``. With ``owned``, only those experts are
        fetched and computed; the other slots hold zeros."""
        needed = groups.first_use if owned is None else [e for e in groups.first_use if e in owned]
        row_of = {e: i for i, e in enumerate(groups.experts)}
        counts = [groups.sizes[row_of[e]] for e in needed]
        fill = x.new_zeros if owned is not None else x.new_empty
        slots = fill(groups.t * groups.k, x.shape[1])
        # even with nothing needed: the (empty) fetch lets the prefetcher retire this layer's reads ahead
        cpu = self._cpu
        if kernel.kind == "grouped":
            slots_of = {e: groups.span(row_of[e]).tolist() for e in needed}
            return self._compute_many(x, weights, slots_of, groups.k, layer, cast(NativeMoEKernel, kernel), needed,
                                      counts, slots)
        if kernel.kind != "per_expert":  # per_layer (an in_slots kernel is never exchanged: fused is off then)
            got = {}
            for e, ew in self.cache.fetch(layer, needed, counts):
                got[e] = ew.tensors  # the dict stays alive here even if the cache evicts the expert
            c0 = cpu()
            cast(BatchedSwiGLUKernel, kernel).compute_layer(x, groups, got, weights, slots)
            self.kernel_cpu_seconds += cpu() - c0
            return slots
        k, one = groups.k, cast(PerExpertKernel, kernel)
        for e, ew in self.cache.fetch(layer, needed, counts):
            c0 = cpu()
            sl = groups.span(row_of[e])
            # float32 routing weights (DeepSeek; Mixtral's reference scales in float32) multiply in float32
            # and round once, as transformers
            slots[sl] = (one.compute(x[sl // k], ew.tensors) * weights[sl, None]).to(slots.dtype)
            self.kernel_cpu_seconds += cpu() - c0
        return slots

    def _compute_many(self, x: torch.Tensor, weights: torch.Tensor, slots_of: dict[int, list[int]], k: int,
                      layer: int, kernel: NativeMoEKernel, needed: list[int], counts: list[int],
                      slots: torch.Tensor) -> torch.Tensor:
        """:meth:`compute_slots` through a :class:`NativeMoEKernel`: the experts the cache holds in one call (they
        stay intact until the first read one is inserted), then each read expert in its own call as it comes. An
        expert the kernels do not cover (a piece in another dtype) goes through the kernel's ``fallback``."""
        hold = getattr(self.cache, "holds", None)
        ready = sum(1 for e in needed if hold((layer, e))) if hold is not None else 0
        calls, rows = [], []
        cpu = self._cpu
        table = self._tables.get(layer)
        for i, (e, ew) in enumerate(self.cache.fetch(layer, needed, counts)):
            call = kernel.call_for(ew)
            if table is not None and call is not None and hold((layer, e)):
                table.put(e, call)  # the compiled decoder layer finds it from now on (until evicted)
            if call is None:  # as the per-expert path does
                c0 = cpu()
                sl = torch.tensor(slots_of[e], device=x.device)
                slots[sl] = (kernel.fallback(x[sl // k], ew.tensors) * weights[sl, None]).to(slots.dtype)
                self.kernel_cpu_seconds += cpu() - c0
            else:
                calls.append(call)
                rows.append(slots_of[e])
            if calls and i + 1 >= ready:  # the last held expert, then each read one: compute before the cache moves on
                c0 = cpu()
                native.moe(x, calls, rows, k, weights, kernel.act, kernel.params, out=slots)
                self.kernel_cpu_seconds += cpu() - c0
                calls, rows = [], []
        return slots

    # -- the slot pool's path (FusedSwiGLUKernel) --------------------------------------------------
    def _compute_in_slots(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, layer: int,
                          kernel: FusedSwiGLUKernel) -> torch.Tensor:
        """A layer on the fused kernel, reading the experts where the VRAM slot pool holds them.

        Every expert resident: no host work at all (the routing is counted later from the device,
        :meth:`TieredExpertCache.log_routing`). Otherwise the host learns the layer's routing with
        one small device -> host copy, fetches what VRAM lacks into slots (host tier, then disk),
        publishes the slot table and queues the kernel; during a CUDA graph capture that host part
        is left to run between the captured segments (:mod:`moestream.decode_graph`).
        """
        cache = cast(SlotSource, self.cache)
        pool = cache.pool
        if cache.all_resident:
            if pool.dirty:  # the preload's slots, once (never inside a graph capture: nothing changes after)
                pool.flush()
            cache.log_routing(layer, idx)
            return kernel.compute_from_slots(x, weights, idx, pool.table[layer], pool.views)
        ahead = self.following.get(layer, ())
        if self.capture is not None:  # the next layers' guesses computed in the graph, staged between segments
            guesses = [b.route(self._route_input)[1].reshape(-1) for b in ahead]
            self.capture.boundary(layer, idx, guesses, [b.layer for b in ahead])
            return kernel.compute_from_slots(x, weights, idx, pool.table[layer], pool.views)
        n = idx.numel()
        if ahead:  # the next layers' routers on this layer's input, fetched in the same copy
            guesses = [b.route(self._route_input)[1].reshape(-1) for b in ahead]
            ids = torch.cat([idx.reshape(-1)] + guesses).tolist()
        else:
            ids = idx.reshape(-1).tolist()  # the layer's one device -> host copy
        self.fetch_layer(layer, ids[:n])
        try:
            out = kernel.compute_from_slots(x, weights, idx, pool.table[layer], pool.views)
        finally:
            cache.end_layer()
        if ahead:
            at, keys = n, []
            for b in ahead:
                keys += [(b.layer, e) for e in ids[at : at + n]]
                at += n
            cache.stage(keys)
        return out

    def fetch_layer(self, layer: int, ids: list[int]) -> list[int]:
        """Bring the experts of ``layer``'s routing ``ids`` (expert ids of its T*K slots, routing order)
        into their slots and publish the slot table; they stay until the cache's ``end_layer``.

        Returns the layer's distinct experts in order of first use.

        Raises:
            ReadError: an expert read failed (the layer is released).
        """
        counts: dict[int, int] = {}
        for e in ids:
            counts[e] = counts.get(e, 0) + 1
        needed = list(counts)
        cache = cast(SlotSource, self.cache)
        cache.hold(layer, needed)
        try:
            for _ in cache.fetch(layer, needed, list(counts.values())):
                pass
            cache.ready()
        except BaseException:
            cache.end_layer()
            raise
        return needed
