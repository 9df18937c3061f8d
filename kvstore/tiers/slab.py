"""Page-allocated slabs: the extent allocator and the tier base shared by ``dram`` (a
shared-memory slab) and ``hbm`` (a torch tensor on a device)."""
from __future__ import annotations

import bisect
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.errors import CapacityError, InvalidArgument
from kvstore.integrity import checksum_of
from kvstore.tiers.base import Sink, Slot, T, TableTier
from kvstore.tiers.buffers import host_u8, nbytes

PAGE_BYTES = 4096


def pages_for(size: int) -> int:
    """Pages a block of ``size`` bytes takes (an empty block still takes one)."""
    return max(1, -(-size // PAGE_BYTES))


def page_footprint(size: int) -> int:
    """Bytes of the whole pages a block of ``size`` bytes takes of a slab (at least one
    page): :meth:`SlabTier.footprint`, what a tenant's quota charges
    (``kvstore.pool.tenants.charge``) and cluster placement counts."""
    return pages_for(size) * PAGE_BYTES


class ExtentAllocator:
    """First-fit allocator of runs of pages, coalescing free neighbours.

    Invariant: free extents are disjoint, sorted by start and never adjacent.
    """

    def __init__(self, pages: int) -> None:
        self._starts: list[int] = [0]
        self._lengths: list[int] = [pages]
        self.free_pages = pages

    def alloc(self, pages: int) -> int | None:
        """Start page of a run of ``pages`` pages, or None when no free run is that long."""
        if pages > self.free_pages:
            return None
        for i, length in enumerate(self._lengths):
            if length >= pages:
                start = self._starts[i]
                if length == pages:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += pages
                    self._lengths[i] -= pages
                self.free_pages -= pages
                return start
        return None

    def free(self, start: int, pages: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        self.free_pages += pages
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            i -= 1
            self._lengths[i] += pages
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, pages)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]


class SlabTier(TableTier[tuple[int, int, int]]):
    """Blocks in one pre-allocated slab of ``capacity_bytes`` rounded up to pages (the
    attribute holds the rounded size).

    Invariant: every committed block and every reserved slot owns a distinct run of pages;
    ``_used`` / ``_reserved`` are the bytes of the pages of the committed blocks / open
    slots (:meth:`footprint`): a block of 8 KiB and 8 bytes takes 12 KiB of the slab, and
    the tier's usage, its watermarks and its stats say so.
    Subclasses provide the slab: ``_copy_in`` and ``_view``.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(page_footprint(capacity_bytes) if capacity_bytes > 0 else capacity_bytes)
        self.pages = pages_for(capacity_bytes)
        self._alloc = ExtentAllocator(self.pages)
        self._blocks: dict[bytes, tuple[int, int, int]] = {}  # key -> (offset, size, checksum)

    @abstractmethod
    def _copy_in(self, offset: int, data: Any) -> None:
        """Copy ``data`` into the slab at byte ``offset``."""

    @abstractmethod
    def _view(self, offset: int, size: int) -> Any:
        """A read-only uint8 view of ``size`` slab bytes at ``offset``."""

    def footprint(self, size: int) -> int:
        return page_footprint(size)

    def reserve(self, size: int) -> Slot | None:
        if size > self.capacity_bytes:
            raise CapacityError(f"{self.name}: a {size}-byte block exceeds the tier's capacity "
                                f"of {self.capacity_bytes} bytes")
        pages = pages_for(size)
        start = self._alloc.alloc(pages)
        if start is None:
            return None
        self._reserved += pages * PAGE_BYTES
        return Slot(size, start * PAGE_BYTES)

    def write(self, slot: Slot, offset: int, data: Any) -> None:
        n = nbytes(data)
        if offset < 0 or offset + n > slot.size:
            raise InvalidArgument(f"{self.name}: write of {n} bytes at {offset} overruns a "
                                  f"{slot.size}-byte slot")
        self._copy_in(slot.offset + offset, data)

    def commit(self, slot: Slot, key: bytes, checksum: int) -> None:
        self._blocks[key] = (slot.offset, slot.size, checksum)
        fp = page_footprint(slot.size)
        self._reserved -= fp
        self._used += fp

    def abort(self, slot: Slot) -> None:
        pages = pages_for(slot.size)
        self._alloc.free(slot.offset // PAGE_BYTES, pages)
        self._reserved -= pages * PAGE_BYTES

    def read(self, key: bytes, sink: Sink[T]) -> T | None:
        loc = self._blocks.get(key)
        if loc is None:
            return None
        return sink(self._view(loc[0], loc[1]))

    def read_many(self, keys: Sequence[bytes], sinks: Sequence[Sink[T]]) -> list[T | None | Exception]:
        """One loop without per-block calls; an exception a sink raises propagates (a slab
        read has no other failure)."""
        blocks, view = self._blocks, self._view
        out: list[T | None | Exception] = []
        for key, sink in zip(keys, sinks):
            loc = blocks.get(key)
            out.append(None if loc is None else sink(view(loc[0], loc[1])))
        return out

    def remove(self, key: bytes) -> int:
        loc = self._blocks.pop(key, None)
        if loc is None:
            return 0
        offset, size, _ = loc
        pages = pages_for(size)
        self._alloc.free(offset // PAGE_BYTES, pages)
        self._used -= pages * PAGE_BYTES
        return pages * PAGE_BYTES

    def keys(self) -> Iterator[tuple[bytes, int]]:
        return ((k, v[1]) for k, v in list(self._blocks.items()))

    def info(self, key: bytes) -> tuple[int, int] | None:
        loc = self._blocks.get(key)
        return None if loc is None else (loc[1], loc[2])

    def verify(self, key: bytes) -> bool:
        """Whether the block still matches the checksum taken at put (a scrub; in-process
        reads of a slab are not verified). Raises KeyError for an absent key."""
        offset, size, checksum = self._blocks[key]
        return checksum_of(host_u8(self._view(offset, size))) == checksum
