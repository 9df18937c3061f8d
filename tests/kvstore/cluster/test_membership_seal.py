"""Membership records are sealed with the store token: whoever can write to the cluster's Redis
but holds no token cannot list a node of its own, so engines, the scheduler and kvctl never
send it the store token (a forged record would receive it in the first call); a record
replayed after its TTL, or an earlier one written back over the live one, is refused; no
value stops the listing of the others."""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
import redis

import kvstore.cluster.client as cluster_client
from kvstore.cluster.client import ClusterClient
from kvstore.cluster.membership import CLOCK_SLACK_S, KEY_PREFIX, NodeInfo, RedisRegistry, seal, unseal
from launcher.supervisor import free_port
from tests.helpers.kvctl_helpers import TOKEN, block, kvctl, kvctl_env

INFO = NodeInfo("n0", "127.0.0.1:1", (("dram", 1 << 20, 0),), 1 << 19, "", 7, False)
TTL = 3.0


def test_a_sealed_record_opens_only_under_its_token_within_its_ttl_and_at_its_own_key():
    key, value = KEY_PREFIX + "n0", seal(INFO, TOKEN, 1000.0, TTL)
    assert unseal(key, value, TOKEN, 1001.0) == (INFO, 1000.0)
    assert unseal(key, value, None, 1e9)[0] == INFO             # a reader without a token sends none
    with pytest.raises(ValueError, match="does not verify"):
        unseal(key, value, "another-token", 1001.0)
    assert unseal(key, value, TOKEN, 1000.0 + TTL + CLOCK_SLACK_S)[0] == INFO
    with pytest.raises(ValueError, match="replayed"):
        unseal(key, value, TOKEN, 1000.0 + TTL + CLOCK_SLACK_S + 0.1)
    with pytest.raises(ValueError, match="does not verify"):    # moved under another node's key
        unseal(KEY_PREFIX + "n1", value, TOKEN, 1001.0)
    doc = json.loads(value)
    doc["body"] = doc["body"].replace("127.0.0.1:1", "127.0.0.1:2")
    with pytest.raises(ValueError, match="does not verify"):    # an address changed after sealing
        unseal(key, json.dumps(doc), TOKEN, 1001.0)
    with pytest.raises(ValueError, match="unsealed"):
        unseal(key, seal(INFO, None, 0.0, TTL), TOKEN, 1001.0)
    assert unseal(key, seal(INFO, None, 0.0, TTL), None, 0.0) == (INFO, None)
    with pytest.raises(ValueError, match="names node 'n0'"):   # a tokenless reader checks the key too
        unseal(KEY_PREFIX + "n1", seal(INFO, None, 0.0, TTL), None, 0.0)
    for junk in ("[]", "{}", "not json", "[" * 50_000, b"\xff\xfe", '{"body": 3}', '{"body": "[[["}',
                 '{"info": {"node_id": "n0", "bogus": 1}}', '{"info": {"node_id": "n0", "address": 5}}',
                 '{"info": {"node_id": "n0", "address": "a", "tiers": [["dram", true, 0]]}}',
                 '{"info": {"node_id": "n0", "address": "a", "epoch": 1e400}}', "{" * 70_000):
        with pytest.raises(ValueError):
            unseal(key, junk, None, 0.0)


def test_the_registry_lists_only_what_verifies_and_logs_each_refusal_once(redis_url, caplog):
    node, reader = RedisRegistry(redis_url, TOKEN), RedisRegistry(redis_url, TOKEN)
    r = redis.Redis.from_url(redis_url)
    try:
        node.register(INFO, 30.0)
        seconds, micros = r.time()
        now = seconds + micros * 1e-6
        forged = {"plain": seal(NodeInfo("plain", "127.0.0.1:2"), None, now, TTL),
                  "other": seal(NodeInfo("other", "127.0.0.1:3"), "another-token", now, TTL),
                  "stale": seal(NodeInfo("stale", "127.0.0.1:4"), TOKEN, now - TTL - CLOCK_SLACK_S - 1, TTL),
                  "deep": "[" * 60_000,                          # RecursionError in json: it stopped the listing
                  "junk": "{"}
        for name, value in forged.items():
            r.set(KEY_PREFIX + name, value, px=30_000)
        with caplog.at_level(logging.WARNING, logger="kvstore.cluster.membership"):
            assert reader.nodes() == [INFO]
            assert reader.nodes() == [INFO]
        refused = [m for m in caplog.messages if "left out" in m]
        assert sorted(m.split()[2] for m in refused) == sorted(repr(KEY_PREFIX + n) for n in forged)
        tokenless = RedisRegistry(redis_url)
        assert {n.node_id for n in tokenless.nodes()} == {"n0", "plain", "other", "stale"}
        tokenless.close()

        # an earlier beat written back over the live record: refused by a reader that saw the later
        earlier = r.get(KEY_PREFIX + "n0")
        time.sleep(0.05)
        node.register(INFO, 30.0)
        assert reader.nodes() == [INFO]
        r.set(KEY_PREFIX + "n0", earlier, px=30_000)
        assert reader.nodes() == []
        node.register(INFO, 30.0)
        assert reader.nodes() == [INFO]
    finally:
        node.close(), reader.close(), r.close()


