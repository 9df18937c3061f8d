"""The :class:`BlockTransport` strategy and the registry that picks one by name."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.registry import registrar
from kvstore.tiers.buffers import copy_into

log = logging.getLogger(__name__)
TRANSPORTS: dict[str, Callable[..., BlockTransport]] = {}


register_transport = registrar(TRANSPORTS)


class BlockTransport(ABC):
    """Reads blocks of one store node by key.

    Invariant: a returned block's bytes passed the checksum taken at put; anything else —
    absent, expired lease, failed checksum — is a miss (None), never wrong bytes. Raises
    :class:`kvstore.errors.Unavailable` only when the node cannot be reached at all.
    """

    name = "abstract"
    fallback_reason: str | None = None   # why this transport stands in for the one preferred

    @abstractmethod
    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Bytes of each key, None for a miss; with ``stop_at_miss`` the list ends at the
        first miss."""

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Any], stop_at_miss: bool = False) -> list[int | None]:
        """Copy block i into ``outs[i]`` (a numpy array or tensor, at least the block's
        size); per key the bytes written or None for a miss. This default goes through
        :meth:`get_blocks`; transports that can write in place override it."""
        return [None if data is None else copy_into(out, np.frombuffer(data, dtype=np.uint8))
                for data, out in zip(self.get_blocks(keys, stop_at_miss), outs)]

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Release what the transport holds (connections, registered buffers)."""


def open_transport(prefer: str, address: str, auth_token: str | None = None,
                   te_endpoint: str | None = None, client: object | None = None) -> BlockTransport:
    """A transport to the node at ``address`` (gRPC host:port). ``prefer``: ``auto`` (the
    same-host slab when the node runs on this host, else the transfer engine when the node
    announces ``te_endpoint``, else the gRPC stream), or one of :data:`TRANSPORTS` by name.
    A transfer engine that cannot start falls back to ``grpc_stream`` with a warning
    (``fallback_reason`` says why). ``client``: a StoreClient of the node to reuse for the
    same-host path. Raises ValueError for an unknown name."""
    if prefer not in ("auto", *TRANSPORTS):
        raise ValueError(f"unknown transport {prefer!r}; valid: auto, {', '.join(TRANSPORTS)}")
    if prefer == "auto":
        try:
            return TRANSPORTS["same_host"](address, auth_token=auth_token, client=client)
        except KVStoreError:
            pass
    if prefer == "transfer_engine" or (prefer == "auto" and te_endpoint):
        try:
            return TRANSPORTS["transfer_engine"](address, auth_token=auth_token)
        except KVStoreError as exc:
            log.warning("transfer engine unavailable for %s, falling back to the gRPC stream: %s",
                        address, exc)
            t = TRANSPORTS["grpc_stream"](address, auth_token=auth_token)
            t.fallback_reason = str(exc)
            return t
    return TRANSPORTS["grpc_stream" if prefer == "auto" else prefer](address, auth_token=auth_token)
