"""The codec of a store node's gRPC API (protos/kvstore.proto): every message ↔ the domain
types of kvstore/wire/types.py, both directions, in this one module. The servicer
(kvstore/service.py), :class:`~kvstore.client.StoreClient`, the same-host control over gRPC
(kvstore/dataplane/grpc_control.py) and the transfer-engine reader's gRPC fallback
(kvstore/transfer/te_transport.py) all go through it; errors go through
kvstore/wire/errors.py. Block bytes travel in chunks of
:data:`~kvstore.wire.channel.CHUNK_BYTES`.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from typing import Any

from kvstore.integrity import checksum_of
from kvstore.pool.quotas import check_namespace
from kvstore.pool.tenants import NAMESPACE_METADATA
from kvstore.wire.channel import CHUNK_BYTES
from kvstore.wire.types import (
    BlockLocation,
    DataPlaneInfo,
    LeaseGrant,
    LeaseRequest,
    LookupResult,
    PutResult,
    ReserveRequest,
    SlotGrant,
    TierStats,
    chain_parents,
)
from protos import kvstore_pb2 as pb

_TIER_FIELDS = tuple(f.name for f in fields(TierStats))


# -- Lookup ------------------------------------------------------------------------------------
_PURPOSES = {"reuse": pb.LOOKUP_REUSE, "handoff": pb.LOOKUP_HANDOFF, "probe": pb.LOOKUP_PROBE}
_PURPOSE_NAMES = {v: k for k, v in _PURPOSES.items()}


def lookup_request(keys: Sequence[bytes], purpose: str = "reuse", namespace: str | None = None) -> pb.LookupRequest:
    """``purpose``: reuse, handoff or probe (kvstore/pool/reads.py); raises KeyError for
    another. ``namespace``: the tenant looking, for its lookup books (None: not said)."""
    return pb.LookupRequest(keys=list(keys), purpose=_PURPOSES[purpose], namespace=namespace or "")


def lookup_namespace_of(request: pb.LookupRequest) -> str | None:
    """The tenant a Lookup names (None: none); raises InvalidArgument for a malformed one."""
    return check_namespace(request.namespace) if request.namespace else None


def lookup_purpose_of(request: pb.LookupRequest) -> str:
    """The request's purpose; a value this node does not know counts as a probe (nothing)."""
    return _PURPOSE_NAMES.get(request.purpose, "probe")


