"""KV events (kvstore/events): a store node's index publishes BlockStored / BlockRemoved /
NodeCleared with per-node sequence numbers; a scheduler-side replica applies them, detects
gaps and resynchronises from the node's Snapshot RPC. Real Redis (a private redis-server),
real gRPC store nodes, real tiers. The channels' own entries (format, seals, bounds):
test_event_channel.py."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.events import (
    EventChannel,
    EventKind,
    IndexReplica,
    KVEvent,
    LocalEventChannel,
    PublishingIndex,
    RedisEventChannel,
    local_channel,
    make_channel,
    store_snapshot_source,
)
from kvstore.node import StoreNode
from kvstore.pool.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS

NODE = "node-a"
BLOCK = 4096
K = [bytes([i]) * 32 for i in range(12)]


class DropOne(EventChannel):
    """Publishes through ``inner`` but loses the event of seq ``drop_seq`` on the way."""

    def __init__(self, inner: EventChannel, drop_seq: int) -> None:
        self.inner, self.drop_seq, self.dropped = inner, drop_seq, 0
        self.description = f"{inner.description} (dropping seq {drop_seq})"

    def publish(self, events: Sequence[KVEvent]) -> None:
        kept = [e for e in events if e.seq != self.drop_seq]
        self.dropped += len(events) - len(kept)
        self.inner.publish(kept)

    def start_cursor(self, from_start: bool) -> Any:
        return self.inner.start_cursor(from_start)

    def read(self, cursor: Any, count: int = 1000, block_s: float = 0.0) -> tuple[Any, list[KVEvent]]:
        return self.inner.read(cursor, count, block_s)


def channel_of(kind: str, request: pytest.FixtureRequest) -> EventChannel:
    if kind == "redis":
        return RedisEventChannel(request.getfixturevalue("redis_url"), stream="test:events")
    return LocalEventChannel()


class Node:
    """A store node (HBM on the CPU over DRAM, or DRAM only) whose index publishes to
    ``channel``, served over gRPC on 127.0.0.1."""

    def __init__(self, channel: EventChannel, tiers: tuple[str, ...] = ("hbm", "dram"),
                 node_id: str = NODE) -> None:
        made = [TIERS["hbm"](16 * BLOCK, device="cpu") if t == "hbm" else TIERS[t](64 * BLOCK) for t in tiers]
        self.index = PublishingIndex(node_id, channel)
        self.pool = KVPool(made, node_id=node_id, index=self.index)
        self.server, port = serve_store(self.pool)
        self.address = f"127.0.0.1:{port}"
        self.client = StoreClient(self.address)
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.client.close()
            self.server.stop(None).wait()
            self.index.close()
            self.pool.close()


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        node.stop()


def converged(replica: IndexReplica, node: Node) -> bool:
    """Whether the replica holds exactly the node's copies, once it reached the node's seq."""
    assert replica.wait_for(node.index.node_id, node.index.seq, epoch=node.index.epoch), replica.stats()
    with replica.lock:
        mine = sorted(replica.index.node_entries(node.index.node_id))
    return mine == sorted(node.index.node_entries(node.index.node_id))


def tiers_of(replica: IndexReplica, keys: Sequence[bytes], node: str = NODE) -> tuple[str, ...]:
    return replica.match(keys).per_node.get(node, ())


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_hbm_and_dram_copies_then_node_cleared(kind, request, nodes) -> None:
    """A block in HBM and DRAM on one node; evicting the HBM copy keeps the node's
    hit, evicting the DRAM copy removes it; a cleared node's hits drop to 0 at once."""
    channel = channel_of(kind, request)
    node = Node(channel)
    nodes.append(node)
    with IndexReplica(channel, store_snapshot_source({NODE: node.address})) as replica:
        chain = K[:3]
        assert all(r.ok for r in node.client.put_blocks([(k, bytes([i]) * BLOCK) for i, k in enumerate(chain)]))
        assert converged(replica, node) and tiers_of(replica, chain) == ("hbm",) * 3

        node.client.evict("hbm", 1 << 30)                  # demote all three to DRAM
        assert converged(replica, node) and tiers_of(replica, chain) == ("dram",) * 3
        assert node.client.get(chain[0]) == bytes([0]) * BLOCK   # a DRAM hit promotes K0 to HBM
        assert converged(replica, node)
        with replica.lock:
            assert replica.index.entry(chain[0]).locations == {NODE: ("hbm", "dram")}
        assert tiers_of(replica, chain) == ("hbm", "dram", "dram")

        node.client.evict("hbm", 1)                        # the HBM copy of K0 goes; DRAM stays
        assert converged(replica, node)
        assert tiers_of(replica, chain) == ("dram",) * 3 and replica.match(chain).blocks == 3

        node.client.evict("dram", 1 << 30)                 # the DRAM copies go: no copy left
        assert converged(replica, node)
        assert tiers_of(replica, chain) == () and replica.match(chain).blocks == 0

        node.client.put_blocks([(k, b"x" * BLOCK) for k in chain])
        assert converged(replica, node) and replica.hits(chain) == {NODE: 3}
        node.stop()                                        # NodeCleared: its hits drop at once
        assert replica.wait_for(NODE, node.index.seq, epoch=node.index.epoch)
        assert replica.hits(chain) == {} and replica.match(chain).blocks == 0
        with replica.lock:
            replica.index.check_integrity()
        assert replica.stats().gaps == 0


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_lost_event_is_detected_and_the_replica_converges(kind, request, nodes) -> None:
    """One event lost on the way (a BlockRemoved, so the replica would keep a
    phantom hit); the next event reveals the gap; a snapshot makes the replica exact."""
    inner = channel_of(kind, request)
    dropping = DropOne(inner, drop_seq=6)       # seq 1 NodeCleared, 2-5 stored, 6 removed
    node = Node(dropping, tiers=("dram",))
    nodes.append(node)
    with IndexReplica(inner, store_snapshot_source({NODE: node.address})) as replica:
        node.client.put_blocks([(k, b"a" * BLOCK) for k in K[:4]])
        assert node.index.seq == 5 and converged(replica, node)
        node.pool.remove(K[1])                  # seq 6: lost
        node.index.publisher.flush()
        assert replica.match(K[:4]).blocks == 4           # the phantom: the replica missed it
        node.client.put_blocks([(K[4], b"b" * BLOCK)])    # seq 7 reveals the gap
        assert converged(replica, node)
        assert dropping.dropped == 1
        stats = replica.stats()
        assert stats.gaps == 1 and stats.resyncs == 1
        assert replica.match(K[:4]).blocks == 1 and K[4] in replica.index
        node.client.put_blocks([(K[5], b"c" * BLOCK)])    # and events flow on after it
        assert converged(replica, node) and replica.stats().gaps == 1


