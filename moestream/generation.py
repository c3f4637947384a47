"""Generation: prefill in chunks, decode token by token, sample, stop, and count.

``generate()`` drives a loaded :class:`~moestream.engine.Engine` over one prompt and
yields a :class:`Step` per generated token; :class:`GenerationStats` gathers what a run
did (speed, cache hit rate, bytes read, distinct experts per layer, memory).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .budget import GB
from .engine import Engine
from .errors import ConfigError, InputError
from .memory import available_bytes, peak_rss_bytes
from .models.layers import KVCache
from .quant import native
from .textstream import StopStrings
from .tokenizer import StreamDecoder, current_turn, think_token_ids


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Each option has a value that disables it: ``temperature`` 0 means greedy (argmax);
    ``top_k`` 0, ``top_p`` 0 or 1.0, ``min_p`` 0, ``repetition_penalty`` 1.0 and
    ``frequency_penalty``/``presence_penalty`` 0 are off. ``seed`` makes sampling repeatable.

    Penalties act first, on the model's float32 logits (and so steer greedy picks too):

    - ``repetition_penalty`` (CTRL, Keskar et al. 2019; as transformers'
      ``RepetitionPenaltyLogitsProcessor``): each distinct token among the last
      ``repetition_context`` tokens (prompt included, as mlx-lm and llama.cpp) has its logit
      divided by the penalty when positive and multiplied by it when negative.
    - ``frequency_penalty`` and ``presence_penalty`` (OpenAI's definition, range [-2, 2]):
      ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``,
      counting the tokens generated so far (not the prompt).

    Then the filters, in transformers' order: temperature, top-k, top-p (nucleus, Holtzman
    et al. 2019), min-p (Nguyen et al. 2024: drop tokens whose probability is below
    ``min_p`` times the most likely token's, as transformers' ``MinPLogitsWarper``).

    Raises:
        InputError: a value out of range (naming the option and its CLI flag).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 256
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise InputError(f"temperature (--temp) must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise InputError(f"top_p (--top-p) must be in [0, 1] (0 or 1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k (--top-k) must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"seed (--seed) must be between 0 and 2^63 - 1, got {self.seed}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p (--min-p) must be in [0, 1] (0 = off), got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise InputError(
                f"repetition_penalty (--rep-penalty) must be a finite number > 0 (1 = off), "
                f"got {self.repetition_penalty}"
            )
        if self.repetition_context < 0:
            raise InputError(f"repetition_context (--rep-ctx) must be >= 0, got {self.repetition_context}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        rep = self.repetition_penalty != 1.0 and self.repetition_context > 0
        return rep or bool(self.frequency_penalty or self.presence_penalty)


def apply_penalties(
    logits: torch.Tensor, context: list[int], generated: list[int], params: SamplingParams
) -> torch.Tensor:
    """The logits [vocab] (float32) after the penalties of ``params``; the input is not changed.

    ``context``: every token id before the next one (prompt and generated); the repetition
    penalty looks at its last ``params.repetition_context``. ``generated``: the ids generated
    so far, counted by the frequency and presence penalties. See :class:`SamplingParams`.
    """
    p = params
    out = logits
    if p.repetition_penalty != 1.0 and p.repetition_context > 0 and context:
        out = out.clone()
        ids = torch.tensor(sorted(set(context[-p.repetition_context :])), dtype=torch.int64)
        picked = out[ids]
        out[ids] = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=out.shape[0]).to(out.dtype)
        out = out - (counts * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty)
    return out


class Sampler:
    """Temperature, top-k, top-p (nucleus, Holtzman et al. 2019) and min-p sampling over float32 logits.

    Penalties are applied before (:func:`apply_penalties`); see :class:`SamplingParams`.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The float32 logits [vocab] sampling draws from: divided by the temperature, with the tokens
        that top-k, top-p and min-p remove at -inf (temperature > 0 only).

        A temperature so small that the division overflows float32 (1e-40 for logits near 1) is
        sampled at its limit: every token below the top logit has probability
        exp(-(top - logit) / temperature), which is exactly 0 in float32 and float64 once
        top / temperature overflows (the gap is at least one float32 step of ``top``, about
        6e-8 * top, so the exponent is below -2e31), so the draw is uniform over the tokens tied at
        the top (the argmax when there is one). Top-p keeps at least the most likely token, as
        transformers' ``TopPLogitsWarper(min_tokens_to_keep=1)``, whatever ``top_p`` rounds to in
        float32 (1e-300 is 0 there). Neither changes a draw that worked before, bit for bit.
        """
        p = self.params
        raw = logits.float().cpu()
        logits = raw / p.temperature
        if not torch.isfinite(logits.max()):  # overflowed (+inf, or NaN from 0 / a temperature 0 in float32)
            logits = torch.zeros_like(raw).masked_fill(raw != raw.max(), float("-inf"))
        if p.top_k and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if 0 < p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the smallest set reaching top_p
            drop[0] = False  # and at least the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        if p.min_p > 0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))  # the top token always stays
        return logits

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick a token id from ``logits`` [vocab]."""
        if self.params.temperature == 0:
            return int(torch.argmax(logits.float().cpu()))
        probs = torch.softmax(self.warp(logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


@dataclass
class GenerationStats:
    """What one generation did. Units: tokens, tokens/s, GB (10^9 bytes), MB (10^6 bytes)."""

    prompt_tokens: int = 0
    prompt_cached_tokens: int = 0  # prompt tokens whose KV cache a Session already held (not prefilled)
    generated_tokens: int = 0
    generated_token_ids: list[int] = field(default_factory=list)
    logits_sha256: str = ""  # SHA-256 over every step's float32 logits, in order: equal runs, equal digests
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
    # -- read-ahead: decode's accuracy (hits / (hits + wasted)) overall and per layer read for
    # ([issued, hits, wasted]), the CPU its predictions took per decoded token; prefill's reads ahead
    prefetch_accuracy: float = 0.0
    prefetch_per_layer: dict[int, list[int]] = field(default_factory=dict)
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
        budget = self.cache_budget_gb if isinstance(self.cache_budget_gb, str) else f"{self.cache_budget_gb:.3g} GB"
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


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities of one step, as OpenAI's ``logprobs``.

    From the distribution after penalties and the ``</think>`` mask and before
    temperature and the filters (natural log, float). ``logprob``: the chosen token's;
    ``top``: the ``n`` most likely ``(token id, logprob)`` pairs, most likely first
    (tokens that cannot be picked, at -inf, are left out). Token ids, not text: decode
    each with the tokenizer for OpenAI's ``token``/``bytes`` fields.
    """

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Step:
    """One generated token.

    ``token``: its id. ``text``: the text that became final with it (may be empty: the
    detokenizer holds back incomplete UTF-8, and text that may start a stop string is
    held until settled; the text of a stop string and of an EOS token is never given).
    ``logits``: with ``keep_logits``, the model's float32 logits [vocab] it came from,
    before penalties. ``logprob``: with ``logprobs``, a :class:`TokenLogprob`.
    ``finish_reason``: None until the last step, then ``"stop"`` (an EOS token or a stop
    string) or ``"length"`` (``max_tokens`` or the model's context length reached).
    """

    token: int
    text: str
    logits: torch.Tensor | None = None
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None


@dataclass
class Session:
    """A KV cache kept across calls of :func:`generate`: multi-turn chat and prompt caching.

    ``ids`` are the token ids whose keys and values are in ``kv`` (positions
    ``0..len(ids)``). A call of :func:`generate` with a session prefills only the part of
    its prompt after the longest prefix it shares with ``ids``; afterwards ``ids`` holds
    the prompt and every generated token but the last (the last sampled token has not
    gone through the model). ``kv`` is made on first use.
    """

    kv: KVCache | None = None
    ids: list[int] = field(default_factory=list)


GENERATION_CONFIG = "generation_config.json"
_DEFAULT_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def generation_defaults(folder: str | Path) -> dict:
    """Sampling defaults from a checkpoint's ``generation_config.json`` (empty without one).

    Returns the fields present among ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` (``SamplingParams`` names, ``repetition_penalty`` included).
    An explicit ``"do_sample": false`` makes the default greedy (``temperature`` 0), as in
    transformers; otherwise the values are taken as given, as vLLM does.

    Raises:
        ConfigError: naming the file or field, when the file is not a JSON object or a
            field is not a number.
    """
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    out = {}
    for name, kind in _DEFAULT_FIELDS.items():
        v = cfg.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise ConfigError(f"{path}: field {name!r} = {v!r} is not {'an integer' if kind is int else 'a number'}")
        out[name] = kind(v)
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def _generation_eos(folder: Path) -> list:
    """generation_config.json's ``eos_token_id`` as a list (empty without the file or the field).

    Raises:
        ConfigError: naming the file and field, when it is not a token id or a list of them.
    """
    path = folder / GENERATION_CONFIG
    try:
        v = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []  # no file, or not a JSON object: generation_defaults names that one
    ids = v if isinstance(v, list) else [v]
    if v is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
        raise ConfigError(f"{path}: field 'eos_token_id' = {shown} is not a token id or a list of them")
    return ids


def eos_ids(engine: Engine) -> set[int]:
    """End-of-sequence / end-of-turn token ids: config.json's, generation_config.json's and the tokenizer's."""
    ids: set[int] = set()
    cfg_eos = engine.checkpoint.config.get("eos_token_id")
    for v in (cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]) + _generation_eos(engine.checkpoint.path):
        if isinstance(v, int) and not isinstance(v, bool):  # config.json's was checked at load
            ids.add(v)
    tok = engine.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return ids



def whole_model_hint(engine: Engine, comfort: float = 0.8) -> str | None:
    """A note that ``--cache-budget-gb all`` will be faster, when every expert fits comfortably in memory.

    Shown when the budget is smaller than the experts and the expert bytes not yet held
    are at most ``comfort`` times the memory still available to this process
    (:func:`moestream.memory.available_bytes`, cgroup limits included). Returns the
    note with the numbers (GB = 10^9 bytes), or None.
    """
    cache, store = engine.cache, engine.store
    if cache.budget_bytes is None:
        return None
    par = getattr(engine, "parallel", None)  # under torchrun: this rank's experts only
    mine = "" if par is None else " of this rank"
    experts = sum(store.cached_nbytes((i, e)) for i, lay in engine.layout.layers.items()
                  for e in range(lay.num_experts) if par is None or par.owns((i, e)))
    if cache.budget_bytes >= experts:
        return None
    need = experts - cache.used_bytes
    avail = available_bytes()
    if need > comfort * avail:
        return None
    return (
        f"note: the whole model fits in memory (resident weights {engine.resident_bytes / GB:.3g} GB + every "
        f"expert{mine} {experts / GB:.3g} GB; {avail / GB:.3g} GB available): --cache-budget-gb all keeps every "
        f"expert{mine} resident and will be faster than the {cache.budget_bytes / GB:.3g} GB budget"
    )


def _logprob(processed: torch.Tensor, token: int, n: int) -> TokenLogprob:
    lp = torch.log_softmax(processed, dim=-1)
    top = torch.topk(lp, min(n, lp.shape[0])) if n else None
    pairs = [] if top is None else [
        (int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist()) if v != float("-inf")
    ]
    return TokenLogprob(float(lp[token]), pairs)


@torch.inference_mode()
def _forward(engine: Engine, x: torch.Tensor, pos: int, kv, session: Session | None) -> torch.Tensor:
    """``engine.model(x, pos, kv)`` with the intra-op thread count of load (:meth:`Engine.hold_threads`:
    another count gives other bits); when it fails part-way (a failed expert read), some layers
    have already written this step into ``kv`` and others not, so a ``session`` is emptied: its
    next call prefills from scratch instead of continuing from a half-updated cache. A Ctrl-C
    (KeyboardInterrupt) part-way is such a failure too."""
    engine.hold_threads()
    try:
        return engine.model(x, pos, kv)
    except BaseException:
        if session is not None:
            session.kv = None
            session.ids.clear()
        raise


def generate(
    engine: Engine,
    prompt_ids: list[int],
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stats: GenerationStats | None = None,
    prefill_chunk: int = 512,
    stop_at_eos: bool = True,
    keep_logits: bool = False,
    *,
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    multi_think: bool = False,
    session: Session | None = None,
) -> Iterator[Step]:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids``, yielding each as it is made.

    The one generation entry point (the CLI, the Python API and a server all use it).

    The prompt is prefilled layer by layer in chunks of ``prefill_chunk`` tokens (each
    layer's experts are read once per chunk), then tokens are decoded one at a time.
    The chunk size sets the shapes of the prefill matmuls and so, in bf16, the low bits
    of the result; the CLI keeps it fixed so that no option but the model's own routing
    changes the output.

    Each step: the model's logits -> penalties (:func:`apply_penalties`) -> the
    ``</think>`` mask -> (log-probabilities) -> :class:`Sampler` (temperature, top-k,
    top-p, min-p; argmax at temperature 0).

    Args:
        prompt_ids: the token ids to continue (the whole context: with a ``session``,
            the shared prefix is not prefilled again).
        max_tokens: tokens to generate at most; also capped by the model's context
            length (``max_position_embeddings``).
        sampling: :class:`SamplingParams`.
        stats: when given, filled in as generation proceeds and completed at the end.
        stop_at_eos: end at an end-of-sequence token (:func:`eos_ids`).
        keep_logits: each :class:`Step` carries the model's float32 logits [vocab] (the
            first step's are the prefill's last position).
        stop: stop strings: generation ends before the first one, whose text is never
            yielded, even when split across tokens (needs the tokenizer).
        logprobs: when not None, each step carries a :class:`TokenLogprob` with the top
            ``logprobs`` alternatives (0: the chosen token's only).
        multi_think: allow ``</think>`` again after it appeared in the current turn
            (the prompt after its last EOS token, and the generated tokens). By default
            its logit is masked (-inf) from then on: a reasoning model closes its
            thinking once. Only where ``</think>`` is one token of the tokenizer.
        session: a :class:`Session` whose KV cache is reused and updated. Without one, the engine's
            prefix cache (``prefix_cache_gb``, :mod:`moestream.prefix_cache`), when it has one, gives the
            longest cached prefix (``stats.prompt_cached_tokens``; the logits are a fresh prefill's bits) and
            keeps this run's blocks.

    Under expert parallelism (``engine.parallel``) every rank must call this together:
    rank 0's prompt, ``max_tokens``, sampling (a seed drawn by rank 0 when none is given),
    stop strings and chunking are used on every rank, and closing rank 0's generator early
    stops the others at the same step.

    Yields:
        :class:`Step` per generated token; the last has ``finish_reason`` ``"stop"`` or
        ``"length"``.

    Raises:
        InputError: an empty prompt, ``max_tokens`` < 1, a token id outside the
            vocabulary, a prompt that fills the model's context, stop strings without a
            tokenizer, ``logprobs`` < 0.
        ReadError: when an expert read fails (naming the expert and file).
        EngineClosedError: the engine was closed.
    """
    engine.check_open()
    model = engine.model
    par = getattr(engine, "parallel", None)
    if par is not None:  # expert parallel (torchrun): every rank runs rank 0's request, its seed included
        prompt_ids, max_tokens, sampling, stop, stop_at_eos, multi_think, prefill_chunk = par.agree_generation(
            prompt_ids, max_tokens, sampling, stop, stop_at_eos, multi_think, prefill_chunk)
    prompt_ids, max_tokens, stops = _check_request(engine, prompt_ids, max_tokens, logprobs, stop)
    stats = stats if stats is not None else GenerationStats()
    sampler = Sampler(sampling)
    eos = eos_ids(engine)
    stop_ids = eos if stop_at_eos else set()
    decoder = None
    if engine.tokenizer is not None:
        decoder = StreamDecoder(engine.tokenizer)
    stopper = StopStrings(stops)
    think_end = None
    think_closed = False
    if not multi_think and engine.tokenizer is not None:
        think_end = think_token_ids(engine.tokenizer)[1]
        think_closed = think_end is not None and think_end in current_turn(prompt_ids, eos)
    kv, reuse = _kv_cache(model, session, prompt_ids, max_tokens)
    # the engine's prefix cache (--prefix-cache-gb), shared with the server's scheduler: a session keeps its own KV
    pcache = getattr(engine, "prefix_cache", None) if session is None and par is None else None
    if pcache is not None:
        reuse, blocks = pcache.lookup(prompt_ids, len(prompt_ids) - 1)
        pcache.fill(kv, reuse, blocks)
    ids = torch.tensor(prompt_ids, dtype=torch.int64, device=engine.device)
    stats.prompt_tokens = len(prompt_ids)
    stats.prompt_cached_tokens = reuse
    counters = _Counters(engine)
    logits = None
    stats.finish_reason = "length"
    generated: list[int] = []
    failed = False  # a forward pass failed part-way: the KV cache is not fit for the prefix cache
    try:  # the stats are filled in however it ends: done, failed or interrupted (Ctrl-C) in prefill or decode
        for s in range(reuse, len(prompt_ids), prefill_chunk):
            logits = _forward(engine, ids[s : s + prefill_chunk], s, kv, session)
            if session is not None:
                session.ids.extend(prompt_ids[s : s + prefill_chunk])
        if pcache is not None:
            pcache.store(prompt_ids, kv)
        counters.decode_starts(stats, len(prompt_ids) - reuse)
        pos = len(prompt_ids)
        context = list(prompt_ids) if sampling.penalized else []
        digest = hashlib.sha256()

        def account(n: int, token: int) -> tuple[str, str | None]:
            """Step ``n``'s token into the counters, the think state and the text: (text, finish reason)."""
            nonlocal think_closed
            generated.append(token)
            if context:
                context.append(token)
            if think_end is not None and token == think_end:
                think_closed = True
            stats.generated_token_ids.append(token)
            stats.generated_tokens = n + 1
            is_eos = token in stop_ids
            final = is_eos or n + 1 == max_tokens
            text, hit = _step_text(decoder, stopper, token, is_eos, final)
            reason = None
            if is_eos or hit:
                stats.finish_reason = reason = "stop"
            elif final:
                reason = "length"
            return text, reason

        if _pipelined(engine, kv, sampling, logprobs, par):
            # greedy on the GPU: the token is picked on the device and step n + 1 is queued before the host
            # reads step n's token (one wait per token; the host's work overlaps the next step)
            picker = _DevicePicker(logits, think_end, think_closed)
            cur = picker.pick(logits)
            for n in range(max_tokens):
                nxt, failed = None, None
                if n + 1 < max_tokens:
                    try:
                        nxt = picker.pick(_forward(engine, cur.token, pos, kv, session))
                    except Exception as e:  # noqa: BLE001 -- raised once the step it belongs to is reached
                        failed = e
                token, host_logits = cur.wait()
                digest.update(host_logits)
                stats.logits_sha256 = digest.hexdigest()
                text, reason = account(n, token)
                yield Step(token, text, cur.logits if keep_logits else None, None, reason)
                if reason is not None:
                    if nxt is not None:
                        kv.length = pos  # the step queued ahead is dropped: its position is past the cache's tokens
                    break
                if failed is not None:
                    raise failed
                if session is not None:
                    session.ids.append(token)
                pos += 1
                cur = nxt
            return
        for n in range(max_tokens):
            last = logits[-1].float()
            # a fingerprint of every step's logits, bit for bit: equal digests prove two runs
            # (budgets, worker counts, read paths) computed the same numbers, not only the same tokens
            digest.update(last.contiguous().view(torch.int32).cpu().numpy().tobytes())
            stats.logits_sha256 = digest.hexdigest()
            processed = apply_penalties(last, context, generated, sampling) if sampling.penalized else last
            if think_closed:
                processed = processed.clone() if processed is last else processed
                processed[think_end] = float("-inf")
            token = sampler(processed)
            text, reason = account(n, token)
            lp = _logprob(processed, token, logprobs) if logprobs is not None else None
            try:
                yield Step(token, text, last if keep_logits else None, lp, reason)
            except GeneratorExit:
                if par is not None and par.rank == 0 and reason is None:
                    par.flag(False)  # cancelled on rank 0 (a closed stream): the other ranks stop too
                raise
            if reason is not None:
                break
            if par is not None and not par.flag(True):  # rank 0 goes on, or was cancelled
                break
            logits = _forward(engine, torch.tensor([token], dtype=torch.int64, device=engine.device), pos, kv, session)
            if session is not None:
                session.ids.append(token)
            pos += 1
    except BaseException as e:
        failed = not isinstance(e, GeneratorExit)  # a closed generator leaves its cache whole
        raise
    finally:
        counters.fill(stats)
        if pcache is not None and not failed:
            pcache.store(prompt_ids + generated, kv)



PIPELINE_DEVICES = ("cuda",)  # where greedy decode picks tokens on the device, a step ahead (tests add "cpu")


def _pipelined(engine: Engine, kv, sampling: SamplingParams, logprobs: int | None, par) -> bool:
    """Whether the decode loop picks tokens on the device and queues each step before reading the last one's
    token: greedy, no penalties, no log-probabilities, one process, a plain KV cache (one that a step too many
    leaves as it was but for a position past the session's tokens), on a device of :data:`PIPELINE_DEVICES`."""
    return (engine.device.type in PIPELINE_DEVICES and sampling.temperature == 0 and not sampling.penalized
            and logprobs is None and par is None and type(kv) is KVCache)


@dataclass
class _Picked:
    """A step's token picked on the device, and its copies to the host in flight."""

    token: torch.Tensor  # int64 [1] on the device: the next step's input
    logits: torch.Tensor  # float32 [vocab] on the device (the Step's logits)
    host_token: torch.Tensor
    host_logits: torch.Tensor
    event: object

    def wait(self) -> tuple[int, memoryview]:
        """(the token, the logits' float32 bytes) once the copies are done."""
        if self.event is not None:
            self.event.synchronize()
        return int(self.host_token[0]), memoryview(self.host_logits.numpy()).cast("B")


class _DevicePicker:
    """Greedy picks on the device (the same token as :class:`Sampler` at temperature 0: the first maximum),
    the ``</think>`` mask applied there too, each step's token and logits copied to a ring of two pinned
    buffers (a step's are read before the step after next writes them again)."""

    def __init__(self, logits: torch.Tensor, think_end: int | None, think_closed: bool):
        dev = logits.device
        self.cuda = dev.type == "cuda"
        vocab = logits.shape[-1]
        self.think_end = think_end
        self.closed = torch.tensor([think_closed], device=dev) if think_end is not None else None
        self._tok = [torch.empty(1, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._logits = [torch.empty(vocab, dtype=torch.float32, pin_memory=self.cuda) for _ in range(2)]
        self._at = 0

    def pick(self, logits: torch.Tensor) -> _Picked:
        last = logits[-1].float()
        processed = last
        if self.think_end is not None:
            processed = last.clone()
            one = processed.narrow(0, self.think_end, 1)
            one.copy_(torch.where(self.closed, torch.full_like(one, float("-inf")), one))
        token = torch.argmax(processed).reshape(1)
        if self.closed is not None:
            self.closed |= token == self.think_end
        j = self._at % 2
        self._at += 1
        host_token, host_logits = self._tok[j], self._logits[j]
        host_token.copy_(token, non_blocking=True)
        host_logits.copy_(last, non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return _Picked(token, last, host_token, host_logits, event)


def _check_request(engine: Engine, prompt_ids, max_tokens: int, logprobs: int | None,
                   stop: Sequence[str]) -> tuple[list[int], int, list[str]]:
    """A request checked against the model: ``(prompt ids, max_tokens capped by the context, stop strings)``.

    Raises:
        InputError: see :func:`generate`.
    """
    model = engine.model
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise InputError("the prompt is empty")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InputError(f"max_tokens must be a whole number, got {max_tokens!r}")
    if max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {max_tokens}")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise InputError(f"logprobs must be a whole number or None, got {logprobs!r}")
    if logprobs is not None and logprobs < 0:
        raise InputError(f"logprobs must be >= 0, got {logprobs}")
    stops = [s for s in stop if s]
    if stops and engine.tokenizer is None:
        raise InputError("stop strings need the tokenizer (load with tokenizer=True)")
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
    return prompt_ids, max_tokens, stops


def _kv_cache(model, session: Session | None, prompt_ids: list[int], max_tokens: int):
    """``(KV cache, prompt tokens it already holds)``: the session's, its shared prefix kept, or a new one."""
    if session is None:
        return model.new_kv_cache(len(prompt_ids) + min(max_tokens, 256)), 0  # grows as needed
    reuse = 0
    while reuse < min(len(session.ids), len(prompt_ids) - 1) and session.ids[reuse] == prompt_ids[reuse]:
        reuse += 1
    if session.kv is None:
        session.kv = model.new_kv_cache(len(prompt_ids) + min(max_tokens, 256))
    del session.ids[reuse:]
    return session.kv, reuse


def _step_text(decoder, stopper: StopStrings, token: int, is_eos: bool, final: bool) -> tuple[str, bool]:
    """The text a step shows and whether a stop string ended it (no text without a tokenizer)."""
    if decoder is None:
        return "", False
    text, hit = stopper.push("" if is_eos else decoder.push(token))
    if final and not hit:
        more, hit = stopper.push(decoder.flush())
        text += more if hit else more + stopper.flush()
    return text, hit


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


def resolve_sampling(
    defaults: dict | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    **fixed,
) -> SamplingParams:
    """:class:`SamplingParams` from explicit values, then ``defaults`` (:func:`generation_defaults`), then built-ins.

    The five options that a checkpoint's ``generation_config.json`` may set take None for
    "not given"; ``fixed`` holds the other fields (``seed``, ``repetition_context``,
    ``frequency_penalty``, ``presence_penalty``) as given.

    Raises:
        InputError: a value out of range (see :class:`SamplingParams`).
    """
    defaults = defaults or {}
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 repetition_penalty=repetition_penalty)
    values = {k: v if v is not None else defaults.get(k, getattr(SamplingParams, k)) for k, v in given.items()}
    return SamplingParams(**values, **fixed)


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
