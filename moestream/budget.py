"""The cache budget: parsed once, sized once, checked against the memory available before any weight is read.

Every figure is in bytes unless named ``_gb`` (GB = 10^9 bytes, as ``--cache-budget-gb``); a budget is printed as a
plain number of GB (:func:`gb_text`). Messages name an option as the caller gave it (``name``: the CLI's
:func:`~moestream.errors.flag` by default, or ``EngineOptions.name``).

* :func:`parse_budget` reads a ``--cache-budget-gb`` value (a number of GB, ``all``,
  ``auto``); :func:`parse_host_budget` a ``--host-cache-gb`` value.
* :func:`resident_bytes` counts the resident weights (the one place that does).
* :func:`plan_cpu_budget` sizes the CPU expert cache (``auto``: the memory available less
  resident weights, KV cache and a reserve) and refuses a budget that cannot fit;
  :func:`plan_device_budget` does the same for the VRAM cache of a CUDA device;
  :func:`plan_host_budget` sizes the pinned host tier behind it.

None of this changes the output: it decides how many experts stay in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import memory  # its functions looked up at call time (tests replace them)
from .errors import BudgetError, flag, given

if TYPE_CHECKING:  # the CLI parses budgets before torch is imported
    import torch

GB = 1e9  # the one definition: engine, inspect and the rest import it
AUTO = "auto"
# What the PyTorch runtime, the interpreter and activations take beyond the weights,
# measured as about 0.5 GB on the development machine; part of the reserve.
RUNTIME_RESERVE = 500_000_000
# Tokens of context the auto budget keeps room for in the KV cache, when not told.
DEFAULT_CONTEXT_TOKENS = 4096


def gb_text(nbytes: float, digits: int = 3) -> str:
    """``nbytes`` as a plain number of GB, never an exponent: ``digits`` significant digits, whole GB from
    ``10^(digits-1)`` GB on (``100000``, ``3``, ``0.5``, ``12.5``, ``0.00001``)."""
    gb = nbytes / GB
    if gb == 0 or not math.isfinite(gb):
        return f"{gb:g}"
    if abs(gb) >= 10 ** (digits - 1):
        return f"{gb:.0f}"
    decimals = digits - 1 - math.floor(math.log10(abs(gb)))
    return f"{gb:.{decimals}f}".rstrip("0").rstrip(".")


def is_auto(value) -> bool:
    """Whether a ``--cache-budget-gb`` / ``--host-cache-gb`` value is ``auto``."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def _gb(value, name: str, extra: str) -> float:
    said = given(name, repr(value), ": ")  # --cache-budget-gb: 'x', cache_budget_gb='x'
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise BudgetError(f"{said} is not a number of GB: give a number between 0 and 1e9{extra} "
                          "(it must be a number of GB)") from None
    if not (0 <= gb < 1e9):  # a billion GB is more than any machine; NaN fails too
        raise BudgetError(f"{said} must be a number of GB between 0 and 1e9{extra}")
    return gb


def parse_budget(value: str | float | None, name: str = "--cache-budget-gb") -> int | None | str:
    """A ``--cache-budget-gb`` value (``name``: the option as the caller gave it): bytes, None for ``all`` (every
    expert resident), or ``"auto"``.

    Raises:
        BudgetError: for a negative, non-finite or unparsable value.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if is_auto(value):
        return AUTO
    return int(_gb(value, name, ", 'all' or 'auto'") * GB)


def parse_host_budget(value: str | float | None, name: str = "--host-cache-gb") -> int | None | str:
    """A ``--host-cache-gb`` value (``name``: as the caller gave it): bytes, ``"auto"``, or None (no host tier).

    Raises:
        BudgetError: for a negative, non-finite or unparsable value.
    """
    if value is None:
        return None
    if is_auto(value):
        return AUTO
    return int(_gb(value, name, ", or 'auto'") * GB)


def resident_bytes(net: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``net``'s parameters, each tensor counted once (tied weights).

    A parameter still on the meta device (shapes only, before loading) counts at ``dtype``'s
    size when it is floating point (it will be loaded in the compute dtype); a loaded one,
    or an integer one (packed quantized weights), at its own element size.
    """
    itemsize = None if dtype is None else dtype.itemsize
    seen, total = set(), 0
    for p in net.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = itemsize if (p.is_meta and itemsize is not None and p.is_floating_point()) else p.element_size()
        total += p.numel() * size
    return total


