"""Settings both ends of a store node's gRPC wire use: how block bytes are chunked and the
channel and server options. A neutral module, so a client never imports the server."""
from __future__ import annotations

from typing import Any

from kvstore.port_hold import held

CHUNK_BYTES = 1 << 20                # block bytes per PutChunk / GetChunk
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
                # a client finds a restarted peer within 0.1-2 s (gRPC's default backs off to 120 s)
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000)]


def server_options() -> list[tuple[str, Any]]:
    """A gRPC server's options. A server refuses a port already in use (gRPC sets SO_REUSEPORT
    by default, which would let a second node share the port and take half its connections),
    unless its supervisor holds the port for it (:mod:`kvstore.port_hold`): it then binds
    beside the hold."""
    return GRPC_OPTIONS + [("grpc.so_reuseport", 1 if held() else 0)]


def listen(server: Any, address: str, who: str) -> int:
    """Bind gRPC ``server`` to ``address``; the port. Raises RuntimeError naming ``who`` when
    the port is in use or the address is not local (gRPC raises its own "Failed to bind"
    where older versions returned 0)."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise RuntimeError(f"{who}: cannot listen on {address} (port in use or address not local)")
    return int(port)
