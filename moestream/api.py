"""The Python API, mirroring ``moestream generate``: :func:`generate` and :func:`stream_generate`.

::

    import moestream

    with moestream.load("Qwen/Qwen3-30B-A3B", cache_budget_gb=3) as engine:
        print(moestream.generate(engine, "Why is the sky blue?", max_tokens=200, hide_think=True))
        for r in moestream.stream_generate(engine, "Tell me a story.", temp=0.7, stop=["THE END"]):
            print(r.text, end="", flush=True)

The engine closes when the ``with`` block ends (or call ``engine.close()``); a closed engine
raises :class:`~moestream.errors.EngineClosedError` when used.

Keyword names follow the CLI flags (``--rep-penalty`` is ``rep_penalty``); sampling
defaults come from the checkpoint's ``generation_config.json`` as in the CLI. For a
server, :func:`moestream.generation.generate` is the token-level entry point underneath.

Several prompts together, each with its own options, one forward pass per step for all of them
(:mod:`moestream.scheduler`; each answer the bits of its solo run on the CPU)::

    for s in moestream.batch_generate(engine, ["Hi!", "Name three rivers."], max_tokens=[32, 64],
                                      sampling=[None, SamplingParams(temperature=0.7, seed=1)]):
        print(s.index, repr(s.text))
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .budget import GB
from .engine import Engine
from .errors import InputError
from .generation import TokenLogprob, eos_ids
from .generation import generate as generate_tokens
from .generation_stats import GenerationStats
from .memory import peak_rss_bytes
from .sampling import SamplingParams, generation_defaults, resolve_sampling
from .scheduler import DEFAULT_STEP_TOKENS, Request, Scheduler
from .textstream import ReasoningSplitter
from .tokenizer import chat_ids, encode_prompt, prompt_opens_thinking, think_token_ids


@dataclass(frozen=True)
class GenerationResponse:
    """One generated token of :func:`stream_generate`, with the run's stats so far.

    Attributes:
        text: the text to show for this token (may be empty); with ``hide_think``, the
            answer only.
        reasoning, answer: this token's text split into the thinking block and the answer
            (tags dropped; see :class:`moestream.textstream.ReasoningSplitter`).
        token: the token id. logprob: a :class:`~moestream.generation.TokenLogprob` when
            ``logprobs`` was given.
        finish_reason: None until the last token, then ``"stop"`` or ``"length"``.
        prompt_tokens: tokens in the prompt; prompt_tps: prefill speed (tokens/s).
        generation_tokens: tokens generated so far; generation_tps: decode speed so far
            (tokens/s, from the second token on).
        cache_hit_rate: expert-cache hit rate of this run so far (0..1).
        peak_rss_gb: peak resident set size of the process (GB = 10^9 bytes).
    """

    text: str
    reasoning: str
    answer: str
    token: int
    logprob: TokenLogprob | None
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    cache_hit_rate: float
    peak_rss_gb: float


def prompt_ids(
    engine: Engine,
    prompt: str | Sequence[int] | Sequence[dict],
    system: str | None = None,
    chat_template: bool = True,
    no_think: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids for ``prompt``: text (through the chat template unless ``chat_template`` is False),
    a list of chat messages (``{"role", "content"}``), or token ids (used as they are).

    Raises:
        InputError: an empty prompt, a prompt needing a tokenizer without one, bad messages.
    """
    kwargs = dict(chat_template_kwargs or {})
    if no_think:
        kwargs["enable_thinking"] = False
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("the prompt is empty")
        if engine.tokenizer is None:
            raise InputError("a text prompt needs the tokenizer (load with tokenizer=True) or give token ids")
        if tools:
            return chat_ids(engine.tokenizer, [{"role": "user", "content": prompt}], tools, kwargs)
        return encode_prompt(engine.tokenizer, prompt, chat_template, system, kwargs)
    prompt = list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        if engine.tokenizer is None:
            raise InputError("chat messages need the tokenizer (load with tokenizer=True)")
        messages = ([{"role": "system", "content": system}] if system else []) + prompt
        return chat_ids(engine.tokenizer, messages, tools, kwargs)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InputError("the prompt must be a string, a list of chat messages, or a list of token ids")
    return prompt


