"""Cluster membership: where store nodes announce themselves — the Redis registry, or with no
Redis an embedded in-process one (one process, one host) that says so. Each record is kept
alive by a TTL heartbeat (kvstore/cluster/heartbeat.py) and sealed with the store token
(kvstore/cluster/records.py says how and why); a node that stops heartbeating disappears
within the TTL. Whatever a record holds, it is left out (and logged) or listed: never an
exception that would stop the listing."""
from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

from kvstore.cluster.records import (
    CLOCK_SLACK_S,
    KEY_PREFIX,
    LEFT_PREFIX,
    LEFT_TTL_S,
    NodeInfo,
    NotSealedForThisToken,
    document,
    left_key,
    mac,
    opened,
    seal,
    unseal,
    whole,
)

__all__ = ["CLOCK_SLACK_S", "EMBEDDED", "KEY_PREFIX", "LEFT_PREFIX", "LEFT_TTL_S", "LocalRegistry", "NodeInfo",
           "NotSealedForThisToken", "RedisRegistry", "Registry", "WARN_AGAIN_S", "registry_for", "seal", "unseal"]
log = logging.getLogger(__name__)
WARN_AGAIN_S = 60.0              # a record still refused (or a node id held twice) is logged again after this long


class Registry(ABC):
    """Where nodes announce themselves. ``kind`` names it for logs and reports."""

    kind = "abstract"

    @abstractmethod
    def register(self, info: NodeInfo, ttl_s: float) -> None:
        """Announce (or refresh) ``info`` for ``ttl_s`` seconds."""

    @abstractmethod
    def deregister(self, node_id: str, epoch: int = 0) -> None:
        """Withdraw a node at once (a clean stop), and note that its life ``epoch`` left
        cleanly (:meth:`left_cleanly`), for :data:`LEFT_TTL_S` seconds. Neither is done when
        the record at ``node_id`` is another life's (a node of the same id that is live: a twin
        stopped before it stood aside must not withdraw it, nor make its later crash look like a
        clean stop); ``epoch`` 0 withdraws whatever is there (and notes life 0)."""

    @abstractmethod
    def left_cleanly(self, node_id: str, epoch: int) -> bool:
        """Whether life ``epoch`` of ``node_id`` stopped cleanly (:meth:`deregister`) within
        the last :data:`LEFT_TTL_S` seconds. Each life is noted apart: another life's clean
        stop (a restart's, a twin's of the same id) says nothing of this one, so a life that
        vanished from the listing without its own crashed, stopped answering or was cut off."""

    @abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """The live nodes, sorted by node id."""

    def holder(self, node_id: str) -> NodeInfo | None:
        """The node whose live record is at ``node_id``'s key now (one that verifies under
        this registry's token), else None: what a heartbeat checks before it writes, so that
        two live nodes given one node id do not overwrite each other's record in turn."""
        return self.holding(node_id)[0]

    @abstractmethod
    def holding(self, node_id: str) -> tuple[NodeInfo | None, float]:
        """:meth:`holder` and when its record lapses unless rewritten, in seconds on this
        registry's own clock (Redis: the server's; embedded: this process's monotonic one;
        0.0 with no holder). Two readings tell a live holder from a dead one: the end moves
        later only when its node beat in between. A record without a TTL was written by no
        heartbeat (every beat sets one): it has no holder."""

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Release connections."""


class RedisRegistry(Registry):
    """Records under ``kvstore:nodes:`` in the Redis at ``url``, each with a TTL (``SET PX``),
    sealed with ``token`` (the store token) when given: see the module's docstring. A record
    :meth:`nodes` refuses is left out and logged (its key as ``repr``; again after
    :data:`WARN_AGAIN_S` if it is still refused then); ``unverified`` counts the records of
    the last listing left out because they are not sealed under ``token``
    (:class:`NotSealedForThisToken`): all of them and none listed means a wrong token more
    likely than an empty cluster."""

    kind = "redis"

    def __init__(self, url: str, token: str | None = None) -> None:
        import redis
        self.url, self._token = url, token or None
        self._r = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._warned: dict[str, float] = {}   # key -> when its refusal was last logged (monotonic s)
        self._newest: dict[str, float] = {}   # node id -> the latest sealed_at listed
        self.unverified = 0                   # records of the last listing not sealed under the token
        # One listing at a time: two readers of one registry (a client's listing and its health
        # check) each check a node's record against _newest and then set it, so the one that
        # read the older beat, finishing second, refused a live node as a replay.
        self._listing = threading.Lock()

    def _server_time(self) -> float:
        seconds, micros = self._r.time()
        return seconds + micros * 1e-6

    def register(self, info: NodeInfo, ttl_s: float) -> None:
        value = seal(info, self._token, self._server_time(), ttl_s)
        self._r.set(KEY_PREFIX + info.node_id, value, px=max(1, int(ttl_s * 1000)))

    def deregister(self, node_id: str, epoch: int = 0) -> None:
        record, key = KEY_PREFIX + node_id, left_key(node_id, epoch)
        body = json.dumps({"node_id": node_id, "epoch": int(epoch)})
        value = json.dumps({"body": body, "mac": mac(self._token, key, body) if self._token else ""})

        def withdraw(pipe: Any) -> None:   # under WATCH: redis-py reruns it when a beat lands meanwhile
            held = pipe.get(record)
            if epoch and held is not None:
                seconds, micros = pipe.time()
                try:
                    other = unseal(record, held, self._token, seconds + micros * 1e-6)[0].epoch
                except ValueError:   # not a record this token's holders wrote: nobody lists it
                    other = epoch
                if other != epoch:
                    log.info("membership: node id %r is held by another life (epoch %d); this one (epoch %d) "
                             "leaves it", node_id, other, epoch)
                    return
            pipe.multi()
            pipe.delete(record)
            pipe.set(key, value, px=int(LEFT_TTL_S * 1000))

        self._r.transaction(withdraw, record)

    def left_cleanly(self, node_id: str, epoch: int) -> bool:
        key = left_key(node_id, epoch)
        value = self._r.get(key)
        if value is None:
            return False
        try:   # sealed like a record: a clean stop anyone who can write to Redis noted is none
            inner = opened(key, document(value), self._token)
        except ValueError:
            return False
        return inner.get("node_id") == node_id and whole(inner.get("epoch")) and inner["epoch"] == int(epoch)

    def nodes(self) -> list[NodeInfo]:
        with self._listing:
            return self._nodes()

    def holding(self, node_id: str) -> tuple[NodeInfo | None, float]:
        key = KEY_PREFIX + node_id
        pipe = self._r.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        pipe.time()
        value, left_ms, now_ = pipe.execute(raise_on_error=False)
        if isinstance(now_, Exception):
            raise now_
        # None or an error (a key of another type, WRONGTYPE: no node wrote it; a beat's SET
        # replaces it); a PTTL of -1: no TTL (no beat wrote it); -2: gone since the GET
        if not isinstance(value, bytes | str) or isinstance(left_ms, Exception) or left_ms < 0:
            return None, 0.0
        seconds, micros = now_
        now = seconds + micros * 1e-6
        try:
            return unseal(key, value, self._token, now)[0], now + left_ms / 1000
        except ValueError:   # not one this token's holders wrote (or stale): it does not count
            return None, 0.0

    def _nodes(self) -> list[NodeInfo]:
        keys = sorted(self._r.scan_iter(match=KEY_PREFIX + "*", count=1000))
        self.unverified = 0
        if not keys:
            return []
        pipe = self._r.pipeline(transaction=False)
        pipe.mget(keys)
        pipe.time()
        values, (seconds, micros) = pipe.execute()
        now = seconds + micros * 1e-6
        out = []
        for raw_key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            key = raw_key.decode(errors="replace")
            try:
                info, sealed_at = unseal(key, value, self._token, now)
                if self._token and sealed_at is not None:
                    if sealed_at < self._newest.get(info.node_id, sealed_at):
                        raise ValueError("older than a record of this node already listed (an earlier beat or "
                                         "life written back over the live one)")
                    self._newest[info.node_id] = sealed_at
                out.append(info)
            except ValueError as exc:
                self.unverified += isinstance(exc, NotSealedForThisToken)
                self._warn(key, exc)
        return out

    def _warn(self, key: str, exc: ValueError) -> None:
        now = time.monotonic()
        if now - self._warned.get(key, -WARN_AGAIN_S) < WARN_AGAIN_S:
            return
        if len(self._warned) >= 1024:   # keys are the writer's choice: keep the table bounded
            self._warned.clear()
        self._warned[key] = now
        log.warning("membership record %r left out: %s", key, exc)

    def close(self) -> None:
        self._r.close()


class LocalRegistry(Registry):
    """In-process records with expiry: a single-host run without Redis."""

    kind = "embedded"

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[NodeInfo, float]] = {}
        self._left: dict[tuple[str, int], float] = {}   # (node id, epoch) -> noted until (monotonic s)
        self._lock = threading.Lock()

    def register(self, info: NodeInfo, ttl_s: float) -> None:
        with self._lock:
            self._nodes[info.node_id] = (info, time.monotonic() + ttl_s)

    def deregister(self, node_id: str, epoch: int = 0) -> None:
        with self._lock:
            held = self._nodes.get(node_id)
            if epoch and held is not None and held[0].epoch != epoch and held[1] > time.monotonic():
                return   # another life of this id holds the record
            self._nodes.pop(node_id, None)
            now = time.monotonic()
            self._left = {life: until for life, until in self._left.items() if until > now}   # lapsed ones go
            self._left[(node_id, int(epoch))] = now + LEFT_TTL_S

    def left_cleanly(self, node_id: str, epoch: int) -> bool:
        with self._lock:
            return self._left.get((node_id, int(epoch)), 0.0) > time.monotonic()

    def holding(self, node_id: str) -> tuple[NodeInfo | None, float]:
        with self._lock:
            info, until = self._nodes.get(node_id, (None, 0.0))
        return (info, until) if until > time.monotonic() else (None, 0.0)

    def nodes(self) -> list[NodeInfo]:
        now = time.monotonic()
        with self._lock:
            return sorted((i for i, until in self._nodes.values() if until > now), key=lambda i: i.node_id)


EMBEDDED = LocalRegistry()


def registry_for(redis_url: str | None, token: str | None = None) -> Registry:
    """The Redis registry at ``redis_url``, its records sealed with ``token`` (the store
    token); with None, this process's embedded one (logged)."""
    if redis_url:
        return RedisRegistry(redis_url, token)
    log.info("no Redis configured: single-host membership in an embedded in-process registry")
    return EMBEDDED
