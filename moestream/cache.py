"""Expert cache: which experts stay in memory, under a byte budget, and its counters.

A cache of experts keyed by ``(layer, expert)``, evicting in the order of an
:class:`~moestream.policies.EvictionPolicy` (LRU by default). The budget bounds the bytes of
cached experts; an expert in use by the layer being computed is pinned and never
evicted, so the cache may exceed its budget by at most the experts in use (a budget
smaller than one layer's experts still works: each is read, used, then evicted).
Budget ``None`` means every expert stays resident (the in-memory mode).

The cache is driven from one thread (the compute thread); the store's reader threads
only fill buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .policies import EvictionPolicy, LRUPolicy
from .store import ExpertStore, ExpertWeights, Key


@dataclass
class HitCounts:
    """Lookups of experts and their hits, as the cache counts them (and :mod:`moestream.cachesim` replays them)."""

    lookups: int = 0
    hits: int = 0
    # hits split by where the expert came from (subsets of ``hits``; the rest are plain cache hits)
    prefetch_hits: int = 0  # read ahead by the prefetcher (``--prefetch-ahead``)
    pinned_hits: int = 0  # held by a pin of the cache policy

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class CacheStats(HitCounts):
    """Cache counters. ``lookups == hits + misses``; every miss is one expert read."""

    misses: int = 0
    evictions: int = 0
    preloaded: int = 0


class ExpertCache:
    """LRU cache of experts with a byte budget, fed by an :class:`ExpertStore`.

    Args:
        store: reads missing experts.
        budget_bytes: bytes of experts to keep, or ``None`` for every expert.
        num_experts: layer index -> experts in that layer (sizes the usage counters).
        policy: the eviction policy (default :class:`~moestream.policies.LRUPolicy`); it
            orders the experts that are neither in use nor pinned.

    Experts pinned with :meth:`pin` (a hot list, a usage profile, a pin file) are never
    evicted; their bytes count against the budget.

    Attributes:
        stats: :class:`CacheStats`.
        usage: layer -> int64 tensor [num_experts] of how many token routings chose
            each expert (used for distinct-experts-per-layer and usage profiles).
    """

    serves_compiled_layers = True  # counts the compiled decoder layer's hits (record_hits, evict_hooks)

    def __init__(
        self, store: ExpertStore, budget_bytes: int | None, num_experts: dict[int, int],
        policy: EvictionPolicy | None = None,
    ):
        self.store = store
        self.policy = policy if policy is not None else LRUPolicy()
        self.pinned_keys: set[Key] = set()  # pinned for good: never evicted
        self.pinned_bytes = 0
        self._protect: set[Key] = set()  # the experts of the fetch under way: evicted last
        self.budget_bytes = budget_bytes
        self.device = store.device
        self.stats = CacheStats()
        self.usage = {layer: torch.zeros(n, dtype=torch.int64) for layer, n in num_experts.items()}
        self._entries: OrderedDict[Key, ExpertWeights] = OrderedDict()
        self._pins: dict[Key, int] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self.prefetcher = None  # a moestream.prefetch.Prefetcher (--prefetch-ahead), set by engine.load
        self.evict_hooks: list = []  # called with each evicted key (a compiled layer's expert table lets go of it)

    # -- queries -----------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys_lru_first(self) -> list[Key]:
        """Cached keys the policy may evict, first to be evicted first (LRU: least to most
        recently used). Pinned experts are not listed."""
        return self.policy.order()

    def held(self, layer: int) -> list[tuple[int, ExpertWeights]]:
        """``(expert, weights)`` of each expert of ``layer`` cached now."""
        return [(key[1], ew) for key, ew in self._entries.items() if key[0] == layer]

    def pinned(self) -> set[Key]:
        return set(self._pins)

    # -- policy ------------------------------------------------------------------------
    def _pin(self, key: Key) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, key: Key) -> None:
        n = self._pins[key] - 1
        if n:
            self._pins[key] = n
        else:
            del self._pins[key]

    def _insert(self, ew: ExpertWeights) -> ExpertWeights:
        """Cache ``ew`` as read; return the entry to hand out (a tiered cache hands out a device copy)."""
        if ew.key not in self.pinned_keys:
            self.policy.admit(ew.key)
        self._entries[ew.key] = ew
        self.used_bytes += ew.nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return ew

    def _read(self, keys: list[Key]):
        """Start reading the missing ``keys``: an iterable of experts in completion order with a
        ``close()`` (the store's batch; a tiered cache serves its host tier first)."""
        return self.store.submit(keys)

    def _shrink(self) -> None:
        """Evict the policy's victims until within budget: experts neither in use nor pinned,
        those of the fetch under way last."""
        if self.budget_bytes is None or self.used_bytes <= self.budget_bytes:
            return
        busy = self._pins.__contains__
        while self.used_bytes > self.budget_bytes:
            key = self.policy.victim(lambda k: k in self._pins or k in self._protect)
            if key is None:
                key = self.policy.victim(busy)
            if key is None:
                break
            self.policy.remove(key)
            ew = self._entries.pop(key)
            for hook in self.evict_hooks:
                hook(key)
            self.used_bytes -= ew.nbytes
            self.stats.evictions += 1
            self.store.release(ew)  # its buffer may serve the next read

    # -- use ---------------------------------------------------------------------------
    def holds(self, key: Key) -> bool:
        """Whether ``key`` is cached now (so :meth:`fetch` hands it out at once, before any read)."""
        return key in self._entries

    def fetch(
        self, layer: int, experts: list[int], counts: list[int] | None = None
    ) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield ``(expert, weights)`` for each of ``experts`` of ``layer``.

        Cached experts come first, while the missing ones are being read; missing experts
        follow in the order their reads complete. Each yielded expert stays pinned until
        the caller asks for the next one (or closes the iterator), so callers must not
        keep its tensors after that. ``counts[i]`` is how many token routings chose
        ``experts[i]`` (default 1), recorded in :attr:`usage`.

        Raises:
            ReadError: from the store, naming the expert and file; nothing partially
                read is cached.
        """
        usage = self.usage.get(layer)
        hits: list[ExpertWeights] = []
        misses: list[Key] = []
        pf, prefetched = self.prefetcher, []
        for i, e in enumerate(experts):
            key = (layer, e)
            if usage is not None:
                usage[e] += 1 if counts is None else counts[i]
            self.stats.lookups += 1
            ew = self._entries.get(key)
            if ew is None and pf is not None and pf.pending(key):  # read ahead: no read on the critical path
                self.stats.hits += 1
                self.stats.prefetch_hits += 1
                prefetched.append(key)
                continue
            if ew is None:
                self.stats.misses += 1
                misses.append(key)
            else:
                self.stats.hits += 1
                if key in self.pinned_keys:
                    self.stats.pinned_hits += 1
                self._entries.move_to_end(key)
                self._pin(key)
                hits.append(ew)
        # the policy sees hits, then read-ahead experts, then misses, each in request order,
        # whatever order reads finish in
        for key in [ew.key for ew in hits] + prefetched + misses:
            if key not in self.pinned_keys:
                self.policy.record(key)
        self._protect = {(layer, e) for e in experts}
        held = [ew.key for ew in hits]
        batch = None
        try:
            batch = self._read(misses) if misses else None
            if pf is not None:
                pf.retire(layer, prefetched)
                pf.issue()  # reads ahead for the next layers queue behind this layer's misses
            for ew in hits:
                yield ew.key[1], ew
                self._unpin(ew.key)
                held.remove(ew.key)
            yield from self._admitted(pf.take(prefetched) if prefetched else (), held)  # as misses are
            if batch is not None:
                yield from self._admitted(batch, held)
        finally:
            if batch is not None:
                batch.close()
            for key in held:
                self._unpin(key)
            self._shrink()
            self._protect = set()

    def record_hits(self, layer: int, experts: list[int], counts: list[int],
                    as_tensors: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Count a use of ``layer``'s ``experts`` (all held now; ``counts[i]`` token routings chose ``experts[i]``)
        computed without :meth:`fetch` (the compiled decoder layer reads them where the cache holds them): the
        counters, usage and policy as a :meth:`fetch` of them that hit everywhere. ``as_tensors``: the same two
        lists as int64 tensors (the usage counters then take one ``index_add_``).

        Raises:
            KeyError: an expert not held."""
        usage = self.usage.get(layer)
        entries, pinned, record = self._entries, self.pinned_keys, self.policy.record
        st = self.stats
        if usage is not None:
            ids, cnt = as_tensors if as_tensors is not None else (torch.tensor(experts), torch.tensor(counts))
            usage.index_add_(0, ids, cnt)
        for e in experts:
            key = (layer, e)
            if key not in entries:
                raise KeyError(f"expert {e} of layer {layer} is not in the cache")
            entries.move_to_end(key)
            if key in pinned:
                st.pinned_hits += 1
        st.lookups += len(experts)
        st.hits += len(experts)
        for e in experts:
            key = (layer, e)
            if key not in pinned:
                record(key)
        self._shrink()  # as a fetch ends (a cache over its budget by experts in use comes back to it)

    def _admitted(self, arrived, held: list):
        """Each expert ``arrived`` (read for this fetch, or ahead for it) inserted and held while the caller
        uses it: ``(expert id, weights)``; ``held`` lists the keys held until the caller moves on."""
        for ew in arrived:
            ew = self._insert(ew)
            self._pin(ew.key)
            held.append(ew.key)
            self._shrink()
            yield ew.key[1], ew
            self._unpin(ew.key)
            held.remove(ew.key)
            self._shrink()

    def close(self) -> None:
        """Release what the cache holds outside the budget's entries (nothing here; a tiered cache
        waits for its copies)."""

    def preload(self, keys: list[Key], progress=None) -> None:
        """Read ``keys`` into the cache (as most recently used), as far as the budget allows.

        ``progress``, if given, is called with each expert's bytes as it arrives.
        """
        keys = [k for k in keys if k not in self._entries]
        with self.store.submit(keys) as batch:
            for ew in batch:
                self._insert(ew)
                self.stats.preloaded += 1
                self._shrink()
                if progress is not None:
                    progress(ew.nbytes)

    def pin(self, keys: list[Key], limit_bytes: int | None = None, progress=None) -> int:
        """Read ``keys`` (hottest first) into the cache and pin them: they are never evicted.

        Pinning stops at the first expert that would take the pinned bytes over
        ``limit_bytes`` (at most the budget; default the budget). Pinned bytes count
        against the budget. With budget ``None`` (every expert resident) nothing needs
        pinning and 0 is returned. ``progress`` is called with each expert's bytes.

        Returns:
            how many experts are newly pinned.

        Raises:
            ReadError: from the store; what was read before stays pinned.
        """
        if self.budget_bytes is None:
            return 0
        limit = self.budget_bytes if limit_bytes is None else min(limit_bytes, self.budget_bytes)
        total, chosen = self.pinned_bytes, []
        for key in dict.fromkeys(keys):
            if key in self.pinned_keys:
                continue
            n = self._entries[key].nbytes if key in self._entries else self.store.cached_nbytes(key)
            if total + n > limit:
                break
            chosen.append(key)
            total += n
        to_read = []
        for key in chosen:
            if key in self._entries:  # already cached: the policy lets go of it
                self.policy.remove(key)
                self.pinned_keys.add(key)
                self.pinned_bytes += self._entries[key].nbytes
            else:
                to_read.append(key)
        with self.store.submit(to_read) as batch:
            for ew in batch:
                self.pinned_keys.add(ew.key)
                self._insert(ew)
                self.pinned_bytes += ew.nbytes
                self.stats.preloaded += 1
                self._shrink()
                if progress is not None:
                    progress(ew.nbytes)
        return len(chosen)

    def distinct_experts(self) -> dict[int, int]:
        """Layer -> how many distinct experts the routings so far have used."""
        return {layer: int((u > 0).sum()) for layer, u in self.usage.items()}
