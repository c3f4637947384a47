"""The I/O settings of a loaded model: read path, prefetch, wired memory, the page cache.

``engine.load`` calls :func:`plan_io` before any expert is read, feeds the resident weights'
progress through :meth:`IOSettings.resident_progress` (which keeps their page cache from
being charged to a memory cap when expert reads bypass it) and calls :meth:`IOSettings.start`
once the resident weights are in (the cache budget is :mod:`moestream.budget`'s). None of
these settings changes the output: they decide how and when bytes are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import memory, prefetch  # prefetch.CHUNK_WINDOW_PER_WORKER looked up at call time (tests set it)
from .cache import ExpertCache
from .checkpoint import Checkpoint
from .direct_io import DirectReader
from .memory import WiredMemory
from .prefetch import Prefetcher
from .store import PreadReader, Reader

# Use the page cache (auto) only when the checkpoint is under this share of the memory
# available: then most of it stays cached and re-reads are free; above it the page cache
# thrashes and only costs copies and reclaim.
PAGE_CACHE_SHARE = 0.6
# While the resident weights load through the page cache, drop the shards' cached pages after
# every this many bytes (when expert reads bypass the page cache), so a memory cap never
# holds more than this much of it (plus the tensor being read).
DROP_EVERY = 64 * 1024 * 1024


def drop_page_cache(files) -> None:
    """``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole of each file: its clean cached pages
    are dropped (and stop counting against a cgroup's memory). Files that cannot be opened are skipped."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class IOSettings:
    """What :func:`plan_io` chose, and the objects it made.

    Attributes:
        reader: the store's read path (:class:`~moestream.store.PreadReader` or
            :class:`~moestream.direct_io.DirectReader`).
        use_page_cache: whether expert reads go through the OS page cache.
        page_cache_reason: why (the option, or the auto rule with its numbers).
        checkpoint_bytes: bytes of the checkpoint's shards.
        prefetch_ahead: layers read ahead in decode (0: off); ``prefetcher`` the object, once started.
        chunk_window: experts of the next layer read ahead during a prefill chunk (0: off; the
            CPU expert cache only).
        wire_memory: whether resident weights and cached experts are mlocked;
            ``wired`` the :class:`~moestream.memory.WiredMemory`, once started.
    """

    reader: Reader
    use_page_cache: bool
    page_cache_reason: str
    checkpoint_bytes: int
    prefetch_ahead: int = 0
    wire_memory: bool = False
    chunk_window: int = 0
    prefetcher: object = None
    wired: WiredMemory | None = None

    def resident_progress(self, ckpt: Checkpoint, progress=None):
        """A progress callback for the resident weights' load (``progress(nbytes)`` per tensor).

        When expert reads bypass the page cache, the resident weights are its only use: their
        shards' cached pages are dropped every :data:`DROP_EVERY` bytes as they load, so that the
        page cache charged to a memory cap stays small (measured: a cap's peak was the resident
        weights twice over, once in memory and once as page cache, until they were all in).
        """
        if self.use_page_cache:
            return progress
        done = [0]

        def step(nbytes: int) -> None:
            if progress is not None:
                progress(nbytes)
            done[0] += nbytes
            if done[0] >= DROP_EVERY:
                done[0] = 0
                drop_page_cache(ckpt.shards)

        return step

    def start(self, ckpt: Checkpoint, net, store, cache, owns=None) -> None:
        """After the resident weights are loaded: drop the rest of their page cache when it is
        not used, lock them (``wire_memory``), and start the prefetcher (decode read-ahead with
        ``prefetch_ahead``; prefill read-ahead with ``chunk_window`` when experts stream through
        the CPU cache), reading ahead only experts ``owns(key)`` accepts, under expert parallelism."""
        if not self.use_page_cache:
            drop_page_cache(ckpt.shards)  # the resident weights were read buffered, once
        if self.wire_memory:
            self.wired = WiredMemory()
            self.wired.lock_tensors(net.parameters(), "the resident weights")
            store.wired = self.wired
        window = self.chunk_window if type(cache) is ExpertCache and cache.budget_bytes is not None else 0
        if self.prefetch_ahead > 0 or window > 0:
            self.prefetcher = Prefetcher(store, net.moe_blocks(), self.prefetch_ahead, owns=owns, window=window)
            self.prefetcher.attach(cache)

    def describe(self) -> str:
        """One line on the read path, for the user."""
        if self.use_page_cache:
            path = "through the page cache"
        else:
            path = "O_DIRECT into huge-page buffers (page cache bypassed)"
        extra = f", prefetch {self.prefetch_ahead} layer(s) ahead" if self.prefetch_ahead else ""
        extra += f", prefill reads {self.chunk_window} experts of the next layer ahead" if self.chunk_window else ""
        extra += ", memory wired (mlock)" if self.wire_memory else ""
        return f"expert reads: {path} ({self.page_cache_reason}){extra}"


def plan_io(ckpt: Checkpoint, workers: int, use_page_cache: bool | None, prefetch_ahead: int,
            wire_memory: bool, chunk_reads: bool = True) -> IOSettings:
    """Choose the read path: the page cache when asked (or, by default, when the checkpoint
    is under :data:`PAGE_CACHE_SHARE` of the memory available), else ``O_DIRECT``; and the
    prefill read-ahead window (``chunk_reads``: the CPU expert cache; 2 experts per reader thread)."""
    size = 0
    for f in ckpt.shards:
        try:
            size += f.stat().st_size
        except OSError:
            pass
    if use_page_cache is None:
        avail, source = memory.available_with_source()
        use_page_cache = size < PAGE_CACHE_SHARE * avail
        reason = (f"auto: the checkpoint's {size / 1e9:.2f} GB is {'under' if use_page_cache else 'over'} "
                  f"{PAGE_CACHE_SHARE} of the {avail / 1e9:.2f} GB available, {source}")
    else:
        reason = "--use-page-cache" if use_page_cache else "--no-page-cache"
    if use_page_cache or not hasattr(os, "O_DIRECT"):
        reader: Reader = PreadReader()
        use_page_cache = True
    else:
        reader = DirectReader()
    window = prefetch.CHUNK_WINDOW_PER_WORKER * workers if chunk_reads else 0
    return IOSettings(reader, use_page_cache, reason, size, prefetch_ahead, wire_memory, window)
