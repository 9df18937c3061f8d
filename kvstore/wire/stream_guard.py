"""The store node's guards on its gRPC streams (Put, Get, Snapshot): a client-streamed
message that does not parse reaches the handler as :data:`UNPARSED` (:class:`StreamParseGuard`);
streams run on threads of their own (:class:`StreamLane`), at most so many open, and one
that waits on its peer too long is ended (:class:`StreamGuard`). Limits: kvstore/limits.py;
:func:`kvstore.service.grpc_server` installs them."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import CapacityError
from kvstore.wire.channel import CHUNK_BYTES
from kvstore.wire.errors import grpc_abort

log = logging.getLogger(__name__)

UNPARSED = object()  # a client-streamed message that did not parse (see StreamParseGuard)


class StreamParseGuard(grpc.ServerInterceptor):
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


class StreamLane(futures.ThreadPoolExecutor):
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


class StreamGuard(grpc.ServerInterceptor):
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

    def __init__(self, lane: StreamLane, idle_s: float, max_open: int, per_message_s: float) -> None:
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
