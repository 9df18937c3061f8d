"""The store side of the same-host data plane: lends locations in the DRAM tier's slab under
leases (reads) and slab space under reservations (writes), for clients that copy the bytes
themselves. The gRPC servicer and the Unix-socket server both call this one object."""
from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Container, Sequence

from kvstore.errors import InvalidArgument, KVStoreError, QuotaExceeded
from kvstore.integrity import checksum_of
from kvstore.limits import MAX_KEY_BYTES, check_key, check_ttl
from kvstore.pool.lease import Lease, Reservation
from kvstore.pool.pool import KVPool, PutResult
from kvstore.tiers.dram import PAGE_BYTES, DramTier
from kvstore.wire.types import (
    ELSEWHERE,
    MAPPED,
    MISS,
    SLOT_EXISTED,
    SLOT_FAILED,
    SLOT_OPEN,
    SLOT_QUOTA,
    BlockLocation,
    DataPlaneInfo,
    LeaseGrant,
    LeaseRequest,
    ReserveRequest,
    SlotGrant,
    chain_parents,
    host_id,
)

SPARE_KEY = b"\0spare:"   # the placeholder key of a slot reserved before its block's key is known
MAX_SPARES_PER_ASK = 64
MAX_LEASE_TTL_S = 3600.0  # a longer lease would pin blocks past any reasonable copy
WRITE_GRACE_S = 5.0  # at most: a reservation timeout of T gives the writer T - min(5 s, T / 2)
_MISS = (MISS, 0, 0, 0)
_ELSEWHERE = (ELSEWHERE, 0, 0, 0)


