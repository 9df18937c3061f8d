"""The store node's gRPC service: converts messages to domain types at the edge and maps
kvstore errors to gRPC status codes. Block bytes travel in chunks of ``CHUNK_BYTES``."""
from __future__ import annotations

import hmac
import logging
from concurrent import futures
from typing import Iterator

import grpc

from kvstore import __version__
from kvstore.errors import IntegrityError, InvalidArgument
from kvstore.pool import KVPool, checksum_of
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
MAX_KEY_BYTES = 64
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)]


class StoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, pool: KVPool, max_block_bytes: int = 1 << 30) -> None:
        self.pool = pool
        self.max_block_bytes = max_block_bytes

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        n, tiers = self.pool.lookup(list(request.keys))
        return pb.LookupResponse(prefix_blocks=n, tiers=tiers)

    def Put(self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext) -> pb.PutResponse:
        results: list[pb.PutResult] = []
        key: bytes | None = None
        buf = bytearray()
        size = checksum = 0

        def finish() -> None:
            if key is None:
                return
            if len(buf) != size:
                results.append(pb.PutResult(key=key, ok=False,
                                            error=f"got {len(buf)} bytes, header said {size}"))
                return
            try:
                r = self.pool.put(key, bytes(buf), checksum)
                results.append(pb.PutResult(key=key, ok=r.ok, existed=r.existed, error=r.error))
            except IntegrityError as exc:
                results.append(pb.PutResult(key=key, ok=False, error=str(exc)))

        for chunk in request_iterator:
            if chunk.key:
                finish()
                if len(chunk.key) > MAX_KEY_BYTES:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"block key of {len(chunk.key)} bytes; at most {MAX_KEY_BYTES}")
                if chunk.size > self.max_block_bytes:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"block of {chunk.size} bytes; at most {self.max_block_bytes}")
                key, size, checksum = chunk.key, chunk.size, chunk.checksum
                buf = bytearray()
            elif key is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first chunk of a put carries no key")
            buf += chunk.data
            if len(buf) > size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"block {key.hex()[:16]}: more bytes than its size {size}")
        finish()
        return pb.PutResponse(results=results)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        for key in request.keys:
            data = self.pool.get(key)
            if data is None:
                yield pb.GetChunk(key=key, missing=True)
                if request.stop_at_miss:
                    return
                continue
            checksum = checksum_of(data)
            view = memoryview(data)
            for off in range(0, max(len(data), 1), CHUNK_BYTES):
                if off == 0:
                    yield pb.GetChunk(key=key, size=len(data), checksum=checksum, offset=0,
                                      data=bytes(view[:CHUNK_BYTES]))
                else:
                    yield pb.GetChunk(offset=off, data=bytes(view[off:off + CHUNK_BYTES]))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(node_id=self.pool.node_id, tiers=[
            pb.TierStats(name=s.name, device=s.device, capacity_bytes=s.capacity_bytes,
                         used_bytes=s.used_bytes, blocks=s.blocks, hits=s.hits, misses=s.misses,
                         evictions=s.evictions, demotions=s.demotions, promotions=s.promotions,
                         integrity_failures=s.integrity_failures)
            for s in self.pool.stats()])

    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        try:
            freed, blocks = self.pool.evict(request.tier, request.bytes)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.EvictResponse(evicted_bytes=freed, evicted_blocks=blocks)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(status="SERVING", node_id=self.pool.node_id, version=__version__)


class _TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        meta = dict(handler_call_details.invocation_metadata or ())
        if not hmac.compare_digest(str(meta.get("authorization", "")).encode(), self._expected.encode()):
            return self._deny
        return continuation(handler_call_details)


def serve_store(pool: KVPool, address: str = "127.0.0.1:0", auth_token: str | None = None,
                workers: int = 8) -> tuple[grpc.Server, int]:
    """Start the store service on ``address`` (host:port; port 0 picks a free one).
    Returns the started server and its bound port. Raises RuntimeError if it cannot bind."""
    interceptors = [_TokenInterceptor(auth_token)] if auth_token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=GRPC_OPTIONS,
                         interceptors=interceptors)
    pb_grpc.add_KVStoreServicer_to_server(StoreServicer(pool), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"store: cannot listen on {address}")
    server.start()
    log.info("store node %s listening on %s (port %d)", pool.node_id, address, port)
    return server, port
