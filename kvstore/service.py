"""The store node's gRPC service: converts messages to domain types at the edge and maps
kvstore errors to gRPC status codes. Block bytes travel in chunks of ``CHUNK_BYTES``."""
from __future__ import annotations

import functools
import logging
from concurrent import futures
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from kvstore import __version__
from kvstore.auth import interceptors_for
from kvstore.dataplane.host import DataPlaneHost
from kvstore.errors import InvalidArgument, KVStoreError, LeaseExpired, QuotaExceeded
from kvstore.events.publisher import snapshot_of
from kvstore.lease import Reservation
from kvstore.limits import check_count, check_key, check_keys, check_ttl
from kvstore.pool import KVPool
from kvstore.tiers.buffers import to_bytes
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvstore.metrics import StoreMetrics

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
SNAPSHOT_CHUNK_ENTRIES = 8192        # index entries per Snapshot chunk (~0.5 MiB)
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
                # a client finds a restarted peer within 0.1-2 s (gRPC's default backs off to 120 s)
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000)]
# Servers refuse a port already in use (gRPC sets SO_REUSEPORT by default, which would let a
# second node share the port and take half its connections).
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.so_reuseport", 0)]


def _refusing(method: Callable[..., Any]) -> Callable[..., Any]:
    """A unary servicer method whose InvalidArgument (raised anywhere under it) is answered
    as INVALID_ARGUMENT with its message, instead of gRPC's UNKNOWN."""
    @functools.wraps(method)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return call


