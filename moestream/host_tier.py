"""The GPU tier's host side: page-locked (pinned) host memory for the store's read buffers
(:class:`PinnedBufferPool`, ``cudaHostRegister``), and the second tier of the expert cache, an LRU of
experts kept in those buffers (:class:`HostTier`, ``--host-cache-gb``), so a hit costs one asynchronous
host-to-device copy. A buffer is reused or freed only after the event of its last copy has completed.
The cache that uses both is :class:`moestream.tiered_cache.TieredExpertCache`.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from .copy_engine import CopyEngine
from .store import BufferPool, ExpertWeights, Key


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
