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

With ``slots=True`` (the fused MoE kernel's cache, :mod:`moestream.fused_moe`) the VRAM tier is a
:class:`SlotPool`: every expert of the model has the same byte layout, so the tier is one
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

import contextlib
import ctypes
import math
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .cache import ExpertCache
from .checkpoint import torch_dtype
from .errors import ConfigError
from .policies import EvictionPolicy
from .store import PIECE_ALIGN, BufferPool, ExpertStore, ExpertWeights, Key

SLOT_ALIGN = 256  # bytes: a slot's start, so every piece keeps the alignment it has in a read buffer


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
    staged: int = 0  # experts copied from the host tier ahead of their layer (TieredExpertCache.stage)

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
            # the span the tensors cover (the store lays a buffer out like the file, in whole blocks)
            lo = min(t.storage_offset() * t.element_size() for t in tensors.values())
            lo -= lo % 64  # each tensor keeps its alignment to 64 bytes (a CPU kernel's bits may depend on it)
            hi = max((t.storage_offset() + t.numel()) * t.element_size() for t in tensors.values())
            src = torch.empty(0, dtype=torch.uint8).set_(st)[lo:hi]
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            out = {}
            for role, t in tensors.items():
                off = t.storage_offset() * t.element_size() - lo
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

    def copy_into(self, ew: ExpertWeights, row: torch.Tensor, views: dict[str, torch.Tensor], after=None,
                  wait: bool = True):
        """Start copying expert ``ew`` (host tensors) into a device slot.

        Args:
            ew: the host expert (the store's buffer, or separate tensors).
            row: uint8 [slot_bytes], the slot's bytes; views: role -> the slot's typed view of it.
            after: an event the copy must wait for (the slot's last use by compute), or None.
            wait: make the compute stream wait for the copy now (a fetch that computes next);
                False leaves that to the caller, who waits on the returned event before the
                kernel that reads the slot (a copy ahead of its layer, beside compute).

        Returns:
            the copy's event (None on the CPU). One copy of the whole buffer when its pieces
            sit at the slot's offsets (the store's layout), else one per piece.

        Raises:
            ValueError: when ``ew``'s pieces are not the slot's.
        """
        tensors = ew.tensors
        if set(tensors) != set(views):
            raise ValueError(f"expert {ew.key} holds {sorted(tensors)}; its slot holds {sorted(views)}")
        base = row.data_ptr()
        storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        # one copy when the pieces sit in one buffer at the slot's offsets plus one shift (the
        # store's buffers hold each expert at its file offset modulo 4 KiB)
        shifts = {t.storage_offset() * t.element_size() - (views[r].data_ptr() - base) for r, t in tensors.items()}
        span = max(views[r].data_ptr() - base + t.numel() * t.element_size() for r, t in tensors.items())
        single = len(storages) == 1 and len(shifts) == 1 and min(shifts) >= 0 and all(
            t.is_contiguous() and t.dtype == views[r].dtype and t.shape == views[r].shape
            for r, t in tensors.items()
        ) and span <= row.numel() and min(shifts) + span <= next(iter(tensors.values())).untyped_storage().nbytes()
        if self.cuda:
            if after is not None:
                self.stream.wait_event(after)
            ctx = torch.cuda.stream(self.stream)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            if single:
                src = torch.empty(0, dtype=torch.uint8).set_(next(iter(tensors.values())).untyped_storage())
                nbytes, shift = span, min(shifts)
                row[:nbytes].copy_(src[shift : shift + nbytes], non_blocking=self.cuda)
            else:
                nbytes = 0
                for role, t in tensors.items():
                    views[role].copy_(t, non_blocking=self.cuda)
                    nbytes += t.numel() * t.element_size()
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.stream)
            if wait:
                torch.cuda.current_stream(self.device).wait_event(event)
        self.h2d_bytes += nbytes
        self.copies += 1
        return event

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