class StoreServicer(pb_grpc.KVStoreServicer):
    """Every call naming keys is checked first (kvstore/limits.py): key lengths the key spec
    makes, at most MAX_KEYS_PER_CALL keys, finite TTLs; a refusal is INVALID_ARGUMENT."""

    def __init__(self, pool: KVPool, max_block_bytes: int = 1 << 30,
                 dataplane: DataPlaneHost | None = None) -> None:
        self.pool = pool
        self.max_block_bytes = max_block_bytes
        self.dataplane = dataplane  # the same-host data plane (kvstore/dataplane); None: no DRAM slab

    @_refusing
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        check_keys(request.keys)
        n, tiers = self.pool.lookup(list(request.keys))
        return pb.LookupResponse(prefix_blocks=n, tiers=tiers)

    def Put(self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext) -> pb.PutResponse:
        """Per block: reserve at its header chunk, write each data chunk as it arrives,
        commit at the next header or the end of the stream (the checksum sent is verified
        there). A stream that breaks — the client died or cancelled — aborts the open
        reservation: no visible key, and its space is free at once."""
        results: list[pb.PutResult] = []
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
                results.append(pb.PutResult(key=key, ok=False, error=error))
                return
            open_res, res = res, None
            try:
                r = self.pool.commit(open_res)
                results.append(pb.PutResult(key=key, ok=r.ok, existed=r.existed, error=r.error))
            except (KVStoreError, OSError) as exc:
                results.append(pb.PutResult(key=key, ok=False, error=str(exc)))

        try:
            for chunk in request_iterator:
                if chunk is UNPARSED:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a put chunk that does not parse as "
                                  "kvstore.v1.PutChunk")
                if chunk.key:
                    finish()
                    try:
                        check_key(chunk.key, "key")
                        check_key(chunk.parent, "parent", allow_empty=True)
                    except InvalidArgument as exc:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    if chunk.size > self.max_block_bytes:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"block of {chunk.size} bytes; at most {self.max_block_bytes}")
                    key, size, got, error = chunk.key, chunk.size, 0, ""
                    try:
                        res = self.pool.reserve(key, size, chunk.checksum, parent=chunk.parent or None,
                                                namespace=namespace)
                    except QuotaExceeded as exc:   # the blocks before it in the stream are stored
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                    except (KVStoreError, OSError) as exc:
                        res, error = None, str(exc)
                elif key is None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first chunk of a put carries no key")
                got += len(chunk.data)
                if got > size:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"block {key.hex()[:16]}: more bytes than its size {size}")
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
        return pb.PutResponse(results=results)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        """A prefix-chain read (``stop_at_miss``) is one leased pool read of the chain;
        otherwise one read per block. A read whose lease expired is a miss. Each block goes
        with the checksum taken at put, so the reader verifies it end to end (bytes changed
        in the slab since are a miss at the reader, not passed on as good)."""
        try:
            check_keys(request.keys)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        keys = list(request.keys)
        if request.stop_at_miss:
            try:
                blocks: Iterator[tuple[bytes, int] | None] = iter(
                    self.pool.read_many(keys, to_bytes, stop_at_miss=True, chain=True, with_checksums=True))
            except LeaseExpired:
                blocks = iter([None])
        else:
            blocks = (self._get_one(key) for key in keys)
        for key, got in zip(keys, blocks):
            if got is None:
                yield pb.GetChunk(key=key, missing=True)
                if request.stop_at_miss:
                    return
                continue
            data, checksum = got
            view = memoryview(data)
            for off in range(0, max(len(data), 1), CHUNK_BYTES):
                if off == 0:
                    yield pb.GetChunk(key=key, size=len(data), checksum=checksum, offset=0,
                                      data=bytes(view[:CHUNK_BYTES]))
                else:
                    yield pb.GetChunk(offset=off, data=bytes(view[off:off + CHUNK_BYTES]))

    def _get_one(self, key: bytes) -> tuple[bytes, int] | None:
        try:
            got = self.pool.read_many([key], to_bytes, with_checksums=True)
        except LeaseExpired:
            return None
        return got[0]

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(node_id=self.pool.node_id, tiers=[
            pb.TierStats(name=s.name, device=s.device, capacity_bytes=s.capacity_bytes,
                         used_bytes=s.used_bytes, blocks=s.blocks, hits=s.hits, misses=s.misses,
                         evictions=s.evictions, demotions=s.demotions, promotions=s.promotions,
                         integrity_failures=s.integrity_failures, leased_bytes=s.leased_bytes,
                         pinned_bytes=s.pinned_bytes, reserved_bytes=s.reserved_bytes, policy=s.policy,
                         quarantines=s.quarantines)
            for s in self.pool.stats()])

    @_refusing
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        try:
            freed, blocks = self.pool.evict(request.tier, request.bytes)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.EvictResponse(evicted_bytes=freed, evicted_blocks=blocks)

    @_refusing
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        check_keys(request.keys)
        keys, ttl = list(request.keys), check_ttl(request.ttl_s)
        pin = self.pool.pin_prefix if request.prefix else self.pool.pin
        return pb.PinResponse(blocks=pin(keys, hard=request.hard, ttl_s=ttl))

    @_refusing
    def Unpin(self, request: pb.UnpinRequest, context: grpc.ServicerContext) -> pb.UnpinResponse:
        check_keys(request.keys)
        keys = list(request.keys)
        unpin = self.pool.unpin_prefix if request.prefix else self.pool.unpin
        return pb.UnpinResponse(blocks=unpin(keys))

    @_refusing
    def SetPolicy(self, request: pb.SetPolicyRequest, context: grpc.ServicerContext) -> pb.SetPolicyResponse:
        try:
            previous = self.pool.set_policy(request.policy, request.tier or None)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.SetPolicyResponse(previous=previous)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(status="SERVING", node_id=self.pool.node_id, version=__version__)

    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> Iterator[pb.SnapshotChunk]:
        snap = snapshot_of(self.pool.index, self.pool.node_id)
        entries = snap.entries
        for start in range(0, max(len(entries), 1), SNAPSHOT_CHUNK_ENTRIES):
            part = entries[start:start + SNAPSHOT_CHUNK_ENTRIES]
            head = dict(node_id=snap.node, epoch=snap.epoch, seq=snap.seq) if start == 0 else {}
            yield pb.SnapshotChunk(keys=[e[0] for e in part], tiers=[e[1] for e in part],
                                   sizes=[e[2] for e in part], **head)


    # -- the same-host data plane (kvstore/dataplane): control only, bytes go through the slab
    def _plane(self, context: grpc.ServicerContext) -> DataPlaneHost:
        if self.dataplane is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node has no DRAM slab to map")
        return self.dataplane  # type: ignore[return-value]

    def DataPlaneInfo(self, request: pb.DataPlaneInfoRequest, context: grpc.ServicerContext) -> pb.DataPlaneInfoResponse:
        if self.dataplane is None:
            return pb.DataPlaneInfoResponse(available=False, node_id=self.pool.node_id)
        i = self.dataplane.info()
        return pb.DataPlaneInfoResponse(available=True, slab_name=i.slab_name, slab_bytes=i.slab_bytes,
                                        socket_path=i.socket_path, host_id=i.host_id, node_id=i.node_id,
                                        puts_in_slab=i.puts_in_slab)

    @_refusing
    def LeaseBlocks(self, request: pb.LeaseBlocksRequest, context: grpc.ServicerContext) -> pb.LeaseBlocksResponse:
        check_keys(request.keys)
        g = self._plane(context).lease(list(request.keys), request.ttl_s or None, request.stop_at_miss,
                                       request.chain)
        return pb.LeaseBlocksResponse(lease_id=g.lease_id, deadline=g.deadline, blocks=[
            pb.LeasedBlock(state=b.state, offset=b.offset, size=b.size, checksum=b.checksum) for b in g.blocks])

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(released=self._plane(context).release(request.lease_id))

    @_refusing
    def ReserveBlocks(self, request: pb.ReserveBlocksRequest, context: grpc.ServicerContext) -> pb.ReserveBlocksResponse:
        if len(request.keys) != len(request.sizes):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "keys and sizes differ in length")
        check_keys(request.keys)
        check_key(request.parent, "parent", allow_empty=True)
        grants = self._plane(context).reserve(list(zip(request.keys, request.sizes)), request.chain,
                                              request.parent or None)
        return pb.ReserveBlocksResponse(slots=[pb.ReservedSlot(state=g.state, reservation_id=g.res_id,
                                                               offset=g.offset, error=g.error, write_by=g.write_by)
                                               for g in grants])

    @_refusing
    def CommitBlocks(self, request: pb.CommitBlocksRequest, context: grpc.ServicerContext) -> pb.CommitBlocksResponse:
        check_count(len(request.reservation_ids), "reservation_ids")
        if request.checksums and len(request.checksums) != len(request.reservation_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "checksums and reservation_ids differ in length")
        results = self._plane(context).commit(list(request.reservation_ids),
                                              checksums=list(request.checksums) or None)
        return pb.CommitBlocksResponse(results=[pb.PutResult(key=r.key, ok=r.ok, existed=r.existed, error=r.error)
                                                for r in results])

    @_refusing
    def AbortBlocks(self, request: pb.AbortBlocksRequest, context: grpc.ServicerContext) -> pb.AbortBlocksResponse:
        check_count(len(request.reservation_ids), "reservation_ids")
        self._plane(context).abort(list(request.reservation_ids))
        return pb.AbortBlocksResponse()


