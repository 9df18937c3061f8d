"""The abstract tier, its slot and usage types, and the registry tiers are picked from.

A tier stores whole blocks by key within ``capacity_bytes``. Writes are two-phase: ``reserve``
takes the space, ``write`` fills it (possibly in several chunks), ``commit`` makes the block
readable under its key, ``abort`` gives the space back. Recency, eviction, leases, pins and
the index are the pool's business, not the tier's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from kvstore.errors import CapacityError, IntegrityError
from kvstore.integrity import checksum_of
from kvstore.registry import registrar
from kvstore.tiers.buffers import copy_into, host_u8, to_bytes

T = TypeVar("T")
Sink = Callable[[Any], T]  # receives a read-only uint8 view of a block (numpy, or torch on a device)
TIERS: dict[str, Callable[..., Tier]] = {}


register_tier = registrar(TIERS)


@dataclass(slots=True)
class Slot:
    """Space reserved in a tier for one block of ``size`` bytes. ``offset``: where it starts
    in a slab (bytes); ``data``: the tier's private write buffer, if it keeps one;
    ``persisted``: the key :meth:`Tier.persist` wrote the bytes under (None before), and
    ``epoch``: the tier's storage generation then (a tier that replaces damaged storage
    loses what was persisted before)."""

    size: int
    offset: int = 0
    data: Any = None
    persisted: bytes | None = None
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes a tier holds: ``used_bytes`` = committed + reserved; ``blocks`` = committed."""

    capacity_bytes: int
    used_bytes: int
    reserved_bytes: int
    blocks: int


