"""A Python client of a store node's gRPC API (batched, streamed block transfers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.events.event import NodeSnapshot
from kvstore.pool import PutResult, TierStats, checksum_of
from kvstore.service import CHUNK_BYTES, GRPC_OPTIONS
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``blocks``: longest prefix held; ``tiers``: the tier of each of those blocks."""

    blocks: int
    tiers: tuple[str, ...]


class StoreClient:
    """Talks to one store node at ``address`` (host:port).

    Every method raises :class:`Unavailable` when the node cannot be reached and
    :class:`InvalidArgument` when the node rejects the request as malformed.
    """

    def __init__(self, address: str, auth_token: str | None = None, timeout_s: float = 60.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._meta = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn, *args, **kw):  # type: ignore[no-untyped-def]
        try:
            return fn(*args, timeout=self.timeout_s, metadata=self._meta, **kw)
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None

    def health(self) -> str:
        return self._call(self._stub.Health, pb.HealthRequest()).status

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the node answers; raises Unavailable after ``timeout_s``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"store node at {self.address} not ready after {timeout_s} s") from None

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of the key chain the node holds (renews nothing)."""
        resp = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys)))
        return LookupResult(resp.prefix_blocks, tuple(resp.tiers))

    def put_blocks(self, blocks: Sequence[tuple[bytes, bytes]], chain: bool = False,
                   parent: bytes | None = None) -> list[PutResult]:
        """Put several blocks in one streamed call; one result per block, in order.
        ``chain``: the blocks form one prefix chain (head first; ``parent``: the key the
        head extends), so the node evicts its tail before its head."""
        if not blocks:
            return []
        resp = self._call(self._stub.Put, _put_chunks(blocks, chain, parent))
        return [PutResult(r.key, r.ok, r.existed, r.error) for r in resp.results]

    def put(self, key: bytes, data: bytes) -> PutResult:
        return self.put_blocks([(key, data)])[0]

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Bytes of each key (None for a miss; with ``stop_at_miss`` the list ends at the
        first miss). Each block's checksum is verified after it crosses the socket; a block
        that fails it is returned as a miss."""
        if not keys:
            return []
        out: list[bytes | None] = []
        buf = bytearray()
        size = checksum = 0
        started = False

        def finish() -> None:
            if started:
                ok = len(buf) == size and checksum_of(buf) == checksum
                out.append(bytes(buf) if ok else None)

        try:
            for chunk in self._stub.Get(pb.GetRequest(keys=list(keys), stop_at_miss=stop_at_miss),
                                        timeout=self.timeout_s, metadata=self._meta):
                if chunk.missing:
                    finish()
                    started = False
                    out.append(None)
                elif chunk.key:
                    finish()
                    started, size, checksum = True, chunk.size, chunk.checksum
                    buf = bytearray(chunk.data)
                else:
                    buf += chunk.data
            finish()
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None
        return out

    def get(self, key: bytes) -> bytes | None:
        return self.get_blocks([key])[0]

    def stats(self) -> tuple[str, list[TierStats]]:
        resp = self._call(self._stub.Stats, pb.StatsRequest())
        return resp.node_id, [TierStats(t.name, t.device or "cpu", t.capacity_bytes, t.used_bytes, t.blocks,
                                        t.hits, t.misses, t.evictions, t.demotions, t.promotions,
                                        t.integrity_failures, leased_bytes=t.leased_bytes,
                                        pinned_bytes=t.pinned_bytes, reserved_bytes=t.reserved_bytes,
                                        policy=t.policy) for t in resp.tiers]

    def evict(self, tier: str, nbytes: int) -> tuple[int, int]:
        resp = self._call(self._stub.Evict, pb.EvictRequest(tier=tier, bytes=nbytes))
        return resp.evicted_bytes, resp.evicted_blocks

    def pin(self, keys: Sequence[bytes], hard: bool = False, ttl_s: float | None = None,
            prefix: bool = False) -> int:
        """Pin blocks (``prefix``: the longest held prefix of the chain ``keys``): hard pins
        are never evicted, soft ones (``ttl_s``; default the node's) only as a last resort.
        Returns blocks pinned."""
        req = pb.PinRequest(keys=list(keys), prefix=prefix, hard=hard, ttl_s=ttl_s or 0.0)
        return self._call(self._stub.Pin, req).blocks

    def unpin(self, keys: Sequence[bytes], prefix: bool = False) -> int:
        """Drop pins (``prefix``: along the chain ``keys``); returns pins dropped."""
        return self._call(self._stub.Unpin, pb.UnpinRequest(keys=list(keys), prefix=prefix)).blocks

    def set_policy(self, policy: str, tier: str | None = None) -> dict[str, str]:
        """Switch the eviction policy of ``tier`` (default every tier); returns tier →
        previous policy. Raises InvalidArgument for an unknown policy or tier."""
        resp = self._call(self._stub.SetPolicy, pb.SetPolicyRequest(tier=tier or "", policy=policy))
        return dict(resp.previous)

    def snapshot(self) -> NodeSnapshot:
        """The node's index (every copy it holds) as of its KV event seq: what an index
        replica resynchronises from after a gap (kvstore/events)."""
        entries: list[tuple[bytes, str, int]] = []
        node, epoch, seq = "", 0, 0
        try:
            for i, chunk in enumerate(self._stub.Snapshot(pb.SnapshotRequest(), timeout=self.timeout_s,
                                                          metadata=self._meta)):
                if i == 0:
                    node, epoch, seq = chunk.node_id, chunk.epoch, chunk.seq
                entries.extend(zip(chunk.keys, chunk.tiers, chunk.sizes))
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None
        return NodeSnapshot(node, epoch, seq, tuple(entries))


def _put_chunks(blocks: Sequence[tuple[bytes, bytes]], chain: bool = False,
                parent: bytes | None = None) -> Iterator[pb.PutChunk]:
    for i, (key, data) in enumerate(blocks):
        view = memoryview(data)
        link = (blocks[i - 1][0] if i else parent) if chain else None
        yield pb.PutChunk(key=key, size=len(data), checksum=checksum_of(data), data=bytes(view[:CHUNK_BYTES]),
                          parent=link or b"")
        for off in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
            yield pb.PutChunk(data=bytes(view[off:off + CHUNK_BYTES]))


def _translate(exc: grpc.RpcError, address: str) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(detail)
    return Unavailable(f"store node at {address}: {code.name if code else 'error'}: {detail}")
