"""The one token scheme of every kvstore port: a caller sends ``authorization: Bearer <token>``
(gRPC metadata; the same-host and TCP control channels send the token in their HELLO frame),
the server compares it in constant time. Two secrets, each in one environment variable that
both sides read, so ``kvstore up`` hands them to its children without putting them on a
command line (``ps`` shows argv to every local user; ``/proc/<pid>/environ`` only to the
process's owner):

- ``KVSTORE_STORE_TOKEN``: the store nodes' token (``kvstore serve --auth-token``; engines,
  the scheduler and the vLLM connector send it as ``--store-token``);
- ``KVSTORE_ENGINE_TOKEN``: the engines' token (``kvstore engine --auth-token``; only the
  front door holds it, as ``kvstore scheduler --engine-token``), so only the front door sets
  a request's namespace.

A third, ``KVSTORE_METRICS_TOKEN``, is read-only: the metrics ports of store nodes and
engines take it beside their service's token, so a Prometheus scraper needs neither the
store token (every tenant's blocks) nor the engines' (requests in any namespace).
"""
from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import grpc

STORE_TOKEN_ENV = "KVSTORE_STORE_TOKEN"
ENGINE_TOKEN_ENV = "KVSTORE_ENGINE_TOKEN"
METRICS_TOKEN_ENV = "KVSTORE_METRICS_TOKEN"
# A Redis URL may hold a password (redis://:PASSWORD@host:port/db): services also read it from
# the environment, so kvstore up never puts it on a command line.
REDIS_URL_ENV = "KVSTORE_REDIS_URL"


def new_token() -> str:
    """A fresh random token: 32 bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def token_from(flag: str | None, env: str) -> str | None:
    """The token given by a flag, else by the environment variable ``env``; None (or "")
    means no token."""
    return flag or os.environ.get(env) or None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``token`` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer <token>``: the scheme in any case (it
    is case-insensitive, RFC 7235 §2.1, as the front door's HTTP check takes it), the token
    exactly (compared in constant time); a binary value never is."""
    if not isinstance(header, str):
        return False
    scheme, _, sent = header.partition(" ")
    same = hmac.compare_digest(sent.encode(), token.encode())
    return scheme.lower() == "bearer" and same


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with ``UNAUTHENTICATED``, every call whose ``authorization`` metadata is not
    ``Bearer <token>``; the servicer is never reached. The refusal is a streaming-request
    handler that never reads: a unary one would hold a server worker until the caller sent
    its request message, so a few tokenless calls that never send one froze a server (8
    on a store node, 16 on an engine)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an auth token must not be empty")
        self._token = token

        def deny(requests: object, context: grpc.ServicerContext) -> Iterator[None]:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
            yield None   # never reached: abort raises
        self._deny: grpc.RpcMethodHandler[Any, None] = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        meta = dict(handler_call_details.invocation_metadata or ())
        if not bearer_matches(meta.get("authorization"), self._token):
            return self._deny
        return continuation(handler_call_details)


def interceptors_for(token: str | None) -> list[grpc.ServerInterceptor]:
    """The server interceptors of a port that requires ``token`` (none without one)."""
    return [TokenInterceptor(token)] if token else []
