"""A private ``redis-server`` for a one-host cluster (``kvstore up --store-nodes N``): a free
127.0.0.1 port, no persistence, optionally a password (given to the server on its standard
input, never on its command line), stopped by the caller."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from urllib.parse import quote, urlsplit, urlunsplit


def start_private_redis(log_path: str | None = None, timeout_s: float = 10.0,
                        password: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (no persistence, 127.0.0.1 only) on a free port; returns the
    process and its URL (``redis://:PASSWORD@127.0.0.1:PORT/0`` with a ``password``, which
    every client then needs). Raises RuntimeError when the binary is missing or does not
    start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; pass --redis URL or install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    # The settings go on standard input ("-": read the config from stdin), so a password is
    # never in the process list.
    conf = (f"port {port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\nprotected-mode yes\n"
            + (f"requirepass {password}\n" if password else ""))
    proc = subprocess.Popen([binary, "-"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(conf.encode())
    proc.stdin.close()
    auth = f":{quote(password, safe='')}@" if password else ""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://{auth}127.0.0.1:{port}/0"
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
