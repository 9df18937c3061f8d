"""The OpenAI-compatible wire format of the front door: request validation
(``/v1/completions``, ``/v1/chat/completions``; OpenAI's API reference,
https://platform.openai.com/docs/api-reference/completions/create and .../chat/create) and
the errors; the answers' shapes are in scheduler/frontdoor/openai_shapes.py.

Checked as OpenAI defines them: ``model`` (the served model, else 404 ``model_not_found``),
``temperature`` [0, 2], ``top_p`` [0, 1], ``seed`` (an integer), ``stop`` (a string or up to
:data:`MAX_STOP_STRINGS`: generation ends when the text contains one, the text is cut before
it and ``finish_reason`` is ``"stop"``, scheduler/frontdoor/text_stream.py), ``stream_options``
(``include_usage``, only with ``stream``), chat ``content`` as a string or a list of text
parts. Fields that would change the answer and that neither front door applies
(:data:`NEVER_APPLIED`; vLLM's ``cache_salt``, the namespace, which the front door sets from
the caller's API key, and ``kv_transfer_params``, the hand-off it controls) are a 400.

A prompt whose tokens plus ``max_tokens`` exceed the model's limit (``max_model_len``) is a
400 with code ``context_length_exceeded``, as OpenAI's API and vLLM answer it.

Extensions to OpenAI's shapes: ``choices[0].token_ids`` (generated ids, also one per stream
chunk), ``ignore_eos`` in the request (generate exactly ``max_tokens``),
``prefix_cache`` in the request (default true; false: pool off for this request — every
prompt token is computed, no cache is read or written, ``cached_tokens`` is 0) and
``usage.prompt_tokens_details.cached_tokens`` (prompt tokens loaded from a cache).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engines.tokenizer import Tokenizer
from kvstore.errors import InvalidArgument

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's "developer" messages are its reasoning models' "system" ones, which a chat template knows.
TEMPLATE_ROLE = {"developer": "system"}
MAX_STOP_STRINGS = 4          # as OpenAI's API
MAX_STOP_CHARS = 256          # per stop string


class APIError(Exception):
    """An error answered to the HTTP client: ``status`` (HTTP), ``message`` (says what is
    wrong), ``type`` and ``code`` (OpenAI's error fields)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers = headers or {}
        self.param = param      # the request field at fault, when one is

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request is checked against: ``vocab_size`` (ids in ``[0, vocab_size)``),
    ``max_model_len`` (prompt + generated tokens) and ``model_ids``: the names a request's
    ``model`` may give (the first is the one ``/v1/models`` lists; empty: any)."""

    vocab_size: int
    max_model_len: int
    model_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. ``prompt``: token ids; ``max_tokens``: tokens to generate (>= 1); ``chat``: answer
    in the chat shapes; ``temperature``, ``top_p``, ``seed``: as sent (None: not sent); ``include_usage``: a
    stream ends with a usage chunk (``stream_options.include_usage``); ``logprobs``: how many alternatives per
    token the client asked log probabilities for (None: none asked); ``prefix_cache``: False computes every
    prompt token, reading and writing no cache (the request's ``"prefix_cache": false``); ``messages``: a
    chat request's messages as its prompt was rendered from them (role and text alone)."""

    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    chat: bool
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    include_usage: bool = False
    logprobs: int | None = None
    prefix_cache: bool = True
    messages: tuple[dict[str, str], ...] = ()


def _bad(message: str, code: str = "invalid_value", param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def model_not_found(model: str) -> APIError:
    """404 ``model_not_found``, OpenAI's answer for a model it does not serve."""
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


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
    return APIError(400, f"the prompt has {n} {unit}, more than the model's limit of {limits.max_model_len} tokens "
                         f"can hold", code="context_length_exceeded")


def _encode(tokenizer: Tokenizer, text: str, field: str, limits: ModelLimits) -> list[int]:
    """Token ids of ``text``; text that cannot be encoded (a lone surrogate) is a 400, and so
    is text too long to fit the context whatever its tokens (checked before tokenizing it)."""
    if len(text) > limits.max_model_len * MAX_CHARS_PER_TOKEN:
        raise _too_long(len(text), "characters", limits)
    try:
        return tokenizer.encode(text)
    except (InvalidArgument, UnicodeError) as exc:
        raise _bad(f"'{field}': {exc}", "invalid_text", field) from None


def _flag(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{param or name}' must be true or false, got {type(value).__name__}", "invalid_type",
                   param or name)
    return value


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    """``stop``: absent/None, a string or a list of up to MAX_STOP_STRINGS non-empty strings
    of at most MAX_STOP_CHARS characters each. Raises APIError 400 otherwise."""
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise _bad(f"'stop' must be a string or a list of strings, got {type(stop).__name__}", "invalid_type", "stop")
    odd = [x for x in items if not isinstance(x, str)]
    if odd:   # a list, since None (JSON null) inside it is an odd item too
        raise _bad(f"'stop' must be a string or a list of strings, got a list holding a {type(odd[0]).__name__}",
                   "invalid_type", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    for x in items:
        if not x or len(x) > MAX_STOP_CHARS:
            raise _bad(f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters, got {len(x)}", param="stop")
    return tuple(dict.fromkeys(items))


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}", "invalid_value", name)
    return float(value)


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 64):
        raise _bad(f"'seed' must be an integer from -2**63 to 2**64 - 1, got {seed!r}", "invalid_value", "seed")
    return seed % (1 << 64)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """``stream_options.include_usage``; stream_options without ``stream`` is a 400 (as OpenAI)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(opts, dict):
        raise _bad(f"'stream_options' must be an object, got {type(opts).__name__}", "invalid_type", "stream_options")
    return _flag(opts, "include_usage", "stream_options.include_usage")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Alternatives asked per token: completions ``logprobs`` (0 to 5), chat ``logprobs``
    (true) with ``top_logprobs`` (0 to 20). None when none asked."""
    if chat:
        asked, top = _flag(body, "logprobs"), body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            raise _bad(f"'top_logprobs' must be an integer from 0 to 20, got {top!r}", param="top_logprobs")
        if top is not None and not asked:
            raise _bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if asked else None
    n = body.get("logprobs")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 5:
        raise _bad(f"'logprobs' must be an integer from 0 to 5, got {n!r}", param="logprobs")
    return n


def _neutral(*values: Any) -> Callable[[Any], bool]:
    """Whether a value is one of ``values``, a boolean only as a boolean: ``True == 1`` and
    ``0 == False`` in Python, so ``"best_of": true`` or ``"echo": 0`` passed a bare ``in``."""
    return lambda v: any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in values)


# Fields that change the answer and that no front door here applies: a value other than the
# neutral one is refused (400), never ignored. (name -> is the value neutral?)
NEVER_APPLIED: dict[str, Callable[[Any], bool]] = {
    "echo": _neutral(None, False), "suffix": _neutral(None, ""),
    "best_of": _neutral(None, 1), "tools": _neutral(None, []),
    "functions": _neutral(None, []), "tool_choice": _neutral(None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "cache_salt": _neutral(None), "kv_transfer_params": _neutral(None),   # vLLM's: the front door's own
}
# Fields the vLLM engines apply (scheduler/vllm/frontdoor.py passes them on) and the built-in
# engines do not: refused by the built-in front door.
NOT_BUILT_IN: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _neutral(None, {}), "presence_penalty": _neutral(None, 0),
    "frequency_penalty": _neutral(None, 0), "repetition_penalty": _neutral(None, 1),
    "top_k": _neutral(None, 0, -1), "min_p": _neutral(None, 0),
    "min_tokens": _neutral(None, 0), "stop_token_ids": _neutral(None, []),
}


def refuse_fields(body: dict[str, Any], table: dict[str, Callable[[Any], bool]], who: str) -> None:
    """Raises APIError 400 naming the first field of ``table`` whose value in ``body`` is not
    the neutral one (``who`` says what does not apply it)."""
    for name, neutral in table.items():
        if name in body and not neutral(body[name]):
            raise _bad(f"'{name}' is not supported by {who}", "unsupported_parameter", name)


def _common(body: Any, limits: ModelLimits) -> None:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "invalid_body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {type(model).__name__}", "invalid_type", "model")
    if model is not None and limits.model_ids and model not in limits.model_ids:
        raise model_not_found(model)
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise _bad("only 'n': 1 is supported", "unsupported_value", "n")
    refuse_fields(body, NEVER_APPLIED, "this server")