def kv_bytes_per_token(net: torch.nn.Module, dtype: torch.dtype) -> int:
    """KV cache bytes one token adds: the model's :meth:`~moestream.models.base.CausalLM.kv_bytes_per_token`."""
    return net.kv_bytes_per_token(dtype.itemsize)


@dataclass
class AutoBudget:
    """How ``--cache-budget-gb auto`` was sized.

    ``budget = available - resident - kv_cache - reserve``, at least 0 and at most
    ``experts_total``; ``available`` is the memory this process can still take
    (:func:`moestream.memory.available_bytes`: MemAvailable, or a cgroup limit less this
    process's RSS, whichever is smaller), ``source`` says which.
    """

    available: int
    source: str
    resident: int
    kv_cache: int
    kv_tokens: int
    reserve: int
    experts_total: int
    budget: int

    def describe(self) -> str:
        """One line with the numbers, for the user."""
        capped = self.budget == self.experts_total
        return (
            f"cache budget auto: {self.budget / GB:.2f} GB = {self.available / GB:.2f} GB available ({self.source}) "
            f"- {self.resident / GB:.2f} GB resident weights - {self.kv_cache / GB:.2f} GB KV cache "
            f"({self.kv_tokens} tokens) - {self.reserve / GB:.2f} GB runtime reserve"
            + (f" (capped at every expert, {self.experts_total / GB:.2f} GB)" if capped else "")
        )


def _context_hint(room: int, per_token: int, tokens: int, sequences: int, prefix_cache: int,
                  name: Callable[[str], str], strict: bool = False) -> str | None:
    """What to say when the KV caches are what does not fit: everything else fits in ``room`` bytes and a context
    shorter than ``tokens`` would too (``per_token``: the bytes a token of context adds, every sequence's caches at
    twice their size; ``strict``: the room must stay above 0, as ``auto``'s cache needs); the other ways out, fewer
    sequences and a smaller prefix cache, where they apply. None otherwise."""
    if per_token <= 0 or room <= 0:
        return None
    fit = (room - 1) // per_token if strict else room // per_token
    if not 1 <= fit < tokens:
        return None
    each = f" for each of {sequences} sequences" if sequences > 1 else ""
    return (f"the KV cache is what does not fit: give a smaller {name('context_tokens')} (at most {fit} tokens of "
            f"context fit{each})" + (f", or fewer {name('max_batch')} sequences" if sequences > 1 else "")
            + (f", or a smaller {name('prefix_cache')}" if prefix_cache else ""))


def auto_cache_budget(resident: int, kv_cache: int, kv_tokens: int, reserve: int, experts_total: int,
                      root=None, share: int = 1, prefix_cache: int = 0, sequences: int = 1,
                      name: Callable[[str], str] = flag) -> AutoBudget:
    """Size the expert cache from the memory really available (``--cache-budget-gb auto``).

    Args: ``resident`` weights not yet loaded, ``kv_cache`` for the context of ``kv_tokens``
    tokens (``prefix_cache`` bytes of it the prefix cache's, the rest ``sequences`` KV caches), ``reserve`` for the
    runtime and reads in flight, ``experts_total`` every expert
    (the budget never exceeds it). ``root``: a fake ``/`` for tests (default
    :data:`moestream.memory.SYSTEM_ROOT`). ``share``: processes on this machine that split
    its memory (expert parallelism under torchrun); each takes ``available / share``. ``name``: how the message
    names an option.

    Raises:
        BudgetError: when nothing is left for the cache, with the numbers (and, when the KV cache is what does not
            fit, the context that would).
    """
    avail, source = memory.available_with_source(root)
    if share > 1:
        avail, source = avail // share, f"{source}, split between {share} local ranks"
    left = avail - resident - kv_cache - reserve
    out = AutoBudget(avail, source, resident, kv_cache, kv_tokens, reserve, experts_total,
                     max(0, min(left, experts_total)))
    if left <= 0:
        per_token = (kv_cache - prefix_cache) // kv_tokens if kv_tokens else 0
        hint = _context_hint(avail - resident - reserve - prefix_cache, per_token, kv_tokens, sequences, prefix_cache,
                             name, strict=True)
        raise BudgetError(
            f"{given(name('cache_budget'), 'auto')}: no memory left for the expert cache: {out.describe()}; "
            + (hint or "the resident weights, KV cache and runtime need more than this process may use (raise the "
               "memory limit, or shorten the context)")
        )
    return out


