"""The routes a vLLM user reaches for beside the OpenAI API, answered as vLLM's server answers
them (vllm/entrypoints/openai/api_server.py): ``POST /tokenize`` and ``POST /detokenize``
with the served model's tokenizer, ``GET /version``, and ``GET``/``POST /ping`` (the
health check's status code, as vLLM's SageMaker-style ``/ping``)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

import kvstore
from engines.tokenizer import Tokenizer
from scheduler.frontdoor.openai_api import (
    APIError,
    ModelLimits,
    _bad,
    _common,
    _encode,
    _too_long,
    chat_text,
)
from scheduler.frontdoor.request_parts import parse_json_body

if TYPE_CHECKING:
    from scheduler.frontdoor.server import Frontdoor


def extra_routes(door: Frontdoor) -> list[web.RouteDef]:
    """The routes above, served by ``door`` (its tokenizer, limits, health and tenants)."""
    from scheduler.frontdoor.server import tenant_of

    async def tokenize(request: web.Request) -> web.Response:
        """``{"prompt": str}`` or ``{"messages": [...]}`` -> ``{"count", "max_model_len",
        "tokens", "token_strs": null}``."""
        def answer(body: object) -> bytes:     # the answer too is built where the body is parsed
            tokens = parse_tokenize(body, door.tokenizer, door.limits)
            return json.dumps({"count": len(tokens), "max_model_len": door.limits.max_model_len,
                               "tokens": tokens, "token_strs": None}).encode()
        try:
            data = await parse_json_body(request, answer, door.parse_slots, tenant_of(request),
                                         limit=door.body_limit)
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        return web.Response(body=data, content_type="application/json")

    async def detokenize(request: web.Request) -> web.Response:
        """``{"tokens": [int, ...]}`` -> ``{"prompt": str}``."""
        try:
            tokens = await parse_json_body(request, lambda b: parse_detokenize(b, door.limits),
                                           door.parse_slots, tenant_of(request), limit=door.body_limit)
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        return web.json_response({"prompt": door.tokenizer.decode(tokens)})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": kvstore.__version__})

    async def ping(request: web.Request) -> web.Response:
        report = door.health_checks.report()
        return web.json_response({"status": report.status}, status=report.http_status)

    return [web.post("/tokenize", tokenize), web.post("/detokenize", detokenize),
            web.get("/version", version), web.get("/ping", ping), web.post("/ping", ping)]


def parse_tokenize(body: Any, tokenizer: Tokenizer, limits: ModelLimits) -> list[int]:
    """The token ids of a ``/tokenize`` body (vLLM's: ``{"prompt": str}`` or
    ``{"messages": [...]}``, chat-templated as :func:`parse_chat` does; ``model`` optional).
    Raises APIError 400 (what is wrong; ``context_length_exceeded`` for text no tokenization
    could fit in the context) or 404 (``model`` is not the served model)."""
    _common(body, limits)
    if "messages" in body:
        return _encode(tokenizer, chat_text(body, tokenizer, limits), "messages", limits)
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