def test_event_deleted_from_the_stream_before_a_late_replica_reads_it(redis_url, nodes) -> None:
    """An entry XDEL'ed from the Redis Stream (a trimmed or lost event) is a gap for a
    replica that reads the stream from its start."""
    channel = RedisEventChannel(redis_url, stream="test:events")
    node = Node(channel, tiers=("dram",))
    nodes.append(node)
    node.client.put_blocks([(k, b"a" * BLOCK) for k in K[:3]])
    node.pool.remove(K[0])
    node.client.put_blocks([(K[3], b"a" * BLOCK)])
    node.index.publisher.flush()
    r = redis.Redis.from_url(redis_url)
    entries = r.xrange("test:events")
    assert [int(f[b"seq"]) for _, f in entries] == list(range(1, 7))
    assert r.xdel("test:events", entries[4][0]) == 1        # seq 5: K0 removed
    replica = IndexReplica(channel, store_snapshot_source({NODE: node.address}))
    while replica.poll():
        pass
    assert replica.stats().gaps == 1 and converged(replica, node)
    assert replica.match(K[:4]).blocks == 0 and replica.longest_prefix(K[1:4]) == 3


def test_replica_joining_mid_epoch_takes_a_snapshot(nodes) -> None:
    channel = LocalEventChannel()
    node = Node(channel, tiers=("dram",))
    nodes.append(node)
    node.client.put_blocks([(k, b"a" * BLOCK) for k in K[:3]])
    node.index.publisher.flush()
    replica = IndexReplica(channel, store_snapshot_source({NODE: node.address}), from_start=False)
    assert replica.poll() == 0 and replica.match(K[:3]).blocks == 0   # it knows nothing yet
    node.client.put_blocks([(K[3], b"a" * BLOCK)])
    node.index.publisher.flush()
    replica.poll()
    assert converged(replica, node) and replica.hits(K[:4]) == {NODE: 4}
    assert replica.stats().resyncs == 1


