"""The I/O settings of a loaded model: read path, auto cache budget, prefetch, wired memory.

``engine.load`` calls :func:`plan_io` before any expert is read, then
:meth:`IOSettings.size_budget` (for ``--cache-budget-gb auto``) and
:meth:`IOSettings.start` once the resident weights are in. None of these settings
changes the output: they decide how and when bytes are read and where they are kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from . import memory
from .checkpoint import Checkpoint
from .memory import AutoBudget, WiredMemory, auto_cache_budget, check_memlock
from .store import MAX_READ_BYTES, PreadReader, Reader

# Use the page cache (auto) only when the checkpoint is under this share of the memory
# available: then most of it stays cached and re-reads are free; above it the page cache
# thrashes and only costs copies and reclaim.
PAGE_CACHE_SHARE = 0.6
# Tokens of context the auto budget keeps room for in the KV cache, when not told.
DEFAULT_CONTEXT_TOKENS = 4096


def is_auto(budget) -> bool:
    """Whether a ``--cache-budget-gb`` value is ``auto``."""
    return isinstance(budget, str) and budget.strip().lower() == "auto"


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
        auto: how the ``auto`` budget was sized (None for a given budget).
        budget: the cache budget in bytes (None: every expert).
    """

    reader: Reader
    use_page_cache: bool
    page_cache_reason: str
    checkpoint_bytes: int
    prefetch_ahead: int = 0
    wire_memory: bool = False
    auto: AutoBudget | None = None
    budget: int | None = None
    prefetcher: object = None
    wired: WiredMemory | None = None
    reserve_bytes: int = field(default=0, repr=False)

    def size_budget(self, net, store, keys: list, budget: int | None, dtype: torch.dtype, auto: bool,
                    context_tokens: int | None, share: int = 1) -> int | None:
        """The cache budget in bytes: ``budget`` as given, or sized for ``auto``.

        ``share``: ranks on this machine (expert parallelism); ``auto`` takes this rank's
        share of the memory available.

        ``auto``: memory available (:func:`moestream.memory.available_with_source`: cgroup
        v1/v2 limits included) less the resident weights (``net`` on the meta device, in
        ``dtype``), the KV cache for ``context_tokens`` (twice its size, since it grows
        by doubling), and a reserve: the PyTorch runtime (0.5 GB), reads in flight
        (2 x workers reads of up to 16 MiB), the store's free buffers (2 x workers
        experts), O_DIRECT bounce buffers (18 MiB per worker) and the prefetch staging
        area (``ahead`` x top-k experts). Capped at every expert.

        Raises:
            BudgetError: when nothing is left for the cache (with the numbers), or, with
                ``wire_memory``, when RLIMIT_MEMLOCK is below what must be locked.
        """
        experts = sum(store.cached_nbytes(k) for k in keys)
        one = max((store.cached_nbytes(k) for k in keys), default=0)
        resident = _resident_bytes(net, dtype)
        workers = store.workers
        reserve = memory.RUNTIME_RESERVE + 2 * workers * max(MAX_READ_BYTES, one) + 2 * workers * one
        if not self.use_page_cache:
            reserve += workers * (MAX_READ_BYTES + 2 * 1024 * 1024)
        top_k = getattr(getattr(net, "args", None), "num_experts_per_tok", 8)
        reserve += self.prefetch_ahead * top_k * one
        self.reserve_bytes = reserve
        if auto:
            ctx = context_tokens or min(DEFAULT_CONTEXT_TOKENS, net.max_context or DEFAULT_CONTEXT_TOKENS)
            kv = 2 * ctx * _kv_bytes_per_token(net, dtype)
            self.auto = auto_cache_budget(resident, kv, ctx, reserve, experts, share=share)
            budget = self.auto.budget
        self.budget = budget
        if self.wire_memory:
            check_memlock(resident + (experts if budget is None else min(budget, experts)) + 2 * workers * one)
        return budget

    def start(self, ckpt: Checkpoint, net, store, cache) -> None:
        """After the resident weights are loaded: drop them from the page cache when it is
        not used, lock them (``wire_memory``), and start the prefetcher."""
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
            from .prefetch import Prefetcher

            self.prefetcher = Prefetcher(store, net.moe_blocks(), self.prefetch_ahead)
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


def _resident_bytes(net, dtype: torch.dtype) -> int:
    """Bytes of ``net``'s parameters (on the meta device: shapes only) once cast to ``dtype``."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    seen, total = set(), 0
    for p in net.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * (itemsize if p.is_floating_point() else p.element_size())
    return total


def _kv_bytes_per_token(net, dtype: torch.dtype) -> int:
    """KV cache bytes one token adds: keys and values of every attention layer."""
    from .models.layers import Attention

    itemsize = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * m.kv_heads * m.head_dim * itemsize for m in net.modules() if isinstance(m, Attention))


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
        from .direct_io import DirectReader

        reader = DirectReader()
    return IOSettings(reader, use_page_cache, reason, size, prefetch_ahead, wire_memory)
