"""Expert store: reads the bytes of whole experts from the shards.

The store turns a list of wanted experts into positional reads: every expert gets one
buffer of its own (so the cache can free it alone), its pieces are laid out in that
buffer at aligned offsets, and pieces that are adjacent on disk -- the three tensors of
one expert, or neighbouring experts of one layer -- are coalesced into one ``preadv``
that scatters the file range into the experts' buffers. Reads run on a thread pool
(``os.preadv`` releases the GIL) and are handed back as each expert completes, in
completion order; the caller decides the order in which results are combined.

Readers are one class behind :class:`Reader`; the store owns the plan and the pool.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .checkpoint import Checkpoint, FileHandles, pread_full, torch_dtype
from .errors import EngineClosedError, ReadError
from .layout import QUANT_PARAMS, ExpertLayout

if TYPE_CHECKING:
    from .memory import WiredMemory

Key = tuple[int, int]  # (layer, expert)

# Offsets of pieces inside an expert's buffer are multiples of this (bytes): keeps every
# tensor view aligned for vectorized kernels, and identical whatever the read path.
PIECE_ALIGN = 64
# Coalesced reads stop growing at this many bytes, so several reads stay in flight.
MAX_READ_BYTES = 16 * 1024 * 1024


def _new_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (page-aligned; returned to the OS when freed)."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class BufferPool:
    """Host buffers for experts, recycled when experts are evicted.

    Each buffer is its own private anonymous mapping, so memory beyond what the pool keeps
    goes back to the OS at once. (``torch.empty`` buffers stayed on glibc's heap after
    eviction: peak RSS rose by 1.1 GB during a 25-token prefill of the Qwen3-30B-A3B
    shape.) Recycling matters too: a fresh mapping costs a page fault and a zeroed page
    per 4 KiB; without reuse, decode of that shape took 7.86 s per token against 7.17 s
    with it (16 tokens, cold cache, 8 GiB cap). At most ``max_free`` buffers wait for
    reuse; that memory, like the reads in flight, is outside the cache budget.
    """

    def __init__(self, max_free: int):
        self.max_free = max_free
        self._free: dict[int, list[mmap.mmap]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> tuple[mmap.mmap, torch.Tensor, memoryview]:
        """A mapping of at least ``nbytes``, a uint8 tensor of exactly ``nbytes`` over it, and a view."""
        size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            free = self._free.get(size)
            m = free.pop() if free else None
            if m is not None:
                self._count -= 1
        if m is None:
            m = _new_mapping(size)
        return m, torch.frombuffer(m, dtype=torch.uint8, count=nbytes), memoryview(m)[:nbytes]

    def put(self, m: mmap.mmap) -> None:
        """Return a mapping nothing uses any more; kept for reuse or freed."""
        with self._lock:
            if self._count < self.max_free:
                self._free.setdefault(len(m), []).append(m)
                self._count += 1

    @property
    def free_buffers(self) -> int:
        return self._count


@dataclass
class ExpertWeights:
    """One expert held in memory: a buffer and named tensor views into it.

    ``tensors`` maps role (``"gate"``, ``"up"``, ``"down"``) to a tensor of the piece's
    shape and dtype, on ``device``; ``nbytes`` is what the expert costs the cache budget.
    """

    key: Key
    tensors: dict[str, torch.Tensor]
    nbytes: int
    mapping: mmap.mmap | None = field(default=None, repr=False)


class Reader(ABC):
    """Fills buffers from a shard: the interface a read path (buffered, O_DIRECT) implements."""

    @abstractmethod
    def read(self, file: Path, offset: int, buffers: list[memoryview], what: str) -> int:
        """Fill ``buffers`` in order from byte ``offset`` of ``file``; return bytes read.

        Raises:
            ReadError: naming ``what`` and ``file`` when the read fails or is short.
        """

    def close(self) -> None:  # noqa: B027 -- a reader may hold nothing to release
        """Release the reader's files (default: nothing to release)."""


