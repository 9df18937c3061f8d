"""The store node's Admin gRPC service (protos/admin.proto): what ``kvctl`` drives.

It is registered on the node's own gRPC server (kvstore/node.py), so the server's token
interceptor (kvstore/auth.py) guards it exactly as it guards the store API: a call without
the store token (``Bearer <KVSTORE_STORE_TOKEN>``) is refused UNAUTHENTICATED before it
reaches a method. Tenants never hold that token (the front door derives their namespace
from their own API key), so no tenant can list, inspect or probe another's blocks here.

Errors go through kvstore/wire/errors.py, as the store API's do (the gRPC code of the
class, the class named in the ``kvstore-error`` trailer): a bad key, tier, prefix or namespace
is INVALID_ARGUMENT naming it; draining a node with no cluster membership is
FAILED_PRECONDITION.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.admin import ops
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.limits import check_count, check_key, check_keys
from kvstore.pool.quotas import check_namespace
from kvstore.pool.tenants import TenantBooks, namespace_stats, tenants_of
from kvstore.wire.errors import refusing
from protos import admin_pb2 as apb
from protos import admin_pb2_grpc as apb_grpc

MAX_LIST = 10000          # blocks one ListBlocks returns at most (the rest are counted)


@dataclass
class NodeControl:
    """What the Admin service may change about its node besides the pool: ``set_draining``
    announces the flag in membership (None: a node with no cluster presence); ``data_dir``
    is reported by Stats."""

    node_id: str
    data_dir: str = ""
    set_draining: Callable[[bool], None] | None = None
    draining: bool = False


def _block(v: ops.BlockView) -> apb.Block:
    return apb.Block(key=v.key, namespace=v.namespace, size=v.size, tiers=list(v.tiers), pin=v.pin,
                     pin_ttl_s=v.pin_ttl_s, leased=v.leased, parent=v.parent, checksum=v.checksum)


def _keys_response(r: ops.MoveReport) -> apb.KeysResponse:
    return apb.KeysResponse(done=r.done, freed_bytes=r.freed_bytes,
                            failed=[apb.Failure(key=k, reason=why) for k, why in r.failed.items()])


class AdminServicer(apb_grpc.AdminServicer):
    """Admin calls on one pool (kvstore/admin/ops.py) and its tenant books."""

    def __init__(self, pool: Any, control: NodeControl, tenants: TenantBooks | None = None) -> None:
        self.pool = pool
        self.control = control
        self.tenants = tenants if tenants is not None else tenants_of(pool)

    def _tier(self, name: str) -> str | None:
        return name or None

    @refusing
    def ListBlocks(self, request: apb.ListBlocksRequest, context: grpc.ServicerContext) -> apb.ListBlocksResponse:
        ns = _namespace_filter(request)
        limit = min(request.limit or MAX_LIST, MAX_LIST)
        views, matched = ops.list_blocks(self.pool, self._tier(request.tier), ns, request.key_prefix, limit)
        return apb.ListBlocksResponse(node_id=self.pool.node_id, blocks=[_block(v) for v in views], matched=matched)

    @refusing
    def Inspect(self, request: apb.InspectRequest, context: grpc.ServicerContext) -> apb.InspectResponse:
        check_key(request.key)
        view = ops.inspect(self.pool, request.key)
        return apb.InspectResponse(found=view is not None, block=_block(view) if view else None)

    def _resolve(self, request: apb.KeysRequest) -> list[bytes]:
        check_keys(request.keys)
        check_count(len(request.key_prefixes), "key_prefixes")
        if not request.keys and not request.key_prefixes:
            raise InvalidArgument("name at least one block key or key prefix")
        return ops.resolve(self.pool, list(request.keys), list(request.key_prefixes))

    @refusing
    def Remove(self, request: apb.KeysRequest, context: grpc.ServicerContext) -> apb.KeysResponse:
        return _keys_response(ops.remove(self.pool, self._resolve(request)))

    @refusing
    def Demote(self, request: apb.KeysRequest, context: grpc.ServicerContext) -> apb.KeysResponse:
        return _keys_response(ops.demote(self.pool, self._resolve(request)))

    @refusing
    def Promote(self, request: apb.KeysRequest, context: grpc.ServicerContext) -> apb.KeysResponse:
        return _keys_response(ops.promote(self.pool, self._resolve(request)))

    @refusing
    def Flush(self, request: apb.FlushRequest, context: grpc.ServicerContext) -> apb.FlushResponse:
        ns = _namespace_filter(request)
        r = ops.flush(self.pool, self._tier(request.tier), ns, request.force)
        return apb.FlushResponse(tiers=r.tiers, dropped_blocks=r.dropped_blocks, freed_bytes=r.freed_bytes,
                                 left=r.left, success=r.success)

    @refusing
    def Evict(self, request: apb.EvictRequest, context: grpc.ServicerContext) -> apb.EvictResponse:
        if not request.tier:
            raise InvalidArgument("name the tier to evict from")
        r = ops.evict(self.pool, request.tier, request.bytes)
        return apb.EvictResponse(tier=r.tier, asked_bytes=r.asked_bytes, freed_bytes=r.freed_bytes,
                                 demoted=r.demoted, dropped=r.dropped, reason=r.reason)

    @refusing
    def SetDraining(self, request: apb.DrainRequest, context: grpc.ServicerContext) -> apb.DrainResponse:
        was = self.control.draining
        if self.control.set_draining is None and request.draining:
            raise FailedPrecondition(f"node {self.control.node_id} has no cluster membership to drain from")
        self.control.draining = request.draining
        if self.control.set_draining is not None:
            self.control.set_draining(request.draining)
        return apb.DrainResponse(draining=request.draining, was_draining=was)

    @refusing
    def Stats(self, request: apb.StatsRequest, context: grpc.ServicerContext) -> apb.StatsResponse:
        return apb.StatsResponse(node_id=self.pool.node_id, draining=self.control.draining,
                                 data_dir=self.control.data_dir, namespaces=[
            apb.NamespaceStats(namespace=s.namespace, bytes=s.bytes, blocks=s.blocks, hits=s.hits,
                               misses=s.misses, evictions=s.evictions, rejected_puts=s.rejected_puts,
                               quota_bytes=s.quota_bytes, tier_bytes=s.tier_bytes, lookup_hits=s.lookup_hits,
                               lookup_misses=s.lookup_misses)
            for s in namespace_stats(self.pool).values()])

    def _used(self, namespace: str) -> int:
        with self.pool._lock:
            return self.tenants.used(namespace)

    @refusing
    def SetQuota(self, request: apb.QuotaRequest, context: grpc.ServicerContext) -> apb.QuotaResponse:
        ns = check_namespace(request.namespace)
        old = self.tenants.quotas.set(ns, int(request.bytes))
        return apb.QuotaResponse(namespace=ns, found=old is not None, bytes=request.bytes,
                                 previous_bytes=old or 0, used_bytes=self._used(ns))

    @refusing
    def GetQuota(self, request: apb.QuotaRequest, context: grpc.ServicerContext) -> apb.QuotaResponse:
        ns = check_namespace(request.namespace)
        q = self.tenants.quotas.get(ns)
        return apb.QuotaResponse(namespace=ns, found=q is not None, bytes=q or 0, used_bytes=self._used(ns))

    @refusing
    def RemoveQuota(self, request: apb.QuotaRequest, context: grpc.ServicerContext) -> apb.QuotaResponse:
        ns = check_namespace(request.namespace)
        old = self.tenants.quotas.remove(ns)
        return apb.QuotaResponse(namespace=ns, found=old is not None, bytes=old or 0, used_bytes=self._used(ns))

    @refusing
    def ListQuotas(self, request: apb.ListQuotasRequest, context: grpc.ServicerContext) -> apb.ListQuotasResponse:
        return apb.ListQuotasResponse(quotas=[
            apb.QuotaResponse(namespace=ns, found=True, bytes=q, used_bytes=self._used(ns))
            for ns, q in sorted(self.tenants.quotas.all().items())])


def attach_tenants(cfg: Any, pool: Any) -> TenantBooks:
    """Give a store node's pool its tenant books, with the quotas persisted in
    ``<data_dir>/<node_id>/quotas.json``. Raises InvalidArgument for a quota file that
    cannot be read."""
    import os

    from kvstore.pool.quotas import QUOTA_FILE, QuotaStore
    from kvstore.pool.tenants import attach
    return attach(pool, QuotaStore(os.path.join(cfg.data_dir, cfg.node_id, QUOTA_FILE)))


def node_control(cfg: Any, pool: Any, agent: Any) -> NodeControl:
    """The Admin service's hold on a store node (kvstore/node.py): the cluster agent whose
    heartbeat announces the draining flag (announced at once, not at the next beat)."""
    import os
    node_dir = os.path.join(cfg.data_dir, cfg.node_id)

    def set_draining(flag: bool) -> None:
        agent.draining = flag
        if agent.heartbeat is not None:
            agent.heartbeat.beat()
    return NodeControl(cfg.node_id, os.path.abspath(node_dir), set_draining)


def admin_service(pool: Any, control: NodeControl,
                  tenants: TenantBooks | None = None) -> Callable[[grpc.Server], None]:
    """``add(server)`` registering the Admin service for ``pool`` (for ``serve_store``'s
    ``extra_services``)."""
    def add(server: grpc.Server) -> None:
        apb_grpc.add_AdminServicer_to_server(AdminServicer(pool, control, tenants), server)
    return add


def _namespace_filter(request: apb.ListBlocksRequest | apb.FlushRequest) -> str | None:
    """A call's namespace filter: None (every block), "" (blocks no tenant owns) or a
    namespace as every other call takes it. Raises InvalidArgument for a name no tenant can
    have (rather than matching nothing, quietly)."""
    if not request.HasField("namespace"):
        return None
    return check_namespace(request.namespace) if request.namespace else ""
