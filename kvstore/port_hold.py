"""Ports a supervisor holds for the services it starts, so that no other user's process can take
one while its service loads, restarts or backs off — and with it the bearer tokens its clients
send (``kvstore up`` holds every port of its stack; docs/limits.md).

A hold is a TCP socket bound to the port with SO_REUSEPORT and without SO_REUSEADDR that never
listens. Linux then lets another socket bind the port — on that address, or on a wildcard
address that covers it — only with SO_REUSEPORT set and the same effective uid
(``inet_bind_conflict`` in net/ipv4/inet_connection_sock.c): the service, told so by
:data:`HELD_ENV`, binds beside the hold and listens; a process of another user cannot bind it at
all. Connections reach only a listener, so between a service's exit and its restart they are
refused, never accepted by someone else. The hold is not inherited by children (Python's sockets
are close-on-exec)."""
from __future__ import annotations

import os
import socket

HELD_ENV = "KVSTORE_PORT_HELD"   # "1": this process's supervisor holds its ports (bind with SO_REUSEPORT)


def family(host: str) -> socket.AddressFamily:
    """The address family of a literal ``host`` (an IPv6 address has a colon)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def hold(host: str, port: int = 0) -> socket.socket:
    """A hold on ``port`` of ``host`` (0: a free one the system picks; the socket's
    ``getsockname()`` says which). Raises OSError (EADDRINUSE) when the port is taken."""
    sock = socket.socket(family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def held() -> bool:
    """Whether this process's supervisor holds the ports it is to listen on: bind them with
    SO_REUSEPORT (without a hold a service leaves it off, so a port in use stays an error)."""
    return os.environ.get(HELD_ENV) == "1"
