"""The store node's gRPC service: messages become domain types at the edge through
kvstore/wire/proto_codec.py, and kvstore errors become gRPC status codes through
kvstore/wire/errors.py. Block bytes travel in chunks of ``kvstore.wire.channel.CHUNK_BYTES``.
:class:`kvstore.node.StoreNode` serves this with the same-host control socket beside it."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from kvstore import __version__
from kvstore.auth import interceptors_for
from kvstore.dataplane.host import DataPlaneHost
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, LeaseExpired, QuotaExceeded
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
from kvstore.wire.channel import CHUNK_BYTES, SERVER_OPTIONS, listen
from kvstore.wire.errors import grpc_abort, refusing
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
        (its reservation expired); a writer that trickles is ended by :class:`_StreamGuard`."""
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


UNPARSED = object()  # a client-streamed message that did not parse (see _StreamParseGuard)


class _StreamParseGuard(grpc.ServerInterceptor):
    """gRPC (1.85) answers a client-streamed message that does not parse by sending the
    call's status itself and ending the handler's request iterator; the handler's reply is
    then a second status on that call, whose batch never completes, and the server never
    stops (``server.stop()`` hung after one such Put, found by tests/kvstore/test_fuzz_store_grpc.py).
    This wraps the deserializer of client-streamed requests: a message that does not parse
    arrives as :data:`UNPARSED`, and the handler refuses it (INVALID_ARGUMENT)."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
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


class _StreamLane(futures.ThreadPoolExecutor):
    """The threads streamed calls run on. :meth:`open`: the streams handed to it and not yet
    done — running, or queued for a thread while their caller still waits (a queued call
    whose caller cancelled or timed out does not count: it ends as soon as a thread takes
    it, and counting it refused new streams for as long as slow ones held every thread)."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="kvstore-stream")
        self.running = 0
        self._queued: dict[int, Any] = {}    # id -> the call's gRPC state (``client``: open or not)
        self._ids = itertools.count()
        self._count = threading.Lock()

    def open(self) -> int:
        with self._count:
            return self.running + sum(1 for state in self._queued.values()
                                      if getattr(state, "client", "open") == "open")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        # gRPC submits (context.run, handler-in-pool, rpc_event, state, ...): its private
        # _RPCState says whether the caller is still there (grpc 1.85's _server.py).
        state = args[2] if len(args) > 2 else None
        call_id = next(self._ids)

        def run() -> Any:
            with self._count:
                self._queued.pop(call_id, None)
                self.running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._count:
                    self.running -= 1
        with self._count:
            self._queued[call_id] = state
        try:
            return super().submit(run)
        except BaseException:
            with self._count:
                self._queued.pop(call_id, None)
            raise


