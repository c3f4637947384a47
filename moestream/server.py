"""``moestream serve``: an OpenAI-compatible HTTP server for one streamed model (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(streamed as server-sent events or not), ``GET /health``, ``GET /metrics`` (Prometheus
text format), ``GET /stats`` (JSON for the chat page) and ``GET /`` (a small chat page).

Up to ``max_batch`` generations run together (:class:`BatchRunner`: the engine's
:class:`~moestream.scheduler.Scheduler` on a thread of its own steps every running sequence in one
forward pass, each answer the bits of its solo run); more wait in a FIFO of at most ``max_queue``
entries; one more gets 429 with ``Retry-After``. Each step's tokens go to their requests on the event
loop; a client that disconnects (streamed or not) cancels its sequence, which leaves at the next step
without touching the others; one that disconnects while it waits leaves the queue. With the engine's
prefix cache (``--prefix-cache-gb``) a prompt reuses the keys and values of its longest cached prefix,
reported as ``usage.prompt_tokens_details.cached_tokens``. Under expert parallelism (torchrun) one
generation runs at a time (:class:`Runner`), as its ranks follow rank 0's generations one by one.

Request and response shapes follow OpenAI's chat and completions APIs (as llama.cpp's
and vLLM's servers implement them); the text between ``<think>`` and ``</think>`` is
returned as ``reasoning_content`` (vLLM's field), and Qwen3-style ``<tool_call>`` JSON
blocks as ``tool_calls``. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; bad input is a 4xx, never a 500, and
any other failure a JSON 500 in that shape (or, mid-stream, an error event then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .budget import GB
from .errors import InputError, MoestreamError, PromptTooLongError, TemplateVariableError
from .generation import Step, eos_ids, generate
from .generation_stats import GenerationStats
from .sampling import SamplingParams, generation_defaults
from .scheduler import Request as SequenceRequest
from .scheduler import Scheduler
from .serverguard import (
    DEFAULT_MAX_BODY_BYTES,
    TRIM_AFTER_BYTES,
    BodyLimit,
    ServerErrors,
    api_key_matches,
    internal_error_message,
    release_freed_memory,
)
from .textstream import ReasoningSplitter
from .tokenizer import PromptLimit, chat_ids, encode_text, prompt_opens_thinking, think_token_ids

log = logging.getLogger("moestream.server")
T = TypeVar("T")


class APIError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        # ASCII JSON: a message quoting hostile text (an unpaired surrogate) still encodes
        return Response(json.dumps(body), status_code=self.status, headers=self.headers, media_type="application/json")


# ---- request bodies: known fields are type-checked strictly, unknown fields ignored ----

class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        # OpenAI's schema: only an assistant message that calls tools may leave out its content
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, which aiperf and other load testers send to fix the output length
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


# ---- what runs: one generation at a time, on a thread, behind a bounded FIFO ----

@dataclass
class Job:
    """One generation: prompt token ids and everything ``generate`` needs."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    logprobs: int | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    min_tokens: int = 0
    ignore_eos: bool = False
    cached_tokens: int = 0  # prompt tokens the prefix cache held (set when it is admitted)


_END = object()


