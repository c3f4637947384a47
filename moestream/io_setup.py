"""The I/O settings of a loaded model: read path, prefetch, wired memory.

``engine.load`` calls :func:`plan_io` before any expert is read and :meth:`IOSettings.start`
once the resident weights are in (the cache budget is :mod:`moestream.budget`'s). None of
these settings changes the output: they decide how and when bytes are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import memory
from .checkpoint import Checkpoint
from .direct_io import DirectReader
from .memory import WiredMemory
from .prefetch import Prefetcher
from .store import PreadReader, Reader

# Use the page cache (auto) only when the checkpoint is under this share of the memory
# available: then most of it stays cached and re-reads are free; above it the page cache
# thrashes and only costs copies and reclaim.
PAGE_CACHE_SHARE = 0.6


@dataclass
class IOSettings:
    """What :func:`plan_io` chose, and the objects it made.

    Attributes:
        reader: the store's read path (:class:`~moestream.store.PreadReader` or
            :class:`~moestream.direct_io.DirectReader`).
        use_page_cache: whether expert reads go through the OS page cache.
        page_cache_reason: why (the option, or the auto rule with its numbers).
        checkpoint_bytes: bytes of the checkpoint's shards.
        prefetch_ahead: layers read ahead (0: off); ``prefetcher`` the object, once started.
        wire_memory: whether resident weights and cached experts are mlocked;
            ``wired`` the :class:`~moestream.memory.WiredMemory`, once started.
    """

    reader: Reader
    use_page_cache: bool
    page_cache_reason: str
    checkpoint_bytes: int
    prefetch_ahead: int = 0
    wire_memory: bool = False
    prefetcher: object = None
    wired: WiredMemory | None = None

    def start(self, ckpt: Checkpoint, net, store, cache, owns=None) -> None:
        """After the resident weights are loaded: drop them from the page cache when it is
        not used, lock them (``wire_memory``), and start the prefetcher (reading ahead only
        experts ``owns(key)`` accepts, under expert parallelism)."""
        if not self.use_page_cache and hasattr(os, "posix_fadvise"):
            for f in ckpt.shards:  # the resident weights were read buffered, once
                try:
                    fd = os.open(f, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        if self.wire_memory:
            self.wired = WiredMemory()
            self.wired.lock_tensors(net.parameters(), "the resident weights")
            store.wired = self.wired
        if self.prefetch_ahead > 0:
            self.prefetcher = Prefetcher(store, net.moe_blocks(), self.prefetch_ahead, owns=owns)
            self.prefetcher.attach(cache)

    def describe(self) -> str:
        """One line on the read path, for the user."""
        if self.use_page_cache:
            path = "through the page cache"
        else:
            path = "O_DIRECT into huge-page buffers (page cache bypassed)"
        extra = f", prefetch {self.prefetch_ahead} layer(s) ahead" if self.prefetch_ahead else ""
        extra += ", memory wired (mlock)" if self.wire_memory else ""
        return f"expert reads: {path} ({self.page_cache_reason}){extra}"


def plan_io(ckpt: Checkpoint, workers: int, use_page_cache: bool | None, prefetch_ahead: int,
            wire_memory: bool) -> IOSettings:
    """Choose the read path: the page cache when asked (or, by default, when the checkpoint
    is under :data:`PAGE_CACHE_SHARE` of the memory available), else ``O_DIRECT``."""
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
    return IOSettings(reader, use_page_cache, reason, size, prefetch_ahead, wire_memory)
