"""A store node: builds the tiers and the pool from a :class:`StoreConfig` and serves them."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from kvstore.config import StoreConfig
from kvstore.events import PublishingIndex, make_channel
from kvstore.pool import KVPool
from kvstore.service import close_dataplane, serve_store
from kvstore.tiers.registry import build_tiers

if TYPE_CHECKING:
    from kvstore.cluster.agent import ClusterAgent
    from kvstore.metrics_http import MetricsServer

log = logging.getLogger(__name__)


def build_pool(cfg: StoreConfig) -> KVPool:
    """The tiers of ``cfg.tier_list()`` (fastest first, built by kvstore/tiers/registry.py:
    HBM on ``hbm_device``, DRAM pre-faulted in the background with ``dram_prefault``, SSD
    as LMDB under ``data_dir/<node_id>/ssd``). An SSD directory that cannot be used raises
    OSError (one line), or with ``ssd_on_error = "disable"`` leaves the node without its SSD
    tier (logged); a damaged one is moved aside by the tier itself (kvstore/tiers/ssd.py)."""
    tiers = build_tiers(cfg)
    # The index publishes KV events (to Redis at cfg.redis_url, else in-process).
    index = PublishingIndex(cfg.node_id, make_channel(cfg.redis_url))
    return KVPool(tiers, node_id=cfg.node_id, index=index, settings=cfg.pool_settings())


_AGENTS: dict[int, "ClusterAgent"] = {}   # id(server) -> the node's cluster presence
_METRICS: dict[int, MetricsServer] = {}   # id(server) -> the node's metrics port (cfg.metrics_port)


def start_node(cfg: StoreConfig) -> tuple[grpc.Server, int, KVPool]:
    """Build the pool, serve it (with the transfer-engine ``BlockTransfer`` service and the
    Admin service, kvstore/admin) and register the node in the cluster (Redis at
    ``cfg.redis_url``, else embedded). With ``cfg.metrics_port`` set, also serve Prometheus
    metrics there (:func:`metrics_url`). Raises OSError / RuntimeError when a port cannot be
    bound, InvalidArgument when the node's quota file cannot be read."""
    from kvstore.admin.service import admin_service, attach_tenants, node_control
    from kvstore.cluster.agent import ClusterAgent
    pool = build_pool(cfg)
    try:
        attach_tenants(cfg, pool)   # per-tenant books and quotas, before anything reads the pool
    except BaseException:
        pool.close()
        raise
    agent: ClusterAgent | None = None
    metrics = None
    if cfg.metrics_port is not None:
        from kvstore.metrics import serve_metrics
        try:
            metrics = serve_metrics(cfg, pool)
        except BaseException:
            pool.close()
            raise
    try:
        agent = ClusterAgent(cfg, pool)
        if metrics is not None and agent.control is not None:
            metrics[0].watch_dataplane(agent.control.host, "remote")
        admin = admin_service(pool, node_control(cfg, pool, agent))
        server, port = serve_store(pool, f"{cfg.host}:{cfg.port}", auth_token=cfg.auth_token,
                                   extra_services=(*agent.services(), admin),
                                   dataplane_socket=cfg.dataplane_socket_path(),
                                   dataplane_poll_s=cfg.dataplane_poll_us * 1e-6,
                                   metrics=metrics[0] if metrics else None)
    except BaseException:
        if agent is not None:
            agent.stop()
        if metrics is not None:
            metrics[1].close()
        pool.close()  # nothing may outlive a node that did not start (its shared-memory slab)
        raise
    agent.start(port)
    _AGENTS[id(server)] = agent
    if metrics is not None:
        _METRICS[id(server)] = metrics[1]
    return server, port, pool


def metrics_url(server: grpc.Server) -> str | None:
    """``http://host:port/metrics`` of a node :func:`start_node` started with a metrics port;
    None without one."""
    metrics = _METRICS.get(id(server))
    return metrics.url if metrics is not None else None


def stop_node(server: grpc.Server, pool: KVPool, grace_s: float = 2.0) -> None:
    """Leave the cluster, stop serving, announce ``NodeCleared`` to index replicas, close
    the pool."""
    agent = _AGENTS.pop(id(server), None)
    if agent is not None:
        agent.leave()   # withdrawn from lookups before the port closes
    metrics = _METRICS.pop(id(server), None)
    if metrics is not None:
        metrics.close()
    server.stop(grace=grace_s).wait()
    close_dataplane(server)
    if agent is not None:
        agent.stop()
    if isinstance(pool.index, PublishingIndex):
        pool.index.close()
    pool.close()
