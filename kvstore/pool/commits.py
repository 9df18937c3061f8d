"""The commit of a pool's reservations: a batch of one tier checked (open, in time, its bytes
complete and matching, its key not stored yet), committed to the tier in one call (a slow
tier's persist outside the pool's lock), then indexed and linked; the failed ones aborted."""
from __future__ import annotations

import threading
import time
from abc import abstractmethod

from kvstore.errors import IntegrityError, ReservationExpired
from kvstore.pool.lease import Reservation
from kvstore.pool.lease import ReservationState as RS
from kvstore.pool.ledger import BlockMeta
from kvstore.pool.moves import Mover
from kvstore.pool.placement import Placement
from kvstore.pool.types import PutResult


class Commits:
    """The commit side of :class:`~kvstore.pool.reservations.Reservations` (a mixin: that
    class holds the state these methods use and frees, checks and settles reservations)."""

    _place: Placement
    _lock: threading.RLock
    _mover: Mover
    _open: dict[int, Reservation]

    @abstractmethod
    def check_open(self, res: Reservation, now: float) -> None: ...
    @abstractmethod
    def _free(self, res: Reservation) -> None: ...
    @abstractmethod
    def _settle_tenant(self, res: Reservation) -> None: ...
    @abstractmethod
    def _fail(self, res: Reservation) -> None: ...

    def commit_many(self, batch: list[Reservation]) -> list[PutResult | Exception]:
        """Commit reservations of one tier in one tier call; call without the lock held.
        Per block a PutResult or the exception that failed it (ReservationExpired for one
        not open or past its deadline, IntegrityError for short or mismatched bytes,
        OSError for a failed write); failed ones are aborted. A slow tier's persist runs
        outside the lock; a commit of a key whose commit into the same tier is in flight
        waits for that one (and then finds it stored)."""
        if not batch:
            return []
        place, level = self._place, batch[0].level
        tier = place.tiers[level]
        with self._lock:
            inflight = place.inflight
            while inflight and any((r.level, r.key) in inflight for r in batch):
                self._mover.settled.wait()
            out, todo = self._admissible(batch)
            if not todo:
                return out  # type: ignore[return-value]
            if place.tenants is not None:   # each block is its committing writer's tenant's
                for _, res, _ in todo:
                    place.tenants.committing(res.id)
            if not tier.slow_commit:  # the books only: no I/O, all under the lock
                return self._publish(out, todo, self._tier_commit(todo))
            for _, res, _ in todo:
                inflight[(level, res.key)] = None
                res.writing += 1
        errors: list[Exception | None] = [OSError("persist did not run")] * len(todo)
        try:
            errors = tier.persist([(r.slot, r.key, c) for _, r, c in todo])
        finally:
            with self._lock:
                for _, res, _ in todo:
                    del inflight[(level, res.key)]
                    res.writing -= 1
                try:
                    for k, (_, res, _) in enumerate(todo):
                        if errors[k] is None and res.state is not RS.OPEN:   # aborted meanwhile
                            errors[k] = ReservationExpired(f"reservation of block {res.key.hex()[:16]} "
                                                           f"is {res.state.value}")
                            self._free(res)
                    self._publish(out, todo, self._tier_commit(todo, errors))
                finally:
                    self._mover.settled.notify_all()
        return out  # type: ignore[return-value]

    def _admissible(self, batch: list[Reservation]) -> tuple[list[PutResult | Exception | None],
                                                             list[tuple[int, Reservation, int]]]:
        """Check each reservation (the lock held): open and in time, its bytes complete and
        matching, its key not stored yet. Returns the results so far (None where the block
        is to be committed) and (index, reservation, checksum) of those to commit."""
        place, now = self._place, time.monotonic()
        out: list[PutResult | Exception | None] = [None] * len(batch)
        todo: list[tuple[int, Reservation, int]] = []
        keys: set[bytes] = set()
        for i, res in enumerate(batch):
            if res.state is RS.EXISTED:
                out[i] = PutResult(res.key, True, existed=True)
                continue
            try:
                self.check_open(res, now)
            except ReservationExpired as exc:
                out[i] = exc
                continue
            checksum = res.digest()
            if res.written != res.size:
                out[i] = IntegrityError(f"block {res.key.hex()[:16]}: got {res.written} bytes, "
                                        f"header said {res.size}")
            elif res.expected is not None and checksum != res.expected:
                out[i] = IntegrityError(f"block {res.key.hex()[:16]}: bytes do not match the sent checksum")
            elif place.held(res.key) or res.key in keys:  # another writer stored it first
                out[i] = PutResult(res.key, True, existed=True)
            else:
                todo.append((i, res, checksum))
                keys.add(res.key)
                continue
            self._fail(res)
        return out, todo

    def _tier_commit(self, todo: list[tuple[int, Reservation, int]],
                     errors: list[Exception | None] | None = None) -> list[Exception | None]:
        """The tier's commit of the blocks without an error yet (the lock held)."""
        errors = list(errors) if errors is not None else [None] * len(todo)
        go = [k for k, err in enumerate(errors) if err is None]
        if not go:
            return errors
        tier = self._place.tiers[todo[0][1].level]
        if len(go) == 1:
            _, res, checksum = todo[go[0]]
            try:
                tier.commit(res.slot, res.key, checksum)
            except OSError as exc:
                errors[go[0]] = exc
            return errors
        for k, err in zip(go, tier.commit_many([(todo[k][1].slot, todo[k][1].key, todo[k][2]) for k in go])):
            errors[k] = err
        return errors

    def _publish(self, out: list[PutResult | Exception | None], todo: list[tuple[int, Reservation, int]],
                 errors: list[Exception | None]) -> list[PutResult | Exception]:
        """Index the committed blocks and link them (the lock held); abort the failed ones."""
        place = self._place
        for (i, res, checksum), err in zip(todo, errors):
            if err is not None:
                if res.state is RS.OPEN:
                    self._fail(res)
                out[i] = err
                continue
            res.state, res.slot = RS.COMMITTED, None
            self._open.pop(res.id, None)
            place.admit(res.level, res.key, BlockMeta(res.size, checksum))
            self._settle_tenant(res)
            if res.parent is not None:
                place.link(res.key, res.parent)
            out[i] = PutResult(res.key, True)
        return out  # type: ignore[return-value]
