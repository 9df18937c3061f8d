"""The connector's figures and KV events without a vLLM engine (engines/vllm/connector_metrics.py,
connector_events.py, pool_link.py): vLLM's own classes, a real Prometheus registry, a real
msgpack round trip, a pool link to a port where nothing listens. The engine-level checks are in
test_vllm_connector_metrics.py and tests/scheduler/vllm/test_vllm_kv_events.py."""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm")

from engines.vllm.connector_events import MEDIUM_OF_TIER, OWNERSHIP, KVStoreKVEvents, PoolEventBook, lost, saved  # noqa: E402
from engines.vllm.connector_metrics import KVStoreConnectorStats, KVStorePromMetrics, StatsRecorder, hit_sources  # noqa: E402
from scheduler.vllm.pool_events import OWNERSHIP as BRIDGE_OWNERSHIP  # noqa: E402
from scheduler.vllm.pool_events import POOL_TIER_OF_MEDIUM  # noqa: E402

BS = 4
KEYS = [bytes([i]) * 32 for i in range(1, 7)]
TOKENS = list(range(100, 124))    # 6 blocks of 4


def test_hit_sources_name_vllms_sources_and_sum_to_the_tokens() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as S
    assert hit_sources(["dram", "dram", "ssd"], BS, 12) == {S.HOST: 8, S.DISK: 4}
    assert hit_sources(["hbm", "odd"], BS, 10) == {S.P2P: 4, S.EXTERNAL_UNSPECIFIED: 6}
    assert hit_sources([], BS, 0) == {}


def test_stats_add_up_across_ranks_and_survive_the_trip_to_the_api_server() -> None:
    import msgspec
    a, b = StatsRecorder(), StatsRecorder()
    assert a.take() is None                         # nothing happened: vLLM gets None
    a.lookup()
    a.hits(["dram", "dram", "ssd"], BS)
    a.load(0.002, 3, 3 * 1024)
    b.load(0.004, 1, 1024, errors=2, cause="miss")
    b.save(0.001, 2, 2048)
    b.unavailable(0.5)
    one, two = a.take(), b.take()
    assert one is not None and two is not None and a.take() is None   # taking empties the interval
    shipped = msgspec.msgpack.decode(msgspec.msgpack.encode(two.data))   # vLLM ships data as msgpack
    total = one.aggregate(KVStoreConnectorStats(data=shipped))
    d = total.data
    assert d["hit_blocks"] == {"dram": 2, "ssd": 1} and d["hit_tokens"] == {"dram": 8, "ssd": 4}
    assert d["load_bytes"] == 4096 and d["loaded_blocks"] == 4 and d["load_errors"] == {"miss": 2}
    assert d["save_bytes"] == 2048 and d["pool_unavailable_s"] == 0.5 and d["lookups"] == 1
    line = total.reduce()
    assert line["hit_blocks_dram"] == 2 and line["load_errors_miss"] == 2 and line["load_ms_avg"] == 3.0
    assert KVStoreConnectorStats().is_empty() and not total.is_empty()


