"""The GPU tier of the expert cache: experts in device memory (VRAM), a second LRU tier of
experts in pinned host memory, the disk behind both.

:class:`TieredExpertCache` is an :class:`~moestream.cache.ExpertCache` whose entries live
on the compute device (``--cache-budget-gb`` is the VRAM budget) and whose misses are
served, in this order, by

1. the host tier (:class:`HostTier`, ``--host-cache-gb``): an LRU of experts kept in
   their read buffers, which are page-locked (pinned) host memory, so a hit costs one
   asynchronous host-to-device copy;
2. the expert store: a read from disk (``O_DIRECT`` where allowed) straight into a pinned
   buffer of :class:`PinnedBufferPool`, then the same copy. The read buffer then stays
   in the host tier (when it has room) or goes back to the pool once its copy is done.

Copies run on a side CUDA stream (:class:`CopyEngine`): each expert's buffer goes over in
one ``cudaMemcpyAsync`` from pinned memory, an event is recorded after it, and the compute
stream waits on that event, so the host thread never blocks on a copy and disk reads of
later experts overlap the copies of earlier ones. A host buffer is reused or freed only
after the event of its last copy has completed.

With ``device="cpu"`` the same class runs on the CPU: the "device" tier is a second set of
host tensors and copies are synchronous. The tests drive the tier logic that way.

The bytes that reach the device are the bytes on disk, whatever tier they came through,
so the cache state never reaches the arithmetic.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .cache import ExpertCache
from .errors import ConfigError
from .policies import EvictionPolicy
from .store import BufferPool, ExpertStore, ExpertWeights, Key


@dataclass
class TierStats:
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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _address(m) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a refused registration, so the next kernel launch does not report it."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except OSError:
            continue


def cuda_host_register(addr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``addr`` for CUDA (``cudaHostRegister``); True on success."""
    for attempt in range(2):
        try:
            ok = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)) == 0
        except Exception:  # noqa: BLE001 -- a binding missing or refusing: copies stay correct, only slower
            ok = False
        if ok:
            return True
        _clear_cuda_error()
        if attempt == 0:  # a stale registration at this address (memory unmapped while registered): drop it
            cuda_host_unregister(addr)
            _clear_cuda_error()
    return False