def _finish(body: dict[str, Any], tokens: list[int], limits: ModelLimits, default_max_tokens: int,
            chat: bool) -> GenerationRequest:
    # chat: max_completion_tokens (OpenAI's current name), else max_tokens; null is "not sent"
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(field)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad(f"'{field}' must be a positive integer, got {max_tokens!r}", param=field)
    prompt = "messages" if chat else "prompt"
    if not tokens:
        raise _bad("the prompt is empty", "empty_prompt", prompt)
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise _bad(f"token id {bad} in the prompt is outside the vocabulary [0, {limits.vocab_size})", param=prompt)
    if len(tokens) + max_tokens > limits.max_model_len:
        raise APIError(400, f"the prompt has {len(tokens)} tokens and {max_tokens} were asked for: "
                            f"{len(tokens) + max_tokens} exceeds the model's limit of "
                            f"{limits.max_model_len} tokens", code="context_length_exceeded")
    stream = _flag(body, "stream")
    prefix_cache = body.get("prefix_cache", True)
    if prefix_cache is not None and not isinstance(prefix_cache, bool):
        raise _bad(f"'prefix_cache' must be true or false, got {type(prefix_cache).__name__}", "invalid_type",
                   "prefix_cache")
    return GenerationRequest(tuple(tokens), max_tokens, stream, _flag(body, "ignore_eos"), chat, _stops(body),
                             _number(body, "temperature", 0.0, 2.0), _number(body, "top_p", 0.0, 1.0),
                             _seed(body), _stream_options(body, stream), _logprobs(body, chat),
                             prefix_cache is not False)


