"""The KV pool: tiers in order (fastest first), the prefix index, eviction with demotion to
the next tier, promotion on a lower-tier hit, leases, pins and the two-phase put.

Contracts (docs/architecture.md §3.1):
- a key is in the index for (node, tier) iff the tier holds its complete, committed bytes;
  a failed, aborted or timed-out put leaves no visible key and frees its space;
- leased and hard-pinned blocks are never evicted or overwritten, soft-pinned ones only as a
  last resort; lookups and existence checks renew nothing;
- a read that outlives its lease raises LeaseExpired, never returns another block's bytes;
- within one prefix chain, tails are evicted before heads;
- a put of an existing key is success and changes nothing.

Threading: one lock guards the books (index, ledgers, reservations); byte work runs
outside it — block bytes are copied under a reservation (writes) or a lease (reads), and a
slow tier's commit (an SSD transaction) of a put, a demotion or a promotion runs outside it
too (kvstore/pool/reservations.py, kvstore/pool/moves.py), so a slow tier never stalls reads of the
others.

The read side (reads, lookups, leases) is :class:`kvstore.pool.reads.PoolReads`.
"""
from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstore.errors import IntegrityError, InvalidArgument
from kvstore.index.prefix_index import PrefixIndex
from kvstore.integrity import checksum_of
from kvstore.pool.eviction import make_policy
from kvstore.pool.lease import Pin, Reservation
from kvstore.pool.moves import Mover
from kvstore.pool.placement import Placement
from kvstore.pool.reads import PROBE, PoolReads
from kvstore.pool.reservations import Reservations
from kvstore.pool.types import PoolSettings, PutResult, TierStats
from kvstore.tiers.base import Tier

__all__ = ["KVPool", "PoolSettings", "PutResult", "TierStats", "checksum_of"]


class KVPool(PoolReads):
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
        self._mover = Mover(self._place, self._lock)
        self._writes = Reservations(self._place, self._lock, self.settings.reservation_timeout_s, self._mover)
        self._lease_ids = itertools.count(1)
        for level, tier in enumerate(self.tiers):
            tier.on_lost = functools.partial(self._tier_lost, level)
        with self._lock:
            self._place.load()
        self._mover.settle()

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
        block belongs to (kvstore/pool/tenants.py); over its quota, its own blocks are evicted
        first, and QuotaExceeded is raised when they cannot make room."""
        return self._writes.reserve(key, size, checksum, self._place.level_of(tier), parent, namespace)

    def reserve_many(self, items: Sequence[tuple[bytes, int, bytes | None]], tier: str | None = None,
                     namespace: str | None = None) -> list[Reservation | Exception]:
        """:meth:`reserve` of each (key, size, parent) in ``tier``, in one hold of the lock
        where no move has to be settled between them: per item the reservation or the
        exception that refused it (after a QuotaExceeded, the rest are refused with it)."""
        return self._writes.reserve_many(items, self._place.level_of(tier), namespace)

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

    def commit_filled(self, items: Sequence[tuple[Reservation, int | None]]) -> list[PutResult | Exception]:
        """:meth:`mark_filled` + :meth:`commit` of several reservations of one tier (a
        same-host writer's COMMIT frame) in one batch: per item the PutResult or the
        exception that failed it (that reservation is aborted)."""
        return self._writes.commit_filled(items)

    def abort(self, res: Reservation) -> None:
        """Give the reservation's space back (idempotent; a no-op once committed)."""
        self._writes.abort(res)

    def claim(self, res: Reservation, namespace: str) -> None:
        """Make ``namespace`` the tenant of an open reservation under its current key (a
        same-host writer's spare slot, reserved before its tenant was known, named at
        commit). A reservation of another tenant moves to this one only if its quota
        takes the block (its own blocks evicted first); raises QuotaExceeded when it
        cannot, ReservationExpired when ``res`` is no longer open."""
        self._writes.claim(res, namespace)

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
        self._mover.settle()
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

    # -- pins ------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], hard: bool = False, ttl_s: float | None = None) -> int:
        """Pin the blocks of ``keys`` this node holds: ``hard`` (never evicted, until
        unpinned) or soft (evicted only as a last resort, for ``ttl_s``, default the pool's
        soft-pin TTL). A soft pin never weakens a hard one. Returns distinct blocks pinned."""
        pin = Pin(True) if hard else Pin(False, time.monotonic() + (ttl_s or self.settings.soft_pin_ttl_s))
        with self._lock:
            return self._place.pin(keys, pin)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop the pins on ``keys``; returns how many there were."""
        with self._lock:
            return self._place.unpin(keys)

    def pin_prefix(self, chain: Sequence[bytes], hard: bool = False, ttl_s: float | None = None) -> int:
        """Pin the longest prefix of the chain this node holds; returns distinct blocks
        pinned (a chain that names a block twice counts it once)."""
        with self._lock:
            return self.pin(chain[:self.lookup(chain, PROBE).blocks], hard, ttl_s)

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
        self._mover.settle()
        return freed, blocks

    def remove(self, key: bytes) -> int:
        """Drop every copy of ``key`` on this node that is not leased; returns bytes freed."""
        with self._lock:
            now = time.monotonic()
            freed = sum(self._place.drop(level, key) for level, book in enumerate(self._place.books)
                        if key in book.blocks and not book.blocks[key].leased(now))
        self._mover.settle()
        return freed

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
                assert self._writes.reserved_bytes(level) + self._place.move_bytes(level) == \
                    tier.usage().reserved_bytes

    def close(self) -> None:
        self._mover.settle()
        with self._lock:
            for tier in self.tiers:
                tier.close()


def _result(key: bytes, r: PutResult | Exception) -> PutResult:
    return r if isinstance(r, PutResult) else PutResult(key, False, error=str(r))
