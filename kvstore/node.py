"""A store node: builds the tiers and the pool from a :class:`StoreConfig` and serves them."""
from __future__ import annotations

import logging
import os

import grpc

from kvstore.config import StoreConfig
from kvstore.events import PublishingIndex, make_channel
from kvstore.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS

log = logging.getLogger(__name__)


def build_pool(cfg: StoreConfig) -> KVPool:
    """HBM (if ``hbm_bytes`` > 0, on ``hbm_device``) over DRAM (if ``dram_bytes`` > 0) over
    SSD (if ``ssd_bytes`` > 0, LMDB under ``data_dir/<node_id>/ssd``)."""
    tiers = []
    if cfg.hbm_bytes > 0:
        tiers.append(TIERS["hbm"](cfg.hbm_bytes, device=cfg.hbm_device))
    if cfg.dram_bytes > 0:
        tiers.append(TIERS["dram"](cfg.dram_bytes))
    if cfg.ssd_bytes > 0:
        tiers.append(TIERS["ssd"](cfg.ssd_bytes, path=os.path.join(cfg.data_dir, cfg.node_id, "ssd"),
                                  fsync=cfg.ssd_fsync))
    # The index publishes KV events (to Redis at cfg.redis_url, else in-process).
    index = PublishingIndex(cfg.node_id, make_channel(cfg.redis_url))
    return KVPool(tiers, node_id=cfg.node_id, index=index, settings=cfg.pool_settings())


def start_node(cfg: StoreConfig) -> tuple[grpc.Server, int, KVPool]:
    pool = build_pool(cfg)
    server, port = serve_store(pool, f"{cfg.host}:{cfg.port}", auth_token=cfg.auth_token)
    return server, port, pool


def stop_node(server: grpc.Server, pool: KVPool, grace_s: float = 2.0) -> None:
    """Stop serving, announce ``NodeCleared`` to index replicas, close the pool."""
    server.stop(grace=grace_s).wait()
    if isinstance(pool.index, PublishingIndex):
        pool.index.close()
    pool.close()
