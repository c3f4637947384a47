"""Defences of ``moestream serve`` against hostile clients: a bounded request body, a
constant-time API key check, memory given back after large requests, and no exception
answered outside OpenAI's error shape.

The server parses a request body only after :class:`BodyLimit` has received all of it
and found it within ``--max-body-mb``: a longer body is answered 413 in OpenAI's error
shape without being kept, whether it announces its length (``Content-Length``) or
streams it (chunked). Invalid JSON, invalid UTF-8 and nesting past Python's recursion
limit are refused by the request parser as 400s (``moestream.server``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hmac
import json
import logging

# Default --max-body-mb: a 262,144-token prompt is about 1 MB of text; tools and JSON
# escaping leave room to spare.
DEFAULT_MAX_BODY_BYTES = 4 * 1000 * 1000
# A refused body is read and dropped up to this many bytes before the 413 (then the
# connection is closed): enough for a client to finish an upload of tens of MB.
DRAIN_BYTES = 64 * 1000 * 1000
# After a request whose body is at least this long, freed memory goes back to the system
# (release_freed_memory): tokenizing a 1 MB prompt leaves ~100 MB of freed heap behind.
TRIM_AFTER_BYTES = 64 * 1000

log = logging.getLogger("moestream.server")


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>``: the scheme in any case
    (RFC 7235: auth schemes are case-insensitive), one or more spaces, then the key, compared in
    constant time (:func:`hmac.compare_digest`), so the time taken does not tell how many
    leading characters of a guess were right."""
    scheme, _, credentials = authorization.partition(" ")
    given = credentials.lstrip(" ").encode("utf-8", "surrogateescape")
    match = hmac.compare_digest(given, api_key.encode("utf-8", "surrogateescape"))
    return match and scheme.lower() == "bearer"


def _error_body(status: int, message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``, every arena).

    glibc keeps memory freed by a thread in that thread's arena for reuse, so a server that
    tokenized a few MB of prompt (the tokenizer's byte-level pieces, offsets and ids, then the
    rendered text) stays that much larger afterwards: measured on Qwen3's tokenizer, a 3 MB
    prompt left 200 MB of RSS, 12 of them through the server 0.5 GB. A trim takes ~10-80 ms
    after such a request and ~0.05 ms when there is nothing to give back. No-op elsewhere.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class BodyLimit:
    """ASGI middleware: receive each HTTP request's body whole, at most ``limit`` bytes, before
    the app sees it; a longer one gets 413 (``code: request_too_large``) and is dropped.

    After the body, the app's further ``receive`` calls go to the client connection, so a
    streaming response still learns of a disconnect. After a request of at least
    :data:`TRIM_AFTER_BYTES`, the memory its handling freed goes back to the system
    (:func:`release_freed_memory`, on a worker thread, once the answer is sent).
    """

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await self._refuse(send, 400, f"Content-Length {declared[:40]!r} is not a number",
                                          "invalid_content_length")
            if n > self.limit:
                await self._drain(receive)
                return await self._too_large(send, n)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            body = message.get("body", b"")
            total += len(body)
            if total > self.limit:
                chunks.clear()
                if message.get("more_body", False):
                    await self._drain(receive)
                return await self._too_large(send, total)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks.clear()
        sent = False

        async def receive_again():
            nonlocal sent
            if not sent:
                sent = True
                return replay
            return await receive()

        try:
            return await self.app(scope, receive_again, send)
        finally:
            if total >= TRIM_AFTER_BYTES:
                replay["body"] = b""  # this middleware's reference to the body, before the trim
                await asyncio.to_thread(release_freed_memory)

    async def _drain(self, receive) -> None:
        """Read and drop the rest of a refused body (up to :data:`DRAIN_BYTES`), so the client,
        still sending, reads the 413 instead of a reset connection."""
        dropped = 0
        while dropped < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _too_large(self, send, n: int) -> None:
        await self._refuse(send, 413, f"the request body is over {self.limit} bytes ({n} or more received); "
                                      "this server's limit is --max-body-mb", "request_too_large")

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        body = _error_body(status, message, code)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body})


class ServerErrors:
    """ASGI middleware: an exception that escapes the app before its answer started is answered
    as HTTP 500 in OpenAI's shape (``type: server_error``, ``code: internal_error``, the
    exception's class and message) and logged with its traceback, instead of a plain-text 500
    and a closed connection. (A stream that has started answers its own errors in the stream.)
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as e:
            if started:
                raise
            log.exception("moestream: internal error answering %s %s", scope.get("method"), scope.get("path"))
            body = _error_body(500, internal_error_message(e), "internal_error", type="server_error")
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def internal_error_message(e: BaseException) -> str:
    """What a client is told of an unexpected exception: its class and message (no traceback)."""
    return f"internal error ({type(e).__name__}): {e}"
