"""Defences of ``moestream serve`` against hostile clients: a bounded request body and a
constant-time API key check.

The server parses a request body only after :class:`BodyLimit` has received all of it
and found it within ``--max-body-mb``: a longer body is answered 413 in OpenAI's error
shape without being kept, whether it announces its length (``Content-Length``) or
streams it (chunked). Invalid JSON, invalid UTF-8 and nesting past Python's recursion
limit are refused by the request parser as 400s (``moestream.server``).
"""

from __future__ import annotations

import hmac
import json

# Default --max-body-mb: a 262,144-token prompt is about 1 MB of text; tools and JSON
# escaping leave room to spare.
DEFAULT_MAX_BODY_BYTES = 4 * 1000 * 1000
# A refused body is read and dropped up to this many bytes before the 413 (then the
# connection is closed): enough for a client to finish an upload of tens of MB.
DRAIN_BYTES = 64 * 1000 * 1000


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>``, compared in
    constant time (:func:`hmac.compare_digest`), so the time taken does not tell how many
    leading characters of a guess were right."""
    given = authorization.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {api_key}".encode("utf-8", "surrogateescape"))


def _error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class BodyLimit:
    """ASGI middleware: receive each HTTP request's body whole, at most ``limit`` bytes, before
    the app sees it; a longer one gets 413 (``code: request_too_large``) and is dropped.

    After the body, the app's further ``receive`` calls go to the client connection, so a
    streaming response still learns of a disconnect.
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

        return await self.app(scope, receive_again, send)

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
