"""Expert store: reads the bytes of whole experts from the shards.

The store turns a list of wanted experts into positional reads. Every expert gets one
buffer of its own (so the cache can free it alone), laid out **like the file**: each run
of the expert's pieces that lie back to back on disk occupies the 4 KiB-aligned span of
the file around it (:func:`frame`), so a piece's tensor sits at its file offset modulo
4 KiB, and the same layout serves every read path. Pieces adjacent on disk -- the three
tensors of one expert, neighbouring experts of one layer -- are coalesced into one read.
The buffered path (:class:`PreadReader`) scatters the range into the pieces; the O_DIRECT
path (:class:`moestream.direct_io.DirectReader`) reads the 4 KiB-rounded range straight
into the experts' buffers (:meth:`Reader.read_into`), with no copy but the few bytes of a
block two experts share. Reads run on reader threads (``os.preadv`` releases the GIL),
demand reads before reads ahead, and are handed back as each expert completes, in
completion order; the caller decides the order in which results are combined.

On the CPU the buffers come from :class:`HugePagePool`: slots carved from arenas of 2 MiB
transparent huge pages, faulted in once and recycled for good, so a read never faults a
fresh page in and an eviction returns nothing to the OS.

Readers are one class behind :class:`Reader`; the store owns the plan, the buffers and the
reader threads.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import math
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from .budget import ReadBuffers
from .checkpoint import Checkpoint, FileHandles, pread_full, torch_dtype
from .counters import Counters
from .errors import EngineClosedError, ReadError
from .layout import QUANT_PARAMS, ExpertLayout, Piece

if TYPE_CHECKING:
    from .memory import WiredMemory

Key = tuple[int, int]  # (layer, expert)

# What an expert costs the cache budget: its pieces, each rounded up to this many bytes (the
# bytes of the expert itself, whatever the read path; the frame's alignment slack is counted
# in the reserve, moestream.budget).
PIECE_ALIGN = 64
# O_DIRECT offsets, lengths and buffer addresses are multiples of this (bytes): the logical
# block size of a disk is 512 or 4096, and 4096 satisfies both. Expert frames are laid out
# in whole blocks of the file.
BLOCK = 4096
HUGE_PAGE = 2 * 1024 * 1024
# Coalesced reads stop growing at this many bytes, so several reads stay in flight ...
MAX_READ_BYTES = 16 * 1024 * 1024
# ... and at this many pieces (one iovec each, two for a block that two experts share;
# the kernel takes at most 1024 per preadv).
MAX_READ_PARTS = 256
# Reader-thread priorities: demand reads (a layer waits on them) before reads ahead.
DEMAND, AHEAD = 0, 1
# Bytes of one arena of the CPU buffer pool (experts of a size are slots of arenas this big).
ARENA_BYTES = 64 * 1024 * 1024
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in at once (not in Python 3.11's mmap module)


def _new_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (page-aligned; returned to the OS when freed)."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def address_of(buf) -> int:
    """Address of the first byte of a writable buffer (mmap or memoryview)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