class Runner:
    """Runs :class:`Job`\\ s one at a time; at most ``max_queue`` wait (FIFO), more get 429.

    ``enter()`` waits for the model (raising a 429 :class:`APIError` when the queue is
    full); ``start()`` then runs the job on a thread and returns a :class:`Run` whose
    steps the caller consumes. The model is handed to the next job only when the thread
    has finished, even if its client went away.
    """

    def __init__(self, engine, max_queue: int, metrics: Metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._lock: asyncio.Lock | None = None
        self.waiting = 0
        self.busy = False

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()  # created inside the server's event loop
        return self._lock

    async def enter(self) -> None:
        if self.lock.locked() and self.waiting >= self.max_queue:
            raise APIError(
                429, f"the server is busy: {self.waiting} requests are already waiting (--max-queue {self.max_queue})",
                type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"},
            )
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting + self.busy)
        try:
            await self.lock.acquire()  # asyncio.Lock wakes waiters in FIFO order
        finally:
            self.waiting -= 1
        self.busy = True
        self.metrics.queue_depth.set(self.waiting + 1)

    def _leave(self) -> None:
        self.busy = False
        self.metrics.queue_depth.set(self.waiting)
        self.lock.release()

    def start(self, job: Job) -> Run:
        """Run ``job`` on a thread (after :meth:`enter`); the model is released when it ends."""
        run = Run(asyncio.get_running_loop(), asyncio.Queue(), threading.Event())

        def work():
            try:
                for step in generate(self.engine, job.ids, job.max_tokens, job.sampling, job.stats,
                                     stop_at_eos=not job.ignore_eos, stop=job.stop, logprobs=job.logprobs):
                    run.loop.call_soon_threadsafe(run.queue.put_nowait, step)
                    self.metrics.tokens.inc()
                    self.metrics.tokens_generated += 1
                    if run.cancelled.is_set():
                        break  # closes the generator: the client is gone
            except BaseException as e:  # handed to the request, which answers it
                run.loop.call_soon_threadsafe(run.queue.put_nowait, e)
            finally:
                self.metrics.last_decode_tok_s = job.stats.decode_tok_s or self.metrics.last_decode_tok_s
                run.loop.call_soon_threadsafe(run.queue.put_nowait, _END)
                run.loop.call_soon_threadsafe(self._leave)

        threading.Thread(target=work, name="moestream-generate", daemon=True).start()
        return run


class BatchRunner:
    """Runs :class:`Job`\\ s together: up to ``max_batch`` in the engine's
    :class:`~moestream.scheduler.Scheduler` (its own thread, ``moestream-generate``), at most
    ``max_queue`` more waiting (FIFO), more get 429.

    :meth:`submit` hands a job to the scheduler and returns its :class:`Run` at once (a job that waits
    is queued inside the scheduler); setting the run's ``cancelled`` (a disconnect, the answer done)
    cancels that sequence only.
    """

    def __init__(self, engine, max_batch: int, max_queue: int, metrics: Metrics):
        self.engine, self.max_batch, self.max_queue, self.metrics = engine, max_batch, max_queue, metrics
        plan = getattr(engine, "budget", None)  # the KV caches the budget plan counted: the running ones' bound
        kv_tokens = plan.context_tokens * plan.sequences if plan is not None and plan.context_tokens else None
        self.scheduler = Scheduler(engine, max_batch, kv_tokens=kv_tokens)
        self.scheduler.observer = metrics.observe_step
        # a burst of sequences freed KV caches, logits and activations in the scheduler thread's arena: give
        # them back to the system once it idles (glibc keeps them otherwise; 175 MB after 200 requests at once)
        self.scheduler.on_idle = release_freed_memory
        metrics.queue_depth.set_function(lambda: sum(self.scheduler.counts))
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return self.scheduler.counts[1]

    @property
    def running(self) -> int:
        return self.scheduler.counts[0]

    @property
    def busy(self) -> bool:
        return self.running > 0

    def submit(self, job: Job) -> Run:
        """Queue ``job`` in the scheduler (on the event loop's thread). Raises a 429 :class:`APIError` when
        ``max_batch`` run and ``max_queue`` wait already, a 400 for a request the engine refuses."""
        running, waiting = self.scheduler.counts
        if running + waiting >= self.max_batch + self.max_queue:
            raise APIError(
                429, f"the server is busy: {running} requests are running (--max-batch {self.max_batch}) and "
                f"{waiting} waiting (--max-queue {self.max_queue})",
                type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"},
            )
        if self._thread is None:
            self._thread = threading.Thread(target=self.scheduler.serve_forever, name="moestream-generate",
                                            daemon=True)
            self._thread.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        metrics = self.metrics

        def on_step(step: Step) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, step)
            metrics.tokens.inc()
            metrics.tokens_generated += 1

        def on_end(error: BaseException | None) -> None:
            metrics.last_decode_tok_s = job.stats.decode_tok_s or metrics.last_decode_tok_s
            if error is not None:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            loop.call_soon_threadsafe(queue.put_nowait, _END)

        request = SequenceRequest(job.ids, job.max_tokens, job.sampling, tuple(job.stop), job.logprobs,
                                  job.min_tokens, job.ignore_eos)
        try:
            seq = self.scheduler.submit(request, on_step, on_end)
        except InputError as e:
            raise APIError(400, str(e)) from None
        job.stats = seq.stats
        return Run(loop, queue, seq.cancelled)

    def close(self) -> None:
        """End every sequence and the scheduler's thread."""
        self.scheduler.close()


