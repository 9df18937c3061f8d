"""The systems benchmarks/bench_dataplane.py compares, each behind the same put/get calls:
kvstore's same-host data plane (a store node process of its own), Mooncake Store (its master
and a segment holder), Redis (a private redis-server) and ``np.copyto`` (the memory-bandwidth
bound); plus the block cases (:class:`Case`) and the child processes they start."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.client import StoreClient  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402

BIN = Path(sys.executable).parent
KIB, MIB = 1 << 10, 1 << 20

HOLDER = r"""
import sys, mooncake.store as ms
name, meta, master, seg = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = ms.MooncakeDistributedStore()
rc = s.setup(name, meta, seg, 16 << 20, "tcp", "", master)
print("READY", rc, flush=True)
sys.stdin.read()
s.close()
"""


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on port {port}") from None
            time.sleep(0.05)


class Case:
    """One block size: source blocks and output arrays carved from two arenas (so Mooncake
    can register them once), fresh keys per round."""

    def __init__(self, label: str, size: int, n: int, batch: bool) -> None:
        self.label, self.size, self.n, self.batch = label, size, n, batch
        self.src_arena = np.frombuffer(np.random.default_rng(size).bytes(size * n), dtype=np.uint8)
        self.dst_arena = np.ones(size * n, dtype=np.uint8)  # touched: no first-touch page faults
        self.src = [self.src_arena[i * size:(i + 1) * size] for i in range(n)]
        self.dst = [self.dst_arena[i * size:(i + 1) * size] for i in range(n)]

    def keys(self, system: str, rnd: int) -> list[str]:
        return [f"{system}-{self.label}-r{rnd}-{i}" for i in range(self.n)]

    def check(self) -> bool:
        ok = all(d.tobytes() == s.tobytes() for d, s in zip(self.dst, self.src))
        self.dst_arena[:] = 1
        return ok


class Processes:
    """Every child process this benchmark starts; all are stopped in :meth:`stop`."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kw)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def block_key(name: str) -> bytes:
    """The 16-byte block key (xxh3_128, as the key spec makes) kvstore stores ``name`` under:
    kvstore refuses keys of any other length; the peers take the name as it is."""
    return xxhash.xxh3_128_digest(name.encode())


class KVStore:
    name = "kvstore"

    def __init__(self, procs: Processes, tmp: str, verify: bool = True) -> None:
        port = free_port()
        self.socket_path = os.path.join(tmp, "kvstore.sock")
        cfg = os.path.join(tmp, "store.toml")
        Path(cfg).write_text(f'node_id = "bench"\nport = {port}\ndram_bytes = "2GiB"\nssd_bytes = 0\n'
                             f'data_dir = "{tmp}/store"\ntransfer_engine = "tcp"\n'
                             # the whole slab registered, as Mooncake Store registers its segment;
                             # te_probe below measures the default (a staging area) beside it
                             f'te_staging_bytes = 0\n'
                             f'dataplane_socket = "{self.socket_path}"\n')
        self.proc = procs.start([sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve",
                                 "--config", cfg], cwd=ROOT, stdout=subprocess.DEVNULL)
        wait_port(port, self.proc, "kvstore serve")
        self.client = StoreClient(f"127.0.0.1:{port}")
        self.client.wait_ready(30)
        self.path = self.client.data_path_in_use
        if not self.path.startswith("same-host"):
            raise RuntimeError(f"kvstore client did not pick the same-host path ({self.path})")
        self.client._local().verify = verify
        self.address = f"127.0.0.1:{port}"
        self.te: Any = None

    def open_te(self, case: Case) -> None:
        """The cross-host reader of this node (its transfer engine over loopback), with
        ``case``'s output arena registered as Mooncake's is."""
        from kvstore.transfer import TransferEngineTransport
        self.te = TransferEngineTransport(self.address)
        if self.te.control is None:
            raise RuntimeError("the kvstore node announced no TCP control channel")
        self.te.register(case.dst_arena)

    def get_te(self, case: Case, keys: list[str]) -> None:
        got = [self.te.get_into([block_key(k)], [d])[0] for k, d in zip(keys, case.dst)]
        assert all(g == case.size for g in got), got[:2]
        assert self.te.grpc_reads == 0, "transfer-engine reads fell back to gRPC"

    def put(self, case: Case, keys: list[str], batch: bool = False) -> None:
        bkeys = [block_key(k) for k in keys]
        if case.batch or batch:
            rs = self.client.put_blocks(list(zip(bkeys, case.src)))
        else:
            rs = [self.client.put_blocks([(k, s)])[0] for k, s in zip(bkeys, case.src)]
        assert all(r.ok for r in rs), rs[:2]

    def get(self, case: Case, keys: list[str], batch: bool = False) -> None:
        bkeys = [block_key(k) for k in keys]
        if case.batch or batch:
            got = self.client.get_into(bkeys, case.dst)
        else:
            got = [self.client.get_into([k], [d])[0] for k, d in zip(bkeys, case.dst)]
        assert all(g == case.size for g in got), got[:2]

    def clear(self, case: Case, keys: list[str]) -> None:
        self.client.evict("dram", 1 << 40)  # as Mooncake's remove: the next round reuses the space

    def close(self) -> None:
        if self.te is not None:
            self.te.close()
        self.client.close()


