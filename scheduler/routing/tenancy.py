"""Request identity for the scheduler: the tenant namespace taken from the caller's
credentials, and the block keys of a prompt, built exactly as the engines build them."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from engines.types import EngineInfo, extras_for
from kvstore.index.keys import KeyExtras, block_keys

PUBLIC_NAMESPACE = "public"


def namespace_from_authorization(header: str | None) -> str:
    """The tenant of a request from its ``Authorization`` header (docs/key-spec.md §3): ``"key-"``
    + the first 16 hex digits of SHA-256 of the bearer token, or ``"public"`` when there is
    no bearer token. Never taken from a field of the request body."""
    if not header:
        return PUBLIC_NAMESPACE
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return PUBLIC_NAMESPACE
    # a header that is not UTF-8 reaches us with surrogates (aiohttp): hash the bytes sent
    return "key-" + hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def request_extras(info: EngineInfo, namespace: str) -> KeyExtras:
    """The key extras of a request served by engines described by ``info`` (the same
    function the engines call: :func:`engines.types.extras_for`)."""
    return extras_for(info.model_id, info.revision, info.layout, namespace)


def prompt_keys(tokens: Sequence[int], info: EngineInfo, namespace: str) -> list[bytes]:
    """Block keys of the full blocks of ``tokens`` (``len(tokens) // info.block_size`` keys,
    head first). Raises InvalidArgument for token ids outside ``[0, 2**32)``."""
    return block_keys(tokens, info.block_size, request_extras(info, namespace))