@dataclass
class Run:
    """A running job's steps, handed from its thread to the event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cancelled: threading.Event

    async def steps(self) -> AsyncIterator[Step]:
        """Each :class:`Step` as it is made. Leaving early (a disconnect) cancels the generation."""
        try:
            while True:
                item = await self.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled.set()


class Metrics:
    """Prometheus metrics, in a registry of the server's own."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.tokens = Counter("moestream_generated_tokens", "Tokens generated", registry=self.registry)
        self.requests = Counter("moestream_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.queue_depth = Gauge("moestream_queue_depth", "Requests waiting or running", registry=self.registry)
        self.batch_size = Histogram("moestream_batch_size", "Sequences in each forward pass of the scheduler",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=self.registry)
        self.step_tokens = Histogram("moestream_step_tokens", "Tokens in each forward pass of the scheduler",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=self.registry)
        self.runner = None  # the Runner or BatchRunner, set by the Service: running and waiting sequences
        self.last_decode_tok_s = 0.0
        self.tokens_generated = 0
        self.engine = engine
        self.registry.register(self)

    def collect(self):
        """Engine-wide figures, read at scrape time."""
        cache, store = self.engine.cache.stats, self.engine.store.stats
        yield GaugeMetricFamily("moestream_cache_hit_rate", "Expert cache hits / lookups since start",
                                value=cache.hits / cache.lookups if cache.lookups else 0.0)
        yield CounterMetricFamily("moestream_disk_read_bytes", "Bytes of experts read from disk",
                                  value=store.bytes_read)
        yield CounterMetricFamily("moestream_experts_read", "Experts read from disk", value=store.experts_read)
        yield GaugeMetricFamily("moestream_decode_tokens_per_second", "Decode speed of the last generation",
                                value=self.last_decode_tok_s)
        runner = self.runner
        if runner is not None:
            yield GaugeMetricFamily("moestream_running_sequences", "Sequences generating now",
                                    value=getattr(runner, "running", int(runner.busy)))
            yield GaugeMetricFamily("moestream_waiting_sequences", "Sequences waiting to start", value=runner.waiting)
        pc = getattr(self.engine, "prefix_cache", None)
        if pc is not None:
            yield CounterMetricFamily("moestream_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix "
                                      "cache instead of prefilled", value=pc.stats.hit_tokens)
            yield CounterMetricFamily("moestream_prefix_cache_lookup_tokens", "Prompt tokens looked up in the "
                                      "prefix cache", value=pc.stats.lookup_tokens)
            yield GaugeMetricFamily("moestream_prefix_cache_bytes", "Bytes of KV blocks the prefix cache holds",
                                    value=pc.used_bytes)

    def observe_step(self, sequences: int, tokens: int) -> None:
        """One scheduler step of ``sequences`` sequences and ``tokens`` tokens (called on its thread)."""
        self.batch_size.observe(sequences)
        self.step_tokens.observe(tokens)

    def snapshot(self, runner: Runner) -> dict:
        cache, store = self.engine.cache.stats, self.engine.store.stats
        return {
            "cache_hit_rate": cache.hits / cache.lookups if cache.lookups else 0.0,
            "gb_read": store.bytes_read / GB,
            "experts_read": store.experts_read,
            "decode_tok_s": self.last_decode_tok_s,
            "tokens_generated": self.tokens_generated,
            "queue_depth": runner.waiting + runner.busy,
            "busy": runner.busy,
        }


# ---- text handling: tool calls, logprobs ----

_TOOL_OPEN, _TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(re.escape(_TOOL_OPEN) + r"(.*?)" + re.escape(_TOOL_CLOSE), re.DOTALL)


class ToolCallStream:
    """Holds back answer text from the first ``<tool_call>`` on, and parses the blocks at the end.

    Qwen3's (and Hermes') format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
    """

    def __init__(self):
        self.held = ""
        self.holding = False

    def push(self, text: str) -> str:
        if self.holding:
            self.held += text
            return ""
        buf = self.held + text
        i = buf.find(_TOOL_OPEN)
        if i >= 0:
            self.holding, self.held = True, buf[i:]
            return buf[:i]
        keep = next((k for k in range(min(len(_TOOL_OPEN) - 1, len(buf)), 0, -1) if buf.endswith(_TOOL_OPEN[:k])), 0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str, list[dict]]:
        """(text left to show, OpenAI ``tool_calls``). Blocks that are not valid JSON stay text."""
        calls, rest, last = [], [], 0
        for m in _TOOL_BLOCK.finditer(self.held):
            try:
                obj = json.loads(m[1])
                name, args = obj["name"], obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                continue
            rest.append(self.held[last : m.start()])
            last = m.end()
            calls.append({
                "index": len(calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            })
        rest.append(self.held[last:])
        text = "".join(rest) if calls else self.held
        return (text.strip() if calls else text), calls


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprob(tokenizer, step: Step) -> dict:
    lp = step.logprob

    def entry(tok: int, value: float) -> dict:
        text = _token_text(tokenizer, tok)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {**entry(step.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


# ---- the app ----

@dataclass
class ServerOptions:
    """``moestream serve`` settings. ``max_context``: tokens (prompt + generated) per request."""

    model_name: str
    max_context: int
    max_queue: int = 16
    api_key: str | None = None
    # generations running together (--max-batch; None: the engine's EngineOptions.max_batch, which the budget
    # plan counted KV caches for)
    max_batch: int | None = None
    # hostile-client bounds (moestream.serverguard): request body bytes (--max-body-mb) and
    # prompt tokens (--max-prompt-tokens; None: the context less one token to generate)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then ``work`` is cancelled (a queued
    request leaves the queue, a running generation stops at its next token) and
    :class:`ClientGone` is raised. The request's body must have been read already."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if gone.done() and not gone.cancelled():
        gone.exception()  # retrieved: a receive that failed counts as gone
    if task.cancelled():
        raise ClientGone
    return task.result()


class _RunStream(StreamingResponse):
    """A streamed answer whose generation is cancelled whenever the response ends: finished,
    failed, or its client gone (before the first event too, when the body never starts)."""

    def __init__(self, run: Run, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancelled.set()


def _gone() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it; /metrics counts it


def route_template(router, scope) -> str:
    """The template of the route ``scope`` goes to (``/v1/models/{model_id}``), or ``unmatched``."""
    partial = None
    for route in router.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route.path_format
        if match is Match.PARTIAL and partial is None:  # the path, with another method
            partial = route.path_format
    return partial or "unmatched"


class Gate:
    """ASGI middleware for ``/v1``: the ``--api-key`` check (401 in OpenAI's shape) and the request
    count ``moestream_requests_total{endpoint, status}``, labelled by route template with one label
    for every path no route matches, so that neither random paths nor refused ones grow /metrics."""

    def __init__(self, app, router, metrics: Metrics, api_key: str | None = None):
        self.app, self.router, self.metrics, self.api_key = app, router, metrics, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        endpoint = route_template(self.router, scope)
        if self.api_key:
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            if not api_key_matches(auth, self.api_key):
                self.metrics.requests.labels(endpoint, "401").inc()
                refusal = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                   type="authentication_error", code="invalid_api_key")
                return await refusal.response()(scope, receive, send)
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()


class Service:
    """What the endpoints share and do: one engine's runner and metrics, its tokenizer (on a
    thread of its own), the prompt bounds and the sampling defaults."""

    def __init__(self, engine, options: ServerOptions):
        self.engine, self.options = engine, options
        self.metrics = Metrics(engine)
        if getattr(engine, "parallel", None) is not None:  # the ranks follow one generation at a time
            self.runner = Runner(engine, options.max_queue, self.metrics)
        else:
            batch = options.max_batch or getattr(getattr(engine, "options", None), "max_batch", 1) or 1
            self.runner = BatchRunner(engine, batch, options.max_queue, self.metrics)
        self.metrics.runner = self.runner
        self.tok = engine.tokenizer
        self.defaults = generation_defaults(engine.checkpoint.path)
        self.think_ids = think_token_ids(self.tok)
        self.end_of_turn = eos_ids(engine)
        # the longest prompt taken: --max-prompt-tokens, and at most the context less one token to generate
        most, given = options.max_context - 1, options.max_prompt_tokens
        if given is not None and given <= most:
            most, self.bound_text = given, f"this server takes prompts of at most {given} tokens (--max-prompt-tokens)"
        else:
            self.bound_text = f"this server's context is {options.max_context} tokens (--max-context)"
        self.limit = PromptLimit.for_tokenizer(self.tok, most) if self.tok is not None else None
        # one tokenization at a time, off the event loop, on one thread (one malloc arena)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moestream-tokenize")

    @asynccontextmanager
    async def lifespan(self, app):
        yield
        self.pool.shutdown(wait=False)
        if isinstance(self.runner, BatchRunner):
            self.runner.close()

    async def encode(self, param: str, text: object, fn: Callable[..., list[int]], *args) -> list[int]:
        """``fn(*args)`` (rendering and tokenizing ``text``, a prompt of up to --max-body-mb) on the
        tokenizer's thread, so that a long prompt does not stall the event loop that answers
        everyone else; its errors as 400s naming ``param``."""
        def work():
            try:  # JSON's "\\ud800" escapes decode to unpaired surrogates, which tokenizers reject
                size = len(json.dumps(text, ensure_ascii=False).encode("utf-8"))
            except UnicodeEncodeError as e:
                raise APIError(400, f"the text holds {e.object[e.start:e.end]!a}, an unpaired UTF-16 surrogate: "
                               "not valid Unicode", code="invalid_unicode") from None
            try:
                return fn(*args)
            finally:
                if size >= TRIM_AFTER_BYTES:  # the tokenizer's pieces of a long prompt, freed now
                    release_freed_memory()

        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, work)
        except PromptTooLongError as e:
            raise APIError(400, f"{e}; {self.bound_text}", param=param, code="context_length_exceeded") from None
        except TemplateVariableError as e:
            raise APIError(400, str(e), param=f"chat_template_kwargs.{e.key}", code="invalid_value") from None
        except InputError as e:
            raise APIError(400, str(e), param=param) from None

    def budget(self, req: _Sampling, prompt_len: int, requested: int | None) -> int:
        """Tokens to generate: ``requested``, or what the context leaves. Raises a 400 :class:`APIError`."""
        limit, context = self.options.max_prompt_tokens, self.options.max_context
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        if limit is not None and prompt_len > limit:
            raise APIError(
                400, f"the prompt is {prompt_len} tokens; this server takes prompts of at most {limit} tokens "
                "(--max-prompt-tokens)", param=param, code="context_length_exceeded",
            )
        room = context - prompt_len
        if room < 1:
            raise APIError(
                400, f"the prompt is {prompt_len} tokens; this server's context is {context} tokens "
                "(--max-context), which leaves no room to generate", param=param, code="context_length_exceeded",
            )
        if requested is not None and requested > room:
            raise APIError(
                400, f"max_tokens {requested} plus the prompt's {prompt_len} tokens exceed the context of "
                f"{context} tokens", param="max_tokens", code="context_length_exceeded",
            )
        return requested if requested is not None else room

    def sampling(self, req: _Sampling) -> SamplingParams:
        if req.n not in (None, 1):
            raise APIError(400, f"n = {req.n}: this server makes one choice per request (n=1)", param="n")
        given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
                                              "presence_penalty", "repetition_penalty")}
        try:
            return SamplingParams(**{**self.defaults, **{k: v for k, v in given.items() if v is not None}})
        except InputError as e:
            raise APIError(400, str(e)) from None

    @staticmethod
    def stops(req: _Sampling) -> list[str]:
        s = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(s) > 16:
            raise APIError(400, f"stop: at most 16 stop strings, got {len(s)}", param="stop")
        return [x for x in s if x]

    def job(self, req: _Sampling, ids: list[int], requested: int | None, logprobs: int | None) -> Job:
        """The :class:`Job` of a request: its token budget, sampling, stops, ``min_tokens`` and ``ignore_eos``
        checked (400s naming the field)."""
        max_tokens = self.budget(req, len(ids), requested)
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens {req.min_tokens} exceeds the {max_tokens} tokens this request may "
                           "generate (max_tokens, or what the context leaves)", param="min_tokens",
                           code="invalid_value")
        if req.min_tokens and isinstance(self.runner, Runner):
            raise APIError(400, "min_tokens is not supported under expert parallelism", param="min_tokens")
        return Job(ids, max_tokens, self.sampling(req), self.stops(req), logprobs, min_tokens=req.min_tokens,
                   ignore_eos=req.ignore_eos)

    async def answer(self, request: Request, job: Job, stream: bool, respond: Callable[[Run], Any]):
        """Queue ``job``, run it, and answer with ``respond(run)``: the events of a stream, or a
        coroutine giving the whole answer. A client that leaves, queued or running, ends the job."""
        if isinstance(self.runner, BatchRunner):
            run = self.runner.submit(job)  # 429 at once when full: no await between the count and the queueing
            if stream:
                return _RunStream(run, respond(run))
            try:
                return await unless_gone(request, respond(run))
            except ClientGone:
                return _gone()
            finally:
                run.cancelled.set()  # answered, failed or gone: the sequence leaves at the next step
        if stream:
            try:
                await unless_gone(request, self.runner.enter())
            except ClientGone:
                return _gone()
            run = self.runner.start(job)
            return _RunStream(run, respond(run))

        async def queued_then_run():
            await self.runner.enter()
            run = self.runner.start(job)
            try:
                return await respond(run)
            finally:
                run.cancelled.set()  # answered, failed or cancelled: the thread stops at its next token

        try:
            return await unless_gone(request, queued_then_run())
        except ClientGone:
            return _gone()

    async def chat(self, req: ChatRequest, request: Request):
        messages = [_message_dict(m) for m in req.messages]
        ids = await self.encode("messages", [messages, req.tools, req.chat_template_kwargs], chat_ids, self.tok,
                                messages, req.tools, req.chat_template_kwargs, self.limit)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self.job(req, ids, requested, (req.top_logprobs or 0) if req.logprobs else None)
        thinking = prompt_opens_thinking(ids, self.think_ids, self.end_of_turn)
        split, tools = self.think_ids[1] is not None, bool(req.tools)
        meta = _Meta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.options.model_name)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self.answer(request, job, True,
                                     lambda run: _chat_events(run, job, meta, self.tok, thinking, split, tools, usage))
        return await self.answer(request, job, False,
                                 lambda run: _chat_whole(run, job, meta, self.tok, thinking, split, tools))

    async def completion(self, req: CompletionRequest, request: Request):
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self.encode("prompt", prompt, encode_text, self.tok, prompt, self.limit)
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt: empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.engine.model.vocab_size]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary", param="prompt")
        job = self.job(req, ids, req.max_tokens, req.logprobs)
        meta = _Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.options.model_name)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self.answer(request, job, True, lambda run: _completion_events(run, job, meta, self.tok,
                                                                                           usage))
        return await self.answer(request, job, False, lambda run: _completion_whole(run, job, meta, self.tok))

    def model_card(self) -> dict:
        return {"id": self.options.model_name, "object": "model", "created": 0, "owned_by": "moestream",
                "max_context": self.options.max_context}


