"""What a generation did: :class:`GenerationStats` (speed, cache hit rate, bytes read, distinct experts per
layer, CPU time, memory), filled from the engine's counters at the start, the decode's start and the end
(``_Counters``) however the run ends.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from .budget import GB, gb_text
from .engine import Engine
from .memory import peak_rss_bytes
from .quant import native


@dataclass
class GenerationStats:
    """What one generation did. Units: tokens, tokens/s, GB (10^9 bytes), MB (10^6 bytes)."""

    prompt_tokens: int = 0
    prompt_cached_tokens: int = 0  # prompt tokens whose KV cache a Session already held (not prefilled)
    generated_tokens: int = 0
    generated_token_ids: list[int] = field(default_factory=list)
    logits_sha256: str = ""  # SHA-256 over every step's float32 logits, in order: equal runs, equal digests
    finish_reason: str = ""  # "stop", "length", "interrupted" (Ctrl-C) or "cancelled" (a scheduled sequence)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    cache_hit_rate: float = 0.0
    cache_lookups: int = 0
    cache_hits: int = 0
    experts_read: int = 0
    reads: int = 0
    experts_per_read: float = 0.0
    gb_read: float = 0.0
    mb_read_per_decoded_token: float = 0.0
    decode_hit_rate: float = 0.0
    distinct_experts_per_layer_mean: float = 0.0
    distinct_experts_per_layer: dict[int, int] = field(default_factory=dict)
    experts_per_layer: int = 0
    resident_weight_gb: float = 0.0
    cache_budget_gb: float | str = 0.0
    cache_peak_gb: float = 0.0
    peak_rss_gb: float = 0.0
    load_seconds: float = 0.0
    # -- I/O: hits split by source (rates over cache_lookups; they add up to cache_hit_rate),
    # bytes read on the critical path vs by prefetch, read bandwidth while reading
    cache_hit_rate_cache: float = 0.0
    cache_hit_rate_prefetch: float = 0.0
    cache_hit_rate_pinned: float = 0.0
    prefetch_hits: int = 0
    pinned_hits: int = 0
    gb_read_critical: float = 0.0
    gb_read_prefetch: float = 0.0
    prefetch_issued: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    prefetch_wasted_gb: float = 0.0
    prefetch_status: str = ""  # "on", or why decode read-ahead switched itself off; "" without read-ahead
    read_busy_seconds: float = 0.0
    read_gb_per_s: float = 0.0
    read_path: str = ""
    direct_read_seconds: float = 0.0  # O_DIRECT: time in reads and in copies (shared blocks), summed over threads
    direct_copy_seconds: float = 0.0
    # -- CPU time (user + system, every thread of the process, seconds). A decoded token's is split
    # into the reader threads' (reads issued: syscalls, copies, checks), the compiled kernels' (every call
    # into moestream's CPU kernels: experts, attention, norms, routers, LM head; their OpenMP threads
    # included; the expert kernels' part of it given too) and the rest (Python and PyTorch glue,
    # sampling, bookkeeping). Reads that run while a kernel computes are counted in both: then the
    # kernels' figure is an upper bound and the rest's a lower one.
    prefill_cpu_seconds: float = 0.0
    decode_cpu_seconds: float = 0.0
    cpu_s_per_decoded_token: float = 0.0
    cpu_reads_s_per_token: float = 0.0
    cpu_kernels_s_per_token: float = 0.0
    cpu_compiled_s_per_token: float = 0.0
    cpu_rest_s_per_token: float = 0.0
    # -- read-ahead: decode's accuracy overall and per layer read for, the CPU its predictions took per
    # decoded token; prefill's reads ahead
    prefetch_accuracy: float = 0.0  # hits / (hits + wasted)
    prefetch_per_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [issued, hits, wasted]
    prefetch_plan_cpu_s_per_token: float = 0.0
    prefill_read_ahead: int = 0
    prefill_read_ahead_hits: int = 0
    prefill_read_ahead_wasted: int = 0

    def to_json(self) -> str:
        """The stats as a JSON object (per-layer keys as strings)."""
        d = asdict(self)
        d["distinct_experts_per_layer"] = {str(k): v for k, v in self.distinct_experts_per_layer.items()}
        d["prefetch_per_layer"] = {str(k): v for k, v in self.prefetch_per_layer.items()}
        return json.dumps(d, indent=2)

    def summary(self) -> str:
        """The stats block printed after a generation."""
        per_layer = list(self.distinct_experts_per_layer.values())
        spread = f"min {min(per_layer)}, max {max(per_layer)}" if per_layer else "no MoE layers"
        budget = (self.cache_budget_gb if isinstance(self.cache_budget_gb, str)
                  else f"{gb_text(self.cache_budget_gb * GB)} GB")
        return "\n".join([
            f"prompt tokens        {self.prompt_tokens}"
            + (f" ({self.prompt_cached_tokens} already in the KV cache)" if self.prompt_cached_tokens else ""),
            f"generated tokens     {self.generated_tokens} ({self.finish_reason})",
            f"prefill              {self.prefill_tok_s:.2f} tok/s ({self.prefill_seconds:.2f} s)",
            f"decode               {self.decode_tok_s:.2f} tok/s ({self.decode_seconds:.2f} s)",
            f"cache hit rate       {self.cache_hit_rate:.1%} overall, {self.decode_hit_rate:.1%} in decode "
            f"({self.cache_hits}/{self.cache_lookups} lookups)",
            f"experts read         {self.experts_read} in {self.reads} reads "
            f"({self.experts_per_read:.2f} experts/read)",
            f"read from disk       {self.gb_read:.3f} GB, "
            f"{self.mb_read_per_decoded_token:.1f} MB per decoded token",
            f"distinct experts     {self.distinct_experts_per_layer_mean:.1f} of {self.experts_per_layer} "
            f"per MoE layer (mean; {spread})",
            f"resident weights     {self.resident_weight_gb:.2f} GB",
            f"cache budget         {budget} (peak held {self.cache_peak_gb:.2f} GB)",
            f"peak RSS             {self.peak_rss_gb:.2f} GB",
        ] + self._io_lines())

    def _io_lines(self) -> list[str]:
        """The I/O lines of the summary: hit sources, critical-path vs prefetch bytes, read speed."""
        lines = [
            f"hits by source       cache {self.cache_hit_rate_cache:.1%}, prefetch {self.cache_hit_rate_prefetch:.1%}, "
            f"pinned {self.cache_hit_rate_pinned:.1%} of lookups",
            f"read on demand       {self.gb_read_critical:.3f} GB (critical path); "
            f"{self.gb_read_prefetch:.3f} GB read ahead",
            f"read speed           {self.read_gb_per_s:.2f} GB/s while reading ({self.read_busy_seconds:.2f} s busy)"
            + (f"; {self.read_path}" if self.read_path else "")
            + (f" ({self.direct_read_seconds:.2f} s in reads, {self.direct_copy_seconds:.2f} s in copies, "
               "summed over threads)" if self.direct_read_seconds else ""),
        ]
        if self.prefetch_issued or self.prefetch_status:
            lines.append(
                f"prefetch             {self.prefetch_issued} experts read ahead, {self.prefetch_hits} used "
                f"({self.prefetch_late} still in flight), {self.prefetch_wasted} wasted "
                f"({self.prefetch_wasted_gb:.3f} GB)" + (f"; {self.prefetch_status}" if self.prefetch_status else "")
            )
            decode = self.prefetch_issued - self.prefill_read_ahead
            if self.prefill_read_ahead:
                lines.append(f"  in prefill         {self.prefill_read_ahead} read ahead for the next layer, "
                             f"{self.prefill_read_ahead_hits} used, {self.prefill_read_ahead_wasted} wasted")
            if decode > 0:
                lines.append(f"  in decode          accuracy {self.prefetch_accuracy:.1%}, predictions "
                             f"{1000 * self.prefetch_plan_cpu_s_per_token:.1f} ms CPU per token")
        if self.decode_cpu_seconds:
            lines.append(
                f"CPU per token        {self.cpu_s_per_decoded_token:.3f} s (reads {self.cpu_reads_s_per_token:.3f}, "
                f"compiled kernels {self.cpu_compiled_s_per_token:.3f} of which experts "
                f"{self.cpu_kernels_s_per_token:.3f}, the rest {self.cpu_rest_s_per_token:.3f}); "
                f"prefill {self.prefill_cpu_seconds:.2f} s"
            )
        return lines


class _Counters:
    """The engine's counters at a generation's start (and its decode's), to fill its stats however it ends."""

    def __init__(self, engine: Engine):
        cache, store = engine.cache, engine.store
        self.engine = engine
        self.hits, self.lookups = cache.stats.hits, cache.stats.lookups
        self.bytes, self.experts, self.reads = store.stats.bytes_read, store.stats.experts_read, store.stats.reads
        self.usage = {k: v.clone() for k, v in cache.usage.items()}
        self.io = _io_snapshot(engine)
        self.t0, self.t1 = time.perf_counter(), None  # t1: the decode's start; None while prefilling
        self.cpu0, self.cpu1 = _cpu_snapshot(engine), None  # CPU clocks at the start and the decode's start
        self.decode_hits, self.decode_lookups, self.decode_bytes = self.hits, self.lookups, self.bytes

    def decode_starts(self, stats: GenerationStats, prefilled: int) -> None:
        """Prefill is done (``prefilled`` tokens): its time and rate; the decode's counters start here."""
        cache, store = self.engine.cache, self.engine.store
        stats.prefill_seconds = time.perf_counter() - self.t0
        stats.prefill_tok_s = prefilled / stats.prefill_seconds if stats.prefill_seconds else 0.0
        self.decode_hits, self.decode_lookups, self.decode_bytes = \
            cache.stats.hits, cache.stats.lookups, store.stats.bytes_read
        self.t1 = time.perf_counter()
        self.cpu1 = _cpu_snapshot(self.engine)

    def fill(self, stats: GenerationStats) -> None:
        """The run's figures into ``stats``: times, rates, cache and read counters, distinct experts, memory."""
        engine, cache, store = self.engine, self.engine.cache, self.engine.store
        if self.t1 is None:  # ended in prefill
            stats.prefill_seconds = time.perf_counter() - self.t0
        stats.decode_seconds = time.perf_counter() - self.t1 if self.t1 is not None else 0.0
        decoded = max(0, stats.generated_tokens - 1)  # the first token comes from prefill
        stats.decode_tok_s = decoded / stats.decode_seconds if decoded and stats.decode_seconds else 0.0
        lookups = cache.stats.lookups - self.lookups
        hits = cache.stats.hits - self.hits
        stats.cache_lookups, stats.cache_hits = lookups, hits
        stats.cache_hit_rate = hits / lookups if lookups else 0.0
        d_lookups = cache.stats.lookups - self.decode_lookups
        stats.decode_hit_rate = (cache.stats.hits - self.decode_hits) / d_lookups if d_lookups else 0.0
        stats.experts_read = store.stats.experts_read - self.experts
        stats.reads = store.stats.reads - self.reads
        stats.experts_per_read = stats.experts_read / stats.reads if stats.reads else 0.0
        stats.gb_read = (store.stats.bytes_read - self.bytes) / GB
        stats.mb_read_per_decoded_token = (store.stats.bytes_read - self.decode_bytes) / 1e6 / decoded if decoded \
            else 0.0
        distinct = {k: int(((v - self.usage[k]) > 0).sum()) for k, v in cache.usage.items()}
        stats.distinct_experts_per_layer = distinct
        stats.distinct_experts_per_layer_mean = sum(distinct.values()) / len(distinct) if distinct else 0.0
        stats.experts_per_layer = max(engine.layout.layers[k].num_experts for k in distinct) if distinct else 0
        stats.resident_weight_gb = engine.resident_bytes / GB
        stats.cache_budget_gb = "all" if cache.budget_bytes is None else cache.budget_bytes / GB
        stats.cache_peak_gb = cache.peak_bytes / GB
        stats.peak_rss_gb = peak_rss_bytes() / GB
        stats.load_seconds = engine.load_seconds
        _fill_io_stats(stats, engine, self.io)
        _fill_cpu_stats(stats, self.cpu0, self.cpu1, _cpu_snapshot(engine), decoded)


def _cpu_snapshot(engine: Engine) -> dict:
    """CPU clocks at one moment: the process (all threads), the reader threads, the expert kernels,
    the read-ahead predictions (seconds)."""
    pf = engine.io.prefetcher if engine.io is not None else None
    pipe = engine.pipeline
    reader = getattr(engine.store, "reader_cpu_seconds", None)
    return dict(
        process=time.process_time(), reads=reader() if reader is not None else 0.0,
        kernels=getattr(pipe, "kernel_cpu_seconds", 0.0), plan=0.0 if pf is None else pf.stats.plan_cpu_seconds,
        compiled=native.kernel_cpu_seconds(),
    )


def _fill_cpu_stats(stats: GenerationStats, cpu0: dict, cpu1: dict | None, cpu2: dict, decoded: int) -> None:
    """The CPU figures into ``stats`` from :func:`_cpu_snapshot` at the start (``cpu0``), the decode's start
    (``cpu1``, None when it ended in prefill) and the end (``cpu2``), over ``decoded`` tokens."""
    stats.prefill_cpu_seconds = (cpu1 or cpu2)["process"] - cpu0["process"]
    if cpu1 is None:
        return
    stats.decode_cpu_seconds = cpu2["process"] - cpu1["process"]
    if decoded:
        total = stats.decode_cpu_seconds / decoded
        reads = (cpu2["reads"] - cpu1["reads"]) / decoded
        kernels = (cpu2["kernels"] - cpu1["kernels"]) / decoded
        stats.cpu_s_per_decoded_token = total
        stats.cpu_reads_s_per_token = reads
        compiled = max(kernels, (cpu2["compiled"] - cpu1["compiled"]) / decoded)
        stats.cpu_kernels_s_per_token = kernels
        stats.cpu_compiled_s_per_token = compiled
        stats.cpu_rest_s_per_token = max(0.0, total - reads - compiled)
        stats.prefetch_plan_cpu_s_per_token = (cpu2["plan"] - cpu1["plan"]) / decoded


def _io_snapshot(engine: Engine) -> dict:
    """The I/O counters at the start of a generation (the stats are differences)."""
    cs, rs = engine.cache.stats, engine.store.stats
    pf = engine.io.prefetcher if engine.io is not None else None
    return dict(
        prefetch_hits=cs.prefetch_hits, pinned_hits=cs.pinned_hits, prefetch_bytes=rs.prefetch_bytes,
        busy=rs.busy_seconds, bytes=rs.bytes_read, pf=None if pf is None else pf.stats.as_dict(),
        direct=getattr(engine.store.reader, "direct_seconds", 0.0),
        copy=getattr(engine.store.reader, "copy_seconds", 0.0),
    )


def _fill_io_stats(stats: GenerationStats, engine: Engine, io0: dict) -> None:
    cs, rs = engine.cache.stats, engine.store.stats
    lookups = stats.cache_lookups
    stats.prefetch_hits = cs.prefetch_hits - io0["prefetch_hits"]
    stats.pinned_hits = cs.pinned_hits - io0["pinned_hits"]
    plain = stats.cache_hits - stats.prefetch_hits - stats.pinned_hits
    if lookups:
        stats.cache_hit_rate_cache = plain / lookups
        stats.cache_hit_rate_prefetch = stats.prefetch_hits / lookups
        stats.cache_hit_rate_pinned = stats.pinned_hits / lookups
    read = rs.bytes_read - io0["bytes"]
    ahead = rs.prefetch_bytes - io0["prefetch_bytes"]
    stats.gb_read_prefetch = ahead / GB
    stats.gb_read_critical = (read - ahead) / GB
    stats.read_busy_seconds = rs.busy_seconds - io0["busy"]
    stats.read_gb_per_s = read / GB / stats.read_busy_seconds if stats.read_busy_seconds else 0.0
    stats.direct_read_seconds = getattr(engine.store.reader, "direct_seconds", 0.0) - io0["direct"]
    stats.direct_copy_seconds = getattr(engine.store.reader, "copy_seconds", 0.0) - io0["copy"]
    io = engine.io
    if io is not None:
        stats.read_path = "page cache" if io.use_page_cache else "O_DIRECT"
        if io.prefetcher is not None:
            now, then = io.prefetcher.stats.as_dict(), io0["pf"] or {}
            stats.prefetch_issued = now["issued"] - then.get("issued", 0)
            stats.prefetch_late = now["late"] - then.get("late", 0)
            stats.prefetch_wasted = now["wasted"] - then.get("wasted", 0)
            stats.prefetch_wasted_gb = (now["wasted_bytes"] - then.get("wasted_bytes", 0)) / GB
            stats.prefetch_status = now["disabled"] or "on"
            stats.prefill_read_ahead = now["chunk_issued"] - then.get("chunk_issued", 0)
            stats.prefill_read_ahead_hits = now["chunk_hits"] - then.get("chunk_hits", 0)
            stats.prefill_read_ahead_wasted = now["chunk_wasted"] - then.get("chunk_wasted", 0)
            before = then.get("per_layer", {})
            per = {}
            for layer, (issued, hit, waste) in now["per_layer"].items():
                b = before.get(layer, [0, 0, 0])
                if issued - b[0] or hit - b[1] or waste - b[2]:
                    per[layer] = [issued - b[0], hit - b[1], waste - b[2]]
            stats.prefetch_per_layer = per
            hits, wasted = sum(v[1] for v in per.values()), sum(v[2] for v in per.values())
            stats.prefetch_accuracy = hits / (hits + wasted) if hits + wasted else 0.0
