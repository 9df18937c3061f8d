"""Shared pytest fixtures. Append fixtures; keep each group under its own heading."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


# -- store core: tiers, pool and store service ------------------------------------------------
@pytest.fixture
def make_dram() -> Iterator[Callable[..., object]]:
    """Factory of DRAM tiers (shared-memory slabs); every slab is closed and unlinked after
    the test, so no /dev/shm segment leaks."""
    from kvstore.tiers.dram import DramTier

    made: list[DramTier] = []

    def make(capacity_bytes: int) -> DramTier:
        tier = DramTier(capacity_bytes)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def make_ssd(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Factory of SSD tiers on a real LMDB directory under ``tmp_path`` (default ``ssd``);
    closed after the test."""
    from kvstore.tiers.ssd import SsdTier

    made: list[SsdTier] = []

    def make(capacity_bytes: int, name: str = "ssd") -> SsdTier:
        tier = SsdTier(capacity_bytes, str(tmp_path / name))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def store_node(make_dram, make_ssd) -> Iterator[tuple[object, str]]:
    """A real store service on 127.0.0.1 (port 0) over a DRAM (64 MiB) + SSD (256 MiB) pool,
    with the Admin service (kvstore/admin) on the same port. Yields (pool, "127.0.0.1:port")."""
    from kvstore.admin.service import NodeControl, admin_service
    from kvstore.pool.pool import KVPool
    from kvstore.service import serve_store

    pool = KVPool([make_dram(64 << 20), make_ssd(256 << 20)])
    server, port = serve_store(pool, extra_services=(admin_service(pool, NodeControl(pool.node_id)),))
    yield pool, f"127.0.0.1:{port}"
    server.stop(grace=None).wait()


