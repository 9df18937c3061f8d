"""A private ``redis-server`` for a one-host cluster (``kvstore up --store-nodes N``): a free
127.0.0.1 port, no persistence, optionally a password (given to the server on its standard
input, never on its command line), stopped by the caller. ``host``, ``port`` and ``argv_prefix``
put it elsewhere: on another address, or inside a network namespace (``ip netns exec NS``)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from urllib.parse import quote, urlsplit, urlunsplit


def start_private_redis(log_path: str | None = None, timeout_s: float = 10.0,
                        password: str | None = None, host: str = "127.0.0.1", port: int = 0,
                        argv_prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (no persistence, bound to ``host`` only) on ``port`` (0: a free
    one of this network namespace's); returns the process and its URL
    (``redis://:PASSWORD@HOST:PORT/0`` with a ``password``, which every client then needs).
    ``argv_prefix`` goes before the server's command line (``["ip", "netns", "exec", NS]``:
    give a ``port``, the free-port probe runs here). Raises RuntimeError when the binary is
    missing or does not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; pass --redis URL or install redis-server")
    if not port:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    # The settings go on standard input ("-": read the config from stdin), so a password is
    # never in the process list.
    conf = (f"port {port}\nbind {host}\nsave \"\"\nappendonly no\nprotected-mode yes\n"
            + (f"requirepass {password}\n" if password else ""))
    proc = subprocess.Popen([*argv_prefix, binary, "-"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(conf.encode())
    proc.stdin.close()
    auth = f":{quote(password, safe='')}@" if password else ""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return proc, f"redis://{auth}{host}:{port}/0"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)


def redact_url(url: str) -> str:
    """``url`` with any password shown as ``***`` (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def stop_private_redis(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """Stop a server from :func:`start_private_redis` (terminate, then kill)."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
