"""Reads that bypass the OS page cache: ``O_DIRECT`` into huge-page bounce buffers.

When a checkpoint is much bigger than memory, the page cache only costs: every expert
read is copied into it, the kernel has to reclaim it (inside a cgroup cap, on the
reading thread), and it evicts what the process needs. :class:`DirectReader` opens
shards with ``O_DIRECT`` and reads each coalesced range -- its start rounded down and
its end rounded up to the block size -- into a per-thread bounce buffer made of 2 MiB
transparent huge pages, then copies the bytes asked for into the experts' buffers (the
extra bytes at either end are dropped). The copy keeps each tensor at the same 64-byte
aligned offset of its expert buffer whatever the read path, so the kernels, and the
output bits, do not depend on it.

Why huge pages: on the development machine's virtual disk an ``O_DIRECT`` read into a
buffer scattered over 4 KiB pages is split into many small requests (0.5-1.4 GB/s); into
2 MiB-aligned huge pages it goes through whole (3.1-3.3 GB/s; ``docs/benchmarks.md``).

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
from .store import Reader

HUGE_PAGE = 2 * 1024 * 1024
# O_DIRECT offsets, lengths and buffer addresses are multiples of this (bytes). The
# logical block size of a disk is 512 or 4096; 4096 satisfies both.
DIRECT_ALIGN = 4096


def _address(buf) -> int:
    """Address of the first byte of a writable buffer (mmap or memoryview)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


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


class DirectReader(Reader):
    """Positional reads that bypass the page cache (``O_DIRECT``), with a fallback.

    Each reader thread owns one bounce buffer
    (:class:`HugePageBuffer`) as large as the largest read it has done (16 MiB plus two
    blocks for the store's coalesced reads), so memory outside the cache budget grows by
    ``workers`` such buffers.

    Args:
        note: called once with a sentence when a file refuses ``O_DIRECT`` (default:
            printed to stderr).

    Attributes:
        fallback_files: shards read through the page cache (``O_DIRECT`` refused).
        direct_bytes: bytes read from the disk with ``O_DIRECT``, alignment included.
        direct_seconds, copy_seconds: time in ``O_DIRECT`` reads and in copies out of the
            bounce buffers, summed over threads (where the read path's time goes).
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

    def _bounce(self, nbytes: int) -> HugePageBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = HugePageBuffer(max(nbytes, 16 * 1024 * 1024 + 2 * DIRECT_ALIGN))
            self._local.buf = buf
            with self._lock:
                self._buffers.append(buf)  # the old one is kept until close: its thread may be mid-copy
        return buf

    # -- reads ---------------------------------------------------------------------------
    def read(self, file: Path, offset: int, buffers: list[memoryview], what: str) -> int:
        """Fill ``buffers`` in order from byte ``offset`` of ``file``; return the bytes asked for.

        Raises:
            ReadError: naming ``what`` and ``file`` on an OS error or a short read.
        """
        total = sum(len(b) for b in buffers)
        fd = self._fd(file)
        if fd is not None:
            try:
                return self._read_direct(fd, file, offset, total, buffers, what)
            except OSError as e:  # EINVAL: this filesystem accepted the open, not the read
                if e.errno != errno.EINVAL:
                    raise ReadError(f"reading {what} from {file} at byte {offset}: {e.strerror or e}") from None
                self._refuse(file, e)
        fd = self._fallback.get(file)
        n = pread_full(fd, offset, buffers, file, what)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)
        return n

    def _read_direct(self, fd: int, file: Path, offset: int, total: int, buffers: list[memoryview], what: str) -> int:
        start = offset - offset % DIRECT_ALIGN
        end = offset + total
        span = -(-(end - start) // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = self._bounce(span)
        got = 0
        t0 = time.perf_counter()
        while start + got < end:
            n = os.preadv(fd, [buf.view[got:span]], start + got)
            if n <= 0 or n % DIRECT_ALIGN:  # end of file (a final partial block), or nothing more
                got += max(n, 0)
                if start + got < end:
                    raise ReadError(
                        f"reading {what} from {file}: short read, the file ends at byte {start + got} "
                        f"before byte {end}: truncated or replaced?"
                    )
                break
            got += n
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
        """Close the shard descriptors and drop the bounce buffers."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            self._buffers.clear()
        for fd in fds:
            os.close(fd)
        self._fallback.close()
        self._local = threading.local()