class Tier(ABC):
    """Stores whole blocks by key, within ``capacity_bytes``.

    Invariants: ``used_bytes`` is the sum of the :meth:`footprint` of the committed blocks
    plus the reserved slots; a key is readable only after ``commit``; a failed ``commit`` leaves
    nothing readable and the slot still reserved (the caller aborts it). Not thread-safe
    for reserve/commit/abort/remove (the pool serialises those); ``write`` to distinct slots
    and ``read`` may run concurrently with them.
    """

    name: str = "tier"
    device: str = "cpu"
    holds_bytes: bool = True   # False: sizes only (kvstore.tiers.accounting)
    # Set by the pool: called with the keys of committed blocks the tier lost by itself
    # (a damaged SSD environment moved aside, kvstore/tiers/ssd.py), so it forgets them.
    on_lost: Callable[[list[bytes]], None] | None = None
    quarantines: int = 0       # times the tier found its storage damaged and replaced it
    # True: a commit does slow I/O (an LMDB transaction), which the pool runs through
    # persist outside its lock; False: commit only updates the tier's books.
    slow_commit: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes

    # -- the six primitives ----------------------------------------------------------------
    @abstractmethod
    def reserve(self, size: int) -> Slot | None:
        """Take ``size`` bytes. Returns None when they do not fit now (evicting may help);
        raises CapacityError when they can never fit."""

    @abstractmethod
    def write(self, slot: Slot, offset: int, data: Any) -> None:
        """Copy ``data`` (bytes-like, uint8 array or tensor) to ``offset`` of the slot."""

    @abstractmethod
    def commit(self, slot: Slot, key: bytes, checksum: int) -> None:
        """Make the slot's bytes readable as ``key``. Raises OSError on a failed write
        (nothing is readable then; the slot stays reserved for the caller to abort)."""

    @abstractmethod
    def abort(self, slot: Slot) -> None:
        """Give a reserved (uncommitted) slot's space back."""

    @abstractmethod
    def read(self, key: bytes, sink: Sink[T]) -> T | None:
        """``sink(view)`` over the block's bytes, or None on a miss. Raises IntegrityError
        when a tier that verifies reads finds the bytes do not match their checksum."""

    @abstractmethod
    def remove(self, key: bytes) -> int:
        """Drop a committed block; returns the bytes freed (0 when absent)."""

    @abstractmethod
    def keys(self) -> Iterator[tuple[bytes, int]]:
        """(key, size) of every committed block, oldest write first."""

    @abstractmethod
    def info(self, key: bytes) -> tuple[int, int] | None:
        """(size, checksum) of a committed block, or None when absent."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def verify(self, key: bytes) -> bool:
        """Whether the committed block still matches the checksum taken at put (a scrub:
        :meth:`kvstore.pool.pool.KVPool.scrub`). This default reads it; a tier that verifies its
        reads and raises IntegrityError says False. Raises KeyError for an absent key."""
        info = self.info(key)
        if info is None:
            raise KeyError(key)
        try:
            got = self.read(key, lambda view: checksum_of(host_u8(view)))
        except IntegrityError:
            return False
        return got == info[1]

    def footprint(self, size: int) -> int:
        """Bytes of this tier's capacity a block of ``size`` bytes takes, what
        ``used_bytes`` counts: its size, unless the tier's layout rounds it (a slab's
        whole pages, :class:`kvstore.tiers.slab.SlabTier`)."""
        return size

    # -- conveniences and batched variants -------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.usage().used_bytes

    def contains(self, key: bytes) -> bool:
        return any(k == key for k, _ in self.keys())

    def fits(self, size: int) -> bool:
        """Whether a block of ``size`` bytes could be reserved now without eviction."""
        try:
            slot = self.reserve(size)
        except CapacityError:
            return False
        if slot is None:
            return False
        self.abort(slot)
        return True

    def put(self, key: bytes, data: Any, checksum: int) -> None:
        """reserve + write + commit in one call. A present key is a no-op. Raises
        CapacityError when the block does not fit now, OSError on a failed write; in both
        cases nothing is stored."""
        if self.contains(key):
            return
        size = len(data) if not hasattr(data, "nbytes") else int(data.nbytes)
        slot = self.reserve(size)
        if slot is None:
            raise CapacityError(f"{self.name}: no room now for a {size}-byte block "
                                f"({self.usage().used_bytes} of {self.capacity_bytes} bytes used)")
        try:
            self.write(slot, 0, data)
            self.commit(slot, key, checksum)
        except BaseException:
            self.abort(slot)
            raise

    def persist(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        """The slow part of committing these slots, for a :attr:`slow_commit` tier: write
        their bytes durably under their keys without making them readable (a later
        :meth:`commit` of the slot publishes it and does no I/O; an :meth:`abort` discards
        what was written). Thread-safe against every other call of the tier, so the pool
        runs it outside its lock. Per slot None or the OSError that failed it (that slot
        is not persisted). Default: nothing to write (the bytes are in place already)."""
        return [None] * len(items)

    def commit_many(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        """Commit several slots; per slot None or the OSError that failed it."""
        out: list[Exception | None] = []
        for slot, key, checksum in items:
            try:
                self.commit(slot, key, checksum)
                out.append(None)
            except OSError as exc:
                out.append(exc)
        return out

    def read_many(self, keys: Sequence[bytes], sinks: Sequence[Sink[T]]) -> list[T | None | Exception]:
        """``read(keys[i], sinks[i])`` for each key; an exception (an IntegrityError, or one
        a sink raised) is returned in place of that block's value, not raised."""
        out: list[T | None | Exception] = []
        for key, sink in zip(keys, sinks):
            try:
                out.append(self.read(key, sink))
            except Exception as exc:  # noqa: BLE001 — handed back per block to the pool
                out.append(exc)
        return out

    def get(self, key: bytes) -> bytes | None:
        return self.read(key, to_bytes)

    def get_into(self, key: bytes, out: np.ndarray | Any) -> int | None:
        """Copy the block into ``out`` (a contiguous array or tensor of at least its size)
        without an intermediate bytes object; returns the bytes copied or None on a miss."""
        return self.read(key, lambda view: copy_into(out, view))

    def flush(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Finish slow work the tier deferred (an SSD tier's deletes of removed blocks);
        thread-safe, run by the pool outside its lock. Default: none."""

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Release the tier's resources."""


# A TableTier's entry per block: (size, checksum), or a longer tuple that starts with the size.
Entry = TypeVar("Entry", bound=tuple[int, ...])


class TableTier(Tier, Generic[Entry]):
    """A tier that keeps its committed blocks in ``_blocks`` (key → ``Entry``: ``(size, checksum)``,
    or a longer tuple whose subclass overrides :meth:`keys` and :meth:`info`), and counts
    ``_used`` (committed bytes) and ``_reserved`` (bytes of puts in flight).

    Invariant: ``_used`` is the sum of the sizes in ``_blocks``.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._blocks: dict[bytes, Entry] = {}
        self._used = 0
        self._reserved = 0

    def reserve(self, size: int) -> Slot | None:
        """Reserve ``size`` bytes by counting them (a tier with no layout of its own to
        allocate); None when they do not fit now. Raises CapacityError for a block larger
        than the whole tier."""
        if size > self.capacity_bytes:
            raise CapacityError(f"{self.name}: a {size}-byte block exceeds the tier's capacity "
                                f"of {self.capacity_bytes} bytes")
        if self._used + self._reserved + size > self.capacity_bytes:
            return None
        self._reserved += size
        return Slot(size)

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def keys(self) -> Iterator[tuple[bytes, int]]:
        return ((k, v[0]) for k, v in list(self._blocks.items()))

    def info(self, key: bytes) -> tuple[int, int] | None:
        return self._blocks.get(key)  # type: ignore[return-value]

    @property
    def used_bytes(self) -> int:
        return self._used + self._reserved

    def usage(self) -> TierUsage:
        return TierUsage(self.capacity_bytes, self._used + self._reserved, self._reserved, len(self._blocks))