class Mooncake:
    name = "mooncake"

    def __init__(self, procs: Processes, tmp: str, cases: list[Case]) -> None:
        import mooncake.store as ms
        rpc, metrics, http = free_port(), free_port(), free_port()
        self.master = procs.start([str(BIN / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                                   "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
                                   "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                                   f"--http_metadata_server_port={http}"],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "master.log"), "w"))
        wait_port(rpc, self.master, "mooncake_master")
        wait_port(http, self.master, "mooncake metadata server")
        meta, master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        seg = 1 << 30
        self.holder = procs.start([sys.executable, "-c", HOLDER, f"127.0.0.1:{free_port()}", meta, master, str(seg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  stderr=open(os.path.join(tmp, "holder.log"), "w"))
        line = self.holder.stdout.readline().split()
        if line[:2] != ["READY", "0"]:
            raise RuntimeError(f"Mooncake segment holder failed to start: {line}")
        self.store = ms.MooncakeDistributedStore()
        rc = self.store.setup(f"127.0.0.1:{free_port()}", meta, 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        for case in cases:  # zero-copy put_from / get_into need registered buffers
            for arena in (case.src_arena, case.dst_arena):
                if self.store.register_buffer(arena.ctypes.data, arena.nbytes) != 0:
                    raise RuntimeError("Mooncake register_buffer failed")

    def put(self, case: Case, keys: list[str]) -> None:
        ptrs = [s.ctypes.data for s in case.src]
        if case.batch:
            rcs = self.store.batch_put_from(keys, ptrs, [case.size] * case.n)
        else:
            rcs = [self.store.put_from(k, p, case.size) for k, p in zip(keys, ptrs)]
        assert all(rc == 0 for rc in rcs), rcs[:2]

    def get(self, case: Case, keys: list[str]) -> None:
        ptrs = [d.ctypes.data for d in case.dst]
        if case.batch:
            got = self.store.batch_get_into(keys, ptrs, [case.size] * case.n)
        else:
            got = [self.store.get_into(k, p, case.size) for k, p in zip(keys, ptrs)]
        assert all(g == case.size for g in got), got[:2]

    def clear(self, case: Case, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k, True)  # force: a get holds a lease on the object for 10 s

    def close(self) -> None:
        self.store.close()
        self.holder.stdin.close()


class Redis:
    name = "redis"

    def __init__(self, procs: Processes, tmp: str) -> None:
        import redis
        port = free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = procs.start([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--protected-mode", "yes"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, self.proc, "redis-server")
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.ping()

    def put(self, case: Case, keys: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k, s in zip(keys, case.src):
            pipe.set(k, memoryview(s))
        assert all(pipe.execute())

    def get(self, case: Case, keys: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for d, v in zip(case.dst, pipe.execute()):
            np.copyto(d, np.frombuffer(v, dtype=np.uint8))

    def clear(self, case: Case, keys: list[str]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


class CopyTo:
    """The physical limit: the same bytes between the same arrays, one process."""

    name = "np.copyto"

    def put(self, case: Case, keys: list[str]) -> None:
        for s, d in zip(case.src, case.dst):
            np.copyto(d, s)

    get = put

    def clear(self, case: Case, keys: list[str]) -> None:
        pass

    def close(self) -> None:
        pass
