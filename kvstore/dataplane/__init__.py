"""The same-host data plane: a client on the store node's host maps the DRAM tier's
shared-memory slab and moves block bytes itself, while a light control channel (a Unix
domain socket with struct-packed frames; gRPC where there is none) carries only leases,
reservations and lookups (DESIGN.md §5).

- :mod:`kvstore.dataplane.types`: the small types both sides share;
- :mod:`kvstore.dataplane.host`: the store side (leases and reservations over a pool);
- :mod:`kvstore.dataplane.wire`: the compact framing of the Unix socket;
- :mod:`kvstore.dataplane.server`: the control channel servers (Unix socket; read-only TCP);
- :mod:`kvstore.dataplane.uds`: their client side (:class:`UdsControl`, :class:`TcpControl`);
- :mod:`kvstore.dataplane.grpc_control`: the same control over gRPC;
- :mod:`kvstore.dataplane.local`: :class:`LocalDataPlane`, the same-host client.
"""
from kvstore.dataplane.types import BlockLocation, DataPlaneInfo, LeaseGrant, SlotGrant, host_id

__all__ = ["BlockLocation", "DataPlaneInfo", "LeaseGrant", "SlotGrant", "host_id"]
