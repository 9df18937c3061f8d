"""The same-host control over gRPC, for a node that serves no Unix socket (or one this
process cannot reach): the calls of :class:`kvstore.dataplane.control_client.UdsControl`, one
RPC each (about 0.7 ms per call from Python, against tens of microseconds on the socket);
messages through kvstore/wire/proto_codec.py."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore.wire import proto_codec as codec
from kvstore.wire.types import LeaseGrant, LeaseRequest, LookupResult, PutResult, ReserveRequest, SlotGrant
from protos import kvstore_pb2 as pb


class GrpcControl:
    """``call(method, request)``: a unary call on the node's KVStore stub that translates
    gRPC errors to kvstore errors (StoreClient's ``_call``)."""

    def __init__(self, stub: Any, call: Callable[..., Any]) -> None:
        self._stub, self._call = stub, call

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse",
               namespace: str | None = None) -> LookupResult:
        return codec.lookup_of(self._call(self._stub.Lookup, codec.lookup_request(keys, purpose, namespace)))

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
              chain: bool = False) -> LeaseGrant:
        req = codec.lease_request(LeaseRequest(keys, ttl_s, stop_at_miss, chain))
        return codec.lease_grant_of(self._call(self._stub.LeaseBlocks, req))

    def lease_pipelined(self, chunks: Sequence[Sequence[bytes]], ttl_s: float | None,
                        consume: Callable[[int, LeaseGrant], None]) -> None:
        """Lease, ``consume(i, grant)`` and release each chunk in turn (not pipelined)."""
        for n, keys in enumerate(chunks):
            grant = self.lease(keys, ttl_s)
            try:
                consume(n, grant)
            finally:
                self.release(grant.lease_id)

    def release(self, lease_id: int) -> None:
        if lease_id:
            self._call(self._stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=lease_id))

    def reserve(self, items: Sequence[tuple[bytes, int]], chain: bool = False,
                parent: bytes | None = None, namespace: str | None = None) -> list[SlotGrant]:
        req = codec.reserve_request(ReserveRequest(items, chain, parent, namespace))
        return codec.slots_of(self._call(self._stub.ReserveBlocks, req))

    name = "grpc"
    spares = False  # no spare slots over gRPC: reserve, write, commit
    spares_owed = 0

    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
               spare: tuple[int, int] = (0, 0), checksums: Sequence[int] | None = None,
               give_back: Sequence[int] = (), namespace: str | None = None) -> list[PutResult]:
        """Commit filled slots (reserved under ``keys``; ``parents`` were given at reserve
        and are not resent; ``checksums``: the writer's, None: the node takes them). No
        spares are granted over gRPC; ``give_back`` ids are aborted."""
        self.abort(give_back)
        if not res_ids:
            return []
        resp = self._call(self._stub.CommitBlocks, codec.commit_request(res_ids, checksums, namespace))
        return codec.put_results_of(resp.results, keys)

    def commit_pipelined(self, chunks: Iterable[tuple[Sequence[int], Sequence[bytes], Sequence[bytes | None],
                                                      Sequence[int]]],
                         namespace: str | None = None) -> list[PutResult]:
        """One CommitBlocks call per chunk, in turn (gRPC is not pipelined here)."""
        out: list[PutResult] = []
        for ids, keys, parents, sums in chunks:
            out += self.commit(ids, keys, parents, (0, 0), sums, namespace=namespace)
        return out

    def take_spares(self, wait: bool = False) -> list[tuple[int, SlotGrant]]:
        return []

    def abort(self, res_ids: Sequence[int]) -> None:
        if res_ids:
            self._call(self._stub.AbortBlocks, pb.AbortBlocksRequest(reservation_ids=list(res_ids)))

    def close(self) -> None:
        pass
