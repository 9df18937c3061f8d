"""A host outside the cluster, holding no token or password, tries every port of a store
node's host (run inside that outsider's namespace by ``benchmarks/multihost.py``'s callers).

argv: one JSON object: ``store`` (host:port), ``control``, ``metrics``, ``redis`` (host:port
each), ``te`` (the transfer engine's handshake endpoint host:port, as the membership record
names it), ``wildcard`` (the host's other listeners on every interface, host:port), ``key``
(hex of a block the node holds) and ``marker`` (hex of that block's first 64 bytes).
Prints a JSON object (what each try got; a refusal is the error's class name), then, after a
line on its standard input (the harness holds a lease on the block: it is in flight, copied
into the node's staging area), another: what the transfer engine tries got then.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kvstore.admin.client import AdminClient  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.dataplane.control_client import TcpControl  # noqa: E402
from kvstore.transfer.engine import local_address_toward  # noqa: E402

PROBE_BYTES = 1 << 20


def outcome(fn) -> str:    # type: ignore[no-untyped-def]
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 (the outcome is the answer)
        return type(exc).__name__
    return f"ANSWERED: {str(got)[:80]}"


def store_tries(addr: str, key: bytes) -> dict[str, str]:
    client = StoreClient(addr, None, timeout_s=5, data_path="grpc")
    admin = AdminClient(addr, None, timeout_s=5)
    try:
        return {"store_get": outcome(lambda: client.get_blocks([key])),
                "store_put": outcome(lambda: client.put_blocks([(os.urandom(16), b"x" * 4096)])),
                "store_lookup": outcome(lambda: client.lookup([key])),
                "admin_remove": outcome(lambda: admin.keys_call("Remove", [key])),
                "admin_list": outcome(lambda: admin.list_blocks())}
    finally:
        client.close()
        admin.close()


def control_try(addr: str, key: bytes) -> str:
    def lease() -> object:
        ctl = TcpControl(addr, None, timeout_s=5)
        try:
            return ctl.lease([key])
        finally:
            ctl.close()
    return outcome(lease)


def metrics_try(addr: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
            return f"ANSWERED: HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return type(exc).__name__


def redis_try(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"KEYS *\r\n")
            return s.recv(128).decode(errors="replace").strip()
    except OSError as exc:
        return type(exc).__name__


def tcp_try(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
        return "open"
    except OSError as exc:
        return type(exc).__name__


class EngineProbe:
    """A Mooncake transfer engine of the outsider's own, aimed at the node's: it finds the
    node's registered region (the handshake names it), reads its first :data:`PROBE_BYTES`
    and writes 4 KiB there."""

    def __init__(self, endpoint: str) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")
        from mooncake.engine import TransferEngine
        self.endpoint = endpoint
        self.engine = TransferEngine()
        rc = self.engine.initialize(local_address_toward(endpoint.rpartition(":")[0]), "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"the outsider's transfer engine did not start ({rc})")
        self.buf = np.zeros(PROBE_BYTES, dtype=np.uint8)
        self.engine.register_memory(int(self.buf.ctypes.data), PROBE_BYTES)

    def tries(self, marker: bytes) -> dict[str, object]:
        remote = self.engine.get_first_buffer_address(self.endpoint)
        out: dict[str, object] = {"te_region_found": bool(remote and remote > 0)}
        if not out["te_region_found"]:
            return out
        self.buf[:] = 0
        rc = self.engine.transfer_sync_read(self.endpoint, int(self.buf.ctypes.data), remote, PROBE_BYTES)
        out["te_read_rc"] = rc
        out["te_read_nonzero_bytes"] = int(np.count_nonzero(self.buf)) if rc == 0 else 0
        out["te_read_holds_block"] = rc == 0 and marker in self.buf.tobytes()
        self.buf[:4096] = 0xAA
        out["te_write_rc"] = self.engine.transfer_sync_write(self.endpoint, int(self.buf.ctypes.data), remote, 4096)
        return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    key, marker = bytes.fromhex(spec["key"]), bytes.fromhex(spec["marker"])
    result: dict[str, object] = store_tries(spec["store"], key)
    result["control_lease"] = control_try(spec["control"], key)
    result["metrics"] = metrics_try(spec["metrics"])
    result["redis"] = redis_try(spec["redis"])
    result["wildcard_listeners"] = {a: tcp_try(a) for a in spec["wildcard"]}
    probe = EngineProbe(spec["te"])
    result.update(probe.tries(marker))     # the block at rest (no read of it in flight)
    print(json.dumps(result), flush=True)
    sys.stdin.readline()                   # the harness now holds a lease on the block: in flight
    print(json.dumps(probe.tries(marker)), flush=True)


if __name__ == "__main__":
    main()
