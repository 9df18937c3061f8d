"""Holds on blocks and on space: a reader's :class:`Lease`, an admin's :class:`Pin`, a
writer's :class:`Reservation`. They are handles; the pool keeps the books they refer to.
Times are ``time.monotonic()`` seconds."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Any

from kvstore.errors import LeaseExpired
from kvstore.integrity import checksum_of, new_hasher


class Lease:
    """A reader's time-bounded hold on some blocks (one copy each, in ``tiers``).

    Invariant: while ``time.monotonic() <= deadline`` and the lease is not released, none of
    its blocks is evicted, removed or overwritten. After the deadline the blocks may go at
    any moment, so a read that ends later fails with LeaseExpired. Lookups never renew it.
    """

    __slots__ = ("id", "keys", "tiers", "deadline", "released", "_metas")

    def __init__(self, lease_id: int, keys: tuple[bytes, ...], tiers: tuple[str, ...],
                 deadline: float, metas: list[Any]) -> None:
        self.id = lease_id
        self.keys = keys
        self.tiers = tiers
        self.deadline = deadline
        self.released = False
        self._metas = metas

    @property
    def blocks(self) -> int:
        return len(self.keys)

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) > self.deadline

    def check(self) -> None:
        """Raises LeaseExpired once the deadline has passed."""
        if self.expired():
            raise LeaseExpired(f"lease {self.id} on {self.blocks} blocks expired "
                               f"{time.monotonic() - self.deadline:.3f} s ago")


@dataclass(frozen=True, slots=True)
class Pin:
    """An admin's hold on a block. ``hard``: never evicted, until unpinned. Soft: evicted
    only as a last resort, until ``until`` (monotonic seconds)."""

    hard: bool
    until: float = math.inf

    def active(self, now: float) -> bool:
        return self.hard or now <= self.until

    def holds(self, now: float, last_resort: bool) -> bool:
        """Whether this pin keeps its block from being evicted in this pass."""
        return self.hard or (not last_resort and now <= self.until)


class ReservationState(enum.Enum):
    OPEN = "open"            # space taken, being written
    EXISTED = "existed"      # the key was already stored: writes are discarded, commit succeeds
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"      # timed out; its space was freed


class Reservation:
    """Space reserved in one tier for one block of ``size`` bytes, written in order.

    Invariant: the block is invisible until the pool commits it; an aborted or expired
    reservation has given its space back (``slot`` is None once it has). ``written`` counts
    the bytes written so far, and :meth:`digest` is their xxh3-64 (one-shot when the block
    came in one write, streamed otherwise).
    """

    __slots__ = ("id", "key", "size", "level", "slot", "expected", "deadline", "parent",
                 "written", "writing", "_hasher", "_digest", "state")

    def __init__(self, res_id: int, key: bytes, size: int, level: int, slot: Any,
                 expected: int | None, deadline: float, parent: bytes | None,
                 state: ReservationState = ReservationState.OPEN) -> None:
        self.id = res_id
        self.key = key
        self.size = size
        self.level = level
        self.slot = slot
        self.expected = expected
        self.deadline = deadline
        self.parent = parent
        self.written = 0
        self.writing = 0
        self._hasher: Any = None
        self._digest: int | None = None
        self.state = state

    def hash_part(self, offset: int, data: Any) -> None:
        """Account for ``data`` (host bytes) written at ``offset``; writes come in order."""
        if offset == 0 and len(data) == self.size:
            self._digest = checksum_of(data)
            return
        if self._hasher is None:
            self._hasher = new_hasher()
        self._hasher.update(data)

    def digest(self) -> int:
        """xxh3-64 of the bytes written so far."""
        if self._digest is not None:
            return self._digest
        return self._hasher.intdigest() if self._hasher is not None else checksum_of(b"")

    def assign(self, key: bytes, parent: bytes | None) -> None:
        """Name the block an open, unwritten-to-the-index reservation will commit as (a
        same-host writer's spare slot, taken before its key was known)."""
        self.key, self.parent = key, parent

    def filled(self, digest: int) -> None:
        """The whole slot was written in place (a same-host writer through the mapped slab);
        ``digest``: the xxh3-64 of its bytes, taken from the tier."""
        self.written, self._hasher, self._digest = self.size, None, digest

    @property
    def existed(self) -> bool:
        return self.state is ReservationState.EXISTED

    @property
    def open(self) -> bool:
        return self.state is ReservationState.OPEN
