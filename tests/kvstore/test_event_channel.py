"""The KV event channels (kvstore/events/channel.py): a Redis stream's entries round-trip and
foreign ones are skipped, a reader with the store token takes only entries sealed with it,
and the in-process channel is bounded, its slow reader seeing a gap. Real Redis."""
from __future__ import annotations

import logging

import redis

from kvstore.events import EventKind, IndexReplica, KVEvent, LocalEventChannel, RedisEventChannel


def test_event_wire_format_round_trips_and_rejects_foreign_entries(redis_url) -> None:
    event = KVEvent("n", 123, 7, EventKind.BLOCK_STORED, b"\x00\xffkey", "hbm", 65536, 1.5)
    assert KVEvent.from_fields(event.to_fields()) == event
    channel = RedisEventChannel(redis_url, stream="test:wire")
    channel.publish([event])
    r = redis.Redis.from_url(redis_url)
    r.xadd("test:wire", {b"v": b"999", b"node": b"n"})        # not ours: skipped
    r.xadd("test:wire", {b"v": b"1", b"node": b"n"})          # truncated: skipped
    channel.publish([KVEvent("n", 123, 8, EventKind.NODE_CLEARED, ts=2.0)])
    cursor, events = channel.read(channel.start_cursor(True))
    assert [e.seq for e in events] == [7, 8] and events[1].kind is EventKind.NODE_CLEARED
    assert channel.read(cursor, block_s=0.05) == (cursor, [])
    assert all(v for v in event.to_fields().values() if v is not event.key)


def test_sealed_entries_are_read_and_forged_or_unsealed_ones_skipped_with_a_log_line(redis_url, caplog) -> None:
    """Whoever can write to the Redis but holds no store token cannot publish a hit: a
    reader with the token skips every entry not sealed with it (logged once, with a count)."""
    sealed = RedisEventChannel(redis_url, stream="test:sealed", token="store-token")
    stored = KVEvent("n", 1, 1, EventKind.BLOCK_STORED, b"k" * 32, "dram", 4096, 1.0)
    sealed.publish([stored])
    forged = KVEvent("n", 1, 2, EventKind.BLOCK_STORED, b"f" * 32, "dram", 4096, 1.0)
    RedisEventChannel(redis_url, stream="test:sealed").publish([forged])                    # no token
    RedisEventChannel(redis_url, stream="test:sealed", token="other").publish([forged])     # another token
    fields = stored.to_fields()
    fields[b"mac"] = b"0" * 64                                                               # a made-up seal
    redis.Redis.from_url(redis_url).xadd("test:sealed", fields)
    moved = RedisEventChannel(redis_url, stream="test:other", token="store-token")
    moved.publish([forged])                                       # a genuine seal is for its own stream only
    entry = redis.Redis.from_url(redis_url).xrange("test:other")[0][1]
    redis.Redis.from_url(redis_url).xadd("test:sealed", entry)
    sealed.publish([KVEvent("n", 1, 2, EventKind.NODE_CLEARED, ts=2.0)])
    with caplog.at_level(logging.WARNING, logger="kvstore.events.channel"):
        _, events = sealed.read(sealed.start_cursor(True))
    assert events == [stored, KVEvent("n", 1, 2, EventKind.NODE_CLEARED, ts=2.0)]
    assert [m for m in caplog.messages if "skipped 4 KV event(s) not sealed" in m]
    _, everything = RedisEventChannel(redis_url, stream="test:sealed").read("0-0")   # a tokenless reader takes all
    assert len(everything) == 6


def test_local_channel_is_bounded_and_a_slow_reader_sees_a_gap() -> None:
    channel = LocalEventChannel(maxlen=4)
    channel.publish([KVEvent("n", 1, s, EventKind.NODE_CLEARED) for s in range(1, 11)])
    cursor = channel.start_cursor(True)
    cursor, events = channel.read(cursor)
    assert [e.seq for e in events] == [7, 8, 9, 10] and channel.read(cursor) == (cursor, [])
    replica = IndexReplica(channel)             # no snapshot source: carries on, says so
    replica.poll()
    assert replica.stats().gaps == 1 and replica.node_state("n").seq == 10