def cuda_host_unregister(addr: int) -> None:
    """Undo :func:`cuda_host_register` (before the memory is unmapped)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(addr)
    except Exception:  # noqa: BLE001
        pass


class PinnedBufferPool(BufferPool):
    """A :class:`~moestream.store.BufferPool` whose mappings are page-locked for the device.

    Each mapping is registered once (``register(address, nbytes) -> bool``) when created,
    stays registered while the pool recycles it, and is unregistered before it is dropped.
    Registering a private mapping (rather than pinned allocations, which PyTorch's host
    allocator rounds up to a power of two: 16 MiB for a 9.44 MB expert) keeps pinned memory
    to the experts' own size. If registering fails, the pool warns once and hands out
    plain buffers (copies are then staged by the driver: correct, slower).
    """

    def __init__(self, max_free: int, register: Callable[[int, int], bool] = cuda_host_register,
                 unregister: Callable[[int], None] = cuda_host_unregister):
        super().__init__(max_free)
        self._register, self._unregister = register, unregister
        self._pinned: set[int] = set()
        self._plock = threading.Lock()
        self.failed = False
        self.registered_bytes = 0

    def get(self, nbytes: int):
        m, t, v = super().get(nbytes)
        addr = _address(m)
        with self._plock:
            fresh = addr not in self._pinned and not self.failed
        if fresh:
            if self._register(addr, len(m)):
                with self._plock:
                    self._pinned.add(addr)
                    self.registered_bytes += len(m)
            else:
                self.failed = True
                print("warning: could not page-lock expert buffers (cudaHostRegister); host-to-device copies "
                      "go through the driver's staging (slower)", file=sys.stderr)
        return m, t, v

    def put(self, m) -> None:
        with self._lock:
            if self._count < self.max_free:
                self._free.setdefault(len(m), []).append(m)
                self._count += 1
                return
        addr = _address(m)
        with self._plock:
            known = addr in self._pinned
            self._pinned.discard(addr)
            if known:
                self.registered_bytes -= len(m)
        if known:
            self._unregister(addr)

    def is_pinned(self, m) -> bool:
        with self._plock:
            return _address(m) in self._pinned

    def close(self) -> None:
        """Unregister every mapping still registered and drop the free ones. A registered mapping
        must never be unmapped: a new mapping at the same address could not be registered
        (the driver would still hold the old pages), so pools are closed, not just dropped."""
        with self._plock:
            addrs, self._pinned = list(self._pinned), set()
            self.registered_bytes = 0
        for addr in addrs:
            self._unregister(addr)
        with self._lock:  # unmapped only now, unregistered
            self._free.clear()
            self._count = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


class CopyEngine:
    """Host-to-device copies of experts on a side stream, with an event per copy.

    Args:
        device: the compute device. ``cpu`` makes copies synchronous host copies with no
            events (the tier logic then runs unchanged on the CPU).

    Attributes:
        h2d_bytes, copies: bytes and copies issued.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.h2d_bytes = 0
        self.copies = 0

    def to_device(self, ew: ExpertWeights):
        """Start copying expert ``ew`` (host tensors) to the device.

        Returns ``(device ExpertWeights, event)``; the event (None on the CPU) completes
        when the copy has landed. The compute stream is made to wait on it, so kernels
        queued after this call see the copied bytes; the host buffer must stay untouched
        until the event completes. When every tensor is a contiguous view of one buffer
        (the store's layout), the whole buffer goes in one copy and the device tensors are
        views at the same byte offsets.
        """
        tensors = ew.tensors
        storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        one = len(storages) == 1 and all(t.is_contiguous() for t in tensors.values())
        event = None
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            # the destination may be memory the compute stream just freed: copy after its queued work
            self.stream.wait_stream(compute)
        if one:
            st = next(iter(tensors.values())).untyped_storage()
            src = torch.empty(0, dtype=torch.uint8).set_(st)
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            out = {}
            for role, t in tensors.items():
                off = t.storage_offset() * t.element_size()
                n = t.numel() * t.element_size()
                out[role] = dst[off : off + n].view(t.dtype).view(t.shape)
            nbytes = src.numel()
        else:
            out, nbytes = {}, 0
            for role, t in tensors.items():
                d = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        d.copy_(t, non_blocking=True)
                else:
                    d.copy_(t)
                out[role] = d
                nbytes += t.numel() * t.element_size()
        if self.cuda:
            for d in out.values():  # written on the copy stream: not reused before the copy is done
                d.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
            compute.wait_event(event)
        self.h2d_bytes += nbytes
        self.copies += 1
        return ExpertWeights(ew.key, out, nbytes, None), event

    @staticmethod
    def done(event) -> bool:
        return event is None or event.query()

    @staticmethod
    def wait(event) -> None:
        """Block the host until ``event`` completes."""
        if event is not None:
            event.synchronize()