@dataclass(frozen=True)
class SlotLayout:
    """Where an expert's pieces sit in a VRAM slot.

    Attributes:
        roles: ``(role, dtype, shape, byte offset)`` per piece, in the store's piece order, at
            offsets rounded up to :data:`~moestream.store.PIECE_ALIGN` as the store lays out a
            read buffer (so a buffer goes over in one copy).
        slot_bytes: bytes per slot (a multiple of :data:`SLOT_ALIGN`).
    """

    roles: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    slot_bytes: int

    @classmethod
    def of(cls, pieces: list[tuple[str, torch.dtype, tuple[int, ...]]],
           frame: tuple[int, ...] | None = None) -> "SlotLayout":
        """The layout of pieces ``(role, dtype, shape)``, in order: packed at
        :data:`~moestream.store.PIECE_ALIGN` offsets, or at a store frame's piece offsets ``at``
        less the first (as the pieces lie in the store's buffers: one copy moves an expert)."""
        roles, at = [], 0
        first = min(frame) if frame else 0
        for i, (role, dtype, shape) in enumerate(pieces):
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            roles.append((role, dtype, tuple(shape), frame[i] - first if frame else at))
            at = max(at, frame[i] - first + nbytes) if frame else at + -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN
        return cls(tuple(roles), max(SLOT_ALIGN, -(-at // SLOT_ALIGN) * SLOT_ALIGN))

    def views(self, storage: torch.Tensor) -> dict[str, torch.Tensor]:
        """role -> a view [S, *shape] of ``storage`` (uint8 [S, slot_bytes]): slot ``s``'s piece is ``view[s]``."""
        out = {}
        for role, dtype, shape, off in self.roles:
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            out[role] = storage[:, off : off + nbytes].view(dtype).view(storage.shape[0], *shape)
        return out


def expert_slot_layout(store: ExpertStore, keys: list[Key]) -> SlotLayout | None:
    """The one slot layout of experts ``keys`` as the store hands them out (after its cast to the compute
    dtype), or None when they differ (or the store transforms experts: then no slot pool)."""
    if getattr(store, "prepare", None) is not None or not keys:
        return None
    layout, frames = None, set()
    for key in keys:
        pieces, cast = [], False
        for p in store.layout.pieces(*key):
            converts = store._converts(p.dtype, p.role)
            cast |= converts
            pieces.append((p.role, store.dtype if converts else torch_dtype(p.dtype), tuple(p.shape)))
        this = SlotLayout.of(pieces)
        if layout is None:
            layout = this
        elif this != layout:
            return None
        at = store.frame(key).at
        frames.add(None if cast else tuple(a - min(at) for a in at))
    # the store lays buffers out like the file, each expert at its file offset modulo 4 KiB: when
    # the pieces lie alike relative to the first in every expert, a slot takes that layout and one
    # copy of the buffer's span moves an expert
    if len(frames) == 1 and None not in frames:
        return SlotLayout.of(pieces, next(iter(frames)))
    return layout


class SlotPool:
    """The VRAM expert tier as preallocated slots of one :class:`SlotLayout`.

    Args:
        layout: the slot layout; capacity: slots; num_experts: layer -> experts (sizes the table);
        device: where the slots and the table live.

    Attributes:
        storage: uint8 [capacity, slot_bytes] on ``device``; views: role -> [capacity, *shape]
            (what the fused kernel reads: ``gate``/``up`` [S, I, H], ``down`` [S, H, I]).
        table: int32 [max layer + 1, max experts] on ``device``: ``table[layer, e]`` is expert
            ``e``'s slot, -1 when not resident; written from :attr:`host_table` by :meth:`flush`.
        slot_of: (layer, expert) -> slot, on the host.
        last_use: per slot, the event after the last compute that read it (None: nothing pending);
        ready: per slot, the event of a copy nothing has waited for yet.
    """

    def __init__(self, layout: SlotLayout, capacity: int, num_experts: dict[int, int],
                 device: torch.device | str):
        if capacity < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {capacity}")
        self.layout, self.capacity, self.device = layout, capacity, torch.device(device)
        self.storage = torch.empty(capacity, layout.slot_bytes, dtype=torch.uint8, device=self.device)
        self.views = layout.views(self.storage)
        rows, cols = max(num_experts, default=0) + 1, max(num_experts.values(), default=1)
        self.host_table = torch.full((rows, cols), -1, dtype=torch.int32)
        self.table = torch.full((rows, cols), -1, dtype=torch.int32, device=self.device)
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * capacity
        self.last_use: list[object] = [None] * capacity
        self.ready: list[object] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self.dirty = False

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, key: Key) -> int:
        """A free slot for ``key`` (which must not hold one); recorded in the host table."""
        if key in self.slot_of:
            raise ValueError(f"expert {key} already holds slot {self.slot_of[key]}")
        if not self._free:
            raise RuntimeError("no free VRAM slot (the cache evicts before it takes one)")
        slot = self._free.pop()
        self.slot_of[key], self.key_of[slot] = slot, key
        self.host_table[key] = slot
        self.dirty = True
        return slot

    def give(self, key: Key) -> int:
        """Free ``key``'s slot (its table entry becomes -1); returns the slot."""
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        self.ready[slot] = None
        self.host_table[key] = -1
        self.dirty = True
        self._free.append(slot)
        return slot

    def row(self, slot: int) -> torch.Tensor:
        """uint8 [slot_bytes]: slot ``slot``'s bytes."""
        return self.storage[slot]

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """role -> slot ``slot``'s piece (a view)."""
        return {role: v[slot] for role, v in self.views.items()}

    def flush(self) -> None:
        """Write the host table to the device table (queued on the compute stream, before the kernels
        launched after this), when it changed."""
        if self.dirty:
            # pageable source: the copy is staged before this returns, so the host table may change after
            self.table.copy_(self.host_table, non_blocking=True)
            self.dirty = False

    def mark_used(self, keys, event) -> None:
        """Compute that reads ``keys``' slots was queued before ``event``: refill them only after it."""
        for key in keys:
            slot = self.slot_of.get(key)
            if slot is not None:
                self.last_use[slot] = event


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
    @property
    def stats(self):
        if self._log or self._host_log or self._pending:
            self._fold()
        return self._stats

    @stats.setter
    def stats(self, value) -> None:
        self._stats = value

    @property
    def usage(self):
        if self._log or self._host_log or self._pending:
            self._fold()
        return self._usage

    @usage.setter
    def usage(self, value) -> None:
        self._usage = value

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
