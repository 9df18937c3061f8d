"""Binding a port as another user (``nobody``), as a local attacker squatting a service's port
would: for the tests of the ports ``kvstore up`` holds (kvstore/port_hold.py). Needs root (to
run a process as ``nobody``) and a Python that user may run."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

# The system's Python: the project's may sit under a directory only root can read.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

# Every way a squatter could try: on the address and on the wildcard, with and without
# SO_REUSEADDR and SO_REUSEPORT; prints each outcome ("bound" or the error's name).
_BIND = """
import errno, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
for addr in (host, "0.0.0.0"):
    for reuse_addr in (0, 1):
        for reuse_port in (0, 1):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse_addr)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuse_port)
            try:
                s.bind((addr, port))
                s.listen()
                print("bound")
            except OSError as exc:
                print(errno.errorcode.get(exc.errno, str(exc.errno)))
            finally:
                s.close()
"""


def need_other_user() -> None:
    """Skip unless this test can run a process as ``nobody``."""
    if os.geteuid() != 0 or SYSTEM_PYTHON is None:
        pytest.skip("needs root and /usr/bin/python3 to bind a port as another user")


def binds_as_nobody(host: str, port: int) -> list[str]:
    """What each of ``nobody``'s eight bind attempts on ``port`` gave (``bound`` or an errno name)."""
    need_other_user()
    proc = subprocess.run([SYSTEM_PYTHON, "-c", _BIND, host, str(port)], user="nobody", capture_output=True,
                          text=True, timeout=30, check=True)
    return proc.stdout.split()


_CONNECT = """
import errno, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    print("connected")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, str(exc.errno)))
"""


def connects_as_nobody(path: str) -> str:
    """What ``nobody``'s connect to the Unix socket ``path`` gave (``connected`` or an errno name)."""
    need_other_user()
    proc = subprocess.run([SYSTEM_PYTHON, "-c", _CONNECT, path], user="nobody", capture_output=True,
                          text=True, timeout=30, check=True)
    return proc.stdout.strip()
