"""The DRAM tier: one pre-allocated, named shared-memory slab with a page allocator, so a
reader on the same host can map the slab and copy blocks out without a socket."""
from __future__ import annotations

import bisect
import os
import uuid
from multiprocessing import shared_memory
from typing import Iterator

import numpy as np
import xxhash

from kvstore.errors import CapacityError, IntegrityError
from kvstore.tiers.base import Tier, register_tier

PAGE_BYTES = 4096


class ExtentAllocator:
    """First-fit allocator of runs of pages, coalescing free neighbours.

    Invariant: free extents are disjoint, sorted by start and never adjacent.
    """

    def __init__(self, pages: int) -> None:
        self._starts: list[int] = [0]
        self._lengths: list[int] = [pages]
        self.free_pages = pages

    def alloc(self, pages: int) -> int | None:
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


@register_tier("dram")
class DramTier(Tier):
    """Blocks in a shared-memory slab of ``capacity_bytes`` (rounded up to pages).

    The slab is named (``shm_name``) so another process on the host can map it.
    """

    def __init__(self, capacity_bytes: int, shm_name: str | None = None) -> None:
        super().__init__(capacity_bytes)
        pages = -(-capacity_bytes // PAGE_BYTES)
        self.shm_name = shm_name or f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._shm = shared_memory.SharedMemory(name=self.shm_name, create=True, size=pages * PAGE_BYTES)
        self._slab = np.ndarray((pages * PAGE_BYTES,), dtype=np.uint8, buffer=self._shm.buf)
        self._alloc = ExtentAllocator(pages)
        self._blocks: dict[bytes, tuple[int, int, int]] = {}  # key -> (offset, size, checksum)
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def fits(self, size: int) -> bool:
        pages = max(1, -(-size // PAGE_BYTES))
        if self._alloc.free_pages < pages:
            return False
        start = self._alloc.alloc(pages)  # probe for a contiguous run, then give it back
        if start is None:
            return False
        self._alloc.free(start, pages)
        return True

    def put(self, key: bytes, data: bytes | memoryview, checksum: int) -> None:
        if key in self._blocks:
            return
        size = len(data)
        pages = max(1, -(-size // PAGE_BYTES))
        start = self._alloc.alloc(pages)
        if start is None:
            raise CapacityError(f"dram: no free run of {pages} pages for a {size}-byte block")
        offset = start * PAGE_BYTES
        self._slab[offset:offset + size] = np.frombuffer(data, dtype=np.uint8)
        self._blocks[key] = (offset, size, checksum)
        self._used += size

    def get(self, key: bytes) -> bytes | None:
        loc = self._blocks.get(key)
        if loc is None:
            return None
        offset, size, _ = loc
        return self._slab[offset:offset + size].tobytes()

    def get_into(self, key: bytes, out: np.ndarray) -> int | None:
        """Copy the block into ``out`` (a uint8 array of at least its size) without an
        intermediate bytes object; returns the bytes copied or None on a miss."""
        loc = self._blocks.get(key)
        if loc is None:
            return None
        offset, size, _ = loc
        np.copyto(out[:size], self._slab[offset:offset + size])
        return size

    def verify(self, key: bytes) -> bool:
        """Whether the block's bytes still match the checksum taken at put."""
        offset, size, checksum = self._blocks[key]
        if xxhash.xxh3_64_intdigest(self._slab[offset:offset + size]) == checksum:
            return True
        self.remove(key)
        raise IntegrityError(f"dram block {key.hex()[:16]} failed its checksum")

    def remove(self, key: bytes) -> int:
        loc = self._blocks.pop(key, None)
        if loc is None:
            return 0
        offset, size, _ = loc
        self._alloc.free(offset // PAGE_BYTES, max(1, -(-size // PAGE_BYTES)))
        self._used -= size
        return size

    def keys(self) -> Iterator[tuple[bytes, int]]:
        return ((k, v[1]) for k, v in list(self._blocks.items()))

    def close(self) -> None:
        self._slab = None  # type: ignore[assignment]
        try:
            self._shm.close()
            self._shm.unlink()
        except (FileNotFoundError, BufferError):
            pass