# -- the expert's buffer layout -----------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    """Where an expert's pieces sit in its buffer.

    ``at[i]`` is the buffer offset of piece ``i`` (in :meth:`ExpertLayout.pieces` order) and
    ``shift[i]`` that offset minus the piece's file offset: buffer byte ``x + shift[i]`` holds
    file byte ``x`` for the whole 4 KiB-rounded span of the piece's run. ``nbytes`` is the
    buffer's size (a whole number of blocks); ``cost`` what the expert counts against the
    cache budget (its pieces, each rounded up to :data:`PIECE_ALIGN`).
    """

    nbytes: int
    at: tuple[int, ...]
    shift: tuple[int, ...]
    cost: int


def frame(pieces: tuple[Piece, ...] | list[Piece]) -> Frame:
    """Lay out one expert's buffer like the file.

    Pieces are grouped into runs (same file, back to back on disk); each run takes the span
    from its first byte rounded down to :data:`BLOCK` to its last byte rounded up, runs one
    after the other in file order. A piece's tensor thus lands at its file offset modulo 4 KiB
    whichever path reads it, and an O_DIRECT read of the rounded span lands in place.
    """
    order = sorted(range(len(pieces)), key=lambda i: (str(pieces[i].file), pieces[i].offset))
    at, shift = [0] * len(pieces), [0] * len(pieces)
    pos = 0
    run_file, run_start, run_end, run_shift = None, 0, -1, 0
    for i in order:
        p = pieces[i]
        if p.file != run_file or p.offset != run_end:  # a new run: its own aligned span
            if run_file is not None:
                pos += -(-run_end // BLOCK) * BLOCK - run_start
            run_file, run_start = p.file, p.offset - p.offset % BLOCK
            run_shift = pos - run_start
        at[i], shift[i] = p.offset + run_shift, run_shift
        run_end = p.offset + p.nbytes
    if run_file is not None:
        pos += -(-run_end // BLOCK) * BLOCK - run_start
    cost = sum(-(-p.nbytes // PIECE_ALIGN) * PIECE_ALIGN for p in pieces)
    return Frame(max(pos, BLOCK), tuple(at), tuple(shift), cost)


# -- buffers --------------------------------------------------------------------------------------

class BufferPool:
    """Host buffers for experts, each its own page-aligned private anonymous mapping, recycled
    when experts are evicted; at most ``max_free`` wait for reuse, the rest go back to the OS.

    The base of :class:`moestream.host_tier.PinnedBufferPool` (page-locked for a device);
    the CPU store uses :class:`HugePagePool`. Buffers are page-aligned, so an O_DIRECT read
    lands in them in place too (at small-page speed).
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