@pytest.fixture(scope="module")
def same_host_store() -> Iterator[tuple[object, str]]:
    """A store node in this process, shared by a module's tests (so a test can reach its slab
    while engines in other processes use it): a 256 MiB DRAM tier, the same-host data plane
    on a Unix socket. Yields (pool, "127.0.0.1:port")."""
    import os
    import tempfile
    import uuid

    from kvstore.node import StoreNode
    from kvstore.pool.pool import KVPool, PoolSettings
    from kvstore.tiers.dram import DramTier

    tier = DramTier(256 << 20)
    pool = KVPool([tier], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    path = os.path.join(tempfile.gettempdir(), f"kvstore-test-{uuid.uuid4().hex[:8]}.sock")
    node = StoreNode.serve(pool, dataplane_socket=path)
    yield pool, node.address
    node.stop(grace_s=None)
    tier.close()


# -- same-host data plane: store nodes with their Unix control socket ---------------------------
@pytest.fixture
def slab_node(make_dram, make_ssd):
    """Yields a factory: ``start(dram_bytes, ssd_bytes=0, socket=True, token=None, **settings)``
    → (pool, address, socket path or ""); everything is stopped after the test."""
    from kvstore.node import StoreNode
    from kvstore.pool.pool import KVPool, PoolSettings
    from tests.helpers.dataplane_helpers import socket_path

    started: list[StoreNode] = []

    def start(dram_bytes: int = 16 << 20, ssd_bytes: int = 0, socket: bool = True, token: str | None = None,
              **settings):
        tiers = [make_dram(dram_bytes)] + ([make_ssd(ssd_bytes)] if ssd_bytes else [])
        pool = KVPool(tiers, settings=PoolSettings(high_watermark=1.0, low_watermark=1.0, **settings))
        path = socket_path() if socket else ""
        served = StoreNode.serve(pool, auth_token=token, dataplane_socket=path or None)
        started.append(served)
        nodes[id(pool)] = served
        return pool, served.address, path

    nodes: dict[int, StoreNode] = {}
    start.nodes = nodes  # type: ignore[attr-defined]  # id(pool) -> its StoreNode
    yield start
    for served in started:
        served.stop(grace_s=None)


@pytest.fixture
def client_of():
    """Factory of StoreClients (``make(address, **kw)``, ready, 30 s timeout), closed after
    the test."""
    from kvstore.client import StoreClient

    made: list[StoreClient] = []

    def make(address: str, **kw) -> StoreClient:
        c = StoreClient(address, timeout_s=30, **kw)
        c.wait_ready(10)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# -- KV events: a private Redis ---------------------------------------------------------------
@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A private ``redis-server`` on a free 127.0.0.1 port (no persistence), killed at the end
    of the session. Yields its URL. Skips when no redis-server binary is installed."""
    import shutil

    from kvstore.cluster.redis_server import start_private_redis, stop_private_redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    proc, url = start_private_redis()
    try:
        yield url
    finally:
        stop_private_redis(proc)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The private Redis, emptied before the test."""
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


# -- cluster and transfer: store node processes -----------------------------------------------
@pytest.fixture
def spawn_store_node(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Factory of real store node processes (``python -m launcher serve``) on 127.0.0.1.
    ``spawn(node_id, *flags)`` returns (Popen, "127.0.0.1:port") once the node answers;
    every process still running is terminated (then killed) after the test."""
    import subprocess
    import sys

    import grpc

    from launcher.supervisor import free_port

    procs: list[subprocess.Popen] = []

    def spawn(node_id: str, *flags: str, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
        port = free_port()
        log = open(tmp_path / f"{node_id}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve",
                                 "--node-id", node_id, "--host", "127.0.0.1", "--port", str(port),
                                 "--data-dir", str(tmp_path / "data"), *flags],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(proc)
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                proc.kill()
                raise RuntimeError(f"store node {node_id} not ready: "
                                   f"{(tmp_path / f'{node_id}.log').read_text(errors='replace')[-2000:]}") from None
        return proc, address

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    """Drop this process's Mooncake transfer engines before pytest prints its summary: each
    logs as it unregisters, and those lines should not follow the summary."""
    import sys
    if "kvstore.transfer.engine" in sys.modules:
        sys.modules["kvstore.transfer.engine"].shutdown_engines()


# -- fuzz targets (tests/test_fuzz_*.py): executions per wire ----------------------------------
def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """Print each fuzz target's executions per second (tests/helpers/fuzzing.py) after the run."""
    import sys
    fuzzing = sys.modules.get("tests.helpers.fuzzing")
    lines = fuzzing.summary_lines() if fuzzing is not None else []
    if lines:
        terminalreporter.section("fuzz: executions per wire")
        for line in lines:
            terminalreporter.write_line(line)


# -- parallel runs (make test: pytest-xdist, two workers) ------------------------------------
# Work goes to the workers a module at a time, so that a module-scoped fixture (a store node,
# a set of vLLM servers) starts once, not once per worker that happens to get one of its tests.
# The tests that start vLLM pin its instances to the machine's cores (one per core): two such
# tests at once would oversubscribe them and run slower than one after the other, so every
# module that starts vLLM is one unit, run by one worker in turn while the other worker runs
# the rest. (xdist's own ``xdist_group`` marks cannot do this under pytest 9.2, whose node ids
# xdist 3.8 no longer rewrites: the groups are decided here, on the node ids themselves.)
_STARTS_VLLM = ("tests.helpers.vllm_driver", "tests.helpers.vllm_engine", "engines.vllm.launch", "launcher.vllm_setups")
_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _starts_vllm(module: str) -> bool:
    """Whether the test module at ``module`` (a path from the root) starts vLLM."""
    path = _ROOT / module
    return path.suffix == ".py" and path.is_file() and any(name in path.read_text() for name in _STARTS_VLLM)


def _unit_of(nodeid: str) -> str:
    """The unit of work a test is scheduled in: ``vllm`` for every module that starts vLLM,
    else its module."""
    module = nodeid.split("::", 1)[0]
    return "vllm" if _starts_vllm(module) else module


def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndVLLM(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    return ModulesAndVLLM(config, log)