def create_app(engine, options: ServerOptions) -> FastAPI:
    """The FastAPI app serving ``engine`` (a loaded :class:`~moestream.engine.Engine` with its tokenizer)."""
    service = Service(engine, options)
    app = FastAPI(title="moestream", docs_url=None, redoc_url=None, lifespan=service.lifespan)
    app.state.runner, app.state.metrics = service.runner, service.metrics
    # outermost last: the key and the count, then the body bound, then the net for any exception
    app.add_middleware(ServerErrors)
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    app.add_middleware(Gate, router=app.router, metrics=service.metrics, api_key=options.api_key)
    _add_error_handlers(app)
    _add_routes(app, service)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(MoestreamError)
    async def _engine_error(request: Request, e: MoestreamError):
        # bad input found by the engine is the client's; anything else (a failed expert read,
        # naming the expert and file) is the server's, answered in OpenAI's shape
        if isinstance(e, InputError):
            return APIError(400, str(e)).response()
        return APIError(500, str(e), type="server_error", code=_error_code(e)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                            code="invalid_json").response()
        param = ".".join(loc) or None
        return APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param,
                        code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()


def _add_routes(app: FastAPI, service: Service) -> None:
    runner, metrics, name = service.runner, service.metrics, service.options.model_name

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "busy": runner.busy, "waiting": runner.waiting,
                "running": getattr(runner, "running", int(runner.busy))}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats():
        return metrics.snapshot(runner)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("moestream").joinpath("data/chat.html").read_text()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(404, f"the model {model_id[:200]!r} does not exist: this server serves {name!r}",
                           param="model", code="model_not_found")
        return service.model_card()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await service.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await service.completion(req, request)


