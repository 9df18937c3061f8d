"""Stopping on SIGTERM / SIGINT within a bound, whatever the state (kvstore/shutdown.py):
a stop that hangs is forced after its grace and still removes its /dev/shm segment and
socket files; a second signal forces at once; ``kvstore serve`` (transfer engine on, after
junk on its ports and with a large get in flight), ``kvstore engine`` and ``kvstore
scheduler`` (still waiting for engines that never answer) each exit within 10 s."""
from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.supervisor import free_port

ROOT = Path(__file__).resolve().parents[2]

HUNG = """
import sys, time
from kvstore.shutdown import Shutdown, leave_nothing
leave_nothing(sys.argv[1])
s = Shutdown("hung service", grace_s=float(sys.argv[2])).install()
print("ready", flush=True)
s.wait()
time.sleep(1000)       # a graceful stop that never ends
"""


def spawn(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def stop_time(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 20) -> float:
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return float("inf")
    return time.monotonic() - t0


def test_a_hung_stop_is_forced_after_its_grace_and_leaves_no_file(tmp_path):
    marker = tmp_path / "segment"
    marker.write_bytes(b"x")
    proc = spawn("-c", HUNG, str(marker), "1.0")
    assert proc.stdout.readline().strip() == "ready"
    took = stop_time(proc)
    assert 0.9 <= took < 3, took
    assert proc.returncode == 3 and "forced exit" in proc.stderr.read()
    assert not marker.exists()


def test_a_second_signal_forces_the_exit_at_once(tmp_path):
    proc = spawn("-c", HUNG, str(tmp_path / "none"), "60")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None                                   # stopping, gracefully
    assert stop_time(proc, signal.SIGINT) < 2 and proc.returncode == 3


def _junk_at(port: int) -> None:
    for junk in (b"\x00" * 64, os.urandom(4096), b"\xff" * 16 + b"GET / HTTP/1.1\r\n\r\n"):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(junk)
        except OSError:
            pass


def _listening_ports(pid: int) -> set[int]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}


@pytest.mark.slow
def test_every_service_stops_within_10_s_whatever_its_state(tmp_path):
    store_port = free_port()
    data = tmp_path / "data"
    serve = spawn("-m", "launcher", "serve", "--port", str(store_port), "--dram", "64MiB", "--ssd", "64MiB",
                  "--data-dir", str(data), "--transfer-engine", "tcp")
    engine = spawn("-m", "launcher", "engine", "--role", "decode", "--store", f"127.0.0.1:{store_port}")
    scheduler = spawn("-m", "launcher", "scheduler", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1",
                      "--port", "0")                                  # waits for engines that never answer
    procs = {"serve": serve, "engine": engine, "scheduler": scheduler}
    try:
        assert "serving on" in serve.stdout.readline()
        assert "serving on" in engine.stdout.readline()
        from kvstore.client import StoreClient
        client = StoreClient(f"127.0.0.1:{store_port}", timeout_s=30)
        for port in _listening_ports(serve.pid) - {store_port}:     # transfer engine, control channel
            _junk_at(port)

        def big_get() -> None:
            try:
                client._grpc_get_blocks([os.urandom(32) for _ in range(100_000)])
            except Exception:
                pass

        threading.Thread(target=big_get, daemon=True).start()
        time.sleep(1.5)
        took = {name: stop_time(proc) for name, proc in procs.items()}
        assert all(t <= 10 for t in took.values()), took
        assert all(p.returncode in (0, 3) for p in procs.values()), {n: p.returncode for n, p in procs.items()}
        assert not glob.glob(f"/dev/shm/kvstore-{serve.pid}-*")
        assert not glob.glob(str(data / "*" / "dataplane.sock"))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