def _namespace_of(context: grpc.ServicerContext) -> str | None:
    """The tenant a Put's blocks belong to: its ``kvstore-namespace`` metadata
    (kvstore/tenants.py), None without one. A malformed one aborts INVALID_ARGUMENT."""
    from kvstore.quotas import check_namespace
    from kvstore.tenants import NAMESPACE_METADATA
    value = dict(context.invocation_metadata() or ()).get(NAMESPACE_METADATA)
    if not value:
        return None
    try:
        return check_namespace(str(value))
    except InvalidArgument as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{NAMESPACE_METADATA} metadata: {exc}")
    return None


UNPARSED = object()  # a client-streamed message that did not parse (see _StreamParseGuard)


class _StreamParseGuard(grpc.ServerInterceptor):
    """gRPC (1.85) answers a client-streamed message that does not parse by sending the
    call's status itself and ending the handler's request iterator; the handler's reply is
    then a second status on that call, whose batch never completes, and the server never
    stops (``server.stop()`` hung after one such Put, found by tests/test_fuzz_store_grpc.py).
    This wraps the deserializer of client-streamed requests: a message that does not parse
    arrives as :data:`UNPARSED`, and the handler refuses it (INVALID_ARGUMENT)."""

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or not handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def safe(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError:
                return UNPARSED
        return handler._replace(request_deserializer=safe)


_UDS: dict[int, object] = {}  # id(server) -> its same-host control socket (kvstore/dataplane/server.py)


def close_dataplane(server: grpc.Server) -> None:
    """Close the Unix control socket :func:`serve_store` opened for ``server`` (if any);
    the clients' leases and reservations on it end."""
    uds = _UDS.pop(id(server), None)
    if uds is not None:
        uds.close()  # type: ignore[attr-defined]


def serve_store(pool: KVPool, address: str = "127.0.0.1:0", auth_token: str | None = None,
                workers: int = 8, extra_services: tuple = (),
                dataplane_socket: str | None = None, dataplane_poll_s: float = 200e-6,
                metrics: StoreMetrics | None = None) -> tuple[grpc.Server, int]:
    """Start the store service on ``address`` (host:port; port 0 picks a free one).
    ``extra_services``: callables ``add(server)`` that register more servicers on the same
    server (e.g. kvstore/transfer's BlockTransfer). ``dataplane_socket``: also serve the
    same-host control channel on this Unix socket path (close it with
    :func:`close_dataplane`); ``dataplane_poll_s``: how long its connections poll for the
    next request before sleeping; ``metrics``: a :class:`kvstore.metrics.StoreMetrics` that
    times Put, Get and the data plane's control ops. Returns the started server and its
    bound port. Raises RuntimeError if it cannot bind."""
    interceptors = interceptors_for(auth_token) + [_StreamParseGuard()]
    if metrics is not None:
        interceptors.append(metrics.interceptor())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS,
                         interceptors=interceptors)
    dataplane = DataPlaneHost.for_pool(pool, dataplane_socket or "")
    if metrics is not None and dataplane is not None:
        metrics.watch_dataplane(dataplane)
    pb_grpc.add_KVStoreServicer_to_server(StoreServicer(pool, dataplane=dataplane), server)
    for add in extra_services:
        add(server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"store: cannot listen on {address} (port in use or address not local)")
    server.start()
    if dataplane is not None and dataplane_socket:
        from kvstore.dataplane.server import UdsServer
        _UDS[id(server)] = UdsServer(dataplane, dataplane_socket, auth_token, dataplane_poll_s)
    log.info("store node %s listening on %s (port %d)", pool.node_id, address, port)
    return server, port