@dataclass
class BudgetPlan:
    """What the budget came to for one loaded model.

    Attributes:
        budget: the expert cache budget in bytes (None: every expert resident).
        auto: how ``auto`` was sized (None for a given budget).
        reserve: bytes set aside for the runtime, reads in flight, read-ahead staging and buffers.
        host: bytes of the pinned host tier behind a VRAM cache (0: none).
        kv_cache: bytes set aside for the KV caches (twice the context's per sequence: each grows by
            doubling; ``sequences`` of them for a server running that many at once).
        prefix_cache: bytes of the prefix cache's KV blocks (``--prefix-cache-gb``).
        sequences: sequences that run at once (``--max-batch``).
        context_tokens: tokens of context each sequence's KV cache was counted for.
        experts: bytes of every expert (of this rank): the most the cache holds, whatever the budget.
    """

    budget: int | None
    auto: AutoBudget | None = None
    reserve: int = 0
    host: int = 0
    kv_cache: int = 0
    prefix_cache: int = 0
    sequences: int = 1
    context_tokens: int = 0
    experts: int = 0


def context_tokens_for(net, context_tokens: int | None) -> int:
    """Tokens of context the KV cache must hold: as given, else 4096 or the model's context if smaller."""
    return context_tokens or min(DEFAULT_CONTEXT_TOKENS, net.max_context or DEFAULT_CONTEXT_TOKENS)


def _what(budget: int | None, name: Callable[[str], str] = flag) -> str:
    if budget is None:
        return f"every expert ({given(name('cache_budget'), 'all')})"
    return f"a {gb_text(budget)} GB cache budget"


@dataclass(frozen=True)
class ReadBuffers:
    """The expert store's buffer sizes that the reserve counts, in bytes (the store's are
    :meth:`moestream.store.ExpertStore.read_buffers`; the budget sits below the store and takes them as given).

    Attributes:
        max_read: the largest coalesced read (the store's ``MAX_READ_BYTES``; 0: one expert).
        arena: one arena of the CPU buffer pool (``ARENA_BYTES``; 0: none beyond one expert).
        huge_page: the pool's and the O_DIRECT scratch's page (``HUGE_PAGE``; 0: no scratch).
        frame_slack: bytes at most an expert's buffer takes beyond its budget cost (block alignment).
    """

    max_read: int = 0
    arena: int = 0
    huge_page: int = 0
    frame_slack: int = 0


