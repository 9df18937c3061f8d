"""``kvctl watch`` against a real store node: the real CLI in a subprocess, refreshing twice;
blocks read between the two refreshes show as hits in the second one's interval."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kvstore.client import StoreClient


def kvctl(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvstore.kvctl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_watch_json_counts_the_reads_between_two_refreshes(store_node):
    pool, address = store_node
    blocks = [(os.urandom(32), bytes([i]) * 4096) for i in range(8)]
    with StoreClient(address, data_path="grpc") as client:
        assert all(r.ok for r in client.put_blocks(blocks, chain=True))
        # a generous --timeout: on a loaded machine a node's answer can take longer than the default
        proc = kvctl("--store", address, "--timeout", "60", "watch", "--count", "2", "--interval", "3", "--json")
        first = json.loads(proc.stdout.readline())            # printed before the interval starts
        assert client.get_blocks([k for k, _ in blocks[:5]]) == [v for _, v in blocks[:5]]
        assert client.get_blocks([os.urandom(32)]) == [None]
        second = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=90) == 0, (second, proc.stderr.read())
    assert proc.stdout.read() == ""                            # exactly two refreshes

    assert first["interval_s"] is None and "rate" not in first["nodes"][0]["tiers"][0]
    dram = {t["name"]: t for t in second["nodes"][0]["tiers"]}["dram"]
    assert second["nodes"][0]["up"] and second["nodes"][0]["node_id"] == pool.node_id
    assert dram["blocks"] == 8 and dram["capacity_bytes"] == 64 << 20
    assert dram["delta"]["hits"] == 5 and dram["delta"]["misses"] == 1
    assert dram["interval_read_success_ratio"] == 5 / 6
    assert dram["rate"]["hits"] == 5 / second["interval_s"] and second["interval_s"] >= 3
    stats = {s.name: s for s in pool.stats()}
    assert dram["hits"] == stats["dram"].hits and dram["misses"] == stats["dram"].misses


def test_watch_table_refreshes_count_times_and_names_a_node_that_is_down(store_node):
    _, address = store_node
    proc = kvctl("--store", address, "--timeout", "1", "watch", "--count", "2", "--interval", "0.2",
                 "--node", "127.0.0.1:1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err                           # one node answered
    frames = [f for f in out.split("\n\nkvstore watch") if f.strip()]
    assert len(frames) == 2, out
    assert "totals (rates from the next refresh)" in frames[0]
    assert "rates per second over the last" in frames[1]
    assert "dram" in frames[1] and "ssd" in frames[1] and "hits/s" in frames[1]
    assert "127.0.0.1:1" in out and "DOWN: " in out


def test_watch_refuses_a_bad_count_and_says_when_no_node_answers():
    proc = kvctl("watch", "--count", "0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--count: must be a whole number >= 1" in err
    proc = kvctl("--store", "127.0.0.1:1", "--timeout", "1", "watch", "--count", "1", "--json")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert json.loads(out)["nodes"][0]["up"] is False and json.loads(out)["nodes"][0]["error"]