def test_restarted_node_starts_a_new_epoch(tmp_path, nodes) -> None:
    """A node that restarts forgets what it held (the DRAM tier): its new epoch opens with
    NodeCleared, so the replica drops the old copies without a snapshot."""
    channel = LocalEventChannel()
    first = Node(channel, tiers=("dram",))
    nodes.append(first)
    first.client.put_blocks([(k, b"a" * BLOCK) for k in K[:3]])
    replica = IndexReplica(channel, store_snapshot_source({NODE: first.address}))
    replica.start()
    try:
        assert converged(replica, first)
        first.stop()
        second = Node(channel, tiers=("dram",))
        nodes.append(second)
        second.client.put_blocks([(K[5], b"b" * BLOCK)])
        assert second.index.epoch > first.index.epoch and converged(replica, second)
        assert replica.match(K[:3]).blocks == 0 and replica.hits([K[5]]) == {NODE: 1}
        assert replica.stats().resyncs == 0
        # A late event of the old epoch changes nothing.
        replica.apply(KVEvent(NODE, first.index.epoch, 99, EventKind.BLOCK_STORED, K[7], "dram", 1))
        assert K[7] not in replica.index and replica.stats().stale >= 1
    finally:
        replica.stop()


def test_lost_node_is_dropped_and_an_unreachable_node_gives_no_stale_hits(nodes) -> None:
    channel = LocalEventChannel()
    node = Node(channel, tiers=("dram",))
    nodes.append(node)
    node.client.put_blocks([(k, b"a" * BLOCK) for k in K[:2]])
    node.index.publisher.flush()                    # events leave on a background thread
    replica = IndexReplica(channel, store_snapshot_source({NODE: "127.0.0.1:1"}, timeout_s=2))
    while replica.poll():
        pass
    assert replica.hits(K[:2]) == {NODE: 2}
    assert replica.drop_node(NODE) == 2 and replica.hits(K[:2]) == {}
    # The next event is mid-epoch for a dropped node: the snapshot fails (no such address):
    # the node stays out of the replica rather than giving hits that may be stale.
    node.client.put_blocks([(K[2], b"a" * BLOCK)])
    node.index.publisher.flush()
    replica.poll()
    assert replica.stats().resync_failures == 1 and replica.hits(K[:3]) == {}


def test_snapshot_rpc_is_consistent_with_the_event_seq(nodes, store_node) -> None:
    node = Node(LocalEventChannel(), tiers=("hbm", "dram"))
    nodes.append(node)
    blocks = [(k, bytes([i]) * BLOCK) for i, k in enumerate(K[:10])]
    node.client.put_blocks(blocks)
    node.client.evict("hbm", 3 * BLOCK)
    snap = node.client.snapshot()
    assert (snap.node, snap.epoch, snap.seq) == (NODE, node.index.epoch, node.index.seq)
    assert sorted(snap.entries) == sorted(node.index.node_entries(NODE))
    assert {t for _, t, _ in snap.entries} == {"hbm", "dram"} and {s for *_, s in snap.entries} == {BLOCK}
    # A pool whose index publishes nothing still answers, with epoch and seq 0.
    pool, address = store_node
    pool.put(K[0], b"z" * 100)
    with StoreClient(address) as client:
        plain = client.snapshot()
    assert (plain.epoch, plain.seq) == (0, 0) and plain.entries == ((K[0], "dram", 100),)


def test_snapshot_streams_many_entries(nodes) -> None:
    node = Node(LocalEventChannel(), tiers=("dram",))
    nodes.append(node)
    for i in range(20_000):  # index-only copies: the Snapshot RPC streams them in chunks
        node.index.add(i.to_bytes(32, "little"), NODE, "dram", 1)
    snap = node.client.snapshot()
    assert len(snap.entries) == 20_000 and snap.seq == node.index.seq