def read_reserve(net, one: int, workers: int, page_cache: bool, prefetch_ahead: int,
                 buffers: ReadBuffers = ReadBuffers(), chunk_window: int = 0, cached: int = 0) -> int:
    """Bytes the reads need outside the cache budget (part of the reserve), for experts of ``one`` bytes at most.

    * reads in flight: 2 x ``workers`` reads of up to ``max(buffers.max_read, one)`` bytes;
    * read-ahead staging: ``chunk_window`` experts of the next layer during a prefill chunk, and
      ``prefetch_ahead`` x top-k experts in decode (:mod:`moestream.prefetch`);
    * the buffer pool's one partly used arena (:class:`moestream.store.HugePagePool`; its other
      slots hold cached, in-flight or staged experts, counted already);
    * the block alignment of every buffer (``buffers.frame_slack`` bytes at most per expert, for the
      ``cached`` bytes of the budget and everything in flight or staged);
    * O_DIRECT (``page_cache`` False): each reader thread's huge-page scratch for blocks two experts share.
    """
    in_flight = 2 * workers * max(buffers.max_read, one)
    staged = (chunk_window + prefetch_ahead * net.top_k) * one
    arena = max(buffers.arena, one + buffers.huge_page)
    slack = (cached // max(one, 1) + 2 * workers + chunk_window + prefetch_ahead * net.top_k) * buffers.frame_slack
    scratch = 0 if page_cache else workers * buffers.huge_page
    return in_flight + staged + arena + slack + scratch


def plan_cpu_budget(net, budget: int | None | str, dtype: torch.dtype, experts: int, one: int, workers: int,
                    page_cache: bool, prefetch_ahead: int, context_tokens: int | None, share: int = 1,
                    buffers: ReadBuffers = ReadBuffers(), wire_memory: bool = False,
                    chunk_window: int = 0, sequences: int = 1, prefix_cache: int = 0,
                    name: Callable[[str], str] = flag) -> BudgetPlan:
    """The CPU expert cache budget, checked against the memory available (before any weight is read).

    Args:
        net: the model on the meta device (shapes only; its ``top_k``, attention layers).
        budget: bytes, None (``all``) or ``"auto"``.
        dtype: the compute dtype; experts: bytes of every expert (of this rank); one: the largest.
        workers: reader threads; page_cache: whether reads go through the page cache;
        prefetch_ahead: layers read ahead in decode; context_tokens: KV cache tokens (default:
            4096, or the model's context if smaller);
        share: processes of this machine that split its memory (expert parallelism);
        buffers: the store's buffer sizes (:class:`ReadBuffers`: its largest read, arena, alignment slack).
        wire_memory: whether resident weights and cached experts will be locked (``--wire-memory``).
        chunk_window: experts read ahead for the next layer during a prefill chunk.
        sequences: sequences running at once (``--max-batch``), each with a KV cache for the context;
        prefix_cache: bytes the prefix cache keeps (``--prefix-cache-gb``).
        name: how messages name an option (``EngineOptions.name``; the CLI's flags by default).

    The reserve: the PyTorch runtime, the KV caches (twice their size for the context: each grows
    by doubling, one per running sequence), the prefix cache and what the reads need outside the
    budget (:func:`read_reserve`). ``auto`` takes what is left of the memory available after the
    resident weights and the reserve, capped at every expert; a given budget (or ``all``)
    is refused when it does not fit.

    Raises:
        BudgetError: when resident weights, the cached experts and the reserve exceed the
            memory available (cgroup limits included), or nothing is left for ``auto``; with
            ``wire_memory``, when RLIMIT_MEMLOCK is below what must be locked. When everything but the KV
            caches fits, the message gives the context that would.
    """
    resident = resident_bytes(net, dtype)
    ctx = context_tokens_for(net, context_tokens)
    per_token = sequences * 2 * kv_bytes_per_token(net, dtype)  # a token of context in every sequence's cache
    kv = ctx * per_token + prefix_cache
    streaming = budget is not None
    guess = experts if budget is None or budget == AUTO else min(budget, experts)

    def reads(cached: int) -> int:
        return read_reserve(net, one, workers, page_cache, prefetch_ahead, buffers,
                            chunk_window if streaming else 0, cached)

    reserve = RUNTIME_RESERVE + reads(guess)
    auto = None
    if budget == AUTO:
        auto = auto_cache_budget(resident, kv, ctx, reserve, experts, share=share, prefix_cache=prefix_cache,
                                 sequences=sequences, name=name)
        budget = auto.budget
    cached = experts if budget is None else min(budget, experts)
    reserve = RUNTIME_RESERVE + reads(cached)
    avail = memory.available_bytes() // share
    need = resident + cached + kv + reserve
    if need > avail:
        batch, budget_flag, prefix_flag = name("max_batch"), name("cache_budget"), name("prefix_cache")
        hint = _context_hint(avail - (need - kv) - prefix_cache, per_token, ctx, sequences, prefix_cache, name)
        if hint is None:
            hint = f"give a smaller {budget_flag}, or auto" + (
                f", or fewer {batch} sequences or a smaller {prefix_flag}" if sequences > 1 or prefix_cache else "")
        elif cached >= need - avail:  # a budget smaller by the excess would do too
            hint += f", or a smaller {budget_flag}"
        raise BudgetError(
            f"resident weights ({resident / GB:.2f} GB) plus {_what(budget, name)} ({cached / GB:.2f} GB) plus the "
            f"KV cache ({kv / GB:.2f} GB for {ctx} tokens" + (f" x {sequences} sequences ({batch})" if sequences > 1
                                                              else "")
            + (f", the prefix cache's {prefix_cache / GB:.2f} GB included ({prefix_flag})" if prefix_cache else "")
            + f") plus the runtime and read buffers ({reserve / GB:.2f} GB) need {need / GB:.2f} GB, but only "
            f"{avail / GB:.2f} GB of memory is available to this process (cgroup limit included"
            + (f"; this rank's share of {share} on this machine" if share > 1 else "") + "); " + hint
        )
    if wire_memory:
        memory.check_memlock(resident + cached + 2 * workers * one, name=name("wire_memory"))
    return BudgetPlan(budget, auto, reserve, kv_cache=kv - prefix_cache, prefix_cache=prefix_cache,
                      sequences=sequences, context_tokens=ctx, experts=experts)


def plan_device_budget(net, budget: int | None | str, dtype: torch.dtype, experts: int, one: int, free: int,
                       device, context_tokens: int | None, extra_resident: int = 0, sequences: int = 1,
                       prefix_cache: int = 0, name: Callable[[str], str] = flag) -> BudgetPlan:
    """The VRAM expert budget on a CUDA device with ``free`` bytes free.

    ``extra_resident``: bytes the resident weights take beyond their parameters' (quantized resident
    linears dequantized at load on the GPU). ``sequences``: KV caches running at once (``--max-batch``);
    ``prefix_cache``: the prefix cache's bytes (0 on CUDA, where it is off). ``name``: how messages name an option.

    ``budget`` as given (refused, before any weight is read, when resident weights plus it
    exceed the free device memory), or for ``auto`` the free memory less resident weights,
    the KV cache (twice its size for the context) and a reserve (1 GB plus four layers' worth
    of experts for stacking and activations), capped at every expert.

    Raises:
        BudgetError: with the numbers.
    """
    resident = resident_bytes(net, dtype) + extra_resident
    ctx = context_tokens_for(net, context_tokens)
    per_token = sequences * 2 * kv_bytes_per_token(net, dtype)
    kv = ctx * per_token
    reserve = int(1e9) + 4 * net.top_k * one + kv + prefix_cache
    if budget == AUTO:
        left = free - resident - reserve
        if left <= 0:
            hint = _context_hint(free - resident - (reserve - kv), per_token, ctx, sequences, prefix_cache, name,
                                 strict=True)
            raise BudgetError(
                f"{given(name('cache_budget'), 'auto')}: {device} has {free / GB:.2f} GB free; resident weights "
                f"({resident / GB:.2f} GB) and a {reserve / GB:.2f} GB reserve (the KV cache's {kv / GB:.2f} GB for "
                f"{ctx} tokens included) leave nothing for experts" + (f"; {hint}" if hint else "")
            )
        return BudgetPlan(min(left, experts), None, reserve, kv_cache=kv, prefix_cache=prefix_cache,
                          sequences=sequences, context_tokens=ctx, experts=experts)
    cached = experts if budget is None else min(budget, experts)
    if resident + cached > free:
        raise BudgetError(
            f"resident weights ({resident / GB:.2f} GB) plus {_what(budget, name)} ({cached / GB:.2f} GB) need "
            f"{(resident + cached) / GB:.2f} GB, but {device} has {free / GB:.2f} GB free; "
            f"give a smaller {name('cache_budget')}"
        )
    return BudgetPlan(budget, None, reserve, kv_cache=kv, prefix_cache=prefix_cache, sequences=sequences,
                      context_tokens=ctx, experts=experts)


def plan_host_budget(host: int | None | str, experts: int, one: int, workers: int, share: int = 1,
                     name: Callable[[str], str] = flag) -> int:
    """Bytes of the pinned host tier behind a VRAM cache (``--host-cache-gb``; 0: none).

    ``auto``: 0.8 of the memory available (cgroup limits included) less a reserve (the runtime
    and 2 x 2 x workers experts in flight), at most every expert, split between the ``share``
    local ranks. A number larger than the memory available is refused.

    Raises:
        BudgetError: for a value that cannot fit, with the numbers.
    """
    if host is None:
        return 0
    reserve = RUNTIME_RESERVE + 2 * 2 * workers * one
    avail = memory.available_bytes()
    if host == AUTO:
        n = max(0, min(experts, int(0.8 * avail) - reserve))
        return n // share if share > 1 else n
    if min(host, experts) + reserve > avail:
        raise BudgetError(
            f"{given(name('host_cache'), gb_text(host, 6))}: {min(host, experts) / GB:.2f} GB of pinned experts plus a "
            f"{reserve / GB:.2f} GB reserve exceed the {avail / GB:.2f} GB of memory available; give less or 'auto'"
        )
    return host
