"""The KV pool: tiers in order (fastest first), the prefix index, eviction with demotion to
the next tier, promotion on a lower-tier hit, leases, pins and the two-phase put.

Contracts (DESIGN.md §4):
- a key is in the index for (node, tier) iff the tier holds its complete, committed bytes;
  a failed, aborted or timed-out put leaves no visible key and frees its space;
- leased and hard-pinned blocks are never evicted or overwritten, soft-pinned ones only as a
  last resort; lookups and existence checks renew nothing;
- a read that outlives its lease raises LeaseExpired, never returns another block's bytes;
- within one prefix chain, tails are evicted before heads;
- a put of an existing key is success and changes nothing.

Threading: one lock guards the books; block bytes are copied outside it, protected by a
reservation (writes) or a lease (reads).
"""
from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from kvstore.errors import IntegrityError, InvalidArgument, LeaseExpired
from kvstore.eviction import make_policy
from kvstore.index.prefix_index import PrefixIndex
from kvstore.integrity import checksum_of
from kvstore.lease import Lease, Pin, Reservation
from kvstore.placement import Placement
from kvstore.pool_types import PoolSettings, PutResult, TierStats
from kvstore.reservations import Reservations
from kvstore.tiers.base import Tier
from kvstore.tiers.buffers import copy_into, to_bytes

__all__ = ["KVPool", "PoolSettings", "PutResult", "TierStats", "checksum_of"]
Sink = Callable[[Any], Any]


