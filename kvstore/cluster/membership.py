"""Cluster membership: each store node keeps a record ``kvstore:nodes:<node_id>`` (JSON) alive
with a TTL heartbeat; a node that stops heartbeating disappears within the TTL. With no Redis
an embedded in-process registry stands in (one process, one host) and says so.

Records are sealed with the store token. Every reader of the registry (engines, the
scheduler, the vLLM connector, kvctl) sends the store token to the addresses it lists, so a
record anyone who can write to Redis could forge would hand them the token. A node with a
token therefore writes ``{"body": ..., "mac": hex}``: the body holds the record, when it was
sealed and its TTL, and the MAC is an HMAC-SHA256 under the token over the record's key and
the body. Both sides read the time off the Redis server (``TIME``), so no two hosts' clocks
are compared. A reader with a token lists only records whose MAC verifies, sealed no longer
ago than their TTL (+ :data:`CLOCK_SLACK_S`: a record replayed after its node stopped is as
dead as the node within the same TTL) and no older than a record of that node it has
already listed (an earlier life, or an earlier beat, written back over the live one). A
reader without a token sends none, so it takes every well-formed record. (A node without a
token writes an unsealed record; a reader with one refuses it.) Whatever a record holds, it
is left out (and logged) or listed: never an exception that would stop the listing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)
KEY_PREFIX = "kvstore:nodes:"
LEFT_PREFIX = "kvstore:left:"    # a life's clean stop: a key per <node id>:<epoch>, kept LEFT_TTL_S
LEFT_TTL_S = 3600.0              # how long a clean stop is remembered, seconds
# How far past its TTL a sealed record may be read, seconds (by the Redis server's clock: the
# round trips between reading the clock and writing or reading the record).
CLOCK_SLACK_S = 2.0
MAX_RECORD_BYTES = 64 << 10      # a record is a few hundred bytes; a larger value is not one
WARN_AGAIN_S = 60.0              # a record still refused is logged again after this long
# How much later a record's end must read, seconds, to count as rewritten (a beat moves it by
# the writer's interval; two readings of an untouched one differ by their round trips' jitter).
REWRITE_SLACK_S = 0.05
_MAC_CONTEXT = b"kvstore membership record v1\0"


class NotSealedForThisToken(ValueError):
    """A record whose seal does not verify under the reader's store token, or that is not
    sealed while the reader holds one: another cluster's, a forgery, or the reader's token
    is wrong or stale."""


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
    def from_dict(cls, d: Any) -> NodeInfo:
        """The record ``d`` (a decoded JSON object). Raises ValueError naming the field that
        is missing or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError("the record is not a JSON object")
        d = dict(d)
        tiers = d.get("tiers", ())
        if not isinstance(tiers, list | tuple) or not all(
                isinstance(t, list | tuple) and len(t) == 3 and isinstance(t[0], str)
                and all(_whole(x) for x in t[1:]) for t in tiers):
            raise ValueError("tiers: not a list of [name, capacity_bytes, used_bytes]")
        d["tiers"] = tuple(tuple(t) for t in tiers)
        types = {"node_id": str, "address": str, "free_bytes": int, "te_endpoint": str, "epoch": int, "draining": bool}
        for name, kind in types.items():
            if name in d and not (isinstance(d[name], kind) and (kind is bool or not isinstance(d[name], bool))):
                raise ValueError(f"{name}: not a {kind.__name__}")
        try:
            return cls(**d)
        except TypeError as exc:   # a field missing or unknown
            raise ValueError(str(exc)) from None


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _left_key(node_id: str, epoch: int) -> str:
    """The key noting that life ``epoch`` of ``node_id`` stopped cleanly: one per life, each
    with its own TTL, so lives of one id do not overwrite one another's and lapse on their own
    (a hash per id has one TTL for all its fields: refreshed by each stop, it would keep every
    life of an id restarted more often than :data:`LEFT_TTL_S`). The epoch, a whole number,
    comes last: no other (id, epoch) gives the same key."""
    return f"{LEFT_PREFIX}{node_id}:{int(epoch)}"


