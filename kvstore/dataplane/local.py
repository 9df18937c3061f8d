"""The same-host client: maps a store node's DRAM slab and moves block bytes with one copy
each way, while a control channel (:class:`~kvstore.dataplane.uds.UdsControl`, or
:class:`~kvstore.dataplane.grpc_control.GrpcControl`) carries only leases and reservations.

A get: one LEASE for the whole batch → copy each block out of the slab → check the lease's
deadline (and, with ``verify``, each block's checksum) → RELEASE (no reply awaited). A put:
one RESERVE per window → copy each block into its slot → one COMMIT (the node checksums the
slots as they lie in the slab). No block byte goes through a socket.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from kvstore.errors import InvalidArgument, LeaseExpired, Unavailable
from kvstore.integrity import checksum_of
from kvstore.pool import PutResult
from kvstore.tiers.buffers import as_u8, copy_into, nbytes
from kvstore.dataplane.types import (ELSEWHERE, MAPPED, SLOT_EXISTED, SLOT_OPEN, DataPlaneInfo, LeaseGrant,
                                     SlotGrant, host_id)

log = logging.getLogger(__name__)
MAX_KEY_BYTES = 64
_U8 = np.dtype(np.uint8)
Fetch = Callable[[list[bytes]], list[bytes | None]]  # keys -> bytes over the gRPC stream


class Control(Protocol):
    """The control channel of a :class:`LocalDataPlane` (uds.UdsControl, grpc_control.GrpcControl)."""

    name: str
    spares: bool

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]: ...
    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
              chain: bool = False) -> LeaseGrant: ...
    def release(self, lease_id: int) -> None: ...
    def reserve(self, items: Sequence[tuple[bytes, int]], chain: bool = False,
                parent: bytes | None = None) -> list[SlotGrant]: ...
    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
               spare: tuple[int, int] = (0, 0)) -> tuple[list[PutResult], list[SlotGrant]]: ...
    def abort(self, res_ids: Sequence[int]) -> None: ...
    def close(self) -> None: ...


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


class LocalDataPlane:
    """Reads and writes blocks of a store node on this host through its mapped slab.

    Invariant: a block is returned only if its copy ended before its lease's deadline (the
    node never reuses a leased block's bytes before then) and, with ``verify`` (default),
    only if the copied bytes match the checksum taken at put; otherwise LeaseExpired or a
    miss — never another block's bytes. Thread-safe as far as its control is (both are).
    """

    def __init__(self, info: DataPlaneInfo, control: Control, verify: bool = True,
                 lease_ttl_s: float | None = None, fetch: Fetch | None = None) -> None:
        self.info = info
        self.control = control
        self.verify = verify
        self.lease_ttl_s = lease_ttl_s
        self.fetch = fetch  # blocks held in another tier (SSD, HBM); None: they are misses
        self._mm, self._slab = map_slab(info)
        self._spares: dict[int, list[tuple[int, int]]] = {}  # size -> (reservation id, offset)
        self._spare_lock = threading.Lock()

    @property
    def channel(self) -> str:
        """The control channel: ``uds`` or ``grpc``."""
        return self.control.name

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """Longest prefix of ``keys`` the node holds and the tier of each (renews nothing)."""
        return self.control.lookup(keys)

    # -- reads -----------------------------------------------------------------------------
    def get_into(self, keys: Sequence[bytes], outs: Sequence[Any], stop_at_miss: bool = False,
                 chain: bool = False) -> list[int | None]:
        """Copy block i into ``outs[i]`` (a contiguous numpy array or torch tensor on any
        device, at least the block's size in bytes); per key the bytes copied or None for a
        miss (with ``stop_at_miss`` the list ends at the first miss). One lease for the
        batch. Raises LeaseExpired when the copies outlived the lease (the buffers' contents
        are then undefined), InvalidArgument for a too-small buffer, Unavailable when the
        node cannot be reached."""
        if len(outs) < len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        if not keys:
            return []
        grant = self.control.lease(keys, self.lease_ttl_s, stop_at_miss, chain or stop_at_miss)
        try:
            out, later = self.copy_leased(grant, keys, outs)
        finally:
            self.control.release(grant.lease_id)
        if later and self.fetch is not None:
            for i, data in zip(later, self.fetch([keys[i] for i in later])):
                out[i] = None if data is None else copy_into(outs[i], np.frombuffer(data, dtype=np.uint8))
        return _cut(out) if stop_at_miss else out

    def copy_leased(self, grant: LeaseGrant, keys: Sequence[bytes],
                    outs: Sequence[Any]) -> tuple[list[int | None], list[int]]:
        """Copy the MAPPED blocks of ``grant`` into ``outs`` and validate them: raises
        LeaseExpired when the copies ended after the lease's deadline; a block failing its
        checksum (with ``verify``) is a miss. Returns per block the bytes copied or None,
        and the indices of the blocks held in another tier. Releases nothing."""
        out: list[int | None] = [None] * len(grant.blocks)
        bad: list[int] = []
        later: list[int] = []
        slab, verify = self._slab, self.verify
        for i, (state, off, size, csum) in enumerate(grant.blocks):
            if state != MAPPED:
                if state == ELSEWHERE:
                    later.append(i)
                continue
            dst = outs[i]
            src = slab[off:off + size]
            if type(dst) is np.ndarray and dst.dtype is _U8 and dst.ndim == 1 and dst.shape[0] >= size:
                d = dst if dst.shape[0] == size else dst[:size]
                np.copyto(d, src)
                ok = not verify or checksum_of(d) == csum
            else:
                copy_into(dst, src)
                host = as_u8(dst)
                ok = not verify or checksum_of(host[:size] if isinstance(host, np.ndarray) else src) == csum
            out[i] = size
            if not ok:
                bad.append(i)
        late = time.monotonic() - grant.deadline
        if late > 0:
            raise LeaseExpired(f"copy of {len(grant.blocks)} blocks outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        for i in bad:  # corrupt in the slab, or reused under a lease that lied: never returned
            log.warning("block %s failed its checksum after the slab copy; a miss", keys[i].hex()[:16])
            out[i] = None
        return out, later

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False,
                   chain: bool = False) -> list[bytes | None]:
        """Bytes of each key (None for a miss; with ``stop_at_miss`` the list ends at the
        first miss): one lease, one copy per block out of the slab. Raises as get_into."""
        if not keys:
            return []
        grant = self.control.lease(keys, self.lease_ttl_s, stop_at_miss, chain or stop_at_miss)
        out: list[bytes | None] = [None] * len(grant.blocks)
        later: list[int] = []
        bad: list[int] = []
        slab, verify = self._slab, self.verify
        try:
            for i, (state, off, size, csum) in enumerate(grant.blocks):
                if state == MAPPED:
                    out[i] = data = slab[off:off + size].tobytes()
                    if verify and checksum_of(data) != csum:
                        bad.append(i)
                elif state == ELSEWHERE:
                    later.append(i)
            late = time.monotonic() - grant.deadline
        finally:
            self.control.release(grant.lease_id)
        if late > 0:
            raise LeaseExpired(f"copy of {len(grant.blocks)} blocks outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        for i in bad:
            log.warning("block %s failed its checksum after the slab copy; a miss", keys[i].hex()[:16])
            out[i] = None
        if later and self.fetch is not None:
            for i, data in zip(later, self.fetch([keys[i] for i in later])):
                out[i] = data
        return _cut(out) if stop_at_miss else out

    # -- writes ----------------------------------------------------------------------------
    def put_blocks(self, blocks: Sequence[tuple[bytes, Any]], chain: bool = False,
                   parent: bytes | None = None) -> list[PutResult]:
        """Store blocks (bytes-like, numpy arrays or tensors on any device): reserve slab
        slots, copy each block into its slot, commit; one result per block, in order (an
        existing key is success). Windows of up to a quarter of the slab go per round trip.
        ``chain``: the blocks form one prefix chain (head first; ``parent``: the key the
        head extends). Raises Unavailable when the node cannot be reached."""
        for key, _ in blocks:  # as the gRPC service refuses them
            if not key or len(key) > MAX_KEY_BYTES:
                raise InvalidArgument(f"block key of {len(key)} bytes; 1 to {MAX_KEY_BYTES}")
        views = [as_u8(data) for _, data in blocks]
        window = max(1, self.info.slab_bytes // 4)
        out: list[PutResult] = []
        start = 0
        while start < len(blocks):
            end, total = start + 1, nbytes(views[start])
            while end < len(blocks) and total + nbytes(views[end]) <= window:
                total += nbytes(views[end])
                end += 1
            link = parent if start == 0 else (blocks[start - 1][0] if chain else None)
            out += self._put_window(blocks[start:end], views[start:end], chain, link)
            start = end
        return out

    def _put_window(self, blocks: Sequence[tuple[bytes, Any]], views: list[Any], chain: bool,
                    parent: bytes | None, retry: bool = True) -> list[PutResult]:
        """One window: fill spare slots where there are some of the right size (no RESERVE
        round trip), reserve the rest, copy every block into its slot, commit all in one
        frame naming each block's key and chain parent, and ask for spares for next time."""
        keys = [k for k, _ in blocks]
        sizes = [nbytes(v) for v in views]
        parents = [parent if i == 0 else (keys[i - 1] if chain else None) for i in range(len(keys))]
        ctl = self.control
        slots: list[SlotGrant | None] = [None] * len(keys)
        spared: set[int] = set()
        if ctl.spares:
            with self._spare_lock:
                for i, size in enumerate(sizes):
                    free = self._spares.get(size)
                    if free:
                        rid, off = free.pop()
                        slots[i] = SlotGrant(SLOT_OPEN, rid, off)
                        spared.add(i)
        need = [i for i in range(len(keys)) if slots[i] is None]
        if need:
            whole = len(need) == len(keys)  # chain links can go with the reservation
            grants = ctl.reserve([(keys[i], sizes[i]) for i in need], chain and whole, parent if whole else None)
            for i, g in zip(need, grants):
                slots[i] = g
        granted: list[SlotGrant] = [g for g in slots if g is not None]  # every block has one now
        todo = [i for i, g in enumerate(granted) if g.state == SLOT_OPEN]
        slab = self._slab
        try:
            for i in todo:
                off, v = granted[i].offset, views[i]
                if isinstance(v, np.ndarray):
                    np.copyto(slab[off:off + v.shape[0]], v)
                else:
                    copy_into(slab[off:off + sizes[i]], v)
        except BaseException:
            ctl.abort([granted[i].res_id for i in todo])
            raise
        ask = (0, 0)
        if ctl.spares:  # spares of the window's last block size, for the next puts
            with self._spare_lock:
                held = len(self._spares.get(sizes[-1], ()))
            ask = (sizes[-1], max(0, sum(s == sizes[-1] for s in sizes) - held))
        results, spares = ctl.commit([granted[i].res_id for i in todo], [keys[i] for i in todo],
                                     [parents[i] for i in todo], ask)
        if spares:
            with self._spare_lock:
                self._spares.setdefault(ask[0], []).extend((g.res_id, g.offset) for g in spares)
        done = dict(zip(todo, results))
        out = [done[i] if i in done else PutResult(k, g.state == SLOT_EXISTED, g.state == SLOT_EXISTED, g.error)
               for i, (k, g) in enumerate(zip(keys, granted))]
        stale = [i for i in spared if not out[i].ok]  # a spare that timed out: put those again
        if stale and retry:
            with self._spare_lock:
                self._spares.clear()
            again = self._put_window([blocks[i] for i in stale], [views[i] for i in stale], False, None, retry=False)
            for i, r in zip(stale, again):
                out[i] = r
        return out

    def close(self) -> None:
        """Close the control channel and unmap the slab (views still held keep it mapped)."""
        self.control.close()
        self._slab = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass


def _cut(out: list[Any]) -> list[Any]:
    """A prefix read's results, ending at the first miss (that None included)."""
    for i, v in enumerate(out):
        if v is None:
            return out[:i + 1]
    return out
