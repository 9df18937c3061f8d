"""Moves of blocks between tiers whose byte work runs outside the pool's lock: a demotion
into a slow tier (its :meth:`Tier.persist`, an LMDB transaction) and a promotion (the read
of the lower copy and the write of the upper one).

Under the lock, :class:`kvstore.pool.placement.Placement` plans a move: it reserves the target
slot, holds the source copy (a promotion) or copies its bytes into the slot and drops it
(a demotion: the source's space is what the eviction frees), and records the target
(level, key) in ``inflight`` so that no other writer stores that key in that tier
meanwhile. :meth:`Mover.settle`, called by whoever made the lock's changes once it has let
go of the lock, does the byte work and publishes each move under the lock (index and
books), or gives its slot back.

A demoted block is a miss from the moment it leaves the upper tier until it is published in
the lower one; its pins and chain links are kept meanwhile.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import IntegrityError, KVStoreError
from kvstore.pool.ledger import BlockMeta
from kvstore.tiers.base import Slot

if TYPE_CHECKING:
    from kvstore.pool.placement import Placement


@dataclass(slots=True)
class Move:
    """One block going from tier ``src`` to tier ``dst`` (levels). ``meta``: the source
    copy's books (held, ``moves`` + 1, until published: a promotion) or None (a demotion,
    whose source is gone and whose bytes are in ``slot`` already)."""

    src: int
    dst: int
    key: bytes
    slot: Slot
    size: int
    checksum: int
    meta: BlockMeta | None = None
    error: Exception | None = None


class Mover:
    """Runs the moves a pool's placement planned. ``settled``: a condition on the pool's
    lock, notified whenever an in-flight (tier, key) is published or given up."""

    def __init__(self, place: Placement, lock: threading.RLock) -> None:
        self._place = place
        self._lock = lock
        self.settled = threading.Condition(lock)

    def wait_free(self, level: int, key: bytes) -> None:
        """Wait (the lock held) until no move or commit of ``key`` into tier ``level`` is
        in flight."""
        inflight = self._place.inflight
        while (level, key) in inflight:
            self.settled.wait()

    def settle(self) -> None:
        """Do the byte work of every planned move and publish it; flush the slow tiers'
        deferred deletes. Call without the lock held."""
        place = self._place
        while place.moves or place.dirty:
            with self._lock:
                moves, place.moves = place.moves, []
                dirty, place.dirty = place.dirty, set()
            try:
                self._work(moves)
                for level in sorted(dirty):
                    place.tiers[level].flush()
            finally:   # every move is published or given up, whatever the byte work raised
                if moves:
                    with self._lock:
                        for move in moves:
                            place.publish(move)
                        self.settled.notify_all()

    def _work(self, moves: list[Move]) -> None:
        """The byte work of ``moves`` (no lock held): promotions' copies, then one
        persist per slow target tier. A failure is recorded on its move."""
        place = self._place
        for move in moves:
            if move.meta is not None:
                self._copy(move)
        by_dst: dict[int, list[Move]] = {}
        for move in moves:
            if move.error is None and place.tiers[move.dst].slow_commit:
                by_dst.setdefault(move.dst, []).append(move)
        for dst, group in by_dst.items():
            try:
                errors = place.tiers[dst].persist([(m.slot, m.key, m.checksum) for m in group])
            except Exception as exc:  # noqa: BLE001 — recorded on each move, which is then given up
                errors = [exc] * len(group)
            for move, err in zip(group, errors):
                move.error = err

    def _copy(self, move: Move) -> None:
        """A promotion's bytes: the source copy into the target slot."""
        place = self._place
        target = place.tiers[move.dst]
        try:
            ok = place.tiers[move.src].read(move.key, lambda view: target.write(move.slot, 0, view) or True)
            if not ok:
                move.error = KVStoreError(f"block {move.key.hex()[:16]} left tier {move.src} while promoted")
        except Exception as exc:  # noqa: BLE001 — recorded on the move, which is then given up
            move.error = exc
            if isinstance(exc, IntegrityError):
                with self._lock:
                    place.corrupt(move.src, move.key, move.meta)