def test_prometheus_metrics_carry_the_figures_by_tier_and_cause() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Gauge, Counter, Histogram)}
    prom = KVStorePromMetrics(_Config(), types, ["model_name", "engine"], {0: ["tiny", "0"]})
    rec = StatsRecorder()
    rec.hits(["dram"] * 3, BS)
    rec.load(0.01, 3, 3000, errors=1, cause="identity_mismatch")
    rec.unavailable(1.5)
    rec.dropped(5)
    prom.observe(rec.take().data, 0)
    prom.observe({"hit_blocks": {"dram": 1}}, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvstore_hit_blocks_total", {**labels, "tier": "dram"}) == 4
    assert registry.get_sample_value("vllm:kvstore_hit_tokens_total", {**labels, "tier": "dram"}) == 12
    assert registry.get_sample_value("vllm:kvstore_load_bytes_total", labels) == 3000
    assert registry.get_sample_value("vllm:kvstore_load_errors_total", {**labels, "cause": "identity_mismatch"}) == 1
    assert registry.get_sample_value("vllm:kvstore_pool_unavailable_seconds_total", labels) == 1.5
    assert registry.get_sample_value("vllm:kvstore_saves_dropped_blocks_total", labels) == 5
    assert registry.get_sample_value("vllm:kvstore_load_seconds_count", labels) == 1


class _Config:
    kv_transfer_config = None


def test_a_save_is_published_once_every_rank_reported_it_and_a_loss_when_any_did() -> None:
    book = PoolEventBook(BS, put_tier="dram")
    book.saving(KEYS[:2], 0, TOKENS, None, "alice", None)
    rank0, rank1 = KVStoreKVEvents(), KVStoreKVEvents()
    rank0.add_events([saved(KEYS[:2], BS)])
    rank0.add_events([lost(KEYS[5:6])])
    rank0.increment_workers(1)       # vLLM's aggregation of two ranks, one of which reported
    book.reported(rank0)
    assert book.take() == []         # the loss is of a block never announced; the save waits for rank 1
    rank1.add_events([saved(KEYS[:2], BS)])
    book.reported(rank1)
    (ev,) = book.take()
    assert ev.block_hashes == KEYS[:2] and ev.token_ids == TOKENS[:8] and ev.parent_block_hash is None
    assert ev.medium == "CPU" and ev.ownership == OWNERSHIP and ev.extra_keys == [("alice",), None]
    assert book.take() == []
    gone = KVStoreKVEvents()
    gone.add_events([lost(KEYS[1:2])])
    book.reported(gone)
    (rm,) = book.take()
    assert rm.block_hashes == KEYS[1:2] and rm.medium == "CPU"


def test_a_save_one_rank_never_reports_is_dropped() -> None:
    events = KVStoreKVEvents(num_workers=2)
    events.add_events([saved(KEYS[:1], BS)])
    for _ in range(80):
        assert events.pop_common_events() == []
    assert not events.has_events()


def test_lookups_announce_what_the_pool_holds_once_and_its_losses() -> None:
    book = PoolEventBook(BS)
    book.looked_up(KEYS[:4], ("dram", "dram", "ssd"), TOKENS, "t", None)
    stored = book.take()
    assert [(e.block_hashes, e.medium, e.parent_block_hash) for e in stored] == [
        (KEYS[:2], "CPU", None), (KEYS[2:3], "STORAGE", KEYS[1])]
    assert stored[1].token_ids == TOKENS[8:12] and stored[1].extra_keys is None
    book.looked_up(KEYS[:4], ("dram", "dram", "ssd"), TOKENS, "t", None)
    assert book.take() == []                          # told once
    book.looked_up(KEYS[:4], ("dram",), TOKENS, "t", None)
    (rm,) = book.take()                               # block 1 is gone; a lookup says nothing past it
    assert rm.block_hashes == KEYS[1:2] and rm.medium == "CPU"
    book.reset()
    book.looked_up(KEYS[:1], ("dram",), TOKENS, "t", None)
    assert [e.block_hashes for e in book.take()] == [KEYS[:1]]   # after a reset, announced anew


def test_the_router_reads_the_connectors_names() -> None:
    assert BRIDGE_OWNERSHIP == OWNERSHIP
    assert POOL_TIER_OF_MEDIUM == {m: t for t, m in MEDIUM_OF_TIER.items()}


def test_a_pool_that_cannot_be_reached_is_a_load_error_of_its_own_cause_and_down_time() -> None:
    import numpy as np

    from engines.vllm.pool_link import ConnectorConfig, PoolLink
    from kvstore.tiers.buffers import Segments
    from launcher.supervisor import free_port
    link = PoolLink(ConnectorConfig(store=f"127.0.0.1:{free_port()}", timeout_s=0.5))
    try:
        assert link.lookup(KEYS[:2]) == (0, ()) and link.last_tiers == ()
        out = Segments([np.zeros(64, dtype=np.uint8)])
        assert link.load(KEYS[:1], [out]) == 0 and link.last_load_error == "pool_unavailable"
        first = link.take_unavailable_s()
        assert first > 0
        assert link.take_unavailable_s() > 0          # still down: its seconds keep counting
    finally:
        link.close()


def test_the_worker_side_attaches_the_slab_at_start_and_the_scheduler_side_builds_no_page_tables(
        slab_node) -> None:
    """The worker side's link maps a same-host node's slab and builds its page tables when
    vLLM registers its KV caches (``attach``), not on the first request; the scheduler side's
    link, which only looks blocks up, builds none."""
    from engines.vllm.pool_link import ConnectorConfig, PoolLink
    _, address, _ = slab_node(dram_bytes=64 << 20)
    worker, scheduler = PoolLink(ConnectorConfig(store=address)), PoolLink(ConnectorConfig(store=address),
                                                                          moves_bytes=False)
    try:
        worker.attach()
        plane = worker._client._plane
        assert plane is not None and plane._prefault.done.is_set()
        assert scheduler.lookup(KEYS[:2]) == (0, ())
        assert scheduler._client._plane is not None and scheduler._client._plane._prefault is None
    finally:
        worker.close()
        scheduler.close()


def test_over_a_cluster_the_worker_side_attaches_each_same_host_slab_at_start(redis_url, spawn_store_node,
                                                                             caplog) -> None:
    """With ``kvstore.redis``, the worker side's link attaches every live node's slab at start
    and builds its page tables; the scheduler side's builds none for the nodes it asks."""
    import logging

    from engines.vllm.pool_link import ConnectorConfig, PoolLink
    from kvstore.cluster.client import ClusterClient
    for i in range(2):
        spawn_store_node(f"attach-n{i}", "--dram", "8MiB", "--ssd", "0", "--redis", redis_url,
                         "--transfer-engine", "off")
    with ClusterClient(redis_url) as probe:
        probe.wait_for_nodes(2, timeout_s=30)
    worker, scheduler = PoolLink(ConnectorConfig(redis=redis_url)), PoolLink(ConnectorConfig(redis=redis_url),
                                                                             moves_bytes=False)
    try:
        with caplog.at_level(logging.INFO, logger="engines.vllm.pool_link"):
            worker.attach()
        planes = [c._plane for c in worker._client._clients.values()]
        assert len(planes) == 2 and all(p is not None and p._prefault.done.is_set() for p in planes)
        built = [r.getMessage() for r in caplog.records if "page tables built" in r.getMessage()]
        assert sorted(m.split("'")[0] for m in built) == [f"kvstore connector: attach-n{i}" for i in range(2)]
        assert scheduler.lookup(KEYS[:2]) == (0, ())
        asked = [c._plane for c in scheduler._client._clients.values()]
        assert len(asked) == 2 and all(p is not None and p._prefault is None for p in asked)
    finally:
        worker.close()
        scheduler.close()


def test_the_connectors_log_lines_go_through_vllms_handlers_only_where_nothing_else_configured_logging() -> None:
    """In a process where only vLLM's logger has a handler, the connector's INFO lines reach
    it (once); where the application configured logging, they are left to it."""
    import subprocess
    import sys
    script = """
import logging, sys
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("VLLM %(name)s %(message)s"))
logging.getLogger("vllm").addHandler(handler)
logging.getLogger("vllm").setLevel(logging.INFO)
if sys.argv[1] == "app":
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(name)s %(message)s")
from engines.vllm.log_setup import log_through_vllm
log_through_vllm()
log_through_vllm()
logging.getLogger("kvstore.client").info("attached")
logging.getLogger("engines.vllm.pool_link").debug("not shown")
"""
    def ours(where: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", script, where], capture_output=True, text=True, timeout=120)
        return [line for line in done.stdout.splitlines() if " vllm." not in line]   # vLLM's own lines
    assert ours("vllm") == ["VLLM kvstore.client attached"]
    assert ours("app") == ["APP kvstore.client attached"]


def test_a_tenant_over_its_quota_is_logged_once_a_minute_with_the_blocks_refused(caplog, monkeypatch) -> None:
    import logging

    from engines.vllm import pool_link
    from engines.vllm.pool_link import ConnectorConfig, PoolLink
    from kvstore.errors import QuotaExceeded
    link = PoolLink(ConnectorConfig(store="127.0.0.1:1"))
    clock = [1000.0]
    monkeypatch.setattr(pool_link.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="engines.vllm.pool_link"):
        for blocks in (3, 4, 5):                       # the first is logged, the next two held back
            link._quota_refused("tenant-a", blocks, QuotaExceeded("over"))
        link._quota_refused("tenant-b", 2, QuotaExceeded("over"))   # another tenant: its own line
        clock[0] += 61
        link._quota_refused("tenant-a", 1, QuotaExceeded("over"))   # a minute on: 4 + 5 + 1 refused since
    lines = [r.getMessage() for r in caplog.records if "over its pool quota" in r.getMessage()]
    assert len(lines) == 3
    assert "'tenant-a' over its pool quota, 3 blocks" in lines[0] and "'tenant-b'" in lines[1]
    assert "'tenant-a' over its pool quota, 10 blocks" in lines[2]
