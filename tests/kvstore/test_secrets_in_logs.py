"""Secrets stay out of logs: a Redis URL's password (``redis://:PASSWORD@host:port/db``, how
``kvstore up`` hands its private Redis to the children) is never written to a service's log.
A real password-protected ``redis-server`` and a real store node publishing its KV events
there; the node's log lines name the stream with the password as ``***``."""
from __future__ import annotations

import logging
import shutil

import pytest

from kvstore.auth import new_token
from kvstore.client import StoreClient
from kvstore.cluster.redis_server import start_private_redis, stop_private_redis
from kvstore.config import StoreConfig
from kvstore.events import IndexReplica, PublishingIndex, make_channel, store_snapshot_source
from kvstore.node import StoreNode

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_a_redis_password_is_never_logged(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    password = new_token()
    proc, url = start_private_redis(password=password)
    node = None
    try:
        cfg = StoreConfig(node_id="p1", port=0, dram_bytes=1 << 20, ssd_bytes=0, data_dir=str(tmp_path),
                          redis_url=url, transfer_engine="off")
        node = StoreNode.start(cfg)
        index = node.pool.index
        assert isinstance(index, PublishingIndex)    # a node's index publishes its KV events
        channel = make_channel(url)
        replica = IndexReplica(channel, store_snapshot_source({"p1": node.address})).start()
        try:
            with StoreClient(node.address) as client:
                client.put(b"s" * 32, b"v" * 100)
            assert replica.wait_for("p1", index.seq) and replica.hits([b"s" * 32]) == {"p1": 1}
        finally:
            replica.stop()
        assert password not in channel.description and ":***@127.0.0.1" in channel.description
        events_lines = [r.getMessage() for r in caplog.records if "Redis stream" in r.getMessage()]
        assert events_lines, caplog.text             # the node did log where its events go
        assert password not in caplog.text and all(":***@" in line for line in events_lines)
    finally:
        if node is not None:
            node.stop(grace_s=0)
        stop_private_redis(proc)


def test_the_vllm_connector_names_its_cluster_without_the_redis_password() -> None:
    """The connector's log lines name its pool (``PoolLink.target``: at start, and in every
    lookup, load or save failure); in cluster mode that is the Redis URL, shown with the
    password as ``***``."""
    from engines.vllm.pool_link import ConnectorConfig, PoolLink
    password = new_token()
    for url in (f"redis://:{password}@127.0.0.1:6390/0", f"unix://:{password}@/run/kvstore/redis-1.sock?db=0"):
        target = PoolLink(ConnectorConfig(redis=url)).target
        assert password not in target and ":***@" in target, target