@dataclass
class _Meta:
    id: str
    created: int
    model: str


def _message_dict(m: Message) -> dict:
    """A request message as the chat template takes it (text parts joined, tool-call arguments as objects)."""
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    content = m.content
    if isinstance(content, list):
        content = "".join(p.text for p in content)
    d["content"] = content or ""  # chat templates (Qwen3's) fail on a null content
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        d["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            args = c.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    raise APIError(400, f"tool call {c.function.name!r}: arguments are not JSON",
                                   param="messages") from None
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        d["tool_calls"] = calls
    return d


def _error_code(e: MoestreamError) -> str:
    """``read_error`` for a failed expert read, else the error class's name in snake case."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).lower()


def _error_event(e: Exception) -> dict:
    """The error event that ends a stream: a MoestreamError by its class (``read_error``), anything
    else as ``internal_error`` (logged with its traceback)."""
    if isinstance(e, MoestreamError):
        kind = "invalid_request_error" if isinstance(e, InputError) else "server_error"
        return {"error": {"message": str(e), "type": kind, "param": None, "code": _error_code(e)}}
    log.error("moestream: internal error in a stream", exc_info=e)
    return {"error": {"message": internal_error_message(e), "type": "server_error", "param": None,
                      "code": "internal_error"}}


def _usage(job: Job, completion: int) -> dict:
    return {"prompt_tokens": len(job.ids), "completion_tokens": completion, "total_tokens": len(job.ids) + completion,
            "prompt_tokens_details": {"cached_tokens": job.stats.prompt_cached_tokens}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _chat_whole(run: Run, job: Job, meta: _Meta, tok, thinking: bool, split: bool, tools: bool) -> dict:
    splitter = ReasoningSplitter(start_in_reasoning=thinking) if split else None
    reasoning, answer, logprobs, count, finish = [], [], [], 0, "length"
    async for step in run.steps():
        count += 1
        if step.logprob is not None:
            logprobs.append(_chat_logprob(tok, step))
        if splitter is not None:
            r, a = splitter.push(step.text)
            reasoning.append(r)
            answer.append(a)
        else:
            answer.append(step.text)
        finish = step.finish_reason or finish
    if splitter is not None:
        r, a = splitter.flush()
        reasoning.append(r)
        answer.append(a)
    content, calls = "".join(answer), []
    if tools:
        stream = ToolCallStream()
        content = stream.push(content)
        rest, calls = stream.finish()
        content += rest
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        finish = "tool_calls"
    return {
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": {"content": logprobs} if job.logprobs is not None else None}],
        "usage": _usage(job, count),
    }


async def _chat_events(run: Run, job: Job, meta: _Meta, tok, thinking: bool, split: bool, tools: bool,
                       include_usage: bool) -> AsyncIterator[str]:
    base = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model}

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": {"content": logprobs} if logprobs is not None else None}
        return _sse({**base, "choices": [choice]})

    splitter = ReasoningSplitter(start_in_reasoning=thinking) if split else None
    calls_stream = ToolCallStream() if tools else None
    count, finish = 0, "length"
    yield chunk({"role": "assistant", "content": ""})
    try:
        async for step in run.steps():
            count += 1
            finish = step.finish_reason or finish
            r, a = splitter.push(step.text) if splitter is not None else ("", step.text)
            if calls_stream is not None:
                a = calls_stream.push(a)
            lp = [_chat_logprob(tok, step)] if step.logprob is not None else None
            delta = {}
            if r:
                delta["reasoning_content"] = r
            if a:
                delta["content"] = a
            if delta or lp:
                yield chunk(delta, logprobs=lp)
        r, a = splitter.flush() if splitter is not None else ("", "")
        if calls_stream is not None:
            a = calls_stream.push(a)
            rest, calls = calls_stream.finish()
            a += rest
        else:
            calls = []
        delta = {k: v for k, v in (("reasoning_content", r), ("content", a)) if v}
        if delta:
            yield chunk(delta)
        if calls:
            yield chunk({"tool_calls": calls})
            finish = "tool_calls"
        yield chunk({}, finish)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(job, count)})
    except Exception as e:  # a failed read, or anything, mid-stream: tell the client in the stream
        yield _sse(_error_event(e))
    yield "data: [DONE]\n\n"


def _completion_logprobs(tok, steps: list[Step], offset0: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = offset0
    for s in steps:
        text = _token_text(tok, s.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(s.logprob.logprob)
        out["top_logprobs"].append({_token_text(tok, t): v for t, v in s.logprob.top})
        out["text_offset"].append(offset)
        offset += len(s.text)
    return out


async def _completion_whole(run: Run, job: Job, meta: _Meta, tok) -> dict:
    steps = [s async for s in run.steps()]
    finish = steps[-1].finish_reason if steps and steps[-1].finish_reason else "length"
    return {
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "text": "".join(s.text for s in steps), "finish_reason": finish,
                     "logprobs": _completion_logprobs(tok, steps) if job.logprobs is not None else None}],
        "usage": _usage(job, len(steps)),
    }


async def _completion_events(run: Run, job: Job, meta: _Meta, tok, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model}
    count, finish, offset = 0, "length", 0
    try:
        async for step in run.steps():
            count += 1
            finish = step.finish_reason or finish
            lp = _completion_logprobs(tok, [step], offset) if job.logprobs is not None else None
            offset += len(step.text)
            if step.text or lp:
                choice = {"index": 0, "text": step.text, "finish_reason": None, "logprobs": lp}
                yield _sse({**base, "choices": [choice]})
        yield _sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}]})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(job, count)})
    except Exception as e:
        yield _sse(_error_event(e))
    yield "data: [DONE]\n\n"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: connections are refused until the
    server starts), as uvicorn binds one, so that ``serve`` can say at once, before loading a model
    for minutes, that the address is taken or wrong.

    Raises:
        MoestreamError: an unknown host, an address in use or not of this machine, a port not allowed.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror):
            raise MoestreamError(f"--host {host}: not an address or a known host name ({e.strerror})") from None
        if e.errno == errno.EADDRINUSE:
            raise MoestreamError(f"--host {host} --port {port}: {host}:{port} is already in use "
                                 "(another server is listening there)") from None
        raise MoestreamError(f"--host {host} --port {port}: cannot listen there: {e.strerror}") from None
    return sock


def serve(engine, options: ServerOptions, host: str = "127.0.0.1", port: int = 8080,
          sock: socket.socket | None = None) -> None:
    """Serve ``engine`` until interrupted (uvicorn, one worker), on ``sock`` (from :func:`bind`) or
    on a socket bound to ``host:port`` now."""
    import uvicorn

    sock = sock if sock is not None else bind(host, port)
    config = uvicorn.Config(create_app(engine, options), host=host, port=port, log_level="info")
    uvicorn.Server(config).run(sockets=[sock])
