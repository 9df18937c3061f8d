"""The shapes of the front door's OpenAI-compatible answers: whole responses, stream chunks
and usage (OpenAI's API reference: https://platform.openai.com/docs/api-reference/completions/object,
.../chat/object and .../chat-streaming). Completions are ``text_completion`` objects with
``cmpl-`` ids; chat answers ``chat.completion`` (whole) and ``chat.completion.chunk``
(streamed) with ``chatcmpl-`` ids. A stream carries usage only when the client asked
(``stream_options.include_usage``): then a last chunk with empty ``choices`` and the usage,
as OpenAI sends it. ``logprobs`` (when asked): completions carry OpenAI's legacy object
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), chat its ``content``
list (``token``, ``logprob``, ``bytes``, ``top_logprobs``) — built by :class:`LogprobsShape`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.tokenizer import ByteTokenizer, Tokenizer
from engines.types import TokenLogprobs
from scheduler.frontdoor.openai_api import GenerationRequest


class LogprobsShape:
    """The ``logprobs`` object of one choice, for the whole answer or chunk by chunk
    (:meth:`of` takes the next tokens with their :class:`TokenLogprobs`; completions'
    ``text_offset`` runs on across calls). A token's text is the tokenizer's decode of it
    alone (a byte that is part of a character: U+FFFD; its ``bytes`` say which byte)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self._tok, self._chat = tokenizer, chat
        self._offset = 0

    def _text(self, token: int) -> str:
        return self._tok.decode([token])

    def _bytes(self, token: int) -> list[int]:
        if isinstance(self._tok, ByteTokenizer) and ByteTokenizer.OFFSET <= token < 256 + ByteTokenizer.OFFSET:
            return [token - ByteTokenizer.OFFSET]
        return list(self._text(token).encode("utf-8"))

    def of(self, tokens: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        if self._chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in tokens]}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in tokens:
            text = self._text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            # text -> logprob, the chosen token first, then the alternatives, most likely first; a
            # text two tokens share (U+FFFD: bytes of no whole character) keeps the first
            top: dict[str, float] = {}
            for i, v in ((token, lp.logprob), *lp.top) if lp is not None else ():
                top.setdefault(self._text(i), v)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def _chat_entry(self, token: int, lp: TokenLogprobs | None) -> dict[str, Any]:
        top = [] if lp is None else [{"token": self._text(i), "logprob": v, "bytes": self._bytes(i)} for i, v in lp.top]
        return {"token": self._text(token), "logprob": None if lp is None else lp.logprob,
                "bytes": self._bytes(token), "top_logprobs": top}


def request_id(chat: bool, hex_id: str) -> str:
    """``chatcmpl-<hex>`` for chat, ``cmpl-<hex>`` for completions (OpenAI's id prefixes)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{hex_id}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(req: GenerationRequest, id_: str, created: int, model: str, text: str,
                  token_ids: Sequence[int], finish_reason: str | None,
                  usage_: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole (non-streamed) answer, completion or chat shape."""
    choice: dict[str, Any]
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason, "token_ids": list(token_ids)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
        obj = "text_completion"
    return {"id": id_, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_}


def chunk_body(req: GenerationRequest, id_: str, created: int, model: str, text: str,
               token_ids: Sequence[int], finish_reason: str | None = None,
               first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One server-sent event of a streamed answer (``first``: the chat delta names the role)."""
    choice: dict[str, Any]
    if req.chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
    return {"id": id_, "object": _chunk_object(req), "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, id_: str, created: int, model: str,
                usage_: dict[str, Any]) -> dict[str, Any]:
    """The last event of a stream whose client asked for usage: no choices, the usage."""
    return {"id": id_, "object": _chunk_object(req), "created": created, "model": model, "choices": [],
            "usage": usage_}


def _chunk_object(req: GenerationRequest) -> str:
    return "chat.completion.chunk" if req.chat else "text_completion"
