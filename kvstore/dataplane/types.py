"""Small types shared by the store side and the client side of the same-host data plane.
Times are ``time.monotonic()`` seconds: CLOCK_MONOTONIC is one clock for every process of a
host, so a lease deadline the store sets can be checked by the client after its copy."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

MISS = 0        # the node does not hold the block
MAPPED = 1      # the block is in the DRAM slab at (offset, size); copy it out under the lease
ELSEWHERE = 2   # held in another tier (SSD, HBM): fetch it over the gRPC stream

SLOT_OPEN = 0     # write the block at the slot's offset, then commit
SLOT_EXISTED = 1  # the key is stored already: nothing to write (an idempotent put)
SLOT_FAILED = 2   # no slot (``error`` says why)


class BlockLocation(NamedTuple):
    """Where one leased block lies: ``state`` MISS / MAPPED / ELSEWHERE; for MAPPED,
    ``offset`` and ``size`` in the slab (bytes) and the xxh3-64 ``checksum`` taken at put."""

    state: int
    offset: int = 0
    size: int = 0
    checksum: int = 0


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A lease on some blocks: ``lease_id`` (for release), ``deadline`` (monotonic seconds;
    a copy that ends later is not trusted), one :class:`BlockLocation` per key asked (a
    prefix read ends at the first miss)."""

    lease_id: int
    deadline: float
    blocks: list[BlockLocation]


class SlotGrant(NamedTuple):
    """A reservation for one block: ``state`` SLOT_OPEN / SLOT_EXISTED / SLOT_FAILED, its
    id (for commit / abort) and slab ``offset``, or the ``error`` that failed it.
    ``write_by``: the monotonic time by which the writer's copy into the slot must have
    ended; the node keeps the space reserved a grace period longer (:data:`WRITE_GRACE_S`),
    and a writer never starts a copy it cannot finish by then, so a slot whose reservation
    timed out is never written into after its space went to another block."""

    state: int
    res_id: int = 0
    offset: int = 0
    error: str = ""
    write_by: float = 0.0


WRITE_GRACE_S = 5.0  # at most: a reservation timeout of T gives the writer T - min(5 s, T / 2)


@dataclass(frozen=True, slots=True)
class DataPlaneInfo:
    """How to reach a store node's slab from its host: the shared-memory ``slab_name`` of
    ``slab_bytes``, the Unix socket of the light control channel (``socket_path``; empty:
    use gRPC), the node's ``host_id`` (a client on another host must not map a same-named
    segment of its own) and ``node_id``. ``puts_in_slab``: the slab is the node's top tier,
    where puts land (a node with an HBM tier above it takes puts over gRPC)."""

    slab_name: str
    slab_bytes: int
    socket_path: str
    host_id: str
    node_id: str
    puts_in_slab: bool = True


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