class PreadReader(Reader):
    """Buffered positional reads (``os.preadv``) through the page cache.

    Shards are opened with ``POSIX_FADV_RANDOM``: expert reads jump around the file, and
    the kernel's default readahead after each read pulled in about 1.5x the bytes asked
    for on this machine's disk (measured with ``/proc/<pid>/io``), halving useful speed.
    """

    def __init__(self):
        self._files = FileHandles(getattr(os, "POSIX_FADV_RANDOM", None))

    def read(self, file: Path, offset: int, buffers: list[memoryview], what: str) -> int:
        return pread_full(self._files.get(file), offset, buffers, file, what)

    def close(self) -> None:
        self._files.close()


@dataclass
class _Job:
    """One coalesced read: ``length`` bytes at ``offset`` of ``file``.

    ``parts`` lists, in file order, the (expert, piece index) each stretch of the range
    lands in; ``keys`` the experts it touches.
    """

    file: Path
    offset: int
    length: int
    parts: list[tuple[Key, int]]
    keys: list[Key]


@dataclass
class ReadStats:
    """Counters of the store, in experts, syscalls, bytes and seconds."""

    experts_read: int = 0
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # summed over reader threads
    # -- the I/O issue's counters: prefetch reads (subsets of the totals above) and the
    # wall time during which at least one read was in flight (bytes_read / busy_seconds
    # is the read bandwidth while reading)
    prefetch_experts: int = 0
    prefetch_reads: int = 0
    prefetch_bytes: int = 0
    busy_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ExpertStore:
    """Reads experts of a checkpoint into memory.

    Args:
        checkpoint: the opened checkpoint (owns the shard files).
        layout: where each expert's pieces lie (:func:`moestream.layout.discover_experts`).
        dtype: compute dtype; float pieces stored in another dtype are cast after the read.
        device: where the expert tensors are handed out (a host buffer is read first).
        workers: reader threads; reads of one layer's missing experts run in parallel.
        reader: the read path (default :class:`PreadReader`).

    Quantized experts (see :mod:`moestream.quant`): packed integer and fp8 pieces and
    quantization parameters (scales, biases, ``weight_scale_inv``) keep their stored
    dtype; the kernels compute on them as read.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        layout: ExpertLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        workers: int = 8,
        reader: Reader | None = None,
    ):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.checkpoint = checkpoint
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.workers = workers
        self.reader = reader or PreadReader()
        self.stats = ReadStats()
        self.pool = BufferPool(max_free=2 * workers)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moestream-read")
        self.closed = False
        self._lock = threading.Lock()
        self._active = 0  # reads in flight, for busy_seconds
        self._busy_since = 0.0
        self.wired: "WiredMemory | None" = None  # set by --wire-memory: experts handed out are mlocked

    def expert_nbytes(self, key: Key) -> int:
        """Bytes one expert occupies on disk."""
        return self.layout.expert_nbytes(*key)

    def _allocate(self, key: Key) -> tuple[ExpertWeights, list[memoryview]]:
        """A buffer for one expert, its pieces at aligned offsets: the expert and a view per piece."""
        pieces = self.layout.pieces(*key)
        offsets, total = [], 0
        for p in pieces:
            offsets.append(total)
            total += -(-p.nbytes // PIECE_ALIGN) * PIECE_ALIGN
        m, buf, raw = self.pool.get(total)
        tensors, views = {}, []
        for p, off in zip(pieces, offsets):
            tensors[p.role] = buf[off : off + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)
            views.append(raw[off : off + p.nbytes])
        return ExpertWeights(key, tensors, total, m), views

    def _plan(self, keys: list[Key]) -> list[_Job]:
        """Coalesced reads covering every piece of ``keys``, first-needed experts first."""
        segments = [
            (p.file, p.offset, p.nbytes, prio, key, i)
            for prio, key in enumerate(keys)
            for i, p in enumerate(self.layout.pieces(*key))
        ]
        segments.sort(key=lambda s: (str(s[0]), s[1]))
        jobs: list[tuple[int, _Job]] = []
        for file, offset, n, prio, key, i in segments:
            last = jobs[-1][1] if jobs else None
            if (
                last is not None
                and last.file == file
                and last.offset + last.length == offset
                and last.length + n <= MAX_READ_BYTES
            ):
                last.length += n
                last.parts.append((key, i))
                if key not in last.keys:
                    last.keys.append(key)
                jobs[-1] = (min(jobs[-1][0], prio), last)
            else:
                jobs.append((prio, _Job(file, offset, n, [(key, i)], [key])))
        jobs.sort(key=lambda j: j[0])
        return [j for _, j in jobs]

    def _run(self, job: _Job, views: list[memoryview], prefetch: bool = False) -> None:
        what = "expert " + ", ".join(f"(layer {layer}, expert {e})" for layer, e in job.keys[:4])
        if len(job.keys) > 4:
            what += f" and {len(job.keys) - 4} more"
        with self._lock:
            self._active += 1
            if self._active == 1:
                self._busy_since = time.perf_counter()
        t0 = time.perf_counter()
        try:
            try:
                self.reader.read(job.file, job.offset, views, what)
            except OSError as e:  # a reader that let an OS error through: still name expert and file
                raise ReadError(f"reading {what} from {job.file} at byte {job.offset}: {e.strerror or e}") from None
            self.checkpoint.check_unchanged(job.file, what)  # a shard replaced or written while running
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.stats.busy_seconds += t1 - self._busy_since
        dt = t1 - t0
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += job.length
            self.stats.read_seconds += dt
            if prefetch:
                self.stats.prefetch_reads += 1
                self.stats.prefetch_bytes += job.length

    def _converts(self, role_dtype: str, role: str = "") -> bool:
        dt = torch_dtype(role_dtype)
        return _castable(dt, role) and dt != self.dtype

    def cached_nbytes(self, key: Key) -> int:
        """Bytes one expert takes in the cache once read (after any cast to the compute dtype)."""
        total = 0
        for p in self.layout.pieces(*key):
            if self._converts(p.dtype, p.role):
                total += math.prod(p.shape) * torch.tensor([], dtype=self.dtype).element_size()
            else:
                total += -(-p.nbytes // PIECE_ALIGN) * PIECE_ALIGN
        return total

    def _finish(self, ew: ExpertWeights) -> ExpertWeights:
        """Cast float pieces to the compute dtype and move them to the device.

        When every piece was replaced, the read buffer is dropped; otherwise it stays
        alive and is counted with the new tensors.
        """
        tensors = {}
        for role, t in ew.tensors.items():
            if _castable(t.dtype, role) and t.dtype != self.dtype:
                t = t.to(self.dtype)
            if t.device != self.device:
                t = t.to(self.device)
            tensors[role] = t
        kept = [r for r, t in tensors.items() if t is ew.tensors.get(r)]
        if self.wired is not None:
            self.wired.lock_expert(ew.key, [t for r, t in tensors.items() if r not in kept], ew.mapping)
        if len(kept) == len(tensors) == len(ew.tensors):
            return ew
        nbytes = sum(tensors[r].numel() * tensors[r].element_size() for r in tensors if r not in kept)
        if kept:  # some pieces still live in the read buffer
            return ExpertWeights(ew.key, tensors, nbytes + ew.nbytes, ew.mapping)
        self.release(ew)
        return ExpertWeights(ew.key, tensors, nbytes, None)

    def release(self, ew: ExpertWeights) -> None:
        """Give back an expert nothing will use again (evicted, or abandoned mid-read).

        Its buffer may be handed to the next read at once, so ``ew`` is emptied: a stale
        reference fails loudly instead of reading another expert's bytes.
        """
        mapping, ew.mapping, ew.tensors = ew.mapping, None, {}
        if self.wired is not None:
            self.wired.unlock_expert(ew.key)
        if mapping is not None:
            self.pool.put(mapping)

    def submit(self, keys: list[Key], max_inflight: int | None = None, prefetch: bool = False) -> "ReadBatch":
        """Start reading ``keys`` (in priority order) and return the batch of reads.

        The first reads are issued before this returns, so the caller can compute on
        what it already holds while they run; iterate the batch to receive experts.
        ``prefetch`` counts the reads as prefetch reads (off the critical path).

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        if self.closed:
            raise EngineClosedError("the expert store is closed (its engine's close() was called): load the model "
                                    "again to read experts")
        return ReadBatch(self, keys, max_inflight or 2 * self.workers, prefetch)

    def read_all(self, keys: list[Key]) -> dict[Key, ExpertWeights]:
        """Read ``keys`` and return them all (a convenience over :meth:`submit`)."""
        with self.submit(keys) as batch:
            return {ew.key: ew for ew in batch}

    def close(self) -> None:
        """Stop the reader threads and release the reader's files."""
        self.closed = True
        self._threads.shutdown(wait=True)
        self.reader.close()


