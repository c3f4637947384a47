"""Generation: prefill in chunks, decode token by token, sample, stop, and count.

``generate()`` drives a loaded :class:`~moestream.engine.Engine` over one prompt and
yields a :class:`Step` per generated token; :class:`~moestream.generation_stats.GenerationStats` gathers what a
run did (speed, cache hit rate, bytes read, distinct experts per layer, memory). The sampling options, penalties
and sampler are :mod:`moestream.sampling`'s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .budget import gb_text
from .engine import Engine
from .errors import ConfigError, InputError
from .generation_stats import GenerationStats, _Counters
from .memory import available_bytes
from .models.layers import KVCache
from .sampling import GENERATION_CONFIG, Sampler, SamplingParams, apply_penalties
from .textstream import StopStrings
from .tokenizer import StreamDecoder, current_turn, think_token_ids


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
        f"note: the whole model fits in memory (resident weights {gb_text(engine.resident_bytes)} GB + every "
        f"expert{mine} {gb_text(experts)} GB; {gb_text(avail)} GB available): --cache-budget-gb all keeps every "
        f"expert{mine} resident and will be faster than the {gb_text(cache.budget_bytes)} GB budget"
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
    eos = eos_ids(engine)
    turn = _Turn(stats, max_tokens, eos if stop_at_eos else set(),
                 StreamDecoder(engine.tokenizer) if engine.tokenizer is not None else None, StopStrings(stops),
                 *_think_state(engine, prompt_ids, eos, multi_think))
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
    failed = False  # a forward pass failed part-way: the KV cache is not fit for the prefix cache
    try:  # the stats are filled in however it ends: done, failed or interrupted (Ctrl-C) in prefill or decode
        for s in range(reuse, len(prompt_ids), prefill_chunk):
            logits = _forward(engine, ids[s : s + prefill_chunk], s, kv, session)
            if session is not None:
                session.ids.extend(prompt_ids[s : s + prefill_chunk])
        if pcache is not None:
            pcache.store(prompt_ids, kv)
        counters.decode_starts(stats, len(prompt_ids) - reuse)
        if sampling.penalized:
            turn.context = list(prompt_ids)
        if _pipelined(engine, kv, sampling, logprobs, par):
            yield from _decode_on_device(engine, logits, len(prompt_ids), kv, session, turn, keep_logits)
        else:
            yield from _decode(engine, logits, len(prompt_ids), kv, session, turn, Sampler(sampling), sampling,
                               logprobs, keep_logits, par)
    except BaseException as e:
        failed = not isinstance(e, GeneratorExit)  # a closed generator leaves its cache whole
        raise
    finally:
        counters.fill(stats)
        if pcache is not None and not failed and not turn.ahead_failed:
            pcache.store(prompt_ids + turn.generated, kv)


def _think_state(engine: Engine, prompt_ids: list[int], eos: set[int], multi_think: bool) -> tuple[int | None, bool]:
    """``(the </think> token to mask once the thinking closed, or None; whether it closed in the prompt's turn)``."""
    if multi_think or engine.tokenizer is None:
        return None, False
    think_end = think_token_ids(engine.tokenizer)[1]
    return think_end, think_end is not None and think_end in current_turn(prompt_ids, eos)


@dataclass
class _Turn:
    """A generation's state between steps: the tokens so far, the think state, the text and the stats."""

    stats: GenerationStats
    max_tokens: int
    stop_ids: set[int]
    decoder: StreamDecoder | None
    stopper: StopStrings
    think_end: int | None
    think_closed: bool
    generated: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # the prompt and the tokens so far, with penalties only
    digest: object = field(default_factory=hashlib.sha256)
    ahead_failed: bool = False  # the step queued ahead failed as the run ended: the KV cache is not whole

    def account(self, n: int, token: int) -> tuple[str, str | None]:
        """Step ``n``'s token into the counters, the think state and the text: (text, finish reason)."""
        stats = self.stats
        self.generated.append(token)
        if self.context:
            self.context.append(token)
        if self.think_end is not None and token == self.think_end:
            self.think_closed = True
        stats.generated_token_ids.append(token)
        stats.generated_tokens = n + 1
        is_eos = token in self.stop_ids
        final = is_eos or n + 1 == self.max_tokens
        text, hit = _step_text(self.decoder, self.stopper, token, is_eos, final)
        reason = None
        if is_eos or hit:
            stats.finish_reason = reason = "stop"
        elif final:
            reason = "length"
        return text, reason

    def fingerprint(self, data) -> None:
        """A step's logits (bytes) into the run's digest (``stats.logits_sha256``)."""
        self.digest.update(data)
        self.stats.logits_sha256 = self.digest.hexdigest()


def _decode_on_device(engine: Engine, logits, pos: int, kv, session: Session | None, turn: _Turn,
                      keep_logits: bool) -> Iterator[Step]:
    """Greedy decode on the GPU: the token is picked on the device and step n + 1 is queued before the host
    reads step n's token (one wait per token; the host's work overlaps the next step)."""
    picker = _DevicePicker(logits, turn.think_end, turn.think_closed)
    cur = picker.pick(logits)
    for n in range(turn.max_tokens):
        nxt, failed = None, None
        if n + 1 < turn.max_tokens:
            try:
                nxt = picker.pick(_forward(engine, cur.token, pos, kv, session))
            except Exception as e:  # noqa: BLE001 -- raised once the step it belongs to is reached
                failed = e
        token, host_logits = cur.wait()
        turn.fingerprint(host_logits)
        text, reason = turn.account(n, token)
        yield Step(token, text, cur.logits if keep_logits else None, None, reason)
        if reason is not None:
            if nxt is not None:
                kv.length = pos  # the step queued ahead is dropped: its position is past the cache's tokens
            turn.ahead_failed = failed is not None
            break
        if failed is not None:
            raise failed
        if session is not None:
            session.ids.append(token)
        pos += 1
        cur = nxt


def _decode(engine: Engine, logits, pos: int, kv, session: Session | None, turn: _Turn, sampler: Sampler,
            sampling: SamplingParams, logprobs: int | None, keep_logits: bool, par) -> Iterator[Step]:
    """Decode on the host: each step's logits -> penalties -> the ``</think>`` mask -> (log-probabilities) ->
    the sampler; under expert parallelism rank 0 tells the others at each step whether to go on."""
    for n in range(turn.max_tokens):
        last = logits[-1].float()
        # a fingerprint of every step's logits, bit for bit: equal digests prove two runs
        # (budgets, worker counts, read paths) computed the same numbers, not only the same tokens
        turn.fingerprint(last.contiguous().view(torch.int32).cpu().numpy().tobytes())
        processed = apply_penalties(last, turn.context, turn.generated, sampling) if sampling.penalized else last
        if turn.think_closed:
            processed = processed.clone() if processed is last else processed
            processed[turn.think_end] = float("-inf")
        token = sampler(processed)
        text, reason = turn.account(n, token)
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
