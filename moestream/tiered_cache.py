"""The GPU tier of the expert cache: experts in device memory (VRAM), a second LRU tier of
experts in pinned host memory, the disk behind both.

:class:`TieredExpertCache` is an :class:`~moestream.cache.ExpertCache` whose entries live
on the compute device (``--cache-budget-gb`` is the VRAM budget) and whose misses are
served, in this order, by

1. the host tier (:class:`~moestream.host_tier.HostTier`, ``--host-cache-gb``): an LRU of experts kept in
   their read buffers, which are page-locked (pinned) host memory, so a hit costs one
   asynchronous host-to-device copy;
2. the expert store: a read from disk (``O_DIRECT`` where allowed) straight into a pinned
   buffer of :class:`~moestream.host_tier.PinnedBufferPool`, then the same copy. The read buffer then stays
   in the host tier (when it has room) or goes back to the pool once its copy is done.

Copies run on a side CUDA stream (:class:`~moestream.copy_engine.CopyEngine`): each expert's buffer goes over in
one ``cudaMemcpyAsync`` from pinned memory, an event is recorded after it, and the compute
stream waits on that event, so the host thread never blocks on a copy and disk reads of
later experts overlap the copies of earlier ones. A host buffer is reused or freed only
after the event of its last copy has completed.

With ``slots=True`` (the fused MoE kernel's cache, :mod:`moestream.fused_moe`) the VRAM tier is a
:class:`~moestream.slot_pool.SlotPool`: every expert of the model has the same byte layout, so the tier is one
preallocated ``[capacity, slot_bytes]`` device buffer; the cache maps ``(layer, expert)`` to a
slot and a device-side table gives each layer's expert -> slot (-1: not resident), which the
kernel reads, so a hit costs the host nothing. A slot is refilled only after the event of its
last use (the compute that read it) and its new contents are read only after the event of their
copy, so copies for later layers (:meth:`TieredExpertCache.stage`) run beside compute.

With ``device="cpu"`` the same class runs on the CPU: the "device" tier is a second set of
host tensors and copies are synchronous. The tests drive the tier logic that way.

The bytes that reach the device are the bytes on disk, whatever tier they came through,
so the cache state never reaches the arithmetic.
"""


from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .cache import ExpertCache
from .copy_engine import CopyEngine
from .counters import Counters
from .errors import ConfigError, given
from .host_tier import HostTier, PinnedBufferPool
from .policies import EvictionPolicy
from .slot_pool import SlotPool, expert_slot_layout
from .store import ExpertStore, ExpertWeights, Key


@dataclass
class TierStats(Counters):
    """Counters of the tiers, beyond :class:`~moestream.cache.CacheStats` (whose ``hits`` are VRAM hits).

    ``host_hits``: experts missing from VRAM found in the host tier; ``disk_reads``: experts
    read from disk for a fetch (the rest of the VRAM misses); ``h2d_bytes`` / ``h2d_copies``:
    bytes and copies host-to-device; ``host_evictions``: experts dropped from the host tier.
    """

    host_hits: int = 0
    disk_reads: int = 0
    h2d_bytes: int = 0
    h2d_copies: int = 0
    host_evictions: int = 0
    staged: int = 0  # experts copied from the host tier ahead of their layer (TieredExpertCache.stage)


class _Folded:
    """An attribute of :class:`TieredExpertCache` kept as ``_<name>`` and read after ``_fold_pending``: reading
    the counters first counts the routings of all-resident layers not yet counted."""

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        cache._fold_pending()
        return getattr(cache, self.attr)

    def __set__(self, cache, value) -> None:
        setattr(cache, self.attr, value)


class _TierReads:
    """A fetch's VRAM misses: host-tier hits first (no read), then the store's reads as they complete.

    Iterates host :class:`~moestream.store.ExpertWeights`; ``close`` closes the store's batch.
    """

    def __init__(self, cache: "TieredExpertCache", keys: list[Key]):
        self._cache = cache
        self._host = []
        to_read = []
        for key in keys:
            ew = cache.host.get(key)
            if ew is not None:
                self._host.append(ew)
            else:
                to_read.append(key)
        cache.tier_stats.host_hits += len(self._host)
        cache.tier_stats.disk_reads += len(to_read)
        self._batch = cache.store.submit(to_read) if to_read else None

    def __iter__(self) -> Iterator[ExpertWeights]:
        yield from self._host
        if self._batch is not None:
            yield from self._batch

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()