def parse_completion(body: Any, tokenizer: Tokenizer, limits: ModelLimits,
                     default_max_tokens: int) -> GenerationRequest:
    """Validate a ``/v1/completions`` body. ``prompt`` is a string or a list of token ids, or
    a list holding one of those (OpenAI's batch form, as its SDK sends ``prompt=["..."]``;
    a batch of more is a 400: one prompt per request). Raises APIError 400 (what is wrong;
    ``context_length_exceeded``: prompt + max_tokens over the limit) or 404 (``model`` is
    not the served model)."""
    _common(body, limits)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required: a string or a list of token ids", "missing_prompt", "prompt")
    prompt = body["prompt"]
    batch = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list))
    if batch:
        prompt = prompt[0]                     # a batch of one prompt is that prompt
    if isinstance(prompt, str):
        tokens = _encode(tokenizer, prompt, "prompt", limits)
    elif isinstance(prompt, list):
        if len(prompt) > limits.max_model_len:
            raise _too_long(len(prompt), "tokens", limits)
        if prompt and not batch and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad(f"only one prompt per request is supported, got a batch of {len(prompt)}",
                       "unsupported_value", "prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise _bad("'prompt' as a list must hold integer token ids only", "invalid_type", "prompt")
        tokens = list(prompt)
    else:
        raise _bad(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}",
                   "invalid_type", "prompt")
    return _finish(body, tokens, limits, default_max_tokens, chat=False)


def message_text(content: Any) -> str | None:
    """A chat message's ``content`` as text: a string, or a list of text parts
    (``{"type": "text", "text": str}``) joined; None for anything else (another kind of
    part, such as an image, included)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    strings = [t for t in texts if isinstance(t, str)]
    return "".join(strings) if len(strings) == len(content) else None


def parse_chat(body: Any, tokenizer: Tokenizer, limits: ModelLimits,
               default_max_tokens: int) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body: ``messages`` is a non-empty list of
    ``{"role": one of CHAT_ROLES, "content": str or a list of text parts}``; the prompt is
    the tokenizer's chat template of them. Raises APIError 400 or 404 as
    :func:`parse_completion`."""
    _common(body, limits)
    turns = chat_turns(body, limits)
    tokens = _encode(tokenizer, tokenizer.apply_chat_template(turns), "messages", limits)
    return replace(_finish(body, tokens, limits, default_max_tokens, chat=True), messages=tuple(turns))


def chat_turns(body: dict[str, Any], limits: ModelLimits) -> list[dict[str, str]]:
    """A chat body's ``messages`` as its template renders them (role, text); APIError 400 as :func:`parse_chat`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required: a non-empty list of {role, content}", "missing_messages", "messages")
    if len(messages) > limits.max_model_len:    # every message takes a token of the template at least
        raise _too_long(len(messages), "messages", limits)
    turns = []
    for i, m in enumerate(messages):
        text = message_text(m.get("content")) if isinstance(m, dict) else None
        parts = m.get("content") if isinstance(m, dict) else None
        if text is None and isinstance(parts, list):    # name the part the model cannot take
            for j, part in enumerate(parts):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    what = (f"a {kind!r} part" if isinstance(kind, str) and kind != "text" else
                            "a text part without a string 'text'" if kind == "text" else "not a content part")
                    raise _bad(f"messages[{i}].content[{j}] is {what}; this model takes text parts only "
                               "({\"type\": \"text\", \"text\": ...})", "unsupported_content", "messages")
        if text is None or m.get("role") not in CHAT_ROLES:
            raise _bad(f"messages[{i}] must be an object with 'role' one of {list(CHAT_ROLES)} and 'content' "
                       "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})", "invalid_type",
                       "messages")
        turns.append({"role": TEMPLATE_ROLE.get(m["role"], m["role"]), "content": text})
    return turns


def parse_tokenize(body: Any, tokenizer: Tokenizer, limits: ModelLimits) -> list[int]:
    """The token ids of a ``/tokenize`` body (vLLM's: ``{"prompt": str}`` or
    ``{"messages": [...]}``, chat-templated as :func:`parse_chat` does; ``model`` optional).
    Raises APIError 400 (what is wrong; ``context_length_exceeded`` for text no tokenization
    could fit in the context) or 404 (``model`` is not the served model)."""
    _common(body, limits)
    if "messages" in body:
        return _encode(tokenizer, tokenizer.apply_chat_template(chat_turns(body, limits)), "messages", limits)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _bad("'prompt' (a string) or 'messages' is required", "missing_prompt", "prompt")
    return _encode(tokenizer, prompt, "prompt", limits)


def parse_detokenize(body: Any, limits: ModelLimits) -> list[int]:
    """The token ids of a ``/detokenize`` body (vLLM's: ``{"tokens": [int, ...]}``), each
    in ``[0, vocab_size)``, at most ``max_model_len`` of them. Raises APIError 400 or 404."""
    _common(body, limits)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise _bad("'tokens' must be a list of integer token ids", "invalid_type", "tokens")
    if len(tokens) > limits.max_model_len:
        raise _too_long(len(tokens), "tokens", limits)
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise _bad(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", "invalid_value", "tokens")
    return tokens
