"""The store node's gRPC service: messages become domain types at the edge through
kvstore/wire/proto_codec.py, and kvstore errors become gRPC status codes through
kvstore/wire/errors.py. Block bytes travel in chunks of ``kvstore.wire.channel.CHUNK_BYTES``.
:class:`kvstore.node.StoreNode` serves this with the same-host control socket beside it."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from kvstore import __version__
from kvstore.auth import interceptors_for
from kvstore.dataplane.host import DataPlaneHost
from kvstore.errors import InvalidArgument, KVStoreError, LeaseExpired, QuotaExceeded
from kvstore.events.publisher import snapshot_of
from kvstore.limits import (
    MAX_OPEN_STREAMS,
    STREAM_IDLE_S,
    STREAM_WAIT_PER_MESSAGE_S,
    STREAM_WORKERS,
    check_count,
    check_key,
    check_keys,
    check_ttl,
)
from kvstore.pool.lease import Reservation
from kvstore.pool.pool import KVPool, PutResult
from kvstore.tiers.buffers import to_bytes
from kvstore.wire import proto_codec as codec
from kvstore.wire.channel import listen, server_options
from kvstore.wire.errors import grpc_abort, refusing
from kvstore.wire.stream_guard import UNPARSED, StreamGuard, StreamLane, StreamParseGuard
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvstore.metrics import StoreMetrics

log = logging.getLogger(__name__)
SNAPSHOT_CHUNK_ENTRIES = 8192        # index entries per Snapshot chunk (~0.5 MiB)
# A prefix-chain Get reads its chain in windows of about this many bytes (one leased pool
# read each), so that a long chain, or one key named many times, is never all in memory.
CHAIN_WINDOW_BYTES = 64 << 20


class StoreServicer(pb_grpc.KVStoreServicer):
    """Every call naming keys is checked first (kvstore/limits.py): key lengths the key spec
    makes, at most MAX_KEYS_PER_CALL keys, finite TTLs; a refusal is INVALID_ARGUMENT. Any
    other kvstore error ends a call with its own status (kvstore/wire/errors.py)."""

    def __init__(self, pool: KVPool, max_block_bytes: int = 1 << 30,
                 dataplane: DataPlaneHost | None = None) -> None:
        self.pool = pool
        self.max_block_bytes = max_block_bytes
        self.dataplane = dataplane  # the same-host data plane (kvstore/dataplane); None: no DRAM slab

    @refusing
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        check_keys(request.keys)
        return codec.lookup_response(self.pool.lookup(list(request.keys), codec.lookup_purpose_of(request),
                                                       codec.lookup_namespace_of(request)))

    def Put(self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext) -> pb.PutResponse:
        """Per block: reserve at its header chunk, write each data chunk as it arrives,
        commit at the next header or the end of the stream (the checksum sent is verified
        there). A stream that breaks — the client died or cancelled — before a block's
        bytes are all in aborts its open reservation: no visible key, and its space is free
        at once (a block whose bytes all came and whose checksum holds may still be stored
        when the client cancels after sending them). Refused, ending the stream: a chunk
        with neither key nor data (``INVALID_ARGUMENT``), a header before the previous
        block's bytes are all in (``INVALID_ARGUMENT``: one block reserved per stream at a
        time). A block not whole within the pool's reservation timeout is a failed result
        (its reservation expired); a writer that trickles is ended by :class:`StreamGuard`."""
        results: list[PutResult] = []
        namespace = _namespace_of(context)
        key: bytes | None = None
        res: Reservation | None = None   # the current block's reservation; None: skip its bytes
        size = got = 0
        error = ""

        def finish() -> None:
            nonlocal res
            if key is None:
                return
            if res is None:
                results.append(PutResult(key, False, error=error))
                return
            open_res, res = res, None
            try:
                results.append(self.pool.commit(open_res))
            except (KVStoreError, OSError) as exc:
                results.append(PutResult(key, False, error=str(exc)))

        try:
            for chunk in request_iterator:
                if chunk is UNPARSED:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a put chunk that does not parse as "
                                  "kvstore.v1.PutChunk")
                if chunk.key:
                    if key is not None and got < size:
                        grpc_abort(context, InvalidArgument(
                            f"block {key.hex()[:16]}: a header came after {got} of its {size} bytes; a block's "
                            f"bytes all come before the next block's header"))
                    finish()
                    key, size, checksum, parent = codec.put_header_of(chunk)
                    try:
                        check_key(key, "key")
                        check_key(parent or b"", "parent", allow_empty=True)
                    except InvalidArgument as exc:
                        grpc_abort(context, exc)
                    if size > self.max_block_bytes:
                        grpc_abort(context, InvalidArgument(f"block of {size} bytes; at most {self.max_block_bytes}"))
                    got, error = 0, ""
                    try:
                        res = self.pool.reserve(key, size, checksum, parent=parent, namespace=namespace)
                    except QuotaExceeded as exc:   # the blocks before it in the stream are stored
                        grpc_abort(context, exc)
                    except (KVStoreError, OSError) as exc:
                        res, error = None, str(exc)
                elif key is None:
                    grpc_abort(context, InvalidArgument("first chunk of a put carries no key"))
                elif not chunk.data:
                    grpc_abort(context, InvalidArgument(f"block {key.hex()[:16]}: a put chunk with neither a "
                                                        f"key nor data"))
                got += len(chunk.data)
                if got > size:
                    grpc_abort(context, InvalidArgument(f"block {key.hex()[:16]}: more bytes than its size {size}"))
                if res is not None and chunk.data:
                    try:
                        self.pool.write(res, chunk.data)
                    except (KVStoreError, OSError) as exc:
                        self.pool.abort(res)
                        res, error = None, str(exc)
            finish()
        finally:
            if res is not None:  # the stream broke mid-block (or the call was aborted)
                self.pool.abort(res)
        return pb.PutResponse(results=[codec.put_result(r) for r in results])

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        """A prefix-chain read (``stop_at_miss``) reads the chain in leased windows of about
        :data:`CHAIN_WINDOW_BYTES` (:meth:`_read_chain`); otherwise one read per block. A
        read whose lease expired is a miss. Each block goes with the checksum taken at put,
        so the reader verifies it end to end (bytes changed in the slab since are a miss at
        the reader, not passed on as good)."""
        try:
            check_keys(request.keys)
        except InvalidArgument as exc:
            grpc_abort(context, exc)
        keys = list(request.keys)
        if request.stop_at_miss:
            blocks: Iterator[tuple[bytes, int] | None] = self._read_chain(keys)
        else:
            blocks = (self._get_one(key) for key in keys)
        for key, got in zip(keys, blocks):
            if got is None:
                yield codec.missing_chunk(key)
                if request.stop_at_miss:
                    return
                continue
            yield from codec.get_chunks(key, *got)

    def _read_chain(self, keys: list[bytes]) -> Iterator[tuple[bytes, int] | None]:
        """(bytes, checksum) of each block of the chain ``keys``, head first, ending after
        the first None (a miss): leased pool reads of about :data:`CHAIN_WINDOW_BYTES` each
        (``max_bytes``: the pool stops a window by the sizes it holds), each going on from
        the last block the one before sent (``after``: linked to it, counted once)."""
        prev: bytes | None = None
        i = 0
        while i < len(keys):
            try:
                got = self.pool.read_many(keys[i:], to_bytes, stop_at_miss=True, chain=True, with_checksums=True,
                                          after=prev, max_bytes=CHAIN_WINDOW_BYTES)
            except LeaseExpired:
                got = [None]
            for block in got:
                yield block
                if block is None:
                    return
            i += len(got)
            prev = keys[i - 1]

    def _get_one(self, key: bytes) -> tuple[bytes, int] | None:
        try:
            got = self.pool.read_many([key], to_bytes, with_checksums=True)
        except LeaseExpired:
            return None
        return got[0]

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(node_id=self.pool.node_id, tiers=[codec.tier_stats(s) for s in self.pool.stats()])

    @refusing
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        freed, blocks = self.pool.evict(request.tier, request.bytes)
        return pb.EvictResponse(evicted_bytes=freed, evicted_blocks=blocks)

    @refusing
    def Scrub(self, request: pb.ScrubRequest, context: grpc.ServicerContext) -> pb.ScrubResponse:
        check_keys(request.keys)
        checked, dropped = self.pool.scrub(list(request.keys))
        return pb.ScrubResponse(checked=checked, dropped=dropped)

    @refusing
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        check_keys(request.keys)
        keys, ttl = list(request.keys), check_ttl(request.ttl_s)
        pin = self.pool.pin_prefix if request.prefix else self.pool.pin
        return pb.PinResponse(blocks=pin(keys, hard=request.hard, ttl_s=ttl))

    @refusing
    def Unpin(self, request: pb.UnpinRequest, context: grpc.ServicerContext) -> pb.UnpinResponse:
        check_keys(request.keys)
        keys = list(request.keys)
        unpin = self.pool.unpin_prefix if request.prefix else self.pool.unpin
        return pb.UnpinResponse(blocks=unpin(keys))

    @refusing
    def SetPolicy(self, request: pb.SetPolicyRequest, context: grpc.ServicerContext) -> pb.SetPolicyResponse:
        previous = self.pool.set_policy(request.policy, request.tier or None)
        return pb.SetPolicyResponse(previous=previous)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(status="SERVING", node_id=self.pool.node_id, version=__version__)

    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> Iterator[pb.SnapshotChunk]:
        snap = snapshot_of(self.pool.index, self.pool.node_id)
        entries = snap.entries
        for start in range(0, max(len(entries), 1), SNAPSHOT_CHUNK_ENTRIES):
            part = entries[start:start + SNAPSHOT_CHUNK_ENTRIES]
            head: dict[str, Any] = dict(node_id=snap.node, epoch=snap.epoch, seq=snap.seq) if start == 0 else {}
            yield pb.SnapshotChunk(keys=[e[0] for e in part], tiers=[e[1] for e in part],
                                   sizes=[e[2] for e in part], **head)


    # -- the same-host data plane (kvstore/dataplane): control only, bytes go through the slab
    def _plane(self, context: grpc.ServicerContext) -> DataPlaneHost:
        if self.dataplane is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node has no DRAM slab to map")
        return self.dataplane

    def DataPlaneInfo(self, request: pb.DataPlaneInfoRequest,
                      context: grpc.ServicerContext) -> pb.DataPlaneInfoResponse:
        info = None if self.dataplane is None else self.dataplane.info()
        return codec.dataplane_info(info, self.pool.node_id)

    @refusing
    def LeaseBlocks(self, request: pb.LeaseBlocksRequest, context: grpc.ServicerContext) -> pb.LeaseBlocksResponse:
        check_keys(request.keys)
        return codec.lease_response(self._plane(context).lease_for(codec.lease_request_of(request)))

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(released=self._plane(context).release(request.lease_id))

    @refusing
    def ReserveBlocks(self, request: pb.ReserveBlocksRequest,
                      context: grpc.ServicerContext) -> pb.ReserveBlocksResponse:
        try:
            req = codec.reserve_request_of(request)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        check_keys(request.keys)
        check_key(request.parent, "parent", allow_empty=True)
        return codec.reserve_response(self._plane(context).reserve_for(req))

    @refusing
    def CommitBlocks(self, request: pb.CommitBlocksRequest, context: grpc.ServicerContext) -> pb.CommitBlocksResponse:
        check_count(len(request.reservation_ids), "reservation_ids")
        if request.checksums and len(request.checksums) != len(request.reservation_ids):
            raise InvalidArgument("checksums and reservation_ids differ in length")
        namespace = codec.commit_namespace_of(request)
        return codec.commit_response(self._plane(context).commit(list(request.reservation_ids),
                                                                 checksums=list(request.checksums) or None,
                                                                 namespace=namespace))

    @refusing
    def AbortBlocks(self, request: pb.AbortBlocksRequest, context: grpc.ServicerContext) -> pb.AbortBlocksResponse:
        check_count(len(request.reservation_ids), "reservation_ids")
        self._plane(context).abort(list(request.reservation_ids))
        return pb.AbortBlocksResponse()


def _namespace_of(context: grpc.ServicerContext) -> str | None:
    """The tenant a Put's blocks belong to: its ``kvstore-namespace`` metadata
    (kvstore/pool/tenants.py), None without one. A malformed one aborts INVALID_ARGUMENT."""
    from kvstore.pool.quotas import check_namespace
    from kvstore.pool.tenants import NAMESPACE_METADATA
    value = codec.namespace_of(context.invocation_metadata())
    if not value:
        return None
    try:
        return check_namespace(value)
    except InvalidArgument as exc:
        grpc_abort(context, InvalidArgument(f"{NAMESPACE_METADATA} metadata: {exc}"))


def grpc_server(pool: KVPool, address: str = "127.0.0.1:0", auth_token: str | None = None, workers: int = 8,
                extra_services: tuple = (), dataplane: DataPlaneHost | None = None,
                metrics: StoreMetrics | None = None) -> tuple[grpc.Server, int]:
    """Start the store service of ``pool`` on ``address`` (host:port; port 0 picks a free
    one), the token interceptor first. ``extra_services``: callables ``add(server)`` that
    register more servicers on the same server (e.g. kvstore/transfer's BlockTransfer).
    ``dataplane``: the same-host data plane its control calls go to (None: none);
    ``metrics``: a :class:`kvstore.metrics.StoreMetrics` that times Put, Get and the data
    plane's control ops. ``workers``: the server's threads for every call but streams;
    streams (Put, Get, Snapshot) run on :data:`~kvstore.limits.STREAM_WORKERS` threads of
    their own, are ended when idle :data:`~kvstore.limits.STREAM_IDLE_S` (or trickling:
    :data:`~kvstore.limits.STREAM_WAIT_PER_MESSAGE_S`), and at most
    :data:`~kvstore.limits.MAX_OPEN_STREAMS` are open (:class:`StreamGuard`). Returns the
    started server and its bound port. Raises RuntimeError if it cannot bind."""
    lane = StreamLane(STREAM_WORKERS)
    interceptors = interceptors_for(auth_token) + [StreamParseGuard(),
                                                   StreamGuard(lane, STREAM_IDLE_S, MAX_OPEN_STREAMS,
                                                                STREAM_WAIT_PER_MESSAGE_S)]
    if metrics is not None:
        interceptors.append(metrics.interceptor())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(),
                         interceptors=interceptors)
    if metrics is not None and dataplane is not None:
        metrics.watch_dataplane(dataplane)
    pb_grpc.add_KVStoreServicer_to_server(StoreServicer(pool, dataplane=dataplane), server)
    for add in extra_services:
        add(server)
    port = listen(server, address, "store")
    server.start()
    log.info("store node %s listening on %s (port %d)", pool.node_id, address, port)
    return server, port


def serve_store(pool: KVPool, address: str = "127.0.0.1:0", auth_token: str | None = None,
                workers: int = 8, extra_services: tuple = (),
                metrics: StoreMetrics | None = None) -> tuple[grpc.Server, int]:
    """:func:`grpc_server` with the same-host data plane over gRPC (when ``pool`` has a DRAM
    tier) and no Unix control socket; :meth:`kvstore.node.StoreNode.serve` adds the socket.
    Returns the started server and its bound port."""
    return grpc_server(pool, address, auth_token, workers, extra_services, DataPlaneHost.for_pool(pool), metrics)
