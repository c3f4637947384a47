"""Generation: prefill in chunks, decode token by token, sample, stop, and count.

``generate()`` drives a loaded :class:`~moestream.engine.Engine` over one prompt and
yields a :class:`Step` per generated token; :class:`GenerationStats` gathers what a run
did (speed, cache hit rate, bytes read, distinct experts per layer, memory).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from .engine import GB, Engine
from .errors import InputError
from .memory import peak_rss_bytes


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature`` 0 means greedy (argmax); ``top_k`` 0 and ``top_p`` 1.0 disable those
    filters; ``seed`` makes sampling repeatable.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise InputError(f"temperature (--temp) must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p (--top-p) must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k (--top-k) must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"seed (--seed) must be between 0 and 2^63 - 1, got {self.seed}")


class Sampler:
    """Temperature, top-k and top-p (nucleus, Holtzman et al. 2019) sampling over float32 logits."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick a token id from ``logits`` [vocab]."""
        p = self.params
        logits = logits.float().cpu()
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the smallest set reaching top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


@dataclass
class GenerationStats:
    """What one generation did. Units: tokens, tokens/s, GB (10^9 bytes), MB (10^6 bytes)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    generated_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
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
    prefetch_status: str = ""
    read_busy_seconds: float = 0.0
    read_gb_per_s: float = 0.0
    read_path: str = ""
    direct_read_seconds: float = 0.0  # O_DIRECT: time in reads and in bounce-buffer copies, summed over threads
    direct_copy_seconds: float = 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["distinct_experts_per_layer"] = {str(k): v for k, v in self.distinct_experts_per_layer.items()}
        return json.dumps(d, indent=2)

    def summary(self) -> str:
        """The stats block printed after a generation."""
        per_layer = list(self.distinct_experts_per_layer.values())
        spread = f"min {min(per_layer)}, max {max(per_layer)}" if per_layer else "no MoE layers"
        budget = self.cache_budget_gb if isinstance(self.cache_budget_gb, str) else f"{self.cache_budget_gb:.3g} GB"
        return "\n".join([
            f"prompt tokens        {self.prompt_tokens}",
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
        return lines


@dataclass(frozen=True)
class Step:
    """One generated token: its id, its text piece (may be empty), and the logits it came from."""

    token: int
    text: str
    logits: torch.Tensor | None = None


def _eos_ids(engine: Engine) -> set[int]:
    ids: set[int] = set()
    cfg_eos = engine.checkpoint.config.get("eos_token_id")
    for v in cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]:
        if isinstance(v, int):
            ids.add(v)
    tok = engine.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return ids


@torch.inference_mode()
def generate(
    engine: Engine,
    prompt_ids: list[int],
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stats: GenerationStats | None = None,
    prefill_chunk: int = 512,
    stop_at_eos: bool = True,
    keep_logits: bool = False,
) -> Iterator[Step]:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids``, yielding each as it is made.

    The prompt is prefilled layer by layer in chunks of ``prefill_chunk`` tokens (each
    layer's experts are read once per chunk), then tokens are decoded one at a time.
    The chunk size sets the shapes of the prefill matmuls and so, in bf16, the low bits
    of the result; the CLI keeps it fixed so that no option but the model's own routing
    changes the output.
    ``stats``, when given, is filled in as generation proceeds and completed at the end.
    With ``keep_logits`` each :class:`Step` carries the float32 logits [vocab] it was
    sampled from (the first step's are the prefill's last position).

    Generation also stops at the model's context length (``max_position_embeddings``).

    Raises:
        InputError: an empty prompt, ``max_tokens`` < 1, a token id outside the
            vocabulary, or a prompt that fills the model's context.
        ReadError: when an expert read fails (naming the expert and file).
    """
    model, cache, store = engine.model, engine.cache, engine.store
    if not prompt_ids:
        raise InputError("the prompt is empty")
    if max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {max_tokens}")
    bad = [t for t in prompt_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the model's vocabulary (vocab_size {model.vocab_size})")
    if model.max_context is not None:
        if len(prompt_ids) >= model.max_context:
            raise InputError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context holds {model.max_context} "
                "(max_position_embeddings)"
            )
        max_tokens = min(max_tokens, model.max_context - len(prompt_ids))
    stats = stats if stats is not None else GenerationStats()
    sampler = Sampler(sampling)
    eos = _eos_ids(engine) if stop_at_eos else set()
    decoder = None
    if engine.tokenizer is not None:
        from .tokenizer import StreamDecoder

        decoder = StreamDecoder(engine.tokenizer)
    kv = model.new_kv_cache(len(prompt_ids) + min(max_tokens, 256))  # grows as needed
    ids = torch.tensor(prompt_ids, dtype=torch.int64, device=engine.device)
    stats.prompt_tokens = len(prompt_ids)
    start_hits, start_lookups = cache.stats.hits, cache.stats.lookups
    start_bytes, start_experts, start_reads = store.stats.bytes_read, store.stats.experts_read, store.stats.reads
    usage_before = {k: v.clone() for k, v in cache.usage.items()}
    io0 = _io_snapshot(engine)

    t0 = time.perf_counter()
    logits = None
    for s in range(0, len(prompt_ids), prefill_chunk):
        logits = model(ids[s : s + prefill_chunk], s, kv)
    stats.prefill_seconds = time.perf_counter() - t0
    stats.prefill_tok_s = len(prompt_ids) / stats.prefill_seconds if stats.prefill_seconds else 0.0
    decode_hits0, decode_lookups0, decode_bytes0 = cache.stats.hits, cache.stats.lookups, store.stats.bytes_read

    t1 = time.perf_counter()
    pos = len(prompt_ids)
    stats.finish_reason = "length"
    try:
        for n in range(max_tokens):
            last = logits[-1].float()
            token = sampler(last)
            stats.generated_token_ids.append(token)
            stats.generated_tokens = n + 1
            is_eos = token in eos
            final = is_eos or n + 1 == max_tokens
            text = ""
            if decoder is not None:
                text = "" if is_eos else decoder.push(token)
                if final:
                    text += decoder.flush()
            if is_eos:
                stats.finish_reason = "stop"
            yield Step(token, text, last if keep_logits else None)
            if final:
                break
            logits = model(torch.tensor([token], dtype=torch.int64, device=engine.device), pos, kv)
            pos += 1
    finally:
        stats.decode_seconds = time.perf_counter() - t1
        decoded = max(0, stats.generated_tokens - 1)  # the first token comes from prefill
        stats.decode_tok_s = decoded / stats.decode_seconds if decoded and stats.decode_seconds else 0.0
        lookups = cache.stats.lookups - start_lookups
        hits = cache.stats.hits - start_hits
        stats.cache_lookups, stats.cache_hits = lookups, hits
        stats.cache_hit_rate = hits / lookups if lookups else 0.0
        d_lookups = cache.stats.lookups - decode_lookups0
        stats.decode_hit_rate = (cache.stats.hits - decode_hits0) / d_lookups if d_lookups else 0.0
        stats.experts_read = store.stats.experts_read - start_experts
        stats.reads = store.stats.reads - start_reads
        stats.experts_per_read = stats.experts_read / stats.reads if stats.reads else 0.0
        stats.gb_read = (store.stats.bytes_read - start_bytes) / GB
        stats.mb_read_per_decoded_token = (store.stats.bytes_read - decode_bytes0) / 1e6 / decoded if decoded else 0.0
        distinct = {k: int(((v - usage_before[k]) > 0).sum()) for k, v in cache.usage.items()}
        stats.distinct_experts_per_layer = distinct
        stats.distinct_experts_per_layer_mean = sum(distinct.values()) / len(distinct) if distinct else 0.0
        stats.experts_per_layer = max(engine.layout.layers[k].num_experts for k in distinct) if distinct else 0
        stats.resident_weight_gb = engine.resident_bytes / GB
        stats.cache_budget_gb = "all" if cache.budget_bytes is None else cache.budget_bytes / GB
        stats.cache_peak_gb = cache.peak_bytes / GB
        stats.peak_rss_gb = peak_rss_bytes() / GB
        stats.load_seconds = engine.load_seconds
        _fill_io_stats(stats, engine, io0)


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
