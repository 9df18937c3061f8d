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

from kvstore.child_process import guarded_argv


def start_private_redis(log_path: str | None = None, timeout_s: float = 10.0,
                        password: str | None = None, host: str = "127.0.0.1", port: int = 0,
                        argv_prefix: Sequence[str] = (), unix_socket: str | None = None,
                        die_with_parent: bool = False) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (no persistence) on the Unix socket ``unix_socket`` (mode 0700,
    TCP off; its directory should be this user's alone: :func:`socket_path`), else bound to
    ``host`` only on ``port`` (0: a free one of this network namespace's). Returns the process
    and its URL (``unix://:PASSWORD@/PATH?db=0`` or ``redis://:PASSWORD@HOST:PORT/0`` with a
    ``password``, which every client then needs). ``argv_prefix`` goes before the server's
    command line (``["ip", "netns", "exec", NS]``: give a ``port``, the free-port probe runs
    here); ``die_with_parent``: the server gets SIGTERM when this process dies, even by SIGKILL
    (a supervisor's children; :func:`kvstore.child_process.guarded_argv`). It has
    started once it answers PING under ``password`` while its process runs, so a server left
    on the same address by an earlier run is never taken for it. Raises RuntimeError when the
    binary is missing or does not start (its log's path named)."""
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
    argv = [*argv_prefix, binary, "-"]
    proc = subprocess.Popen(guarded_argv(argv) if die_with_parent else argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(conf.encode())
    proc.stdin.close()
    auth = f":{quote(password, safe='')}@" if password else ""
    url = f"unix://{auth}{quote(unix_socket)}?db=0" if unix_socket else f"redis://{auth}{host}:{port}/0"
    deadline = time.monotonic() + timeout_s
    while True:
        if _answers(url) and proc.poll() is None:
            return proc, url
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on {unix_socket or f'port {port}'}"
                               + (f" (its log: {log_path})" if log_path else "")) from None
        time.sleep(0.05)


def _config_string(text: str) -> str:
    """``text`` as one argument of a redis.conf line, whatever it holds (spaces, quotes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _answers(url: str) -> bool:
    """Whether the server at ``url`` answers PING under the URL's password."""
    import redis
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def socket_path() -> str:
    """Where ``kvstore up`` puts its private Redis's socket: ``redis-<pid>.sock`` in this
    user's private socket directory (:func:`kvstore.config.private_socket_path`: 0700, this
    user's, checked; ``$XDG_RUNTIME_DIR/kvstore`` or ``/tmp/kvstore-<uid>``), never in a
    directory someone else could own or rename (a ``--data-dir`` under another user's
    directory). Raises OSError when that directory cannot be had."""
    import os

    from kvstore.config import private_socket_path
    return private_socket_path(f"redis-{os.getpid()}.sock")


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
