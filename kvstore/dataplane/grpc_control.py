"""The same-host control over gRPC, for a node that serves no Unix socket (or one this
process cannot reach): the calls of :class:`kvstore.dataplane.uds.UdsControl`, one RPC each
(about 0.7 ms per call from Python, against tens of microseconds on the socket)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from kvstore.pool import PutResult
from kvstore.dataplane.types import BlockLocation, LeaseGrant, SlotGrant
from protos import kvstore_pb2 as pb


class GrpcControl:
    """``call(method, request)``: a unary call on the node's KVStore stub that translates
    gRPC errors to kvstore errors (StoreClient's ``_call``)."""

    def __init__(self, stub: Any, call: Callable[..., Any]) -> None:
        self._stub, self._call = stub, call

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        resp = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys)))
        return resp.prefix_blocks, list(resp.tiers)

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
              chain: bool = False) -> LeaseGrant:
        resp = self._call(self._stub.LeaseBlocks, pb.LeaseBlocksRequest(
            keys=list(keys), ttl_s=ttl_s or 0.0, stop_at_miss=stop_at_miss, chain=chain))
        return LeaseGrant(resp.lease_id, resp.deadline,
                          [BlockLocation(b.state, b.offset, b.size, b.checksum) for b in resp.blocks])

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
                parent: bytes | None = None) -> list[SlotGrant]:
        resp = self._call(self._stub.ReserveBlocks, pb.ReserveBlocksRequest(
            keys=[k for k, _ in items], sizes=[s for _, s in items], chain=chain, parent=parent or b""))
        return [SlotGrant(s.state, s.reservation_id, s.offset, s.error, s.write_by) for s in resp.slots]

    name = "grpc"
    spares = False  # no spare slots over gRPC: reserve, write, commit
    spares_owed = 0

    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
               spare: tuple[int, int] = (0, 0), checksums: Sequence[int] | None = None,
               give_back: Sequence[int] = ()) -> list[PutResult]:
        """Commit filled slots (reserved under ``keys``; ``parents`` were given at reserve
        and are not resent; ``checksums``: the writer's, None: the node takes them). No
        spares are granted over gRPC; ``give_back`` ids are aborted."""
        self.abort(give_back)
        if not res_ids:
            return []
        resp = self._call(self._stub.CommitBlocks, pb.CommitBlocksRequest(reservation_ids=list(res_ids),
                                                                          checksums=list(checksums or ())))
        return [PutResult(k, r.ok, r.existed, r.error) for k, r in zip(keys, resp.results)]

    def commit_pipelined(self, chunks: Iterable[tuple[Sequence[int], Sequence[bytes], Sequence[bytes | None],
                                                      Sequence[int]]]) -> list[PutResult]:
        """One CommitBlocks call per chunk, in turn (gRPC is not pipelined here)."""
        out: list[PutResult] = []
        for ids, keys, parents, sums in chunks:
            out += self.commit(ids, keys, parents, (0, 0), sums)
        return out

    def take_spares(self, wait: bool = False) -> list[tuple[int, SlotGrant]]:
        return []

    def abort(self, res_ids: Sequence[int]) -> None:
        if res_ids:
            self._call(self._stub.AbortBlocks, pb.AbortBlocksRequest(reservation_ids=list(res_ids)))

    def close(self) -> None:
        pass