def test_no_redis_means_an_in_process_channel_and_the_node_says_so(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    import kvstore.events.channel as channel_module
    channel_module._LOCAL = None                 # as in a fresh process
    assert make_channel(None) is local_channel()
    assert "in-process" in caplog.text
    replica = IndexReplica(local_channel(), from_start=False)
    cfg = StoreConfig(node_id="solo", port=0, dram_bytes=1 << 20, ssd_bytes=0, data_dir=str(tmp_path))
    node = StoreNode.start(cfg)
    pool = node.pool
    try:
        with StoreClient(node.address) as client:
            client.put(K[0], b"q" * 100)
        pool.index.publisher.flush()
        while replica.poll():
            pass
        assert replica.hits([K[0]]) == {"solo": 1}
    finally:
        node.stop(grace_s=0)
    replica.poll()
    assert replica.hits([K[0]]) == {}


def test_store_config_takes_a_redis_url(redis_url, tmp_path) -> None:
    with pytest.raises(ValueError, match="redis://"):
        StoreConfig(redis_url="localhost:6379")
    cfg = StoreConfig.load(None, node_id="r1", port=0, dram_bytes="1MiB", ssd_bytes=0,
                           data_dir=str(tmp_path), redis_url=redis_url)
    node = StoreNode.start(cfg)
    pool = node.pool
    channel = make_channel(redis_url)
    replica = IndexReplica(channel, store_snapshot_source({"r1": node.address})).start()
    try:
        with StoreClient(node.address) as client:
            client.put(K[1], b"r" * 100)
        assert replica.wait_for("r1", pool.index.seq) and replica.hits([K[1]]) == {"r1": 1}
    finally:
        node.stop(grace_s=0)
        assert replica.wait_for("r1", pool.index.seq) and replica.hits([K[1]]) == {}
        replica.stop()
    assert isinstance(channel, RedisEventChannel)


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_a_replica_from_now_skips_the_past(kind, request) -> None:
    channel = channel_of(kind, request)
    channel.publish([KVEvent("n", 1, 1, EventKind.NODE_CLEARED)])
    cursor = channel.start_cursor(False)
    channel.publish([KVEvent("n", 1, 2, EventKind.BLOCK_STORED, K[0], "dram", 1)])
    assert [e.seq for e in channel.read(cursor)[1]] == [2]
    assert [e.seq for e in channel.read(channel.start_cursor(True))[1]] == [1, 2]


def test_an_index_that_does_not_speak_for_its_id_publishes_nothing_until_it_does() -> None:
    """A store node in a cluster publishes its KV events only while it holds its node id
    (kvstore/cluster/agent.py): held back, they change no replica; once it speaks, a new
    epoch announces every copy it holds, replacing what another life of the id published."""
    channel = LocalEventChannel()
    other = PublishingIndex(NODE, channel)                     # the live node of this id
    other.add(K[0], NODE, "dram", 10)
    twin = PublishingIndex(NODE, channel, speaking=False)      # a second one, standing aside
    twin.add(K[1], NODE, "dram", 10)
    twin.add(K[2], NODE, "ssd", 10)
    other.publisher.flush()
    twin.publisher.flush()
    replica = IndexReplica(channel)
    replica.poll()
    assert replica.hits([K[0]]) == {NODE: 1} and replica.hits([K[1]]) == {}
    assert replica.node_state(NODE).epoch == other.epoch
    other.close()                                              # the live node stops; the twin takes the id
    twin.speak(True)
    twin.speak(True)                                           # idempotent: no second epoch
    twin.publisher.flush()
    replica.poll()
    state = replica.node_state(NODE)
    assert twin.epoch > other.epoch and (state.epoch, state.seq) == (twin.epoch, 3)
    assert replica.hits([K[0]]) == {} and replica.hits([K[1]]) == {NODE: 1} and replica.hits([K[2]]) == {NODE: 1}
    twin.speak(False)
    twin.add(K[3], NODE, "dram", 10)
    twin.close()                                               # held back too: no NodeCleared
    replica.poll()
    assert replica.hits([K[1]]) == {NODE: 1} and replica.hits([K[3]]) == {}
