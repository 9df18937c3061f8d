"""The same-host client: maps a store node's DRAM slab and moves block bytes with one copy
each way, while a control channel (:class:`~kvstore.dataplane.uds.UdsControl`, or
:class:`~kvstore.dataplane.grpc_control.GrpcControl`) carries only leases and reservations.

A get: one LEASE for the whole batch → copy each block out of the slab → check the lease's
deadline (and, with ``verify``, each block's checksum) → RELEASE (no reply awaited). A put:
one RESERVE per window (none while spare slots last) → copy each block into its slot and
checksum the slot while it is still in this core's cache → one COMMIT carrying the
checksums. No block byte goes through a socket.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from kvstore.errors import InvalidArgument, LeaseExpired, Unavailable
from kvstore.integrity import checksum_of, new_hasher
from kvstore.pool import PutResult
from kvstore.limits import check_key
from kvstore.tiers.buffers import Segments, as_u8, copy_into, nbytes
from kvstore.tiers.prefault import Prefaulter
from kvstore.dataplane.types import (ELSEWHERE, MAPPED, SLOT_EXISTED, SLOT_OPEN, DataPlaneInfo, LeaseGrant,
                                     SlotGrant, host_id)

log = logging.getLogger(__name__)
LEASE_CHUNK = 64          # a get of at least twice this many keys leases them in pipelined chunks
LEASE_FIRST_CHUNK = 16    # ... the first of them this small: the only lease the copy waits for
PIPELINE_BYTES = 4 << 20  # a put of more is committed in chunks of this, while the next is copied
SPARE_STOCK = 4           # spare slots a writer keeps of the size it puts, asked for ahead
COPY_MARGIN_S = 0.05      # a slot is written only if the copy surely ends before its write-by time,
MIN_COPY_BYTES_PER_S = 100e6  # assuming at least this copy rate
# A put of a block this large hashes it on a helper thread beside its copy; smaller ones hash
# the slot right after the copy, while it is in cache. A/B in one process (2 cores, best of
# 12 rounds): 1 MiB puts 213 us serial vs 228 us beside (the thread hand-off costs more than
# the 1 MiB hash), 2 MiB about even, 4 MiB 468 vs 566 us, 16 MiB 1.6 vs 2.1 ms.
PARALLEL_HASH_BYTES = 2 << 20
PIPELINED_VERIFY_BYTES = 4 << 20  # a get of a block this large verifies chunks beside the copy
VERIFY_CHUNK_BYTES = 1 << 20
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
    def lease_pipelined(self, chunks: Sequence[Sequence[bytes]], ttl_s: float | None,
                        consume: Callable[[int, LeaseGrant], None]) -> None: ...
    def reserve(self, items: Sequence[tuple[bytes, int]], chain: bool = False,
                parent: bytes | None = None) -> list[SlotGrant]: ...
    spares_owed: int

    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
               spare: tuple[int, int] = (0, 0), checksums: Sequence[int] | None = None,
               give_back: Sequence[int] = ()) -> list[PutResult]: ...
    def commit_pipelined(self, chunks: Iterable[tuple[Sequence[int], Sequence[bytes], Sequence[bytes | None],
                                                      Sequence[int]]]) -> list[PutResult]: ...
    def take_spares(self, wait: bool = False) -> list[tuple[int, SlotGrant]]: ...
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
                 lease_ttl_s: float | None = None, fetch: Fetch | None = None, prefault: bool = True) -> None:
        self.info = info
        self.control = control
        self.verify = verify
        self.lease_ttl_s = lease_ttl_s
        self.fetch = fetch  # blocks held in another tier (SSD, HBM); None: they are misses
        self._mm, self._slab = map_slab(info)
        # This process's page tables for the slab, built in the background: a first touch of
        # each 4 KiB page of the mapping is a fault (1 MiB: ~0.5 ms on a VM, vs ~0.07 once mapped).
        self._prefault = Prefaulter(int(self._slab.ctypes.data), int(self._slab.nbytes),
                                    f"mapping of {info.slab_name}") if prefault and self._slab.nbytes else None
        self._spares: dict[int, list[SlotGrant]] = {}  # size -> spare slots in stock
        self._spare_lock = threading.Lock()
        self._hash_pool: ThreadPoolExecutor | None = None

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
        if chain or stop_at_miss or len(keys) < 2 * LEASE_CHUNK:
            grant = self.control.lease(keys, self.lease_ttl_s, stop_at_miss, chain or stop_at_miss)
            try:
                out, later = self.copy_leased(grant, keys, outs)
            finally:
                self.control.release(grant.lease_id)
        else:
            out, later = self._get_pipelined(keys, outs)
        if later and self.fetch is not None:
            for i, data in zip(later, self.fetch([keys[i] for i in later])):
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
        late = time.monotonic() - grant.deadline
        if late > 0:
            raise LeaseExpired(f"copy of {len(grant.blocks)} blocks outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        for i in bad:  # corrupt in the slab, or reused under a lease that lied: never returned
            log.warning("block %s failed its checksum after the slab copy; a miss", keys[i].hex()[:16])
            out[i] = None
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
            pending = pool.submit(hasher.update, part)
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
            check_key(key)
        if len(blocks) == 1 and self.control.spares:  # the common one-block put
            view = as_u8(blocks[0][1])
            done = self._put_spared(blocks[0][0], view, nbytes(view), parent)
            if done is not None:
                return [done]
        keys = [k for k, _ in blocks]
        views = [as_u8(data) for _, data in blocks]
        sizes = [nbytes(v) for v in views]
        parents = [parent if i == 0 else (keys[i - 1] if chain else None) for i in range(len(keys))]
        if len(blocks) == 1:  # the common one-block put: no windows
            return self._put_window(keys, views, sizes, parents, chain)
        window = max(1, self.info.slab_bytes // 4)
        out: list[PutResult] = []
        start = 0
        while start < len(blocks):
            end, total = start + 1, sizes[start]
            while end < len(blocks) and total + sizes[end] <= window:
                total += sizes[end]
                end += 1
            out += self._put_window(keys[start:end], views[start:end], sizes[start:end], parents[start:end], chain)
            start = end
        return out

    def _put_spared(self, key: bytes, view: Any, size: int, parent: bytes | None) -> PutResult | None:
        """One block into a spare slot of its size, committed in one round trip: the
        common put, kept lean (what :meth:`_put_window` does for one block, without its
        lists). None when no spare of that size is in stock and in time (the caller then
        reserves); spares too near their write-by time are given back unwritten."""
        ctl = self.control
        give_back: list[int] = []
        with self._spare_lock:
            self._restock(size)
            slot = self._pop_spare(size, time.monotonic(), give_back)
        if slot is None:
            if give_back:
                ctl.abort(give_back)
            return None
        try:
            checksum = self._fill(slot.offset, view, size)
        except BaseException:
            ctl.abort([slot.res_id] + give_back)
            raise
        ask, unused = self._spare_ask([size])
        result = ctl.commit([slot.res_id], [key], [parent], ask, [checksum], give_back + unused)[0]
        if not result.ok:  # the spare timed out before its commit: put it again, reserved afresh
            result = self._put_window([key], [view], [size], [parent], False, retry=False)[0]
        return result

    def _put_window(self, keys: list[bytes], views: list[Any], sizes: list[int], parents: list[bytes | None],
                    chain: bool, retry: bool = True) -> list[PutResult]:
        """One window: fill spare slots where there are some of the right size and still in
        time (no RESERVE round trip), reserve the rest, copy every block into its slot and
        checksum it, and commit each block under its key and chain parent: in one frame
        (asking for spares for the next puts, giving back unusable ones), or in pipelined
        chunks of :data:`PIPELINE_BYTES` that the node commits while the next chunk is
        copied. A slot is never written once its write-by time is too near (:func:`_in_time`):
        it is given back and its block put again through a fresh reservation, as is a
        block whose spare slot turned out to have timed out at commit."""
        ctl = self.control
        n = len(keys)
        slots: list[SlotGrant | None] = [None] * n
        spared: set[int] = set()
        give_back: list[int] = []
        if ctl.spares and retry:
            with self._spare_lock:
                self._restock(sizes[0])
                now = time.monotonic()
                for i, size in enumerate(sizes):
                    slots[i] = self._pop_spare(size, now, give_back)
                    if slots[i] is not None:
                        spared.add(i)
        need = [i for i in range(n) if slots[i] is None]
        if need:
            whole = len(need) == n  # chain links can go with the reservation
            grants = ctl.reserve([(keys[i], sizes[i]) for i in need], chain and whole, parents[0] if whole else None)
            for i, g in zip(need, grants):
                slots[i] = g
        granted: list[SlotGrant] = [g for g in slots if g is not None]  # every block has one now
        todo = [i for i, g in enumerate(granted) if g.state == SLOT_OPEN]
        late: list[int] = []   # slots whose write-by time came too near: not written, given back
        sent: list[int] = []   # slots filled and sent to commit, in order
        if sum(sizes[i] for i in todo) > PIPELINE_BYTES:
            try:
                results = ctl.commit_pipelined(self._fill_chunks(todo, granted, views, sizes, keys, parents,
                                                                 sent, late))
            except BaseException:  # the control lock is free again here: abort what was not sent
                done_ids = set(sent)
                ctl.abort([granted[i].res_id for i in todo if i not in done_ids] + give_back)
                raise
            if late or give_back:
                ctl.abort([granted[i].res_id for i in late] + give_back)
        else:
            try:  # one chunk: everything filled, then one COMMIT
                filled = list(self._fill_chunks(todo, granted, views, sizes, keys, parents, sent, late, math.inf))
            except BaseException:
                ctl.abort([granted[i].res_id for i in todo] + give_back)
                raise
            ids, ks, ps, sums = filled[0] if filled else ([], [], [], [])
            ask, unused = self._spare_ask(sizes)
            results = ctl.commit(ids, ks, ps, ask, sums, give_back + unused + [granted[i].res_id for i in late])
        done = dict(zip(sent, results))
        out = [done[i] if i in done else PutResult(k, g.state == SLOT_EXISTED, g.state == SLOT_EXISTED, g.error)
               for i, (k, g) in enumerate(zip(keys, granted))]
        redo = sorted(set(late) | {i for i in spared if not out[i].ok})  # put those again, once
        if redo and retry:
            again = self._put_window([keys[i] for i in redo], [views[i] for i in redo], [sizes[i] for i in redo],
                                     [parents[i] for i in redo], False, retry=False)
            for i, r in zip(redo, again):
                out[i] = r
        if not retry:
            for i in late:
                out[i] = PutResult(keys[i], False, error="the slot's reservation ran out before the copy")
        return out

    def _fill(self, off: int, view: Any, size: int) -> int:
        """Copy one block into its slot at ``off``; its xxh3_64. A host array of at least
        :data:`PARALLEL_HASH_BYTES` is hashed on a helper thread while this one copies it
        (both read the same source; numpy's copy runs without the GIL). Otherwise the slot
        is hashed right after the copy, while it is still in cache."""
        slot = self._slab[off:off + size]
        if isinstance(view, np.ndarray) and view.shape[0] == size:
            if size >= PARALLEL_HASH_BYTES:
                pending = self._hasher().submit(checksum_of, view)
                np.copyto(slot, view)
                return pending.result()
            np.copyto(slot, view)
        else:
            copy_into(slot, view)
        return checksum_of(slot)

    def _hasher(self) -> ThreadPoolExecutor:
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-put-hash")
        return self._hash_pool

    def _fill_chunks(self, todo: list[int], granted: list[SlotGrant], views: list[Any], sizes: list[int],
                     keys: list[bytes], parents: list[bytes | None], sent: list[int], late: list[int],
                     chunk_bytes: float = PIPELINE_BYTES) -> Any:
        """Fill the slots of ``todo`` and yield them as (ids, keys, parents, checksums) in
        commit chunks of about ``chunk_bytes``, recording in ``sent`` the slots yielded and
        in ``late`` the ones skipped because their write-by time came too near. Aborts
        nothing itself: it may run under the control channel's lock (the caller aborts
        after an error)."""
        chunk: list[int] = []
        sums: list[int] = []
        total = 0
        for i in todo:
            if not _in_time(granted[i], sizes[i], time.monotonic()):
                late.append(i)
                continue
            sums.append(self._fill(granted[i].offset, views[i], sizes[i]))
            chunk.append(i)
            total += sizes[i]
            if total >= chunk_bytes:
                sent.extend(chunk)
                yield ([granted[j].res_id for j in chunk], [keys[j] for j in chunk], [parents[j] for j in chunk], sums)
                chunk, sums, total = [], [], 0
        if chunk:
            sent.extend(chunk)
            yield ([granted[j].res_id for j in chunk], [keys[j] for j in chunk], [parents[j] for j in chunk], sums)

    def _spare_ask(self, sizes: list[int]) -> tuple[tuple[int, int], list[int]]:
        """(size, count) of spare slots to ask for at this commit, and the spare slots to
        give back with it. A writer keeps spares of the size it puts now only: enough of
        the window's last block size for the next window like it, at least
        :data:`SPARE_STOCK`; spares of other sizes go back (the node also caps what one
        connection holds). Nothing is asked while a grant is owed or the stock is more
        than half full."""
        if not self.control.spares or self.control.spares_owed:
            return (0, 0), []
        size = sizes[-1]
        want = max(SPARE_STOCK, sum(s == size for s in sizes))
        with self._spare_lock:
            held = len(self._spares.get(size, ()))
            if held * 2 > want:
                return (0, 0), []
            unused = [g.res_id for s, stock in self._spares.items() if s != size for g in stock]
            self._spares = {size: self._spares.get(size, [])}
        return (size, want - held), unused

    def _restock(self, size: int) -> None:
        """Take in the spare grants the node sent (``_spare_lock`` held): those arrived, or
        all owed when none of ``size`` is in stock. With spares in stock, a grant still owed
        is read by the next round trip (after its request went out), not on the put's path."""
        ctl = self.control
        if not ctl.spares_owed or not self._spares.get(size):
            self._stock(ctl.take_spares(wait=ctl.spares_owed > 0))

    def _pop_spare(self, size: int, now: float, give_back: list[int]) -> SlotGrant | None:
        """A spare slot of ``size`` a copy started at ``now`` surely fills in time
        (``_spare_lock`` held), or None; the ones too near their write-by time, popped on
        the way, go to ``give_back`` (never written)."""
        stock = self._spares.get(size)
        while stock:
            g = stock.pop()
            if _in_time(g, size, now):
                return g
            give_back.append(g.res_id)
        return None

    def _stock(self, grants: list[tuple[int, SlotGrant]]) -> None:
        """Keep spare slots granted by the node (``_spare_lock`` held)."""
        for size, g in grants:
            self._spares.setdefault(size, []).append(g)

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


def _in_time(slot: SlotGrant, size: int, now: float) -> bool:
    """Whether a copy of ``size`` bytes started at ``now`` surely ends before the slot's
    write-by time (assuming at least :data:`MIN_COPY_BYTES_PER_S`, plus
    :data:`COPY_MARGIN_S`); a slot without one (0) is always in time."""
    return not slot.write_by or now + COPY_MARGIN_S + size / MIN_COPY_BYTES_PER_S <= slot.write_by


def _cut(out: list[Any]) -> list[Any]:
    """A prefix read's results, ending at the first miss (that None included)."""
    for i, v in enumerate(out):
        if v is None:
            return out[:i + 1]
    return out
