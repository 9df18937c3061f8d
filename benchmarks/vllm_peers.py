"""The four set-ups of benchmarks/bench_vllm.py: the pool each one starts (private processes on
free 127.0.0.1 ports, stopped by the caller's ``Processes``) and the connector vLLM loads.

A set-up's :meth:`start` returns a :class:`Launch`: the interpreter that runs
benchmarks/vllm_worker.py (kvstore's venv, or LMCache's own), the connector (module, class,
extra config; None for recompute) and the environment the engine needs. Every pool gets the
same capacity (``pool_bytes``) so that none of them evicts the benchmark's working set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from dataplane_peers import Processes, wait_port  # noqa: E402

from launcher.supervisor import free_port  # noqa: E402

KV_PY = ROOT / ".venv" / "bin" / "python"
LMCACHE_PY = ROOT / ".venv-lmcache" / "bin" / "python"
KV_CONNECTOR = ROOT / "engines" / "vllm" / "connector.py"
GIB = 1 << 30


@dataclass
class Launch:
    python: Path
    connector: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)
    notes: str = ""


class SetupError(RuntimeError):
    """A set-up that cannot run here; its message goes into the JSON."""


def _log(tmp: str, name: str):
    return open(os.path.join(tmp, f"{name}.log"), "w")


class Recompute:
    name = "recompute"
    label = "no connector (recompute)"

    def start(self, procs: Processes, tmp: str, pool_bytes: int) -> Launch:
        return Launch(KV_PY, None, notes="vLLM alone, prefix caching off: every prompt token is computed")


class KVStore:
    name = "kvstore"
    label = "kvstore KVStoreConnector"

    def start(self, procs: Processes, tmp: str, pool_bytes: int) -> Launch:
        if not KV_CONNECTOR.exists():
            raise SetupError(f"{KV_CONNECTOR.relative_to(ROOT)} does not exist yet")
        port = free_port()
        proc = procs.start([str(ROOT / ".venv" / "bin" / "kvstore"), "--log-level", "WARNING", "serve",
                            "--port", str(port), "--dram", f"{pool_bytes // GIB}GiB",
                            "--data-dir", os.path.join(tmp, "store")],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=_log(tmp, "kvstore-serve"))
        wait_port(port, proc, "kvstore serve")
        return Launch(KV_PY, {"module": "engines.vllm.connector", "class": "KVStoreConnector",
                              "extra_config": {"kvstore.store": f"127.0.0.1:{port}"}},
                      notes=f"kvstore serve --dram {pool_bytes // GIB}GiB (one store node)")


class KVStoreSync(KVStore):
    name = "kvstore_sync"
    label = "kvstore KVStoreConnector, saves in the step (kvstore.async_save false)"

    def start(self, procs: Processes, tmp: str, pool_bytes: int) -> Launch:
        launch = super().start(procs, tmp, pool_bytes)
        assert launch.connector is not None
        launch.connector["extra_config"]["kvstore.async_save"] = False
        launch.notes += "; kv_both saves in wait_for_save, before the step ends"
        return launch


class Mooncake:
    name = "mooncake"
    label = "Mooncake MooncakeStoreConnector"

    def start(self, procs: Processes, tmp: str, pool_bytes: int) -> Launch:
        bindir = ROOT / ".venv" / "bin"
        rpc, metrics, client = free_port(), free_port(), free_port()
        master = procs.start([str(bindir / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                              "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
                             stdout=subprocess.DEVNULL, stderr=_log(tmp, "mooncake-master"))
        wait_port(rpc, master, "mooncake_master")
        holder = procs.start([str(bindir / "mooncake_client"), "-host=127.0.0.1", f"-port={client}",
                              "-metadata_server=P2PHANDSHAKE", "-protocol=tcp",
                              f"-master_server_address=127.0.0.1:{rpc}",
                              f"-global_segment_size={pool_bytes // GIB} GB"],
                             stdout=subprocess.DEVNULL, stderr=_log(tmp, "mooncake-client"))
        wait_port(client, holder, "mooncake_client", timeout_s=60)
        config = os.path.join(tmp, "mooncake.json")
        Path(config).write_text(json.dumps({
            "mode": "standalone-store", "global_segment_size": 0, "protocol": "tcp",
            "metadata_server": "P2PHANDSHAKE", "master_server_address": f"127.0.0.1:{rpc}",
            "local_hostname": "127.0.0.1"}))
        module = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
        return Launch(KV_PY, {"module": module, "class": "MooncakeStoreConnector", "extra_config": {}},
                      env={"MOONCAKE_CONFIG_PATH": config},
                      notes=f"mooncake_master + mooncake_client holding a {pool_bytes // GIB} GB segment "
                            "(tcp, P2PHANDSHAKE); the engine mounts no segment (standalone-store). Its loads are "
                            "asynchronous (timed in flight); its wait_for_save only queues the blocks to a "
                            "background send thread, so its store figure is that enqueue alone")


class LMCache:
    name = "lmcache"
    label = "LMCache LMCacheMPConnector"

    def start(self, procs: Processes, tmp: str, pool_bytes: int) -> Launch:
        if not LMCACHE_PY.exists():
            raise SetupError(f"{LMCACHE_PY.relative_to(ROOT)} is missing (make lmcache-venv)")
        port, http, prom = free_port(), free_port(), free_port()
        server = procs.start([str(LMCACHE_PY.parent / "lmcache"), "server", "--host", "127.0.0.1",
                              "--port", str(port), "--chunk-size", "32", "--l1-size-gb", str(pool_bytes // GIB),
                              "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                              "--http-host", "127.0.0.1", "--http-port", str(http),
                              "--prometheus-port", str(prom)],
                             stdout=subprocess.DEVNULL, stderr=_log(tmp, "lmcache-server"))
        wait_port(port, server, "lmcache server", timeout_s=120)
        module = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
        return Launch(LMCACHE_PY, {"module": module, "class": "LMCacheMPConnector",
                                   "extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}},
                      notes=f"lmcache server (LMCache 0.5.6, chunk 32, L1 {pool_bytes // GIB} GB, LRU) in "
                            ".venv-lmcache; vLLM there too")


SETUPS = {s.name: s for s in (Recompute(), KVStore(), KVStoreSync(), Mooncake(), LMCache())}
