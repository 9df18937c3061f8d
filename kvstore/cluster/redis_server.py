"""A private ``redis-server`` for a one-host cluster (``kvstore up``): no persistence,
optionally a password (given to the server on its standard input, never on its command line),
stopped by the caller. It listens on a Unix socket in a directory only this user can enter
(``unix_socket``: what ``kvstore up`` gives, so no other local user can reach it or take its
address first), or on a free 127.0.0.1 port; ``host``, ``port`` and ``argv_prefix`` put a TCP one
elsewhere: on another address, or inside a network namespace (``ip netns exec NS``)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from urllib.parse import quote, urlsplit, urlunsplit


def start_private_redis(log_path: str | None = None, timeout_s: float = 10.0,
                        password: str | None = None, host: str = "127.0.0.1", port: int = 0,
                        argv_prefix: Sequence[str] = (), unix_socket: str | None = None
                        ) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (no persistence) on the Unix socket ``unix_socket`` (mode 0700,
    TCP off; its directory should be this user's alone: :func:`socket_path`), else bound to
    ``host`` only on ``port`` (0: a free one of this network namespace's). Returns the process
    and its URL (``unix://:PASSWORD@/PATH?db=0`` or ``redis://:PASSWORD@HOST:PORT/0`` with a
    ``password``, which every client then needs). ``argv_prefix`` goes before the server's
    command line (``["ip", "netns", "exec", NS]``: give a ``port``, the free-port probe runs
    here). Raises RuntimeError when the binary is missing or does not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; pass --redis URL or install redis-server")
    if unix_socket:
        listen = f"port 0\nunixsocket {_config_string(unix_socket)}\nunixsocketperm 700\n"
    else:
        if not port:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        listen = f"port {port}\nbind {host}\n"
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    # The settings go on standard input ("-": read the config from stdin), so a password is
    # never in the process list.
    conf = (listen + "save \"\"\nappendonly no\nprotected-mode yes\n"
            + (f"requirepass {_config_string(password)}\n" if password else ""))
    proc = subprocess.Popen([*argv_prefix, binary, "-"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(conf.encode())
    proc.stdin.close()
    auth = f":{quote(password, safe='')}@" if password else ""
    url = f"unix://{auth}{quote(unix_socket)}?db=0" if unix_socket else f"redis://{auth}{host}:{port}/0"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _connect(unix_socket, host, port)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on {unix_socket or f'port {port}'}") from None
            time.sleep(0.05)


def _config_string(text: str) -> str:
    """``text`` as one argument of a redis.conf line, whatever it holds (spaces, quotes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _connect(unix_socket: str | None, host: str, port: int) -> None:
    """Connect to the server's socket and close again; OSError while nothing listens there."""
    if unix_socket:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(0.2)
            s.connect(unix_socket)
    else:
        socket.create_connection((host, port), timeout=0.2).close()


def socket_path(data_dir: str) -> str:
    """Where ``kvstore up`` puts its private Redis's socket: ``DATA_DIR/redis.sock`` (the data
    directory is 0700), or, when that path is too long for a Unix socket,
    ``redis-<pid>.sock`` in this user's private socket directory
    (:func:`kvstore.config.private_socket_dir`). Raises OSError when that directory cannot be
    had."""
    import os

    from kvstore.config import MAX_SOCKET_PATH, private_socket_dir
    path = os.path.abspath(os.path.join(data_dir, "redis.sock"))
    if len(path) < MAX_SOCKET_PATH:
        return path
    name = f"redis-{os.getpid()}.sock"
    return os.path.join(private_socket_dir(MAX_SOCKET_PATH - 1 - len(name)), name)


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
