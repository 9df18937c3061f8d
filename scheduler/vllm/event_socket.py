"""The ZeroMQ side of the vLLM KV-event bridge (scheduler/vllm/events.py): the subscriber
thread on an instance's PUB socket and the replay of lost batches from its ROUTER socket
(vLLM 0.32, ``vllm/distributed/kv_events.py``: frames ``(topic, seq, payload)``; a replay
request is ``seq`` as 8 big-endian bytes, answered batch by batch and ended by seq -1)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, TypeVar

log = logging.getLogger("scheduler.vllm.events")

END_SEQ = -1
MAX_MESSAGE_BYTES = 64 << 20       # one batch on the wire, at most (ZeroMQ drops a larger one)
_S = TypeVar("_S", bound="EventSubscriber")


class EventSubscriber:
    """Subscribes to ``endpoint`` and hands each batch to :meth:`receive` (the bridge's
    translation); drops the instance's hits (:meth:`_clear`) when the publisher disconnects.
    The bridge sets the attributes below."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None
    replay_timeout_s: float
    stats: Any
    _last: int | None
    _stop: threading.Event
    _thread: threading.Thread | None

    def receive(self, seq: int, payload: bytes) -> None:
        raise NotImplementedError

    def _clear(self, why: str) -> None:
        raise NotImplementedError

    def _replay(self, start: int, upto: int) -> list[tuple[int, bytes]]:
        """Batches ``start .. upto - 1`` as the replay socket returns them, in its order
        (possibly fewer: vLLM's buffer keeps the last 10,000, and its socket drops replies
        beyond its high-water mark); none without a replay endpoint or on a timeout."""
        if self.replay_endpoint is None:
            return []
        import zmq
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    log.warning("vLLM KV events of %s: replay from %d timed out", self.engine_id, start)
                    return []
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return []
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return got
                if start <= seq < upto and (not got or seq > got[-1][0]):
                    got.append((seq, frames[3]))
        finally:
            sock.close()

    def start(self: _S) -> _S:
        """Subscribe to the endpoint in a background thread until :meth:`stop`. Raises
        RuntimeError while a previous thread has not stopped."""
        if self._thread is not None and self._thread.is_alive():
            if not self._stop.is_set():
                return self
            raise RuntimeError(f"the KV-event bridge of {self.engine_id} is still stopping")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"vllm-kv-events-{self.engine_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None

    def _run(self) -> None:
        import zmq
        import zmq.utils.monitor
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)   # a publisher that went away
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        log.info("vLLM KV events of %s: subscribed to %s (replay: %s)", self.engine_id, self.endpoint,
                 self.replay_endpoint or "none")
        if self.endpoint.startswith("tcp://"):
            log.warning("vLLM KV events of %s come over TCP (%s): they carry prompt tokens in clear, to anyone "
                        "who can reach the port; an ipc:// socket in a 0700 directory keeps them on this host",
                        self.engine_id, self.endpoint)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    zmq.utils.monitor.recv_monitor_message(monitor)
                    # what a restarted instance publishes before we reconnect is lost, and its
                    # numbers may run past ours: nothing the old one held can be trusted
                    self._clear("the publisher disconnected (the instance stopped or restarted)")
                    self._last = None
                if sock not in ready:
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.bad += 1
                    continue
                self.receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
