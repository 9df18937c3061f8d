"""A private ``redis-server`` for a one-host cluster (``kvstore up --store-nodes N``): a free
127.0.0.1 port, no persistence, stopped by the caller."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time


def start_private_redis(log_path: str | None = None, timeout_s: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (``--save '' --appendonly no``) on a free port; returns the
    process and its URL. Raises RuntimeError when the binary is missing or does not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; pass --redis URL or install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)


def stop_private_redis(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """Stop a server from :func:`start_private_redis` (terminate, then kill)."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
