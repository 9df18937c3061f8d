"""Generated text as it streams: incremental detokenization (:class:`TextStream`) and
OpenAI's ``stop`` strings (:class:`StopText`), for both the whole and the streamed answers
of the front door."""
from __future__ import annotations

from collections.abc import Sequence

from engines.tokenizer import ByteTokenizer, Tokenizer


class TextStream:
    """Incremental detokenization: :meth:`push` returns the text each new token adds, as soon
    as it is known, so a stream's first chunk carries the first token's text. With the
    byte-level tokenizer, only the first bytes of a character not yet complete wait
    (:class:`engines.tokenizer.ByteStream`). With a checkpoint's tokenizer the whole
    sequence is decoded again and the new text sent, except a trailing run of U+FFFD (the
    tokens so far may end inside a character, which the next ones complete): what precedes
    it is sent, the run waits for a token that decodes to something else, or for
    :meth:`flush` at the end. The pieces joined equal the tokenizer's decode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._bytes = tokenizer.stream() if isinstance(tokenizer, ByteTokenizer) else None
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token_id: int) -> str:
        if self._bytes is not None:
            return self._bytes.push(token_id)
        self._ids.append(token_id)
        return self._take(self._tok.decode(self._ids).rstrip("\ufffd"))

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
