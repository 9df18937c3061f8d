"""Pre-faulting a shared-memory slab: its pages allocated and mapped before the first block
lands in them, in a background thread, instead of one page fault per 4 KiB on the put or get
that touches them first.

Measured on this project's 2-core VM (kernel 6.18, shmem huge pages off): copying 1 MiB into
a fresh /dev/shm slab took 881 us (page allocation, zeroing and mapping), into another
process's first mapping of allocated pages 501 us (minor faults), and 56-70 us once the
pages were populated. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+, madvise(2)) populates
256 MiB in 120-140 ms without touching the bytes, so it is safe while blocks are written.
"""
from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23            # <linux/mman.h>; not exported by Python's mmap module
CHUNK_BYTES = 64 << 20              # one madvise call (about 30 ms); a stop is noticed between calls

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate(address: int, nbytes: int) -> int:
    """Populate ``nbytes`` of this process's mapping at ``address`` (page-aligned) for
    writing; 0 on success, else the errno (EINVAL: kernel older than 5.14; ENOMEM: out of
    memory or not mapped). The ctypes call releases the GIL."""
    if _libc.madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


class Prefaulter:
    """Populates ``nbytes`` at ``address`` in :data:`CHUNK_BYTES` steps on a daemon thread,
    lowest addresses first (where first-fit allocation puts blocks). :meth:`stop` must be
    called before the mapping goes away; it returns once no madvise call is running.
    ``done`` is set when the whole range is populated (or the kernel refused)."""

    def __init__(self, address: int, nbytes: int, what: str) -> None:
        self.address, self.nbytes, self.what = address, nbytes, what
        self.populated = 0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvstore-prefault-{what}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self.populated < self.nbytes and not self._stop.is_set():
                n = min(CHUNK_BYTES, self.nbytes - self.populated)
                err = populate(self.address + self.populated, n)
                if err:
                    log.info("pre-faulting %s stopped after %d of %d bytes (errno %d); its pages fault in "
                             "on first use instead", self.what, self.populated, self.nbytes, err)
                    break
                self.populated += n
        finally:
            self.done.set()

    def stop(self) -> None:
        """Stop after the madvise call in progress (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
