"""The same-host data plane: a client on the store node's host maps the DRAM tier's
shared-memory slab and moves block bytes itself, while a light control channel (a Unix
domain socket with struct-packed frames; gRPC where there is none) carries only leases,
reservations and lookups (docs/wires.md §3).

- :mod:`kvstore.wire.types`: the small types both sides share;
- :mod:`kvstore.dataplane.host`: the store side (leases and reservations over a pool);
- :mod:`kvstore.wire.frame_codec`: the compact frames of the Unix socket;
- :mod:`kvstore.dataplane.framing`: their socket I/O;
- :mod:`kvstore.dataplane.control_server`: the control channel servers (Unix socket; read-only TCP);
- :mod:`kvstore.dataplane.control_client`: their client side (:class:`UdsControl`, :class:`TcpControl`);
- :mod:`kvstore.dataplane.grpc_control`: the same control over gRPC;
- :mod:`kvstore.dataplane.local`: :class:`LocalDataPlane`, the same-host client: its reads
  (``slab_reads``), writes (``slab_writes``), spare slots (``spares``) and the control it
  talks to (``control``).
"""
from kvstore.wire.types import BlockLocation, DataPlaneInfo, LeaseGrant, SlotGrant, host_id  # re-exported

__all__ = ["BlockLocation", "DataPlaneInfo", "LeaseGrant", "SlotGrant", "host_id"]
