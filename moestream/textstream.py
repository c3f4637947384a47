"""Streamed text: stop strings caught across token boundaries, and reasoning split from the answer.

Both work on the text pieces a generation yields (see :func:`moestream.generation.generate`),
holding back the few characters that could still turn out to be the start of a stop
string or a tag, so that nothing that must be cut is ever emitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


def _partial_suffix(text: str, needle: str) -> int:
    """Length of the longest proper prefix of ``needle`` that ``text`` ends with."""
    for k in range(min(len(needle) - 1, len(text)), 0, -1):
        if text.endswith(needle[:k]):
            return k
    return 0


class StopStrings:
    """Ends a text stream before the first stop string, which is never emitted.

    ``push(piece)`` returns ``(text, stopped)``: the text that is now safe to show, and
    whether a stop string was found (``text`` then ends just before it and the stream is
    over). Text that could be the beginning of a stop string split across pieces is held
    back until the next piece settles it; :meth:`flush` returns what is held at the end.
    Matching is on characters, as OpenAI's and vLLM's ``stop``.
    """

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.stopped = False

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        buf = self._buf + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._buf, self.stopped = "", True
            return buf[: min(hits)], True
        hold = max(_partial_suffix(buf, s) for s in self.stops)
        self._buf = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text at the end of the stream (it turned out not to be a stop string)."""
        out, self._buf = self._buf, ""
        return "" if self.stopped else out


class Split(NamedTuple):
    """Text of one streamed piece, separated: ``reasoning`` (inside the thinking block) and ``answer``."""

    reasoning: str
    answer: str


class ReasoningSplitter:
    """Separates the thinking block of a reasoning model (``<think>`` ... ``</think>``) from its answer, streaming.

    ``push(piece)`` returns a :class:`Split` of the text that became final; the tags
    themselves are dropped. ``start_in_reasoning`` is for chat templates whose generation
    prompt already opens the block (the model's output then starts inside it; see
    :func:`moestream.tokenizer.prompt_opens_thinking`). Each tag toggles the state, so a
    model that thinks again after answering (``--multi-think``) is split right too.
    With ``strip`` (default) newlines at the start and end of each block and of the answer
    are dropped, as the Qwen3 chat template does when it re-renders a past turn.
    Tags split across pieces are caught (held back until settled). Same contract as
    vLLM's ``reasoning_content`` / ``content`` split (DeepSeek-R1 and Qwen3 parsers).
    """

    def __init__(self, start_in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>",
                 strip: bool = True):
        self.reasoning = start_in_reasoning
        self.open_tag, self.close_tag, self.strip = open_tag, close_tag, strip
        self._buf = ""
        self._at_start = True  # at the start of a block or of the answer (leading newlines dropped)
        self.saw_close = False  # a close tag has been seen (the thinking block ended)

    def _emit(self, text: str, out: tuple[list, list], end: bool) -> None:
        if self.strip:
            if self._at_start:
                text = text.lstrip("\n")
            if end:
                text = text.rstrip("\n")
        if text:
            self._at_start = False
            out[0 if self.reasoning else 1].append(text)

    def push(self, piece: str) -> Split:
        out: tuple[list, list] = ([], [])
        self._buf += piece
        while True:
            tag = self.close_tag if self.reasoning else self.open_tag
            i = self._buf.find(tag)
            if i < 0:
                break
            self._emit(self._buf[:i], out, end=True)
            self._buf = self._buf[i + len(tag) :]
            self.saw_close = self.saw_close or self.reasoning
            self.reasoning = not self.reasoning
            self._at_start = True
        hold = _partial_suffix(self._buf, tag)
        body = self._buf[: len(self._buf) - hold]
        if self.strip:
            body = body.rstrip("\n")  # trailing newlines wait: they are dropped if a tag follows
        self._emit(body, out, end=False)
        self._buf = self._buf[len(body) :]
        return Split("".join(out[0]), "".join(out[1]))

    def flush(self) -> Split:
        """What is held back at the end of the stream."""
        out: tuple[list, list] = ([], [])
        self._emit(self._buf, out, end=True)
        self._buf = ""
        return Split("".join(out[0]), "".join(out[1]))
