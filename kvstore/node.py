"""A store node: builds the tiers and the pool from a :class:`StoreConfig` and serves them."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import grpc

from kvstore.config import StoreConfig
from kvstore.events import PublishingIndex, make_channel
from kvstore.pool import KVPool
from kvstore.service import close_dataplane, serve_store
from kvstore.tiers import TIERS

if TYPE_CHECKING:
    from kvstore.cluster.agent import ClusterAgent

log = logging.getLogger(__name__)


def build_pool(cfg: StoreConfig) -> KVPool:
    """HBM (if ``hbm_bytes`` > 0, on ``hbm_device``) over DRAM (if ``dram_bytes`` > 0,
    pre-faulted in the background with ``dram_prefault``) over SSD (if ``ssd_bytes`` > 0,
    LMDB under ``data_dir/<node_id>/ssd``). An SSD directory that cannot be used raises
    OSError (one line), or with ``ssd_on_error = "disable"`` leaves the node without its SSD
    tier (logged); a damaged one is moved aside by the tier itself (kvstore/tiers/ssd.py)."""
    tiers = []
    if cfg.hbm_bytes > 0:
        tiers.append(TIERS["hbm"](cfg.hbm_bytes, device=cfg.hbm_device))
    if cfg.dram_bytes > 0:
        tiers.append(TIERS["dram"](cfg.dram_bytes, prefault=cfg.dram_prefault))
    if cfg.ssd_bytes > 0:
        try:
            tiers.append(TIERS["ssd"](cfg.ssd_bytes, path=os.path.join(cfg.data_dir, cfg.node_id, "ssd"),
                                      fsync=cfg.ssd_fsync))
        except OSError as exc:
            if cfg.ssd_on_error != "disable" or not tiers:
                for tier in tiers:
                    tier.close()
                raise
            log.error("%s; serving without an SSD tier (--ssd-on-error disable)", exc)
    # The index publishes KV events (to Redis at cfg.redis_url, else in-process).
    index = PublishingIndex(cfg.node_id, make_channel(cfg.redis_url))
    return KVPool(tiers, node_id=cfg.node_id, index=index, settings=cfg.pool_settings())


_AGENTS: dict[int, "ClusterAgent"] = {}   # id(server) -> the node's cluster presence


def start_node(cfg: StoreConfig) -> tuple[grpc.Server, int, KVPool]:
    """Build the pool, serve it (with the transfer-engine ``BlockTransfer`` service) and
    register the node in the cluster (Redis at ``cfg.redis_url``, else embedded)."""
    from kvstore.cluster.agent import ClusterAgent
    pool = build_pool(cfg)
    agent: ClusterAgent | None = None
    try:
        agent = ClusterAgent(cfg, pool)
        server, port = serve_store(pool, f"{cfg.host}:{cfg.port}", auth_token=cfg.auth_token,
                                   extra_services=agent.services(),
                                   dataplane_socket=cfg.dataplane_socket_path(),
                                   dataplane_poll_s=cfg.dataplane_poll_us * 1e-6)
    except BaseException:
        if agent is not None:
            agent.stop()
        pool.close()  # nothing may outlive a node that did not start (its shared-memory slab)
        raise
    agent.start(port)
    _AGENTS[id(server)] = agent
    return server, port, pool


def stop_node(server: grpc.Server, pool: KVPool, grace_s: float = 2.0) -> None:
    """Leave the cluster, stop serving, announce ``NodeCleared`` to index replicas, close
    the pool."""
    agent = _AGENTS.pop(id(server), None)
    if agent is not None:
        agent.leave()   # withdrawn from lookups before the port closes
    server.stop(grace=grace_s).wait()
    close_dataplane(server)
    if agent is not None:
        agent.stop()
    if isinstance(pool.index, PublishingIndex):
        pool.index.close()
    pool.close()