class HugePagePool:
    """Expert buffers carved from arenas of 2 MiB-aligned transparent huge pages, recycled for good.

    Buffers of one size (a whole number of 4 KiB blocks: an expert's :class:`Frame`) are slots
    of arenas of up to ``arena_bytes``, each one private anonymous mapping advised
    ``MADV_HUGEPAGE`` and faulted in whole when made (``MADV_POPULATE_WRITE``). A slot given
    back waits for the next expert of its size; memory goes back to the OS only when the pool
    is dropped. So after the cache has filled, reads neither fault pages in nor hand any
    back, and an O_DIRECT read into a slot goes through the disk in large requests (a buffer
    scattered over 4 KiB pages is split into small ones: 0.5-1.4 GB/s against 3.1-3.3 on the
    development machine's virtual disk, ``../shared/notes/machine.md``).

    The pool's memory is the most experts ever held at once (cached, being read, read
    ahead) plus one partly used arena per size; ``nbytes`` says how much it has mapped.
    ``get`` returns ``(slot, tensor, view)``: the slot (a writable memoryview of exactly the
    size asked for, 4 KiB-aligned) is what :meth:`put` takes back.
    """

    def __init__(self, arena_bytes: int = ARENA_BYTES):
        self.arena_bytes = arena_bytes
        self._free: dict[int, list[memoryview]] = {}
        self._arenas: list[mmap.mmap] = []
        self._slot_size: dict[int, int] = {}  # id(slot) -> its size class
        self._slots: list[memoryview] = []  # every slot, so that no id is ever reused
        self._lock = threading.Lock()
        self.nbytes = 0
        self.in_use = 0

    def _carve(self, size: int) -> list[memoryview]:
        """A new arena for slots of ``size`` bytes; its slots."""
        per = max(1, min(self.arena_bytes, 8 * size) // size)
        span = -(-per * size // HUGE_PAGE) * HUGE_PAGE
        m = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        skip = -address_of(m) % HUGE_PAGE
        for advice in (getattr(mmap, "MADV_HUGEPAGE", None), MADV_POPULATE_WRITE):
            if advice is not None:
                try:
                    m.madvise(advice, skip, span)
                except OSError:
                    pass  # no huge pages, or an old kernel: still correct (pages fault in on first use)
        whole = memoryview(m)
        slots = [whole[skip + i * size : skip + (i + 1) * size] for i in range(per)]
        self._arenas.append(m)
        self.nbytes += span
        for s in slots:
            self._slot_size[id(s)] = size
        self._slots.extend(slots)
        return slots

    def get(self, nbytes: int) -> tuple[memoryview, torch.Tensor, memoryview]:
        """A slot of at least ``nbytes`` (rounded up to 4 KiB), a uint8 tensor of exactly
        ``nbytes`` over it, and a view of those bytes."""
        size = -(-max(nbytes, 1) // BLOCK) * BLOCK
        with self._lock:
            free = self._free.setdefault(size, [])
            if not free:
                free.extend(reversed(self._carve(size)))
            slot = free.pop()
            self.in_use += 1
        return slot, torch.frombuffer(slot, dtype=torch.uint8, count=nbytes), slot[:nbytes]

    def put(self, slot: memoryview) -> None:
        """Take back a slot nothing uses any more (it waits for the next expert of its size)."""
        with self._lock:
            self._free[self._slot_size[id(slot)]].append(slot)
            self.in_use -= 1

    @property
    def free_buffers(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())


@dataclass
class ExpertWeights:
    """One expert held in memory: a buffer and named tensor views into it.

    ``tensors`` maps role (``"gate"``, ``"up"``, ``"down"``) to a tensor of the piece's
    shape and dtype, on ``device``; ``nbytes`` is what the expert costs the cache budget.
    """

    key: Key
    tensors: dict[str, torch.Tensor]
    nbytes: int
    mapping: object = field(default=None, repr=False)  # the buffer (a pool's mapping or slot)


class Extent(NamedTuple):
    """Where one piece of a read lands: ``view``, its bytes in the expert's buffer; ``base``, that
    whole buffer; ``shift``, buffer offset minus file offset over the piece's run (file byte
    ``x`` goes to ``base[x + shift]``, for ``x`` anywhere in the run's 4 KiB-rounded span)."""

    view: memoryview
    base: memoryview
    shift: int


class Reader(ABC):
    """Fills expert buffers from a shard: the interface a read path (buffered, O_DIRECT) implements."""

    @abstractmethod
    def read(self, file: Path, offset: int, buffers: list[memoryview], what: str) -> int:
        """Fill ``buffers`` in order from byte ``offset`` of ``file``; return bytes read.

        Raises:
            ReadError: naming ``what`` and ``file`` when the read fails or is short.
        """

    def read_into(self, file: Path, offset: int, extents: list[Extent], what: str) -> int:
        """Fill each extent's ``view`` in order from byte ``offset`` of ``file`` (the store's call).

        A reader may also write the bytes of the runs' 4 KiB-rounded spans around them
        (``base``/``shift``): that is how O_DIRECT reads in place. Default: :meth:`read` of
        the views. Returns the bytes asked for; raises as :meth:`read`.
        """
        return self.read(file, offset, [e.view for e in extents], what)

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


class ReaderThreads:
    """The store's reader threads: a fixed number of workers taking jobs by priority
    (:data:`DEMAND` before :data:`AHEAD`), first come first served within one.

    A layer's own reads thus never queue behind reads ahead for later layers. Each worker's
    CPU clock can be read at any time (:meth:`cpu_seconds`), for the CPU split of the stats.
    """

    def __init__(self, workers: int, name: str = "moestream-read"):
        self._n, self._name = workers, name
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._clocks: list[int] = []
        self._idle = threading.Semaphore(0)  # idle workers, roughly
        self._closed = False

    def submit(self, priority: int, fn, *args) -> Future:
        """Queue ``fn(*args)``; its Future."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the reader threads are shut down")
            heapq.heappush(self._heap, (priority, next(self._seq), fut, fn, args))
            self._cv.notify()
            # an idle worker takes it; else start one more, up to the limit (as ThreadPoolExecutor does)
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._n:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return fut

    def _work(self) -> None:
        clock = time.pthread_getcpuclockid(threading.get_ident()) if hasattr(time, "pthread_getcpuclockid") else None
        with self._cv:
            if clock is not None:
                self._clocks.append(clock)
        while True:
            with self._cv:
                if not self._heap and not self._closed:
                    self._idle.release()  # once per idle spell
                    while not self._heap and not self._closed:
                        self._cv.wait()
                if not self._heap:
                    return
                _, _, fut, fn, args = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 -- handed to whoever waits on the future
                fut.set_exception(e)

    def cpu_seconds(self) -> float:
        """CPU seconds the reader threads have used so far (user + system), all of them."""
        with self._cv:
            clocks = list(self._clocks)
        total = 0.0
        for c in clocks:
            try:
                total += time.clock_gettime(c)
            except OSError:
                pass  # a thread that has ended
        return total

    def shutdown(self) -> None:
        """Cancel queued jobs, let running ones finish, and join the threads."""
        with self._cv:
            self._closed = True
            queued, self._heap = self._heap, []
            self._cv.notify_all()
        for item in queued:
            item[2].cancel()
        for t in self._threads:
            t.join()


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
class ReadStats(Counters):
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
    # CPU seconds the reader threads spent on reads (syscalls, copies, checks), summed
    read_cpu_seconds: float = 0.0


class ExpertStore:
    """Reads experts of a checkpoint into memory.

    Args:
        checkpoint: the opened checkpoint (owns the shard files).
        layout: where each expert's pieces lie (:func:`moestream.layout.discover_experts`).
        dtype: compute dtype; float pieces stored in another dtype are cast after the read.
        device: where the expert tensors are handed out (a host buffer is read first).
        workers: reader threads; reads of one layer's missing experts run in parallel.
        reader: the read path (default :class:`PreadReader`).

    Each expert's buffer is laid out like the file (:func:`frame`) and comes from ``pool``
    (:class:`HugePagePool`; a device's tier sets a :class:`BufferPool` of its own).

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
        self.pool = HugePagePool()
        self._frames: dict[Key, Frame] = {}
        self._threads = ReaderThreads(workers)
        self.closed = False
        self._lock = threading.Lock()
        self._active = 0  # reads in flight, for busy_seconds
        self._busy_since = 0.0
        self.wired: "WiredMemory | None" = None  # set by --wire-memory: experts handed out are mlocked

    def expert_nbytes(self, key: Key) -> int:
        """Bytes one expert occupies on disk."""
        return self.layout.expert_nbytes(*key)

    def frame(self, key: Key) -> Frame:
        """Where ``key``'s pieces sit in its buffer (:func:`frame`; computed once per expert)."""
        f = self._frames.get(key)
        if f is None:
            f = self._frames[key] = frame(self.layout.pieces(*key))
        return f

    def frame_slack(self, key: Key) -> int:
        """Bytes of ``key``'s buffer beyond what it counts against the budget (block alignment)."""
        f = self.frame(key)
        return max(0, f.nbytes - f.cost)

    def read_buffers(self, keys: list[Key]) -> ReadBuffers:
        """This store's buffer sizes for the budget's reserve (:func:`moestream.budget.read_reserve`):
        its largest read, arena and huge page, and an expert's alignment slack (up to a block at
        either end of each of its pieces; ``keys[0]``'s pieces, as every expert of a model has)."""
        pieces = max((len(self.layout.pieces(*k)) for k in keys[:1]), default=0)
        return ReadBuffers(MAX_READ_BYTES, ARENA_BYTES, HUGE_PAGE, 2 * BLOCK * pieces)

    def reader_cpu_seconds(self) -> float:
        """CPU seconds used so far by the reader threads (their clocks, read now)."""
        return self._threads.cpu_seconds()

    def compute_cpu_seconds(self) -> float:
        """CPU seconds this process has used so far outside the reader threads (the compute thread,
        its OpenMP threads, the rest): a clock for the CPU split of the stats."""
        return time.process_time() - self._threads.cpu_seconds()

    def _allocate(self, key: Key) -> tuple[ExpertWeights, list[Extent]]:
        """A buffer for one expert laid out like the file: the expert and an extent per piece."""
        pieces = self.layout.pieces(*key)
        fr = self.frame(key)
        m, buf, raw = self.pool.get(fr.nbytes)
        tensors, extents = {}, []
        for p, at, shift in zip(pieces, fr.at, fr.shift):
            tensors[p.role] = buf[at : at + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)
            extents.append(Extent(raw[at : at + p.nbytes], raw, shift))
        return ExpertWeights(key, tensors, fr.cost, m), extents

    def _plan(self, keys: list[Key]) -> list[_Job]:
        """Coalesced reads covering every piece of ``keys``, first-needed experts first.

        An expert's run of adjacent pieces goes whole into one read when it fits
        :data:`MAX_READ_BYTES` (so no two reads write one expert's block); runs adjacent on
        disk join while the read stays within :data:`MAX_READ_BYTES` and :data:`MAX_READ_PARTS`.
        """
        segments = sorted(
            ((p.file, p.offset, p.nbytes, prio, key, i)
             for prio, key in enumerate(keys) for i, p in enumerate(self.layout.pieces(*key))),
            key=lambda s: (str(s[0]), s[1]),
        )
        runs: list[list] = []  # [file, offset, length, prio, parts, key] per expert run
        for file, offset, n, prio, key, i in segments:
            r = runs[-1] if runs else None
            if r is not None and r[5] == key and r[0] == file and r[1] + r[2] == offset:
                r[2] += n
                r[4].append((key, i, n))
            else:
                runs.append([file, offset, n, prio, [(key, i, n)], key])
        jobs: list[tuple[int, _Job]] = []

        def fits(job: _Job, n: int, parts: int) -> bool:
            return job.length + n <= MAX_READ_BYTES and len(job.parts) + parts <= MAX_READ_PARTS

        for file, offset, length, prio, parts, key in runs:
            last = jobs[-1][1] if jobs else None
            if last is not None and last.file == file and last.offset + last.length == offset \
                    and fits(last, length, len(parts)):
                last.length += length
                last.parts.extend((k, i) for k, i, _ in parts)
                if key not in last.keys:
                    last.keys.append(key)
                jobs[-1] = (min(jobs[-1][0], prio), last)
                continue
            if length <= MAX_READ_BYTES and len(parts) <= MAX_READ_PARTS:
                jobs.append((prio, _Job(file, offset, length, [(k, i) for k, i, _ in parts], [key])))
                continue
            at = offset  # a run larger than one read: split between its pieces
            for k, i, n in parts:
                last = jobs[-1][1] if jobs else None
                if last is not None and last.keys == [key] and last.offset + last.length == at and fits(last, n, 1):
                    last.length += n
                    last.parts.append((k, i))
                else:
                    jobs.append((prio, _Job(file, at, n, [(k, i)], [key])))
                at += n
        jobs.sort(key=lambda j: j[0])
        return [j for _, j in jobs]

    def _run(self, job: _Job, extents: list[Extent], prefetch: bool = False) -> None:
        what = "expert " + ", ".join(f"(layer {layer}, expert {e})" for layer, e in job.keys[:4])
        if len(job.keys) > 4:
            what += f" and {len(job.keys) - 4} more"
        with self._lock:
            self._active += 1
            if self._active == 1:
                self._busy_since = time.perf_counter()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            try:
                self.reader.read_into(job.file, job.offset, extents, what)
            except OSError as e:  # a reader that let an OS error through: still name expert and file
                raise ReadError(f"reading {what} from {job.file} at byte {job.offset}: {e.strerror or e}") from None
            self.checkpoint.check_unchanged(job.file, what)  # a shard replaced or written while running
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.stats.busy_seconds += t1 - self._busy_since
        dt, cpu = t1 - t0, time.thread_time() - c0
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += job.length
            self.stats.read_seconds += dt
            self.stats.read_cpu_seconds += cpu
            if prefetch:
                self.stats.prefetch_reads += 1
                self.stats.prefetch_bytes += job.length

    def _converts(self, role_dtype: str, role: str = "") -> bool:
        dt = torch_dtype(role_dtype)
        return _castable(dt, role) and dt != self.dtype

    def cached_nbytes(self, key: Key) -> int:
        """Bytes one expert counts against the cache budget once read (after any cast to the
        compute dtype), as :meth:`_finish` counts them."""
        pieces = self.layout.pieces(*key)
        cast = [p for p in pieces if self._converts(p.dtype, p.role)]
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        total = sum(math.prod(p.shape) * itemsize for p in cast)
        if len(cast) < len(pieces):  # the read buffer stays alive with what it still holds
            total += self.frame(key).cost
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
        ``prefetch`` counts the reads as prefetch reads (off the critical path) and queues
        them behind every demand read.

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
        self._threads.shutdown()
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
        self._priority = AHEAD if prefetch else DEMAND
        self._jobs = deque(store._plan(keys)) if keys else deque()
        self._remaining = {k: 0 for k in keys}
        for job in self._jobs:
            for k in job.keys:
                self._remaining[k] += 1
        self._open: dict[Key, tuple[ExpertWeights, list[Extent]]] = {}
        self._limit = max(1, max_inflight)
        self._pending: dict[Future, _Job] = {}
        self._fill()

    def _fill(self) -> None:
        while self._jobs and len(self._pending) < self._limit:
            job = self._jobs.popleft()
            extents = []
            for key, i in job.parts:
                if key not in self._open:
                    self._open[key] = self._store._allocate(key)
                extents.append(self._open[key][1][i])
            fut = self._store._threads.submit(self._priority, self._store._run, job, extents, self.prefetch)
            self._pending[fut] = job

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