class _Watch:
    """One running stream: ``since`` is when it began waiting on its peer (for the next
    request message, or for the peer to take the last response: flow control); None while
    the node itself works. ``waited``: the seconds it waited on its peer before, in all;
    ``moved``: the messages that came or went."""
    __slots__ = ("context", "method", "since", "waited", "moved")

    def __init__(self, context: grpc.ServicerContext, method: str) -> None:
        self.context, self.method = context, method
        self.since: float | None = None
        self.waited = 0.0
        self.moved = 0

    def _done_waiting(self) -> None:
        if self.since is not None:
            self.waited += time.monotonic() - self.since
            self.since = None
        self.moved += 1

    def requests(self, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            self.since = time.monotonic()
            try:
                item = next(it, _END)
            finally:
                self._done_waiting()
            if item is _END:
                return
            yield item

    def responses(self, it: Iterator[Any]) -> Iterator[Any]:
        for item in it:          # the servicer making the next message: not idle
            self.since = time.monotonic()
            try:
                yield item       # returns once gRPC has sent it: the peer is reading
            finally:
                self._done_waiting()

    def overdue(self, now: float, idle_s: float, per_message_s: float) -> str | None:
        """Why the stream is ended now, or None: waiting on its peer for more than
        ``idle_s`` at once, or for more than ``idle_s`` plus ``per_message_s`` per message
        moved in all (a peer that trickles)."""
        if self.since is None:
            return None
        if now - self.since > idle_s:
            return f"no progress for {idle_s:g} s (the store node's stream idle limit, STREAM_IDLE_S)"
        if self.waited + (now - self.since) > idle_s + per_message_s * self.moved:
            return (f"waited {self.waited + now - self.since:.1f} s on its peer over {self.moved} messages; a stream "
                    f"may wait {idle_s:g} s plus {per_message_s:g} s per message in all (STREAM_IDLE_S, "
                    f"STREAM_WAIT_PER_MESSAGE_S: a peer slower than about "
                    f"{CHUNK_BYTES / per_message_s / (1 << 20):.3g} MiB/s)")
        return None


_END = object()


class _StreamGuard(grpc.ServerInterceptor):
    """Streamed calls (Put, Get, Snapshot) run on ``lane``'s threads (gRPC's
    ``experimental_thread_pool`` of a behavior, as its own health service uses), so however
    many streams are open, or stalled, the server's own threads keep answering every other
    call. A stream waiting on its peer for more than ``idle_s`` at once, or for more than
    ``idle_s`` plus ``per_message_s`` per message moved in all (a peer that trickles), is
    ended by a watchdog thread (running while any stream is): ``DEADLINE_EXCEEDED`` naming
    the limit; a Put's request iterator then raises and the Put aborts its open
    reservation. A server-streamed
    call takes its request through the stream (handled as stream-stream), so a request that
    never comes is timed too. With ``max_open`` streams open, one more is refused at once
    (``RESOURCE_EXHAUSTED``). Limits: kvstore/limits.py."""

    def __init__(self, lane: _StreamLane, idle_s: float, max_open: int, per_message_s: float) -> None:
        self.lane, self.idle_s, self.max_open, self.per_message_s = lane, idle_s, max_open, per_message_s
        self._lock = threading.Lock()
        self._watches: set[_Watch] = set()
        self._watching = False

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = handler_call_details.method
        if self.lane.open() >= self.max_open:
            return self._refusal(handler, method)
        if handler.stream_unary is not None:
            stream_unary = handler.stream_unary

            def client_streamed(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                watch = self._open(context, method)
                try:
                    return stream_unary(watch.requests(requests), context)
                finally:
                    self._close(watch)
            client_streamed.experimental_thread_pool = self.lane  # type: ignore[attr-defined]
            return handler._replace(stream_unary=client_streamed)
        inner = handler.unary_stream or handler.stream_stream
        unary_request = handler.unary_stream is not None

        def server_streamed(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            watch = self._open(context, method)
            try:
                if unary_request:
                    request = next(watch.requests(requests), _END)
                    if request is _END or request is UNPARSED:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"{method}: no request message" if request is _END
                                      else f"{method}: a request message that does not parse")
                    yield from watch.responses(inner(request, context))
                else:
                    yield from watch.responses(inner(watch.requests(requests), context))
            finally:
                self._close(watch)
        server_streamed.experimental_thread_pool = self.lane  # type: ignore[attr-defined]
        return grpc.stream_stream_rpc_method_handler(server_streamed, handler.request_deserializer,
                                                     handler.response_serializer)

    def _refusal(self, handler: Any, method: str) -> Any:
        """A handler that refuses the call without reading it, on the server's own threads."""
        exc = CapacityError(f"{method}: {self.max_open} streams open on this node (MAX_OPEN_STREAMS); "
                            f"retry later")

        def refuse(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            grpc_abort(context, exc)

        def refuse_streamed(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            grpc_abort(context, exc)
            yield None   # never reached: abort raises
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_streamed, handler.request_deserializer,
                                                         handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(refuse, handler.request_deserializer,
                                                    handler.response_serializer)

    def _open(self, context: grpc.ServicerContext, method: str) -> _Watch:
        watch = _Watch(context, method)
        with self._lock:
            self._watches.add(watch)
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watchdog, name="kvstore-stream-watchdog", daemon=True).start()
        return watch

    def _close(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _watchdog(self) -> None:
        """Every quarter of the idle limit (at most 1 s), end the streams idle past it;
        returns once no stream is open."""
        tick = min(1.0, self.idle_s / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                if not self._watches:
                    self._watching = False
                    return
                overdue = [(w, why) for w in self._watches
                           if (why := w.overdue(now, self.idle_s, self.per_message_s)) is not None]
                self._watches.difference_update(w for w, _ in overdue)
            for watch, why in overdue:
                self._end(watch, why)

    def _end(self, watch: _Watch, why: str) -> None:
        """Cancel the call with DEADLINE_EXCEEDED and a message naming the limit (gRPC
        1.85's ``Call.cancel(code, details)`` behind the servicer context; the context's own
        ``cancel()`` sends a bare CANCELLED, the fallback)."""
        details = f"{watch.method}: {why}; the node ended the stream"
        log.warning("%s (peer %s)", details, watch.context.peer())
        call = getattr(getattr(watch.context, "_rpc_event", None), "call", None)
        try:
            call.cancel(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], details)  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            watch.context.cancel()


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
    :data:`~kvstore.limits.MAX_OPEN_STREAMS` are open (:class:`_StreamGuard`). Returns the
    started server and its bound port. Raises RuntimeError if it cannot bind."""
    lane = _StreamLane(STREAM_WORKERS)
    interceptors = interceptors_for(auth_token) + [_StreamParseGuard(),
                                                   _StreamGuard(lane, STREAM_IDLE_S, MAX_OPEN_STREAMS,
                                                                STREAM_WAIT_PER_MESSAGE_S)]
    if metrics is not None:
        interceptors.append(metrics.interceptor())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS,
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
