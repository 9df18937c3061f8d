"""The DRAM tier: one pre-allocated, named shared-memory slab with a page allocator, so a
reader on the same host can map the slab (:class:`SlabReader`) and copy blocks out without
a socket."""
from __future__ import annotations

import os
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from kvstore.errors import IntegrityError, InvalidArgument
from kvstore.integrity import checksum_of
from kvstore.tiers import registry
from kvstore.tiers.base import register_tier
from kvstore.tiers.buffers import as_u8, copy_into
from kvstore.tiers.prefault import Prefaulter
from kvstore.tiers.slab import PAGE_BYTES, ExtentAllocator, SlabTier

__all__ = ["PAGE_BYTES", "DramTier", "ExtentAllocator", "SlabReader"]


@register_tier(registry.DRAM.name)
class DramTier(SlabTier):
    """Blocks in a shared-memory slab of ``capacity_bytes`` (rounded up to pages).

    The slab is named (``shm_name``, under /dev/shm) so another process on the host can map
    it; ``close`` unlinks it. Reads hand the sink a read-only numpy view of the slab.
    ``prefault``: allocate and map all its pages on a background thread from the start
    (kvstore/tiers/prefault.py), so no put pays a page fault per 4 KiB; the tier's memory
    is then taken at once rather than as blocks arrive.
    """

    def __init__(self, capacity_bytes: int, shm_name: str | None = None, prefault: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.shm_name = shm_name or f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        size = self.pages * PAGE_BYTES
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=self.shm_name, create=True, size=size)
        self._slab = np.ndarray((size,), dtype=np.uint8, buffer=self._shm.buf)
        self._ro = self._slab.view()
        self._ro.flags.writeable = False
        self._prefault = Prefaulter(int(self._slab.ctypes.data), size, f"dram slab {self.shm_name}") \
            if prefault and size else None

    def _copy_in(self, offset: int, data: Any) -> None:
        src = as_u8(data)
        if isinstance(src, np.ndarray):
            np.copyto(self._slab[offset:offset + src.shape[0]], src)
        else:  # a tensor on a device: one device-to-host copy straight into the slab
            copy_into(self._slab[offset:offset + src.shape[0]], src)

    def _view(self, offset: int, size: int) -> np.ndarray:
        return self._ro[offset:offset + size]

    def view(self, offset: int, size: int) -> np.ndarray:
        """A read-only view of ``size`` slab bytes at ``offset`` (a reservation's slot that a
        same-host writer filled in place, to checksum it before commit)."""
        if offset < 0 or offset + size > self._ro.shape[0]:
            raise InvalidArgument(f"slab range {offset}+{size} outside {self._ro.shape[0]} bytes")
        return self._view(offset, size)

    def locate(self, key: bytes) -> tuple[int, int, int] | None:
        """(offset, size, checksum) of a committed block in the slab, for a mapped reader;
        None when absent. Only meaningful while the caller holds a lease on the block."""
        return self._blocks.get(key)

    def close(self) -> None:
        """Unlink and unmap the slab (idempotent). Views still held elsewhere keep their
        pages mapped until dropped; the name is gone at once."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        if self._prefault is not None:
            self._prefault.stop()  # before the mapping goes
        self._slab = self._ro = None  # type: ignore[assignment]
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            pass


class SlabReader:
    """A same-host reader of a DRAM tier's slab, mapped by name (another process).

    ``read_into`` verifies the checksum after copying, because the bytes crossed a process
    boundary: a mismatch raises IntegrityError and the caller treats it as a miss.
    """

    def __init__(self, shm_name: str) -> None:
        self._shm = shared_memory.SharedMemory(name=shm_name)
        # Python < 3.13 registers attached segments too and would unlink the owner's slab
        # when this process exits; the owner alone unlinks it.
        resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        self._slab = np.ndarray((self._shm.size,), dtype=np.uint8, buffer=self._shm.buf)

    def read_into(self, offset: int, size: int, checksum: int, out: Any) -> int:
        """Copy ``size`` bytes at ``offset`` into ``out`` and verify them; returns ``size``."""
        if offset < 0 or offset + size > self._slab.shape[0]:
            raise InvalidArgument(f"slab range {offset}+{size} outside {self._slab.shape[0]} bytes")
        n = copy_into(out, self._slab[offset:offset + size])
        if checksum_of(as_u8(out)[:n]) != checksum:
            raise IntegrityError(f"slab bytes at {offset}+{size} do not match their checksum")
        return n

    def close(self) -> None:
        self._slab = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:
            pass
