"""The :class:`BlockTransport` strategy and the registry that picks one: :func:`pick_transport`
is the one decision of how a node's block bytes reach this process, for StoreClient (which
moves them itself, through the mapped slab or the gRPC stream) and, through
:func:`open_transport`, ClusterClient alike."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.registry import registrar
from kvstore.tiers.buffers import copy_into
from kvstore.wire.types import DataPlaneInfo, host_id

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


class Pick(NamedTuple):
    """A transport picked for a node: ``name`` (a key of :data:`TRANSPORTS`) and ``why``."""

    name: str
    why: str


def pick_transport(prefer: str, info: DataPlaneInfo | None = None, te_endpoint: str | None = None) -> Pick:
    """How a node's block bytes reach this process. ``prefer``: one of :data:`TRANSPORTS` by
    name, or ``auto``: ``same_host`` when the node's top tier is a DRAM slab on this host
    (``info``, what its ``DataPlaneInfo`` announced), else ``transfer_engine`` when the node
    announces one (``te_endpoint``), else ``grpc_stream``. Raises ValueError for an unknown name."""
    if prefer not in ("auto", *TRANSPORTS):
        raise ValueError(f"unknown transport {prefer!r}; valid: auto, {', '.join(TRANSPORTS)}")
    if prefer != "auto":
        return Pick(prefer, "asked for")
    if info is None:
        why = "the node announces no DRAM slab to map"
    elif not info.puts_in_slab:     # a tier above the slab (HBM) takes puts and promotions in the node
        why = "the node's top tier is not a DRAM slab"
    elif info.host_id != host_id():
        why = f"store node {info.node_id} runs on another host"
    else:
        return Pick("same_host", f"slab {info.slab_name} on this host")
    return Pick("transfer_engine", why + "; the node runs a transfer engine") if te_endpoint \
        else Pick("grpc_stream", why)


def open_transport(prefer: str, address: str, auth_token: str | None = None,
                   te_endpoint: str | None = None, client: Any = None, timeout_s: float = 60.0) -> BlockTransport:
    """A transport to the node at ``address`` (gRPC host:port), the one :func:`pick_transport`
    picks (``auto`` asks the node what it announces, through ``client``, a StoreClient of the
    node to reuse, or one of its own). A slab that cannot be mapped here after all falls back
    to the next choice; a transfer engine that cannot start falls back to ``grpc_stream`` with
    a warning (``fallback_reason`` says why). ``timeout_s``: the most any one call to the node
    may take (a node cut off must not hold its caller longer). Raises ValueError for an unknown name."""
    pick = pick_transport(prefer)         # an unknown name fails before any connection
    own = None
    if prefer == "auto":
        if client is None:
            from kvstore.client import StoreClient
            client = own = StoreClient(address, auth_token=auth_token, timeout_s=timeout_s)
        pick = pick_transport(prefer, client.dataplane_info(), te_endpoint)
    if pick.name == "same_host":
        try:
            return TRANSPORTS["same_host"](address, auth_token=auth_token, client=client, own_client=own is not None,
                                           timeout_s=timeout_s)
        except KVStoreError as exc:   # the slab could not be mapped here after all
            if prefer != "auto":
                raise
            pick = pick_transport(prefer, None, te_endpoint)
            log.info("store node at %s: %s; reading by %s", address, exc, pick.name)
    if own is not None:
        own.close()
    if pick.name == "transfer_engine":
        try:
            return TRANSPORTS["transfer_engine"](address, auth_token=auth_token, timeout_s=timeout_s)
        except KVStoreError as exc:
            log.warning("transfer engine unavailable for %s, falling back to the gRPC stream: %s",
                        address, exc)
            t = TRANSPORTS["grpc_stream"](address, auth_token=auth_token, timeout_s=timeout_s)
            t.fallback_reason = str(exc)
            return t
    return TRANSPORTS[pick.name](address, auth_token=auth_token, timeout_s=timeout_s)

