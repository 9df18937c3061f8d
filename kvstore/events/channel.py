"""Where KV events travel: a Redis Stream (across processes and hosts) or, with no Redis
configured, an in-process channel (single-host runs; it says so once in the log).

Both are append-only logs bounded in length: a reader that falls behind the bound loses
the oldest events, which the replica detects as a sequence gap and repairs from a snapshot.

Redis entries are sealed with the store token, as membership records are
(:mod:`kvstore.cluster.membership`): a publisher with a token adds ``mac``, an HMAC-SHA256
under it over the stream's name and every other field; a reader with a token skips (and
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


def event_mac(token: str, stream: str, fields: dict[bytes, bytes]) -> bytes:
    """The seal of a stream entry: HMAC-SHA256 under ``token`` over the stream's name and
    every field but ``mac`` (each name and value length-prefixed), as hex bytes."""
    mac = hmac.new(token.encode(), _MAC_CONTEXT + stream.encode() + b"\0", hashlib.sha256)
    for name in sorted(fields):
        if name != b"mac":
            value = fields[name]
            mac.update(b"%d:%s%d:%s" % (len(name), name, len(value), value))
    return mac.hexdigest().encode()


class RedisEventChannel(EventChannel):
    """A Redis Stream ``stream`` at ``url``, trimmed to about ``maxlen`` entries (one entry
    per event). Publishing pipelines the XADDs of a batch into one round trip. With
    ``token`` (the store token) entries are sealed and a read skips those that are not
    (see the module's docstring)."""

    def __init__(self, url: str, stream: str = DEFAULT_STREAM, maxlen: int = DEFAULT_MAXLEN,
                 token: str | None = None) -> None:
        import redis  # imported here: single-host runs need no Redis client

        self.url, self.stream, self.maxlen, self._token = url, stream, maxlen, token or None
        self._skipped, self._warned_at = 0, -WARN_AGAIN_S
        from kvstore.cluster.redis_server import redact_url
        self.description = f"Redis stream {stream!r} at {redact_url(url)}"   # logged: no password
        self._redis = redis.Redis.from_url(url)

    def publish(self, events: Sequence[KVEvent]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for event in events:
            fields = event.to_fields()
            if self._token:
                fields[b"mac"] = event_mac(self._token, self.stream, fields)
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
                if self._token and not hmac.compare_digest(
                        fields.get(b"mac", b""), event_mac(self._token, self.stream, fields)):
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
