"""Cluster membership: each store node keeps a record ``kvstore:nodes:<node_id>`` (JSON) alive
with a TTL heartbeat; a node that stops heartbeating disappears within the TTL. With no Redis
an embedded in-process registry stands in (one process, one host) and says so.

Records are sealed with the store token. Every reader of the registry (engines, the
scheduler, the vLLM connector, kvctl) sends the store token to the addresses it lists, so a
record anyone who can write to Redis could forge would hand them the token. A node with a
token therefore writes ``{"info": ..., "sealed_at": unix s, "mac": hex}``, the MAC an
HMAC-SHA256 under the token over the record's key and its ``info`` and ``sealed_at``; a
reader with a token lists only records whose MAC it can verify, sealed within
:data:`RECORD_MAX_AGE_S` (a replayed record of a node that died goes stale), and logs the
rest once per record. A reader without a token sends none, so it takes every well-formed
record. (A node without a token writes an unsealed record; a reader with one refuses it.)
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)
KEY_PREFIX = "kvstore:nodes:"
# How old a sealed record may be (seconds since the node wrote it; also how far ahead of this
# host's clock): a heartbeat rewrites it every second, so this is the hosts' clock skew allowed.
RECORD_MAX_AGE_S = 30.0
_MAC_CONTEXT = b"kvstore membership record v1\0"


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
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeInfo:
        d = dict(d)
        d["tiers"] = tuple(tuple(t) for t in d.get("tiers", ()))
        return cls(**d)


def _mac(token: str, key: str, body: str) -> str:
    return hmac.new(token.encode(), _MAC_CONTEXT + key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def seal(info: NodeInfo, token: str | None, now: float | None = None) -> str:
    """The registry value announcing ``info``: sealed (MAC under ``token``, dated ``now``,
    unix seconds) when there is a token, else the bare record."""
    if not token:
        return json.dumps({"info": asdict(info)}, separators=(",", ":"))
    body = json.dumps({"info": asdict(info), "sealed_at": time.time() if now is None else now},
                      separators=(",", ":"), sort_keys=True)
    return json.dumps({"body": body, "mac": _mac(token, KEY_PREFIX + info.node_id, body)},
                      separators=(",", ":"))


def unseal(key: str, value: str | bytes, token: str | None, now: float | None = None) -> NodeInfo:
    """The node announced at registry ``key`` by ``value``. With a token, the value must be
    sealed under it, less than :data:`RECORD_MAX_AGE_S` old and name the node its key does.
    Raises ValueError saying what is wrong (a forged, stale, unsealed or malformed record)."""
    try:
        doc = json.loads(value)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if "body" in doc:
            body = doc["body"]
            if not isinstance(body, str):
                raise ValueError("body is not a string")
            if token and not hmac.compare_digest(str(doc.get("mac", "")), _mac(token, key, body)):
                raise ValueError("its seal does not verify under this store token (forged, or another cluster's)")
            inner = json.loads(body)
            sealed_at = float(inner["sealed_at"])
            age = (time.time() if now is None else now) - sealed_at
            if token and not -RECORD_MAX_AGE_S <= age <= RECORD_MAX_AGE_S:
                raise ValueError(f"sealed {age:.0f} s ago (more than {RECORD_MAX_AGE_S:.0f} s apart: replayed, "
                                 "or the hosts' clocks disagree)")
            info = NodeInfo.from_dict(inner["info"])
        elif token:
            raise ValueError("unsealed: its node runs without the store token this reader holds")
        else:
            info = NodeInfo.from_dict(doc["info"])
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed ({type(exc).__name__}: {exc})") from None
    if KEY_PREFIX + info.node_id != key:
        raise ValueError(f"names node {info.node_id!r}")
    return info


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
    """Records under ``kvstore:nodes:`` in the Redis at ``url``, each with a TTL (``SET PX``),
    sealed with ``token`` (the store token) when given: see the module's docstring. A record
    :meth:`nodes` refuses is logged once (per key and reason) and left out."""

    kind = "redis"

    def __init__(self, url: str, token: str | None = None) -> None:
        import redis
        self.url, self._token = url, token or None
        self._r = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._refused: set[tuple[str, str]] = set()

    def register(self, info: NodeInfo, ttl_s: float) -> None:
        self._r.set(KEY_PREFIX + info.node_id, seal(info, self._token), px=max(1, int(ttl_s * 1000)))

    def deregister(self, node_id: str) -> None:
        self._r.delete(KEY_PREFIX + node_id)

    def nodes(self) -> list[NodeInfo]:
        keys = sorted(self._r.scan_iter(match=KEY_PREFIX + "*", count=1000))
        if not keys:
            return []
        out = []
        for raw_key, value in zip(keys, self._r.mget(keys), strict=True):
            if value is None:
                continue
            key = raw_key.decode(errors="replace")
            try:
                out.append(unseal(key, value, self._token))
            except ValueError as exc:
                if (key, str(exc)) not in self._refused:
                    self._refused.add((key, str(exc)))
                    log.warning("membership record %s left out: %s", key, exc)
        return out

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


def registry_for(redis_url: str | None, token: str | None = None) -> Registry:
    """The Redis registry at ``redis_url``, its records sealed with ``token`` (the store
    token); with None, this process's embedded one (logged)."""
    if redis_url:
        return RedisRegistry(redis_url, token)
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