class KVPool:
    """Tiers + index + eviction + leases + pins for one store node. Thread-safe."""

    def __init__(self, tiers: Sequence[Tier], node_id: str = "node-0",
                 index: PrefixIndex | None = None, promote_on_hit: bool | None = None,
                 settings: PoolSettings | None = None) -> None:
        if not tiers:
            raise InvalidArgument("a pool needs at least one tier")
        self.settings = settings or PoolSettings()
        self.promote_on_hit = self.settings.promote_on_hit if promote_on_hit is None else promote_on_hit
        self.tiers = list(tiers)
        self.node_id = node_id
        self.index = index if index is not None else PrefixIndex()
        self._lock = threading.RLock()
        self._place = Placement(self.tiers, self.index, node_id, self.settings)
        self._writes = Reservations(self._place, self._lock, self.settings.reservation_timeout_s)
        self._lease_ids = itertools.count(1)
        for level, tier in enumerate(self.tiers):
            tier.on_lost = functools.partial(self._tier_lost, level)
        with self._lock:
            self._place.load()

    def _tier_lost(self, level: int, keys: list[bytes]) -> None:
        """Tier ``level`` lost these committed blocks by itself (its storage was damaged and
        replaced): forget them, counting each as an integrity failure."""
        with self._lock:
            book = self._place.books[level]
            lost = [key for key in keys if key in book.blocks]
            for key in lost:
                self._place.drop(level, key)
            book.counters.integrity_failures += len(lost)

    def tier(self, name: str) -> Tier:
        return self.tiers[self._place.level_of(name)]

    # -- two-phase put ---------------------------------------------------------------------
    def reserve(self, key: bytes, size: int, checksum: int | None = None, tier: str | None = None,
                parent: bytes | None = None, namespace: str | None = None) -> Reservation:
        """Take ``size`` bytes in ``tier`` (default: the top tier) for ``key``, evicting as
        the watermarks say. ``checksum``: what the bytes must hash to (xxh3-64), when the
        caller knows it; ``parent``: the key this one extends in its prefix chain. A key
        already stored gives a reservation whose ``existed`` is true (writes are discarded,
        commit succeeds). Raises CapacityError when the block cannot fit (too large, or
        everything left is leased, pinned or being written). ``namespace``: the tenant the
        block belongs to (kvstore/tenants.py); over its quota, its own blocks are evicted
        first, and QuotaExceeded is raised when they cannot make room."""
        return self._writes.reserve(key, size, checksum, self._place.level_of(tier), parent, namespace)

    def write(self, res: Reservation, data: Any) -> None:
        """Append ``data`` (bytes-like, uint8 array or tensor) to the reservation; one writer
        per reservation. Raises ReservationExpired after the timeout or an abort, and
        InvalidArgument when the bytes overrun the reserved size. A write that fails in the
        tier aborts the reservation (its error propagates)."""
        self._writes.write(res, data)

    def commit(self, res: Reservation) -> PutResult:
        """Make the written block visible; ``existed`` when another writer stored the key
        first. On failure the reservation is aborted and nothing is visible: raises
        ReservationExpired after the timeout, IntegrityError for short bytes or a checksum
        mismatch, OSError when the tier's write fails."""
        return self._writes.commit(res)

    def mark_filled(self, res: Reservation, checksum: int) -> None:
        """Record that the reservation's slot was written in place by a same-host writer
        through the mapped slab (kvstore/dataplane), instead of through :meth:`write`;
        ``checksum``: xxh3-64 of the slot's bytes as the tier holds them (taken after the
        write). :meth:`commit` then checks it against the checksum given at reserve, if any.
        Raises ReservationExpired after the timeout or an abort."""
        self._writes.mark_filled(res, checksum)

    def abort(self, res: Reservation) -> None:
        """Give the reservation's space back (idempotent; a no-op once committed)."""
        self._writes.abort(res)

    # -- one-call puts ---------------------------------------------------------------------
    def put(self, key: bytes, data: Any, checksum: int | None = None, tier: str | None = None,
            parent: bytes | None = None, namespace: str | None = None) -> PutResult:
        """Store one block (reserve, write, commit). A full tier, a tenant over its quota
        (``namespace``, see :meth:`reserve`) or a failed write is a result with ``ok``
        false, not an exception. Raises IntegrityError when ``checksum`` is given and does
        not match ``data`` (nothing is stored)."""
        r = self._writes.put(key, data, checksum, self._place.level_of(tier), parent, namespace)
        if isinstance(r, IntegrityError) and checksum is not None:
            raise r
        return _result(key, r)

    def put_chain(self, items: Sequence[tuple[bytes, Any]], tier: str | None = None,
                  parent: bytes | None = None) -> list[PutResult]:
        """Put a prefix chain (head first; ``parent``: the key its head extends): each block
        is linked to the one before, so eviction takes the chain's tail before its head."""
        return self.put_many(items, chain=True, tier=tier, parent=parent)

    def put_many(self, items: Sequence[tuple[bytes, Any]], checksums: Sequence[int] | None = None,
                 chain: bool = False, tier: str | None = None,
                 parent: bytes | None = None, namespace: str | None = None) -> list[PutResult]:
        """Put several blocks; one result per block, in order; an existing key is success.
        Blocks go in windows of up to a quarter of the tier: reserve and write each, then
        commit the window in one tier call (one LMDB transaction on SSD). ``chain``: the
        items form one prefix chain, ``parent`` the key its head extends; ``namespace``: the
        tenant of every block (see :meth:`reserve`)."""
        raw = self._writes.put_many(items, checksums, chain, self._place.level_of(tier), parent, namespace)
        return [_result(key, r) for (key, _), r in zip(items, raw)]

    # -- accounting only (tiers that keep no bytes) -----------------------------------------
    def account_chain(self, keys: Sequence[bytes], size: int, tier: str | None = None,
                      parent: bytes | None = None) -> int:
        """Hold a prefix chain (head first; ``parent``: the key its head extends) of blocks
        of ``size`` bytes each by size alone, in a tier that keeps no bytes
        (:class:`kvstore.tiers.accounting.AccountingTier`; the simulator's pools). New blocks
        are reserved — evicting and demoting as a put does — and committed, linked as a
        chain; blocks held already count as read; then the head is the most recent. A
        block that cannot fit ends the chain there. Returns blocks newly held. Raises
        InvalidArgument for a tier that keeps bytes."""
        level = self._place.level_of(tier)
        if self.tiers[level].holds_bytes:
            raise InvalidArgument(f"tier {self.tiers[level].name!r} keeps bytes; put blocks there, "
                                  f"account_chain is for accounting tiers")
        new = 0
        with self._lock:
            book, account, link = self._place.books[level], self._writes.account, parent
            for key in keys:
                if key not in book.blocks:
                    r = account(key, size, level, link)
                    if isinstance(r, Exception):
                        break
                    new += not r.existed
                link = key
            blocks, access = book.blocks, book.policy.access
            for key in reversed(keys):
                if key in blocks:
                    access(key)
        return new

    def touch(self, keys: Sequence[bytes]) -> int:
        """Count a read of the blocks of a prefix chain this node holds without moving bytes
        (recency tail-first, so heads stay warm; hits and misses counted as a read's).
        Returns blocks held."""
        with self._lock:
            place = self._place
            found = [(key, hit[0]) for key in keys if (hit := place.find(key)) is not None]
            books = place.books
            for key, level in reversed(found):
                books[level].policy.access(key)
            return len(found)

    # -- reads -----------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], sinks: Sink | Sequence[Sink],
                  lease_ttl_s: float | None = None, stop_at_miss: bool = False,
                  chain: bool = False, with_checksums: bool = False) -> list[Any]:
        """``sink(view)`` for each key held, from its fastest tier, under one lease; None for
        a miss. ``sinks``: one for all keys or one per key; a view is a read-only uint8 array
        (a tensor for a device tier) valid only during the call. ``stop_at_miss``: the list
        ends at the first miss (that None included). ``chain``: the keys are one prefix chain
        (linked, and touched tail-first so heads stay warm). ``with_checksums``: each hit is
        (sink result, the block's xxh3_64 taken at put), for a caller that sends the bytes
        on and lets the receiver verify them end to end. A block failing its checksum is a
        miss, dropped and counted. Raises LeaseExpired when the copies outlived the lease
        (``lease_ttl_s``, default the pool's)."""
        sink_of = sinks if isinstance(sinks, (list, tuple)) else None
        found: list[tuple[int, int, Any]] = []
        groups: dict[int, tuple[list[int], list[bytes], list[Sink]]] = {}  # level -> indices, keys, sinks
        with self._lock:
            deadline = time.monotonic() + (lease_ttl_s or self.settings.lease_ttl_s)
            place = self._place
            n = len(keys)
            for i, key in enumerate(keys):
                hit = place.find(key)
                if hit is None:
                    if stop_at_miss:
                        n = i + 1
                        break
                    continue
                level, meta = hit
                meta.hold(deadline)
                found.append((i, level, meta))
                group = groups.get(level) or groups.setdefault(level, ([], [], []))
                group[0].append(i)
                group[1].append(key)
                group[2].append(sink_of[i] if sink_of is not None else sinks)
            if chain:
                for i, _, _ in found:
                    if i > 0:
                        place.link(keys[i], keys[i - 1])
            for i, level, _ in (reversed(found) if chain else found):
                place.books[level].policy.access(keys[i])
        out: list[Any] = [None] * n
        corrupt: list[tuple[int, int, Any]] = []
        try:
            for level, (idx, level_keys, level_sinks) in groups.items():
                for i, v in zip(idx, self.tiers[level].read_many(level_keys, level_sinks)):
                    if isinstance(v, Exception):
                        if not isinstance(v, IntegrityError):
                            raise v
                        corrupt.append(next(f for f in found if f[0] == i))
                    else:
                        out[i] = v
        finally:
            self._end_read(keys, found, corrupt)
        late = time.monotonic() - deadline
        if late > 0:
            raise LeaseExpired(f"read of {len(found)} blocks outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        if self.promote_on_hit and any(level > 0 for _, level, _ in found):
            with self._lock:
                for i, level, _ in found:
                    if level > 0 and out[i] is not None:
                        self._place.promote(level, keys[i])
        if with_checksums:
            for i, _, meta in found:
                if out[i] is not None:
                    out[i] = (out[i], meta.checksum)
        return out

    def _end_read(self, keys: Sequence[bytes], found: list[tuple[int, int, Any]],
                  corrupt: list[tuple[int, int, Any]]) -> None:
        with self._lock:
            for _, _, meta in found:
                meta.unhold()
            for i, level, meta in corrupt:
                book = self._place.books[level]
                book.counters.integrity_failures += 1
                book.counters.hits -= 1
                book.counters.misses += 1
                if book.blocks.get(keys[i]) is meta:
                    self._place.drop(level, keys[i])

    def read(self, key: bytes, sink: Sink, lease_ttl_s: float | None = None) -> Any:
        """``sink(view)`` of one block under a lease, or None on a miss; :meth:`read_many`
        with one key (the same rules, without the batch bookkeeping)."""
        with self._lock:
            deadline = time.monotonic() + (lease_ttl_s or self.settings.lease_ttl_s)
            hit = self._place.find(key)
            if hit is None:
                return None
            level, meta = hit
            meta.hold(deadline)
            self._place.books[level].policy.access(key)
        found = [(0, level, meta)]
        corrupt: list[tuple[int, int, Any]] = []
        try:
            out = self.tiers[level].read(key, sink)
        except IntegrityError:
            out = None
            corrupt = found
        finally:
            self._end_read((key,), found, corrupt)
        late = time.monotonic() - deadline
        if late > 0:
            raise LeaseExpired(f"read of block {key.hex()[:16]} outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        if level > 0 and out is not None and self.promote_on_hit:
            with self._lock:
                self._place.promote(level, key)
        return out

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, or None on a miss. Raises LeaseExpired (see read_many)."""
        return self.read(key, to_bytes)

    def get_into(self, key: bytes, out: Any) -> int | None:
        """Copy the block into ``out`` (a contiguous numpy array or torch tensor of at least
        its size) with one copy; returns the bytes copied, or None on a miss."""
        return self.read(key, functools.partial(copy_into, out))

    def get_many(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        return self.read_many(keys, to_bytes, stop_at_miss=stop_at_miss)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Batched :meth:`get_into`: block i into ``outs[i]``."""
        return self.read_many(keys, [functools.partial(copy_into, o) for o in outs])

    def get_chain(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Get a prefix chain (None for misses); recency is set tail-first, so heads stay."""
        return self.read_many(keys, to_bytes, stop_at_miss=stop_at_miss, chain=True)

    # -- lookups and locked matches ----------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """Longest prefix of ``keys`` this node holds, and the fastest tier of each of those
        blocks. Changes no recency, renews no lease."""
        with self._lock:
            match = self.index.match(keys, nodes=[self.node_id])
            tiers = list(match.per_node.get(self.node_id, ()))
            return len(tiers), tiers

    def contains(self, key: bytes) -> bool:
        """Whether this node holds ``key`` in some tier (renews nothing)."""
        with self._lock:
            return self._place.held(key)

    def acquire(self, keys: Sequence[bytes], ttl_s: float | None = None) -> Lease:
        """A locked match: lease the longest prefix of ``keys`` this node holds (the copy in
        its fastest tier) for ``ttl_s`` (default: the pool's lease TTL); :meth:`release` it."""
        with self._lock:
            deadline = time.monotonic() + (ttl_s or self.settings.lease_ttl_s)
            n, tiers = self.lookup(keys)
            metas = [self._place.books[self._place.levels[t]].blocks[k] for k, t in zip(keys[:n], tiers)]
            for meta in metas:
                meta.hold(deadline)
            return Lease(next(self._lease_ids), tuple(keys[:n]), tuple(tiers), deadline, metas)

    def lease_many(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
                   chain: bool = False) -> tuple[Lease, list[str | None]]:
        """Lease each key's copy in its fastest tier for a reader that copies the bytes itself
        (a same-host reader of the mapped DRAM slab, kvstore/dataplane). Counts hits and
        misses and touches recency as a read does (``chain``: tail-first, linked), renews
        nothing else. Returns the lease (over the keys held) and, per key, the tier holding
        it or None for a miss; with ``stop_at_miss`` the list ends at the first miss. The
        caller must :meth:`release` the lease; its bytes are trustworthy only if the copy
        ended before ``lease.deadline`` (``time.monotonic()``)."""
        with self._lock:
            deadline = time.monotonic() + (ttl_s or self.settings.lease_ttl_s)
            place, books = self._place, self._place.books
            names = [t.name for t in self.tiers]
            tiers: list[str | None] = []
            held: list[bytes] = []
            metas = []
            for key in keys:
                hit = place.find(key)
                if hit is None:
                    tiers.append(None)
                    if stop_at_miss:
                        break
                    continue
                level, meta = hit
                meta.hold(deadline)
                tiers.append(names[level])
                held.append(key)
                metas.append(meta)
                if not chain:
                    books[level].policy.access(key)
            if chain:
                place.link_chain(held)
                for key, tier in reversed([(k, t) for k, t in zip(keys, tiers) if t is not None]):
                    books[place.levels[tier]].policy.access(key)
            return Lease(next(self._lease_ids), tuple(held), tuple(t for t in tiers if t), deadline, metas), tiers

    def release(self, lease: Lease) -> None:
        """End a lease. Raises InvalidArgument when it was released already."""
        with self._lock:
            if lease.released:
                raise InvalidArgument(f"lease {lease.id} was released already")
            lease.released = True
            for meta in lease._metas:
                meta.unhold()

    # -- pins ------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], hard: bool = False, ttl_s: float | None = None) -> int:
        """Pin the blocks of ``keys`` this node holds: ``hard`` (never evicted, until
        unpinned) or soft (evicted only as a last resort, for ``ttl_s``, default the pool's
        soft-pin TTL). A soft pin never weakens a hard one. Returns blocks pinned."""
        pin = Pin(True) if hard else Pin(False, time.monotonic() + (ttl_s or self.settings.soft_pin_ttl_s))
        with self._lock:
            return self._place.pin(keys, pin)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop the pins on ``keys``; returns how many there were."""
        with self._lock:
            return self._place.unpin(keys)

    def pin_prefix(self, chain: Sequence[bytes], hard: bool = False, ttl_s: float | None = None) -> int:
        """Pin the longest prefix of the chain this node holds; returns blocks pinned."""
        with self._lock:
            return self.pin(chain[:self.lookup(chain)[0]], hard, ttl_s)

    def unpin_prefix(self, chain: Sequence[bytes]) -> int:
        """Unpin the chain's blocks up to the first one this node does not hold."""
        with self._lock:
            n = next((i for i, k in enumerate(chain) if not self._place.held(k)), len(chain))
            return self.unpin(chain[:n])

    # -- admin -----------------------------------------------------------------------------
    def set_policy(self, name: str, tier: str | None = None) -> dict[str, str]:
        """Switch the eviction policy of ``tier`` (default: every tier) at run time, keeping
        the block order (frequency counts restart). Returns tier → previous policy. Raises
        InvalidArgument for an unknown policy or tier."""
        make_policy(name)
        with self._lock:
            levels = range(len(self.tiers)) if tier is None else [self._place.level_of(tier)]
            return {self.tiers[i].name: self._place.books[i].set_policy(make_policy(name)) for i in levels}

    def evict(self, tier_name: str, nbytes: int) -> tuple[int, int]:
        """Evict at least ``nbytes`` from ``tier_name`` in policy order (tails first,
        demoting; never leased or hard-pinned blocks). Returns (bytes, blocks) evicted."""
        with self._lock:
            level = self._place.level_of(tier_name)
            freed = blocks = 0
            while freed < nbytes:
                size = self._place.evict_victim(level)
                if size is None:
                    break
                freed, blocks = freed + size, blocks + 1
            return freed, blocks

    def remove(self, key: bytes) -> int:
        """Drop every copy of ``key`` on this node that is not leased; returns bytes freed."""
        with self._lock:
            now = time.monotonic()
            return sum(self._place.drop(level, key) for level, book in enumerate(self._place.books)
                       if key in book.blocks and not book.blocks[key].leased(now))

    def evictable_bytes(self, tier: str) -> int:
        """Bytes of the tier's committed blocks that are neither leased nor pinned."""
        with self._lock:
            return self._place.evictable_bytes(self._place.level_of(tier), time.monotonic())

    def stats(self) -> list[TierStats]:
        """Each tier's figures, fastest tier first (reaps timed-out reservations first)."""
        with self._lock:
            now = time.monotonic()
            self._writes.reap(now)
            return self._place.stats(now)

    def check_integrity(self) -> None:
        """Assert the pool's invariants (tests call this after mutations)."""
        with self._lock:
            self._place.check()
            for level, tier in enumerate(self.tiers):
                assert self._writes.reserved_bytes(level) == tier.usage().reserved_bytes

    def close(self) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.close()


def _result(key: bytes, r: PutResult | Exception) -> PutResult:
    return r if isinstance(r, PutResult) else PutResult(key, False, error=str(r))
