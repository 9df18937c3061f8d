"""The write path of the same-host client (:class:`~kvstore.dataplane.local.LocalDataPlane`):
one RESERVE per window (none while spare slots last, kvstore/dataplane/spares.py) → copy each
block into its slot and checksum the slot while it is still in this core's cache → one
COMMIT carrying the checksums. No block byte goes through a socket."""
from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.dataplane.control import CommitChunk, Control
from kvstore.dataplane.spares import SpareStock, in_time
from kvstore.errors import QuotaExceeded
from kvstore.integrity import checksum_of
from kvstore.limits import check_key
from kvstore.tiers.buffers import as_u8, copy_into, nbytes
from kvstore.wire.types import SLOT_EXISTED, SLOT_OPEN, SLOT_QUOTA, DataPlaneInfo, PutResult, SlotGrant, chain_parents

PIPELINE_BYTES = 4 << 20  # a put of more is committed in chunks of this, while the next is copied
# A put of a block this large hashes it on a helper thread beside its copy; smaller ones hash
# the slot right after the copy, while it is in cache. A/B in one process (2 cores, best of
# 12 rounds): 1 MiB puts 213 us serial vs 228 us beside (the thread hand-off costs more than
# the 1 MiB hash), 2 MiB about even, 4 MiB 468 vs 566 us, 16 MiB 1.6 vs 2.1 ms.
PARALLEL_HASH_BYTES = 2 << 20


