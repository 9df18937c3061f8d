"""The node side of KV events: an index that publishes every change of its node's copies.

:class:`PublishingIndex` is the pool's :class:`PrefixIndex` with a lock and a per-node
sequence number: each effective ``add``/``remove``/``clear_node`` of the node's own copies
becomes a :class:`KVEvent` (``BlockStored``, ``BlockRemoved``, ``NodeCleared``) queued under
that lock, and :meth:`PublishingIndex.snapshot` reads the node's entries and the sequence
number under the same lock, so a snapshot is exactly the state after event ``seq``.
A background thread (:class:`EventPublisher`) sends queued events in batches, so a pool
never waits on the network while it holds its lock.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kvstore.events.channel import EventChannel
from kvstore.events.event import EventKind, KVEvent, NodeSnapshot
from kvstore.index.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


class EventPublisher:
    """Sends events to ``channel`` from a background thread, in order, in batches of up to
    ``batch`` events. At most ``max_pending`` events wait; beyond that the oldest are dropped
    (replicas see a gap and resynchronise). A failed send drops its batch the same way.

    The thread is woken only when the queue turns non-empty, and then lingers ``linger_s``
    seconds (default 1 ms) before it sends, so a burst of puts costs one wake-up and one
    send, not one per block: in a node serving same-host puts, waking a thread per event
    doubled the commit's latency (GIL hand-offs). Events reach replicas at most
    ``linger_s`` later for it."""

    def __init__(self, channel: EventChannel, batch: int = 1000, max_pending: int = 1_000_000,
                 linger_s: float = 0.001) -> None:
        self.channel = channel
        self.batch = batch
        self.linger_s = linger_s
        self.sent = 0
        self.dropped = 0
        self._pending: deque[KVEvent] = deque()
        self._max_pending = max_pending
        self._lock = threading.Lock()  # publish() enters it directly: cheaper than the Condition's wrapper
        self._cond = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, event: KVEvent) -> None:
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(event)
            if len(self._pending) == 1:
                self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued event was sent (or dropped). False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
            if self.linger_s > 0 and not self._closed:
                time.sleep(self.linger_s)  # let the burst that woke us finish queueing
            with self._cond:
                n = min(self.batch, len(self._pending))
                batch = [self._pending.popleft() for _ in range(n)]
                self._busy = True
            try:
                self.channel.publish(batch)
                self.sent += len(batch)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - any client error: the batch is lost
                self.dropped += len(batch)
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("KV events: %d events lost, %s failed: %s", len(batch),
                                self.channel.description, exc)
                time.sleep(min(1.0, 0.01 * failures))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class PublishingIndex(PrefixIndex):
    """The prefix index of store node ``node_id``: publishes each change of that node's
    copies to ``channel``. Thread-safe for writers and :meth:`snapshot`; readers follow
    :class:`PrefixIndex` (the owner holds its lock).

    Invariant: after event ``seq`` the node's entries are exactly those of
    ``snapshot()`` taken at ``seq``. The epoch opens with ``NodeCleared`` at seq 1.

    ``speaking``: False keeps the events unpublished (numbered all the same) until
    :meth:`speak`: a store node in a cluster speaks for its node id only while it holds the id
    in the membership registry (kvstore/cluster/agent.py). A second node started with a live
    node's id stands aside there and publishes nothing: its events, of a later epoch, would
    take the id's place in every replica, which would then drop the live node's copies and
    skip its events as stale, and the twin's stop would clear them again.
    """

    def __init__(self, node_id: str, channel: EventChannel, capacity: int = 1024, *,
                 speaking: bool = True) -> None:
        super().__init__(capacity)
        self.node_id = node_id
        self.epoch = time.time_ns()
        self.seq = 0
        self.speaking = speaking
        self.publisher = EventPublisher(channel)
        self._lock = threading.RLock()
        log.info("KV events of node %s (epoch %d) go to the %s%s", node_id, self.epoch, channel.description,
                 "" if speaking else " once it holds its node id")
        self._emit(EventKind.NODE_CLEARED)

    def _emit(self, kind: EventKind, key: bytes = b"", tier: str = "", size: int = 0) -> None:
        self.seq += 1
        if self.speaking:
            self.publisher.publish(KVEvent(self.node_id, self.epoch, self.seq, kind, key, tier, size,
                                           time.time()))

    def speak(self, on: bool) -> None:
        """Publish the node's events (``on``) or keep them to itself. Starting to speak opens a
        new epoch, later than every earlier one of this index: ``NodeCleared`` at seq 1, then
        a ``BlockStored`` of every copy the node holds, so a replica that had another life's
        copies under this id replaces them with this node's (a replica past the stream's bound
        resynchronises from a snapshot, as after any gap). Idempotent."""
        with self._lock:
            if on == self.speaking:
                return
            self.speaking = on
            if on:
                self.epoch, self.seq = max(time.time_ns(), self.epoch + 1), 0
                self._emit(EventKind.NODE_CLEARED)
                for key, tier, size in self.node_entries(self.node_id):
                    self._emit(EventKind.BLOCK_STORED, key, tier, size)
            log.info("KV events of node %s: %s", self.node_id,
                     f"published (epoch {self.epoch}, {self.seq - 1} copies announced)" if on else "held back")

    def add(self, key: bytes, node: str, tier: str, size: int = 0, checksum: int = 0) -> bool:
        with self._lock:
            added = super().add(key, node, tier, size, checksum)
            if added and node == self.node_id:
                self._emit(EventKind.BLOCK_STORED, key, tier, size)
            return added

    def remove(self, key: bytes, node: str, tier: str) -> bool:
        with self._lock:
            removed = super().remove(key, node, tier)
            if removed and node == self.node_id:
                self._emit(EventKind.BLOCK_REMOVED, key, tier)
            return removed

    def clear_node(self, node: str) -> int:
        with self._lock:
            dropped = super().clear_node(node)
            if node == self.node_id:
                self._emit(EventKind.NODE_CLEARED)
            return dropped

    def snapshot(self) -> NodeSnapshot:
        """The node's copies as of event ``seq`` (taken under the writers' lock)."""
        with self._lock:
            return NodeSnapshot(self.node_id, self.epoch, self.seq, tuple(self.node_entries(self.node_id)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Announce that the node's copies are gone (``NodeCleared``: the node stops serving
        them), send every queued event, stop the publisher thread."""
        with self._lock:
            self._emit(EventKind.NODE_CLEARED)
        self.publisher.close(timeout_s)


def snapshot_of(index: PrefixIndex, node_id: str) -> NodeSnapshot:
    """A snapshot of ``node_id``'s copies: exact (with its event seq) for a
    :class:`PublishingIndex`; for a plain index epoch and seq are 0 and the caller must hold
    the index owner's lock for it to be consistent."""
    if isinstance(index, PublishingIndex) and index.node_id == node_id:
        return index.snapshot()
    return NodeSnapshot(node_id, 0, 0, tuple(index.node_entries(node_id)))
