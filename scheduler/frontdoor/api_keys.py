"""API keys of the front door: which callers it serves. Without keys every caller is served
(the tenant is then named by whatever bearer token the caller sends, ``public`` without
one); with keys, a request to anything but ``/health``, ``/ping`` and the status page's HTML and script
must carry ``Authorization: Bearer
<key>`` of one of them, else HTTP 401 in OpenAI's error shape. The tenant stays the key's
hash (scheduler/routing/tenancy.py), so each key is one tenant."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from kvstore.auth import METRICS_TOKEN_ENV, token_from

# Liveness probes and supervisors carry no key; the status page's HTML and script hold no
# data (its feed, /status.json, takes a key: scheduler/frontdoor/status_page.py).
OPEN_PATHS = frozenset({"/health", "/ping", "/status", "/status.js"})
METRICS_PATH = "/metrics"


def read_keys_file(path: str) -> list[str]:
    """The keys in ``path``: one per line; blank lines and lines starting with ``#`` are
    skipped, surrounding whitespace is dropped. Raises OSError when it cannot be read and
    ValueError when it holds no key."""
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"API keys file {path} holds no key (one per line; '#' starts a comment)")
    return keys


def load_api_keys(keys: Iterable[str] = (), path: str | None = None) -> frozenset[str]:
    """The keys given one by one and those in the file at ``path``. Raises ValueError for a
    key with whitespace inside or an empty one, and what :func:`read_keys_file` raises."""
    every = list(keys) + (read_keys_file(path) if path else [])
    for key in every:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and hold no whitespace")
    return frozenset(every)


def _digest(key: str) -> bytes:
    # aiohttp hands a header's bytes that are not UTF-8 over as surrogates: hash the bytes sent
    # (such a key matches no configured one) instead of failing the request with a 500.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _unauthorized(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}
    return web.Response(status=401, text=json.dumps(body), content_type="application/json",
                        headers={"WWW-Authenticate": 'Bearer realm="kvstore"'})


def api_key_middleware(keys: frozenset[str], scrape_token: str | None = None
                       ) -> Callable[..., Awaitable[web.StreamResponse]]:
    """An aiohttp middleware serving only requests that carry one of ``keys``. Keys are
    compared by their SHA-256 (a set lookup whose timing tells nothing about a key).
    ``scrape_token`` (default ``$KVSTORE_METRICS_TOKEN``, kvstore/auth.py) is taken on
    ``/metrics`` alone, so a Prometheus scraper holds no tenant's key."""
    digests = frozenset(_digest(k) for k in keys)
    scrape = _digest(t) if (t := token_from(scrape_token, METRICS_TOKEN_ENV)) else None

    @web.middleware
    async def require_api_key(request: web.Request,
                              handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return _unauthorized("You didn't provide an API key: send 'Authorization: Bearer <key>'.")
        digest = _digest(key.strip())
        if digest not in digests and not (request.path == METRICS_PATH and digest == scrape):
            return _unauthorized("Incorrect API key provided.")
        return await handler(request)

    return require_api_key
