"""Cluster membership: each store node keeps a record ``kvstore:nodes:<node_id>`` (JSON) alive
with a TTL heartbeat; a node that stops heartbeating disappears within the TTL. With no Redis
an embedded in-process registry stands in (one process, one host) and says so."""
from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)
KEY_PREFIX = "kvstore:nodes:"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A live store node as announced. ``tiers``: (name, capacity_bytes, used_bytes) each;
    ``free_bytes``: what placement may still put there (below the low watermark);
    ``te_endpoint``: its transfer engine (host:rpc_port), "" for none; ``epoch``: start time
    in ns, so a restarted node is told apart from its previous life; ``draining``: the node
    is being emptied (``kvctl drain``), so placement puts no new blocks there."""

    node_id: str
    address: str
    tiers: tuple[tuple[str, int, int], ...] = ()
    free_bytes: int = 0
    te_endpoint: str = ""
    epoch: int = 0
    draining: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        d = json.loads(text)
        d["tiers"] = tuple(tuple(t) for t in d.get("tiers", ()))
        return cls(**d)


class Registry(ABC):
    """Where nodes announce themselves. ``kind`` names it for logs and reports."""

    kind = "abstract"

    @abstractmethod
    def register(self, info: NodeInfo, ttl_s: float) -> None:
        """Announce (or refresh) ``info`` for ``ttl_s`` seconds."""

    @abstractmethod
    def deregister(self, node_id: str) -> None:
        """Withdraw a node at once (a clean stop)."""

    @abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """The live nodes, sorted by node id."""

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Release connections."""


class RedisRegistry(Registry):
    """Records under ``kvstore:nodes:`` in the Redis at ``url``, each with a TTL (``SET PX``)."""

    kind = "redis"

    def __init__(self, url: str) -> None:
        import redis
        self.url = url
        self._r = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

    def register(self, info: NodeInfo, ttl_s: float) -> None:
        self._r.set(KEY_PREFIX + info.node_id, info.to_json(), px=max(1, int(ttl_s * 1000)))

    def deregister(self, node_id: str) -> None:
        self._r.delete(KEY_PREFIX + node_id)

    def nodes(self) -> list[NodeInfo]:
        keys = sorted(self._r.scan_iter(match=KEY_PREFIX + "*", count=1000))
        if not keys:
            return []
        return [NodeInfo.from_json(v) for v in self._r.mget(keys) if v is not None]

    def close(self) -> None:
        self._r.close()


class LocalRegistry(Registry):
    """In-process records with expiry: a single-host run without Redis."""

    kind = "embedded"

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[NodeInfo, float]] = {}
        self._lock = threading.Lock()

    def register(self, info: NodeInfo, ttl_s: float) -> None:
        with self._lock:
            self._nodes[info.node_id] = (info, time.monotonic() + ttl_s)

    def deregister(self, node_id: str) -> None:
        with self._lock:
            self._nodes.pop(node_id, None)

    def nodes(self) -> list[NodeInfo]:
        now = time.monotonic()
        with self._lock:
            return sorted((i for i, until in self._nodes.values() if until > now), key=lambda i: i.node_id)


EMBEDDED = LocalRegistry()


def registry_for(redis_url: str | None) -> Registry:
    """The Redis registry at ``redis_url``; with None, this process's embedded one (logged)."""
    if redis_url:
        return RedisRegistry(redis_url)
    log.info("no Redis configured: single-host membership in an embedded in-process registry")
    return EMBEDDED


class Heartbeat:
    """Re-announces ``info()`` every ``interval_s`` with ``ttl_s`` (interval < TTL), on a
    daemon thread; :meth:`stop` withdraws the record. A failed announce is logged and retried
    at the next beat (the record may lapse meanwhile: the node looks dead, never wrong)."""

    def __init__(self, registry: Registry, info: Callable[[], NodeInfo], ttl_s: float = 3.0,
                 interval_s: float = 1.0) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"heartbeat interval ({interval_s} s) must be > 0 and below the TTL ({ttl_s} s)")
        self.registry, self.info, self.ttl_s, self.interval_s = registry, info, ttl_s, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-heartbeat", daemon=True)
        self.node_id: str | None = None

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
            self.node_id = info.node_id
            self.registry.register(info, self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - Redis down, stats racing a close: retry
            log.warning("membership heartbeat failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.node_id is not None:
            try:
                self.registry.deregister(self.node_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("membership deregister failed: %s", exc)
