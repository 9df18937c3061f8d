"""Per-tenant books of one pool: which namespace owns each block, what each namespace
holds (bytes, blocks), its hits, misses and quota evictions, and the hard byte quotas
(kvstore/pool/quotas.py) enforced when a put reserves space.

A block key is a hash that already covers the tenant's namespace (kvstore/index/keys.py),
so the store cannot read a block's tenant off its key: a writer names it at put (the gRPC
``Put`` call's ``kvstore-namespace`` metadata, :data:`NAMESPACE_METADATA`; the same-host
RESERVE and COMMIT frames; ``ReserveBlocks`` / ``CommitBlocks``). A same-host spare slot is
reserved unattributed and gets its tenant at commit (:meth:`TenantBooks.claim`). A block put
without one belongs to the unattributed namespace ``""``, which has no quota.

Accounting rules:
- a namespace's ``bytes`` count each of its blocks once, at the whole 4 KiB pages it takes
  (:func:`charge`: what it takes of a DRAM slab, so no block, not even an empty one, is
  free and a quota bounds what a tenant takes of the slab), whichever tiers hold copies
  (demotion and promotion change no tenant's bytes); puts in flight count toward
  the quota too, so concurrent puts cannot overshoot it;
- a hit is a read that found a block the namespace owns; a miss is a read of a block the
  namespace held until it was evicted or removed (the last 65,536 such keys are
  remembered); a read of a key no one held is a miss of ``""``; hits over hits and misses
  is the namespace's read success, not its reuse;
- a lookup hit is a block of the namespace found by a reuse lookup
  (:meth:`kvstore.pool.reads.PoolReads.lookup`); the blocks of a looked-up chain past the
  prefix held are lookup misses of the namespace the lookup names (the engines name the
  request's tenant), else of the chain's (the owner of the last block found, else the
  namespace that held its first block until it went, else ``""``); lookup hits over lookup
  hits and misses is its reuse;
- a put that would take a namespace over its quota first evicts that namespace's own
  blocks (in the tiers' eviction order, the slowest tier first, chain tails before their
  heads, never a leased or pinned one, every copy of each); when that cannot make room the put fails with
  :class:`QuotaExceeded`. Another namespace's blocks are never touched.

A namespace holding nothing (no block, no put in flight) and without a quota is forgotten,
its counters with it, once the node knows :data:`IDLE_NAMESPACES` namespaces: a
client naming a namespace per request (``req-0``, ``req-1``, ...) would otherwise grow the
books and every ``/metrics`` page without bound (3,000 such namespaces, their blocks
evicted, had left 24,000 series). A namespace that holds blocks is never forgotten.

Every method runs under the pool's lock (the pool calls them; :func:`namespace_stats`
takes the lock itself).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import QuotaExceeded
from kvstore.pool.quotas import QuotaStore
from kvstore.tiers.slab import page_footprint

if TYPE_CHECKING:
    from kvstore.pool.placement import Placement

# Bytes a block of ``size`` bytes counts against its tenant: its whole 4 KiB pages, at least one.
charge = page_footprint


NAMESPACE_METADATA = "kvstore-namespace"   # gRPC metadata naming the tenant of a Put's blocks
UNATTRIBUTED = ""
GONE_KEYS = 65536
IDLE_NAMESPACES = 1024   # namespaces known at which those holding nothing are forgotten


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """One namespace on one node. ``bytes`` / ``blocks``: what it holds (each block once);
    ``tier_bytes``: tier name -> bytes of its copies there; ``hits`` / ``misses``: reads
    (their ratio: read success), ``lookup_hits`` / ``lookup_misses``: blocks of reuse
    lookups (their ratio: reuse; see the module's rules); ``evictions``: its blocks evicted to keep it under its quota;
    ``rejected_puts``: puts refused by its quota; ``quota_bytes``: None when it has none (0
    is a quota, one that refuses every put)."""

    namespace: str
    bytes: int
    blocks: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected_puts: int = 0
    quota_bytes: int | None = None
    tier_bytes: dict[str, int] = field(default_factory=dict)
    lookup_hits: int = 0
    lookup_misses: int = 0


class _Tenant:
    """One namespace's books: its keys (size each) and counters."""

    __slots__ = ("evictions", "hits", "keys", "lookup_hits", "lookup_misses", "misses", "name", "pending",
                 "rejected", "stored")

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys: dict[bytes, int] = {}
        self.stored = self.pending = self.hits = self.misses = self.evictions = self.rejected = 0
        self.lookup_hits = self.lookup_misses = 0


class TenantBooks:
    """The pool's per-namespace books (see the module docstring). ``quotas``: the node's
    quota store (in memory when None). A read costs one dict lookup and one counter per
    block here; quota victims are found in the tiers' own eviction order."""

    def __init__(self, quotas: QuotaStore | None = None) -> None:
        self.quotas = quotas if quotas is not None else QuotaStore()
        self.tenants: dict[str, _Tenant] = {UNATTRIBUTED: _Tenant(UNATTRIBUTED)}
        self._none = self.tenants[UNATTRIBUTED]
        self.owner: dict[bytes, _Tenant] = {}
        self.pending: dict[int, tuple[bytes, _Tenant, int]] = {}  # reservation id -> (key, tenant, size)
        self._claims: dict[bytes, _Tenant] = {}                    # key being written -> its tenant
        self._claim_count = Counter[bytes]()
        self._gone: OrderedDict[bytes, _Tenant] = OrderedDict()
        self._sweep_at = IDLE_NAMESPACES

    def _tenant(self, namespace: str | None) -> _Tenant:
        if not namespace:
            return self._none
        t = self.tenants.get(namespace)
        if t is None:
            if len(self.tenants) >= self._sweep_at:
                self._forget_idle()
            t = self.tenants[namespace] = _Tenant(namespace)
        return t

    def _forget_idle(self) -> None:
        """Forget the namespaces holding nothing that have no quota (module docstring); the
        next sweep waits until the books have doubled, so sweeps cost O(1) a new namespace."""
        quotas = self.quotas.all()
        idle = [ns for ns, t in self.tenants.items()
                if ns != UNATTRIBUTED and not t.keys and not t.pending and ns not in quotas]
        for ns in idle:
            del self.tenants[ns]
        self._sweep_at = max(IDLE_NAMESPACES, 2 * len(self.tenants))

    def writer_of(self, key: bytes) -> str:
        """The namespace a block being written to a tier belongs to: its owner, else the
        tenant of a put in flight of it (``""``: none). What an SSD tier records with the
        block (``SsdTier.owner_of``); called outside the pool's lock (dict reads only)."""
        t = self.owner.get(key) or self._claims.get(key)
        return UNATTRIBUTED if t is None else t.name

    def namespace_of(self, key: bytes) -> str:
        """The namespace owning a held block (``""`` for one put without a namespace)."""
        t = self.owner.get(key)
        return UNATTRIBUTED if t is None else t.name

    def used(self, namespace: str) -> int:
        """Bytes the namespace holds (each block once)."""
        t = self.tenants.get(namespace)
        return 0 if t is None else t.stored

    def pending_of(self, namespace: str) -> int:
        """Bytes of the namespace's puts in flight."""
        t = self.tenants.get(namespace)
        return 0 if t is None else t.pending

    # -- hooks of Placement (kvstore/pool/placement.py) ------------------------------------------
    def held(self, key: bytes, size: int) -> None:
        if key in self.owner:
            return   # another copy (demotion, promotion) of a block it owns already
        t = self._claims.get(key, self._none)
        self.owner[key] = t
        size = charge(size)
        t.keys[key] = size
        t.stored += size
        self._gone.pop(key, None)

    def forgotten(self, key: bytes) -> None:
        t = self.owner.pop(key, None)
        if t is None:
            return
        t.stored -= t.keys.pop(key, 0)
        self._gone[key] = t
        if len(self._gone) > GONE_KEYS:
            self._gone.popitem(last=False)

    def hit(self, key: bytes) -> None:
        (self.owner.get(key) or self._none).hits += 1

    def miss(self, key: bytes) -> None:
        t = self._gone.get(key, self._none)
        (self.tenants.get(t.name) or t).misses += 1   # t forgotten while idle: its namespace's books now

    def looked_up(self, keys: Sequence[bytes], found: int, namespace: str | None = None) -> None:
        """A reuse lookup of the chain ``keys`` by tenant ``namespace`` (None: not said)
        found its first ``found`` blocks: each a lookup hit of its owner; the rest misses of
        ``namespace``, else of the chain's namespace — the owner of the last block found,
        else the namespace that held the first block until it went, else ``""``."""
        for key in keys[:found]:
            (self.owner.get(key) or self._none).lookup_hits += 1
        if found < len(keys):
            t = self._tenant(namespace) if namespace else None
            if t is None and found:
                t = self.owner.get(keys[found - 1])
            if t is None:
                gone = self._gone.get(keys[found], self._none)
                t = self.tenants.get(gone.name) or gone
            t.lookup_misses += len(keys) - found

    # -- hooks of Reservations (kvstore/pool/reservations.py) ------------------------------------
    def before_reserve(self, place: Placement, key: bytes, size: int, namespace: str | None) -> None:
        """Make room for a new block of ``size`` bytes under ``namespace``'s quota, evicting
        its own blocks; raises QuotaExceeded when that cannot — before evicting any when its
        pinned blocks alone leave no room (a put refused anyway takes nothing with it)."""
        if not namespace:
            return
        quota = self.quotas.get(namespace)
        if quota is None:
            return
        t = self._tenant(namespace)
        size = charge(size)
        if size > quota:
            t.rejected += 1
            raise QuotaExceeded(f"namespace {namespace!r}: a block taking {size} bytes (whole 4 KiB pages) "
                                f"exceeds its quota of {quota} bytes")
        if t.stored + t.pending + size > quota:
            now, owner, keys = time.monotonic(), self.owner, t.keys
            pinned = sum(keys.get(k, 0) for k, pin in place.pins.items() if owner.get(k) is t and pin.active(now))
            if pinned + t.pending + size > quota:
                t.rejected += 1
                raise QuotaExceeded(
                    f"namespace {namespace!r} is at its quota of {quota} bytes ({t.stored} stored, {pinned} of "
                    f"them pinned, {t.pending} being written): evicting every block it may would not make "
                    f"room; the {size}-byte block was not stored and nothing was evicted")
        while t.stored + t.pending + size > quota:
            victim = self._victim(place, t)
            if victim is None:
                t.rejected += 1
                raise QuotaExceeded(
                    f"namespace {namespace!r} is at its quota of {quota} bytes ({t.stored} stored, "
                    f"{t.pending} being written) and none of its blocks can be evicted "
                    f"(leased or pinned); the {size}-byte block was not stored")
            self._drop_everywhere(place, victim)
            t.evictions += 1

    def reserved(self, res_id: int, key: bytes, namespace: str | None, size: int) -> None:
        t = self._tenant(namespace)
        size = charge(size)
        self.pending[res_id] = (key, t, size)
        t.pending += size
        self._claims.setdefault(key, t)
        self._claim_count[key] += 1

    def claim(self, place: Placement, res_id: int, key: bytes, size: int, namespace: str) -> None:
        """The open reservation ``res_id`` of ``size`` bytes commits as ``key`` for
        ``namespace`` (a spare slot reserved unattributed, named at commit): its pending
        bytes move to that tenant, once its quota takes them (:meth:`before_reserve`;
        raises QuotaExceeded). One reserved before these books were attached is taken in
        the same way."""
        t = self._tenant(namespace)
        entry = self.pending.get(res_id)
        if entry is not None:
            old_key, old, size = entry
            if old is t and old_key == key:
                return
        if entry is None or entry[1] is not t:
            self.before_reserve(place, key, size, namespace)
        self.settled(res_id)
        self.reserved(res_id, key, namespace, size)

    def committing(self, res_id: int) -> None:
        """The reservation ``res_id`` commits its key now: the block belongs to its tenant,
        not to that of another put of the same key reserved earlier (which may still be
        open, or be aborted: the block was booked to a tenant that never stored it, and that
        tenant's quota could then evict it)."""
        entry = self.pending.get(res_id)
        if entry is not None:
            self._claims[entry[0]] = entry[1]

    def settled(self, res_id: int) -> None:
        """A reservation committed, aborted or expired: its bytes are no longer pending."""
        entry = self.pending.pop(res_id, None)
        if entry is None:
            return
        key, t, size = entry
        t.pending -= size
        self._claim_count[key] -= 1
        if self._claim_count[key] <= 0:
            del self._claim_count[key]
            self._claims.pop(key, None)

    # -- quota eviction ------------------------------------------------------------------------
    def _victim(self, place: Placement, tenant: _Tenant) -> bytes | None:
        """The tenant's block to evict: the slowest tier's eviction policy's choice among the
        tenant's blocks with no leased or pinned copy (its chain rule too: tails before
        heads), then the next faster tier's."""
        now = time.monotonic()
        owner = self.owner

        def eligible(key: bytes) -> bool:
            return owner.get(key) is tenant and self._evictable(place, key, now)
        for book in reversed(place.books):
            key = book.victim(eligible)
            if key is not None:
                return key
        return None

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
        for ns in quotas:
            self._tenant(ns)
        out: dict[str, NamespaceStats] = {}
        for ns in sorted(self.tenants):
            t = self.tenants[ns]
            if ns == UNATTRIBUTED and not (t.keys or t.hits or t.misses or t.lookup_hits or t.lookup_misses):
                continue
            tier_bytes = {}
            for tier, book in zip(place.tiers, place.books):
                blocks = book.blocks
                fp = tier.footprint    # what its copies take there, in the tier's used_bytes unit
                tier_bytes[tier.name] = sum(fp(blocks[k].size) for k in t.keys if k in blocks)
            out[ns] = NamespaceStats(ns, t.stored, len(t.keys), t.hits, t.misses, t.evictions, t.rejected,
                                     quotas.get(ns), tier_bytes, t.lookup_hits, t.lookup_misses)
        return out


def attach(pool: Any, quotas: QuotaStore | None = None) -> TenantBooks:
    """Give a :class:`kvstore.pool.pool.KVPool` tenant books (quotas from ``quotas``; in memory
    when None), replacing any it had. The blocks it holds already (an SSD tier's, kept
    across a restart) belong to the namespace the tier recorded with them
    (``recovered_owners``), else to ``""``; a tier that records owners is told where to
    read them from now on (``owner_of``)."""
    books = TenantBooks(quotas)
    place = pool._place
    with pool._lock:
        for tier, book in zip(place.tiers, place.books):
            recovered: dict[bytes, str] = getattr(tier, "recovered_owners", None) or {}
            for key, meta in book.blocks.items():
                ns = recovered.get(key)
                if ns and key not in books.owner:
                    books._claims[key] = books._tenant(ns)
                books.held(key, meta.size)
                books._claims.pop(key, None)
            if hasattr(tier, "owner_of"):
                tier.owner_of = books.writer_of
        place.tenants = books
    return books


def tenants_of(pool: Any) -> TenantBooks:
    """The pool's tenant books, attached (with an in-memory quota store) on first use."""
    with pool._lock:
        books = pool._place.tenants
    return books if books is not None else attach(pool)


def namespace_stats(pool: Any) -> dict[str, NamespaceStats]:
    """Per-namespace figures of a :class:`kvstore.pool.pool.KVPool`: namespace (``""``: blocks
    put without one) -> :class:`NamespaceStats` (bytes, blocks, hits, misses, evictions,
    rejected_puts, quota_bytes, tier_bytes). Takes the pool's lock; O(blocks held)."""
    books = tenants_of(pool)
    with pool._lock:
        return books.stats(pool._place)
