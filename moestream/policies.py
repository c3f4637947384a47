"""Eviction policies of the expert cache: which cached expert goes first when over budget.

A policy sees every lookup (:meth:`EvictionPolicy.record`, hit or miss, in lookup order)
and every expert entering or leaving the cache (:meth:`~EvictionPolicy.admit`,
:meth:`~EvictionPolicy.remove`), and names the next victim on request. Policies only
order keys; they never change what a layer computes, so every policy gives the same
output bits. The same classes drive the real cache (:mod:`moestream.cache`) and the
trace simulator (:mod:`moestream.cachesim`), so simulated hit rates are the cache's.

Every policy here keeps a priority per key (lower = evicted first) in a heap with lazy
invalidation: a key's heap entry is valid while it matches the key's current priority.

- ``lru``: least recently used (priority = the stamp of the last lookup).
- ``lfu``: least frequently used with exponential decay (priority = sum over past
  lookups of ``2^(stamp / half_life)``, ties broken by recency). Counts are kept for
  every expert ever looked up, not only cached ones ("perfect" LFU).
- ``layer``: evicts from the MoE layer whose next visit is furthest away in the
  forward pass's cyclic layer order (the layer that just ran), LFU-decay within a
  layer: an online approximation of Belady's MIN for the layer-by-layer access pattern.
- Belady's MIN (offline, Belady 1966: evict the key whose next use is furthest in the
  future) lives in :mod:`moestream.cachesim`; it needs the whole trace.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable

Key = tuple[int, int]  # (layer, expert)
Skip = Callable[[Key], bool]


class EvictionPolicy(ABC):
    """Orders the cached experts for eviction. Driven from one thread."""

    name = ""

    @abstractmethod
    def record(self, key: Key) -> None:
        """One lookup of ``key`` (a hit or a miss), in lookup order."""

    @abstractmethod
    def admit(self, key: Key) -> None:
        """``key`` entered the cache (after its lookup was recorded, or by a preload)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` left the cache (evicted) or is no longer the policy's (pinned)."""

    @abstractmethod
    def victim(self, skip: Skip) -> Key | None:
        """The cached key to evict next among those for which ``skip(key)`` is false, or None."""

    @abstractmethod
    def order(self) -> list[Key]:
        """The cached keys, first to be evicted first."""


class PriorityPolicy(EvictionPolicy):
    """A policy given by a priority per key: the lowest-priority cached key is evicted first."""

    def __init__(self):
        self._stamp = 0  # lookups so far
        self._prio: dict[Key, tuple] = {}  # every key seen
        self._cached: set[Key] = set()
        self._heap: list[tuple[tuple, Key]] = []

    @abstractmethod
    def _bump(self, key: Key, stamp: int) -> tuple:
        """The new priority of ``key`` after a lookup at ``stamp``."""

    def _initial(self, key: Key, stamp: int) -> tuple:
        """The priority of a key preloaded without any lookup (default: a lookup now)."""
        return self._bump(key, stamp)

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self._prio[key], key))
        if len(self._heap) > 4 * len(self._cached) + 64:  # drop stale entries
            self._heap = [(self._prio[k], k) for k in self._cached]
            heapq.heapify(self._heap)

    def record(self, key: Key) -> None:
        self._prio[key] = self._bump(key, self._stamp)
        self._stamp += 1
        if key in self._cached:
            self._push(key)

    def admit(self, key: Key) -> None:
        if key not in self._prio:
            self._prio[key] = self._initial(key, self._stamp)
        self._cached.add(key)
        self._push(key)

    def remove(self, key: Key) -> None:
        self._cached.discard(key)

    def victim(self, skip: Skip) -> Key | None:
        return _heap_victim(self._heap, self._cached, self._prio, skip)

    def order(self) -> list[Key]:
        return sorted(self._cached, key=lambda k: (self._prio[k], k))


class LRUPolicy(PriorityPolicy):
    """Least recently used: the key whose last lookup is oldest goes first."""

    name = "lru"

    def _bump(self, key: Key, stamp: int) -> tuple:
        return (stamp,)


class LFUDecayPolicy(PriorityPolicy):
    """Least frequently used with exponential decay; ties go to the least recently used.

    A lookup at stamp ``t`` adds ``2^(t / half_life)`` to its key's score, so a lookup
    ``half_life`` lookups old weighs half a fresh one (growing the increment instead of
    decaying every score keeps a lookup O(log n); scores are rescaled before they
    overflow).

    Args:
        half_life: in lookups (> 0).
    """

    name = "lfu"

    def __init__(self, half_life: float):
        super().__init__()
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0 lookups, got {half_life}")
        self.half_life = float(half_life)
        self._score: dict[Key, float] = {}
        self._base = 0  # stamps are counted from here in the weight

    def _weight(self, stamp: int) -> float:
        w = 2.0 ** ((stamp - self._base) / self.half_life)
        if w > 1e200:  # rescale every score (the order is unchanged)
            scale = 2.0 ** (-(stamp - self._base) / self.half_life)
            self._base = stamp
            for k in self._score:
                self._score[k] *= scale
                self._prio[k] = (self._score[k], *self._prio[k][1:])
            self._heap = [(self._prio[k], k) for k in self._cached]
            heapq.heapify(self._heap)
            w = 1.0
        return w

    def _bump(self, key: Key, stamp: int) -> tuple:
        s = self._score.get(key, 0.0) + self._weight(stamp)
        self._score[key] = s
        return (s, stamp)

    def _initial(self, key: Key, stamp: int) -> tuple:
        self._score.setdefault(key, 0.0)
        return (self._score[key], stamp)


class LayerCyclePolicy(LFUDecayPolicy):
    """Evicts from the layer visited furthest in the future; LFU-decay within a layer.

    A forward pass visits the MoE layers in a cycle, so right after layer ``l`` ran, its
    experts are the ones needed last (a whole pass away) -- the choice Belady's MIN makes
    when routing is near uniform -- whereas LRU evicts exactly the layer needed next.
    The policy learns the cycle from the lookups (the layers in ascending order) and
    scans layers from the one just looked up backwards.

    Args:
        half_life: in lookups, for the within-layer LFU-decay order.
    """

    name = "layer"

    def __init__(self, half_life: float):
        super().__init__(half_life)
        self._layers: list[int] = []
        self._current: int | None = None
        self._by_layer: dict[int, list[tuple[tuple, Key]]] = {}
        self._n: dict[int, int] = {}  # cached keys per layer

    def _see(self, layer: int) -> None:
        if layer not in self._by_layer:
            self._by_layer[layer] = []
            self._n[layer] = 0
            self._layers = sorted(self._by_layer)

    def record(self, key: Key) -> None:
        self._see(key[0])
        self._current = key[0]
        super().record(key)

    def admit(self, key: Key) -> None:
        self._see(key[0])
        if key not in self._cached:
            self._n[key[0]] += 1
        super().admit(key)

    def remove(self, key: Key) -> None:
        if key in self._cached:
            self._n[key[0]] -= 1
        super().remove(key)

    def _push(self, key: Key) -> None:
        heap = self._by_layer[key[0]]
        heapq.heappush(heap, (self._prio[key], key))
        if len(heap) > 4 * self._n[key[0]] + 64:  # drop stale entries
            heap[:] = [(self._prio[k], k) for k in self._cached if k[0] == key[0]]
            heapq.heapify(heap)

    def _weight(self, stamp: int) -> float:
        w = 2.0 ** ((stamp - self._base) / self.half_life)
        if w > 1e200:
            scale = 2.0 ** (-(stamp - self._base) / self.half_life)
            self._base = stamp
            for k in self._score:
                self._score[k] *= scale
                self._prio[k] = (self._score[k], *self._prio[k][1:])
            for layer, heap in self._by_layer.items():
                heap[:] = [(self._prio[k], k) for k in self._cached if k[0] == layer]
                heapq.heapify(heap)
            w = 1.0
        return w

    def _scan(self) -> list[int]:
        """Layers from the furthest next visit to the nearest: the current one, then backwards."""
        if not self._layers:
            return []
        i = self._layers.index(self._current) if self._current in self._layers else len(self._layers) - 1
        return [self._layers[(i - j) % len(self._layers)] for j in range(len(self._layers))]

    def victim(self, skip: Skip) -> Key | None:
        for layer in self._scan():
            found = _heap_victim(self._by_layer[layer], self._cached, self._prio, skip)
            if found is not None:
                return found
        return None

    def order(self) -> list[Key]:
        rank = {layer: i for i, layer in enumerate(self._scan())}
        return sorted(self._cached, key=lambda k: (rank.get(k[0], 0), self._prio[k], k))


POLICIES = ("lru", "lfu", "layer")


def _heap_victim(heap: list, cached, prio: dict, skip: Skip) -> Key | None:
    """The lowest-priority key of ``heap`` (``(priority, key)`` items, lazily deleted: an item whose key is no
    longer ``cached`` or whose priority is not ``prio[key]`` is stale and dropped) that ``skip`` does not skip;
    it stays on the heap (still cached until ``remove``), as do the skipped ones. None when there is none."""
    skipped, found = [], None
    while heap:
        p, key = heapq.heappop(heap)
        if key not in cached or p != prio[key]:
            continue  # stale
        if skip(key):
            skipped.append((p, key))
            continue
        found = (p, key)
        break
    for item in skipped:
        heapq.heappush(heap, item)
    if found is not None:
        heapq.heappush(heap, found)
        return found[1]
    return None


def make_policy(name: str, half_life: float = 1024.0) -> EvictionPolicy:
    """A policy by name (``lru``, ``lfu``, ``layer``); ``half_life`` in lookups for the LFU-based ones.

    Raises:
        ValueError: for an unknown name.
    """
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUDecayPolicy(half_life)
    if name == "layer":
        return LayerCyclePolicy(half_life)
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
