"""Generated text as it streams: incremental detokenization (:class:`TextStream`) and
OpenAI's ``stop`` strings (:class:`StopText`), for both the whole and the streamed answers
of the front door."""
from __future__ import annotations

from typing import Sequence

from engines.tokenizer import ByteTokenizer, Tokenizer

MAX_HELD_TOKENS = 3    # a UTF-8 character has at most 4 bytes: 3 tokens may end inside one


class TextStream:
    """Incremental detokenization: :meth:`push` returns the text each new token adds, as soon
    as it is known, so a stream's first chunk carries the first token's text. With the
    byte-level tokenizer, only the first bytes of a character not yet complete wait
    (:class:`engines.tokenizer.ByteStream`). With a checkpoint's tokenizer the whole
    sequence is decoded again and the new text sent, except a trailing run of U+FFFD (the
    tokens so far end inside a character, which the next ones may complete), held for at
    most :data:`MAX_HELD_TOKENS` tokens and then sent as it is. :meth:`flush` returns
    what is still held at the end; the pieces joined equal the tokenizer's decode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._bytes = tokenizer.stream() if isinstance(tokenizer, ByteTokenizer) else None
        self._ids: list[int] = []
        self._sent = 0
        self._held = 0

    def push(self, token_id: int) -> str:
        if self._bytes is not None:
            return self._bytes.push(token_id)
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        whole = text.rstrip("\ufffd")
        if len(whole) < len(text) and self._held < MAX_HELD_TOKENS:
            self._held += 1
            return self._take(whole)
        self._held = 0
        return self._take(text)

    def flush(self) -> str:
        if self._bytes is not None:
            return self._bytes.flush()
        return self._take(self._tok.decode(self._ids))

    def _take(self, text: str) -> str:
        delta, self._sent = text[self._sent:], max(self._sent, len(text))
        return delta


class StopText:
    """Cuts generated text at the first of ``stops`` (OpenAI's ``stop``). :meth:`push` takes
    each new piece of text and returns what may be sent now: everything before a stop string
    once one appeared (then :attr:`hit` is true and nothing more is returned), else all but
    the last ``max(len(stop)) - 1`` characters, held back because a stop string may begin
    there. :meth:`flush` returns what is held back at the end (nothing after a hit)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        text = self._pending + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self._pending = True, ""
            return text[:min(found)]
        keep = max(0, len(text) - self._hold)
        out, self._pending = text[:keep], text[keep:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.hit else self._pending), ""
        return out
