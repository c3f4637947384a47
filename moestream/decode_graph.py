"""Decode steps on the GPU through static buffers, replayed as CUDA graphs.

A one-token decode step of a plain model (embedding, attention and MoE or MLP layers, the
final norm and the LM head; :func:`graph_unsupported` says which qualify) runs through a
:class:`DecodeRunner` once the KV cache exists (after the prefill):

- **Static shapes.** The token id and its position are device tensors written before the
  step. Each attention layer writes its key and value at that position with ``index_copy_``
  and attends over a fixed span of the cache, the *bucket* (:func:`bucket_for`: the next
  power of two of at least 64 above the position, at most the capacity), under a mask computed
  on the device from the position (:class:`StaticDecodeKV`). So a step is the same sequence
  of kernels at every position of a bucket, which a CUDA graph can replay; the eager path runs
  the same kernels and gives the same bits.
- **Every expert resident** (budget ``all``): the MoE layers need nothing from the host
  (:class:`~moestream.pipeline.FusedSwiGLUKernel` reads the slot table on the device), so the
  whole step is one graph; the routings, which only the counters need, go to pinned host
  memory in one asynchronous copy at its end.
- **Partial budgets**: the step is captured as segments between the MoE layers' miss checks.
  Segment ``j`` ends by copying MoE layer ``j``'s routing to pinned host memory; the host waits
  for it, fetches what VRAM lacks into slots, publishes the slot table, and replays segment
  ``j + 1``, which starts with that layer's fused kernel (:func:`plan_segments`).

Graphs are off (the same static path runs eagerly) with ``cuda_graphs=False``, on the CPU,
while a disk prefetcher, a lookahead or a routing trace needs the host inside the step, and
after a capture fails (a warning says why). A KV cache that grows past its capacity is a new
set of tensors: its steps are captured again.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .models.base import CausalLM
from .models.layers import MLP, Attention, DecoderLayer, KVCache, RMSNorm
from .models.linear import Linear
from .models.moe import StreamedMoE
from .models.rope import RotaryEmbedding

MIN_BUCKET = 64


def bucket_for(length: int, capacity: int) -> int:
    """Keys a static decode step attends over for a KV length ``length``: the next power of two of at
    least :data:`MIN_BUCKET`, at most ``capacity`` (a function of the position and the cache's size only,
    so every budget picks the same)."""
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return min(b, capacity)


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
        bucket: keys attended over (positions ``0..bucket-1``; those past ``pos`` are masked).
    """

    def __init__(self, kv: KVCache, pos: torch.Tensor, bucket: int):
        self.kv, self.pos, self.bucket = kv, pos, bucket
        self._masks: dict[int | None, torch.Tensor] = {}

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [kv_heads, 1, head_dim] at the position; the layer's first ``bucket`` keys and values."""
        keys, values = self.kv.layers[layer]
        keys.index_copy_(1, self.pos, k)
        values.index_copy_(1, self.pos, v)
        return keys[:, : self.bucket], values[:, : self.bucket]

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`KVCache.attend` for the one-token step: the bucket's keys under the device-side mask."""
        keys, values = self.update(layer, start, k, v)
        mask = self.attention_mask(start, 1, window, q.device)
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[0] != keys.shape[0])[0]

    def attention_mask(self, start: int, t: int, window: int | None, device) -> torch.Tensor:
        """Boolean [1, bucket]: keys at positions ``<= pos`` (and ``> pos - window``), from the device position."""
        mask = self._masks.get(window)
        if mask is None:
            at = torch.arange(self.bucket, device=self.pos.device)
            mask = at <= self.pos
            if window is not None:
                mask = mask & (at > self.pos - window)
            mask = mask[None, :]
            self._masks[window] = mask
        return mask


