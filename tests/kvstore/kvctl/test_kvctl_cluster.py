"""kvctl on a 3-node cluster (real node processes registered in a private Redis): nodes, ls
across the nodes, and drain: a node's blocks move to the others (pins with them), it is
announced as draining, and placement puts no new blocks there."""
from __future__ import annotations

import os

from kvstore.client import StoreClient
from kvstore.cluster.client import ClusterClient
from tests.helpers.kvctl_helpers import TOKEN, block, kvctl, kvctl_env

BLOCK = 64 << 10


def test_nodes_ls_and_drain_on_three_nodes(spawn_store_node, redis_url, tmp_path):
    addresses = {}
    for i in range(3):
        _, addresses[f"store-{i}"] = spawn_store_node(
            f"store-{i}", "--dram", "8MiB", "--ssd", "16MiB", "--auth-token", TOKEN, "--redis", redis_url,
            "--transfer-engine", "off", "--heartbeat", "0.2", "--node-ttl", "2")
    env = kvctl_env(tmp_path, redis_url=redis_url)
    with ClusterClient(redis_url, auth_token=TOKEN) as cluster:
        cluster.wait_for_nodes(3)

    rc, doc, err = kvctl(env, "nodes")
    assert rc == 0, err
    by_id = {n["node_id"]: n for n in doc["nodes"]}
    assert set(by_id) == set(addresses)
    for node_id, n in by_id.items():
        assert n["address"] == addresses[node_id] and n["health"] == "SERVING" and n["epoch"] > 0
        assert [t["name"] for t in n["tiers"]] == ["dram", "ssd"] and n["draining"] is False

    blocks = {node_id: [(block(i, node_id.encode()), os.urandom(BLOCK)) for i in range(5)] for node_id in addresses}
    for node_id, items in blocks.items():          # store-0's as one prefix chain
        with StoreClient(addresses[node_id], auth_token=TOKEN, data_path="grpc") as c:
            assert all(r.ok for r in c.put_blocks(items, chain=node_id == "store-0", namespace="key-t"))
    pinned = blocks["store-0"][0][0]
    with StoreClient(addresses["store-0"], auth_token=TOKEN, data_path="grpc") as c:
        assert c.pin([pinned], hard=True) == 1

    rc, doc, err = kvctl(env, "ls")
    assert rc == 0, err
    assert doc["matched"] == 15 and sorted(doc["nodes"]) == sorted(addresses)
    assert {(b["node"], b["key"]) for b in doc["blocks"]} == {
        (n, k.hex()) for n, items in blocks.items() for k, _ in items}
    rc, doc, _ = kvctl(env, "ls", "--limit", "3")   # the nodes after the third block still count
    assert rc == 0 and doc["listed"] == 3 and doc["matched"] == 15, doc
    rc, doc, _ = kvctl(env, "ls", "--node", "store-1")
    assert rc == 0 and doc["matched"] == 5 and {b["node"] for b in doc["blocks"]} == {"store-1"}
    assert kvctl(env, "ls", "--node", "store-9")[0] == 1

    rc, doc, err = kvctl(env, "drain", "store-0")
    assert rc == 0, err
    assert doc["success"] and doc["moved_blocks"] == 5 and doc["left_blocks"] == 0 and doc["failed"] == {}
    assert "moved 5 of 5 blocks" in err                        # progress goes to stderr with --json
    rc, doc, _ = kvctl(env, "ls")
    assert doc["matched"] == 15 and "store-0" not in {b["node"] for b in doc["blocks"]}
    moved = {b["key"]: b for b in doc["blocks"] if b["key"] in {k.hex() for k, _ in blocks["store-0"]}}
    assert len(moved) == 5 and {b["namespace"] for b in moved.values()} == {"key-t"}
    assert moved[pinned.hex()]["pin"] == "hard"                # the pin moved with the block
    chain = [k.hex() for k, _ in blocks["store-0"]]         # the chain's links moved with it, on one node
    assert [moved[k]["parent"] for k in chain] == [""] + chain[:-1]
    assert len({moved[k]["node"] for k in chain}) == 1
    assert {n["node_id"]: n["draining"] for n in kvctl(env, "nodes")[1]["nodes"]}["store-0"] is True

    with ClusterClient(redis_url, auth_token=TOKEN, refresh_s=0.0) as cluster:
        fresh = [(block(i, b"new"), os.urandom(BLOCK)) for i in range(6)]
        assert all(r.ok for r in cluster.put_blocks(fresh))
    assert kvctl(env, "ls", "--node", "store-0")[1]["matched"] == 0   # placement skipped it

    rc, doc, _ = kvctl(env, "drain", "store-0", "--cancel")
    assert rc == 0 and doc["draining"] is False


def test_a_refused_drain_leaves_the_node_as_it_was(spawn_store_node, redis_url, tmp_path):
    """Draining the one node not draining is refused (nowhere to move its blocks) and the node
    is not marked draining (it was, before the check, and placement then skipped it for good)."""
    spawn_store_node("solo", "--dram", "8MiB", "--ssd", "16MiB", "--auth-token", TOKEN, "--redis", redis_url,
                     "--transfer-engine", "off", "--heartbeat", "0.2", "--node-ttl", "2")
    env = kvctl_env(tmp_path, redis_url=redis_url)
    with ClusterClient(redis_url, auth_token=TOKEN) as cluster:
        cluster.wait_for_nodes(1)
    rc, _, err = kvctl(env, "drain", "solo")
    assert rc == 1 and "nowhere to move its blocks" in err
    assert [n["draining"] for n in kvctl(env, "nodes")[1]["nodes"]] == [False]
