"""A store node: builds the tiers and the pool from a :class:`StoreConfig` and serves them
(:class:`StoreNode`)."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import grpc

from kvstore.auth import STORE_TOKEN_ENV
from kvstore.config import StoreConfig
from kvstore.dataplane.control_server import NODE_POLL_S, UdsServer
from kvstore.dataplane.host import DataPlaneHost
from kvstore.events import PublishingIndex, make_channel
from kvstore.pool.pool import KVPool
from kvstore.service import grpc_server
from kvstore.tiers.registry import build_tiers

if TYPE_CHECKING:
    from kvstore.cluster.agent import ClusterAgent
    from kvstore.metrics import StoreMetrics
    from kvstore.metrics_http import MetricsServer

log = logging.getLogger(__name__)
# Hosts that bind every interface: a client on this host reaches such a node on loopback.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def build_pool(cfg: StoreConfig) -> KVPool:
    """The tiers of ``cfg.tier_list()`` (fastest first, built by kvstore/tiers/registry.py:
    HBM on ``hbm_device``, DRAM pre-faulted in the background with ``dram_prefault``, SSD
    as LMDB under ``data_dir/<node_id>/ssd``). An SSD directory that cannot be used raises
    OSError (one line), or with ``ssd_on_error = "disable"`` leaves the node without its SSD
    tier (logged); a damaged one is moved aside by the tier itself (kvstore/tiers/ssd.py)."""
    tiers = build_tiers(cfg)
    # The index publishes KV events (to Redis at cfg.redis_url, else in-process) once the
    # node holds its id in the membership registry (kvstore/cluster/agent.py).
    index = PublishingIndex(cfg.node_id, make_channel(cfg.redis_url, token=cfg.auth_token), speaking=False)
    return KVPool(tiers, node_id=cfg.node_id, index=index, settings=cfg.pool_settings())


class StoreNode:
    """One serving store node and everything it owns: the ``pool``, the gRPC ``server`` on
    ``port``, the same-host data plane (``dataplane``) and its Unix control socket
    (``control``), and, once started from a config, the cluster presence (``agent``: the
    transfer engine, its TCP control channel, the membership heartbeat) and the Prometheus
    metrics port (``metrics_server``, with ``cfg.metrics_port``). :meth:`stop` ends
    them in the order that keeps clients safe; a node that fails to start leaves nothing
    running (not even the pool's shared-memory slab, when it owns the pool).

    Build one with :meth:`start` (from a :class:`StoreConfig`, as ``kvstore serve`` does) or
    :meth:`serve` (a pool the caller built; tests, embedded nodes).
    """

    def __init__(self, pool: KVPool, server: grpc.Server, port: int, dataplane: DataPlaneHost | None = None,
                 control: UdsServer | None = None, agent: ClusterAgent | None = None,
                 owns_pool: bool = False, metrics_server: MetricsServer | None = None) -> None:
        self.pool, self.server, self.port = pool, server, port
        self.dataplane, self.control, self.agent = dataplane, control, agent
        self.owns_pool = owns_pool
        self.metrics_server = metrics_server
        self.host = "127.0.0.1"   # where clients reach it: the bound or advertised host (see address)
        self._stopped = False

    @classmethod
    def serve(cls, pool: KVPool, address: str = "127.0.0.1:0", auth_token: str | None = None, workers: int = 8,
              extra_services: tuple = (), dataplane_socket: str | None = None,
              dataplane_poll_s: float = NODE_POLL_S, owns_pool: bool = False,
              metrics: StoreMetrics | None = None) -> StoreNode:
        """Serve ``pool`` on ``address`` (host:port; port 0 picks a free one, see
        :attr:`port`); ``dataplane_socket``: also serve the same-host control channel on
        this Unix socket path (its connections poll ``dataplane_poll_s`` seconds for the
        next request before sleeping). ``owns_pool``: :meth:`stop` closes the pool too.
        ``metrics``: a :class:`kvstore.metrics.StoreMetrics` timing Put, Get and the data
        plane's control ops. Raises RuntimeError when the port cannot be bound, OSError when
        the socket cannot."""
        dataplane = DataPlaneHost.for_pool(pool, dataplane_socket or "")
        server, port = grpc_server(pool, address, auth_token, workers, extra_services, dataplane, metrics)
        control = None
        if dataplane is not None and dataplane_socket:
            try:
                control = UdsServer(dataplane, dataplane_socket, auth_token, dataplane_poll_s)
            except BaseException:
                server.stop(grace=None).wait()
                raise
        node = cls(pool, server, port, dataplane, control, owns_pool=owns_pool)
        node.host = address.rpartition(":")[0].strip("[]") or "127.0.0.1"
        return node

    @classmethod
    def start(cls, cfg: StoreConfig) -> StoreNode:
        """Build the pool (:func:`build_pool`), serve it with the transfer-engine
        ``BlockTransfer`` service, the Admin service (kvstore/admin) and the same-host control
        socket, and register the node in the cluster (Redis at ``cfg.redis_url``, else
        embedded). With ``cfg.metrics_port`` set, also serve Prometheus metrics there
        (:attr:`metrics_url`). Raises OSError / RuntimeError when a port cannot be bound,
        InvalidArgument when the node's quota file cannot be read."""
        from kvstore.admin.service import admin_service, attach_tenants, node_control
        from kvstore.cluster.agent import ClusterAgent
        node_dir = os.path.join(cfg.data_dir, cfg.node_id)
        try:   # the node's own files (quotas, the data-plane socket) live there, SSD tier or not
            os.makedirs(node_dir, exist_ok=True)
        except OSError as exc:
            raise OSError(f"the data directory {cfg.data_dir!r} cannot hold the node's files ({node_dir}: "
                          f"{exc.strerror or exc}); the node keeps its quotas and data-plane socket there "
                          f"even without an SSD tier: give --data-dir a directory it can write") from None
        pool = build_pool(cfg)
        try:
            attach_tenants(cfg, pool)   # per-tenant books and quotas, before anything reads the pool
        except BaseException:
            pool.close()
            raise
        agent: ClusterAgent | None = None
        metrics: tuple[StoreMetrics, MetricsServer] | None = None
        try:
            if cfg.metrics_port is not None:
                from kvstore.metrics import serve_metrics
                metrics = serve_metrics(cfg, pool)
            agent = ClusterAgent(cfg, pool)
            if metrics is not None and agent.control is not None:
                metrics[0].watch_dataplane(agent.control.host, "remote")
            admin = admin_service(pool, node_control(cfg, pool, agent))
            node = cls.serve(pool, f"{cfg.host}:{cfg.port}", auth_token=cfg.auth_token,
                             extra_services=(*agent.services(), admin), dataplane_socket=cfg.dataplane_socket_path(),
                             dataplane_poll_s=cfg.dataplane_poll_us * 1e-6, owns_pool=True,
                             metrics=metrics[0] if metrics else None)
        except BaseException:
            if agent is not None:
                agent.stop()
            if metrics is not None:
                metrics[1].close()
            pool.close()  # nothing may outlive a node that did not start (its shared-memory slab)
            raise
        agent.start(node.port)
        node.agent = agent
        node.host = cfg.advertise_host or cfg.host
        node.metrics_server = metrics[1] if metrics else None
        if not cfg.auth_token:   # as an engine without its token warns (engines/server.py)
            log.warning("store node %s takes calls without a token: any caller that reaches port %d can read, "
                        "list and remove every tenant's blocks and set quotas (give --auth-token or %s)",
                        cfg.node_id, node.port, STORE_TOKEN_ENV)
        return node

    @property
    def address(self) -> str:
        """``host:port`` where a client reaches the node: the advertised host, else the one it
        binds (``127.0.0.1`` for a node bound to every interface, 0.0.0.0 or ::)."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` when the node serves metrics; None without."""
        return self.metrics_server.url if self.metrics_server is not None else None

    def stop(self, grace_s: float | None = 2.0) -> None:
        """Leave the cluster (withdrawn from lookups before the port closes), stop serving,
        close the control socket (its clients' leases and reservations end), stop the
        agent, and, when it owns the pool, announce ``NodeCleared`` to index replicas and
        close the pool. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.agent is not None:
            self.agent.leave()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.server.stop(grace=grace_s).wait()
        if self.control is not None:
            self.control.close()
        if self.agent is not None:
            self.agent.stop()
        if self.owns_pool:
            if isinstance(self.pool.index, PublishingIndex):
                self.pool.index.close()
            self.pool.close()

    def __enter__(self) -> StoreNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
