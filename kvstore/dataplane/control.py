"""The control channel a :class:`~kvstore.dataplane.local.LocalDataPlane` talks to: the
calls :class:`~kvstore.dataplane.control_client.UdsControl` (the node's Unix socket) and
:class:`~kvstore.dataplane.grpc_control.GrpcControl` (gRPC) both serve."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvstore.wire.types import LeaseGrant, LookupResult, PutResult, SlotGrant

# what commit_pipelined takes: chunks of (reservation ids, keys, parents, checksums)
CommitChunk = tuple[Sequence[int], Sequence[bytes], Sequence[bytes | None], Sequence[int]]


class Control(Protocol):
    """``name``: ``uds`` / ``grpc``; ``spares``: whether commits hand out spare slots;
    ``spares_owed``: spare-slot grants asked for and not read yet."""

    name: str
    spares: bool
    spares_owed: int

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse",
               namespace: str | None = None) -> LookupResult: ...
    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
              chain: bool = False) -> LeaseGrant: ...
    def release(self, lease_id: int) -> None: ...
    def lease_pipelined(self, chunks: Sequence[Sequence[bytes]], ttl_s: float | None,
                        consume: Callable[[int, LeaseGrant], None]) -> None: ...
    def reserve(self, items: Sequence[tuple[bytes, int]], chain: bool = False,
                parent: bytes | None = None, namespace: str | None = None) -> list[SlotGrant]: ...
    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
               spare: tuple[int, int] = (0, 0), checksums: Sequence[int] | None = None,
               give_back: Sequence[int] = (), namespace: str | None = None) -> list[PutResult]: ...
    def commit_pipelined(self, chunks: Iterable[CommitChunk], namespace: str | None = None) -> list[PutResult]: ...
    def take_spares(self, wait: bool = False) -> list[tuple[int, SlotGrant]]: ...
    def abort(self, res_ids: Sequence[int]) -> None: ...
    def close(self) -> None: ...