class DataPlaneHost:
    """Leases and reservations lent to same-host clients of one pool's DRAM tier.

    Invariants: every lease in the table is unreleased in the pool (an expired one is
    released by the next sweep); every reservation in the table was made here (it may have
    timed out in the pool, and then its commit fails). A block's location is handed out only
    while a lease holds it, so it cannot move or be reused before the lease's deadline.
    """

    def __init__(self, pool: KVPool, socket_path: str = "", max_block_bytes: int = 1 << 30) -> None:
        tier = next((t for t in pool.tiers if isinstance(t, DramTier)), None)
        if tier is None:
            raise InvalidArgument("the same-host data plane needs a DRAM tier (a shared-memory slab)")
        self.pool = pool
        self.tier: DramTier = tier
        self.socket_path = socket_path
        self.max_block_bytes = max_block_bytes
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._slots: dict[int, Reservation] = {}
        self._ops = 0
        self._spare_ids = itertools.count(1)
        self.max_spare_bytes = min(64 << 20, tier.capacity_bytes // 16)  # per connection
        timeout = pool.settings.reservation_timeout_s
        self.grace_s = min(WRITE_GRACE_S, timeout / 2)  # space kept past a slot's write-by time

    @classmethod
    def for_pool(cls, pool: KVPool, socket_path: str = "") -> DataPlaneHost | None:
        """A host for ``pool``, or None when it has no DRAM tier."""
        try:
            return cls(pool, socket_path)
        except InvalidArgument:
            return None

    def info(self) -> DataPlaneInfo:
        return DataPlaneInfo(self.tier.shm_name, self.tier.pages * PAGE_BYTES, self.socket_path, host_id(),
                             self.pool.node_id, self.pool.tiers[0] is self.tier)

    # -- reads -----------------------------------------------------------------------------
    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
              chain: bool = False) -> LeaseGrant:
        """Lease ``keys`` (each copy in its fastest tier) and say where each lies: MAPPED
        (slab offset, size, checksum), ELSEWHERE (another tier) or MISS. A lease holding no
        block is released at once (id 0)."""
        lease_id, deadline, flat = self.lease_flat(keys, ttl_s, stop_at_miss, chain)
        return LeaseGrant(lease_id, deadline, [BlockLocation(*flat[i:i + 4]) for i in range(0, len(flat), 4)])

    def lease_flat(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
                   chain: bool = False) -> tuple[int, float, list[int]]:
        """:meth:`lease` with the locations flattened (state, offset, size, checksum per
        key), as the Unix socket packs them. Raises InvalidArgument for a TTL that is not a
        number of seconds in (0, :data:`MAX_LEASE_TTL_S`] (0 or None: the pool's)."""
        ttl_s = check_ttl(ttl_s, "lease TTL", MAX_LEASE_TTL_S)
        lease, tiers = self.pool.lease_many(keys, ttl_s, stop_at_miss, chain)
        dram, locate = self.tier.name, self.tier.locate
        flat: list[int] = []
        for key, tier in zip(keys, tiers):
            if tier == dram:
                loc = locate(key)  # leased: it stays put until the deadline
                if loc is not None:
                    flat += (MAPPED, *loc)
                    continue
            flat += _MISS if tier is None else _ELSEWHERE
        if not lease.keys:
            self.pool.release(lease)
            return 0, lease.deadline, flat
        with self._lock:
            lease_id = self._handle(self._leases)
            self._leases[lease_id] = lease
            self._tick()
        return lease_id, lease.deadline, flat

    def lease_for(self, req: LeaseRequest) -> LeaseGrant:
        """:meth:`lease` of a decoded request (what the gRPC servicer calls)."""
        return self.lease(req.keys, req.ttl_s, req.stop_at_miss, req.chain)

    def release(self, lease_id: int) -> bool:
        """End a lease; False when it is unknown (released or swept already)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.pool.release(lease)
        return True

    # -- writes ----------------------------------------------------------------------------
    def reserve(self, items: Sequence[tuple[bytes, int]], chain: bool = False,
                parent: bytes | None = None, namespace: str | None = None) -> list[SlotGrant]:
        """A slab slot per (key, size bytes); ``chain``: block i extends block i - 1 (the
        first extends ``parent``); ``namespace``: the tenant the blocks belong to
        (kvstore/pool/tenants.py). A key already stored gets SLOT_EXISTED; one that cannot fit
        (or is malformed) SLOT_FAILED with the reason; the block its namespace's quota
        refuses, and every block after it, SLOT_QUOTA with the reason (the writer commits
        the ones before and raises QuotaExceeded, as a gRPC Put stream ends there)."""
        out: list[SlotGrant | None] = [None] * len(items)
        made: list[tuple[int, Reservation]] = []
        links = chain_parents([k for k, _ in items], chain, parent)
        todo: list[int] = []
        for i, (key, size) in enumerate(items):
            if not key or len(key) > MAX_KEY_BYTES:
                out[i] = SlotGrant(SLOT_FAILED, error=f"block key of {len(key)} bytes; 1 to {MAX_KEY_BYTES}")
            elif size > self.max_block_bytes:
                out[i] = SlotGrant(SLOT_FAILED, error=f"block of {size} bytes; at most {self.max_block_bytes}")
            else:
                todo.append(i)
        got = self.pool.reserve_many([(items[i][0], items[i][1], links[i]) for i in todo], tier=self.tier.name,
                                     namespace=namespace) if todo else []
        refused = ""
        for i, res in zip(todo, got):
            if refused or isinstance(res, QuotaExceeded):   # that block and every one after it
                refused = refused or str(res)
                out[i] = SlotGrant(SLOT_QUOTA, error=refused)
            elif isinstance(res, Exception):
                out[i] = SlotGrant(SLOT_FAILED, error=str(res))
            elif res.existed:
                out[i] = SlotGrant(SLOT_EXISTED)
            else:
                made.append((i, res))
        if refused:   # malformed items after the refused block are refused with it, as before
            first = next(i for i, g in zip(todo, got) if isinstance(g, QuotaExceeded))
            out[first:] = [SlotGrant(SLOT_QUOTA, error=refused)] * (len(items) - first)
        if made:
            with self._lock:
                for i, res in made:
                    rid = self._handle(self._slots)
                    self._slots[rid] = res
                    out[i] = SlotGrant(SLOT_OPEN, rid, res.slot.offset, write_by=res.deadline - self.grace_s)
                self._tick()
        return out  # type: ignore[return-value]

    def reserve_for(self, req: ReserveRequest) -> list[SlotGrant]:
        """:meth:`reserve` of a decoded request (what the servicers call)."""
        return self.reserve(req.items, req.chain, req.parent, req.namespace)

    def reserve_spares(self, size: int, count: int, lent_bytes: int = 0) -> list[SlotGrant]:
        """Up to ``count`` slots of ``size`` bytes reserved before their keys are known: a
        writer that puts blocks of one size again and again fills a spare and names it at
        commit — one round trip per put instead of two. ``lent_bytes``: what the asking
        connection holds in spares already (their footprints, ``tier.footprint``); with it
        at most :attr:`max_spare_bytes` of the slab (and
        :data:`MAX_SPARES_PER_ASK` slots). Spares take free room only (they never evict a
        block) and time out as any reservation does; ones that cannot fit are left out."""
        tier = self.tier
        room = int(self.pool.settings.high_watermark * tier.capacity_bytes) - tier.used_bytes
        budget = min(self.max_spare_bytes - lent_bytes, room)
        count = min(count, MAX_SPARES_PER_ASK, budget // tier.footprint(size))
        if count <= 0 or size <= 0:
            return []
        items = [(SPARE_KEY + next(self._spare_ids).to_bytes(8, "little"), size) for _ in range(count)]
        return [g for g in self.reserve(items) if g.state == SLOT_OPEN]

    def still_open(self, res_ids: Sequence[int]) -> list[int]:
        """The ids among ``res_ids`` that are still open reservations lent out here."""
        with self._lock:
            return [i for i in res_ids if i in self._slots]

    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes] | None = None,
               parents: Sequence[bytes | None] | None = None,
               checksums: Sequence[int] | None = None, namespace: str | None = None,
               owned: Container[int] | None = None) -> list[PutResult]:
        """Commit reservations whose slots the client filled, then make each block visible.
        ``keys`` / ``parents``: the key (and chain parent) each block commits as — required
        for spares, optional otherwise (empty: keep the reserved key). ``checksums``: the
        writer's xxh3_64 of each slot, taken right after its copy (the slot is still in its
        cache; the node then touches no block byte); None: the node checksums each slot as
        the slab holds it. Either way the checksum covers the bytes the writer left in the
        slot; a writer that sends a wrong one only makes its own block a miss for the
        readers that verify (mapped, transfer engine, SSD). ``namespace``: the tenant each
        block is assigned to here (a spare slot was reserved before its tenant was known;
        its quota is checked now, evicting its own blocks first). Per id a PutResult
        (``ok`` false with the reason: unknown id, timed out, a spare without a key, over
        the namespace's quota, ...). ``owned``: the ids the caller may commit (a connection's
        own reservations; another's is refused as unknown and left open); None: any."""
        with self._lock:
            batch = [self._slots.pop(i, None) if owned is None or i in owned else None for i in res_ids]
        out: list[PutResult | None] = [None] * len(res_ids)
        ready: list[tuple[int, Reservation, int | None]] = []   # (index, reservation, checksum)
        for i, (rid, res) in enumerate(zip(res_ids, batch)):
            if res is None:
                out[i] = PutResult(keys[i] if keys else b"", False,
                                   error=f"no open reservation {rid} (timed out or closed)")
                continue
            try:
                key = keys[i] if keys else b""
                if key:
                    check_key(key, f"keys[{i}]")
                    res.assign(key, (parents[i] if parents else None) or res.parent)
                elif res.key.startswith(SPARE_KEY):
                    raise InvalidArgument("a spare slot needs a block key at commit")
                if namespace:
                    self.pool.claim(res, namespace)
                slot = res.slot
                digest = None
                if slot is not None:
                    digest = checksums[i] if checksums else checksum_of(self.tier.view(slot.offset, res.size))
                ready.append((i, res, digest))
            except (KVStoreError, OSError) as exc:
                self.pool.abort(res)
                out[i] = PutResult(res.key, False, error=str(exc))
        # the whole frame's marks and commits in one batch (one tier call, the lock taken
        # twice), not a mark and a commit per block
        done = self.pool.commit_filled([(res, d) for _, res, d in ready]) if ready else []
        for (i, res, _), r in zip(ready, done):
            if isinstance(r, Exception):
                self.pool.abort(res)
                r = PutResult(res.key, False, error=str(r))
            out[i] = r
        return out  # type: ignore[return-value]

    def abort(self, res_ids: Sequence[int]) -> None:
        with self._lock:
            batch = [self._slots.pop(i, None) for i in res_ids]
        for res in batch:
            if res is not None:
                self.pool.abort(res)

    # -- housekeeping ----------------------------------------------------------------------
    @staticmethod
    def _handle(table: Container[int]) -> int:
        """A fresh id for a lease or reservation lent out (the lock held): random 63 bits,
        not a counter, so an id a client got wrong — another client's, one from before the
        node restarted, a neighbour's — names nothing. The Unix socket checks a connection's
        ids against its own; gRPC calls carry no connection to check them against, and
        sequential ids let one gRPC client release, commit (unwritten) or abort another
        client's (even a same-host socket client's)."""
        while True:
            handle = secrets.randbits(63)
            if handle and handle not in table:
                return handle

    def _tick(self) -> None:
        """Every 256 operations (lock held): release expired leases and forget reservations
        the pool has closed, so clients that vanish leave nothing behind for long."""
        self._ops += 1
        if self._ops & 255:
            return
        now = time.monotonic()
        for lid in [i for i, lease in self._leases.items() if lease.expired(now)]:
            self.pool.release(self._leases.pop(lid))
        for rid in [i for i, res in self._slots.items() if not res.open]:
            del self._slots[rid]

    def close(self) -> None:
        """Release every lease and abort every reservation still lent out."""
        with self._lock:
            leases, slots = list(self._leases.values()), list(self._slots.values())
            self._leases.clear()
            self._slots.clear()
        for lease in leases:
            self.pool.release(lease)
        for res in slots:
            self.pool.abort(res)

    def lent(self) -> tuple[int, int]:
        """(leases, reservations) currently lent out: those not expired, still open in the
        pool (the table itself is swept every 256 operations only, so a gauge read from its
        size stayed up once a writer's spare slots had timed out)."""
        now = time.monotonic()
        with self._lock:
            return (sum(not lease.expired(now) for lease in self._leases.values()),
                    sum(res.open for res in self._slots.values()))
