"""A cluster's store nodes as the front door checks them (kvstore/cluster/health.py): a node
that stops answering is down by name, and so is one whose record lapsed without a clean
stop — it does not vanish from the listing while the front door says ``ok`` (as after
``kill -STOP`` on one of ``--store-nodes 2``). A node stopped cleanly leaves no problem
behind. Real store node processes and a real Redis (the front door's /health over a cluster:
tests/scheduler/frontdoor/test_status_feed_cluster.py)."""
from __future__ import annotations

import signal
import time

from kvstore.cluster.client import ClusterClient
from kvstore.cluster.membership import RedisRegistry
from kvstore.errors import Unavailable
from tests.helpers.kvctl_helpers import TOKEN

FLAGS = ("--dram", "4MiB", "--ssd", "0", "--auth-token", TOKEN, "--transfer-engine", "off",
         "--heartbeat", "0.2", "--node-ttl", "1.5")


def wait_for(predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def problem_of(cluster: ClusterClient) -> str:
    try:
        cluster.health()
    except Unavailable as exc:
        return str(exc)
    return ""


def test_a_node_that_stops_answering_or_lapses_is_down_by_name_and_a_clean_stop_is_not(spawn_store_node,
                                                                                         redis_url):
    spawn_store_node("keep", *FLAGS, "--redis", redis_url)
    lost, lost_address = spawn_store_node("lost", *FLAGS, "--redis", redis_url)
    with ClusterClient(redis_url, auth_token=TOKEN) as cluster:
        cluster.wait_for_nodes(2)
        assert cluster.health() == "SERVING"
        lost.send_signal(signal.SIGSTOP)          # alive, silent: no answer, then its record lapses
        try:
            why = wait_for(lambda: problem_of(cluster), "the stopped node to be reported")
            assert f"store node lost ({lost_address})" in why and "keep" not in why, why
            why = wait_for(lambda: "gone from the registry" in (w := problem_of(cluster)) and w,
                           "the lapsed record to be reported")
            assert "without a clean stop" in why and "(1 node serving)" in why, why
            assert [p.node_id for p in cluster.problems] == ["lost"]
        finally:
            lost.send_signal(signal.SIGCONT)
        wait_for(lambda: problem_of(cluster) == "", "the node to be back")
        assert cluster.health() == "SERVING"
        epoch = {n.node_id: n.epoch for n in cluster.registry.nodes()}
        lost.terminate()                          # a clean stop: deregistered, noted as left
        assert lost.wait(30) == 0
        wait_for(lambda: [n.node_id for n in cluster.registry.nodes()] == ["keep"], "the node to leave")
        assert cluster.health() == "SERVING" and cluster.problems == []
        reg = RedisRegistry(redis_url, TOKEN)
        assert reg.left_cleanly("lost", epoch["lost"]) and not reg.left_cleanly("keep", epoch["keep"])
        assert not reg.left_cleanly("lost", epoch["lost"] + 1)                              # that life only
        assert not RedisRegistry(redis_url, "another-token-0123456789").left_cleanly("lost", epoch["lost"])  # sealed
        reg.close()
