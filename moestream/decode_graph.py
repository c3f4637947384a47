"""Decode steps on the GPU through static buffers, replayed as CUDA graphs.

A one-token decode step of a plain model (embedding, attention and MoE or MLP layers, the
final norm and the LM head; :func:`graph_unsupported` says which qualify) runs through a
:class:`DecodeRunner` once the KV cache exists (after the prefill):

- **Static shapes.** The token id and its position are device tensors written before the
  step. Each attention layer writes its key and value at that position with ``index_copy_``
  and attends with :mod:`moestream.attention_kernel` reading the position from the device
  (:class:`StaticDecodeKV`): the kernel's loop ends at the position, its grid covers the cache's
  capacity. So a step is the same kernels at every position, which one CUDA graph replays, and
  its bits are the eager path's and the prefill's (the kernel's reduction is fixed by position).
- **Every expert resident** (budget ``all``): the MoE layers need nothing from the host
  (:class:`~moestream.pipeline.FusedSwiGLUKernel` reads the slot table on the device), so the
  whole step is one graph; the routings, which only the counters need, are copied to a ring of
  pinned host buffers after each replay (no wait for the step in flight).
- **Partial budgets**: the step is captured as segments between the MoE layers' miss checks.
  Segment ``j`` ends by copying MoE layer ``j``'s routing to pinned host memory; the host waits
  for it, fetches what VRAM lacks into slots, publishes the slot table, and replays segment
  ``j + 1``, which starts with that layer's fused kernel (:func:`plan_segments`).
- **Captured once.** Graphs are kept per (KV tensors, residency); the engine's KV storage
  (:class:`~moestream.models.layers.KVPool`) gives every request the same tensors, so the graphs
  captured for the first request replay for all later ones (``stats.captures`` counts them).
- **Several sequences** (the scheduler's decode steps, :meth:`DecodeRunner.step_batch`): with every expert
  resident and every cache in one of the pool's sets, a step of B sequences is one graph per B, the rows'
  tokens, positions and sets written into its buffers; attention reads each row's set of the pool's stacked
  tensors (:func:`moestream.attention_kernel.attention_batch`), so each row has the bits of its solo step.
  A lone sequence in a pool set takes this path too (one graph for every set).

- **Prefill chunks** (:meth:`DecodeRunner.prefill`): with every expert resident, a chunk of ``T`` tokens into a
  cache of the pool's sets takes the same static path, its start on the device; a length seen before is
  captured as one graph and replayed after (a prefill is some 40 launches a layer: eager, the host's launches
  are its wall). A length seen once stays eager, so prompts of one-off lengths never pay for a capture.

With ``--prefetch-ahead N`` each segment also copies the next ``N`` layers' guessed experts (their routers
on this layer's input, computed in the graph) to the host, which stages the host-tier ones into VRAM
slots on the copy stream right after queuing the next segment: the copies run beside its compute.

Graphs are off (the same static path runs eagerly) with ``cuda_graphs=False``, on the CPU,
while a disk prefetcher or a routing trace needs the host inside the step, and
after a capture fails (a warning says why). A cache that grows past its storage gets new
tensors: its steps are captured again.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from . import attention_kernel
from .counters import Counters
from .models import ops
from .models.base import CausalLM
from .models.layers import MLP, Attention, DecoderLayer, KVCache, RMSNorm
from .models.linear import Linear
from .models.moe import StreamedMoE
from .models.rope import RotaryEmbedding

MAX_GRAPHS = 12  # captured steps kept (KV tensors x residency, batch sizes), least recently used dropped first
PREFILL_GRAPHS = 4  # captured prefill chunks kept (length x KV set), least recently used dropped first
ROUTING_RING = 4  # pinned buffers the all-resident step's routings rotate through


def graph_unsupported(model: nn.Module, also_allowed: tuple = ()) -> str | None:
    """Why ``model``'s decode steps cannot take the static path, or None when they can.

    The static path needs the plain causal-LM skeleton (:class:`~moestream.models.base.CausalLM`'s
    forward, KV cache and rotary embedding) and decoder layers of plain attention
    (:class:`~moestream.models.layers.Attention`), norms, dense MLPs and streamed MoE blocks
    (Qwen3-MoE, Mixtral); other families decode eagerly as before. ``also_allowed``: module types
    counted as plain linears (what the engine swaps for ``nn.Linear`` before decoding, for ``inspect``).
    """
    if not isinstance(model, CausalLM) or type(model).forward is not CausalLM.forward:
        return "the family's forward is its own"
    if type(model).new_kv_cache is not CausalLM.new_kv_cache:
        return "its decode state is not a plain KV cache"
    if type(model.rotary) is not RotaryEmbedding:
        return "its rotary embedding is not the plain one"
    allowed = (Attention, RMSNorm, MLP, StreamedMoE, nn.Linear, Linear, *also_allowed)
    for layer in model.decoder.layers:
        if type(layer) is not DecoderLayer:
            return f"decoder layer {type(layer).__name__} is not a plain one"
        for m in layer.modules():
            if m is not layer and type(m) not in allowed:
                return f"decoder layers hold {type(m).__name__}"
    return None


def plan_segments(model: CausalLM) -> list[int]:
    """The MoE layers at whose routing a partial-budget decode step waits for the host, in order: the
    step is ``len(result) + 1`` graph segments, segment ``j + 1`` starting with layer ``result[j]``'s
    experts."""
    return [b.layer for b in model.moe_blocks()]


class StaticDecodeKV:
    """A one-token view of a :class:`~moestream.models.layers.KVCache` for a static decode step.

    Args:
        kv: the KV cache (every layer's tensors allocated, capacity above the position).
        pos: int64 [1] on the device, the position being decoded.
    """

    def __init__(self, kv: KVCache, pos: torch.Tensor):
        self.kv, self.pos = kv, pos

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [kv_heads, 1, head_dim] at the position; the layer's whole key and value tensors."""
        keys, values = self.kv.layers[layer]
        keys.index_copy_(1, self.pos, k)
        values.index_copy_(1, self.pos, v)
        return keys, values

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`KVCache.attend` for the one-token step: on CUDA the attention kernel reading the position
        from the device (one kernel sequence for every position); elsewhere :func:`ops.attend` at the
        position read back (the CPU's kernels: the plain path's bits)."""
        keys, values = self.update(layer, start, k, v)
        if keys.is_cuda and attention_kernel.available(keys.device):
            return attention_kernel.attention(q, keys, values, 0, scale, window, sinks, pos=self.pos)
        return ops.attend(q, keys, values, int(self.pos[0]), scale, window, sinks)


class StaticBatchKV:
    """One decode step of several sequences over a :class:`~moestream.models.layers.KVPool`'s stacked storage:
    sequence ``b`` (row ``b`` of the step) writes its key and value at ``pos[b]`` of set ``sets[b]`` and attends
    over that set (:func:`moestream.attention_kernel.attention_batch`: the bits of its solo step).

    Args:
        pool: the pool whose stacks hold every sequence's cache.
        sets, pos: int64 [B] on the device: each row's set and position.
    """

    def __init__(self, pool, sets: torch.Tensor, pos: torch.Tensor):
        self.pool, self.sets, self.pos = pool, sets, pos

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` [heads, B, d], ``k``/``v`` [kv_heads, B, d] (one row per sequence; ``start`` unused): [heads, B, d]."""
        keys, values = self.pool.stacked(layer)
        keys[self.sets, :, self.pos] = k.transpose(0, 1)
        values[self.sets, :, self.pos] = v.transpose(0, 1)
        if keys.is_cuda and attention_kernel.available(keys.device):
            return attention_kernel.attention_batch(q, keys, values, self.sets, self.pos, scale, window, sinks)
        outs = []  # elsewhere each sequence through ops.attend at its position (StaticDecodeKV's bits)
        for b, (st, p) in enumerate(zip(self.sets.tolist(), self.pos.tolist())):
            outs.append(ops.attend(q[:, b : b + 1], keys[st], values[st], p, scale, window, sinks))
        return torch.cat(outs, dim=1)


class StaticPrefillKV:
    """A prefill chunk's view of a :class:`~moestream.models.layers.KVCache` for the static path: ``T`` tokens
    written at ``pos`` [T] (``start + 0..T-1`` on the device) and attended with the start read from the device.

    Args:
        kv: the KV cache (every layer's tensors allocated, capacity at least ``start + T``).
        start: int64 [1] on the device, the chunk's first position; pos: int64 [T], its positions.
    """

    def __init__(self, kv: KVCache, start: torch.Tensor, pos: torch.Tensor):
        self.kv, self.start, self.pos = kv, start, pos

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`KVCache.attend` for the chunk (``k``, ``v`` [kv_heads, T, head_dim]): on CUDA the attention kernel
        with the device start (the bits of the plain prefill: its reduction is fixed by position); elsewhere
        :func:`ops.attend` at the start read back."""
        keys, values = self.kv.layers[layer]
        keys.index_copy_(1, self.pos, k)
        values.index_copy_(1, self.pos, v)
        if keys.is_cuda and attention_kernel.available(keys.device):
            return attention_kernel.attention(q, keys, values, 0, scale, window, sinks, pos=self.start)
        return ops.attend(q, keys, values, int(self.start[0]), scale, window, sinks)  # the CPU's kernels


@dataclass
class _PrefillBuffers:
    ids: torch.Tensor  # int64 [T] on the device: the chunk's tokens
    start: torch.Tensor  # int64 [1]: its first position
    offsets: torch.Tensor  # int64 [T]: 0..T-1


@dataclass
class _BatchBuffers:
    ids: torch.Tensor  # int64 [B] on the device: each row's token
    pos: torch.Tensor  # int64 [B]: its position
    sets: torch.Tensor  # int64 [B]: its KV set


@dataclass
class RunnerStats(Counters):
    """Decode steps by path: ``replays`` (graph replays), ``eager`` (static path, no graph), ``captures``
    (graphs captured), ``declined`` (steps left to the model's plain path: no KV cache yet); the same for
    batched steps of several sequences (``batch_*``; declined ones run ``forward_batch``) and for prefill chunks
    (``prefill_*``)."""

    replays: int = 0
    eager: int = 0
    captures: int = 0
    declined: int = 0
    batch_replays: int = 0  # batched steps (several sequences) replayed, run eagerly, declined
    batch_eager: int = 0
    batch_declined: int = 0
    prefill_replays: int = 0  # prefill chunks replayed, run on the static path eagerly, captured
    prefill_eager: int = 0
    prefill_captures: int = 0  # (not in ``captures``, which counts the decode steps')
    disabled: str = ""  # why graphs were switched off, if they were


@dataclass
class _Captured:
    graphs: list  # torch.cuda.CUDAGraph: one for budget all, segments otherwise
    out: torch.Tensor  # the logits buffer the last graph writes
    segments: list = field(default_factory=list)  # (layer, pinned buffer, slots, layers guessed) per boundary
    routing: torch.Tensor | None = None  # on the device, written by the graph: the step's routings (budget all)
    sizes: list = field(default_factory=list)  # (layer, slots) of ``routing``


class _SegmentCapture:
    """The pipeline's hook while a partial-budget step is captured: each MoE layer's routing ends a
    segment (copied to pinned memory inside it) and its kernel starts the next."""

    def __init__(self, pool, mode: str, buffers: list[torch.Tensor]):
        self.pool, self.mode = pool, mode
        self._buffers = list(buffers)  # pinned, allocated before the capture (no host allocation inside it)
        self.graphs = [torch.cuda.CUDAGraph()]
        self.segments: list[tuple[int, torch.Tensor]] = []
        self.graphs[0].capture_begin(pool=pool, capture_error_mode=mode)

    def boundary(self, layer: int, idx: torch.Tensor, guesses: list | tuple = (), ahead: list | tuple = ()) -> None:
        """End the segment at ``layer``'s routing ``idx`` (and the next layers' guesses, ``ahead`` their layers,
        for the copies staged between the segments: ``--prefetch-ahead``)."""
        flat = torch.cat([idx.reshape(-1), *guesses]) if guesses else idx.reshape(-1)
        host = self._buffers.pop(0)[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        self.graphs[-1].capture_end()
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode=self.mode)
        self.graphs.append(g)
        self.segments.append((layer, host, idx.numel(), tuple(ahead)))

    def end(self) -> None:
        self.graphs[-1].capture_end()


class DecodeRunner:
    """One-token decode steps through static buffers (see the module docstring).

    Args:
        model: the loaded model (graph-capable: :func:`graph_unsupported` is None).
        pipeline: its :class:`~moestream.pipeline.ExpertPipeline` (every MoE layer on a slotted kernel).
        cache: the :class:`~moestream.tiered_cache.TieredExpertCache` with its slot pool (another cache
            runs the static path eagerly, with the pipeline's own routing on the host).
        graphs: capture and replay CUDA graphs (CUDA only); False runs the same static path eagerly.

    Attributes:
        stats: :class:`RunnerStats`.
    """

    def __init__(self, model: CausalLM, pipeline, cache, graphs: bool):
        self.model, self.pipeline, self.cache = model, pipeline, cache
        self.device = model.decoder.embed_tokens.weight.device
        self.graphs = graphs and self.device.type == "cuda" and hasattr(cache, "pool")
        self.ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.stats = RunnerStats()
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._moe_layers = plan_segments(model)
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._ring: list[torch.Tensor] = []  # pinned: where each replay's routings go (budget all)
        self._ring_at = 0
        self._batch: dict[int, _BatchBuffers] = {}  # the batched steps' buffers by batch size
        self._prefills: OrderedDict[tuple, _Captured] = OrderedDict()  # captured prefill chunks
        self._prefill_buffers: dict[int, _PrefillBuffers] = {}
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # prefill chunk keys run once (captured the next time)

    # -- the step ---------------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, start: int, kv: KVCache) -> torch.Tensor | None:
        """Logits [1, vocab] of token ``ids`` [1] (host or device) at position ``start``, written into ``kv``;
        None when the step must take the plain path (a KV layer not yet allocated or full)."""
        key = self._key(kv)
        if key is None or start >= key[1]:
            self.stats.declined += 1
            return None
        got = self.step_batch([(ids, start, kv)])  # a cache of the pool's sets: one graph for every set
        if got is not None:
            return got[0]
        if hasattr(self.cache, "settle"):
            self.cache.settle(keep=ROUTING_RING - 1)  # the oldest routing buffer may be written again
        self.ids.copy_(ids.reshape(1), non_blocking=True)
        self.pos.fill_(start)
        if not self.graphs:
            self.stats.eager += 1
            return self._eager(lambda: self._forward(kv))
        key = (key[0], self.all_resident)
        got = self._captured.get(key)
        if got is None:
            out = self._eager(lambda: self._forward(kv))  # eagerly (warms up the capture)
            self.stats.eager += 1
            self._capture_or_disable(key, lambda: self._capture(lambda: self._forward(kv)))
            return out
        self._captured.move_to_end(key)
        self.stats.replays += 1
        return self._replay(got)

    def step_batch(self, parts: list[tuple[torch.Tensor, int, KVCache]]) -> list[torch.Tensor] | None:
        """Logits [1, vocab] per part of one decode step of one or several sequences, ``parts``
        ``[(ids [1], start, kv)]``, through the static batched path: one CUDA graph per batch size for the engine's
        life (the rows' tokens, positions and KV sets are written into its buffers), every row the bits of its
        solo step. None (the caller takes the per-cache path, or
        :meth:`~moestream.models.base.CausalLM.forward_batch` for several) unless every cache holds a set of the
        engine's :class:`~moestream.models.layers.KVPool` with room for its position and every expert is
        resident (a partial budget's segments fetch per token: those steps stay on the per-cache path)."""
        pool = getattr(self.model, "kv_pool", None)
        sets = [pool.set_of(kv) for _, _, kv in parts] if pool is not None else [None]
        b = len(parts)
        if None in sets or any(start >= pool.capacity for _, start, _ in parts) or not self.all_resident:
            self.stats.batch_declined += b > 1
            return None
        buf = self._batch_buffers(b)
        if hasattr(self.cache, "settle"):
            self.cache.settle(keep=ROUTING_RING - 1)
        buf.ids.copy_(torch.cat([ids.reshape(1) for ids, _, _ in parts]), non_blocking=True)
        # from pageable memory: staged before the call returns, so the next step may build its own
        buf.pos.copy_(torch.tensor([start for _, start, _ in parts]), non_blocking=True)
        buf.sets.copy_(torch.tensor(sets), non_blocking=True)
        key = ("batch", b, pool.version, True)
        got = self._captured.get(key) if self.graphs else None
        if got is None:
            out = self._eager(lambda: self._forward_batch(buf))
            self._count(b, "eager")
            if self.graphs:
                self._capture_or_disable(key, lambda: self._capture(lambda: self._forward_batch(buf)))
        else:
            self._captured.move_to_end(key)
            self._count(b, "replays")
            out = self._replay(got)
        for _, start, kv in parts:
            kv.length = start + 1
        return [out[j : j + 1] for j in range(b)]

    def prefill(self, ids: torch.Tensor, start: int, kv: KVCache) -> torch.Tensor | None:
        """Logits [1, vocab] of the last of a prefill chunk's tokens ``ids`` [T] (T > 1, on the device) at positions
        ``start..start+T-1``, written into ``kv``, through the static path (:class:`StaticPrefillKV`): a chunk whose
        (length, KV set) was seen before is one CUDA graph, captured the second time and replayed after. The bits
        of the model's plain forward. None (the caller runs the plain forward) unless every expert is resident and
        ``kv`` is a cache of the engine's :class:`~moestream.models.layers.KVPool` with room for the chunk."""
        pool = getattr(self.model, "kv_pool", None)
        t = ids.shape[0]
        if pool is None or t < 2 or start + t > pool.capacity or not self.all_resident \
                or getattr(kv, "storage", None) is None or type(kv) is not KVCache:
            return None
        self._reserve(kv, ids, start + t)
        sets = pool.set_of(kv)
        if sets is None:
            return None
        buf = self._prefill_buffers.get(t)
        if buf is None:
            z = torch.zeros(1, dtype=torch.int64, device=self.device)
            buf = self._prefill_buffers[t] = _PrefillBuffers(
                torch.zeros(t, dtype=torch.int64, device=self.device), z,
                torch.arange(t, dtype=torch.int64, device=self.device))
        if hasattr(self.cache, "settle"):
            self.cache.settle(keep=ROUTING_RING - 1)
        buf.ids.copy_(ids.reshape(t), non_blocking=True)
        buf.start.fill_(start)
        key = ("prefill", t, sets, pool.version)
        got = self._prefills.get(key) if self.graphs else None
        if got is not None:
            self._prefills.move_to_end(key)
            self.stats.prefill_replays += 1
            return self._replay(got)
        out = self._eager(lambda: self._forward_prefill(buf, kv))
        self.stats.prefill_eager += 1
        if self.graphs:
            if key in self._seen:  # the second time: worth a graph (a length seen once may never come again)
                del self._seen[key]
                if self._capture_or_disable(key, lambda: self._capture(lambda: self._forward_prefill(buf, kv)),
                                            self._prefills, PREFILL_GRAPHS):
                    self.stats.prefill_captures += 1
            else:
                self._seen[key] = None
                while len(self._seen) > 4 * PREFILL_GRAPHS:
                    self._seen.popitem(last=False)
        return out

    def _reserve(self, kv: KVCache, like: torch.Tensor, end: int) -> None:
        """Every attention layer's KV tensors of ``kv`` allocated with room for ``end`` positions (the plain
        path allocates them at the layer's first write; a captured chunk needs them before)."""
        if all(e is not None and e[0].shape[1] >= end for e in kv.layers):
            return
        h = self.model.decoder.embed_tokens(like[:1])  # the dtype the layers' keys have
        for i, layer in enumerate(self.model.decoder.layers):
            attn = layer.self_attn
            kv.reserve(i, end, h, attn.kv_heads, attn.head_dim)

    def _forward_prefill(self, buf: _PrefillBuffers, kv: KVCache) -> torch.Tensor:
        """The static prefill chunk: [1, vocab] logits of its last token."""
        pos = buf.start + buf.offsets
        return self._layers(buf.ids, pos, StaticPrefillKV(kv, buf.start, pos), last=True)

    def _count(self, b: int, what: str) -> None:
        name = what if b == 1 else f"batch_{what}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _batch_buffers(self, b: int) -> _BatchBuffers:
        got = self._batch.get(b)
        if got is None:
            dev = self.device
            got = self._batch[b] = _BatchBuffers(*(torch.zeros(b, dtype=torch.int64, device=dev) for _ in range(3)))
        return got

    def _forward_batch(self, buf: _BatchBuffers) -> torch.Tensor:
        """The static batched step: [B, vocab] logits for the tokens in ``buf``."""
        return self._layers(buf.ids, buf.pos, StaticBatchKV(self.model.kv_pool, buf.sets, buf.pos))

    def _capture_or_disable(self, key: tuple, capture, store: OrderedDict | None = None,
                            limit: int = MAX_GRAPHS) -> bool:
        """Capture a graph for ``key`` into ``store`` (default the steps'; the least recently used dropped beyond
        ``limit``); whether it was. A capture that fails turns graphs off with a warning (the eager path gives
        the same bits)."""
        store = self._captured if store is None else store
        try:
            while len(store) >= limit:
                store.popitem(last=False)
            store[key] = capture()
            if store is self._captured:
                self.stats.captures += 1
            return True
        except Exception as e:  # noqa: BLE001 -- a capture that fails leaves the eager path, same bits
            self.graphs = False
            self.stats.disabled = f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly"
            print(f"moestream: warning: {self.stats.disabled}", file=sys.stderr)
            torch.cuda.synchronize(self.device)
            return False

    @staticmethod
    def _key(kv: KVCache) -> tuple | None:
        """(the KV tensors' addresses, the least capacity) of ``kv``, kept on it while its tensors stay the
        same; None when it is not a plain cache with every layer allocated."""
        if type(kv) is not KVCache or not kv.layers:
            return None
        got = getattr(kv, "_static_key", None)
        if got is not None and got[0] == kv.version:
            return got[1]
        if any(e is None for e in kv.layers):
            return None
        key = (tuple((e[0].data_ptr(), e[1].data_ptr()) for e in kv.layers), min(e[0].shape[1] for e in kv.layers))
        kv._static_key = (kv.version, key)
        return key

    def _forward(self, kv: KVCache) -> torch.Tensor:
        """The static step: [1, vocab] logits for the token in :attr:`ids` at :attr:`pos`."""
        return self._layers(self.ids, self.pos, StaticDecodeKV(kv, self.pos))

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, skv, last: bool = False) -> torch.Tensor:
        """Logits [n, vocab] of tokens ``ids`` [n] at device positions ``pos`` [n] through every layer over ``skv``
        (``last``: [1, vocab], the last token's only, as a prefill needs)."""
        model = self.model
        decoder = model.decoder
        h = decoder.embed_tokens(ids)
        cos, sin = model.rotary(pos, h.dtype)
        for i, layer in enumerate(decoder.layers):
            h = layer(h, cos, sin, skv, i, 0)
        if last:
            h = h[-1:]
        return model.head(decoder.norm(h))

    @property
    def all_resident(self) -> bool:
        """Whether every expert is in VRAM (the whole step, or chunk, is one graph)."""
        return bool(getattr(self.cache, "all_resident", False))

    def _pinned(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def _logged(self) -> tuple[list, torch.Tensor | None]:
        """The step's logged routings (budget all): their (layer, slots) and the ids concatenated, on the device."""
        log = self.cache.take_log() if hasattr(self.cache, "take_log") else []
        if not log:
            return [], None
        return [(layer, i.numel()) for layer, i in log], torch.cat([i.reshape(-1) for _, i in log])

    def _routing_to_host(self, sizes: list, flat: torch.Tensor | None) -> None:
        """Copy a step's routings (device) into the next pinned buffer of the ring, asynchronously; the
        counters fold them in once the copy is done."""
        if flat is None:
            return
        if len(self._ring) < ROUTING_RING:
            self._ring.append(self._pinned(flat.numel()))
        host = self._ring[self._ring_at % len(self._ring)]
        self._ring_at += 1
        if host.numel() < flat.numel():
            host = self._ring[(self._ring_at - 1) % len(self._ring)] = self._pinned(flat.numel())
        host = host[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        self.cache.log_pending(sizes, host, self._event())

    def _event(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _eager(self, forward) -> torch.Tensor:
        """``forward()`` (a static step) run now; its routings copied to the host for the counters."""
        out = forward()
        self._routing_to_host(*self._logged())
        return out

    # -- graphs -----------------------------------------------------------------------------------
    def _capture(self, forward) -> _Captured:
        """``forward()`` (a static step) captured: one graph with every expert resident, else segments."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        mode = "thread_local"  # the store's reader threads may call CUDA (host registration) meanwhile
        k = self.model.top_k  # slots per MoE layer at most (one token; --max-active-experts keeps fewer)
        with torch.cuda.stream(stream):
            if self.all_resident:
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self._pool, capture_error_mode=mode)
                try:
                    out = forward()
                    sizes, flat = self._logged()
                finally:
                    g.capture_end()
                got = _Captured([g], out, routing=flat, sizes=sizes)
            else:
                ahead = 1 + max((len(v) for v in getattr(self.pipeline, "following", {}).values()), default=0)
                seg = _SegmentCapture(self._pool, mode, [self._pinned(k * ahead) for _ in self._moe_layers])
                self.pipeline.capture = seg
                try:
                    out = forward()
                finally:
                    self.pipeline.capture = None
                    seg.end()
                got = _Captured(seg.graphs, out, segments=seg.segments)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return got

    def _replay(self, got: _Captured) -> torch.Tensor:
        graphs = got.graphs
        graphs[0].replay()
        for j, (layer, host, n, ahead) in enumerate(got.segments):
            ev = self._event()
            ev.synchronize()  # the layer's routing (and the next layers' guesses) is in ``host``
            ids = host.tolist()
            self.pipeline.fetch_layer(layer, ids[:n])
            try:
                graphs[j + 1].replay()
            finally:
                self.cache.end_layer()
            if ahead:  # copy the guessed host-tier experts now, beside the segment just queued
                self.cache.stage([(a, e) for i, a in enumerate(ahead) for e in ids[n * (i + 1) : n * (i + 2)]])
        self._routing_to_host(got.sizes, got.routing)
        return got.out.clone()  # the next replay writes the same buffer

    def close(self) -> None:
        """Drop the captured graphs (their memory goes back to PyTorch's pool)."""
        self._captured.clear()
        self._prefills.clear()
