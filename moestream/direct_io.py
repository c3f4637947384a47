"""Reads that bypass the OS page cache: ``O_DIRECT`` straight into the experts' buffers.

When a checkpoint is much bigger than memory, the page cache only costs: every expert
read is copied into it, the kernel has to reclaim it (inside a cgroup cap, on the
reading thread), and it evicts what the process needs. :class:`DirectReader` opens
shards with ``O_DIRECT`` and reads each coalesced range -- its start rounded down and its
end rounded up to the 4 KiB block -- **in place**: the store lays every expert's buffer
out like the file (:func:`moestream.store.frame`), so the rounded span of each expert's
run lands in that expert's own buffer, one iovec per expert run, and the tensors are
views at their offsets inside it. Nothing is copied but the bytes of a block that two
neighbouring experts share (a run that ends or starts inside a block): that block is read
into a small per-thread scratch buffer and its bytes copied to each side (at most 4 KiB
per boundary). The tensors hold exactly the bytes the buffered path puts at the same
offsets, so the kernels, and the output bits, do not depend on the read path.

Buffers that are not 4 KiB-aligned (a plain ``read`` of arbitrary views) go through a
per-thread bounce buffer and are copied out, as before.

Why huge pages (the store's :class:`~moestream.store.HugePagePool`): on the development
machine's virtual disk an ``O_DIRECT`` read into a buffer scattered over 4 KiB pages is
split into many small requests (0.5-1.4 GB/s); into 2 MiB-aligned huge pages it goes
through whole (3.1-3.3 GB/s; ``docs/benchmarks.md``).

Where ``O_DIRECT`` is refused (some filesystems refuse the open or the read with
``EINVAL``), the file is read through the page cache and each range is dropped from it
afterwards with ``posix_fadvise(POSIX_FADV_DONTNEED)``; this is said once per reader.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .checkpoint import FileHandles, pread_full
from .errors import ReadError
from .store import BLOCK, HUGE_PAGE, Extent, Reader, address_of

# O_DIRECT offsets, lengths and buffer addresses are multiples of this (bytes).
DIRECT_ALIGN = BLOCK
_address = address_of


class HugePageBuffer:
    """A private anonymous mapping of at least ``nbytes``, starting at a 2 MiB boundary,
    advised to use transparent huge pages (``MADV_HUGEPAGE``).

    Python's default ``mmap.mmap(-1, n)`` is a shared mapping, which never gets huge
    pages; a private one does. ``view`` is a writable memoryview of exactly the aligned
    ``nbytes``; ``address`` its first byte.
    """

    def __init__(self, nbytes: int):
        self.nbytes = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, self.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = _address(self._map)
        self.skip = -base % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self.skip, self.nbytes)
            except OSError:
                pass  # no transparent huge pages: still correct, only slower on some disks
        self.address = base + self.skip
        self.view = memoryview(self._map)[self.skip : self.skip + self.nbytes]


def _stderr_note(text: str) -> None:
    print(f"moestream: note: {text}", file=sys.stderr, flush=True)


def _open_direct(file: Path) -> int:
    """Open ``file`` read-only with ``O_DIRECT`` (raises OSError where refused)."""
    return os.open(file, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))


def _floor(x: int) -> int:
    return x - x % BLOCK


def _ceil(x: int) -> int:
    return -(-x // BLOCK) * BLOCK


class DirectReader(Reader):
    """Positional reads that bypass the page cache (``O_DIRECT``), in place, with a fallback.

    :meth:`read_into` (the store's call) reads each coalesced range straight into the
    experts' buffers; each reader thread keeps a small scratch buffer for the blocks two
    experts share. :meth:`read` (arbitrary buffers) reads into a per-thread bounce buffer
    of huge pages as large as the largest read it has done and copies out.

    Args:
        note: called once with a sentence when a file refuses ``O_DIRECT`` (default:
            printed to stderr).

    Attributes:
        fallback_files: shards read through the page cache (``O_DIRECT`` refused).
        direct_bytes: bytes read from the disk with ``O_DIRECT``, alignment included;
            ``in_place_bytes`` of them straight into expert buffers.
        direct_seconds, copy_seconds: time in ``O_DIRECT`` reads and in copies (shared
            blocks, bounce buffers), summed over threads (where the read path's time goes).
    """

    def __init__(self, note: Callable[[str], None] | None = None):
        if not hasattr(os, "O_DIRECT"):
            raise ReadError("O_DIRECT reads are not available on this system; use the page cache")
        self._note = note or _stderr_note
        self._noted = False
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._buffers: list[HugePageBuffer] = []
        self._fallback = FileHandles(getattr(os, "POSIX_FADV_RANDOM", None))
        self.fallback_files: set[Path] = set()
        self.direct_bytes = 0
        self.in_place_bytes = 0
        self.direct_seconds = 0.0
        self.copy_seconds = 0.0

    # -- files ---------------------------------------------------------------------------
    def _refuse(self, file: Path, err: OSError) -> None:
        with self._lock:
            self.fallback_files.add(file)
            fd = self._fds.pop(file, None)
            first = not self._noted
            self._noted = True
        if fd is not None:
            os.close(fd)
        if first:
            self._note(
                f"{file}: O_DIRECT refused ({err.strerror or err}); reading through the page cache and dropping each "
                "range from it after the read (posix_fadvise DONTNEED)"
            )

    def _fd(self, file: Path) -> int | None:
        """The ``O_DIRECT`` descriptor of ``file``, or None when it falls back."""
        fd = self._fds.get(file)
        if fd is not None or file in self.fallback_files:
            return fd
        with self._lock:
            fd = self._fds.get(file)
            if fd is not None or file in self.fallback_files:
                return fd
            try:
                fd = _open_direct(file)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise ReadError(f"{file}: cannot open: {e.strerror or e}") from None
                refused = e
            else:
                self._fds[file] = fd
                return fd
        self._refuse(file, refused)
        return None

    def _buffer(self, attr: str, nbytes: int, least: int) -> HugePageBuffer:
        """This thread's bounce (``attr="bounce"``) or scratch buffer of at least ``nbytes``."""
        buf = getattr(self._local, attr, None)
        if buf is None or buf.nbytes < nbytes:
            buf = HugePageBuffer(max(nbytes, least))
            setattr(self._local, attr, buf)
            with self._lock:
                self._buffers.append(buf)  # the old one is kept until close: its thread may be mid-copy
        return buf

    def _fallback_read(self, file: Path, offset: int, buffers: list[memoryview], what: str) -> int:
        fd = self._fallback.get(file)
        n = pread_full(fd, offset, buffers, file, what)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, sum(len(b) for b in buffers), os.POSIX_FADV_DONTNEED)
        return n

    # -- reads ---------------------------------------------------------------------------
    def read(self, file: Path, offset: int, buffers: list[memoryview], what: str) -> int:
        """Fill ``buffers`` in order from byte ``offset`` of ``file`` (through the bounce buffer);
        return the bytes asked for.

        Raises:
            ReadError: naming ``what`` and ``file`` on an OS error or a short read.
        """
        total = sum(len(b) for b in buffers)
        fd = self._fd(file)
        if fd is not None:
            try:
                return self._read_bounced(fd, file, offset, total, buffers, what)
            except OSError as e:  # EINVAL: this filesystem accepted the open, not the read
                if e.errno != errno.EINVAL:
                    raise ReadError(f"reading {what} from {file} at byte {offset}: {e.strerror or e}") from None
                self._refuse(file, e)
        return self._fallback_read(file, offset, buffers, what)

    def read_into(self, file: Path, offset: int, extents: list[Extent], what: str) -> int:
        """Fill each extent's view from byte ``offset`` of ``file``, reading the 4 KiB-rounded range
        straight into the experts' buffers (see the module docstring); return the bytes asked for.

        Falls back to :meth:`read` when a buffer is not 4 KiB-aligned or its run's rounded span
        does not fit in it (a buffer not laid out by the store).

        Raises:
            ReadError: naming ``what`` and ``file`` on an OS error or a short read; the buffers
                may then hold part of the range (the store never hands such an expert out).
        """
        fd = self._fd(file)
        if fd is None:
            return self._fallback_read(file, offset, [e.view for e in extents], what)
        plan = self._plan_in_place(offset, extents)
        if plan is None:
            return self.read(file, offset, [e.view for e in extents], what)
        try:
            return self._read_in_place(fd, file, offset, plan, what)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise ReadError(f"reading {what} from {file} at byte {offset}: {e.strerror or e}") from None
            self._refuse(file, e)
        return self._fallback_read(file, offset, [e.view for e in extents], what)

    @staticmethod
    def _plan_in_place(offset: int, extents: list[Extent]):
        """Split a range into segments (consecutive extents in one buffer with one shift), each
        ``[base, shift, start, end]`` in file bytes, or None when it cannot be read in place."""
        segs: list[list] = []
        pos = offset
        for ex in extents:
            n = len(ex.view)
            last = segs[-1] if segs else None
            if last is not None and last[0] is ex.base and last[1] == ex.shift:
                last[3] = pos + n
            else:
                segs.append([ex.base, ex.shift, pos, pos + n])
            pos += n
        addrs: dict[int, int] = {}
        for base, shift, a, e in segs:
            addr = addrs.get(id(base))
            if addr is None:
                addr = addrs[id(base)] = address_of(base)
            if addr % BLOCK or _floor(a) + shift < 0 or _ceil(e) + shift > len(base):
                return None
        return segs

    def _read_in_place(self, fd: int, file: Path, offset: int, segs: list[list], what: str) -> int:
        start, end = _floor(offset), segs[-1][3]
        # the iovecs: each segment's own whole blocks straight into its buffer; blocks that two or
        # more segments share ("gaps") into the scratch buffer, copied to each side afterwards
        pieces: list[tuple[str, int, int, int]] = []  # ("own", seg index, file start, file end) / ("gap", ...)
        cursor = start
        last = len(segs) - 1
        for i, (_, _, a, e) in enumerate(segs):
            own0 = a if a % BLOCK == 0 else (_ceil(a) if i > 0 else _floor(a))
            own1 = e if e % BLOCK == 0 else (_floor(e) if i < last else _ceil(e))
            if own0 >= own1:
                continue
            if own0 > cursor:
                pieces.append(("gap", -1, cursor, own0))
            pieces.append(("own", i, own0, own1))
            cursor = own1
        if cursor < _ceil(end):
            pieces.append(("gap", -1, cursor, _ceil(end)))
        scratch_need = sum(p[3] - p[2] for p in pieces if p[0] == "gap")
        scratch = self._buffer("scratch", scratch_need, HUGE_PAGE) if scratch_need else None
        iov, gaps, s_at = [], [], 0
        for kind, i, f0, f1 in pieces:
            if kind == "own":
                base, shift = segs[i][0], segs[i][1]
                iov.append(base[f0 + shift : f1 + shift])
            else:
                iov.append(scratch.view[s_at : s_at + f1 - f0])
                gaps.append((f0, f1, s_at))
                s_at += f1 - f0
        t0 = time.perf_counter()
        got = _preadv_full(fd, iov, start, end - start)
        t1 = time.perf_counter()
        if got < end - start:
            raise ReadError(
                f"reading {what} from {file}: short read, the file ends at byte {start + got} before byte {end}: "
                "truncated or replaced?"
            )
        j = 0
        for g0, g1, at in gaps:  # a shared block's bytes to each segment that has some of them (both in file order)
            while segs[j][3] <= g0:
                j += 1
            for base, shift, a, e in segs[j:]:
                if a >= g1:
                    break
                x0, x1 = max(a, g0), min(e, g1)
                if x0 < x1:
                    base[x0 + shift : x1 + shift] = scratch.view[at + x0 - g0 : at + x1 - g0]
        t2 = time.perf_counter()
        own = sum(p[3] - p[2] for p in pieces if p[0] == "own")
        with self._lock:
            self.direct_bytes += got
            self.in_place_bytes += min(own, got)
            self.direct_seconds += t1 - t0
            self.copy_seconds += t2 - t1
        return sum(e - a for _, _, a, e in segs)

    def _read_bounced(self, fd: int, file: Path, offset: int, total: int, buffers: list[memoryview],
                      what: str) -> int:
        start = _floor(offset)
        end = offset + total
        span = _ceil(end - start)
        buf = self._buffer("bounce", span, 16 * 1024 * 1024 + 2 * DIRECT_ALIGN)
        t0 = time.perf_counter()
        got = _preadv_full(fd, [buf.view[:span]], start, end - start)
        if got < end - start:
            raise ReadError(
                f"reading {what} from {file}: short read, the file ends at byte {start + got} "
                f"before byte {end}: truncated or replaced?"
            )
        t1 = time.perf_counter()
        pos = buf.address + (offset - start)
        for b in buffers:  # ctypes.memmove releases the GIL, so compute goes on meanwhile
            if len(b):
                ctypes.memmove(_address(b), pos, len(b))
                pos += len(b)
        t2 = time.perf_counter()
        with self._lock:
            self.direct_bytes += got
            self.direct_seconds += t1 - t0
            self.copy_seconds += t2 - t1
        return total

    def close(self) -> None:
        """Close the shard descriptors and drop the bounce and scratch buffers."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            self._buffers.clear()
        for fd in fds:
            os.close(fd)
        self._fallback.close()
        self._local = threading.local()


def _preadv_full(fd: int, iov: list[memoryview], offset: int, need: int) -> int:
    """``O_DIRECT`` ``preadv`` of the block-aligned iovecs ``iov`` from ``offset`` until ``need``
    bytes have come, resuming after a partial read of whole blocks; returns the bytes read
    (fewer than ``need`` at the end of the file or after a read that stopped inside a block)."""
    got = 0
    while got < need:
        n = os.preadv(fd, iov, offset + got)
        if n <= 0:
            break
        got += n
        if n % BLOCK:  # the end of the file (a final partial block); nothing more can follow
            break
        while n and iov:  # drop what came; the rest starts at a block boundary
            if n >= len(iov[0]):
                n -= len(iov[0])
                iov = iov[1:]
            else:
                iov = [iov[0][n:], *iov[1:]]
                n = 0
        if not iov:
            break
    return got
