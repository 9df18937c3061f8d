"""Where blocks live: the books of every tier of a pool and the rules that move blocks
between tiers — making room under the watermarks, picking victims (leases, pins, chain
order), demoting on eviction, promoting on a lower-tier hit, dropping (index first).

Every method expects the pool's lock to be held. Byte work that is slow — a slow tier's
commit of a demoted block, a promotion's copy — is planned here as a
:class:`kvstore.pool.moves.Move` and done by :class:`kvstore.pool.moves.Mover` outside the lock.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvstore.errors import CapacityError, IntegrityError, InvalidArgument, KVStoreError
from kvstore.index.prefix_index import PrefixIndex
from kvstore.pool.eviction import make_policy
from kvstore.pool.lease import Pin
from kvstore.pool.ledger import BlockMeta, TierLedger
from kvstore.pool.moves import Move
from kvstore.pool.types import PoolSettings, TierStats
from kvstore.tiers.base import Slot, Tier

log = logging.getLogger(__name__)


class TenantHooks(Protocol):
    """What :class:`Placement` tells the tenant books (kvstore/pool/tenants.py), under the lock."""

    def held(self, key: bytes, size: int) -> None: ...
    def forgotten(self, key: bytes) -> None: ...
    def hit(self, key: bytes) -> None: ...
    def miss(self, key: bytes) -> None: ...
    def looked_up(self, keys: Sequence[bytes], found: int, namespace: str | None) -> None: ...   # pool_reads.py
    # ... and what the reservations tell them, under the same lock (kvstore/pool/reservations.py)
    def before_reserve(self, place: Placement, key: bytes, size: int, namespace: str | None) -> None: ...
    def reserved(self, res_id: int, key: bytes, namespace: str | None, size: int) -> None: ...
    def settled(self, res_id: int) -> None: ...
    def committing(self, res_id: int) -> None: ...
    def claim(self, place: Placement, res_id: int, key: bytes, size: int, namespace: str) -> None: ...


class Placement:
    """The books of a pool's tiers (fastest first), its pins and its chain links.

    Invariants: a key is in the index for (node, tier) iff that tier's ledger holds it; a
    pin or a chain link exists only for a key held somewhere or moving; the links form no
    cycle. ``inflight``: (level, key) of every block being committed to a slow tier or
    moved (its target slot, None for a put's); at most one each. ``moves``: planned moves
    not yet taken by a :class:`kvstore.pool.moves.Mover`; ``dirty``: levels whose tier deferred
    work to :meth:`Tier.flush`.
    """

    def __init__(self, tiers: Sequence[Tier], index: PrefixIndex, node_id: str,
                 settings: PoolSettings) -> None:
        self.tiers = list(tiers)
        self.index = index
        self.node_id = node_id
        self.settings = settings
        self.parents: dict[bytes, bytes] = {}
        self.books = [TierLedger(t, make_policy(settings.policy), self.parents) for t in self.tiers]
        self.levels = {t.name: i for i, t in enumerate(self.tiers)}
        self.pins: dict[bytes, Pin] = {}
        self.inflight: dict[tuple[int, bytes], Slot | None] = {}
        self.moves: list[Move] = []
        self.dirty: set[int] = set()
        # Per-tenant books (kvstore/pool/tenants.py): told of every block newly held, forgotten,
        # hit or missed. None: no tenant accounting.
        self.tenants: TenantHooks | None = None

    def load(self) -> None:
        """Index the blocks persistent tiers kept across a restart; evict down to capacity
        where a tier holds more than its (possibly smaller) capacity now."""
        for level, tier in enumerate(self.tiers):
            for key, _ in tier.keys():
                size, checksum = tier.info(key)  # type: ignore[misc]
                self.admit(level, key, BlockMeta(size, checksum))
            self.evict_until(level, lambda: tier.used_bytes <= tier.capacity_bytes)  # noqa: B023 (called at once)

    def level_of(self, name: str | None) -> int:
        if name is None:
            return 0
        try:
            return self.levels[name]
        except KeyError:
            raise InvalidArgument(f"no tier {name!r} on this node; tiers: {list(self.levels)}") from None

    def held(self, key: bytes) -> bool:
        for book in self.books:
            if key in book.blocks:
                return True
        return False

    def moving(self, key: bytes) -> bool:
        """Whether ``key`` is being committed or moved into some tier."""
        inflight = self.inflight
        return bool(inflight) and any((level, key) in inflight for level in range(len(self.books)))

    def find(self, key: bytes, below: int | None = None) -> tuple[int, BlockMeta] | None:
        """The fastest tier holding ``key`` and its copy's books, counting a miss on each
        faster tier and a hit on that one; None (a miss everywhere) when none holds it.
        ``below``: a copy found in a tier slower than this level is returned uncounted —
        the caller's reader does not read it, and the read that does counts it."""
        for level, book in enumerate(self.books):
            meta = book.blocks.get(key)
            if meta is not None:
                if level:
                    if below is not None and level > below:
                        return level, meta
                    for faster in self.books[:level]:
                        faster.counters.misses += 1
                book.counters.hits += 1
                if self.tenants is not None:
                    self.tenants.hit(key)
                return level, meta
        for book in self.books:
            book.counters.misses += 1
        if self.tenants is not None:
            self.tenants.miss(key)
        return None

    # -- room and eviction -----------------------------------------------------------------
    def check_fits(self, level: int, size: int) -> None:
        """Raises CapacityError when a ``size``-byte block is larger than tier ``level``
        itself: no eviction could make room, so none may be made."""
        tier = self.tiers[level]
        if size > tier.capacity_bytes:
            raise CapacityError(f"{tier.name}: a {size}-byte block exceeds the tier's capacity "
                                f"of {tier.capacity_bytes} bytes")

    def make_room(self, level: int, size: int) -> Slot:
        """Reserve ``size`` bytes in tier ``level``: above the high watermark, evict down to
        the low one first; then evict until the tier finds a run of that size. Raises
        CapacityError when the block cannot fit — before evicting anything when it is larger
        than the tier (:meth:`check_fits`)."""
        self.check_fits(level, size)
        tier = self.tiers[level]
        cap, fp = tier.capacity_bytes, tier.footprint(size)
        if tier.used_bytes + fp > self.settings.high_watermark * cap:
            target = max(0.0, self.settings.low_watermark * cap - fp)
            self.evict_until(level, lambda: tier.used_bytes <= target)
        while True:
            slot = tier.reserve(size)
            if slot is not None:
                return slot
            if self.evict_victim(level) is None:
                raise CapacityError(f"{tier.name}: cannot free {size} bytes; everything left is "
                                    f"leased, pinned or being written")

    def evict_until(self, level: int, done: Callable[[], bool]) -> None:
        while not done() and self.evict_victim(level) is not None:
            pass

    def evictable(self, key: bytes, meta: BlockMeta, now: float, last_resort: bool) -> bool:
        if meta.leased(now):
            return False
        pin = self.pins.get(key)
        return pin is None or not pin.holds(now, last_resort)

    def evict_victim(self, level: int) -> int | None:
        """Evict one block from ``level`` (a soft-pinned one only when nothing else can go);
        returns its size, or None when nothing is evictable."""
        book = self.books[level]
        now = time.monotonic()
        for last_resort in (False, True):
            key = book.victim(lambda k: self.evictable(k, book.blocks[k], now, last_resort))  # noqa: B023 (called at once)
            if key is not None:
                return self.evict(level, key)
        return None

    def evict(self, level: int, key: bytes) -> int:
        """Evict ``key`` from ``level``, demoting it to the next tier when it fits there.
        Returns the bytes of the tier it freed (its footprint there, as ``used_bytes``
        counts)."""
        book = self.books[level]
        meta = book.blocks[key]
        if level + 1 < len(self.tiers):
            self.demote(level, key, meta)
        self.drop(level, key, evicted=True)
        book.counters.evictions += 1
        return self.tiers[level].footprint(meta.size)

    def drop(self, level: int, key: bytes, evicted: bool = False) -> int:
        """Forget one copy: index first, then the bytes, so it is invisible before its space
        can be reused. Returns the bytes freed."""
        self.index.remove(key, self.node_id, self.tiers[level].name)
        freed = self.tiers[level].remove(key)
        if self.tiers[level].slow_commit:
            self.dirty.add(level)
        self.books[level].drop(key, evicted)
        self._forget_if_gone(key)
        return freed

    def _forget_if_gone(self, key: bytes) -> None:
        """A key held nowhere and moving nowhere loses its pin, its chain link and its
        tenant (a block on its way to another tier keeps them)."""
        if not self.held(key) and not self.moving(key):
            self.pins.pop(key, None)
            self.parents.pop(key, None)
            if self.tenants is not None:
                self.tenants.forgotten(key)

    def release_slot(self, level: int, slot: Slot) -> None:
        """Give a reserved slot back to tier ``level``."""
        self.tiers[level].abort(slot)
        if self.tiers[level].slow_commit:
            self.dirty.add(level)

    def corrupt(self, level: int, key: bytes, meta: BlockMeta | None) -> None:
        """The copy ``meta`` of ``key`` in ``level`` failed its checksum: count it, log it,
        drop it (a miss from now on)."""
        book = self.books[level]
        book.counters.integrity_failures += 1
        log.warning("block %s in tier %s failed its checksum: damaged data, dropped (a miss)",
                    key.hex()[:16], self.tiers[level].name)
        if key in book.blocks and (meta is None or book.blocks[key] is meta):
            self.drop(level, key)

    # -- moves between tiers ---------------------------------------------------------------
    def _room_for(self, dst: int, meta: BlockMeta) -> Slot | None:
        """A slot in ``dst`` for a copy of ``meta``'s block (held meanwhile, so making room
        cannot evict it); None when it cannot fit."""
        meta.moves += 1
        try:
            return self.make_room(dst, meta.size)
        except CapacityError:
            return None
        finally:
            meta.moves -= 1

    def demote(self, level: int, key: bytes, meta: BlockMeta) -> None:
        """Copy an evicted block to the next tier, with the checksum taken at put, when it
        fits there (nothing when it cannot go: no room, a failed write, a corrupt source).
        Into a slow tier the bytes go to a private buffer of the slot now and the commit is
        planned as a move (the source's space is freed by the caller)."""
        dst = level + 1
        if key in self.books[dst].blocks or (dst, key) in self.inflight:
            return
        slot = self._room_for(dst, meta)
        if slot is None:
            return
        target = self.tiers[dst]
        slow = target.slow_commit
        try:
            ok = self.tiers[level].read(key, lambda view: target.write(slot, 0, _owned(view) if slow else view)
                                        or True)
        except (OSError, KVStoreError) as exc:
            ok = False
            if isinstance(exc, IntegrityError):
                self.books[level].counters.integrity_failures += 1
                log.warning("block %s in tier %s failed its checksum while demoted: damaged data, dropped "
                            "(not demoted)", key.hex()[:16], self.tiers[level].name)
        if ok and slow:
            self.inflight[(dst, key)] = slot
            self.moves.append(Move(level, dst, key, slot, meta.size, meta.checksum))
            return
        if ok:
            try:
                target.commit(slot, key, meta.checksum)
            except OSError:
                ok = False
        if not ok:
            self.release_slot(dst, slot)
            return
        self.admit(dst, key, BlockMeta(meta.size, meta.checksum))
        self.books[level].counters.demotions += 1

    def promote(self, level: int, key: bytes) -> None:
        """Plan a copy of a block hit in a lower tier to the top tier (keeping the lower
        copy, held until the move is published)."""
        meta = self.books[level].blocks.get(key)
        if meta is None or key in self.books[0].blocks or (0, key) in self.inflight:
            return
        slot = self._room_for(0, meta)
        if slot is None:
            return
        meta.moves += 1
        self.inflight[(0, key)] = slot
        self.moves.append(Move(level, 0, key, slot, meta.size, meta.checksum, meta))

    def publish(self, move: Move) -> None:
        """Finish a move whose byte work is done: index and book the target copy, or give
        its slot back when the work failed or the source changed meanwhile."""
        self.inflight.pop((move.dst, move.key), None)
        book = self.books[move.src]
        if move.meta is not None:
            move.meta.moves -= 1
            if book.blocks.get(move.key) is not move.meta:
                move.error = move.error or KVStoreError("the source copy went while it was copied")
        ok = move.error is None and move.key not in self.books[move.dst].blocks
        if ok:
            try:
                self.tiers[move.dst].commit(move.slot, move.key, move.checksum)
            except OSError:
                ok = False
        if not ok:
            self.release_slot(move.dst, move.slot)
            self._forget_if_gone(move.key)
            return
        self.admit(move.dst, move.key, BlockMeta(move.size, move.checksum))
        if move.meta is None:
            book.counters.demotions += 1
        else:
            book.counters.promotions += 1

    def move_bytes(self, level: int) -> int:
        """Bytes of the slots reserved in ``level`` for moves in flight."""
        fp = self.tiers[level].footprint
        return sum(fp(slot.size) for (lvl, _), slot in self.inflight.items() if lvl == level and slot is not None)

    def admit(self, level: int, key: bytes, meta: BlockMeta) -> None:
        if self.tenants is not None:
            self.tenants.held(key, meta.size)
        self.books[level].add(key, meta)
        self.index.add(key, self.node_id, self.tiers[level].name, meta.size, meta.checksum)

    def link(self, child: bytes, parent: bytes) -> None:
        """Record that ``child`` extends ``parent`` in a prefix chain (ignored when it would
        close a cycle, which chained keys never do)."""
        old = self.parents.get(child)
        if old == parent or child == parent:
            return
        # A cycle needs ``child`` to be an ancestor of ``parent``, so a child with no
        # children of its own (every new block of a chain) needs no walk up.
        node: bytes | None = parent
        for _ in range(1 << 16 if any(child in book.kids for book in self.books) else 0):
            node = self.parents.get(node)  # type: ignore[arg-type]
            if node is None:
                break
            if node == child:
                return
        self.parents[child] = parent
        for book in self.books:
            book.link(child, parent, old)

    def link_chain(self, keys: Sequence[bytes]) -> None:
        for parent, child in zip(keys, keys[1:]):
            self.link(child, parent)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], pin: Pin) -> int:
        """Pin the held blocks among ``keys``; a soft pin never weakens a hard one and only
        extends another soft one. Returns blocks pinned (a key named twice counts once, as
        :meth:`unpin` counts)."""
        n = 0
        for key in dict.fromkeys(keys):
            if self.held(key):
                old = self.pins.get(key)
                if old is None or pin.hard:
                    self.pins[key] = pin
                elif not old.hard:
                    self.pins[key] = Pin(False, max(old.until, pin.until))
                n += 1
        return n

    def unpin(self, keys: Sequence[bytes]) -> int:
        return sum(self.pins.pop(k, None) is not None for k in keys)

    # -- figures ---------------------------------------------------------------------------
    def stats(self, now: float) -> list[TierStats]:
        out = []
        for tier, book in zip(self.tiers, self.books):
            u = tier.usage()
            fp = tier.footprint        # in the unit of used_bytes
            leased = sum(fp(m.size) for m in book.blocks.values() if m.leased(now))
            pinned = sum(fp(book.blocks[k].size) for k, p in self.pins.items()
                         if k in book.blocks and p.active(now))
            out.append(TierStats(tier.name, tier.device, u.capacity_bytes, u.used_bytes, u.blocks,
                                 **book.counters.as_dict(), leased_bytes=leased, pinned_bytes=pinned,
                                 reserved_bytes=u.reserved_bytes, policy=book.policy.name,
                                 quarantines=tier.quarantines))
        return out

    def evictable_bytes(self, level: int, now: float) -> int:
        fp = self.tiers[level].footprint
        return sum(fp(m.size) for k, m in self.books[level].blocks.items()
                   if not m.leased(now) and not (k in self.pins and self.pins[k].active(now)))

    def check(self) -> None:
        for tier, book in zip(self.tiers, self.books):
            book.check()
            for key in book.blocks:
                entry = self.index.entry(key)
                assert entry is not None and tier.name in entry.locations.get(self.node_id, ()), \
                    f"{tier.name} holds {key.hex()[:16]} but the index does not say so"
        assert all(self.held(k) or self.moving(k) for k in self.pins), "a pin outlived its block"
        assert all(self.held(k) or self.moving(k) for k in self.parents), "a chain link outlived its block"


def _owned(view: object) -> object:
    """A copy of a tier's view that outlives the source's space (numpy or a tensor)."""
    return view.copy() if isinstance(view, np.ndarray) else view.clone()  # type: ignore[attr-defined]
