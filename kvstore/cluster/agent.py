"""A store node's cluster presence: its transfer engine (DRAM slab registered), the compact
TCP control channel its transfer-engine readers lease blocks on, and its membership
heartbeat. Built before the gRPC server starts (the ``BlockTransfer`` service goes on that
server), started once the port is known, stopped before the pool closes."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from kvstore.cluster.heartbeat import Heartbeat
from kvstore.cluster.membership import NodeInfo, registry_for
from kvstore.config import StoreConfig
from kvstore.dataplane.control_server import TcpControlServer
from kvstore.dataplane.host import DataPlaneHost
from kvstore.events.publisher import PublishingIndex
from kvstore.pool.pool import KVPool
from kvstore.tiers import registry as tier_registry
from kvstore.tiers.dram import DramTier
from kvstore.transfer.engine import NodeTransferEngine, TransferEngineUnavailable
from kvstore.transfer.service import transfer_service
from kvstore.transfer.staging import StagedReads

log = logging.getLogger(__name__)


class ClusterAgent:
    """``te_error`` says why the node runs no transfer engine (None when it runs one, or it
    was turned off); readers then use the gRPC stream."""

    def __init__(self, cfg: StoreConfig, pool: KVPool) -> None:
        self.cfg, self.pool = cfg, pool
        self.host = cfg.advertise_host or cfg.host
        self.epoch = time.time_ns()
        self.node_te: NodeTransferEngine | None = None
        self.te_error: str | None = None
        dram = next((t for t in pool.tiers if t.name == tier_registry.DRAM.name and isinstance(t, DramTier)),
                    None)  # the shared-memory slab
        protocol = cfg.transfer_protocol()
        if protocol and dram is not None:
            try:
                self.node_te = NodeTransferEngine(dram.shm_name, self.host, protocol, cfg.te_metadata,
                                                  cfg.te_staging_bytes)
                exposed = (f"the blocks being read (a {cfg.te_staging_bytes / 2**20:.0f} MiB staging area)"
                           if cfg.te_staging_bytes else "the whole DRAM slab (--te-staging 0)")
                log.warning("store node %s: the Mooncake transfer engine (%s) listens on every interface, "
                            "whatever --host says, and authenticates no one: a peer that reaches %s can read "
                            "and write what is registered with it, here %s. Run it on a private fabric only "
                            "(--transfer-engine off turns it off)", cfg.node_id, protocol, self.node_te.endpoint,
                            exposed)
            except TransferEngineUnavailable as exc:
                self.te_error = str(exc)
                log.warning("store node %s: no transfer engine (%s); readers use the gRPC stream",
                            cfg.node_id, exc)
        self.control: TcpControlServer | None = None
        if self.node_te is not None:
            try:
                plane = DataPlaneHost(pool)
                host: DataPlaneHost | StagedReads = plane
                if self.node_te.staging is not None:   # leases stage their blocks; the slab stays unregistered
                    host = StagedReads(plane, self.node_te.staging, cfg.lease_ttl_s)
                self.control = TcpControlServer(host, cfg.host, cfg.control_port, cfg.auth_token,  # type: ignore[arg-type]
                                                cfg.dataplane_poll_us * 1e-6)
            except OSError:
                self.node_te.close()
                raise
        self.registry = registry_for(cfg.redis_url, cfg.auth_token)
        self.heartbeat: Heartbeat | None = None
        self.port = 0
        self.draining = False   # set by the Admin service (kvctl drain); announced at each beat

    def services(self) -> tuple[Callable[[grpc.Server], None], ...]:
        return (transfer_service(self.pool, self.node_te, self.control.port if self.control else 0),)

    def info(self) -> NodeInfo:
        # Free up to the low watermark: placement that stops there never makes the node evict.
        lw = self.pool.settings.low_watermark
        stats = self.pool.stats()
        free = sum(max(0, int(s.capacity_bytes * lw) - s.used_bytes) for s in stats)   # used: reserved too
        return NodeInfo(self.cfg.node_id, f"{self.host}:{self.port}",
                        tuple((s.name, s.capacity_bytes, s.used_bytes) for s in stats), free,
                        self.node_te.endpoint if self.node_te else "", self.epoch, self.draining)

    def start(self, port: int) -> None:
        self.port = port
        index = self.pool.index   # its KV events speak for the node id while the node holds it
        speak = index.speak if isinstance(index, PublishingIndex) else None
        self.heartbeat = Heartbeat(self.registry, self.info, self.cfg.node_ttl_s, self.cfg.heartbeat_s,
                                   on_holding=speak).start()
        log.info("store node %s heartbeating into the %s registry (TTL %.1f s, transfer engine %s)",
                 self.cfg.node_id, self.registry.kind, self.cfg.node_ttl_s,
                 self.node_te.endpoint if self.node_te else "off")

    def leave(self) -> None:
        """Stop heartbeating and withdraw the membership record (idempotent)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def stop(self) -> None:
        self.leave()
        if self.control is not None:
            self.control.close()  # its readers' leases end here
            self.control.host.close()
        if self.node_te is not None:
            self.node_te.close()
        self.registry.close()
