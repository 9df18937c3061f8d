"""Several store node processes as one pool, found through a real Redis: membership with TTL
heartbeats, placement that keeps a chain together, lookups and reads across nodes, and a
node that dies — its blocks become misses within the TTL and generation still completes,
token-identical, by recomputing them."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from kvstore.admin.client import AdminClient
from kvstore.cluster import LocalRegistry, NodeInfo, RedisRegistry
from kvstore.cluster.client import ClusterClient
from kvstore.cluster.health import ClusterHealth
from kvstore.cluster.heartbeat import Heartbeat
from kvstore.cluster.membership import KEY_PREFIX, LEFT_PREFIX, LEFT_TTL_S
from kvstore.cluster.placement import plan_chain
from kvstore.events.channel import make_channel
from kvstore.events.replica import IndexReplica, store_snapshot_source

TTL_S, BEAT_S = 1.5, 0.3
NODE_FLAGS = ("--ssd", "0", "--heartbeat", str(BEAT_S), "--node-ttl", str(TTL_S))


@pytest.mark.parametrize("prefer,expected", [
    (None, [("b", 0, 5), ("a", 5, 8), ("c", 8, 10)]),     # most free first, spilling when full
    ("a", [("a", 0, 3), ("b", 3, 8), ("c", 8, 10)]),      # the parent's node first
    ("c", [("c", 0, 2), ("b", 2, 7), ("a", 7, 10)]),
])
def test_placement_keeps_a_chain_together_by_free_bytes(prefer, expected):
    assert plan_chain([10] * 10, {"a": 35, "b": 50, "c": 20}, prefer=prefer) == expected


def test_placement_when_full_and_with_replicas():
    assert plan_chain([10] * 4, {"a": 5, "b": 5}) == [("a", 0, 4)]     # the pool there evicts
    assert plan_chain([10] * 4, {"a": 100, "b": 50, "c": 20}, replicas=2) == [("a", 0, 4), ("b", 0, 4)]
    assert plan_chain([10], {"a": 100}, replicas=3) == [("a", 0, 1)]
    assert plan_chain([10], {}) == []


@pytest.mark.parametrize("make", ["local", "redis"])
def test_membership_expires_without_heartbeat_and_leaves_on_stop(make, request):
    registry = LocalRegistry() if make == "local" else RedisRegistry(request.getfixturevalue("redis_url"))
    info = NodeInfo("n1", "127.0.0.1:1", (("dram", 100, 10),), 85, "127.0.0.1:2", 7)
    assert NodeInfo.from_json(info.to_json()) == info
    beat = Heartbeat(registry, lambda: info, ttl_s=0.6, interval_s=0.2).start()
    time.sleep(0.8)
    assert registry.nodes() == [info]                  # refreshed past one TTL
    beat.stop()
    assert registry.nodes() == []                      # a clean stop withdraws at once
    registry.register(info, 0.3)                       # a node that dies: no more beats
    assert registry.nodes() == [info]
    time.sleep(0.5)
    assert registry.nodes() == []
    with pytest.raises(ValueError, match="below the TTL"):
        Heartbeat(registry, lambda: info, ttl_s=1.0, interval_s=1.0)


@pytest.mark.parametrize("make,token", [("local", None), ("redis", None), ("redis", "t0ken")])
def test_a_node_finding_another_lifes_record_at_start_tells_a_dead_life_from_a_live_twin(make, token, request):
    """A node's first beat wrote over any record at its id: a twin started beside a live
    node took the id for a beat (readers saw it flip, and the live node's blocks missed). It
    now writes nothing until the record lapses (a previous life's: it registers then) or is
    rewritten (a live twin's: the later epoch stands aside)."""
    def registry_() -> LocalRegistry | RedisRegistry:
        return LocalRegistry() if make == "local" else RedisRegistry(request.getfixturevalue("redis_url"), token)

    registry, held, beats = registry_(), [], []
    live, twin = NodeInfo("n1", "127.0.0.1:1", epoch=100), NodeInfo("n1", "127.0.0.1:2", epoch=200)
    try:
        first = Heartbeat(registry, lambda: live, ttl_s=0.6, interval_s=0.1).start()
        beats.append(first)
        second = Heartbeat(registry, lambda: twin, ttl_s=0.6, interval_s=0.1, on_holding=held.append).start()
        beats.append(second)
        seen = set()
        for _ in range(40):                            # 2 TTLs, every 0.03 s from the twin's start
            seen |= {n.address for n in registry.nodes()}
            time.sleep(0.03)
        assert seen == {"127.0.0.1:1"}, f"the id flipped between {sorted(seen)}"
        assert second.conflict and "also used by the live node at 127.0.0.1:1" in second.conflict
        assert held and not any(held)                  # it never spoke for the id
        second.stop()
        assert registry.nodes() == [live]              # its stop leaves the live node's record
        first.stop()

        dead = NodeInfo("n1", "127.0.0.1:1", epoch=300)   # a life that crashed: its record, no more beats
        registry.register(dead, 1.0)
        restarted, held = NodeInfo("n1", "127.0.0.1:1", epoch=400), []
        t0 = time.monotonic()
        beat = Heartbeat(registry, lambda: restarted, ttl_s=0.6, interval_s=0.1, on_holding=held.append).start()
        beats.append(beat)
        assert registry.nodes() == [dead] and held == [False]   # waits: it cannot tell yet
        while registry.nodes() != [restarted]:
            assert time.monotonic() - t0 < 1.0 + 1.5, "the restarted node did not register once the record lapsed"
            time.sleep(0.02)
        assert beat.conflict is None
        time.sleep(0.15)
        assert held[-1] is True
        beat.stop()

        # a record no live node rewrites, with a TTL far past this node's (a dead life's of a
        # longer TTL, or planted by hand): written over once this node's own TTL has passed
        registry.register(NodeInfo("n1", "10.6.6.6:50051", epoch=1), 600.0)
        t0 = time.monotonic()
        beat = Heartbeat(registry, lambda: restarted, ttl_s=0.6, interval_s=0.1)
        beats.append(beat.start())
        while registry.nodes() != [restarted]:
            assert time.monotonic() - t0 < 0.6 + 1.5, "a record nobody rewrites kept the node out"
            time.sleep(0.02)
        assert beat.conflict is None
        if isinstance(registry, RedisRegistry):   # a record without a TTL was written by no heartbeat
            registry.register(NodeInfo("n2", "127.0.0.1:3", epoch=1), 30.0)
            registry._r.persist(KEY_PREFIX + "n2")
            assert registry.holder("n2") is None
            registry._r.delete(KEY_PREFIX + "n2")
            registry._r.hset(KEY_PREFIX + "n3", "a", "b")   # a key of another type: no holder, and a beat replaces it
            assert registry.holder("n3") is None
            third = NodeInfo("n3", "127.0.0.1:4", epoch=1)
            beats.append(Heartbeat(registry, lambda: third, ttl_s=0.6, interval_s=0.1).start())
            assert third in registry.nodes()
    finally:
        for b in beats:
            b.stop()
        registry.close()


@pytest.mark.parametrize("make,token", [("local", None), ("redis", None), ("redis", "t0ken")])
def test_a_stop_withdraws_only_its_own_life_and_notes_only_its_own_clean_stop(make, token, request):
    """A twin stopped before its second beat (so before it stood aside) neither deletes the live
    node's record (which would then miss for a beat) nor notes a clean stop the health check
    would read as the live node's, hiding that node's later crash."""
    registry = LocalRegistry() if make == "local" else RedisRegistry(request.getfixturevalue("redis_url"), token)
    live = NodeInfo("n1", "127.0.0.1:1", epoch=100)
    registry.register(live, 30.0)
    registry.deregister("n1", epoch=200)               # the twin's life: not the record's
    assert registry.nodes() == [live]
    assert not registry.left_cleanly("n1", 200) and not registry.left_cleanly("n1", 100)
    registry.deregister("n1", epoch=100)               # the live node's own clean stop
    assert registry.nodes() == []
    assert registry.left_cleanly("n1", 100) and not registry.left_cleanly("n1", 200)
    registry.deregister("n1", epoch=300)               # nothing there: a life whose record lapsed
    assert registry.left_cleanly("n1", 300) and registry.left_cleanly("n1", 100)   # each life its own
    assert not registry.left_cleanly("n2", 100)
    registry.close()


@pytest.mark.parametrize("make,token", [("local", None), ("redis", None), ("redis", "t0ken")])
def test_a_twins_clean_stop_neither_excuses_a_crash_nor_makes_a_clean_stop_look_like_one(make, token, request):
    """One clean-stop marker per node id, compared with the epoch the health check last listed:
    a twin whose first beat wrote over the live node's record and that stopped cleanly before
    the live node's next beat noted left=<its epoch>, which then excused the live node's crash
    (its epoch is the earlier); and a later clean stop of the earlier life wrote over the twin's
    marker, so the twin, listed last, looked crashed. Each life's clean stop is now its own."""
    registry = LocalRegistry() if make == "local" else RedisRegistry(request.getfixturevalue("redis_url"), token)
    health = ClusterHealth(registry, token)
    live, twin = NodeInfo("n1", "127.0.0.1:1", epoch=100), NodeInfo("n1", "127.0.0.1:2", epoch=200)
    try:
        registry.register(live, 30.0)
        health.check()                                 # the reader lists life 100 (no node answers there)
        registry.register(twin, 30.0)                  # the twin's first beat writes over it
        registry.deregister("n1", epoch=200)           # and it stops cleanly before the live node's next beat
        registry.register(live, 0.3)                   # that beat, the live node's last: it crashes
        time.sleep(0.5)
        assert registry.nodes() == []
        _, problems = health.check()
        assert [p.node_id for p in problems] == ["n1"] and "without a clean stop" in problems[0].why, problems

        registry.register(twin, 30.0)                  # the other way round: the reader lists the twin last
        health.check()
        registry.deregister("n1", epoch=200)           # the twin stops cleanly,
        registry.register(live, 30.0)                  # the live node beats again and stops cleanly too
        registry.deregister("n1", epoch=100)
        assert health.check() == (0, [])
    finally:
        health.close()
        registry.close()


def test_clean_stops_are_sealed_per_life_and_lapse_on_their_own(redis_url):
    """A clean stop is sealed with the store token for its (node id, epoch): one written by
    anyone else who can write to Redis, or moved to another life's key, does not count. Each
    life's note has its own TTL (:data:`LEFT_TTL_S`), so an id's notes stay bounded."""
    import redis

    registry = RedisRegistry(redis_url, "t0ken")
    registry.deregister("n1", epoch=100)
    registry.deregister("n1", epoch=200)
    other = RedisRegistry(redis_url, "another-token")
    other.deregister("n2", epoch=100)                  # another cluster's, or a forgery
    r = redis.Redis.from_url(redis_url)
    try:
        keys = sorted(r.scan_iter(match=LEFT_PREFIX + "*"))
        assert len(keys) == 3
        assert all(0 < r.pttl(k) <= LEFT_TTL_S * 1000 for k in keys)
        assert registry.left_cleanly("n1", 100) and registry.left_cleanly("n1", 200)
        assert not registry.left_cleanly("n2", 100) and other.left_cleanly("n2", 100)
        assert not other.left_cleanly("n1", 100)
        r.copy(LEFT_PREFIX + "n1:100", LEFT_PREFIX + "n1:300")   # a sealed note replayed at another life's key
        r.set(LEFT_PREFIX + "n1:400", json.dumps({"body": json.dumps({"node_id": "n1", "epoch": 400}), "mac": ""}))
        r.set(LEFT_PREFIX + "n1:500", b"\xff" * 10)
        assert not any(registry.left_cleanly("n1", e) for e in (300, 400, 500))
    finally:
        r.close()
        other.close()
        registry.close()


def test_cluster_reads_and_writes_across_nodes(redis_url, spawn_store_node):
    for i in range(2):
        spawn_store_node(f"n{i}", "--dram", "1MiB", "--redis", redis_url, *NODE_FLAGS)
    with ClusterClient(redis_url, refresh_s=0.1, transport="transfer_engine") as cluster:
        live = cluster.wait_for_nodes(2, timeout_s=10)
        assert all(n.te_endpoint for n in live)
        blocks = [(i.to_bytes(16, "big"), os.urandom(64 << 10)) for i in range(24)]  # 1.5 MiB
        assert all(r.ok and not r.existed for r in cluster.put_blocks(blocks, chain=True))
        keys = [k for k, _ in blocks]
        owners = [n.node_id for n in cluster.locate(keys)]
        assert len(owners) == 24 and len(set(owners)) == 2             # spilled over
        assert owners == sorted(owners, key=owners.index)             # two runs, not interleaved
        assert cluster.lookup(keys).blocks == 24
        assert cluster.get_blocks(keys) == [d for _, d in blocks]
        assert set(cluster.paths.values()) == {"transfer_engine"}
        missing = b"\xee" * 16
        assert cluster.get_blocks(keys[:3] + [missing], stop_at_miss=True)[-1] is None
        assert cluster.get_blocks([missing, keys[20]]) == [None, blocks[20][1]]
        # extending the chain goes to the node holding its parent (the one with room left)
        tail = [(b"\x01" * 16, os.urandom(1000))]
        assert cluster.put_blocks(tail, chain=True, parent=keys[-1])[0].ok
        assert cluster.locate([tail[0][0]])[0].node_id == owners[-1]
        # hot blocks: a second copy of the head on the other node
        assert cluster.replicate(keys[:4], copies=2) == 4
        assert cluster.replicate(keys[:4], copies=2) == 0                          # idempotent
        assert cluster.get_blocks(keys[:4]) == [d for _, d in blocks[:4]]
        # a tenant's hot blocks: the copy is on the tenant's books where it lands
        assert cluster.replicate(keys[4:6], copies=2, namespace="tenant-hot") == 2
        held = []
        for node in cluster.nodes():
            with AdminClient(node.address, None, 30) as admin:
                held.append({n["namespace"]: n["blocks"] for n in admin.stats()["namespaces"]}.get("tenant-hot", 0))
        assert sorted(held) == [0, 2], held


# -- a node dies mid-life; generation through real engines still completes ------------------
BS = 16


def reference(lm, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_node_loss_shrinks_lookups_within_ttl_and_generation_completes(redis_url, spawn_store_node):
    from engines.decode import DecodeEngine
    from engines.model import ModelConfig, load_model
    from engines.prefill import PrefillEngine

    # 64 blocks of 8 KiB + an 8-byte identity tag (3 pages each): about 25 a node, so the chain spans all three
    procs = {f"n{i}": spawn_store_node(f"n{i}", "--dram", "300KiB", "--redis", redis_url, *NODE_FLAGS)[0]
             for i in range(3)}
    lm = load_model(ModelConfig(block_size=BS))
    prompt = torch.randint(3, 512, (64 * BS + 5,), generator=torch.Generator().manual_seed(64)).tolist()
    want = reference(lm, prompt, 8)
    with ClusterClient(redis_url, refresh_s=0.1) as cluster:
        cluster.wait_for_nodes(3, timeout_s=10)
        prefill = PrefillEngine(lm, cluster, local_cache_blocks=0)
        decode = DecodeEngine(lm, cluster)
        r = prefill.prefill("r1", prompt, "t")
        assert r.stored_blocks == 64
        owners = [n.node_id for n in cluster.locate(list(r.block_keys))]
        assert len(owners) == 64 and len(set(owners)) == 3           # the chain spans all three
        steps = decode.decode("r1", prompt, r.first_token, r.block_keys, r.tail_kv, 8, namespace="t")
        assert [s.token for s in steps] == want

        victim = owners[32]                                            # holds a middle run
        survive = owners.index(victim)
        t0 = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)                      # no clean leave
        procs[victim].wait()
        registry = RedisRegistry(redis_url)
        while victim in {n.node_id for n in registry.nodes()}:
            assert time.monotonic() - t0 < TTL_S + 1.0, "dead node still registered after its TTL"
            time.sleep(0.05)
        registry.close()
        assert cluster.lookup(list(r.block_keys)).blocks == survive

        prefill2 = PrefillEngine(lm, cluster, local_cache_blocks=0)
        r2 = prefill2.prefill("r2", prompt, "t")
        assert r2.loaded_blocks == survive and r2.cached_tokens == survive * BS
        steps = decode.decode("r2", prompt, r2.first_token, r2.block_keys, r2.tail_kv, 8, namespace="t")
        tokens = [s.token for s in steps]
        assert tokens == want


# -- two live nodes given one node id ------------------------------------------------------------
def test_two_live_nodes_with_one_node_id_do_not_take_turns_and_the_later_one_stands_aside(
        redis_url, spawn_store_node, tmp_path):
    """Neither overwrites the other's record every beat (readers would see the id flip between
    two addresses, and half of either node's blocks miss): the node started first keeps the
    id; the later one stays out until the first stops, then registers."""
    first, first_addr = spawn_store_node("twin", "--redis", redis_url, *NODE_FLAGS)
    registry = RedisRegistry(redis_url)
    # what a router's index replica sees of the id (from the start of the KV-event stream)
    replica = IndexReplica(make_channel(redis_url),
                           lambda node: store_snapshot_source({node: registry.holder(node).address})(node)).start()
    deadline = time.monotonic() + 10
    while [n.address for n in registry.nodes()] != [first_addr]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second, second_addr = spawn_store_node("twin", "--redis", redis_url, *NODE_FLAGS,
                                           "--data-dir", str(tmp_path / "other"))
    seen = set()   # from the later node's start: its first beat no longer takes the record
    for _ in range(int(3 * TTL_S / 0.05)):
        seen |= {n.address for n in registry.nodes()}
        time.sleep(0.05)
    assert seen == {first_addr}, f"the id flipped between {sorted(seen)}"
    with ClusterClient(redis_url, refresh_s=0.1) as cluster:
        blocks = [(i.to_bytes(16, "big"), os.urandom(4096)) for i in range(8)]
        assert all(r.ok for r in cluster.put_blocks(blocks, chain=True))
        for _ in range(10):   # every read finds them: the id stays on the node that holds them
            cluster._listed_at = 0.0
            assert cluster.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
            time.sleep(BEAT_S / 2)
    # The later node publishes no KV events while it stands aside: the replica keeps the live
    # node's copies (its first NodeCleared, of a later epoch, would replace them with none,
    # and the live node's events would be skipped as stale from then on).
    deadline = time.monotonic() + 10
    while replica.hits([k for k, _ in blocks]) != {"twin": 8}:
        assert time.monotonic() < deadline, f"the replica sees {replica.hits([k for k, _ in blocks])}"
        time.sleep(0.05)
    first_epoch = replica.node_state("twin").epoch
    first.terminate()          # a clean stop: the id is free, and the later node takes it
    first.wait(10)
    deadline = time.monotonic() + TTL_S + 5 * BEAT_S
    while [n.address for n in registry.nodes()] != [second_addr]:
        assert time.monotonic() < deadline, "the node that stood aside did not register once the id was free"
        time.sleep(0.05)
    assert second.poll() is None
    # now it speaks for the id, in a new epoch: none of the first node's copies are its
    deadline = time.monotonic() + 10
    while replica.hits([k for k, _ in blocks]) != {} or replica.node_state("twin").epoch <= first_epoch:
        assert time.monotonic() < deadline, f"the replica sees {replica.hits([k for k, _ in blocks])}"
        time.sleep(0.05)
    replica.stop()
    registry.close()


# -- a node that hangs (stopped, not dead) ---------------------------------------------------------
def test_a_call_to_a_hung_node_gives_up_within_its_timeout_and_the_node_serves_again_after(spawn_store_node):
    """A same-host call that waited out its whole timeout on a stopped node was retried over
    gRPC with the whole timeout again: twice the timeout (the vLLM connector's 5 s per pool
    call took 10 s). The retry gets what is left, and a call with nothing left fails at once."""
    from kvstore.client import StoreClient
    from kvstore.errors import Unavailable

    proc, address = spawn_store_node("hung", "--ssd", "0", "--dram", "16MiB")
    timeout_s = 1.5
    blocks = [(i.to_bytes(16, "big"), os.urandom(8192)) for i in range(4)]
    with StoreClient(address, timeout_s=timeout_s) as client:
        assert all(r.ok for r in client.put_blocks(blocks))
        assert client.data_path_in_use.startswith("same-host")
        proc.send_signal(signal.SIGSTOP)
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)   # stopped for good before the first call
        try:   # the put fails on the same-host path; the get first asks the node for that path again
            for call in (lambda: client.put_blocks([(b"\x07" * 16, b"x" * 8192)]),
                         lambda: client.get_blocks([k for k, _ in blocks])):
                t0 = time.monotonic()
                with pytest.raises(Unavailable, match=address):
                    call()
                assert time.monotonic() - t0 < timeout_s + 0.6, f"took {time.monotonic() - t0:.2f} s"
        finally:
            proc.send_signal(signal.SIGCONT)
        assert client.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
