"""The shapes of the front door's OpenAI-compatible answers: whole responses, stream chunks
and usage (OpenAI's API reference: https://platform.openai.com/docs/api-reference/completions/object,
.../chat/object and .../chat-streaming). Completions are ``text_completion`` objects with
``cmpl-`` ids; chat answers ``chat.completion`` (whole) and ``chat.completion.chunk``
(streamed) with ``chatcmpl-`` ids. A stream carries usage only when the client asked
(``stream_options.include_usage``): then a last chunk with empty ``choices`` and the usage,
as OpenAI sends it."""
from __future__ import annotations

from typing import Any, Sequence

from scheduler.openai_api import GenerationRequest


def request_id(chat: bool, hex_id: str) -> str:
    """``chatcmpl-<hex>`` for chat, ``cmpl-<hex>`` for completions (OpenAI's id prefixes)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{hex_id}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(req: GenerationRequest, id_: str, created: int, model: str, text: str,
                  token_ids: Sequence[int], finish_reason: str | None,
                  usage_: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) answer, completion or chat shape."""
    choice: dict[str, Any]
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, "token_ids": list(token_ids)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
        obj = "text_completion"
    return {"id": id_, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_}


def chunk_body(req: GenerationRequest, id_: str, created: int, model: str, text: str,
               token_ids: Sequence[int], finish_reason: str | None = None,
               first: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed answer (``first``: the chat delta names the role)."""
    choice: dict[str, Any]
    if req.chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
    return {"id": id_, "object": _chunk_object(req), "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, id_: str, created: int, model: str,
                usage_: dict[str, Any]) -> dict[str, Any]:
    """The last event of a stream whose client asked for usage: no choices, the usage."""
    return {"id": id_, "object": _chunk_object(req), "created": created, "model": model, "choices": [],
            "usage": usage_}


def _chunk_object(req: GenerationRequest) -> str:
    return "chat.completion.chunk" if req.chat else "text_completion"