class TieredExpertCache(ExpertCache):
    """An expert cache in device memory with a host-RAM tier behind it.

    Args:
        store: reads experts into host buffers (its pool should be a
            :class:`PinnedBufferPool` on CUDA; its device is the CPU).
        budget_bytes: bytes of experts kept on ``device`` (None: every expert).
        num_experts, policy: as :class:`~moestream.cache.ExpertCache` (the policy orders
            the device tier).
        device: the compute device (``cuda``, or ``cpu`` to run the tier logic on the CPU).
        host_budget_bytes: bytes of experts kept in the host tier (LRU; 0: none).
        slots: keep the device tier in a :class:`SlotPool` (the fused MoE kernel reads it in
            place); needs every expert in one layout, else :attr:`pool` stays None.

    The device tier keeps the base class's behaviour (policy, pins, protection of the fetch
    under way, counters); entering it is a host-to-device copy (:class:`CopyEngine`). ``key in
    cache`` is true for experts held in either tier, so the prefetcher (``--prefetch-ahead``)
    reads ahead from disk only what neither holds.

    With a slot pool, a layer's experts stay in their slots from its fetch until
    :meth:`end_layer` (the kernel that reads them is queued in between): between
    :meth:`hold` and :meth:`end_layer` nothing of the fetch is evicted, and the cache can
    exceed its budget by one layer's experts (the pool has at least that many slots, and pins
    leave them free).

    Attributes:
        tier_stats: :class:`TierStats`; host: the :class:`HostTier`; copier: the
            :class:`CopyEngine`; pool: the :class:`SlotPool` or None.
    """

    serves_compiled_layers = False  # its own tiers and eviction: the pipeline's fetch path only

    def __init__(self, store: ExpertStore, budget_bytes: int | None, num_experts: dict[int, int],
                 policy: EvictionPolicy | None = None, device: torch.device | str = "cuda",
                 host_budget_bytes: int = 0, slots: bool = False):
        self._log: list[tuple[int, torch.Tensor]] = []  # routings of all-resident layers, not yet counted
        self._host_log: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
        self._pending: list[tuple[list[tuple[int, int]], torch.Tensor, object]] = []
        super().__init__(store, budget_bytes, num_experts, policy)
        self.device = torch.device(device)
        self.copier = CopyEngine(self.device)
        self.host = HostTier(max(0, host_budget_bytes), store.release, max_pending=max(16, 2 * store.workers))
        self.tier_stats = TierStats()
        self.pool: SlotPool | None = None
        self._hold = False
        self._held: list[Key] = []
        self._staging: set[Key] = set()
        self.total_experts = sum(num_experts.values())
        self._widest = max(num_experts.values(), default=0)  # the most experts one layer's fetch can hold
        if slots:
            keys = [(layer, e) for layer, n in num_experts.items() for e in range(n)]
            layout = expert_slot_layout(store, keys)
            if layout is not None:
                one = store.cached_nbytes(keys[0])
                capacity = self.total_experts if budget_bytes is None else min(
                    self.total_experts, max(budget_bytes // one, self._widest))
                self.pool = SlotPool(layout, capacity, num_experts, self.device)

    # -- counters of all-resident layers (counted from the device routing, lazily) -----------
    stats = _Folded()
    usage = _Folded()

    def _fold_pending(self) -> None:
        """Count the routings of all-resident layers not yet counted, before the counters are read."""
        if self._log or self._host_log or self._pending:
            self._fold()

    @property
    def all_resident(self) -> bool:
        """Every expert of the model is in its VRAM slot: a layer needs nothing from the host."""
        return self.pool is not None and len(self._entries) == self.total_experts

    def log_routing(self, layer: int, idx: torch.Tensor) -> None:
        """Count ``layer``'s routing ``idx`` [T, K] (device, int64) as lookups and hits later, without a sync.

        Only while :attr:`all_resident`: every expert is a hit and nothing is evicted, so only
        the counters (``stats``, ``usage``) need the routing, and they fold it in when read.
        """
        self._log.append((layer, idx))

    def take_log(self) -> list[tuple[int, torch.Tensor]]:
        """The routings logged since the last call (a decode step's), for a caller that copies them to
        the host itself (:meth:`log_pending`)."""
        log, self._log = self._log, []
        return log

    def log_pending(self, sizes: list[tuple[int, int]], ids: torch.Tensor, event) -> None:
        """``ids`` (host int64, pinned) will hold, once ``event`` completes, the routings of layers
        ``sizes`` ((layer, slots) each), concatenated. Folded into the counters when read, or at
        :meth:`settle` (before the buffer is written again)."""
        self._pending.append((sizes, ids, event))

    def settle(self, keep: int = 0) -> None:
        """Copy the pending routings out of their buffers (waiting for their events), so the buffers can be
        written again; all but the newest ``keep`` (a decode loop's ring of buffers: the older ones are long
        done, so it does not wait for the step in flight)."""
        while len(self._pending) > keep:
            sizes, ids, event = self._pending.pop(0)
            CopyEngine.wait(event)
            self._host_log.append((sizes, ids.clone()))

    def _fold(self) -> None:
        self.settle()
        log, self._log = self._log, []
        parts = []
        if log:
            flat = torch.cat([i.reshape(-1) for _, i in log]).cpu()  # one sync, when the counters are read
            parts.append(([(layer, i.numel()) for layer, i in log], flat))
        parts += self._host_log
        self._host_log = []
        # steps of one layout (every decode step's) stacked: a few vectorized ops per layer, not per step
        groups: dict[tuple, list[torch.Tensor]] = {}
        for sizes, flat in parts:
            groups.setdefault(tuple(sizes), []).append(flat)
        for sizes, flats in groups.items():
            rows = torch.stack([f[: sum(n for _, n in sizes)] for f in flats]).long()  # [steps, slots]
            at = 0
            for layer, n in sizes:
                ids = rows[:, at : at + n]
                at += n
                use = self._usage.get(layer)
                if use is None or n == 0:
                    continue
                use += torch.bincount(ids.reshape(-1), minlength=use.numel())
                ordered = ids.sort(dim=1).values
                distinct = ids.shape[0] + int((ordered[:, 1:] != ordered[:, :-1]).sum())
                self._stats.lookups += distinct
                self._stats.hits += distinct

    # -- tiers ----------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._entries or key in self.host

    def _read(self, keys: list[Key]):
        return _TierReads(self, keys)

    def _insert(self, ew: ExpertWeights) -> ExpertWeights:
        """Copy the host expert ``ew`` to the device, keep or release its host buffer, and cache the device copy."""
        if self.pool is None:
            dev, event = self.copier.to_device(ew)
            nbytes = dev.nbytes
        else:
            pool = self.pool
            if not pool.free_slots:
                self._evict_for_slot()
            slot = pool.take(ew.key)
            ahead = ew.key in self._staging  # copied ahead of its layer: compute waits at that layer
            event = self.copier.copy_into(ew, pool.row(slot), pool.tensors(slot), after=pool.last_use[slot],
                                          wait=not ahead)
            pool.last_use[slot] = None
            pool.ready[slot] = event if ahead else None
            nbytes = ew.nbytes
            dev = ExpertWeights(ew.key, pool.tensors(slot), nbytes, None)
        self.tier_stats.h2d_bytes += nbytes
        self.tier_stats.h2d_copies += 1
        self.host.copied(ew, event, self._protect | self._staging)
        self.tier_stats.host_evictions = self.host.evictions
        return super()._insert(dev)

    def _busy(self, key: Key) -> bool:
        """In use, part of the fetch under way (its kernel is yet to be queued), or being staged."""
        return key in self._pins or key in self._protect or key in self._staging or key in self._held

    def _evict(self, key: Key) -> None:
        self.policy.remove(key)
        ew = self._entries.pop(key)
        self.used_bytes -= ew.nbytes
        self._stats.evictions += 1
        if self.pool is not None:
            self.pool.give(key)
        else:
            self.store.release(ew)

    def _evict_for_slot(self) -> None:
        key = self.policy.victim(self._busy)
        if key is None:
            raise RuntimeError(f"every one of the {self.pool.capacity} VRAM slots holds an expert in use")
        self._evict(key)

    def _shrink(self) -> None:
        if self.pool is None:
            return super()._shrink()
        if self._hold or self.budget_bytes is None:
            return
        while self.used_bytes > self.budget_bytes:
            key = self.policy.victim(self._busy)
            if key is None:
                break
            self._evict(key)

    def fetch(self, layer: int, experts: list[int], counts: list[int] | None = None):
        self.host.reap()
        for e in experts:
            self.host.touch((layer, e))
        return super().fetch(layer, experts, counts)

    # -- the slot pool's layer protocol (moestream.pipeline) ------------------------------------
    def hold(self, layer: int, experts: list[int]) -> None:
        """A layer's fetch starts: keep its experts in their slots until :meth:`end_layer`."""
        self._hold = True
        self._held = [(layer, e) for e in experts]

    def ready(self) -> None:
        """Before the kernel of the layer just fetched: publish the slot table, and make the compute
        stream wait for the copies of its experts that were staged ahead."""
        pool = self.pool
        for key in self._held:
            slot = pool.slot_of.get(key)
            if slot is not None and pool.ready[slot] is not None:
                if self.copier.cuda:
                    torch.cuda.current_stream(self.device).wait_event(pool.ready[slot])
                pool.ready[slot] = None
        pool.flush()

    def end_layer(self) -> None:
        """The kernel reading the held layer's slots is queued: their next copy waits for it; evict to
        the budget."""
        event = None
        if self.copier.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.pool.mark_used(self._held, event)
        self._hold, self._held = False, []
        self._shrink()
        self.host.reap()

    def stage(self, keys: list[Key]) -> int:
        """Start copying those of ``keys`` that only the host tier holds into VRAM slots now, ahead of
        their layer (beside the compute queued so far); returns how many. The compute stream waits
        for each copy at its layer (:meth:`ready`)."""
        if self.pool is None:
            return 0
        todo = [k for k in dict.fromkeys(keys) if k not in self._entries and k in self.host]
        self._staging = set(todo)
        n = 0
        try:
            for key in todo:
                if not self.pool.free_slots and self.policy.victim(self._busy) is None:
                    break
                ew = self.host.get(key)
                self._insert(ew)
                self.tier_stats.staged += 1
                n += 1
                self._shrink()
        finally:
            self._staging = set()
        return n

    def pin(self, keys: list[Key], limit_bytes: int | None = None, progress=None) -> int:
        """As :meth:`ExpertCache.pin`; with a slot pool, pins leave one layer's experts' slots free."""
        if self.pool is not None and self.budget_bytes is not None:
            one = self.store.cached_nbytes(keys[0]) if keys else 1
            room = max(0, self.pool.capacity - self._widest) * one
            limit_bytes = room if limit_bytes is None else min(limit_bytes, room)
        return super().pin(keys, limit_bytes, progress)

    def describe_tiers(self) -> str:
        """One line on the tiers, for the user."""
        vram = "every expert" if self.budget_bytes is None else f"{self.budget_bytes / 1e9:.2f} GB"
        host = f"{self.host.budget_bytes / 1e9:.2f} GB pinned" if self.host.budget_bytes else "none"
        slots = f" ({self.pool.capacity} slots)" if self.pool is not None else ""
        return f"device {self.device}: expert cache {vram}{slots} in device memory, host tier {host}"

    def close(self) -> None:
        """Wait for copies in flight, give every host buffer back, and unregister the pinned pool."""
        self.host.close()
        if self.copier.cuda:
            torch.cuda.synchronize(self.device)
        pool = self.store.pool
        if isinstance(pool, PinnedBufferPool):
            pool.close()


def resolve_device(device: str | torch.device | None, name: str = "--device") -> torch.device:
    """``auto`` (or None): the ``MOESTREAM_DEVICE`` environment variable when set, else ``cuda`` when a
    CUDA device is available, else ``cpu``; otherwise the device named (``name``: the option, as the caller gave
    it, for the messages).

    Raises:
        ConfigError: for a device that is not ``cpu``, ``cuda`` or ``cuda:N``, or CUDA asked for
            where none is available.
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        device = os.environ.get("MOESTREAM_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    said = given(name, repr(device), ": ")  # --device: 'tpu', device='tpu'
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{said}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{said}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{given(name, device)}: no CUDA device is available to this PyTorch ({torch.__version__})")
    return dev


def device_free_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, in bytes (``cudaMemGetInfo``)."""
    return int(torch.cuda.mem_get_info(device)[0])
