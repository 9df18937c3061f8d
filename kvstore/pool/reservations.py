"""The two-phase put: reserve → write → commit (or abort), and the open reservations of a
pool. A block becomes visible only at commit; an abort, a failed write, short or mismatched
bytes, or a reservation older than the timeout frees its space and leaves no visible key."""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError, QuotaExceeded, ReservationExpired
from kvstore.integrity import checksum_of
from kvstore.pool.commits import Commits
from kvstore.pool.lease import Reservation
from kvstore.pool.lease import ReservationState as RS
from kvstore.pool.ledger import BlockMeta
from kvstore.pool.moves import Mover
from kvstore.pool.placement import Placement
from kvstore.pool.types import PutResult
from kvstore.tiers.buffers import as_u8, host_u8, nbytes

_EMPTY_CHECKSUM = checksum_of(b"")   # what an accounted block (no bytes) hashes to


class Reservations(Commits):
    """Open reservations of one pool. Bytes are written outside the pool's lock, and so is
    a slow tier's commit (:meth:`Tier.persist`, an LMDB transaction); the books change
    under it.

    Invariants: every open reservation owns a slot in its tier (and nothing else does); an
    expired one is freed at the latest by the next reserve, commit or stats call; a slot is
    never freed while a write or a persist into it is in flight; at most one commit of a
    key into a tier is in flight (``Placement.inflight``). The commit itself:
    :class:`~kvstore.pool.commits.Commits`.
    """

    def __init__(self, place: Placement, lock: threading.RLock, timeout_s: float, mover: Mover) -> None:
        self._place = place
        self._lock = lock
        self._mover = mover
        self.timeout_s = timeout_s
        self._open: dict[int, Reservation] = {}
        self._next_reap = math.inf
        self._ids = itertools.count(1)

    def reserve(self, key: bytes, size: int, checksum: int | None, level: int,
                parent: bytes | None, namespace: str | None = None) -> Reservation:
        """One block's :meth:`reserve_many`; raises what refused it."""
        got = self.reserve_many([(key, size, parent)], level, namespace, checksum)[0]
        if isinstance(got, Exception):
            raise got
        return got

    def reserve_many(self, items: Sequence[tuple[bytes, int, bytes | None]], level: int,
                     namespace: str | None = None, checksum: int | None = None) -> list[Reservation | Exception]:
        """Reserve a slot in tier ``level`` for each ``(key, size, parent)``, in order, taking
        the lock once for a run of them: it is let go only to settle the moves (demotions)
        that making room planned, outside the lock, before the next block. Per item the
        reservation (state EXISTED, no slot, for a key held already) or the exception that
        refused it: InvalidArgument for a negative size, CapacityError when no room can be
        made, QuotaExceeded when the namespace's quota cannot make room — then every later
        item is refused with that same exception, untried. ``checksum``: of every item
        (a single put's; None: given at commit)."""
        out: list[Reservation | Exception] = []
        place = self._place
        n = len(items)
        while len(out) < n:
            try:
                with self._lock:
                    now = time.monotonic()
                    self.reap(now)
                    tenants = place.tenants
                    while len(out) < n:
                        key, size, parent = items[len(out)]
                        if size < 0:
                            out.append(InvalidArgument(f"block size must be >= 0 bytes, got {size}"))
                            continue
                        if place.held(key):
                            out.append(Reservation(0, key, size, level, None, checksum, math.inf, parent,
                                                   RS.EXISTED))
                            continue
                        try:
                            place.check_fits(level, size)   # larger than the tier: refused, nothing evicted
                            if tenants is not None:   # the tenant's quota first: it evicts only its own blocks
                                tenants.before_reserve(place, key, size, namespace)
                            slot = place.make_room(level, size)
                        except QuotaExceeded as exc:
                            out += [exc] * (n - len(out))
                            break
                        except (KVStoreError, OSError) as exc:
                            out.append(exc)
                            continue
                        res = Reservation(next(self._ids), key, size, level, slot, checksum, now + self.timeout_s,
                                          parent)
                        self._open[res.id] = res
                        if tenants is not None:
                            tenants.reserved(res.id, key, namespace, size)
                        self._next_reap = min(self._next_reap, res.deadline)
                        out.append(res)
                        if place.moves or place.dirty:
                            break   # settle the moves that made room before the next block
            finally:
                if place.moves or place.dirty:
                    self._mover.settle()   # the demotions making room took, outside the lock
        return out

    def write(self, res: Reservation, data: Any) -> None:
        if res.state is RS.EXISTED:
            return
        src = as_u8(data)
        n = src.shape[0]
        with self._lock:
            self.check_open(res, time.monotonic())
            if res.written + n > res.size:
                raise InvalidArgument(f"block {res.key.hex()[:16]}: {res.written + n} bytes "
                                      f"written, {res.size} reserved")
            offset, res.written = res.written, res.written + n
            res.writing += 1
        try:
            self._place.tiers[res.level].write(res.slot, offset, src)
            res.hash_part(offset, src if isinstance(src, np.ndarray) else host_u8(src))
        except BaseException:
            res.state = RS.ABORTED  # a failed write never reaches a commit; freed just below
            raise
        finally:
            with self._lock:
                res.writing -= 1
                if res.state is not RS.OPEN:
                    self._free(res)

    def put(self, key: bytes, data: Any, checksum: int | None, level: int,
            parent: bytes | None, namespace: str | None = None) -> PutResult | Exception:
        """reserve + one write + commit, with the lock taken twice. Returns the result or
        the exception that failed the block (its space is free again then)."""
        src = as_u8(data)
        try:
            res = self.reserve(key, src.shape[0], checksum, level, parent, namespace)
        except (OSError, KVStoreError) as exc:
            return exc
        if res.state is RS.EXISTED:
            return PutResult(key, True, existed=True)
        try:
            self.write(res, src)
        except (OSError, KVStoreError) as exc:
            self.abort(res)
            return exc
        return self.commit_many([res])[0]

    def account(self, key: bytes, size: int, level: int, parent: bytes | None) -> PutResult | Exception:
        """reserve + commit of a block by its size alone, in a tier that keeps no bytes
        (:class:`kvstore.tiers.accounting.AccountingTier`). No bytes are written, so the
        slot is taken and committed in one hold of the lock, without an open reservation.
        Returns the result or the exception that failed the block."""
        if size < 0:
            return InvalidArgument(f"block size must be >= 0 bytes, got {size}")
        with self._lock:
            place = self._place
            if place.held(key):
                return PutResult(key, True, existed=True)
            try:
                slot = place.make_room(level, size)
                place.tiers[level].commit(slot, key, _EMPTY_CHECKSUM)
            except (OSError, KVStoreError) as exc:
                return exc
            place.admit(level, key, BlockMeta(size, _EMPTY_CHECKSUM))
            if parent is not None:
                place.link(key, parent)
            return PutResult(key, True)

    def put_many(self, items: Sequence[tuple[bytes, Any]], checksums: Sequence[int] | None, chain: bool,
                 level: int, parent: bytes | None, namespace: str | None = None) -> list[PutResult | Exception]:
        """Windows of up to a quarter of the tier: reserve and write each block, then commit
        the window in one tier call (one LMDB transaction on SSD). Per block the result or
        the exception that failed it. ``chain``: block i extends block i - 1."""
        window = max(1, self._place.tiers[level].capacity_bytes // 4)
        views = [as_u8(data) for _, data in items]
        out: list[PutResult | Exception] = []
        start = 0
        while start < len(items):
            end, total = start + 1, nbytes(views[start])
            while end < len(items) and total + nbytes(views[end]) <= window:
                total += nbytes(views[end])
                end += 1
            written: list[tuple[int, Reservation]] = []
            for i in range(start, end):
                key = items[i][0]
                link = parent if i == 0 else (items[i - 1][0] if chain else None)
                res = None
                try:
                    res = self.reserve(key, nbytes(views[i]), checksums[i] if checksums else None, level, link,
                                       namespace)
                    self.write(res, views[i])
                    if res.state is RS.OPEN:
                        written.append((i, res))
                    out.append(PutResult(key, True, existed=res.existed))
                except (OSError, KVStoreError) as exc:
                    if res is not None:
                        self.abort(res)
                    out.append(exc)
            for (i, _), r in zip(written, self.commit_many([res for _, res in written])):
                out[i] = r
            start = end
        return out

    def mark_filled(self, res: Reservation, digest: int) -> None:
        """The slot of ``res`` was written in place; ``digest``: its bytes' xxh3-64, taken
        from the tier after the write. Raises ReservationExpired unless ``res`` is open."""
        if res.state is RS.EXISTED:
            return
        with self._lock:
            self.check_open(res, time.monotonic())
            res.filled(digest)

    def commit_filled(self, items: Sequence[tuple[Reservation, int | None]]) -> list[PutResult | Exception]:
        """:meth:`mark_filled` then :meth:`commit_many` of reservations of one tier whose
        slots were written in place (``(reservation, digest)``; None: no digest, as for a
        reservation without a slot), with the lock taken once for the marks, not per block;
        call without the lock held. Per item the PutResult or the exception that failed it,
        as :meth:`commit_many` answers (which also refuses one closed or past its deadline)."""
        with self._lock:
            for res, digest in items:
                if digest is not None and res.state is RS.OPEN:
                    res.filled(digest)
        return self.commit_many([res for res, _ in items])

    def commit(self, res: Reservation) -> PutResult:
        if res.state is RS.EXISTED:
            return PutResult(res.key, True, existed=True)
        out = self.commit_many([res])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def claim(self, res: Reservation, namespace: str) -> None:
        if res.state is RS.EXISTED:
            return
        try:
            with self._lock:
                self.check_open(res, time.monotonic())
                tenants = self._place.tenants
                if tenants is not None:
                    tenants.claim(self._place, res.id, res.key, res.size, namespace)
        finally:
            place = self._place
            if place.moves or place.dirty:
                self._mover.settle()   # the quota evictions it made, outside the lock

    def abort(self, res: Reservation) -> None:
        with self._lock:
            if res.state is RS.OPEN:
                res.state = RS.ABORTED
                self._free(res)

    def check_open(self, res: Reservation, now: float) -> None:
        """Raises ReservationExpired unless ``res`` is open and in time (an overdue one is
        freed here)."""
        if res.state is RS.OPEN and now > res.deadline and res.writing == 0:
            res.state = RS.EXPIRED
            self._free(res)
        if res.state is RS.EXPIRED:
            raise ReservationExpired(f"reservation of block {res.key.hex()[:16]} timed out "
                                     f"after {self.timeout_s} s; its space is free")
        if res.state is not RS.OPEN:
            raise ReservationExpired(f"reservation of block {res.key.hex()[:16]} is {res.state.value}")

    def reap(self, now: float) -> None:
        """Free every reservation past its deadline (cheap when none can be)."""
        if now < self._next_reap:
            return
        for res in list(self._open.values()):
            if now > res.deadline and res.writing == 0:
                res.state = RS.EXPIRED
                self._free(res)
        self._next_reap = min((r.deadline for r in self._open.values()), default=math.inf)

    def reserved_bytes(self, level: int) -> int:
        """Bytes of tier ``level`` the open reservations take (their footprints there)."""
        fp = self._place.tiers[level].footprint
        return sum(fp(r.size) for r in self._open.values() if r.level == level and r.slot is not None)

    def _free(self, res: Reservation) -> None:
        if res.slot is not None and res.writing == 0:
            self._place.release_slot(res.level, res.slot)
            res.slot = None
            self._open.pop(res.id, None)
            self._settle_tenant(res)

    def _settle_tenant(self, res: Reservation) -> None:
        """The tenant books stop counting the reservation's bytes as pending."""
        if self._place.tenants is not None:
            self._place.tenants.settled(res.id)

    def _fail(self, res: Reservation) -> None:
        res.state = RS.ABORTED
        self._free(res)
