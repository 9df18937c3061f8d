"""Where KV events travel: a Redis Stream (across processes and hosts) or, with no Redis
configured, an in-process channel (single-host runs; it says so once in the log).

Both are append-only logs bounded in length: a reader that falls behind the bound loses
the oldest events, which the replica detects as a sequence gap and repairs from a snapshot.

Redis entries are sealed with the store token, as membership records are
(:mod:`kvstore.cluster.membership`): a publisher with a token adds ``mac``, an HMAC-SHA256
under it over the stream's name and the event's fields (:class:`EventSeal`); a reader with a token skips (and
logs) an entry without a valid one, so whoever can write to the Redis but holds no token
cannot make the router count hits that are not there. A replayed genuine entry is a stale
sequence number to the replica. Publishers and readers must share the token: a reader with
one skips every event of a publisher without.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from itertools import islice
from typing import Any, cast

from kvstore.events.event import KVEvent

log = logging.getLogger(__name__)
DEFAULT_STREAM = "kvstore:events"
# The Redis URL KV events go to, for the processes `kvstore up` starts (it may hold a
# password, so it travels in the environment, not on a command line).
EVENTS_URL_ENV = "KVSTORE_EVENTS_URL"
DEFAULT_MAXLEN = 100_000
_MAC_CONTEXT = b"kvstore kv event v1\0"
WARN_AGAIN_S = 60.0          # skipped entries are logged at most once a minute (with a count)


class EventChannel(ABC):
    """An append-only log of events. ``read`` cursors are opaque to callers."""

    description: str = "channel"

    @abstractmethod
    def publish(self, events: Sequence[KVEvent]) -> None:
        """Append ``events`` in order. Raises OSError (or a client error) when the log
        cannot be reached; the events are then lost (readers see a gap)."""

    @abstractmethod
    def start_cursor(self, from_start: bool) -> Any:
        """A cursor before the oldest event kept (``from_start``) or after the newest."""

    @abstractmethod
    def read(self, cursor: Any, count: int = 1000, block_s: float = 0.0) -> tuple[Any, list[KVEvent]]:
        """Up to ``count`` events after ``cursor``, waiting up to ``block_s`` seconds for the
        first one. Returns the new cursor and the events (possibly none)."""

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Release connections."""


class LocalEventChannel(EventChannel):
    """An in-process log of at most ``maxlen`` events. Thread-safe."""

    description = "in-process channel (single host, this process only)"

    def __init__(self, maxlen: int = DEFAULT_MAXLEN) -> None:
        self._log: deque[KVEvent] = deque(maxlen=maxlen)
        self._base = 0                      # absolute position of self._log[0]
        self._cond = threading.Condition()

    def publish(self, events: Sequence[KVEvent]) -> None:
        with self._cond:
            before = len(self._log)
            self._log.extend(events)
            self._base += before + len(events) - len(self._log)  # dropped off the left
            self._cond.notify_all()

    def _end(self) -> int:
        return self._base + len(self._log)

    def start_cursor(self, from_start: bool) -> int:
        with self._cond:
            return self._base if from_start else self._end()

    def read(self, cursor: int, count: int = 1000, block_s: float = 0.0) -> tuple[int, list[KVEvent]]:
        with self._cond:
            if cursor >= self._end() and block_s > 0:
                self._cond.wait(block_s)
            start = max(cursor, self._base)
            events = list(islice(self._log, start - self._base, start - self._base + count))
            return start + len(events), events


# The fields a seal covers, in this order; the key (binary) last, the others are text that
# holds no NUL (ids from the command line, enum values, numbers), so NUL-joined they are one
# unambiguous message. A field not listed (a later wire version's) is not covered.
_SEALED_FIELDS = (b"v", b"node", b"epoch", b"seq", b"kind", b"tier", b"size", b"ts", b"key")