@dataclass
class RunnerStats:
    """Decode steps by path: ``replays`` (graph replays), ``eager`` (static path, no graph), ``captures``
    (graphs captured), ``declined`` (steps left to the model's plain path: no KV cache yet)."""

    replays: int = 0
    eager: int = 0
    captures: int = 0
    declined: int = 0
    disabled: str = ""  # why graphs were switched off, if they were

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Captured:
    graphs: list  # torch.cuda.CUDAGraph: one for budget all, segments otherwise
    out: torch.Tensor  # the logits buffer the last graph writes
    segments: list = field(default_factory=list)  # (layer, pinned routing buffer) per boundary
    routing: torch.Tensor | None = None  # pinned: the step's routings (budget all)
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

    def boundary(self, layer: int, idx: torch.Tensor) -> None:
        flat = idx.reshape(-1)
        host = self._buffers.pop(0)[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        self.graphs[-1].capture_end()
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode=self.mode)
        self.graphs.append(g)
        self.segments.append((layer, host))

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
        self._captured: dict[tuple, _Captured] = {}
        self._zeroed: dict[int, weakref.ref] = {}  # id -> the KV tensors whose tail was zeroed
        self._moe_layers = plan_segments(model)
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    # -- the step ---------------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, start: int, kv: KVCache) -> torch.Tensor | None:
        """Logits [1, vocab] of token ``ids`` [1] at position ``start``, written into ``kv``; None when the
        step must take the plain path (a KV layer not yet allocated or full)."""
        if type(kv) is not KVCache or not kv.layers or any(
                e is None or e[0].shape[1] <= start for e in kv.layers):
            self.stats.declined += 1
            return None
        if hasattr(self.cache, "settle"):
            self.cache.settle()  # the last step's routing buffers may be written again
        capacity = min(e[0].shape[1] for e in kv.layers)
        bucket = bucket_for(start + 1, capacity)
        self._zero_tail(kv, start)
        self.ids.copy_(ids.reshape(1), non_blocking=True)
        self.pos.fill_(start)
        if not self.graphs:
            self.stats.eager += 1
            return self._eager(kv, bucket)
        key = (bucket, capacity, tuple(e[0].data_ptr() for e in kv.layers), self._all_resident())
        got = self._captured.get(key)
        if got is None:
            out = self._eager(kv, bucket)  # this step, eagerly (which also warms up what the capture needs)
            self.stats.eager += 1
            try:
                self._captured[key] = self._capture(kv, bucket)
                self.stats.captures += 1
            except Exception as e:  # noqa: BLE001 -- a capture that fails leaves the eager path, same bits
                self.graphs = False
                self.stats.disabled = f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly"
                print(f"moestream: warning: {self.stats.disabled}", file=sys.stderr)
                torch.cuda.synchronize(self.device)
            return out
        self.stats.replays += 1
        return self._replay(got)

    def _zero_tail(self, kv: KVCache, start: int) -> None:
        """Zero the positions past the prefill once per KV tensor: attention reads them (masked), and
        uninitialized memory may hold NaN, which a zero weight does not cancel."""
        for k, v in kv.layers:
            seen = self._zeroed.get(id(k))
            if seen is None or seen() is not k:
                k[:, start:].zero_()
                v[:, start:].zero_()
                self._zeroed[id(k)] = weakref.ref(k)

    def _forward(self, kv: KVCache, bucket: int) -> torch.Tensor:
        """The static step: [1, vocab] logits for the token in :attr:`ids` at :attr:`pos`."""
        model = self.model
        decoder = model.decoder
        h = decoder.embed_tokens(self.ids)
        cos, sin = model.rotary(self.pos, h.dtype)
        skv = StaticDecodeKV(kv, self.pos, bucket)
        for i, layer in enumerate(decoder.layers):
            h = layer(h, cos, sin, skv, i, 0)
        return model.head(decoder.norm(h))

    def _all_resident(self) -> bool:
        return bool(getattr(self.cache, "all_resident", False))

    def _pinned(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def _routing_to_host(self, host: torch.Tensor | None = None) -> tuple[list, torch.Tensor | None]:
        """The step's logged routings (budget all), concatenated and copied to pinned memory (async):
        into ``host`` (a capture allocates it before it starts) or a new buffer."""
        log = self.cache.take_log() if hasattr(self.cache, "take_log") else []
        if not log:
            return [], None
        flat = torch.cat([i.reshape(-1) for _, i in log])
        host = self._pinned(flat.numel()) if host is None else host[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        return [(layer, i.numel()) for layer, i in log], host

    def _event(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _eager(self, kv: KVCache, bucket: int) -> torch.Tensor:
        out = self._forward(kv, bucket)
        sizes, host = self._routing_to_host()
        if host is not None:
            self.cache.log_pending(sizes, host, self._event())
        return out

    # -- graphs -----------------------------------------------------------------------------------
    def _capture(self, kv: KVCache, bucket: int) -> _Captured:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        mode = "thread_local"  # the store's reader threads may call CUDA (host registration) meanwhile
        k = self.model.top_k  # slots per MoE layer at most (one token; --max-active-experts keeps fewer)
        with torch.cuda.stream(stream):
            if self._all_resident():
                g = torch.cuda.CUDAGraph()
                buffer = self._pinned(k * len(self._moe_layers))
                g.capture_begin(pool=self._pool, capture_error_mode=mode)
                try:
                    out = self._forward(kv, bucket)
                    sizes, host = self._routing_to_host(buffer)
                finally:
                    g.capture_end()
                got = _Captured([g], out, routing=host, sizes=sizes)
            else:
                seg = _SegmentCapture(self._pool, mode, [self._pinned(k) for _ in self._moe_layers])
                self.pipeline.capture = seg
                try:
                    out = self._forward(kv, bucket)
                finally:
                    self.pipeline.capture = None
                    seg.end()
                got = _Captured(seg.graphs, out, segments=seg.segments)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return got

    def _replay(self, got: _Captured) -> torch.Tensor:
        graphs = got.graphs
        graphs[0].replay()
        for j, (layer, host) in enumerate(got.segments):
            ev = self._event()
            ev.synchronize()  # the layer's routing is in ``host``
            self.pipeline.fetch_layer(layer, host.tolist())
            try:
                graphs[j + 1].replay()
            finally:
                self.cache.end_layer()
        if got.routing is not None:
            self.cache.log_pending(got.sizes, got.routing, self._event())
        return got.out.clone()  # the next replay writes the same buffer

    def close(self) -> None:
        """Drop the captured graphs (their memory goes back to PyTorch's pool)."""
        self._captured.clear()
