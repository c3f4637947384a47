"""Reading experts ahead: while layer L computes, read what the next layers will likely need.

Two cases, one mechanism:

* **Decode** (``--prefetch-ahead N``, one token): the next N layers' top-k experts.
* **Prefill** (a chunk of several tokens, on by default): nearly every expert of a layer
  is used by a 512-token chunk, so while layer L computes, the next layer's experts are
  read -- those its router picks for the chunk, most-used first, up to a window of
  ``window`` experts -- filling the gap between L's last read and L+1's first, when the
  disk would otherwise wait on attention and the router.

The prediction applies each following layer's router (resident) to the hidden state
that enters layer L's MoE block: the residual stream changes little from one layer to
the next, so the next layers' routers applied to it guess much of their top-k (the idea
of pre-gated MoE, Hwang et al. 2024, and of the "next-layer" speculation in
Eliseev & Mazur 2023, "Fast inference of Mixture-of-Experts language models with
offloading"). Prefetch only warms memory: each layer still computes its exact routing
and fetches its experts through the cache, so the output does not change by a bit.

Reads ahead queue behind every demand read (the store's reader threads take a layer's own
reads first). Prefetched experts wait in a staging area outside the cache budget -- at
most ``ahead x top_k`` experts in decode, ``window`` in prefill -- until the layer they were
read for claims them (they then enter the cache like any read) or passes without them
(their bytes are wasted). Decode read-ahead switches itself off when it has wasted more
bytes than it saved. Counters per layer (issued, hits, wasted) and the CPU time the
predictions take are in :class:`PrefetchStats`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .counters import Counters
from .errors import ReadError
from .store import ExpertStore, ExpertWeights, Key, ReadBatch

# Experts of the next layer read ahead in a multi-token chunk, per reader thread (2 x workers:
# as many as the demand reads the store keeps in flight, which the reserve already counts).
CHUNK_WINDOW_PER_WORKER = 2


@dataclass
class PrefetchStats(Counters):
    """Prefetch counters, in experts, bytes and seconds.

    ``issued == hits + wasted + outstanding`` at any time. ``hits`` are experts a layer
    needed that were already read or being read ahead (``late`` of them still in
    flight when claimed); their bytes are ``saved_bytes``, taken off the critical path.
    ``wasted`` experts were read ahead for a layer that did not use them. ``chunk_*``: the
    part of those counts read ahead for multi-token chunks (prefill). ``per_layer``: the
    layer read for -> ``[issued, hits, wasted]`` of one-token (decode) reads ahead, so the
    accuracy of each layer's guess is ``hits / (hits + wasted)``. ``plan_cpu_seconds``: CPU
    time of the predictions (the next layers' routers), outside the reader threads;
    ``plans``: how many predictions were made.
    """

    issued: int = 0
    hits: int = 0
    late: int = 0
    wasted: int = 0
    saved_bytes: int = 0
    wasted_bytes: int = 0
    outstanding: int = 0
    disabled: str = ""  # why decode read-ahead switched itself off, if it did
    chunk_issued: int = 0
    chunk_hits: int = 0
    chunk_wasted: int = 0
    plans: int = 0
    plan_cpu_seconds: float = 0.0
    per_layer: dict[int, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["per_layer"] = {k: list(v) for k, v in self.per_layer.items()}
        return d


def following_blocks(blocks: list, ahead: int) -> dict[int, list]:
    """Layer -> the ``ahead`` MoE blocks after it in the forward pass (fewer near the last layer)."""
    order = list(blocks)
    return {b.layer: order[i + 1 : i + 1 + ahead] for i, b in enumerate(order)}


@torch.inference_mode()
def predict_next(following: list, x: torch.Tensor) -> list[tuple[int, list[int]]]:
    """The experts each of the ``following`` blocks' routers picks for ``x`` [T, H].

    Per block: its router on ``x``, the ``top_k`` experts with the largest summed routing
    weight over the T tokens (for one token, exactly its predicted top-k), those with a
    positive weight, largest first. Returns ``[(layer, [expert, ...]), ...]``.
    """
    out = []
    for block in following:
        weights, idx = block.route(x)
        score = torch.zeros(block.num_experts, dtype=torch.float32, device=x.device)
        score.index_add_(0, idx.reshape(-1), weights.reshape(-1).float())
        top = torch.topk(score, min(idx.shape[1], score.numel())).indices.tolist()
        out.append((block.layer, [e for e in top if score[e] > 0]))
    return out


@torch.inference_mode()
def predict_chunk(following: list, x: torch.Tensor) -> list[tuple[int, list[int]]]:
    """The experts the first of the ``following`` blocks' routers sends the chunk ``x`` [T, H] to, in the order
    :class:`Prefetcher` reads a chunk's next layer ahead: by how many of the T x top_k token slots route to
    each, most first, ties by lower id; only those with a slot.

    Returns ``[(layer, [expert, ...])]``, or ``[]`` when ``following`` is empty (the last MoE layer).
    """
    if not following:
        return []
    block = following[0]
    _, idx = block.route(x)
    counts = torch.bincount(idx.reshape(-1).cpu(), minlength=block.num_experts)
    order = torch.argsort(-counts, stable=True)  # most routings first, then by id
    return [(block.layer, order[: int((counts > 0).sum())].tolist())]


class Prefetcher:
    """Predicts and reads ahead the experts of the next MoE layers.

    Args:
        store: the expert store (its reader threads do the reads, counted as prefetch).
        blocks: the model's :class:`~moestream.models.moe.StreamedMoE` blocks in layer order
            (their routers make the predictions).
        ahead: one-token (decode) steps: how many following MoE layers to read for (0: none).
        min_decided: decode experts read ahead (hits + wasted) to see before judging waste.
        owns: expert parallelism: ``owns((layer, expert))`` says whether this rank reads it (None: all).
        window: multi-token chunks (prefill): experts of the next layer to read ahead (0: none;
            default ``CHUNK_WINDOW_PER_WORKER x`` the store's workers).

    Driven from the compute thread only: :meth:`plan` from a MoE block's forward,
    :meth:`retire`, :meth:`issue`, :meth:`pending` and :meth:`take` from
    :meth:`moestream.cache.ExpertCache.fetch`.
    """

    def __init__(self, store: ExpertStore, blocks: list, ahead: int, min_decided: int = 32, owns=None,
                 window: int | None = None):
        if ahead < 0:
            raise ValueError(f"ahead must be at least 0, got {ahead}")
        self.store = store
        self.ahead = ahead
        self.window = CHUNK_WINDOW_PER_WORKER * store.workers if window is None else window
        self.min_decided = min_decided
        self.enabled = True  # decode read-ahead (chunks are read ahead regardless)
        self.stats = PrefetchStats()
        self._following = following_blocks(blocks, max(ahead, 1))
        self._planned: list[Key] = []
        self._staged: dict[Key, ReadBatch] = {}
        self._chunk: set[Key] = set()  # staged (or planned) for a multi-token chunk
        self._claimed: dict[Key, ReadBatch] = {}  # claimed by the layer fetching now, not yet taken
        self._dropping: list[ReadBatch] = []
        self._cache = None
        self._saved_bytes = self._lost_bytes = 0  # decode reads ahead only: the switch-off rule
        self.owns = owns  # expert parallelism: (layer, expert) -> whether this rank reads it

    def attach(self, cache) -> None:
        """Hook into ``cache`` (an :class:`~moestream.cache.ExpertCache`)."""
        self._cache = cache
        cache.prefetcher = self

    # -- prediction ----------------------------------------------------------------------
    def _wanted(self, key: Key) -> bool:
        return ((self.owns is None or self.owns(key)) and key not in self._staged and key not in self._planned
                and (self._cache is None or key not in self._cache))

    @torch.inference_mode()
    def plan(self, layer: int, x: torch.Tensor) -> None:
        """Predict the experts the layers after ``layer`` will use for ``x`` [T, H] (called by the
        expert pipeline once ``layer`` has routed).

        One token (decode, ``ahead`` > 0): for each of the next ``ahead`` layers, its router is
        applied to ``x`` and its ``top_k`` experts are planned, unless cached or already read
        ahead. Several tokens (a prefill chunk, ``window`` > 0): the next layer's router is
        applied to every token and the experts it routes them to are planned, most routings
        first, up to ``window`` experts.
        """
        chunk = x.shape[0] > 1
        if (chunk and self.window <= 0) or (not chunk and (not self.enabled or self.ahead <= 0)):
            return
        c0, r0 = time.process_time(), self.store.reader_cpu_seconds()
        if chunk:
            self._plan_chunk(layer, x)
        else:
            self._plan_token(layer, x)
        self.stats.plans += 1
        self.stats.plan_cpu_seconds += max(0.0, (time.process_time() - c0) - (self.store.reader_cpu_seconds() - r0))

    def _plan_token(self, layer: int, x: torch.Tensor) -> None:
        for nxt, experts in predict_next(self._following.get(layer, ())[: self.ahead], x):
            for e in experts:
                key = (nxt, e)
                if self._wanted(key):
                    self._planned.append(key)

    def _plan_chunk(self, layer: int, x: torch.Tensor) -> None:
        # the routing traces record predict_chunk's order too: cachesim replays this loop on it
        for nxt, order in predict_chunk(self._following.get(layer, ()), x):
            room = self.window - sum(1 for k in self._chunk if k[0] == nxt)
            for e in order:
                if room <= 0:
                    break
                key = (nxt, e)
                if self._wanted(key):
                    self._planned.append(key)
                    self._chunk.add(key)
                    room -= 1

    def idle_for(self, t: int) -> bool:
        """Whether a layer of ``t`` tokens whose experts are all cached needs nothing of the read-ahead: no plan
        for ``t`` tokens (:meth:`plan`) and no read ahead staged, planned or claimed (so the compiled decoder
        layer may compute it without the fetch that retires and issues reads)."""
        plans = self.window > 0 if t > 1 else self.enabled and self.ahead > 0
        if plans and self._holds_every_expert():  # nothing a plan could read (budget all, every expert in)
            plans = False
        return not plans and not self._staged and not self._planned and not self._claimed

    def _holds_every_expert(self) -> bool:
        """Whether the attached cache keeps every expert and holds them all now (no read ahead can be wanted)."""
        cache = self._cache
        if cache is None or cache.budget_bytes is not None:
            return False
        total = sum(u.numel() for u in cache.usage.values())
        return total > 0 and len(cache) >= total

    def issue(self) -> None:
        """Start the planned reads (they queue behind every demand read)."""
        for key in self._planned:
            self._staged[key] = self.store.submit([key], max_inflight=8, prefetch=True)
            self.stats.issued += 1
            self.stats.outstanding += 1
            if key in self._chunk:
                self.stats.chunk_issued += 1
            else:
                self.stats.per_layer.setdefault(key[0], [0, 0, 0])[0] += 1
        self._planned.clear()
        self._reap()

    # -- claiming ------------------------------------------------------------------------
    def pending(self, key: Key) -> bool:
        """Whether ``key`` has been (or is being) read ahead and not yet claimed."""
        return key in self._staged

    def take(self, keys: list[Key]) -> Iterator[ExpertWeights]:
        """Hand over the read-ahead experts ``keys`` (claimed in :meth:`retire`), waiting for
        any still in flight; they leave the staging area (the caller caches them).

        Raises:
            ReadError: when the read ahead failed, naming the expert and file.
        """
        for key in keys:
            batch = self._claimed.pop(key)
            if not batch.done():
                self.stats.late += 1
            yield from batch

    def retire(self, layer: int, claimed: list[Key]) -> None:
        """``layer`` is fetching now and uses the read-ahead experts ``claimed`` (hits, handed
        over by :meth:`take`); those read ahead for it and not claimed are wasted."""
        self._dropping.extend(self._claimed.values())  # from a fetch abandoned before taking them
        self._claimed.clear()
        for key in claimed:
            self._claimed[key] = self._staged.pop(key)
            self._decided(key, hit=True)
        waste = [k for k in self._staged if k[0] == layer]
        for key in waste:
            self._dropping.append(self._staged.pop(key))
            self._decided(key, hit=False)
        self._judge()

    def _decided(self, key: Key, hit: bool) -> None:
        """A read ahead claimed (``hit``) or wasted, into the counters: a chunk's apart, decode's per layer and in
        the bytes saved and lost that :meth:`_judge` weighs."""
        s = self.stats
        s.outstanding -= 1
        n = self.store.expert_nbytes(key)
        if hit:
            s.hits += 1
            s.saved_bytes += n
        else:
            s.wasted += 1
            s.wasted_bytes += n
        if key in self._chunk:
            self._chunk.discard(key)
            if hit:
                s.chunk_hits += 1
            else:
                s.chunk_wasted += 1
        else:
            s.per_layer.setdefault(key[0], [0, 0, 0])[1 if hit else 2] += 1
            if hit:
                self._saved_bytes += n
            else:
                self._lost_bytes += n

    def _judge(self) -> None:
        """Switch decode read-ahead off once it has wasted more bytes than it saved (chunks aside)."""
        s = self.stats
        hits, wasted = s.hits - s.chunk_hits, s.wasted - s.chunk_wasted
        if self.enabled and hits + wasted >= self.min_decided and self._lost_bytes > self._saved_bytes:
            self.enabled = False
            self._planned = [k for k in self._planned if k in self._chunk]
            s.disabled = (
                f"switched off after {hits} hits and {wasted} wasted experts: {self._lost_bytes / 1e9:.2f} GB "
                f"read for nothing against {self._saved_bytes / 1e9:.2f} GB saved"
            )

    def _reap(self) -> None:
        """Free the buffers of wasted reads that have finished (never blocks)."""
        keep = []
        for batch in self._dropping:
            if batch.done():
                try:
                    for ew in batch:
                        self.store.release(ew)
                except ReadError:
                    pass  # a read nobody needs failed: nothing to report
            else:
                keep.append(batch)
        self._dropping = keep

    def close(self) -> None:
        """Cancel or wait for every read ahead and free its buffers."""
        for batch in [*self._staged.values(), *self._claimed.values(), *self._dropping]:
            batch.close()
        self._staged.clear()
        self._claimed.clear()
        self._dropping.clear()
        self._chunk.clear()
