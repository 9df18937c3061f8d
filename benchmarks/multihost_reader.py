"""The reader side of benchmarks/bench_multihost.py, run inside one host's namespace.

argv: one JSON object: ``mode`` (``cross``: kvstore's transfer-engine path and Mooncake Store's
own client, interleaved round by round; ``same``: kvstore's same-host path), ``node`` (the
store node's host:port; its token in ``KVSTORE_STORE_TOKEN``), ``master`` and ``meta``
(Mooncake's master and HTTP metadata server, for ``cross``) and ``rounds``.

Per block size (1 MiB: 32 blocks, 16 MiB: 8), one block per call on both sides, fresh keys
each round, the best of ``rounds`` after a warm-up round; every round's bytes are compared
with what was put. Prints one JSON object: best seconds per system and size, the checks,
and how many transfer-engine reads fell back to gRPC.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from dataplane_peers import MIB, Case, block_key  # noqa: E402

from kvstore.auth import STORE_TOKEN_ENV  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.transfer import TransferEngineTransport  # noqa: E402
from kvstore.transfer.engine import local_address_toward  # noqa: E402

SIZES = [("1MiB", MIB, 32), ("16MiB", 16 * MIB, 8)]


class KV:
    """kvstore: puts over gRPC (untimed), gets by ``path`` (``te``: the transfer engine into
    the registered output arena; ``same``: the same-host slab, ``get_into``)."""

    def __init__(self, node: str, path: str, cases: list[Case]) -> None:
        token = os.environ.get(STORE_TOKEN_ENV)
        self.path = path
        self.client = StoreClient(node, token, data_path="grpc" if path == "te" else "auto")
        self.client.wait_ready(30)
        if path == "same" and not self.client.data_path_in_use.startswith("same-host"):
            raise RuntimeError(f"kvstore picked {self.client.data_path_in_use}, not the same-host path")
        self.te: Any = None
        if path == "te":
            self.te = TransferEngineTransport(node, token)
            for case in cases:
                self.te.register(case.dst_arena)

    def put(self, case: Case, keys: list[str]) -> None:
        rs = [self.client.put_blocks([(block_key(k), s)])[0] for k, s in zip(keys, case.src)]
        assert all(r.ok for r in rs), rs[:2]

    def get(self, case: Case, keys: list[str]) -> None:
        reader = self.te if self.te is not None else self.client
        got = [reader.get_into([block_key(k)], [d])[0] for k, d in zip(keys, case.dst)]
        assert all(g == case.size for g in got), got[:2]

    def clear(self, case: Case, keys: list[str]) -> None:
        self.client.evict("dram", 1 << 40)

    def close(self) -> None:
        if self.te is not None:
            self.te.close()
        self.client.close()


class Mooncake:
    """Mooncake Store's own client on this host, no segment of its own: its puts land in the
    holder's segment on the node's host, its gets read them across."""

    def __init__(self, master: str, meta: str, cases: list[Case]) -> None:
        import mooncake.store as ms
        me = local_address_toward(master.rpartition(":")[0])
        with socket.socket() as s:
            s.bind((me, 0))
            port = s.getsockname()[1]
        self.store = ms.MooncakeDistributedStore()
        rc = self.store.setup(f"{me}:{port}", meta, 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        for case in cases:
            for arena in (case.src_arena, case.dst_arena):
                if self.store.register_buffer(arena.ctypes.data, arena.nbytes) != 0:
                    raise RuntimeError("Mooncake register_buffer failed")

    def put(self, case: Case, keys: list[str]) -> None:
        rcs = [self.store.put_from(k, s.ctypes.data, case.size) for k, s in zip(keys, case.src)]
        assert all(rc == 0 for rc in rcs), rcs[:2]

    def get(self, case: Case, keys: list[str]) -> None:
        got = [self.store.get_into(k, d.ctypes.data, case.size) for k, d in zip(keys, case.dst)]
        assert all(g == case.size for g in got), got[:2]

    def clear(self, case: Case, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k, True)

    def close(self) -> None:
        self.store.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    cases = [Case(label, size, n, False) for label, size, n in SIZES]
    systems: dict[str, Any] = {}
    if spec["mode"] == "cross":
        systems["kvstore-te"] = KV(spec["node"], "te", cases)
        systems["mooncake"] = Mooncake(spec["master"], spec["meta"], cases)
    else:
        systems["kvstore-same-host"] = KV(spec["node"], "same", cases)
    best: dict[str, dict[str, float]] = {name: {} for name in systems}
    checks: dict[str, bool] = {}
    for rnd in range(spec["rounds"] + 1):
        for case in cases:
            for name, system in systems.items():
                keys = case.keys(name, rnd)
                system.put(case, keys)
                t0 = time.perf_counter()
                system.get(case, keys)
                dt = time.perf_counter() - t0
                ok = case.check()
                checks[f"{name}/{case.label}"] = checks.get(f"{name}/{case.label}", True) and ok
                if rnd:
                    best[name][case.label] = min(best[name].get(case.label, dt), dt)
                system.clear(case, keys)
    kv = systems.get("kvstore-te")
    out = {"best_seconds": best, "checks": checks, "blocks": {label: n for label, _, n in SIZES},
           "te_grpc_reads": kv.te.grpc_reads if kv is not None else None,
           "te_reads": kv.te.te_reads if kv is not None else None}
    for system in systems.values():
        system.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