def test_a_client_drops_its_last_listing_once_the_registry_is_unreadable_too_long(redis_url, monkeypatch):
    node = RedisRegistry(redis_url, TOKEN)
    node.register(INFO, 30.0)
    dead = f"redis://127.0.0.1:{free_port()}/0"       # a port where no Redis listens: every read fails
    monkeypatch.setattr(cluster_client, "STALE_LISTING_S", 0.5)
    with ClusterClient(redis_url, auth_token=TOKEN, refresh_s=0.0) as cluster:
        assert cluster.nodes() == [INFO]
        cluster.registry = RedisRegistry(dead, TOKEN)
        assert cluster.nodes() == [INFO]           # a blip: the last listing still serves
        time.sleep(0.6)
        deadline = time.monotonic() + 5            # too long: a node that stopped meanwhile is not listed,
        while cluster.nodes() != []:               # once the background listing that fails comes back
            assert time.monotonic() < deadline
            time.sleep(0.05)
    node.close()


def test_a_forged_node_gets_no_token_from_kvctl_or_the_cluster_client(spawn_store_node, redis_url, tmp_path):
    spawn_store_node("real", "--dram", "8MiB", "--ssd", "0", "--auth-token", TOKEN, "--redis",
                     redis_url, "--transfer-engine", "off", "--heartbeat", "0.2", "--node-ttl", "2")
    heard: list[tuple[str, str | None]] = []

    class Listener(grpc.GenericRpcHandler):   # the attacker's "node": records what callers send
        def service(self, details):
            heard.append((details.method, dict(details.invocation_metadata).get("authorization")))
            return None

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Listener(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    r = redis.Redis.from_url(redis_url)
    stop = threading.Event()
    fake = seal(NodeInfo("evil", f"127.0.0.1:{port}", (("dram", 1 << 30, 0),), 1 << 30, "", 1, False), None, 0.0, TTL)

    def keep_registered() -> None:
        while not stop.is_set():
            r.set(KEY_PREFIX + "evil", fake, px=3000)
            stop.wait(0.2)
    beat = threading.Thread(target=keep_registered, daemon=True)
    beat.start()
    try:
        with ClusterClient(redis_url, auth_token=TOKEN, refresh_s=0.0) as cluster:
            cluster.wait_for_nodes(1)
            assert [n.node_id for n in cluster.nodes()] == ["real"]
            assert all(res.ok for res in cluster.put_blocks([(block(0), b"x" * 4096)]))
            assert cluster.lookup([block(0), block(1)]).blocks == 1
            assert cluster.get_blocks([block(0)]) == [b"x" * 4096]
        rc, doc, err = kvctl(kvctl_env(tmp_path, redis_url=redis_url), "ls")
        assert rc == 0, err
        assert doc["nodes"] == ["real"] and doc["matched"] == 1
        rc, doc, err = kvctl(kvctl_env(tmp_path, redis_url=redis_url), "nodes")
        assert rc == 0 and [n["node_id"] for n in doc["nodes"]] == ["real"], err
        assert heard == []     # no call at all reached the forged address, so no token either
    finally:
        stop.set()
        beat.join()
        server.stop(0)
        r.close()


def test_kvctl_with_a_wrong_token_is_unauthenticated_not_an_empty_cluster(spawn_store_node, redis_url, tmp_path):
    """New-user review: with a wrong or stale store token every record was left out, so ``ls``
    listed no block, ``namespaces`` none and ``flush --force`` flushed nothing — each exit 0.
    Every record of the registry left out for its seal is now exit 1 UNAUTHENTICATED, and
    ``--json`` says so on stdout too."""
    spawn_store_node("sealed", "--dram", "8MiB", "--ssd", "0", "--auth-token", TOKEN, "--redis",
                     redis_url, "--transfer-engine", "off", "--heartbeat", "0.2", "--node-ttl", "2")
    right = kvctl_env(tmp_path, redis_url=redis_url)
    deadline = time.monotonic() + 30
    while kvctl(right, "nodes")[1]["nodes"] == []:
        assert time.monotonic() < deadline, "the node never registered"
        time.sleep(0.2)
    wrong = kvctl_env(tmp_path, token="a-stale-token-0123456789", redis_url=redis_url)
    for argv in (("ls",), ("namespaces",), ("nodes",), ("flush", "--force"), ("watch", "--count", "1")):
        rc, out, err = kvctl(wrong, *argv)
        assert rc == 1, (argv, out, err)
        assert "UNAUTHENTICATED" in err and "1 node record" in err and "wrong or stale" in err, err
        assert out["success"] is False and "UNAUTHENTICATED" in out["error"], out
    rc, doc, err = kvctl(right, "ls")
    assert rc == 0 and doc["nodes"] == ["sealed"], err


def test_a_registry_that_stops_answering_holds_no_caller_up(redis_url):
    """A periodic listing is read in the background: while the registry takes seconds to
    answer (its host cut off), callers go on with the last listing at once."""
    node = RedisRegistry(redis_url, TOKEN)
    node.register(INFO, 30.0)
    real = RedisRegistry(redis_url, TOKEN)

    class Stalled:      # the real registry behind a link that takes 2 s to answer
        def nodes(self):
            time.sleep(2.0)
            return real.nodes()

    with ClusterClient(redis_url, auth_token=TOKEN, refresh_s=0.0) as cluster:
        assert cluster.nodes() == [INFO]
        cluster.registry = Stalled()
        started = time.monotonic()
        for _ in range(20):
            assert cluster.nodes() == [INFO]
        assert time.monotonic() - started < 1.0
    node.close()
    real.close()
