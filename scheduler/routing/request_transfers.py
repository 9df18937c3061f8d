"""A request's KV transfer and its abort: the blocks a request needs, moved from where they
are cached (a source pool) into the memory that will serve it (a target pool — a decode
instance's KV memory, or a prefill instance's when the Conductor fetches a prefix), under a
lease on the source and reservations on the target (docs/architecture.md §3.1: the two-phase put and leases).

A request can end at any moment (the client disconnects, admission is undone): its
transfer's :meth:`KVTransfer.abort` releases the source lease and aborts every reservation
not yet committed. The pool never frees a slot while a write into it is in flight, and a
write into an aborted reservation fails (``ReservationExpired``), so a request admitted
right after the abort can never be given a block this transfer still writes into, and the
aborted transfer's bytes never land in someone else's block.

:class:`TransferTable` ties transfers to request ids, so that the router's ``finished``
(called once per admitted request, whatever the outcome) aborts what is left.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.pool.lease import Lease, Reservation
    from kvstore.pool.pool import KVPool, PutResult

CHUNK_BYTES = 64 << 10


class KVTransfer:
    """Moves ``keys`` (a prefix chain, head first) from ``source`` into ``target``, in chunks of
    ``chunk_bytes`` (``on_chunk(bytes_so_far)`` after each). :meth:`run` does the work (call
    it in the thread that transfers); :meth:`abort` may be called from any thread, any number of times.

    Invariants: after :meth:`run` returns or :meth:`abort` returns, the source lease is
    released; every reservation this transfer made is committed or aborted; ``reservations``
    lists them (for inspection).
    """

    def __init__(self, request_id: str, source: KVPool, target: KVPool, keys: Sequence[bytes],
                 chunk_bytes: int = CHUNK_BYTES, on_chunk: Callable[[int], None] | None = None) -> None:
        self.request_id = request_id
        self.source, self.target = source, target
        self.keys = tuple(keys)
        self.chunk_bytes = max(1, chunk_bytes)
        self.on_chunk = on_chunk             # called with the bytes written so far, after each chunk
        self.reservations: list[Reservation] = []
        self.written = threading.Event()    # set once the first chunk landed (tests wait on it)
        self._lease: Lease | None = None
        self._lock = threading.Lock()
        self._aborted = False
        self._done = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def run(self) -> list[PutResult]:
        """Lease the longest prefix of ``keys`` the source holds, reserve its blocks in the
        target, copy them and commit. Returns one result per block committed (fewer when the
        source holds a shorter prefix); an empty list when aborted. Raises KVStoreError when
        the target has no room (after aborting what it reserved)."""
        with self._lock:
            if self._aborted:
                return []
            self._lease = self.source.acquire(self.keys)
        try:
            blocks = [b for b in self.source.get_many(self._lease.keys) if b is not None]
            with self._lock:
                if self._aborted:
                    return []
                for key, data in zip(self._lease.keys, blocks):
                    self.reservations.append(self.target.reserve(key, len(data)))
            done = 0
            for res, data in zip(self.reservations, blocks):
                view = memoryview(data)
                for off in range(0, len(view), self.chunk_bytes):
                    if self._aborted:
                        return []
                    chunk = view[off:off + self.chunk_bytes]
                    self.target.write(res, chunk)
                    done += len(chunk)
                    self.written.set()
                    if self.on_chunk is not None:
                        self.on_chunk(done)
            with self._lock:
                if self._aborted:
                    return []
                results = [self.target.commit(res) for res in self.reservations]
                self._done = True
                return results
        except KVStoreError:
            if self._aborted:
                return []          # a write raced the abort: the reservation was already gone
            raise
        finally:
            self._finish()

    def abort(self) -> None:
        """Stop the transfer: abort every reservation not committed, release the lease."""
        with self._lock:
            if self._done:
                return
            self._aborted = True
            for res in self.reservations:
                self.target.abort(res)
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if not self._done and not self._aborted:
                self._aborted = True
                for res in self.reservations:
                    self.target.abort(res)
            lease, self._lease = self._lease, None
        if lease is not None and not lease.released:
            self.source.release(lease)


class TransferTable:
    """Transfers by request id. ``finish(request_id)`` aborts whatever is still running and
    forgets the request; used from one thread (the router's event loop)."""

    def __init__(self) -> None:
        self._by_request: dict[str, list[KVTransfer]] = {}

    def add(self, transfer: KVTransfer) -> None:
        self._by_request.setdefault(transfer.request_id, []).append(transfer)

    def finish(self, request_id: str) -> int:
        """Abort and forget the request's transfers; returns how many there were."""
        transfers = self._by_request.pop(request_id, [])
        for t in transfers:
            t.abort()
        return len(transfers)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_request.values())