class SlabWrites:
    """Writes of :class:`~kvstore.dataplane.local.LocalDataPlane` (a mixin: the plane holds
    the mapped ``_slab``, its ``control``, ``info`` and the ``spares`` stock)."""

    control: Control
    info: DataPlaneInfo
    spares: SpareStock
    _slab: np.ndarray

    def _hasher(self) -> ThreadPoolExecutor:
        raise NotImplementedError

    def put_blocks(self, blocks: Sequence[tuple[bytes, Any]], chain: bool = False,
                   parent: bytes | None = None, namespace: str | None = None) -> list[PutResult]:
        """Store blocks (bytes-like, numpy arrays or tensors on any device): reserve slab
        slots, copy each block into its slot, commit; one result per block, in order (an
        existing key is success). Windows of up to a quarter of the slab go per round trip.
        ``chain``: the blocks form one prefix chain (head first; ``parent``: the key the
        head extends). ``namespace``: the tenant the blocks belong to, sent with each
        RESERVE and COMMIT (a spare slot gets its tenant at commit). Raises Unavailable
        when the node cannot be reached, QuotaExceeded when the tenant's quota refuses a
        block (the blocks before it are stored)."""
        for key, _ in blocks:  # as the gRPC service refuses them
            check_key(key)
        if len(blocks) == 1 and self.control.spares:  # the common one-block put
            view = as_u8(blocks[0][1])
            done = self._put_spared(blocks[0][0], view, nbytes(view), parent, namespace)
            if done is not None:
                return [done]
        keys = [k for k, _ in blocks]
        views = [as_u8(data) for _, data in blocks]
        sizes = [nbytes(v) for v in views]
        parents = chain_parents(keys, chain, parent)
        if len(blocks) == 1:  # the common one-block put: no windows
            return self._put_window(keys, views, sizes, parents, chain, namespace=namespace)
        window = max(1, self.info.slab_bytes // 4)
        out: list[PutResult] = []
        start = 0
        while start < len(blocks):
            end, total = start + 1, sizes[start]
            while end < len(blocks) and total + sizes[end] <= window:
                total += sizes[end]
                end += 1
            out += self._put_window(keys[start:end], views[start:end], sizes[start:end], parents[start:end], chain,
                                    namespace=namespace)
            start = end
        return out

    def _put_spared(self, key: bytes, view: Any, size: int, parent: bytes | None,
                    namespace: str | None = None) -> PutResult | None:
        """One block into a spare slot of its size, committed in one round trip: the
        common put, kept lean (what :meth:`_put_window` does for one block, without its
        lists). None when no spare of that size is in stock and in time (the caller then
        reserves); spares too near their write-by time are given back unwritten."""
        ctl, spares = self.control, self.spares
        give_back: list[int] = []
        with spares.lock:
            spares.restock(size)
            slot = spares.pop(size, time.monotonic(), give_back)
        if slot is None:
            if give_back:
                ctl.abort(give_back)
            return None
        try:
            checksum = self._fill(slot.offset, view, size)
        except BaseException:
            ctl.abort([slot.res_id] + give_back)
            raise
        ask, unused = spares.ask([size])
        result = ctl.commit([slot.res_id], [key], [parent], ask, [checksum], give_back + unused, namespace)[0]
        if not result.ok:  # timed out (or over the quota) before its commit: put it again, reserved afresh
            result = self._put_window([key], [view], [size], [parent], False, retry=False, namespace=namespace)[0]
        return result

    def _put_window(self, keys: list[bytes], views: list[Any], sizes: list[int], parents: list[bytes | None],
                    chain: bool, retry: bool = True, namespace: str | None = None) -> list[PutResult]:
        """One window: fill spare slots where there are some of the right size and still in
        time (no RESERVE round trip), reserve the rest, copy every block into its slot and
        checksum it, and commit each block under its key and chain parent: in one frame
        (asking for spares for the next puts, giving back unusable ones), or in pipelined
        chunks of :data:`PIPELINE_BYTES` that the node commits while the next chunk is
        copied. A slot is never written once its write-by time is too near (:func:`in_time`):
        it is given back and its block put again through a fresh reservation, as is a
        block whose spare slot turned out to have timed out (or over ``namespace``'s quota)
        at commit: its reservation then says QuotaExceeded, raised once the blocks before
        the refused one are committed."""
        ctl, spares = self.control, self.spares
        n = len(keys)
        slots: list[SlotGrant | None] = [None] * n
        spared: set[int] = set()
        give_back: list[int] = []
        if ctl.spares and retry:
            with spares.lock:
                spares.restock(sizes[0])
                now = time.monotonic()
                for i, size in enumerate(sizes):
                    slots[i] = spares.pop(size, now, give_back)
                    if slots[i] is not None:
                        spared.add(i)
        need = [i for i in range(n) if slots[i] is None]
        if need:
            whole = len(need) == n  # chain links can go with the reservation
            grants = ctl.reserve([(keys[i], sizes[i]) for i in need], chain and whole, parents[0] if whole else None,
                                 namespace)
            for i, g in zip(need, grants):
                slots[i] = g
        granted: list[SlotGrant] = [g for g in slots if g is not None]  # every block has one now
        todo = [i for i, g in enumerate(granted) if g.state == SLOT_OPEN]
        late: list[int] = []   # slots whose write-by time came too near: not written, given back
        sent: list[int] = []   # slots filled and sent to commit, in order
        if sum(sizes[i] for i in todo) > PIPELINE_BYTES:
            try:
                results = ctl.commit_pipelined(self._fill_chunks(todo, granted, views, sizes, keys, parents,
                                                                 sent, late), namespace)
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
            ask, unused = spares.ask(sizes)
            results = ctl.commit(ids, ks, ps, ask, sums, give_back + unused + [granted[i].res_id for i in late],
                                 namespace)
        done = dict(zip(sent, results))
        out = [done[i] if i in done else PutResult(k, g.state == SLOT_EXISTED, g.state == SLOT_EXISTED, g.error)
               for i, (k, g) in enumerate(zip(keys, granted))]
        redo = sorted(set(late) | {i for i in spared if not out[i].ok})  # put those again, once
        if redo and retry:
            again = self._put_window([keys[i] for i in redo], [views[i] for i in redo], [sizes[i] for i in redo],
                                     [parents[i] for i in redo], False, retry=False, namespace=namespace)
            for i, r in zip(redo, again):
                out[i] = r
        if not retry:
            for i in late:
                out[i] = PutResult(keys[i], False, error="the slot's reservation ran out before the copy")
        refused = next((g.error for g in granted if g.state == SLOT_QUOTA), None)
        if refused is not None:   # the blocks before it are committed, as on the gRPC stream
            raise QuotaExceeded(refused)
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

    def _fill_chunks(self, todo: list[int], granted: list[SlotGrant], views: list[Any], sizes: list[int],
                     keys: list[bytes], parents: list[bytes | None], sent: list[int], late: list[int],
                     chunk_bytes: float = PIPELINE_BYTES) -> Iterator[CommitChunk]:
        """Fill the slots of ``todo`` and yield them as (ids, keys, parents, checksums) in
        commit chunks of about ``chunk_bytes``, recording in ``sent`` the slots yielded and
        in ``late`` the ones skipped because their write-by time came too near. Aborts
        nothing itself: it may run under the control channel's lock (the caller aborts
        after an error)."""
        chunk: list[int] = []
        sums: list[int] = []
        total = 0
        for i in todo:
            if not in_time(granted[i], sizes[i], time.monotonic()):
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
