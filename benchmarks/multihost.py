"""A kvstore cluster across hosts on this machine (``benchmarks/netns.py``): Redis, with a
password, alone on host 1; a store node on each other host, every service bound to its host's
address; block traffic through :class:`~kvstore.cluster.client.ClusterClient` from the root
namespace (the bridge's address, a host of its own), and the faults. Used by
``tests/kvstore/cluster/test_multihost.py`` and ``benchmarks/bench_multihost.py``.

Store node ``nI`` on host ``I`` serves gRPC on :data:`STORE_PORT`, the transfer engine's lease
channel on :data:`CONTROL_PORT` and metrics on :data:`METRICS_PORT`, all on its host's address;
only the Mooncake transfer engine listens on every interface (it has no bind setting).

:class:`Load` puts chains of blocks whose bytes derive from their key and reads them back,
so every answer is checked: a hit with other bytes is ``wrong`` (must stay 0), a miss is a
recompute. Every acknowledged block is recorded with the node that holds it; after the faults,
:meth:`Load.lost` lists the acknowledged blocks of surviving nodes that no longer read back.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import grpc
import numpy as np

from benchmarks.netns import Topology
from kvstore.cluster.client import ClusterClient
from kvstore.cluster.membership import RedisRegistry
from kvstore.cluster.redis_server import start_private_redis, stop_private_redis
from kvstore.dataplane.control_client import TcpControl

ROOT = Path(__file__).resolve().parents[1]
REDIS_PORT, STORE_PORT, CONTROL_PORT, METRICS_PORT = 6379, 50051, 50052, 9100
BEAT_S, TTL_S = 0.3, 1.5
BLOCK_BYTES = 64 << 10


def block_of(key: bytes, size: int = BLOCK_BYTES) -> bytes:
    """The bytes of block ``key``: derived from it, so any read can be checked."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8).tobytes()


