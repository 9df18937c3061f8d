"""The transfer engine's trust boundary on a store node: a staging area.

Mooncake's engine authenticates no one and (0.3.13) listens on every interface, and its only
check on a request is that the address lies inside memory registered with it. So the node
registers not its DRAM slab but a staging area (``te_staging_bytes``) that holds only the
blocks being read: a transfer-engine reader's LEASE, over the token-checked TCP control
channel, copies each leased block out of the slab into staging space and ends the pool's
lease at once; the reply's offsets are staging offsets. RELEASE, the connection's end or
the lease's TTL frees that space. A stranger who reaches the engine can then read at most
blocks in flight, and anything it writes into them fails the reader's checksum (taken at
put), so it is a miss, never wrong bytes. Released staging space is zeroed by a thread of
its own, off the path of the reader's next LEASE (it pauses while a LEASE copies blocks in:
on the 2-core VM a 16 MiB copy took 1.2 ms alone, 2.7 ms beside a 16 MiB memset), and
only then free again.
"""
from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.dataplane.host import DataPlaneHost
from kvstore.wire.types import ELSEWHERE, MAPPED

log = logging.getLogger(__name__)
ALIGN = 4096
# A block this large is copied into staging in two halves at once, one by a helper thread:
# a 16 MiB block just put took 1.7 ms in one copy and 0.93 ms in two (2-core VM).
SPLIT_COPY_BYTES = 4 << 20
ZERO_CHUNK = 1 << 20   # the zeroer looks for a lease copying blocks in between chunks