def _mac(token: str, key: str, body: str) -> str:
    return hmac.new(token.encode(), _MAC_CONTEXT + key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def _json(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ValueError(f"not JSON ({type(exc).__name__})") from None


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def seal(info: NodeInfo, token: str | None, now: float, ttl_s: float) -> str:
    """The registry value announcing ``info`` for ``ttl_s`` seconds: sealed (MAC under
    ``token``, dated ``now``: the Redis server's time, unix seconds) when there is a token,
    else the bare record."""
    if not token:
        return json.dumps({"info": asdict(info)}, separators=(",", ":"))
    body = json.dumps({"info": asdict(info), "sealed_at": now, "ttl_s": ttl_s}, separators=(",", ":"), sort_keys=True)
    return json.dumps({"body": body, "mac": _mac(token, KEY_PREFIX + info.node_id, body)},
                      separators=(",", ":"))


def unseal(key: str, value: str | bytes, token: str | None, now: float) -> tuple[NodeInfo, float | None]:
    """The node announced at registry ``key`` by ``value``, and when the record was sealed
    (None for an unsealed one), at ``now`` (the Redis server's time). With a token, the value
    must be sealed under it, no older than its TTL + :data:`CLOCK_SLACK_S`, and name the node
    its key does. Raises ValueError saying what is wrong (a forged, stale, unsealed or
    malformed record), and nothing else whatever the value holds."""
    doc = _document(value)
    sealed_at: float | None = None
    if "body" in doc:
        inner = _opened(key, doc, token)
        if not _number(inner.get("sealed_at")) or not _number(inner.get("ttl_s")):
            raise ValueError("body: not an object with a record, sealed_at and ttl_s")
        sealed_at = float(inner["sealed_at"])
        age, ttl_s = now - sealed_at, float(inner["ttl_s"])
        if token and not -CLOCK_SLACK_S <= age <= ttl_s + CLOCK_SLACK_S:
            raise ValueError(f"sealed {age:.1f} s ago, its TTL {ttl_s:g} s (replayed after its node stopped)")
        info = NodeInfo.from_dict(inner.get("info"))
    elif token:
        raise NotSealedForThisToken("unsealed: its node runs without the store token this reader holds")
    else:
        info = NodeInfo.from_dict(doc.get("info"))
    if KEY_PREFIX + info.node_id != key:
        raise ValueError(f"names node {info.node_id!r}")
    return info, sealed_at


def _document(value: str | bytes) -> dict[str, Any]:
    """A registry value as a JSON object; ValueError when it is too large or not one."""
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(value):,} bytes, over {MAX_RECORD_BYTES:,}")
    doc = _json(value)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def _opened(key: str, doc: dict[str, Any], token: str | None) -> dict[str, Any]:
    """The object sealed in ``doc`` (``{"body": JSON text, "mac": hex}``) at ``key``, its MAC
    checked under ``token`` when there is one. Raises NotSealedForThisToken when it does not
    verify, ValueError when the body is not a JSON object."""
    body = doc.get("body")
    if not isinstance(body, str):
        raise ValueError("body is not a string")
    if token and not hmac.compare_digest(str(doc.get("mac", "")), _mac(token, key, body)):
        raise NotSealedForThisToken("its seal does not verify under this store token (forged, or another "
                                    "cluster's, or the token is wrong)")
    inner = _json(body)
    if not isinstance(inner, dict):
        raise ValueError("body: not a JSON object")
    return inner


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
        record, key = KEY_PREFIX + node_id, _left_key(node_id, epoch)
        body = json.dumps({"node_id": node_id, "epoch": int(epoch)})
        value = json.dumps({"body": body, "mac": _mac(self._token, key, body) if self._token else ""})

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
        key = _left_key(node_id, epoch)
        value = self._r.get(key)
        if value is None:
            return False
        try:   # sealed like a record: a clean stop anyone who can write to Redis noted is none
            inner = _opened(key, _document(value), self._token)
        except ValueError:
            return False
        return inner.get("node_id") == node_id and _whole(inner.get("epoch")) and inner["epoch"] == int(epoch)

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


class Heartbeat:
    """Re-announces ``info()`` every ``interval_s`` with ``ttl_s`` (interval < TTL), on a
    daemon thread; :meth:`stop` withdraws the record. A failed announce is logged and retried
    at the next beat (the record may lapse meanwhile: the node looks dead, never wrong).

    Two live nodes given one node id: each beat first reads the record there
    (:meth:`Registry.holding`). A record of another life (epoch) found after this one has
    written or stood aside was written since by a node that is alive; the node started later
    (larger epoch) then stands aside — it writes nothing, :attr:`conflict` says why, and an
    error is logged once a minute — until the other's record is gone, and the earlier one
    keeps its record (logging the same if the other wrote before it stood aside). (They used
    to overwrite each other's record every beat: readers saw the id flip between the two
    addresses and half of either node's blocks missed.) A record of another life found
    before this one has written is that of a previous life of the node, restarted within the
    TTL, or of a live twin: this node writes nothing until it tells which — the record
    lapses (a previous life: this node registers at its next beat, within that life's TTL
    and one interval) or is rewritten, its end (on the registry's clock) moved later by more
    than :data:`REWRITE_SLACK_S` (a live twin: the later epoch stands aside, as above). A
    record not rewritten within this node's own ``ttl_s`` of watching is written over: a
    dead life's of a longer TTL, or one planted by whoever can write to Redis (with a long
    TTL it kept a node without a token out of the cluster for as long). (Its first beat used
    to write over the record at once, so a twin took a live node's id for a beat.)
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
