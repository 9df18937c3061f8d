"""Tokenizers: a byte-level one for the tiny model, or the checkpoint's own."""
from __future__ import annotations

from typing import Protocol, Sequence

from kvstore.errors import InvalidArgument


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 3; 0 = pad, 1 = bos, 2 = eos. Ids at or above 259
    (possible from a random model) decode to nothing."""

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
        raw = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return raw.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """A simple template for the tiny model: ``<role>: <content>\\n`` per message, then
        ``assistant: ``."""
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class HFTokenizer:
    """The tokenizer of a local Hugging Face checkpoint (``AutoTokenizer``)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id if self._tok.eos_token_id is not None else 0

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        if getattr(self._tok, "chat_template", None):
            return self._tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return ByteTokenizer.apply_chat_template(self, messages)  # type: ignore[arg-type]


def load_tokenizer(model_dir: str | None, vocab_size: int = 512) -> Tokenizer:
    """The checkpoint's tokenizer for ``model_dir``, else the byte-level one."""
    return HFTokenizer(model_dir) if model_dir else ByteTokenizer(vocab_size)
