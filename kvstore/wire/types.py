"""The write-and-lease contract: the domain types every wire of a store node carries (the
gRPC API, protos/kvstore.proto; the same-host and TCP control frames,
kvstore/wire/frame_codec.py; the transfer-engine endpoint, protos/transfer.proto) and the
pool and the data plane take. Each wire's codec maps its messages to these types and back,
so adding an option to a put or a lease means: a field here, a line in each codec, and a
case in tests/kvstore/wire/test_wire_conformance.py (which checks every option over every wire).

Times are ``time.monotonic()`` seconds: CLOCK_MONOTONIC is one clock for every process of a
host, so a lease deadline the store sets can be checked by a client on that host after its
copy (a reader on another host trusts a block by its checksum instead). Sizes are bytes.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.pool.types import LookupResult, PutResult, TierStats

__all__ = ["BlockLocation", "DataPlaneInfo", "ELSEWHERE", "LeaseGrant", "LeaseRequest", "LookupResult", "MAPPED",
           "MISS", "PutResult", "ReserveRequest", "SLOT_EXISTED", "SLOT_FAILED", "SLOT_OPEN", "SLOT_QUOTA", "SlotGrant",
           "TierStats", "TransferInfo", "chain_parents", "host_id"]

MISS = 0        # the node does not hold the block
MAPPED = 1      # the block is in the DRAM slab at (offset, size); copy it out under the lease
ELSEWHERE = 2   # held in another tier (SSD, HBM): fetch it over the gRPC stream

SLOT_OPEN = 0     # write the block at the slot's offset, then commit
SLOT_EXISTED = 1  # the key is stored already: nothing to write (an idempotent put)
SLOT_FAILED = 2   # no slot (``error`` says why)
SLOT_QUOTA = 3    # no slot: the put's namespace is at its quota (``error`` says so); a writer raises
                  # QuotaExceeded after committing the blocks before it, as the gRPC stream does


def chain_parents(keys: Sequence[bytes], chain: bool, parent: bytes | None) -> list[bytes | None]:
    """The prefix-chain parent of each block of a put: the first block extends ``parent``
    (None: nothing), block i > 0 extends block i - 1 when ``chain``, else nothing."""
    return [parent or None if i == 0 else (keys[i - 1] if chain else None) for i in range(len(keys))]


class LeaseRequest(NamedTuple):
    """A lease on ``keys`` (at most MAX_KEYS_PER_CALL): ``ttl_s`` seconds (None: the node's
    lease TTL), ``stop_at_miss``: a prefix read (the grant ends at the first miss),
    ``chain``: the keys are one prefix chain (recency is touched tail first). (NamedTuples,
as the results: one is made per call on the hot path.)"""

    keys: Sequence[bytes]
    ttl_s: float | None = None
    stop_at_miss: bool = False
    chain: bool = False


class ReserveRequest(NamedTuple):
    """Slab slots for ``items`` = (key, size bytes); ``chain``: block i extends block i - 1,
    ``parent``: the key the first block extends (None: none); ``namespace``: the tenant the
    blocks belong to (kvstore/pool/tenants.py: accounting and its byte quota; None: unattributed).
    A namespace is bookkeeping only: block keys are salted with it already, so it never
    opens another tenant's blocks to the writer."""

    items: Sequence[tuple[bytes, int]]
    chain: bool = False
    parent: bytes | None = None
    namespace: str | None = None


class BlockLocation(NamedTuple):
    """Where one leased block lies: ``state`` MISS / MAPPED / ELSEWHERE; for MAPPED,
    ``offset`` and ``size`` in the slab (bytes) and the xxh3-64 ``checksum`` taken at put."""

    state: int
    offset: int = 0
    size: int = 0
    checksum: int = 0


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A lease on some blocks: ``lease_id`` (for release; 0: nothing leased), ``deadline``
    (monotonic seconds; a copy that ends later is not trusted), one :class:`BlockLocation`
    per key asked (a prefix read ends at the first miss)."""

    lease_id: int
    deadline: float
    blocks: list[BlockLocation]


class SlotGrant(NamedTuple):
    """A reservation for one block: ``state`` SLOT_OPEN / SLOT_EXISTED / SLOT_FAILED, its
    id (for commit / abort) and slab ``offset``, or the ``error`` that failed it.
    ``write_by``: the monotonic time by which the writer's copy into the slot must have
    ended; the node keeps the space reserved a grace period longer
    (kvstore.dataplane.host.WRITE_GRACE_S), and a writer never starts a copy it cannot
    finish by then, so a slot whose reservation timed out is never written into after its
    space went to another block."""

    state: int
    res_id: int = 0
    offset: int = 0
    error: str = ""
    write_by: float = 0.0


@dataclass(frozen=True, slots=True)
class DataPlaneInfo:
    """How to reach a store node's slab from its host: the shared-memory ``slab_name`` of
    ``slab_bytes``, the Unix socket of the light control channel (``socket_path``; empty:
    use gRPC), the node's ``host_id`` (:func:`host_id`; a client on another host must not
    map a same-named segment of its own) and ``node_id``. ``puts_in_slab``: the slab is the
    node's top tier, where puts land (a node with an HBM tier above it takes puts over gRPC)."""

    slab_name: str
    slab_bytes: int
    socket_path: str
    host_id: str
    node_id: str
    puts_in_slab: bool = True


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """Where a node's transfer engine listens (``te_endpoint`` host:rpc_port, "" = none; its
    ``protocol`` tcp | rdma and ``metadata``: P2PHANDSHAKE or an HTTP metadata URL), the
    registered region readers read from (``slab_address``, ``slab_bytes``; with ``staged`` a
    staging area, where only offsets from the control channel's LEASE are valid) and the TCP
    port of the node's read-only control channel (``control_port``; 0 = none)."""

    node_id: str
    te_endpoint: str = ""
    protocol: str = ""
    slab_address: int = 0
    slab_bytes: int = 0
    metadata: str = ""
    control_port: int = 0
    staged: bool = False


@functools.cache
def host_id() -> str:
    """This host's identity for "same host?": the kernel's boot id (shared by every process
    and container of one boot), or the hostname where /proc has none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()
