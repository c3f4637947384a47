"""Reading experts ahead (``--prefetch-ahead N``): while layer L computes, read what layers
L+1..L+N will likely need.

The prediction applies each following layer's router (resident) to the hidden state
that enters layer L's MoE block: the residual stream changes little from one layer to
the next, so the next layers' routers applied to it guess much of their top-k (the idea
of pre-gated MoE, Hwang et al. 2024, and of the "next-layer" speculation in
Eliseev & Mazur 2023, "Fast inference of Mixture-of-Experts language models with
offloading"). Prefetch only warms memory: each layer still computes its exact routing
and fetches its experts through the cache, so the output does not change by a bit.

Prefetched experts wait in a staging area outside the cache budget -- at most
``ahead x top_k`` experts -- until the layer they were read for claims them (they then
enter the cache like any read) or passes without them (their bytes are wasted). The
prefetcher switches itself off when it has wasted more bytes than it saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import ReadError
from .store import ExpertStore, ExpertWeights, Key, ReadBatch


@dataclass
class PrefetchStats:
    """Prefetch counters, in experts and bytes.

    ``issued == hits + wasted + outstanding`` at any time. ``hits`` are experts a layer
    needed that were already read or being read ahead (``late`` of them still in
    flight when claimed); their bytes are ``saved_bytes``, taken off the critical path.
    ``wasted`` experts were read ahead for a layer that did not use them.
    """

    issued: int = 0
    hits: int = 0
    late: int = 0
    wasted: int = 0
    saved_bytes: int = 0
    wasted_bytes: int = 0
    outstanding: int = 0
    disabled: str = ""  # why prefetch switched itself off, if it did

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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


class Prefetcher:
    """Predicts and reads ahead the experts of the next ``ahead`` MoE layers.

    Args:
        store: the expert store (its reader threads do the reads, counted as prefetch).
        blocks: the model's :class:`~moestream.models.moe.StreamedMoE` blocks in layer order
            (their routers make the predictions).
        ahead: how many following MoE layers to read for (N >= 1).
        min_decided: prefetched experts (hits + wasted) to see before judging waste.
        owns: expert parallelism: ``owns((layer, expert))`` says whether this rank reads it (None: all).

    Driven from the compute thread only: :meth:`plan` from a MoE block's forward,
    :meth:`retire`, :meth:`issue`, :meth:`pending` and :meth:`take` from
    :meth:`moestream.cache.ExpertCache.fetch`.
    """

    def __init__(self, store: ExpertStore, blocks: list, ahead: int, min_decided: int = 32, owns=None):
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1, got {ahead}")
        self.store = store
        self.ahead = ahead
        self.min_decided = min_decided
        self.enabled = True
        self.stats = PrefetchStats()
        self._following = following_blocks(blocks, ahead)
        self._planned: list[Key] = []
        self._staged: dict[Key, ReadBatch] = {}
        self._claimed: dict[Key, ReadBatch] = {}  # claimed by the layer fetching now, not yet taken
        self._dropping: list[ReadBatch] = []
        self._cache = None
        self.owns = owns  # expert parallelism: (layer, expert) -> whether this rank reads it

    def attach(self, cache) -> None:
        """Hook into ``cache`` (an :class:`~moestream.cache.ExpertCache`)."""
        self._cache = cache
        cache.prefetcher = self

    # -- prediction ----------------------------------------------------------------------
    @torch.inference_mode()
    def plan(self, layer: int, x: torch.Tensor) -> None:
        """Predict the experts the layers after ``layer`` will use for ``x`` [T, H] (called by the
        expert pipeline once ``layer`` has routed).

        For each following layer, its router is applied to ``x``; the ``top_k`` experts
        with the largest summed routing weight over the T tokens are planned (for one
        token, exactly its predicted top-k), unless cached or already read ahead.
        """
        if not self.enabled:
            return
        for nxt, experts in predict_next(self._following.get(layer, ()), x):
            for e in experts:
                key = (nxt, e)
                if self.owns is not None and not self.owns(key):  # expert parallel: another rank reads it
                    continue
                if key not in self._staged and key not in self._planned and (
                    self._cache is None or key not in self._cache
                ):
                    self._planned.append(key)

    def issue(self) -> None:
        """Start the planned reads (after the current layer's own reads, which go first)."""
        for key in self._planned:
            self._staged[key] = self.store.submit([key], max_inflight=8, prefetch=True)
            self.stats.issued += 1
            self.stats.outstanding += 1
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
            self.stats.outstanding -= 1
            self.stats.hits += 1
            self.stats.saved_bytes += self.store.expert_nbytes(key)
        waste = [k for k in self._staged if k[0] == layer]
        for key in waste:
            self._dropping.append(self._staged.pop(key))
            self.stats.outstanding -= 1
            self.stats.wasted += 1
            self.stats.wasted_bytes += self.store.expert_nbytes(key)
        s = self.stats
        if self.enabled and s.hits + s.wasted >= self.min_decided and s.wasted_bytes > s.saved_bytes:
            self.enabled = False
            self._planned.clear()
            s.disabled = (
                f"switched off after {s.hits} hits and {s.wasted} wasted experts: {s.wasted_bytes / 1e9:.2f} GB "
                f"read for nothing against {s.saved_bytes / 1e9:.2f} GB saved"
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