def key_of(run: str, n: int) -> bytes:
    return hashlib.sha256(f"{run} block {n}".encode()).digest()[:16]


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM to every process still running, then SIGKILL to any not gone within ``grace_s``."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Cluster:
    """Redis on host 1, store nodes on hosts 2..``nodes + 1``; more hosts after those stay
    empty (an outsider, an engine's host). ``token`` guards every store port; Redis takes
    ``redis_password``. :meth:`close` stops everything and removes the hosts."""

    def __init__(self, workdir: str, nodes: int = 3, extra_hosts: int = 1, dram: str = "256MiB",
                 node_flags: Iterable[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.topology = Topology(1 + nodes + extra_hosts).up()
        self.node_hosts = list(range(2, 2 + nodes))
        self.token = secrets.token_hex(16)
        self.redis_password = secrets.token_hex(16)
        self.dram, self.node_flags = dram, list(node_flags)
        self.procs: dict[int, subprocess.Popen] = {}
        self.redis: subprocess.Popen | None = None
        self.redis_url = ""
        try:
            self.start_redis()
            for i in self.node_hosts:
                self.start_node(i, wait=False)
            for i in self.node_hosts:
                self.wait_node(i)
        except BaseException:
            self.close()
            raise

    # -- services --------------------------------------------------------------------------
    def start_redis(self) -> None:
        self.redis, self.redis_url = start_private_redis(
            str(self.workdir / "redis.log"), timeout_s=20, password=self.redis_password,
            host=self.topology.address(1), port=REDIS_PORT, argv_prefix=self.topology.argv(1, []))

    def node_id(self, i: int) -> str:
        return f"n{i}"

    def address(self, i: int) -> str:
        return f"{self.topology.address(i)}:{STORE_PORT}"

    def start_node(self, i: int, wait: bool = True) -> subprocess.Popen:
        host = self.topology.address(i)
        argv = [sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve", "--node-id", self.node_id(i),
                "--host", host, "--port", str(STORE_PORT), "--control-port", str(CONTROL_PORT),
                "--metrics-port", str(METRICS_PORT), "--redis", self.redis_url, "--transfer-engine", "tcp",
                "--dram", self.dram, "--ssd", "0", "--no-dram-prefault", "--heartbeat", str(BEAT_S),
                "--node-ttl", str(TTL_S), "--data-dir", str(self.workdir / f"h{i}"), *self.node_flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT), KVSTORE_STORE_TOKEN=self.token)
        log = open(self.workdir / f"{self.node_id(i)}.log", "ab")
        self.procs[i] = self.topology.popen(i, argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=str(ROOT), env=env)
        if wait:
            self.wait_node(i)
        return self.procs[i]

    def wait_node(self, i: int, timeout_s: float = 90.0) -> None:
        with grpc.insecure_channel(self.address(i)) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"store node {self.node_id(i)} not ready: {self.log_tail(i)}") from None

    def log_tail(self, i: int) -> str:
        path = self.workdir / f"{self.node_id(i)}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def kill9(self, i: int) -> None:
        """SIGKILL every process on host ``i`` (its store node)."""
        for pid in self.topology.pids(i):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if i in self.procs:
            self.procs[i].wait(10)

    def client(self, timeout_s: float = 2.0, transport: str = "transfer_engine") -> ClusterClient:
        return ClusterClient(self.redis_url, auth_token=self.token, transport=transport, refresh_s=0.1,
                             suspect_s=1.0, timeout_s=timeout_s)

    def registry(self) -> RedisRegistry:
        return RedisRegistry(self.redis_url, self.token)

    def live(self, registry: RedisRegistry) -> set[str]:
        try:
            return {n.node_id for n in registry.nodes()}
        except Exception:   # noqa: BLE001 (Redis cut off: nothing known now)
            return set()

    def converge(self, registry: RedisRegistry, want: set[str], timeout_s: float) -> float | None:
        """Seconds until the registry lists exactly ``want`` (None: not within ``timeout_s``)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.live(registry) == want:
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    def listeners(self, i: int) -> list[str]:
        """``address:port`` of every TCP listener on host ``i`` (``ss -ltn``)."""
        out = self.topology.run(i, ["ss", "-ltnH"]).stdout
        return sorted({line.split()[3] for line in out.splitlines() if line.strip()})

    def close(self) -> None:
        stop_all(self.procs.values())
        if self.redis is not None:
            stop_private_redis(self.redis)
        self.topology.down()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Load:
    """Block traffic through one ClusterClient in a thread: put a chain of ``chain`` blocks,
    then read back a chain put earlier, over and over. Counts ``requests`` (a read of one
    chain), ``hits``/``misses`` (blocks; a miss is a recompute), ``wrong`` (a hit with other
    bytes), ``errors`` (an exception out of the client: must stay 0) and ``acked`` (block key
    → node that held it just after the put was acknowledged)."""

    def __init__(self, cluster: Cluster, run: str, chain: int = 4, size: int = BLOCK_BYTES) -> None:
        self.client = cluster.client()
        self.run, self.chain, self.size = run, chain, size
        self.requests = self.hits = self.misses = self.wrong = self.errors = self.put_failed = 0
        self.acked: dict[bytes, str] = {}
        self.slowest_s = 0.0    # the longest read of a chain
        self.error_text: list[str] = []
        self._n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._lock = threading.Lock()

    def step(self) -> None:
        keys = [key_of(self.run, self._n + j) for j in range(self.chain)]
        self._n += self.chain
        results = self.client.put_blocks([(k, block_of(k, self.size)) for k in keys], chain=True)
        done = [r.key for r in results if r.ok]
        self.put_failed += len(keys) - len(done)
        if done:
            owners = self.client.locate(done)
            with self._lock:
                self.acked.update({k: o.node_id for k, o in zip(done, owners) if o is not None})
        start = int(np.random.default_rng(self._n).integers(0, max(1, self._n // self.chain))) * self.chain
        self.read([key_of(self.run, start + j) for j in range(self.chain)])

    def read(self, keys: list[bytes]) -> None:
        t0 = time.monotonic()
        got = self.client.get_blocks(keys)
        self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
        self.requests += 1
        for k, data in zip(keys, got):
            if data is None:
                self.misses += 1
            elif data != block_of(k, self.size):
                self.wrong += 1
            else:
                self.hits += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 (counted: the client must turn failures into misses)
                self.errors += 1
                self.error_text.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def lost(self, survivors: set[str], tries: int = 3) -> list[bytes]:
        """Acknowledged blocks held by a node in ``survivors`` that do not read back. A read
        that fails (a node slower than the client's timeout on a loaded machine) is a miss
        to the client, not a loss: the blocks that did not read back are asked again, up to
        ``tries`` times in all, a second apart; wrong bytes are never asked again."""
        with self._lock:
            keys = [k for k, node in self.acked.items() if node in survivors]
        for attempt in range(tries):
            if attempt:
                time.sleep(1.0)
            missing, wrong = [], []
            for start in range(0, len(keys), 64):
                part = keys[start:start + 64]
                self.client._listed_at = 0.0
                for k, d in zip(part, self.client.get_blocks(part)):
                    if d is None:
                        missing.append(k)
                    elif d != block_of(k, self.size):
                        wrong.append(k)
            if wrong or not missing:
                return wrong + missing
            keys = missing
        return missing

    def goes_on(self, within_s: float, requests: int = 3) -> float | None:
        """Seconds until ``requests`` more reads complete (None: not within ``within_s``)."""
        t0, before = time.monotonic(), self.requests
        while time.monotonic() - t0 < within_s:
            if self.requests >= before + requests:
                return time.monotonic() - t0
            time.sleep(0.02)
        return None

    def counts(self) -> dict[str, float]:
        return {"slowest_read_s": round(self.slowest_s, 3),
                "requests_completed": self.requests, "blocks_hit": self.hits, "blocks_missed_recomputed": self.misses,
                "wrong_bytes_blocks": self.wrong, "client_errors": self.errors, "acknowledged_blocks": len(self.acked),
                "puts_refused": self.put_failed}

    def close(self) -> None:
        self.client.close()


def outsider_probe(cluster: Cluster, outsider: int, i: int, key: bytes) -> tuple[dict, dict]:
    """Run ``benchmarks/multihost_outsider.py`` on host ``outsider`` (no token, no password)
    against node host ``i``, which holds block ``key``; returns what each try got with the
    block at rest, and what the transfer engine tries got while this process holds a lease
    on it (a read in flight)."""
    te = next(n.te_endpoint for n in cluster.registry().nodes() if n.node_id == cluster.node_id(i))
    addr = cluster.topology.address(i)
    wildcard = [f"{addr}:{a.rpartition(':')[2]}" for a in cluster.listeners(i)
                if a.startswith(("*:", "0.0.0.0:", "[::]:"))]
    spec = {"store": cluster.address(i), "control": f"{addr}:{CONTROL_PORT}", "metrics": f"{addr}:{METRICS_PORT}",
            "redis": f"{cluster.topology.address(1)}:{REDIS_PORT}", "te": te, "wildcard": wildcard,
            "key": key.hex(), "marker": block_of(key)[:64].hex()}
    proc = cluster.topology.popen(outsider, [sys.executable, str(ROOT / "benchmarks" / "multihost_outsider.py"),
                                             json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdin is not None and proc.stdout is not None
    try:
        at_rest = _json_line(proc)
        control = TcpControl(spec["control"], cluster.token, timeout_s=10)
        try:
            control.lease([key])
            proc.stdin.write("leased\n")
            proc.stdin.flush()
            in_flight = _json_line(proc)
        finally:
            control.close()
    finally:
        proc.kill()
        proc.wait()
    return at_rest, in_flight


def _json_line(proc: subprocess.Popen) -> dict:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the outsider probe ended ({proc.wait()}) without an answer")
