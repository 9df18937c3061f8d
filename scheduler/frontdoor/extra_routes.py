"""The routes a vLLM user reaches for beside the OpenAI API, answered as vLLM's server answers
them (vllm/entrypoints/openai/api_server.py): ``POST /tokenize`` and ``POST /detokenize``
with the served model's tokenizer, ``GET /version``, and ``GET``/``POST /ping`` (the
health check's status code, as vLLM's SageMaker-style ``/ping``)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aiohttp import web

import kvstore
from scheduler.frontdoor.openai_api import APIError, parse_detokenize, parse_tokenize
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