class EventSeal:
    """Seals a stream's entries with ``token``: :meth:`of` is HMAC-SHA256 under the token
    over the stream's name and the entry's :data:`_SEALED_FIELDS` (32 bytes). The keyed
    state is computed once, each entry's costs a copy (about 3 us here, not 16)."""

    def __init__(self, token: str, stream: str) -> None:
        self._base = hmac.new(token.encode(), _MAC_CONTEXT + stream.encode() + b"\0", hashlib.sha256)

    def of(self, fields: dict[bytes, bytes]) -> bytes:
        mac = self._base.copy()
        mac.update(b"\0".join([fields.get(name, b"") for name in _SEALED_FIELDS]))
        return mac.digest()

    def holds(self, fields: dict[bytes, bytes]) -> bool:
        """Whether ``fields`` carry a valid ``mac`` (compared in constant time)."""
        return hmac.compare_digest(fields.get(b"mac", b""), self.of(fields))


class RedisEventChannel(EventChannel):
    """A Redis Stream ``stream`` at ``url``, trimmed to about ``maxlen`` entries (one entry
    per event). Publishing pipelines the XADDs of a batch into one round trip. With
    ``token`` (the store token) entries are sealed and a read skips those that are not
    (see the module's docstring)."""

    def __init__(self, url: str, stream: str = DEFAULT_STREAM, maxlen: int = DEFAULT_MAXLEN,
                 token: str | None = None) -> None:
        import redis  # imported here: single-host runs need no Redis client

        self.url, self.stream, self.maxlen = url, stream, maxlen
        self._seal = EventSeal(token, stream) if token else None
        self._skipped, self._warned_at = 0, -WARN_AGAIN_S
        from kvstore.cluster.redis_server import redact_url
        self.description = f"Redis stream {stream!r} at {redact_url(url)}"   # logged: no password
        self._redis = redis.Redis.from_url(url)

    def publish(self, events: Sequence[KVEvent]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for event in events:
            fields = event.to_fields()
            if self._seal is not None:
                fields[b"mac"] = self._seal.of(fields)
            # redis-py types the fields as a dict of its own key and value unions (a dict is
            # invariant, so dict[bytes, bytes] is not one); bytes are what it sends.
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
        pipe.execute()

    def start_cursor(self, from_start: bool) -> str:
        if from_start:
            return "0-0"
        info = self._redis.xinfo_stream(self.stream) if self._redis.exists(self.stream) else None
        return info["last-generated-id"].decode() if info else "0-0"

    def read(self, cursor: str, count: int = 1000, block_s: float = 0.0) -> tuple[str, list[KVEvent]]:
        block_ms = int(block_s * 1000) if block_s > 0 else None
        # RESP2 (redis-py's default protocol): [[stream, [(entry id, {field: value}), ...]]]
        reply = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None",
                     self._redis.xread({self.stream: cursor}, count=count, block=block_ms))
        events: list[KVEvent] = []
        skipped_id = ""
        for _, entries in reply or ():
            for entry_id, fields in entries:
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if self._seal is not None and not self._seal.holds(fields):
                    self._skipped, skipped_id = self._skipped + 1, cursor
                    continue
                try:
                    events.append(KVEvent.from_fields(fields))
                except ValueError as exc:
                    log.warning("skipping stream entry %s: %s", cursor, exc)
        if skipped_id:
            self._warn_skipped(skipped_id)
        return cursor, events

    def _warn_skipped(self, entry_id: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_AGAIN_S:
            log.warning("skipped %d KV event(s) not sealed with this store token (the last: entry %s of %s): "
                        "forged, or their publisher runs without the store token", self._skipped, entry_id,
                        self.stream)
            self._skipped, self._warned_at = 0, now

    def close(self) -> None:
        self._redis.close()


_LOCAL: LocalEventChannel | None = None
_LOCAL_LOCK = threading.Lock()


def local_channel() -> LocalEventChannel:
    """The process-wide in-process channel (logs once that events stay in this process)."""
    global _LOCAL
    with _LOCAL_LOCK:
        if _LOCAL is None:
            _LOCAL = LocalEventChannel()
            log.info("KV events: no Redis configured; using an in-process channel, so only index "
                     "replicas in this process see them (give the node --redis URL for a scheduler "
                     "elsewhere)")
        return _LOCAL


def make_channel(redis_url: str | None, stream: str = DEFAULT_STREAM, token: str | None = None) -> EventChannel:
    """A Redis Stream channel when ``redis_url`` is set (entries sealed with ``token``, the
    store token), else the in-process channel."""
    return RedisEventChannel(redis_url, stream, token=token) if redis_url else local_channel()
