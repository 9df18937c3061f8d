"""The OpenAI-compatible wire format of the front door: request validation and the shapes of
responses, stream chunks and errors (``/v1/completions``, ``/v1/chat/completions``).

``stop`` (a string or a list of up to :data:`MAX_STOP_STRINGS`) is honoured: generation ends
when the decoded text contains one, the text is cut before it and ``finish_reason`` is
``"stop"`` (:class:`StopText`).

Extensions to OpenAI's shapes: ``choices[0].token_ids`` (generated ids, also one per stream
chunk), ``ignore_eos`` in the request (generate exactly ``max_tokens``) and
``usage.prompt_tokens_details.cached_tokens`` (prompt tokens loaded from a cache).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from engines.tokenizer import Tokenizer
from kvstore.errors import InvalidArgument

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4          # as OpenAI's API
MAX_STOP_CHARS = 256          # per stop string


class APIError(Exception):
    """An error answered to the HTTP client: ``status`` (HTTP), ``message`` (says what is
    wrong), ``type`` and ``code`` (OpenAI's error fields)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request is checked against: ``vocab_size`` (ids in ``[0, vocab_size)``) and
    ``max_model_len`` (prompt + generated tokens)."""

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. ``prompt``: token ids; ``max_tokens``: tokens to generate (>= 1);
    ``chat``: answer in the chat shapes."""

    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    chat: bool
    stop: tuple[str, ...] = ()


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code)


def read_json(raw: bytes) -> Any:
    """The request body as JSON. Raises APIError 400 for bytes that are not JSON (or not
    UTF-8) and for JSON nested deeper than Python's decoder recurses (a RecursionError,
    which was a 500)."""
    try:
        return json.loads(raw)
    except ValueError:
        raise _bad("the request body is not valid JSON", "invalid_json") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise _bad("the request body is nested too deeply to parse", "invalid_json") from None


# No tokenizer here makes a token of more characters than this: a longer text cannot fit the
# context, and is refused before tokenizing (which runs on the front door's event loop).
MAX_CHARS_PER_TOKEN = 32


def _too_long(n: int, unit: str, limits: ModelLimits) -> APIError:
    return APIError(413, f"the prompt has {n} {unit}, more than the model's limit of {limits.max_model_len} tokens "
                         f"can hold", code="context_length_exceeded")


def _encode(tokenizer: Tokenizer, text: str, field: str, limits: ModelLimits) -> list[int]:
    """Token ids of ``text``; text that cannot be encoded (a lone surrogate) is a 400, text
    too long to fit the context whatever its tokens a 413 (before tokenizing it)."""
    if len(text) > limits.max_model_len * MAX_CHARS_PER_TOKEN:
        raise _too_long(len(text), "characters", limits)
    try:
        return tokenizer.encode(text)
    except (InvalidArgument, UnicodeError) as exc:
        raise _bad(f"'{field}': {exc}", "invalid_text") from None


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be true or false, got {type(value).__name__}", "invalid_type")
    return value


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    """``stop``: absent/None, a string or a list of up to MAX_STOP_STRINGS non-empty strings
    of at most MAX_STOP_CHARS characters each. Raises APIError 400 otherwise."""
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise _bad(f"'stop' must be a string or a list of strings, got {type(stop).__name__}", "invalid_type")
    odd = next((x for x in items if not isinstance(x, str)), None)
    if odd is not None:
        raise _bad(f"'stop' must be a string or a list of strings, got a list holding a {type(odd).__name__}",
                   "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS}")
    for x in items:
        if not x or len(x) > MAX_STOP_CHARS:
            raise _bad(f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters, got {len(x)}")
    return tuple(dict.fromkeys(items))


def _common(body: Any) -> None:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "invalid_body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {type(model).__name__}", "invalid_type")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise _bad("only 'n': 1 is supported", "unsupported_value")
    # The built-in engines decode greedily; sampling fields are checked as OpenAI's API
    # defines them, so a bad value is a 400 rather than silently ignored.
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise _bad(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}", "invalid_value")


def _finish(body: dict[str, Any], tokens: list[int], limits: ModelLimits, default_max_tokens: int,
            chat: bool) -> GenerationRequest:
    max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    if not tokens:
        raise _bad("the prompt is empty", "empty_prompt")
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise _bad(f"token id {bad} in the prompt is outside the vocabulary [0, {limits.vocab_size})")
    if len(tokens) + max_tokens > limits.max_model_len:
        raise APIError(413, f"the prompt has {len(tokens)} tokens and {max_tokens} were asked for: "
                            f"{len(tokens) + max_tokens} exceeds the model's limit of "
                            f"{limits.max_model_len} tokens", code="context_length_exceeded")
    return GenerationRequest(tuple(tokens), max_tokens, _flag(body, "stream"), _flag(body, "ignore_eos"), chat,
                             _stops(body))


def parse_completion(body: Any, tokenizer: Tokenizer, limits: ModelLimits,
                     default_max_tokens: int) -> GenerationRequest:
    """Validate a ``/v1/completions`` body. ``prompt`` is a string or a list of token ids.
    Raises APIError 400 (what is wrong) or 413 (prompt + max_tokens over the limit)."""
    _common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required: a string or a list of token ids", "missing_prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        tokens = _encode(tokenizer, prompt, "prompt", limits)
    elif isinstance(prompt, list):
        if len(prompt) > limits.max_model_len:
            raise _too_long(len(prompt), "tokens", limits)
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad("only one prompt per request is supported", "unsupported_value")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise _bad("'prompt' as a list must hold integer token ids only", "invalid_type")
        tokens = list(prompt)
    else:
        raise _bad(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}",
                   "invalid_type")
    return _finish(body, tokens, limits, default_max_tokens, chat=False)


def parse_chat(body: Any, tokenizer: Tokenizer, limits: ModelLimits,
               default_max_tokens: int) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body: ``messages`` is a non-empty list of
    ``{"role": one of CHAT_ROLES, "content": str}``; the prompt is the tokenizer's chat
    template of them. Raises APIError 400 or 413 as :func:`parse_completion`."""
    _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required: a non-empty list of {role, content}", "missing_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise _bad(f"messages[{i}] must be an object with 'role' one of {list(CHAT_ROLES)} "
                       "and 'content' a string", "invalid_type")
    text = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
    return _finish(body, _encode(tokenizer, text, "messages", limits), limits, default_max_tokens, chat=True)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(req: GenerationRequest, id_: str, created: int, model: str, text: str,
                  token_ids: Sequence[int], finish_reason: str | None,
                  usage_: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) answer, completion or chat shape."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
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
               usage_: dict[str, Any] | None = None, first: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed answer (usage only on the last one)."""
    if req.chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "token_ids": list(token_ids)}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": list(token_ids)}
        obj = "text_completion"
    out = {"id": id_, "object": obj, "created": created, "model": model, "choices": [choice]}
    if usage_ is not None:
        out["usage"] = usage_
    return out


class TextStream:
    """Incremental detokenization: the text each new token adds. Holds text back while it ends
    in an incomplete UTF-8 sequence (U+FFFD), so multi-byte characters arrive whole."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self._tok.decode(self._ids))

    def _take(self, text: str) -> str:
        delta, self._sent = text[self._sent:], len(text)
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
