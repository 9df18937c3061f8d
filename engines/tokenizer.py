"""Tokenizers: a byte-level one for the tiny model, or the checkpoint's own."""
from __future__ import annotations

import codecs
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore.errors import InvalidArgument


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 3; 0 = pad, 1 = bos, 2 = eos (special: no text).
    Ids at or above 259 stand for no byte (the tiny model's vocabulary is 512, so a random
    model emits them about half the time): each decodes to U+FFFD, the replacement
    character, as a byte that is not valid UTF-8 does — never to nothing, so every token a
    stream carries shows as text."""

    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3

    def __init__(self, vocab_size: int = 512) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS

    def encode(self, text: str) -> list[int]:
        """Raises InvalidArgument for text that is not valid Unicode (a lone surrogate)."""
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"the text is not valid Unicode: {exc.reason} at position {exc.start}") from None
        return [b + self.OFFSET for b in raw]

    def decode(self, ids: Sequence[int]) -> str:
        stream = self.stream()
        return "".join(stream.push(i) for i in ids) + stream.flush()

    def stream(self) -> ByteStream:
        """An incremental decoder: the text of one token at a time (see :class:`ByteStream`)."""
        return ByteStream(self.OFFSET)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """A simple template for the tiny model: ``<role>: <content>\\n`` per message, then
        ``assistant: ``."""
        return plain_chat_template(messages)


class ByteStream:
    """Incremental decoding for :class:`ByteTokenizer`: :meth:`push` returns the text one
    more token completes. Only the first bytes of a multi-byte character not yet complete
    (at most 3) are held back; a byte that cannot be part of one is U+FFFD at once (UTF-8
    decoding with replacement, Unicode §3.9 "U+FFFD Substitution of Maximal Subparts").
    The pieces joined, then :meth:`flush`, equal ``ByteTokenizer.decode`` of the ids."""

    def __init__(self, offset: int) -> None:
        self._offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._offset <= token_id < 256 + self._offset:
            return str(self._utf8.decode(bytes((token_id - self._offset,))))
        if token_id < self._offset:        # pad, bos, eos: no text
            return ""
        return self.flush() + "\ufffd"     # a token that stands for no byte

    def flush(self) -> str:
        """What is held back (an incomplete character: U+FFFD), and start afresh."""
        return str(self._utf8.decode(b"", final=True))


class HFTokenizer:
    """The tokenizer of a local Hugging Face checkpoint (``AutoTokenizer``)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        from engines.model import check_checkpoint_dir
        check_checkpoint_dir(model_dir)
        self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # The served context length is checked where it is known (the front door: 400 past
        # --max-model-len); the checkpoint's own figure would only log a warning, and a wrong
        # one, for every prompt longer than it.
        self._tok.model_max_length = sys.maxsize
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id if self._tok.eos_token_id is not None else 0

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` of a fast tokenizer (what vLLM detokenizes with), or None."""
        return getattr(self._tok, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        assert isinstance(text, str)   # one sequence of ids decodes to one string
        return text

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The checkpoint's chat template, or :func:`plain_chat_template` where it has none."""
        if getattr(self._tok, "chat_template", None):
            text = self._tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            assert isinstance(text, str)   # tokenize=False: the prompt as text
            return text
        return plain_chat_template(messages)


def plain_chat_template(messages: Sequence[dict[str, str]]) -> str:
    """``<role>: <content>\\n`` per message, then ``assistant: `` (the tiny model's template)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def load_tokenizer(model_dir: str | None, vocab_size: int = 512) -> Tokenizer:
    """The checkpoint's tokenizer for ``model_dir``, else the byte-level one."""
    return HFTokenizer(model_dir) if model_dir else ByteTokenizer(vocab_size)