def _castable(dt: torch.dtype, role: str) -> bool:
    """Whether a piece is cast to the compute dtype: float weights, not fp8 codes nor quantization parameters."""
    return dt.is_floating_point and dt.itemsize > 1 and role.partition(".")[2] not in QUANT_PARAMS


class ReadBatch:
    """Reads of a set of experts in flight; iterate it to receive each expert as it completes.

    Experts are yielded in completion order. At most ``max_inflight`` coalesced reads
    (each up to ``MAX_READ_BYTES``, or one expert piece if larger) are outstanding, and an
    expert's buffer is allocated only when its first read is issued, so the memory of
    experts being read, outside any cache budget, stays under ``max_inflight`` reads.
    Iteration raises :class:`~moestream.errors.ReadError` (naming the expert and file)
    when a read fails or is short; a partially read expert is never yielded. Closing the
    batch (or leaving its ``with`` block) cancels reads not yet started and waits for the
    running ones, so no thread writes into a buffer after it is dropped.
    """

    def __init__(self, store: ExpertStore, keys: list[Key], max_inflight: int, prefetch: bool = False):
        self._store = store
        self.prefetch = prefetch
        self._jobs = deque(store._plan(keys)) if keys else deque()
        self._remaining = {k: 0 for k in keys}
        for job in self._jobs:
            for k in job.keys:
                self._remaining[k] += 1
        self._open: dict[Key, tuple[ExpertWeights, list[memoryview]]] = {}
        self._limit = max(1, max_inflight)
        self._pending: dict[Future, _Job] = {}
        self._fill()

    def _fill(self) -> None:
        while self._jobs and len(self._pending) < self._limit:
            job = self._jobs.popleft()
            views = []
            for key, i in job.parts:
                if key not in self._open:
                    self._open[key] = self._store._allocate(key)
                views.append(self._open[key][1][i])
            self._pending[self._store._threads.submit(self._store._run, job, views, self.prefetch)] = job

    def __iter__(self) -> Iterator[ExpertWeights]:
        try:
            while self._pending:
                done, _ = wait(self._pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = self._pending.pop(fut)
                    fut.result()  # re-raises the worker's ReadError
                    self._fill()
                    for k in job.keys:
                        self._remaining[k] -= 1
                        if self._remaining[k] == 0:
                            with self._store._lock:
                                self._store.stats.experts_read += 1
                                if self.prefetch:
                                    self._store.stats.prefetch_experts += 1
                            ew, _ = self._open.pop(k)
                            yield self._store._finish(ew)
        finally:
            self.close()

    def done(self) -> bool:
        """True when every read of the batch has finished (iterating it then does not block)."""
        return not self._jobs and all(f.done() for f in self._pending)

    def close(self) -> None:
        """Cancel reads not yet started; wait for running ones."""
        self._jobs.clear()
        for fut in self._pending:
            fut.cancel()
        if self._pending:
            wait(self._pending)
        self._pending.clear()
        for ew, _ in self._open.values():
            self._store.release(ew)
        self._open.clear()

    def __enter__(self) -> "ReadBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