def lookup_response(result: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(prefix_blocks=result.blocks, tiers=result.tiers)


def lookup_of(resp: pb.LookupResponse) -> LookupResult:
    return LookupResult(resp.prefix_blocks, tuple(resp.tiers))


# -- Put: a stream of chunks, one header chunk per block -----------------------------------------
def put_chunks(blocks: Sequence[tuple[bytes, Any]], chain: bool = False,
               parent: bytes | None = None) -> Iterator[pb.PutChunk]:
    """The chunks of a batched put of ``blocks`` = (key, bytes-like): per block a header
    chunk (key, size, checksum, chain parent, the first bytes), then data chunks."""
    parents = chain_parents([k for k, _ in blocks], chain, parent)
    for (key, data), link in zip(blocks, parents):
        view = memoryview(data)
        yield pb.PutChunk(key=key, size=view.nbytes, checksum=checksum_of(data), data=bytes(view[:CHUNK_BYTES]),
                          parent=link or b"")
        for off in range(CHUNK_BYTES, view.nbytes, CHUNK_BYTES):
            yield pb.PutChunk(data=bytes(view[off:off + CHUNK_BYTES]))


def namespace_metadata(namespace: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata naming a put's tenant (``kvstore-namespace``, kvstore/pool/tenants.py);
    empty without one."""
    return ((NAMESPACE_METADATA, namespace),) if namespace else ()


def namespace_of(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The tenant a put's call metadata names, None without one (not yet checked)."""
    value = dict(metadata or ()).get(NAMESPACE_METADATA)
    return str(value) if value else None


def put_header_of(chunk: pb.PutChunk) -> tuple[bytes, int, int, bytes | None]:
    """(key, size, checksum, parent or None) of a block's header chunk."""
    return chunk.key, chunk.size, chunk.checksum, chunk.parent or None


def put_result(r: PutResult) -> pb.PutResult:
    return pb.PutResult(key=r.key, ok=r.ok, existed=r.existed, error=r.error)


def put_results_of(results: Iterable[pb.PutResult], keys: Sequence[bytes] | None = None) -> list[PutResult]:
    """The results of a put or a commit; ``keys``: name them so (a commit's replies carry none)."""
    if keys is None:
        return [PutResult(r.key, r.ok, r.existed, r.error) for r in results]
    return [PutResult(k, r.ok, r.existed, r.error) for k, r in zip(keys, results)]


# -- Get: a stream of chunks, one header chunk per block (or one "missing" chunk) ----------------
def get_chunks(key: bytes, data: Any, checksum: int) -> Iterator[pb.GetChunk]:
    """The chunks of one block held: a header (key, size, checksum, first bytes), then data."""
    view = memoryview(data)
    yield pb.GetChunk(key=key, size=view.nbytes, checksum=checksum, offset=0, data=bytes(view[:CHUNK_BYTES]))
    for off in range(CHUNK_BYTES, view.nbytes, CHUNK_BYTES):
        yield pb.GetChunk(offset=off, data=bytes(view[off:off + CHUNK_BYTES]))


def missing_chunk(key: bytes) -> pb.GetChunk:
    return pb.GetChunk(key=key, missing=True)


def blocks_of(chunks: Iterable[pb.GetChunk], bad: list[bytes] | None = None) -> list[bytes | None]:
    """The blocks of a Get stream, in order: bytes, or None for a miss and for a block whose
    bytes do not match the checksum sent with it (verified after crossing the wire; its key
    is appended to ``bad`` when given)."""
    out: list[bytes | None] = []
    key = b""
    buf = bytearray()
    size = checksum = 0
    started = False

    def finish() -> None:
        if started:
            ok = len(buf) == size and checksum_of(buf) == checksum
            out.append(bytes(buf) if ok else None)
            if not ok and bad is not None:
                bad.append(key)

    for chunk in chunks:
        if chunk.missing:
            finish()
            started = False
            out.append(None)
        elif chunk.key:
            finish()
            started, key, size, checksum = True, chunk.key, chunk.size, chunk.checksum
            buf = bytearray(chunk.data)
        else:
            buf += chunk.data
    finish()
    return out


# -- Stats -------------------------------------------------------------------------------------
def tier_stats(s: TierStats) -> pb.TierStats:
    """Field for field (TierStats and the message share their field names)."""
    return pb.TierStats(**{name: getattr(s, name) for name in _TIER_FIELDS})


def tier_stats_of(t: pb.TierStats) -> TierStats:
    values = {name: getattr(t, name) for name in _TIER_FIELDS}
    values["device"] = values["device"] or "cpu"
    return TierStats(**values)


# -- the same-host data plane: leases and reservations ---------------------------------------------
def dataplane_info(info: DataPlaneInfo | None, node_id: str) -> pb.DataPlaneInfoResponse:
    if info is None:
        return pb.DataPlaneInfoResponse(available=False, node_id=node_id)
    return pb.DataPlaneInfoResponse(available=True, slab_name=info.slab_name, slab_bytes=info.slab_bytes,
                                    socket_path=info.socket_path, host_id=info.host_id, node_id=info.node_id,
                                    puts_in_slab=info.puts_in_slab)


def dataplane_info_of(resp: pb.DataPlaneInfoResponse) -> DataPlaneInfo | None:
    """None when the node has no slab to map."""
    if not resp.available:
        return None
    return DataPlaneInfo(resp.slab_name, resp.slab_bytes, resp.socket_path, resp.host_id, resp.node_id,
                         resp.puts_in_slab)


def lease_request(req: LeaseRequest) -> pb.LeaseBlocksRequest:
    return pb.LeaseBlocksRequest(keys=list(req.keys), ttl_s=req.ttl_s or 0.0, stop_at_miss=req.stop_at_miss,
                                 chain=req.chain)


def lease_request_of(m: pb.LeaseBlocksRequest) -> LeaseRequest:
    return LeaseRequest(list(m.keys), m.ttl_s or None, m.stop_at_miss, m.chain)


def lease_response(g: LeaseGrant) -> pb.LeaseBlocksResponse:
    return pb.LeaseBlocksResponse(lease_id=g.lease_id, deadline=g.deadline, blocks=[
        pb.LeasedBlock(state=b.state, offset=b.offset, size=b.size, checksum=b.checksum) for b in g.blocks])


def lease_grant_of(resp: pb.LeaseBlocksResponse) -> LeaseGrant:
    return LeaseGrant(resp.lease_id, resp.deadline,
                      [BlockLocation(b.state, b.offset, b.size, b.checksum) for b in resp.blocks])


def reserve_request(req: ReserveRequest) -> pb.ReserveBlocksRequest:
    return pb.ReserveBlocksRequest(keys=[k for k, _ in req.items], sizes=[s for _, s in req.items],
                                   chain=req.chain, parent=req.parent or b"", namespace=req.namespace or "")


def reserve_request_of(m: pb.ReserveBlocksRequest) -> ReserveRequest:
    """Raises ValueError when keys and sizes differ in length, InvalidArgument for a
    malformed namespace."""
    if len(m.keys) != len(m.sizes):
        raise ValueError("keys and sizes differ in length")
    return ReserveRequest(list(zip(m.keys, m.sizes)), m.chain, m.parent or None,
                          check_namespace(m.namespace) if m.namespace else None)


def reserve_response(grants: Sequence[SlotGrant]) -> pb.ReserveBlocksResponse:
    return pb.ReserveBlocksResponse(slots=[pb.ReservedSlot(state=g.state, reservation_id=g.res_id, offset=g.offset,
                                                           error=g.error, write_by=g.write_by) for g in grants])


def slots_of(resp: pb.ReserveBlocksResponse) -> list[SlotGrant]:
    return [SlotGrant(s.state, s.reservation_id, s.offset, s.error, s.write_by) for s in resp.slots]


def commit_request(res_ids: Sequence[int], checksums: Sequence[int] | None,
                   namespace: str | None = None) -> pb.CommitBlocksRequest:
    return pb.CommitBlocksRequest(reservation_ids=list(res_ids), checksums=list(checksums or ()),
                                  namespace=namespace or "")


def commit_namespace_of(m: pb.CommitBlocksRequest) -> str | None:
    """The tenant a CommitBlocks assigns its blocks to (None: as reserved); raises
    InvalidArgument for a malformed one."""
    return check_namespace(m.namespace) if m.namespace else None


def commit_response(results: Sequence[PutResult]) -> pb.CommitBlocksResponse:
    return pb.CommitBlocksResponse(results=[put_result(r) for r in results])
