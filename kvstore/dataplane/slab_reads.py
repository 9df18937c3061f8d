"""The read path of the same-host client (:class:`~kvstore.dataplane.local.LocalDataPlane`):
one LEASE for the batch → copy each block out of the mapped slab → check the lease's
deadline (and, with ``verify``, each block's checksum) → RELEASE (no reply awaited). Blocks
held in another tier (SSD, HBM) are fetched over the gRPC stream. :meth:`get_into` and
:meth:`get_blocks` share one settlement of a lease (:meth:`_settle`): the deadline and the
checksum misses are judged in one place."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.dataplane.control import Control
from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.integrity import checksum_of, new_hasher
from kvstore.tiers.buffers import Segments, as_u8, copy_into
from kvstore.wire.types import ELSEWHERE, MAPPED, LeaseGrant

log = logging.getLogger(__name__)
LEASE_CHUNK = 64          # a get of at least twice this many keys leases them in pipelined chunks
LEASE_FIRST_CHUNK = 16    # ... the first of them this small: the only lease the copy waits for
PIPELINED_VERIFY_BYTES = 4 << 20  # a get of a block this large verifies chunks beside the copy
VERIFY_CHUNK_BYTES = 1 << 20
_U8 = np.dtype(np.uint8)
Fetch = Callable[[list[bytes]], list[bytes | None]]  # keys -> bytes over the gRPC stream
Report = Callable[[list[bytes]], None]  # keys that failed their checksum here -> the node (never raises)


class SlabReads:
    """Reads of :class:`~kvstore.dataplane.local.LocalDataPlane` (a mixin: the plane holds
    the mapped ``_slab``, its ``control`` and its settings)."""

    control: Control
    verify: bool
    lease_ttl_s: float | None
    fetch: Fetch | None
    report: Report | None
    _slab: np.ndarray

    def _hasher(self) -> ThreadPoolExecutor:
        raise NotImplementedError

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
        if chain or stop_at_miss or len(keys) < 2 * LEASE_CHUNK:
            grant = self.control.lease(keys, self.lease_ttl_s, stop_at_miss, chain or stop_at_miss)
            try:
                out, later = self.copy_leased(grant, keys, outs)
            finally:
                self.control.release(grant.lease_id)
        else:
            out, later = self._get_pipelined(keys, outs)
        for i, data in self._fetch_elsewhere(keys, later):
            out[i] = None if data is None else copy_into(outs[i], np.frombuffer(data, dtype=np.uint8))
        return _cut(out) if stop_at_miss else out

    def _get_pipelined(self, keys: Sequence[bytes], outs: Sequence[Any]) -> tuple[list[int | None], list[int]]:
        """A large unordered batch as leases of :data:`LEASE_CHUNK` keys (the first of
        :data:`LEASE_FIRST_CHUNK`): the node grants chunk i + 1 while this process copies
        chunk i, so only the first, small chunk's lease is waited for. Each chunk is checked
        against its own lease's deadline and released after its copy; raises LeaseExpired
        as :meth:`copy_leased` (after every chunk was released)."""
        first = min(LEASE_FIRST_CHUNK, len(keys))  # small, so the first copy starts early
        chunks = [range(0, first)] + [range(a, min(a + LEASE_CHUNK, len(keys)))
                                      for a in range(first, len(keys), LEASE_CHUNK)]
        out: list[int | None] = []
        later: list[int] = []

        def copy(n: int, grant: LeaseGrant) -> None:
            idx = chunks[n]
            got, more = self.copy_leased(grant, keys[idx.start:idx.stop], outs[idx.start:idx.stop])
            out.extend(got)
            later.extend(idx.start + i for i in more)

        self.control.lease_pipelined([keys[r.start:r.stop] for r in chunks], self.lease_ttl_s, copy)
        return out, later

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
        copyto, digest, big = np.copyto, checksum_of, PIPELINED_VERIFY_BYTES
        i = 0
        try:
            for i, (state, off, size, csum) in enumerate(grant.blocks):
                if state != MAPPED:
                    if state == ELSEWHERE:
                        later.append(i)
                    continue
                dst = outs[i]
                src = slab[off:off + size]
                if type(dst) is np.ndarray and dst.shape == (size,) and dst.dtype is _U8 and size < big:
                    copyto(dst, src)  # the common case (a uint8 array of the block's size), kept lean
                    out[i] = size
                    if verify and digest(dst) != csum:
                        bad.append(i)
                    continue
                if type(dst) is np.ndarray and dst.dtype is _U8 and dst.ndim == 1 and dst.shape[0] >= size:
                    d = dst if dst.shape[0] == size else dst[:size]
                    if verify and size >= PIPELINED_VERIFY_BYTES:
                        ok = self._copy_hashed(d, src) == csum
                    else:
                        np.copyto(d, src)
                        ok = not verify or checksum_of(d) == csum
                elif isinstance(dst, Segments):  # a paged block: one part per layer, no staging
                    dst.scatter(src)
                    ok = not verify or dst.checksum() == csum
                else:
                    copy_into(dst, src)
                    host = as_u8(dst)
                    ok = not verify or checksum_of(host[:size] if isinstance(host, np.ndarray) else src) == csum
                out[i] = size
                if not ok:
                    bad.append(i)
        except (ValueError, BufferError, TypeError) as exc:  # e.g. a read-only output array
            raise InvalidArgument(f"output buffer {i}: {exc}") from None
        self._settle(grant, keys, out, bad, time.monotonic())
        return out, later

    def _copy_hashed(self, dst: np.ndarray, src: np.ndarray) -> int:
        """Copy ``src`` into ``dst`` in 1 MiB chunks while a helper thread hashes the chunks
        already copied (streaming xxh3_64, so the digest is that of the whole copy, taken
        from ``dst``); the copy runs without the GIL, the hash with it."""
        hasher, pool, pending = new_hasher(), self._hasher(), None
        n = dst.shape[0]
        for at in range(0, n, VERIFY_CHUNK_BYTES):
            part = dst[at:at + VERIFY_CHUNK_BYTES]
            np.copyto(part, src[at:at + VERIFY_CHUNK_BYTES])
            if pending is not None:
                pending.result()
            pending = pool.submit(hasher.update, part.data)
        if pending is not None:
            pending.result()
        return hasher.intdigest()

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
            copied_at = time.monotonic()
        finally:
            self.control.release(grant.lease_id)
        self._settle(grant, keys, out, bad, copied_at)
        for i, fetched in self._fetch_elsewhere(keys, later):
            out[i] = fetched
        return _cut(out) if stop_at_miss else out

    def _settle(self, grant: LeaseGrant, keys: Sequence[bytes], out: list[Any], bad: list[int],
                copied_at: float) -> None:
        """Judge the copies of one lease: raise LeaseExpired when they ended (``copied_at``,
        monotonic seconds) after its deadline (the bytes may have been reused); otherwise
        make each block of ``bad`` (failed its checksum) a miss in ``out`` and report them
        (``report``: the node verifies them itself and drops a damaged one)."""
        late = copied_at - grant.deadline
        if late > 0:
            raise LeaseExpired(f"copy of {len(grant.blocks)} blocks outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        for i in bad:  # corrupt in the slab, or reused under a lease that lied: never returned
            log.warning("block %s failed its checksum after the slab copy; a miss", keys[i].hex()[:16])
            out[i] = None
        if bad and self.report is not None:
            self.report([keys[i] for i in bad])

    def _fetch_elsewhere(self, keys: Sequence[bytes], later: list[int]) -> list[tuple[int, bytes | None]]:
        """(index, bytes or None) of the blocks held in another tier, read over the gRPC
        stream; none without ``fetch``."""
        if not later or self.fetch is None:
            return []
        return list(zip(later, self.fetch([keys[i] for i in later])))


def _cut(out: list[Any]) -> list[Any]:
    """A prefix read's results, ending at the first miss (that None included)."""
    for i, v in enumerate(out):
        if v is None:
            return out[:i + 1]
    return out
