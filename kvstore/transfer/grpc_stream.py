"""The portable path — block bytes streamed in chunks over the store node's gRPC ``Get`` —
and the same-host path, which is :class:`StoreClient`'s own slab mapping (kvstore/dataplane)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.client import StoreClient
from kvstore.errors import Unavailable
from kvstore.transfer.base import BlockTransport, register_transport


@register_transport("grpc_stream")
class GrpcStreamTransport(BlockTransport):
    """Wraps a :class:`StoreClient`; ``fallback_reason`` is set when this transport stands in
    for a transfer engine that could not start."""

    def __init__(self, address: str, auth_token: str | None = None,
                 client: StoreClient | None = None, timeout_s: float = 60.0) -> None:
        self.address = address
        if client is None:
            client = grpc_only_client(address, auth_token, timeout_s)
            self._own = True
        else:
            self._own = False
        self.client = client
        self.fallback_reason: str | None = None

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        return self.client.get_blocks(keys, stop_at_miss=stop_at_miss)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Any], stop_at_miss: bool = False) -> list[int | None]:
        return self.client.get_into(keys, outs, stop_at_miss=stop_at_miss)

    def close(self) -> None:
        if self._own:
            self.client.close()


def grpc_only_client(address: str, auth_token: str | None, timeout_s: float) -> StoreClient:
    """A StoreClient that always streams over gRPC (never the same-host slab mapping)."""
    try:
        return StoreClient(address, auth_token=auth_token, timeout_s=timeout_s, data_path="grpc")
    except TypeError:      # a StoreClient without data paths
        return StoreClient(address, auth_token=auth_token, timeout_s=timeout_s)


@register_transport("same_host")
class SameHostTransport(GrpcStreamTransport):
    """A node on this host: bytes copied out of its mapped DRAM slab by :class:`StoreClient`
    (kvstore/dataplane), the path :func:`~kvstore.transfer.base.pick_transport` picked for it.
    Raises Unavailable at construction when the slab could not be mapped (the node is
    elsewhere, or its segment cannot be opened here). ``own_client``: close ``client`` with
    this transport (always so for one it makes)."""

    def __init__(self, address: str, auth_token: str | None = None,
                 client: StoreClient | None = None, own_client: bool = False, timeout_s: float = 60.0) -> None:
        own = client is None or own_client
        client = client or StoreClient(address, auth_token=auth_token, timeout_s=timeout_s)
        path = client.data_path_in_use       # whether the client's mapping of the slab took
        if not path.startswith("same-host"):
            if own:
                client.close()
            raise Unavailable(f"store node at {address} is not mapped on this host ({path})")
        super().__init__(address, client=client)
        self._own = own