def stream_generate(
    engine: Engine,
    prompt: str | Sequence[int] | Sequence[dict],
    max_tokens: int = 256,
    *,
    system: str | None = None,
    chat_template: bool = True,
    no_think: bool = False,
    multi_think: bool = False,
    hide_think: bool = False,
    stop: Sequence[str] = (),
    temp: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    rep_penalty: float | None = None,
    rep_ctx: int = 256,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    seed: int | None = None,
    sampling: SamplingParams | None = None,
    logprobs: int | None = None,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt``, yielding a :class:`GenerationResponse` per token.

    Options as ``moestream generate``'s flags: ``temp``, ``top_p``, ``top_k``, ``min_p``
    and ``rep_penalty`` default to the checkpoint's ``generation_config.json`` values,
    else off (greedy); ``sampling`` (a :class:`~moestream.sampling.SamplingParams`)
    replaces all of them. ``stats``, when given, is filled in as in the CLI.

    Raises:
        InputError: bad options or prompt (see :class:`~moestream.sampling.SamplingParams`
            and :func:`moestream.generation.generate`).
        ReadError: when an expert read fails.
        EngineClosedError: the engine was closed.
    """
    engine.check_open()

    if sampling is None:
        sampling = resolve_sampling(
            generation_defaults(engine.checkpoint.path), temp, top_p, top_k, min_p, rep_penalty, seed=seed,
            repetition_context=rep_ctx, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        )
    ids = prompt_ids(engine, prompt, system, chat_template, no_think, tools, chat_template_kwargs)
    stats = stats if stats is not None else GenerationStats()
    opens = prompt_opens_thinking(ids, think_token_ids(engine.tokenizer), eos_ids(engine))
    splitter = ReasoningSplitter(opens)
    cache = engine.cache.stats
    hits0, lookups0 = cache.hits, cache.lookups
    first_at = None
    for n, step in enumerate(generate_tokens(engine, ids, max_tokens, sampling, stats, stop=stop, logprobs=logprobs,
                                             multi_think=multi_think), start=1):
        now = time.perf_counter()
        first_at = first_at or now
        split = splitter.push(step.text)
        if step.finish_reason is not None:
            end = splitter.flush()
            split = type(split)(split.reasoning + end.reasoning, split.answer + end.answer)
        lookups = cache.lookups - lookups0
        yield GenerationResponse(
            text=split.answer if hide_think else step.text, reasoning=split.reasoning, answer=split.answer,
            token=step.token, logprob=step.logprob, finish_reason=step.finish_reason,
            prompt_tokens=len(ids), prompt_tps=stats.prefill_tok_s, generation_tokens=n,
            generation_tps=(n - 1) / (now - first_at) if n > 1 and now > first_at else 0.0,
            cache_hit_rate=(cache.hits - hits0) / lookups if lookups else 0.0,
            peak_rss_gb=peak_rss_bytes() / GB,
        )


def generate(
    engine: Engine,
    prompt: str | Sequence[int] | Sequence[dict],
    max_tokens: int = 256,
    *,
    return_stats: bool = False,
    **options,
) -> str | tuple[str, GenerationStats]:
    """The whole generated text of :func:`stream_generate` (same options); with ``return_stats``,
    ``(text, GenerationStats)``.

    With ``hide_think`` the text is the answer only; otherwise the raw text, thinking
    block and tags included.
    """
    stats = GenerationStats()
    text = "".join(r.text for r in stream_generate(engine, prompt, max_tokens, stats=stats, **options))
    return (text, stats) if return_stats else text


@dataclass(frozen=True)
class BatchStep:
    """One generated token of one prompt of :func:`batch_generate`.

    Attributes:
        index: which prompt (its place in ``prompts``).
        token: the token id. text: the text that became final with it (may be empty; a stop string's
            and an EOS token's text is never given).
        logprob: a :class:`~moestream.generation.TokenLogprob` when that prompt asked for ``logprobs``.
        logits: with ``keep_logits``, the model's float32 logits [vocab] it came from.
        finish_reason: None until the prompt's last token, then ``"stop"`` or ``"length"``.
        stats: that prompt's :class:`~moestream.generation_stats.GenerationStats` so far (prompt, cached and
            generated tokens, token ids, the logits' digest, times).
    """

    index: int
    token: int
    text: str
    logprob: TokenLogprob | None
    logits: torch.Tensor | None
    finish_reason: str | None
    stats: GenerationStats


def _each(name: str, value, n: int) -> list:
    """``value`` for each of ``n`` prompts: a list of n values as given, anything else repeated."""
    if isinstance(value, list):
        if len(value) != n:
            raise InputError(f"{name}: {len(value)} values for {n} prompts")
        return value
    return [value] * n


def batch_generate(
    engine: Engine,
    prompts: Sequence[str | Sequence[int] | Sequence[dict]],
    max_tokens: int | list[int] = 256,
    *,
    sampling: SamplingParams | None | list[SamplingParams | None] = None,
    stop: Sequence[str] | list[Sequence[str]] = (),
    logprobs: int | None | list[int | None] = None,
    min_tokens: int | list[int] = 0,
    ignore_eos: bool | list[bool] = False,
    keep_logits: bool = False,
    max_batch: int | None = None,
    system: str | None = None,
    chat_template: bool = True,
    no_think: bool = False,
) -> Iterator[BatchStep]:
    """Generate from several prompts together, yielding a :class:`BatchStep` per token as each is made.

    Each prompt (text through the chat template, chat messages, or token ids, as :func:`stream_generate`'s)
    is a sequence of the engine's :class:`~moestream.scheduler.Scheduler`: every step computes one token of
    every decoding sequence and prefill chunks of the others in one forward pass, so a layer's experts are
    read once for all of them. On the CPU each prompt's tokens, logits and log-probabilities are exactly
    those of generating it alone (:func:`stream_generate`, or ``moestream generate``), seeded sampling
    included (each prompt samples from its own generator). With the engine's prefix cache
    (``prefix_cache_gb``) a prompt sharing a cached prefix skips prefilling it (``stats.prompt_cached_tokens``).

    Args:
        prompts: one entry per sequence.
        max_tokens, sampling, stop, logprobs, min_tokens, ignore_eos: one value for every prompt, or a list
            of one per prompt. ``sampling`` None: the checkpoint's ``generation_config.json`` defaults
            (greedy without one). ``min_tokens``: tokens before an end-of-sequence token may be picked;
            ``ignore_eos``: an end-of-sequence token does not end that prompt.
        keep_logits: each step carries the model's float32 logits [vocab].
        max_batch: sequences running at once (default: every prompt); the others wait. Each running
            sequence holds a KV cache: load with ``max_batch=N`` to have the budget plan count N of them.

    Steps of different prompts interleave; within a prompt they come in order. Closing the iterator
    early cancels the prompts not finished.

    Raises:
        InputError: a bad prompt or option (an empty prompt, ids outside the vocabulary, a list of the
            wrong length, ``min_tokens`` above ``max_tokens``), before anything runs.
        ReadError: an expert read failed (after the other prompts finished).
        EngineClosedError: the engine was closed.
    """
    engine.check_open()
    n = len(prompts)
    if n == 0:
        raise InputError("batch_generate: no prompts")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise InputError(f"batch_generate: max_batch must be a whole number of at least 1 or None, got {max_batch!r}")
    for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens)):
        for v in _each(name, value, n):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"batch_generate: {name} must be a whole number, got {v!r}")
    for v in _each("ignore_eos", ignore_eos, n):
        if not isinstance(v, bool):
            raise InputError(f"batch_generate: ignore_eos must be True or False, got {v!r}")
    defaults = generation_defaults(engine.checkpoint.path)
    samplings = [s if s is not None else resolve_sampling(defaults) for s in _each("sampling", sampling, n)]
    stops = _each("stop", stop if isinstance(stop, list) and stop and not isinstance(stop[0], str) else
                  [stop] * n, n)
    requests = [
        Request(prompt_ids(engine, p, system, chat_template, no_think), m, sp, tuple(st), lp, mt, ie, keep_logits)
        for p, m, sp, st, lp, mt, ie in zip(prompts, _each("max_tokens", max_tokens, n), samplings, stops,
                                            _each("logprobs", logprobs, n), _each("min_tokens", min_tokens, n),
                                            _each("ignore_eos", ignore_eos, n))
    ]
    scheduler = Scheduler(engine, max_batch or n, step_tokens=max(DEFAULT_STEP_TOKENS, max_batch or n))
    for i, seq, step in scheduler.run(requests):
        yield BatchStep(i, step.token, step.text, step.logprob, step.logits, step.finish_reason, seq.stats)
