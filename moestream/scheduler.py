"""The scheduler: many sequences through one streamed model, a step at a time (continuous batching).

Each :class:`Sequence` has its own KV cache, sampler (its own ``torch.Generator``, so a seeded answer is
its solo run's), stop strings, ``max_tokens``, ``min_tokens``, ``ignore_eos`` and log-probabilities.
:meth:`Scheduler.step` makes one forward pass (:meth:`CausalLM.forward_batch`) of

- one token of every decoding sequence, and
- prefill chunks of sequences not yet decoding, in the order they came, while the step's token budget
  (``step_tokens``) lasts, so that a long prompt is cut into chunks between the others' decode steps
  instead of stalling them;

a sequence joins the decode steps once its prompt is prefilled and leaves at its end (EOS, a stop string,
``max_tokens``, cancellation, an error). Up to ``max_batch`` sequences run; more wait in a FIFO.

Why batching helps a streamed model: a step's MoE layer computes every sequence's tokens in one pass and
reads each routed expert once for all of them. Why it is exact: on the CPU every op of the token path
gives a row bits that depend only on that row (attention: on the sequence's own keys), so a sequence's
logits in a batch, after a prefill cut into other chunks, or after a prefix from the
:class:`~moestream.prefix_cache.PrefixCache`, are ``torch.equal`` to its solo run
(``docs/reliability.md``, "Batches and the prefix cache"). On CUDA a batch runs eager ``forward_batch``
(no CUDA graphs per batch size yet; a lone sequence keeps the decode graphs); the GPU's kernels are
row-invariant too (``moestream/dense_kernel.py``), which ``tests/test_scheduler.py``'s GPU test checks.

A failed forward pass (an expert read that fails) ends every sequence of that step with the error (their
KV caches are half written); the others go on. Cancelling one sequence never touches another's state.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .errors import InputError
from .generation import Step, _check_request, _logprob, _think_state, _Turn, eos_ids
from .generation_stats import GenerationStats
from .sampling import Sampler, SamplingParams, apply_penalties
from .textstream import StopStrings
from .tokenizer import StreamDecoder

log = logging.getLogger("moestream.scheduler")
# Tokens one step computes at most (decode tokens first, then prefill chunks), and the longest chunk of one prompt
# in a step. A step may carry several prompts' chunks: on a streamed model a prefill step reads about every expert of
# each layer whatever its length (256 tokens x top-8 of 128 already touch all of them), so prompts that arrive
# together share one read; one long prompt still takes at most a chunk per step, so decode steps keep coming.
DEFAULT_STEP_TOKENS = 2048
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Request:
    """What one sequence generates.

    Attributes:
        ids: the prompt's token ids (int, within the vocabulary; not empty).
        max_tokens: tokens to generate at most (>= 1; capped by the model's context).
        sampling: :class:`~moestream.sampling.SamplingParams` (its ``seed`` seeds this sequence's own generator).
        stop: stop strings (need the tokenizer); the text of one is never given.
        logprobs: None, or the top alternatives each step's :class:`~moestream.generation.TokenLogprob` lists.
        min_tokens: tokens generated before an end-of-sequence token may be picked (its logits are -inf
            until then; as vLLM's ``min_tokens``); at most ``max_tokens``.
        ignore_eos: an end-of-sequence token does not end the sequence (it runs to ``max_tokens`` or a
            stop string).
        keep_logits: each step carries the model's float32 logits [vocab].
        multi_think: as :func:`moestream.generation.generate`'s.
    """

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] | list[str] = ()
    logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    keep_logits: bool = False
    multi_think: bool = False


WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state in the scheduler (made by :meth:`Scheduler.submit`).

    Attributes:
        id: a number unique in this process. request: its :class:`Request` (``max_tokens`` capped).
        state: ``waiting``, ``prefill``, ``decode`` or ``done``.
        stats: a :class:`~moestream.generation_stats.GenerationStats` (prompt, cached and generated tokens,
            their ids, the logits' digest, times, finish reason; the engine-wide counters are not
            split between sequences).
        cached_tokens: prompt tokens whose keys and values came from the prefix cache.
        error: the exception that ended it, if any.
    """

    request: Request
    stops: list[str]
    on_step: Callable[[Step], None] | None = None
    on_end: Callable[[BaseException | None], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    state: str = WAITING
    stats: GenerationStats = field(default_factory=GenerationStats)
    cached_tokens: int = 0
    error: BaseException | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # the decode state, set when admitted
    kv: object = None
    ids_t: torch.Tensor | None = None
    prefilled: int = 0  # prompt positions in the KV cache
    pos: int = 0  # the next decode step's position
    last: int = 0  # the last sampled token (the next decode step's input)
    generated: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_first: float | None = None

    @property
    def done(self) -> bool:
        return self.state == DONE

    def cancel(self) -> None:
        """Stop this sequence (thread-safe): it leaves at the scheduler's next step, nothing more is yielded."""
        self.cancelled.set()


class _Decoding:
    """A sequence's token picking, as :func:`moestream.generation.generate`'s host loop does it: penalties,
    the ``</think>`` mask, the ``min_tokens`` mask, log-probabilities, the sampler, stop strings and text."""

    def __init__(self, engine: Engine, seq: Sequence):
        r = seq.request
        self.seq, self.req = seq, r
        self.sampler = Sampler(r.sampling)
        self.eos = eos_ids(engine)
        self.min_mask = sorted(self.eos) if r.min_tokens and not r.ignore_eos else []
        decoder = StreamDecoder(engine.tokenizer) if engine.tokenizer is not None else None
        # the tokens so far, the think state, the text: as generate's (the same _Turn), on the sequence's lists
        self.turn = _Turn(seq.stats, r.max_tokens, set() if r.ignore_eos else self.eos, decoder, StopStrings(seq.stops),
                          *_think_state(engine, r.ids, self.eos, r.multi_think), generated=seq.generated,
                          context=list(r.ids) if r.sampling.penalized else [])

    def on_device(self, logits: torch.Tensor) -> bool:
        """Whether this step's token can be picked with other sequences' on the GPU (:func:`_greedy_rows`):
        greedy, no penalties, no log-probabilities, no logits kept -- an argmax, the same token on any device."""
        r = self.req
        return (logits.device.type == "cuda" and r.sampling.temperature == 0 and not r.sampling.penalized
                and r.logprobs is None and not r.keep_logits)

    def masked(self, row: torch.Tensor) -> None:
        """The ``</think>`` and ``min_tokens`` masks applied to a greedy row in place (as :meth:`pick`)."""
        if self.turn.think_closed:
            row[self.turn.think_end] = float("-inf")
        if self.min_mask and len(self.seq.generated) < self.req.min_tokens:
            row[self.min_mask] = float("-inf")

    def picked(self, token: int, host_last: torch.Tensor) -> Step:
        """The step of a token picked on the device (:func:`_greedy_rows`), from its logits' host copy."""
        n = len(self.seq.generated)
        self.turn.fingerprint(host_last.view(torch.int32).numpy().tobytes())
        text, reason = self.turn.account(n, token)
        if reason == "length":
            self.seq.stats.finish_reason = "length"
        return Step(token, text, None, None, reason)

    def pick(self, logits: torch.Tensor) -> Step:
        seq, r, stats, turn = self.seq, self.req, self.seq.stats, self.turn
        n = len(seq.generated)
        last = logits[-1].float()
        turn.fingerprint(last.contiguous().view(torch.int32).cpu().numpy().tobytes())
        processed = apply_penalties(last, turn.context, seq.generated, r.sampling) if r.sampling.penalized else last
        if turn.think_closed:
            processed = processed.clone() if processed is last else processed
            processed[turn.think_end] = float("-inf")
        if self.min_mask and n < r.min_tokens:
            processed = processed.clone() if processed is last else processed
            processed[self.min_mask] = float("-inf")
        token = self.sampler(processed)
        text, reason = turn.account(n, token)
        if reason == "length":
            stats.finish_reason = "length"
        lp = _logprob(processed, token, r.logprobs) if r.logprobs is not None else None
        return Step(token, text, last if r.keep_logits else None, lp, reason)


def _greedy_rows(rows: list[tuple[_Decoding, torch.Tensor]]) -> dict[int, tuple[int, torch.Tensor]]:
    """The greedy rows of a GPU step picked together: their last logits stacked, copied to the host in one
    copy (the run digests'), masked and argmaxed on the device (the first maximum, as the sampler's), one wait
    for all. Returns ``{id(decoding): (token, host float32 logits [vocab])}``; other rows pick one by one."""
    mine = [(d, logits) for d, logits in rows if d.on_device(logits)]
    if len(mine) < 2:
        return {}
    last = torch.stack([logits[-1].float() for _, logits in mine])
    host = torch.empty(last.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(last, non_blocking=True)
    for i, (d, _) in enumerate(mine):
        d.masked(last[i])  # after the copy is queued: the digest is of the raw logits
    tokens = torch.argmax(last, dim=-1).cpu().tolist()  # waits for the copies too (one stream)
    return {id(d): (tokens[i], host[i]) for i, (d, _) in enumerate(mine)}


def _reservation(seq: Sequence) -> int:
    """KV cache tokens a sequence may come to hold: its prompt and every token it may generate."""
    return len(seq.request.ids) + seq.request.max_tokens


class Scheduler:
    """Runs :class:`Sequence`\\ s of one engine together, a forward pass per :meth:`step`.

    Args:
        engine: a loaded :class:`~moestream.engine.Engine` (its ``model`` is read at every step).
        max_batch: sequences running at once (>= 1); more wait, first come first served.
        step_tokens: tokens one step computes at most (>= ``max_batch``): every decoding sequence's one,
            then prefill chunks while it lasts.
        prefill_chunk: the longest prefill chunk of one sequence in a step.
        prefix_cache: a :class:`~moestream.prefix_cache.PrefixCache` (default: the engine's, if any).
        kv_tokens: KV cache tokens the running sequences may reserve together (each reserves its prompt plus
            ``max_tokens``; the budget plan's ``context_tokens x sequences``), None: no bound. A waiting
            sequence starts only when its reservation fits beside the running ones' (first come, first
            served), or when nothing runs: so the KV caches stay within the plan, and a request is never
            refused for it.

    Thread-safe for :meth:`submit` and :meth:`Sequence.cancel` from other threads while one thread runs
    :meth:`step` (or :meth:`serve_forever`).

    Raises:
        InputError: ``max_batch`` < 1, ``step_tokens`` < ``max_batch``, or an engine under expert
            parallelism (its ranks follow one generation at a time).
    """

    def __init__(self, engine: Engine, max_batch: int = 1, step_tokens: int = DEFAULT_STEP_TOKENS,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefix_cache=..., kv_tokens: int | None = None):
        if max_batch < 1:
            raise InputError(f"max_batch must be at least 1, got {max_batch}")
        if step_tokens < max_batch or prefill_chunk < 1:
            raise InputError(f"step_tokens ({step_tokens}) must be at least max_batch ({max_batch}), "
                             f"prefill_chunk ({prefill_chunk}) at least 1")
        if getattr(engine, "parallel", None) is not None:
            raise InputError("the scheduler does not run under expert parallelism (torchrun): its ranks follow "
                             "one generation at a time")
        self.engine, self.max_batch, self.step_tokens, self.prefill_chunk = engine, max_batch, step_tokens, \
            prefill_chunk
        self.prefix_cache = getattr(engine, "prefix_cache", None) if prefix_cache is ... else prefix_cache
        self.kv_tokens = kv_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._decoding: dict[int, _Decoding] = {}
        self.steps = 0  # forward passes made
        self.observer: Callable[[int, int], None] | None = None  # (sequences, tokens) of each step: metrics
        self.on_idle: Callable[[], None] | None = None  # called by serve_forever when the last sequence has left

    # ---- submitting and cancelling ----

    def submit(self, request: Request, on_step: Callable[[Step], None] | None = None,
               on_end: Callable[[BaseException | None], None] | None = None) -> Sequence:
        """Queue ``request``; returns its :class:`Sequence`. ``on_step(step)`` is called (on the stepping
        thread) with each :class:`~moestream.generation.Step`, ``on_end(error)`` once when it leaves
        (finished or cancelled: None; failed: the exception).

        Raises:
            InputError: as :func:`moestream.generation.generate` (empty prompt, ids outside the
                vocabulary, a prompt filling the context, stop strings without a tokenizer, bad
                ``logprobs``), or ``min_tokens`` outside 0..max_tokens.
            EngineClosedError: the engine is closed.
        """
        self.engine.check_open()
        ids, max_tokens, stops = _check_request(self.engine, request.ids, request.max_tokens, request.logprobs,
                                                request.stop)
        if not 0 <= request.min_tokens <= request.max_tokens:
            raise InputError(f"min_tokens must be between 0 and max_tokens ({request.max_tokens}), "
                             f"got {request.min_tokens}")
        req = Request(ids, max_tokens, request.sampling, tuple(stops), request.logprobs,
                      min(request.min_tokens, max_tokens), request.ignore_eos, request.keep_logits,
                      request.multi_think)
        seq = Sequence(req, stops, on_step, on_end)
        seq.stats.prompt_tokens = len(ids)
        seq.stats.finish_reason = "length"
        with self._wake:
            if self._closed:
                raise InputError("the scheduler is closed")
            self.waiting.append(seq)
            self._wake.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Cancel ``seq``: a waiting one leaves the queue now, a running one at the next step."""
        seq.cancel()
        with self._wake:
            if seq.state == WAITING and seq in self.waiting:
                self.waiting.remove(seq)
                self._leave(seq, None)
            self._wake.notify_all()

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        with self._lock:
            return len(self.running), len(self.waiting)

    def has_work(self) -> bool:
        """Whether a sequence runs or waits."""
        return bool(self.running or self.waiting)

    # ---- stepping ----

    def _leave(self, seq: Sequence, error: BaseException | None) -> None:
        """``seq`` is done: its KV cache freed, ``on_end`` told (call with the lock held or from the stepper)."""
        seq.state, seq.error, seq.kv, seq.ids_t = DONE, error, None, None
        self._decoding.pop(seq.id, None)
        now = time.perf_counter()
        st = seq.stats
        if seq.t_first is not None:
            st.decode_seconds = now - seq.t_first
            decoded = max(0, st.generated_tokens - 1)
            st.decode_tok_s = decoded / st.decode_seconds if decoded and st.decode_seconds else 0.0
        elif seq.t_admit:
            st.prefill_seconds = now - seq.t_admit
        if seq.cancelled.is_set() and st.finish_reason == "length" and st.generated_tokens < seq.request.max_tokens:
            st.finish_reason = "cancelled"
        if seq.on_end is not None:
            try:
                seq.on_end(error)
            except Exception:  # noqa: BLE001 -- a callback's failure must not stop the other sequences
                log.exception("moestream: a sequence's on_end callback failed")

    def _admit(self, seq: Sequence) -> None:
        """A KV cache for ``seq``, its longest cached prefix written into it."""
        model, r = self.engine.model, seq.request
        seq.kv = model.new_kv_cache(len(r.ids) + min(r.max_tokens, 256))
        seq.ids_t = torch.tensor(r.ids, dtype=torch.int64, device=self.engine.device)
        seq.t_admit = time.perf_counter()
        if self.prefix_cache is not None:
            n, blocks = self.prefix_cache.lookup(r.ids, len(r.ids) - 1)
            self.prefix_cache.fill(seq.kv, n, blocks)
            seq.prefilled = seq.cached_tokens = seq.stats.prompt_cached_tokens = n
        self._decoding[seq.id] = _Decoding(self.engine, seq)
        seq.state = PREFILL
        self.running.append(seq)

    def _store(self, seq: Sequence) -> None:
        """The sequence's computed blocks into the prefix cache."""
        if self.prefix_cache is not None and seq.kv is not None:
            try:
                self.prefix_cache.store(seq.request.ids + seq.generated, seq.kv)
            except Exception:  # noqa: BLE001 -- the cache is an optimization; a failure there ends no answer
                log.exception("moestream: storing a prefix failed")

    def _reserved(self) -> int:
        return sum(_reservation(s) for s in self.running)

    def _drop_cancelled(self) -> None:
        """Cancelled sequences leave, running or waiting (call with the lock held)."""
        for s in [s for s in self.running if s.cancelled.is_set()]:
            self.running.remove(s)
            self._leave(s, None)
        for s in [s for s in self.waiting if s.cancelled.is_set()]:
            self.waiting.remove(s)
            self._leave(s, None)

    def _plan(self) -> list[tuple[Sequence, torch.Tensor, int]]:
        """This step's parts: ``(sequence, token ids, start)``, decode tokens first, then prefill chunks."""
        parts, budget = [], self.step_tokens
        dev = self.engine.device
        for s in self.running:
            if s.state == DECODE:
                parts.append((s, torch.tensor([s.last], dtype=torch.int64, device=dev), s.pos))
                budget -= 1
        for s in self.running:
            if s.state == PREFILL and budget > 0:
                n = min(budget, self.prefill_chunk, len(s.request.ids) - s.prefilled)
                parts.append((s, s.ids_t[s.prefilled : s.prefilled + n], s.prefilled))
                budget -= n
        return parts

    def step(self) -> list[tuple[Sequence, Step]]:
        """One forward pass over the running sequences (admitting waiting ones first, dropping cancelled ones).

        Returns the steps made, ``(sequence, Step)``, in the order of the pass (a sequence still prefilling
        makes none). A failed pass ends its sequences with the error (``on_end(error)``) and returns [];
        a KeyboardInterrupt ends them too and is raised again.
        """
        with self._lock:
            self._drop_cancelled()
            while self.waiting and len(self.running) < self.max_batch:
                if self.running and self.kv_tokens is not None and \
                        self._reserved() + _reservation(self.waiting[0]) > self.kv_tokens:
                    break  # its KV cache would not fit beside the running ones' yet: it waits its turn
                s = self.waiting.popleft()
                if s.cancelled.is_set():
                    self._leave(s, None)
                    continue
                try:
                    self._admit(s)
                except Exception as e:  # noqa: BLE001 -- e.g. no memory for its cache: this sequence only
                    if s in self.running:
                        self.running.remove(s)
                    self._leave(s, e)
        parts = self._plan()
        if not parts:
            return []
        engine = self.engine
        model = engine.model
        engine.hold_threads()
        try:
            with torch.inference_mode():
                if len(parts) == 1:  # one sequence: the model's own path (its decode runner, a wrapper's forward)
                    s, ids, start = parts[0]
                    outs = [model(ids, start, s.kv)]
                else:
                    outs = model.forward_batch([(ids, start, s.kv) for s, ids, start in parts])
        except BaseException as e:
            with self._lock:
                for s, _, _ in parts:
                    if s in self.running:
                        self.running.remove(s)
                    self._leave(s, e)
            if not isinstance(e, Exception):
                raise
            return []
        self.steps += 1
        if self.observer is not None:
            self.observer(len(parts), sum(ids.shape[0] for _, ids, _ in parts))
        made = []
        now = time.perf_counter()
        greedy = _greedy_rows([(self._decoding[s.id], logits) for (s, ids, start), logits in zip(parts, outs)
                               if s.state != PREFILL or start + ids.shape[0] >= len(s.request.ids)])
        for (s, ids, start), logits in zip(parts, outs):
            if s.state == PREFILL:
                s.prefilled = start + ids.shape[0]
                if s.prefilled < len(s.request.ids):
                    continue
                s.state, s.pos, s.t_first = DECODE, len(s.request.ids), now
                s.stats.prefill_seconds = now - s.t_admit
                s.stats.prefill_tok_s = (len(s.request.ids) - s.cached_tokens) / s.stats.prefill_seconds \
                    if s.stats.prefill_seconds else 0.0
                self._store(s)  # the prompt's blocks, for requests sharing it that come while this one decodes
            else:
                s.pos += 1
            d = self._decoding[s.id]
            step = d.picked(*greedy[id(d)]) if id(d) in greedy else d.pick(logits)
            s.last = step.token
            made.append((s, step))
            if s.on_step is not None and not s.cancelled.is_set():
                try:
                    s.on_step(step)
                except Exception:  # noqa: BLE001
                    log.exception("moestream: a sequence's on_step callback failed")
                    s.cancel()
            if step.finish_reason is not None:
                self._store(s)
                with self._lock:
                    self.running.remove(s)
                    self._leave(s, None)
        return made

    # ---- driving ----

    def serve_forever(self) -> None:
        """Step while there is work, wait for :meth:`submit` when there is none, until :meth:`close`."""
        while True:
            with self._wake:
                if not self._closed and not self.has_work() and self.on_idle is not None:
                    try:
                        self.on_idle()
                    except Exception:  # noqa: BLE001
                        log.exception("moestream: the scheduler's on_idle callback failed")
                while not self._closed and not self.has_work():
                    self._wake.wait()
                if self._closed:
                    return
            try:
                self.step()
            except BaseException:  # noqa: BLE001 -- the step's sequences were told; the others go on
                log.exception("moestream: a scheduler step failed")

    def close(self) -> None:
        """Stop :meth:`serve_forever`; every sequence still waiting or running ends (``on_end(None)``)."""
        with self._wake:
            self._closed = True
            for s in list(self.waiting) + self.running:
                s.cancel()
                self._leave(s, None)
            self.waiting.clear()
            self.running.clear()
            self._wake.notify_all()

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[int, Sequence, Step]]:
        """Generate every request together on the calling thread: ``(index of the request, its Sequence, Step)``
        as each is made. Closing the iterator early cancels the sequences not done.

        Raises:
            InputError: a bad request (before any is run).
            the first error a sequence ended with (a failed expert read), after the others finished.
        """
        reqs = list(requests)
        seqs: list[Sequence] = []
        try:
            for r in reqs:
                seqs.append(self.submit(r))
            index = {s.id: i for i, s in enumerate(seqs)}
            while not all(s.done for s in seqs):
                for s, step in self.step():
                    if s.id in index:
                        yield index[s.id], s, step
        finally:
            for s in seqs:
                if not s.done:
                    self.cancel(s)
            with self._lock:
                self._drop_cancelled()  # their KV caches go now, not at some later step
        failed = next((s.error for s in seqs if s.error is not None), None)
        if failed is not None:
            raise failed