class StagingArea:
    """``nbytes`` of host memory (a numpy array, registered by the caller) cut into extents
    by first fit. Invariant: free extents are sorted, disjoint, never adjacent (coalesced),
    and together with the allocated ones cover the area exactly."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"a staging area needs at least {ALIGN} bytes, got {nbytes}")
        self.nbytes = nbytes - nbytes % ALIGN
        self.buf = np.zeros(self.nbytes, dtype=np.uint8)
        self.buf.fill(0)   # touched now: no copy into it pays page faults
        self._starts: list[int] = [0]        # free extents: starts (sorted) ...
        self._sizes: list[int] = [self.nbytes]  # ... and their lengths
        self.used = 0

    def alloc(self, size: int) -> int | None:
        """The offset of ``size`` bytes (rounded up to 4 KiB; 0 bytes take one page), or None
        when no free extent is that large."""
        need = max(ALIGN, -(-size // ALIGN) * ALIGN)
        for i, n in enumerate(self._sizes):
            if n >= need:
                at = self._starts[i]
                if n == need:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i], self._sizes[i] = at + need, n - need
                self.used += need
                return at
        return None

    def free(self, offset: int, size: int, zeroed: bool = False) -> None:
        """Give back what :meth:`alloc` returned for ``size`` bytes at ``offset``; its bytes
        are zeroed (unless the caller did: ``zeroed``), so what a stranger reads there is
        only ever a block in flight."""
        need = max(ALIGN, -(-size // ALIGN) * ALIGN)
        if not zeroed:
            self.zero(offset, size)
        self.used -= need
        i = bisect.bisect_left(self._starts, offset)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:   # merge with the left one
            i -= 1
            self._sizes[i] += need
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, need)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)

    def zero(self, offset: int, size: int) -> None:
        """Zero ``size`` bytes at ``offset`` (a memset with the GIL released)."""
        if size:
            ctypes.memset(int(self.buf.ctypes.data) + offset, 0, size)


class StagedReads:
    """The read side of a :class:`DataPlaneHost` (LOOKUP, LEASE, RELEASE) for
    transfer-engine readers, through ``area``: a lease's blocks are copied into staging
    space under the pool's lease, which ends before the reply; a block that finds no room is
    answered ELSEWHERE with its size (one in another tier has size 0): the reader leases it
    again once it has released what it holds, or fetches it over the gRPC stream. Staged space is held
    until RELEASE or ``ttl_s`` (the pool's lease TTL) after the lease, whichever is first.
    ``staged``, ``copied_bytes`` and ``crowded`` count blocks staged, their bytes and blocks
    that found no room."""

    def __init__(self, host: DataPlaneHost, area: StagingArea, ttl_s: float) -> None:
        self.host, self.pool, self.area, self.ttl_s = host, host.pool, area, ttl_s
        self._held: dict[int, tuple[float, list[tuple[int, int]]]] = {}  # lease id -> (expiry, extents)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # released extents queued, or zeroed
        self._dirty: list[tuple[int, int]] = []   # released, not zeroed yet: neither held nor free
        self._zeroing = 0    # extents the zeroer holds outside the lock
        self._copying = 0    # leases copying blocks in: the zeroer waits (both want the memory bus) ...
        self._starved = 0    # ... unless one of them waits for space it is zeroing
        self._closed = False
        self.staged = self.copied_bytes = self.crowded = 0
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="staging-copy")
        self._zeroer = threading.Thread(target=self._zero_released, name="staging-zeroer", daemon=True)
        self._zeroer.start()

    def lease_flat(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
                   chain: bool = False) -> tuple[int, float, list[int]]:
        """As :meth:`DataPlaneHost.lease_flat`, offsets in the staging area. Raises what it raises."""
        lease_id, _, flat = self.host.lease_flat(keys, ttl_s, stop_at_miss, chain)
        extents: list[tuple[int, int]] = []
        with self._lock:
            self._copying += 1
        try:
            for j in range(0, len(flat), 4):
                if flat[j] != MAPPED:
                    continue
                offset, size = flat[j + 1], flat[j + 2]
                at = self._alloc(size)
                if at is None:   # its size stays: the reader leases it again after its release
                    flat[j], flat[j + 1] = ELSEWHERE, 0
                    self.crowded += 1
                    continue
                extents.append((at, size))
                self._copy(self.area.buf[at:at + size], self.host.tier.view(offset, size))
                flat[j + 1] = at
                self.staged += 1
                self.copied_bytes += size
        finally:
            with self._lock:
                self._copying -= 1
                self._changed.notify_all()
            if lease_id:
                self.host.release(lease_id)   # the bytes are staged: the slab may move on
        if not extents:
            return 0, time.monotonic() + (ttl_s or self.ttl_s), flat
        expiry = time.monotonic() + (ttl_s or self.ttl_s)
        with self._lock:
            staged_id = next(self._ids)
            self._held[staged_id] = (expiry, extents)
        return staged_id, expiry, flat

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = int(dst.nbytes)
        if n < SPLIT_COPY_BYTES:
            np.copyto(dst, src)
            return
        half = n // 2 - n // 2 % ALIGN
        rest = self._helper.submit(np.copyto, dst[half:], src[half:])
        np.copyto(dst[:half], src[:half])
        rest.result()

    def _alloc(self, size: int) -> int | None:
        with self._lock:
            at = self.area.alloc(size)
            if at is None and (self._dirty or self._zeroing):   # space on its way back: take it now
                self._starved += 1
                self._changed.notify_all()
                while self._zeroing:
                    self._changed.wait()
                self._starved -= 1
                self._free(self._dirty)
                self._dirty = []
                at = self.area.alloc(size)
            if at is None and self._sweep():
                at = self.area.alloc(size)
            return at

    def _free(self, extents: list[tuple[int, int]], zeroed: bool = False) -> None:
        for at, size in extents:
            self.area.free(at, size, zeroed)

    def _sweep(self) -> bool:
        """Free the staged space of leases past their TTL (lock held); whether any was."""
        now = time.monotonic()
        gone = [lid for lid, (expiry, _) in self._held.items() if expiry <= now]
        for lid in gone:
            self._free(self._held.pop(lid)[1])
        return bool(gone)

    def release(self, lease_id: int) -> bool:
        """End a staged lease: its space goes to the zeroer thread, free again once zeroed."""
        with self._lock:
            held = self._held.pop(lease_id, None)
            if held is None:
                return False
            self._dirty += held[1]
            self._changed.notify_all()
        return True

    def _zero_released(self) -> None:
        """The zeroer thread: zero released extents outside the lock, a chunk at a time,
        pausing while a lease copies blocks in (that copy is on a reader's path), then free
        them."""
        while True:
            with self._lock:
                while not self._dirty and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                batch, self._dirty = self._dirty, []
                self._zeroing = len(batch)
            try:
                for at, size in batch:
                    for off in range(0, size, ZERO_CHUNK):
                        with self._lock:
                            while self._copying and not self._starved and not self._closed:
                                self._changed.wait()
                        self.area.zero(at + off, min(ZERO_CHUNK, size - off))
            finally:
                with self._lock:
                    self._free(batch, zeroed=True)
                    self._zeroing = 0
                    self._changed.notify_all()

    def abort(self, res_ids: Sequence[int]) -> None:
        """Nothing to abort: staged reads reserve no slot (the control server calls it at a
        connection's end)."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free(self._dirty)
            self._dirty = []
            self._changed.notify_all()
        self._zeroer.join(timeout=10)
        self._helper.shutdown(wait=True)
        self.host.close()
