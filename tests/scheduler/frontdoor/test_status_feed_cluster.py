"""The status feed of a front door over a cluster: three store node processes registered in
a real Redis, engines and the front door in cluster mode; ``/status.json`` lists every
registered node with its own tier figures, and stops listing one that left cleanly; one that
died is down by name in ``/health`` and on the page."""
from __future__ import annotations

import json
import time

from engines.server import start_engine
from kvstore.client import StoreClient
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.app import start_frontdoor
from tests.helpers.frontdoor_cluster import LoopThread, call, complete

FLAGS = ("--dram", "8MiB", "--ssd", "0", "--heartbeat", "0.2", "--node-ttl", "1", "--transfer-engine", "off")


def test_status_feed_lists_every_registered_node(redis_url, spawn_store_node):
    procs = {f"n{i}": spawn_store_node(f"n{i}", "--redis", redis_url, *FLAGS) for i in range(3)}
    servers, loop, door = [], LoopThread(), None
    try:
        engines = {}
        for role in ("prefill", "decode"):
            server, port = start_engine(role, None, block_size=16, engine_id=f"{role}-0", store_redis=redis_url)
            servers.append(server)
            engines[role] = f"127.0.0.1:{port}"
        door = loop.run(start_frontdoor([engines["prefill"]], [engines["decode"]], None, store_redis=redis_url,
                                        config=FrontdoorConfig(kv_events=redis_url)))   # as `--redis` does
        for i in range(10):   # blocks on every node (a prompt's chain is placed by its keys)
            complete(door.url, {"prompt": f"prompt {i}: long enough for a few KV blocks " * 3, "max_tokens": 3})
        after = time.time()

        def feed() -> dict:
            status, _, body = call(door.url, "/status.json")
            assert status == 200
            return json.loads(body)

        deadline = time.monotonic() + 15     # the feed samples anew at most once a second
        while ((snap := feed())["sampled_at"] < after or len(snap["nodes"]) < 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        nodes = {n["node_id"]: n for n in snap["nodes"]}
        assert set(nodes) == set(procs) and all(n["state"] == "up" for n in nodes.values())
        for node_id, (_, address) in procs.items():
            assert nodes[node_id]["address"] == address
            with StoreClient(address, data_path="grpc") as client:
                (dram,) = client.stats()[1]
            (shown,) = nodes[node_id]["tiers"]
            assert (shown["name"], shown["blocks"], shown["used_bytes"]) == ("dram", dram.blocks, dram.used_bytes)
        assert sum(n["tiers"][0]["blocks"] for n in nodes.values()) > 0

        procs["n2"][0].terminate()            # leaves the registry as it stops
        procs["n2"][0].wait(timeout=15)
        deadline = time.monotonic() + 15
        listed = {"n2"}
        while "n2" in listed and time.monotonic() < deadline:
            time.sleep(0.2)
            listed = {n["node_id"] for n in feed()["nodes"]}
        assert listed == {"n0", "n1"}
        # a clean stop leaves no problem behind (a node that misses one check on a loaded
        # machine is down until it answers the next: the front door checks once a second)
        deadline = time.monotonic() + 10
        while (health := call(door.url, "/health")[0]) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health == 200

        replica = door.frontdoor.router.replica
        assert replica is not None
        deadline = time.monotonic() + 15      # n0's and n1's events: separate publishers, in no set order
        while not all(replica.index.node_blocks(n) for n in ("n0", "n1")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert replica.index.node_blocks("n1") > 0
        procs["n1"][0].kill()                 # no clean stop: down by name, not forgotten
        procs["n1"][0].wait(timeout=15)
        deadline = time.monotonic() + 15
        while (health := call(door.url, "/health"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, _, body = health
        reasons = json.loads(body)["reasons"]
        assert status == 503 and json.loads(body)["status"] == "degraded", body
        assert len(reasons) == 1 and reasons[0].startswith("store: ") and "store node n1" in reasons[0], reasons
        assert reasons[0].endswith("(its blocks are misses; the other nodes serve)"), reasons
        assert replica.index.node_blocks("n1") == 0           # no longer hits in the router's replica
        assert replica.index.node_blocks("n0") > 0
        deadline = time.monotonic() + 15
        while "gone from the registry" not in json.dumps(nodes := feed()["nodes"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        states = {n["node_id"]: n["state"] for n in nodes}
        assert states["n0"] == "up" and "gone from the registry" in states["n1"] and "n2" not in states, states
        complete(door.url, {"prompt": "still served by n0 " * 4, "max_tokens": 2})
    finally:
        if door is not None:
            loop.run(door.stop())
        loop.close()
        for server in servers:
            server.stop(None).wait()
