"""Per-tenant books of one pool: which namespace owns each block, what each namespace
holds (bytes, blocks), its hits, misses and quota evictions, and the hard byte quotas
(kvstore/quotas.py) enforced when a put reserves space.

A block key is a hash that already covers the tenant's namespace (kvstore/index/keys.py),
so the store cannot read a block's tenant off its key: a writer names it at put (the gRPC
``Put`` call's ``kvstore-namespace`` metadata, :data:`NAMESPACE_METADATA`). A block put
without one belongs to the unattributed namespace ``""``, which has no quota.

Accounting rules:
- a namespace's ``bytes`` count each of its blocks once, at its size, whichever tiers hold
  copies (demotion and promotion change no tenant's bytes); puts in flight count toward
  the quota too, so concurrent puts cannot overshoot it;
- a hit is a read that found a block the namespace owns; a miss is a read of a block the
  namespace held until it was evicted or removed (the last 65,536 such keys are
  remembered); a read of a key no one held is a miss of ``""``;
- a put that would take a namespace over its quota first evicts that namespace's own
  blocks (least recently used first, chain tails before their heads, never a leased or
  pinned one, every copy of each); when that cannot make room the put fails with
  :class:`QuotaExceeded`. Another namespace's blocks are never touched.

Every method runs under the pool's lock (the pool calls them; :func:`namespace_stats`
takes the lock itself).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import QuotaExceeded
from kvstore.quotas import QuotaStore

if TYPE_CHECKING:
    from kvstore.placement import Placement

NAMESPACE_METADATA = "kvstore-namespace"   # gRPC metadata naming the tenant of a Put's blocks
UNATTRIBUTED = ""
GONE_KEYS = 65536


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """One namespace on one node. ``bytes`` / ``blocks``: what it holds (each block once);
    ``tier_bytes``: tier name -> bytes of its copies there; ``hits`` / ``misses`` (see the
    module's rules); ``evictions``: its blocks evicted to keep it under its quota;
    ``rejected_puts``: puts refused by its quota; ``quota_bytes``: 0 when it has none."""

    namespace: str
    bytes: int
    blocks: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected_puts: int = 0
    quota_bytes: int = 0
    tier_bytes: dict[str, int] = field(default_factory=dict)


class TenantBooks:
    """The pool's per-namespace books (see the module docstring). ``quotas``: the node's
    quota store (in memory when None)."""

    def __init__(self, quotas: QuotaStore | None = None) -> None:
        self.quotas = quotas if quotas is not None else QuotaStore()
        self.owner: dict[bytes, str] = {}
        self.lru: dict[str, OrderedDict[bytes, int]] = {}    # namespace -> its keys (size), oldest first
        self.stored = Counter[str]()
        self.pending: dict[int, tuple[bytes, str, int]] = {}  # reservation id -> (key, namespace, size)
        self.pending_bytes = Counter[str]()
        self._claims: dict[bytes, str] = {}                    # key being written -> namespace
        self._claim_count = Counter[bytes]()
        self.hits = Counter[str]()
        self.misses = Counter[str]()
        self.evictions = Counter[str]()
        self.rejected = Counter[str]()
        self._gone: OrderedDict[bytes, str] = OrderedDict()

    # -- hooks of Placement (kvstore/placement.py) ------------------------------------------
    def held(self, key: bytes, size: int) -> None:
        if key in self.owner:
            return   # another copy (demotion, promotion) of a block it owns already
        ns = self._claims.get(key, UNATTRIBUTED)
        self.owner[key] = ns
        self.lru.setdefault(ns, OrderedDict())[key] = size
        self.stored[ns] += size
        self._gone.pop(key, None)

    def forgotten(self, key: bytes) -> None:
        ns = self.owner.pop(key, None)
        if ns is None:
            return
        size = self.lru[ns].pop(key, 0)
        self.stored[ns] -= size
        self._gone[key] = ns
        if len(self._gone) > GONE_KEYS:
            self._gone.popitem(last=False)

    def hit(self, key: bytes) -> None:
        ns = self.owner.get(key, UNATTRIBUTED)
        self.hits[ns] += 1
        keys = self.lru.get(ns)
        if keys is not None and key in keys:
            keys.move_to_end(key)

    def miss(self, key: bytes) -> None:
        self.misses[self._gone.get(key, UNATTRIBUTED)] += 1

    # -- hooks of Reservations (kvstore/reservations.py) ------------------------------------
    def before_reserve(self, place: Placement, key: bytes, size: int, namespace: str | None) -> None:
        """Make room for a new block of ``size`` bytes under ``namespace``'s quota, evicting
        its own blocks; raises QuotaExceeded when that cannot."""
        if not namespace:
            return
        quota = self.quotas.get(namespace)
        if quota is None:
            return
        if size > quota:
            self.rejected[namespace] += 1
            raise QuotaExceeded(f"namespace {namespace!r}: a block of {size} bytes exceeds its quota of "
                                f"{quota} bytes")
        while self.stored[namespace] + self.pending_bytes[namespace] + size > quota:
            victim = self._victim(place, namespace)
            if victim is None:
                self.rejected[namespace] += 1
                raise QuotaExceeded(
                    f"namespace {namespace!r} is at its quota of {quota} bytes ({self.stored[namespace]} stored, "
                    f"{self.pending_bytes[namespace]} being written) and none of its blocks can be evicted "
                    f"(leased or pinned); the {size}-byte block was not stored")
            self._drop_everywhere(place, victim)
            self.evictions[namespace] += 1

    def reserved(self, res_id: int, key: bytes, namespace: str | None, size: int) -> None:
        ns = namespace or UNATTRIBUTED
        self.pending[res_id] = (key, ns, size)
        self.pending_bytes[ns] += size
        self._claims.setdefault(key, ns)
        self._claim_count[key] += 1

    def settled(self, res_id: int) -> None:
        """A reservation committed, aborted or expired: its bytes are no longer pending."""
        entry = self.pending.pop(res_id, None)
        if entry is None:
            return
        key, ns, size = entry
        self.pending_bytes[ns] -= size
        self._claim_count[key] -= 1
        if self._claim_count[key] <= 0:
            del self._claim_count[key]
            self._claims.pop(key, None)

    # -- quota eviction ------------------------------------------------------------------------
    def _victim(self, place: Placement, namespace: str) -> bytes | None:
        """The namespace's least recently used block that may go: no leased or pinned copy;
        a block other held blocks extend only when no chain tail is left."""
        now = time.monotonic()
        keys: OrderedDict[bytes, int] = self.lru.get(namespace) or OrderedDict()
        fallback = None
        for key in keys:
            if not self._evictable(place, key, now):
                continue
            if any(book.kids.get(key) for book in place.books):
                fallback = fallback or key
                continue
            return key
        return fallback

    @staticmethod
    def _evictable(place: Placement, key: bytes, now: float) -> bool:
        pin = place.pins.get(key)
        if pin is not None and pin.active(now):
            return False
        return not any(key in book.blocks and book.blocks[key].leased(now) for book in place.books)

    @staticmethod
    def _drop_everywhere(place: Placement, key: bytes) -> None:
        for level, book in enumerate(place.books):
            if key in book.blocks:
                place.drop(level, key, evicted=True)
                book.counters.evictions += 1

    # -- figures -------------------------------------------------------------------------------
    def stats(self, place: Placement) -> dict[str, NamespaceStats]:
        quotas = self.quotas.all()
        names = set(self.stored) | set(self.hits) | set(self.misses) | set(quotas) | set(self.lru)
        out: dict[str, NamespaceStats] = {}
        for ns in sorted(names):
            keys: dict[bytes, int] = self.lru.get(ns) or {}
            tier_bytes = {t.name: 0 for t in place.tiers}
            for tier, book in zip(place.tiers, place.books):
                blocks = book.blocks
                tier_bytes[tier.name] = sum(blocks[k].size for k in keys if k in blocks)
            out[ns] = NamespaceStats(ns, self.stored[ns], len(keys), self.hits[ns], self.misses[ns],
                                     self.evictions[ns], self.rejected[ns], quotas.get(ns, 0), tier_bytes)
        return out


def attach(pool: Any, quotas: QuotaStore | None = None) -> TenantBooks:
    """Give a :class:`kvstore.pool.KVPool` tenant books (quotas from ``quotas``; in memory
    when None), replacing any it had; the blocks it holds already (an SSD tier's, kept
    across a restart) belong to ``""``."""
    books = TenantBooks(quotas)
    place = pool._place
    with pool._lock:
        for book in place.books:
            for key, meta in book.blocks.items():
                books.held(key, meta.size)
        place.tenants = books
    return books


def tenants_of(pool: Any) -> TenantBooks:
    """The pool's tenant books, attached (with an in-memory quota store) on first use."""
    with pool._lock:
        books = pool._place.tenants
    return books if books is not None else attach(pool)


def namespace_stats(pool: Any) -> dict[str, NamespaceStats]:
    """Per-namespace figures of a :class:`kvstore.pool.KVPool`: namespace (``""``: blocks
    put without one) -> :class:`NamespaceStats` (bytes, blocks, hits, misses, evictions,
    rejected_puts, quota_bytes, tier_bytes). Takes the pool's lock; O(blocks held)."""
    books = tenants_of(pool)
    with pool._lock:
        return books.stats(pool._place)
