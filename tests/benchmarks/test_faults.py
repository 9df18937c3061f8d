"""Fault injection as a test: a real ``kvstore up`` under streaming load; each of its
processes (decode engine, prefill engine, store node, front door) is killed with SIGKILL in
turn. Each comes back (a new pid), requests sent after it came back succeed, and every
request that failed meanwhile failed cleanly (OpenAI's error shape, or a stream's error
event; for the front door itself, a refused connection while it is down and a cut one for
the requests it held when it died). Then SIGTERM stops
the whole stack within 10 s, leaving no process, /dev/shm segment or socket file."""
from __future__ import annotations

import asyncio
import glob
import os
import threading
import time

import pytest

from benchmarks.faults import UNCLEAN, UpStack, children, clients, failed_in_flight, recovery_s

VICTIMS = ("scheduler", "decode-0", "prefill-0", "store")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_kill_9_of_each_process_of_kvstore_up_under_load(tmp_path):
    stack = UpStack(str(tmp_path / "up"), ("--dram", "64MiB", "--ssd", "128MiB")).start()
    log: list[tuple[float, float, str]] = []
    stop = threading.Event()
    load = threading.Thread(target=lambda: asyncio.run(clients(stack.url, 4, 400, 6, log, stop)), daemon=True)
    pids_before = stack.children()
    try:
        load.start()
        time.sleep(2)
        assert [o for _, _, o in log].count("ok") > 0, stack.read_output()
        for victim in VICTIMS:
            old = stack.kill9(victim)
            killed_at = time.monotonic()
            deadline = killed_at + 90
            while time.monotonic() < deadline:
                pid = stack.children().get(victim)
                if pid not in (None, old) and recovery_s(log, killed_at) < float("inf"):
                    break
                time.sleep(0.2)
            took = recovery_s(log, killed_at)
            assert took < 90, f"{victim}: not serving 90 s after kill -9\n{stack.read_output()}"
            bad = failed_in_flight(log, killed_at)
            allowed = {"clean", "rejected"} | ({"refused", "cut"} if victim == "scheduler" else set())
            assert bad["cut"] <= 8, f"{victim}: {bad}"   # 4 in flight, 4 on stale keep-alive connections
            assert set(bad) <= allowed, f"{victim}: {bad} ({dict(UNCLEAN)})"
            print(f"{victim}: serving again {took:.1f} s after kill -9; failed meanwhile: {dict(bad)}")
        stop.set()
        load.join(60)
        pids = stack.children()
        assert set(pids) == set(pids_before) and not set(pids.values()) & set(pids_before.values())
        assert "restarted" in stack.read_output()
    finally:
        stop.set()
        took = stack.stop()
    assert took <= 10.5, f"kvstore up took {took:.1f} s to stop"
    assert stack.proc.returncode == 0
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert not glob.glob(f"/dev/shm/kvstore-{pid}-*")
    assert not glob.glob(str(tmp_path / "up" / "store" / "*" / "dataplane.sock"))
    assert children(stack.proc.pid) == {}
