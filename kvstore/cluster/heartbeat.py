"""The heartbeat that keeps a store node's membership record alive, and what it does when two
live nodes are given one node id."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.cluster.membership import WARN_AGAIN_S, Registry
from kvstore.cluster.records import NodeInfo

log = logging.getLogger(__name__)
# How much later a record's end must read, seconds, to count as rewritten (a beat moves it by
# the writer's interval; two readings of an untouched one differ by their round trips' jitter).
REWRITE_SLACK_S = 0.05


class Heartbeat:
    """Re-announces ``info()`` every ``interval_s`` with ``ttl_s`` (interval < TTL), on a
    daemon thread; :meth:`stop` withdraws the record. A failed announce is logged and retried
    at the next beat (the record may lapse meanwhile: the node looks dead, never wrong).

    Two live nodes given one node id: each beat first reads the record there
    (:meth:`Registry.holding`). A record of another life (epoch) found after this one has
    written or stood aside was written since by a node that is alive; the node started later
    (larger epoch) then stands aside — it writes nothing, :attr:`conflict` says why, and an
    error is logged once a minute — until the other's record is gone, and the earlier one
    keeps its record (logging the same if the other wrote before it stood aside). (Were they
    to write in turn, readers would see the id flip between the two addresses and half of
    either node's blocks miss.) A record of another life found
    before this one has written is that of a previous life of the node, restarted within the
    TTL, or of a live twin: this node writes nothing until it tells which — the record
    lapses (a previous life: this node registers at its next beat, within that life's TTL
    and one interval) or is rewritten, its end (on the registry's clock) moved later by more
    than :data:`REWRITE_SLACK_S` (a live twin: the later epoch stands aside, as above). A
    record not rewritten within this node's own ``ttl_s`` of watching is written over: a
    dead life's of a longer TTL, or one planted by whoever can write to Redis (with a long
    TTL it would keep a node without a token out of the cluster for as long). (A first beat
    that wrote over the record at once would let a twin take a live node's id for a beat.)
    ``on_holding``: called with True after each beat that wrote the record over its own or
    none and False when the node stands aside or waits; the store node publishes its KV
    events only while it holds its id."""

    def __init__(self, registry: Registry, info: Callable[[], NodeInfo], ttl_s: float = 3.0,
                 interval_s: float = 1.0, on_holding: Callable[[bool], None] | None = None) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"heartbeat interval ({interval_s} s) must be > 0 and below the TTL ({ttl_s} s)")
        self.registry, self.info, self.ttl_s, self.interval_s = registry, info, ttl_s, interval_s
        # told True after each beat that wrote this node's record, False when it stands aside
        self.on_holding = on_holding or (lambda holds: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-heartbeat", daemon=True)
        self.node_id: str | None = None
        self.epoch = 0
        self.conflict: str | None = None   # why this node stands aside (another live node has its id)
        self._wrote = False                # this life has written its record (and not stood aside since)
        # another life's record found before this one wrote: (epoch, its end, first seen at monotonic s)
        self._watched: tuple[int, float, float] | None = None
        self._warned_at = -WARN_AGAIN_S

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        """Announce now (a change that should not wait for the next beat)."""
        self._beat()

    def _beat(self) -> None:
        try:
            info = self.info()
            self.node_id, self.epoch = info.node_id, info.epoch
            other, ends_at = self.registry.holding(info.node_id)
            if other is not None and other.epoch != info.epoch and not (self._wrote or self.conflict):
                seen = self._seen(info, other, ends_at)
                if seen == "waiting":
                    self.on_holding(False)
                    return   # a previous life's, until it lapses or is rewritten
                if seen == "stale":
                    other = None   # written over: no live node beats it
            if other is not None and other.epoch != info.epoch:
                # written since this node's last beat, or while it waited, by another live node of the same id
                self._duplicate(info, other)
                if other.epoch < info.epoch:   # the earlier node keeps the id
                    self._wrote = False
                    self.on_holding(False)
                    return
            elif self.conflict and other is None:
                log.warning("membership: node id %r is free again; this node (%s) registers", info.node_id,
                            info.address)
                self.conflict = None
            self.registry.register(info, self.ttl_s)
            self._wrote, self._watched = True, None
            if other is None or other.epoch == info.epoch:
                self.on_holding(True)
        except Exception as exc:  # noqa: BLE001 - Redis down, stats racing a close: retry
            log.warning("membership heartbeat failed: %s", exc)

    def _seen(self, info: NodeInfo, other: NodeInfo, ends_at: float) -> str:
        """What ``other``'s record, found before this life wrote its own and ending at
        ``ends_at`` (:meth:`Registry.holding`), is: "rewritten" since this node first saw it
        (its node is alive), "stale" (not rewritten for this node's ``ttl_s``: written over,
        logged) or "waiting" (the first sighting of an epoch, remembered and logged, or not
        rewritten yet)."""
        now = time.monotonic()
        if self._watched is None or self._watched[0] != other.epoch:
            self._watched = (other.epoch, ends_at, now)
            log.info("membership: node id %r is held by epoch %d at %s; this node (%s, epoch %d) registers once "
                     "that record lapses (a previous life's) and stands aside if it is rewritten (a live node's)",
                     info.node_id, other.epoch, other.address, info.address, info.epoch)
            return "waiting"
        if ends_at > self._watched[1] + REWRITE_SLACK_S:
            return "rewritten"
        if now - self._watched[2] >= self.ttl_s:
            log.warning("membership: the record of node id %r (epoch %d at %s) was not rewritten in %.1f s, this "
                        "node's TTL: no live node keeps it (a dead life's of a longer TTL, or one written by "
                        "hand); this node (%s) writes over it", info.node_id, other.epoch, other.address,
                        now - self._watched[2], info.address)
            return "stale"
        return "waiting"

    def _duplicate(self, info: NodeInfo, other: NodeInfo) -> None:
        yields = other.epoch < info.epoch
        why = (f"node id {info.node_id!r} is also used by the live node at {other.address} (epoch {other.epoch}), "
               f"this one at {info.address} (epoch {info.epoch}); "
               + ("it started first: this node stays out of the cluster (its blocks are not listed) until that "
                  "one stops" if yields else "this node started first and keeps the id; the other stays out")
               + ". Give each node its own --node-id")
        if yields:
            self.conflict = why
        now = time.monotonic()
        if now - self._warned_at >= WARN_AGAIN_S:
            self._warned_at = now
            log.error("membership: %s", why)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.node_id is not None and not self.conflict:   # a node standing aside holds no record
            try:
                self.registry.deregister(self.node_id, self.epoch)
            except Exception as exc:  # noqa: BLE001
                log.warning("membership deregister failed: %s", exc)
