"""``kvstore up`` with one store node still gives the router the store's index over KV events:
it starts a private Redis, the store node and the prefill engine publish there, and the
scheduler's replica applies their events (seen in its /metrics). Real processes throughout:
the launcher, redis-server, the store node, the engines, the front door."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launcher.supervisor import free_port
from tests.helpers.process_lines import collect_lines


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1 (for ``--service-ports``)."""
    import random
    for _ in range(200):
        first = random.randrange(20000, 30000)
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


def _metric(url: str, what: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'^kvstore_scheduler_kv_index_replica\{{what="{what}"\}} ([0-9.e+]+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else -1.0


def _store_port_stays_held_while_the_node_is_down(up: subprocess.Popen, port: int, lines: list[str]) -> None:
    """kvstore up holds every port of its stack (kvstore/port_hold.py): with the store node
    killed and kvstore up paused before it restarts the node, another user still cannot bind
    the node's port (without the hold, nothing was bound there: the squatter got the store
    token of every client that reconnected). Then the node is restarted on it."""
    import psutil

    from tests.helpers.other_user import SYSTEM_PYTHON, binds_as_nobody
    if os.geteuid() != 0 or SYSTEM_PYTHON is None:
        return
    node = next(p for p in psutil.process_iter(["cmdline"])
                if "serve" in (p.info["cmdline"] or []) and str(port) in (p.info["cmdline"] or []))
    os.kill(up.pid, signal.SIGSTOP)         # its supervisor would restart the node within 0.5 s
    try:
        node.kill()
        deadline = time.monotonic() + 30
        with contextlib.suppress(psutil.NoSuchProcess):   # a zombie of the paused parent: its sockets are gone
            while node.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert binds_as_nobody("127.0.0.1", port) == ["EADDRINUSE"] * 8
    finally:
        os.kill(up.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not any(line.startswith("kvstore up: store restarted") for line in lines):
        assert time.monotonic() < deadline, "".join(lines[-20:])
        time.sleep(0.1)


def _redis_is_on_a_socket_only_this_user_reaches(lines: list[str]) -> None:
    """The private Redis listens on a Unix socket in this user's 0700 socket directory, on no
    TCP port: another user can neither connect to it nor take its address first (and with it
    the password its clients send)."""
    import stat

    from tests.helpers.other_user import connects_as_nobody
    line = next(line for line in lines if line.startswith("redis "))
    found = re.search(r"unix://:\*\*\*@(/\S+/redis-\d+\.sock)\?db=0", line)
    assert found, line
    path = Path(found.group(1))
    directory = path.parent.stat()
    assert path.is_socket() and directory.st_uid == os.geteuid() and stat.S_IMODE(directory.st_mode) == 0o700
    assert connects_as_nobody(str(path)) == "EACCES"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_kvstore_up_with_one_store_node_feeds_the_router_from_kv_events(tmp_path: Path) -> None:
    port = free_port()
    first = _free_run(6)      # --service-ports: store, prefill, decode, then their 3 metrics ports
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    for name in ("KVSTORE_REDIS_URL", "KVSTORE_EVENTS_URL"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "--log-level", "WARNING", "up", "--engine", "builtin",
                             "--host", "127.0.0.1",
                             "--port", str(port), "--data-dir", str(tmp_path / "up"), "--dram", "64MiB",
                             "--ssd", "64MiB", "--service-ports", str(first)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, ready = collect_lines(proc, "front door")
    url = f"http://127.0.0.1:{port}"
    try:
        assert ready.wait(300), "".join(lines[-40:])
        assert any(line.startswith("redis ") and "KV events" in line for line in lines), "".join(lines)
        _redis_is_on_a_socket_only_this_user_reaches(lines)
        banner = "".join(lines)
        assert f"store node     127.0.0.1:{first}  " in banner and f"127.0.0.1:{first + 3}/metrics" in banner
        assert f"prefill engine prefill-0 127.0.0.1:{first + 1}" in banner, banner
        assert f"decode engine decode-0 127.0.0.1:{first + 2}" in banner, banner
        body = json.dumps({"prompt": list(range(1, 70)), "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        for _ in range(2):
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.loads(r.read())
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * 16
        # The store node's and the prefill engine's events: NodeCleared and BlockStored each.
        # Two publishers, in no set order: wait for all of them, not for the first to land.
        deadline = time.monotonic() + 30
        while _metric(url, "events") < 2 + 2 * 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(url, "events") >= 2 + 2 * 4, "".join(lines[-40:])
        assert _metric(url, "resync_failures") == 0
        _store_port_stays_held_while_the_node_is_down(proc, first, lines)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