class HostTier:
    """The second tier: an LRU of experts held in their (pinned) read buffers, under a byte budget.

    Args:
        budget_bytes: bytes of experts to keep (0: none; each read buffer goes back to the
            pool once its copy is done).
        release: gives a buffer back (the store's ``release``).
        max_pending: released buffers whose copy may still be in flight before the host
            waits for the oldest (bounds pinned memory outside the budget).

    An expert's buffer is released only after the event of its last host-to-device copy
    has completed, whether it leaves the tier by eviction or never entered it.
    """

    def __init__(self, budget_bytes: int, release: Callable[[ExpertWeights], None], max_pending: int = 16):
        self.budget_bytes = budget_bytes
        self._release = release
        self.max_pending = max_pending
        self._entries: OrderedDict[Key, ExpertWeights] = OrderedDict()
        self._events: dict[Key, object] = {}
        self._pending: list[tuple[object, ExpertWeights]] = []
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys_lru_first(self) -> list[Key]:
        return list(self._entries)

    def get(self, key: Key) -> ExpertWeights | None:
        """The held expert ``key`` (marked most recently used), or None."""
        ew = self._entries.get(key)
        if ew is not None:
            self._entries.move_to_end(key)
        return ew

    def holds(self, ew: ExpertWeights) -> bool:
        return self._entries.get(ew.key) is ew

    def touch(self, key: Key) -> None:
        """Mark ``key`` most recently used (a VRAM hit keeps its host copy fresh too)."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def copied(self, ew: ExpertWeights, event, protect: set[Key] = frozenset()) -> None:
        """``ew`` (a host buffer) was just copied to the device, ``event`` marking the copy's end:
        keep it (most recently used) when the budget allows, else release it once copied.
        Evicts least recently used experts beyond the budget, ``protect`` ones last."""
        if self.holds(ew):
            self._events[ew.key] = event
            self._entries.move_to_end(ew.key)
            return
        if ew.nbytes > self.budget_bytes:
            self.defer(ew, event)
            return
        self._entries[ew.key] = ew
        self._events[ew.key] = event
        self.used_bytes += ew.nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        while self.used_bytes > self.budget_bytes:
            victim = next((k for k in self._entries if k not in protect), None)
            if victim is None:
                victim = next(iter(self._entries))
            old = self._entries.pop(victim)
            self.used_bytes -= old.nbytes
            self.evictions += 1
            self.defer(old, self._events.pop(victim))

    def defer(self, ew: ExpertWeights, event) -> None:
        """Release ``ew``'s buffer once ``event`` (its last copy) has completed."""
        if CopyEngine.done(event):
            self._release(ew)
            return
        self._pending.append((event, ew))
        self.reap()
        while len(self._pending) > self.max_pending:
            ev, old = self._pending.pop(0)
            CopyEngine.wait(ev)
            self._release(old)

    def reap(self) -> None:
        """Release the buffers whose copies have completed (never blocks)."""
        keep = []
        for ev, ew in self._pending:
            if CopyEngine.done(ev):
                self._release(ew)
            else:
                keep.append((ev, ew))
        self._pending = keep

    def close(self) -> None:
        """Wait for every copy and release every buffer."""
        for ev, ew in self._pending:
            CopyEngine.wait(ev)
            self._release(ew)
        self._pending = []
        for key, ew in self._entries.items():
            CopyEngine.wait(self._events.get(key))
            self._release(ew)
        self._entries.clear()
        self._events.clear()
        self.used_bytes = 0


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

    The device tier keeps the base class's behaviour exactly (policy, pins, protection of
    the fetch under way, counters); entering it is a host-to-device copy
    (:class:`CopyEngine`). ``key in cache`` is true for experts held in either tier, so
    the prefetcher (``--prefetch-ahead``) reads ahead from disk only what neither holds.

    Attributes:
        tier_stats: :class:`TierStats`; host: the :class:`HostTier`; copier: the
            :class:`CopyEngine`.
    """

    def __init__(self, store: ExpertStore, budget_bytes: int | None, num_experts: dict[int, int],
                 policy: EvictionPolicy | None = None, device: torch.device | str = "cuda",
                 host_budget_bytes: int = 0):
        super().__init__(store, budget_bytes, num_experts, policy)
        self.device = torch.device(device)
        self.copier = CopyEngine(self.device)
        self.host = HostTier(max(0, host_budget_bytes), store.release, max_pending=max(16, 2 * store.workers))
        self.tier_stats = TierStats()

    def __contains__(self, key: Key) -> bool:
        return key in self._entries or key in self.host

    def _read(self, keys: list[Key]):
        return _TierReads(self, keys)

    def _insert(self, ew: ExpertWeights) -> ExpertWeights:
        """Copy the host expert ``ew`` to the device, keep or release its host buffer, and cache the device copy."""
        dev, event = self.copier.to_device(ew)
        self.tier_stats.h2d_bytes += dev.nbytes
        self.tier_stats.h2d_copies += 1
        self.host.copied(ew, event, self._protect)
        self.tier_stats.host_evictions = self.host.evictions
        return super()._insert(dev)

    def fetch(self, layer: int, experts: list[int], counts: list[int] | None = None):
        self.host.reap()
        for e in experts:
            self.host.touch((layer, e))
        return super().fetch(layer, experts, counts)

    def describe_tiers(self) -> str:
        """One line on the tiers, for the user."""
        vram = "every expert" if self.budget_bytes is None else f"{self.budget_bytes / 1e9:.2f} GB"
        host = f"{self.host.budget_bytes / 1e9:.2f} GB pinned" if self.host.budget_bytes else "none"
        return f"device {self.device}: expert cache {vram} in device memory, host tier {host}"

    def close(self) -> None:
        """Wait for copies in flight, give every host buffer back, and unregister the pinned pool."""
        self.host.close()
        if self.copier.cuda:
            torch.cuda.synchronize(self.device)
        pool = self.store.pool
        if isinstance(pool, PinnedBufferPool):
            pool.close()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (or None): the ``MOESTREAM_DEVICE`` environment variable when set, else ``cuda`` when a
    CUDA device is available, else ``cpu``; otherwise the device named.

    Raises:
        ConfigError: for a device that is not ``cpu``, ``cuda`` or ``cuda:N``, or CUDA asked for
            where none is available.
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        device = os.environ.get("MOESTREAM_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device: {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device: {device!r}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is available to this PyTorch ({torch.__version__})")
    return dev


def device_free_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, in bytes (``cudaMemGetInfo``)."""
    return int(torch.cuda.mem_get_info(device)[0])
