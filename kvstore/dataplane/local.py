"""The same-host client: maps a store node's DRAM slab and moves block bytes with one copy
each way, while a control channel (:class:`~kvstore.dataplane.control_client.UdsControl`, or
:class:`~kvstore.dataplane.grpc_control.GrpcControl`) carries only leases and reservations.

The read path is kvstore/dataplane/slab_reads.py (lease, copy out, check, release), the write
path kvstore/dataplane/slab_writes.py (reserve or take a spare slot, copy in and checksum,
commit), the spare-slot stock kvstore/dataplane/spares.py. No block byte goes through a socket.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.dataplane.control import Control
from kvstore.dataplane.slab_reads import Fetch, Report, SlabReads
from kvstore.dataplane.slab_writes import SlabWrites
from kvstore.dataplane.spares import SpareStock
from kvstore.errors import Unavailable
from kvstore.tiers.prefault import Prefaulter
from kvstore.wire.types import DataPlaneInfo, LookupResult, host_id


def map_slab(info: DataPlaneInfo) -> tuple[mmap.mmap, np.ndarray]:
    """Map the node's slab read-write. Raises Unavailable when the node is on another host
    or the segment cannot be opened here (another container, no /dev/shm)."""
    if info.host_id != host_id():
        raise Unavailable(f"store node {info.node_id} runs on another host")
    try:
        fd = os.open(f"/dev/shm/{info.slab_name}", os.O_RDWR)
    except OSError as exc:
        raise Unavailable(f"cannot map slab {info.slab_name} of node {info.node_id}: {exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size < info.slab_bytes:
            raise Unavailable(f"slab {info.slab_name} holds {size} bytes, node says {info.slab_bytes}")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


class LocalDataPlane(SlabReads, SlabWrites):
    """Reads and writes blocks of a store node on this host through its mapped slab.

    Invariant: a block is returned only if its copy ended before its lease's deadline (the
    node never reuses a leased block's bytes before then) and, with ``verify`` (default),
    only if the copied bytes match the checksum taken at put; otherwise LeaseExpired or a
    miss — never another block's bytes. Thread-safe as far as its control is (both are).
    ``fetch``: reads blocks held in another tier (SSD, HBM) over the gRPC stream (None: they
    are misses). ``prefault``: build this process's page tables for the mapping in the
    background. ``report``: told the keys of blocks that failed their checksum after the
    copy (StoreClient reports them to the node, which verifies and drops a damaged one).
    """

    def __init__(self, info: DataPlaneInfo, control: Control, verify: bool = True,
                 lease_ttl_s: float | None = None, fetch: Fetch | None = None, prefault: bool = True,
                 report: Report | None = None) -> None:
        self.info = info
        self.control = control
        self.verify = verify
        self.lease_ttl_s = lease_ttl_s
        self.fetch = fetch
        self.report = report
        self._mm, self._slab = map_slab(info)
        # This process's page tables for the slab, built in the background: a first touch of
        # each 4 KiB page of the mapping is a fault (1 MiB: ~0.5 ms on a VM, vs ~0.07 once mapped).
        self._prefault = Prefaulter(int(self._slab.ctypes.data), int(self._slab.nbytes),
                                    f"mapping of {info.slab_name}") if prefault and self._slab.nbytes else None
        self.spares = SpareStock(control)
        self._hash_pool: ThreadPoolExecutor | None = None

    def wait_prefaulted(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for this process's page tables of the slab; True once
        they are built (or the kernel refused: its pages then fault in on first use), or when
        nothing is being pre-faulted."""
        return self._prefault is None or self._prefault.done.wait(timeout_s)

    @property
    def channel(self) -> str:
        """The control channel: ``uds`` or ``grpc``."""
        return self.control.name

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse",
               namespace: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` the node holds and the tier of each (renews nothing);
        ``purpose``, ``namespace``: what for and whose (kvstore/pool/reads.py: the node's
        lookup books)."""
        return self.control.lookup(keys, purpose, namespace)

    def _hasher(self) -> ThreadPoolExecutor:
        """The helper thread that hashes beside large copies (both directions)."""
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-put-hash")
        return self._hash_pool

    def close(self) -> None:
        """Close the control channel and unmap the slab (views still held keep it mapped)."""
        self.control.close()
        if self._prefault is not None:
            self._prefault.stop()  # before the mapping goes
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
        self._slab = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
