"""Membership records are sealed with the store token: whoever can write to the cluster's Redis
but holds no token cannot list a node of its own, so engines, the scheduler and kvctl never
send it the store token (a forged record used to receive it in the first call)."""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
import redis

from kvstore.cluster.client import ClusterClient
from kvstore.cluster.membership import KEY_PREFIX, RECORD_MAX_AGE_S, NodeInfo, RedisRegistry, seal, unseal
from tests.kvctl_helpers import TOKEN, block, kvctl, kvctl_env

INFO = NodeInfo("n0", "127.0.0.1:1", (("dram", 1 << 20, 0),), 1 << 19, "", 7, False)


def test_a_sealed_record_opens_only_under_its_token_fresh_and_at_its_own_key():
    key, value = KEY_PREFIX + "n0", seal(INFO, TOKEN, now=1000.0)
    assert unseal(key, value, TOKEN, now=1001.0) == INFO
    assert unseal(key, value, None, now=1e9) == INFO            # a reader without a token sends none
    with pytest.raises(ValueError, match="does not verify"):
        unseal(key, value, "another-token", now=1001.0)
    with pytest.raises(ValueError, match="replayed"):
        unseal(key, value, TOKEN, now=1000.0 + RECORD_MAX_AGE_S + 1)
    with pytest.raises(ValueError, match="does not verify"):    # moved under another node's key
        unseal(KEY_PREFIX + "n1", value, TOKEN, now=1001.0)
    doc = json.loads(value)
    doc["body"] = doc["body"].replace("127.0.0.1:1", "127.0.0.1:2")
    with pytest.raises(ValueError, match="does not verify"):    # an address changed after sealing
        unseal(key, json.dumps(doc), TOKEN, now=1001.0)
    with pytest.raises(ValueError, match="unsealed"):
        unseal(key, seal(INFO, None), TOKEN)
    assert unseal(key, seal(INFO, None), None) == INFO
    with pytest.raises(ValueError, match="names node 'n0'"):   # a tokenless reader checks the key too
        unseal(KEY_PREFIX + "n1", seal(INFO, None), None)
    for junk in ("[]", "{}", "not json", '{"body": 3}', '{"info": {"node_id": "n0", "bogus": 1}}'):
        with pytest.raises(ValueError):
            unseal(key, junk, None)


def test_the_registry_lists_only_what_verifies_and_logs_each_refusal_once(redis_url, caplog):
    node, reader = RedisRegistry(redis_url, TOKEN), RedisRegistry(redis_url, TOKEN)
    r = redis.Redis.from_url(redis_url)
    try:
        node.register(INFO, 30.0)
        forged = {"plain": seal(NodeInfo("plain", "127.0.0.1:2"), None),
                  "other": seal(NodeInfo("other", "127.0.0.1:3"), "another-token"),
                  "stale": seal(NodeInfo("stale", "127.0.0.1:4"), TOKEN, now=time.time() - 2 * RECORD_MAX_AGE_S),
                  "junk": "{"}
        for name, value in forged.items():
            r.set(KEY_PREFIX + name, value, px=30_000)
        with caplog.at_level(logging.WARNING, logger="kvstore.cluster.membership"):
            assert reader.nodes() == [INFO]
            assert reader.nodes() == [INFO]
        refused = [m for m in caplog.messages if "left out" in m]
        assert sorted(m.split()[2] for m in refused) == sorted(KEY_PREFIX + n for n in forged)
        tokenless = RedisRegistry(redis_url)
        assert {n.node_id for n in tokenless.nodes()} == {"n0", "plain", "other", "stale"}
        tokenless.close()
    finally:
        node.close(), reader.close(), r.close()


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
    fake = seal(NodeInfo("evil", f"127.0.0.1:{port}", (("dram", 1 << 30, 0),), 1 << 30, "", 1, False), None)

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
