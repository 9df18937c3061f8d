"""The SSD tier: blocks in LMDB under a data directory, each with its checksum (verified on
every read), usage accounting that survives restart (rebuilt from what is on disk when
opened), an LMDB map grown as needed and a configurable fsync policy.

Damage never kills the node: the environment is checked before it is touched and a damaged
one is quarantined (kvstore/tiers/ssd_storage.py)."""
from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import numpy as np

from kvstore.errors import IntegrityError
from kvstore.integrity import checksum_of
from kvstore.tiers import registry
from kvstore.tiers.base import Sink, Slot, T, TableTier, register_tier
from kvstore.tiers.buffers import host_u8, nbytes
from kvstore.tiers.ssd_storage import _DAMAGE, _META, _MIN_MAP, SsdStorage, _Damaged

log = logging.getLogger(__name__)
FSYNC_POLICIES = ("never", "commit")


@register_tier(registry.SSD.name)
class SsdTier(SsdStorage, TableTier[tuple[int, int]]):
    """Blocks in an LMDB environment at ``path``.

    Three named databases: ``blocks`` (key → bytes), ``meta`` (key → size, checksum, write
    sequence) and ``owners`` (key → its tenant's namespace, when it has one; ``owner_of``,
    set by kvstore/pool/tenants.py ``attach``, names it at each write); all change in one
    transaction, so a block is on disk completely or not at all. ``fsync``: ``"never"`` (the
    OS flushes; a machine crash may lose the last puts) or ``"commit"`` (each commit is
    durable). The map starts at ``initial_map_bytes`` (or twice
    what is on disk) and doubles on demand up to ``max_map_bytes`` (default: twice the
    capacity plus 64 MiB, room for LMDB's pages).

    ``write_fault``: a test hook, None in service. When set it is called with the key at each
    commit, before anything reaches LMDB; raising OSError there (ENOSPC, EIO) is a failed write.

    Slow I/O runs outside the pool's lock: :meth:`persist` writes blocks in one LMDB
    transaction without making them readable (``commit`` then only updates the books), and
    :meth:`remove` forgets a block at once and leaves its delete to the next transaction or
    :meth:`flush`. Write transactions, map growth and quarantine are serialised by a lock of
    the tier's own.
    """

    slow_commit = True

    def __init__(self, capacity_bytes: int, path: str, fsync: str = "never",
                 max_map_bytes: int | None = None, initial_map_bytes: int = _MIN_MAP) -> None:
        super().__init__(capacity_bytes)
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"ssd fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.path = path
        self.fsync = fsync
        self.max_map_bytes = max_map_bytes or 2 * capacity_bytes + _MIN_MAP
        self._initial_map = initial_map_bytes
        self._blocks: dict[bytes, tuple[int, int]] = {}  # key -> (size, checksum), write order
        self._seq = 0
        self._readers = 0
        self._growing = False
        self._cv = threading.Condition()
        self._fd = -1
        self._lock_fd = -1           # the flock on kvstore.lock, held from open to close
        self._need = 0               # bytes of data.mdb that LMDB's pages use
        self._wlock = threading.RLock()      # one LMDB write transaction (or map change) at a time
        self._dlock = threading.Lock()
        self._doomed: list[bytes] = []       # removed blocks whose rows await their delete
        self.quarantines = 0
        self.write_fault: Callable[[bytes], None] | None = None
        self.owner_of: Callable[[bytes], str] | None = None   # key -> namespace ("": none), at write
        self.recovered_owners: dict[bytes, str] = {}
        try:
            try:
                self._open(load=True)
            except _Damaged as exc:
                self._quarantine(str(exc), lost=None)
        except BaseException:
            self._unlock()    # a tier that did not open holds no directory
            raise

    @property
    def map_bytes(self) -> int:
        return self._env.info()["map_size"]

    def write(self, slot: Slot, offset: int, data: Any) -> None:
        n = nbytes(data)
        if offset == 0 and n == slot.size and slot.data is None:
            slot.data = host_u8(data)  # a whole block in one write: keep a reference, no copy
            return
        if slot.data is None:
            slot.data = np.empty(slot.size, dtype=np.uint8)  # the block arrives in pieces
        np.copyto(slot.data[offset:offset + n], host_u8(data))

    def commit(self, slot: Slot, key: bytes, checksum: int) -> None:
        err = self.commit_many([(slot, key, checksum)])[0]
        if err is not None:
            raise err

    def persist(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        """One LMDB transaction for all blocks that pass the write-fault hook (and the
        deletes of removed blocks); thread-safe, run outside the pool's lock."""
        errors: list[Exception | None] = [None] * len(items)
        with self._wlock:
            self._guard()
            rows: list[tuple[int, Slot, bytes, int, int]] = []
            for i, (slot, key, checksum) in enumerate(items):
                try:
                    if self.write_fault is not None:
                        self.write_fault(key)
                except OSError as exc:
                    errors[i] = exc
                    continue
                rows.append((i, slot, key, checksum, self._seq + len(rows) + 1))
            try:
                self._put_rows(rows)
            except OSError as exc:
                for i, *_ in rows:
                    errors[i] = exc
                return errors
            for _, slot, key, _, seq in rows:
                slot.persisted, slot.epoch, slot.data = key, self.quarantines, None
                self._seq = max(self._seq, seq)
        return errors

    def commit_many(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        """Publish persisted slots (books only); slots not persisted yet are persisted
        first, in one LMDB transaction."""
        errors: list[Exception | None] = [None] * len(items)
        for i, (slot, key, _) in enumerate(items):
            if slot.persisted == key and slot.epoch != self.quarantines:
                errors[i] = OSError(errno.EIO, f"ssd: the environment at {self.path} was replaced (damaged) "
                                               f"while block {key.hex()[:16]} was written")
        todo = [i for i, (slot, key, _) in enumerate(items) if slot.persisted != key]
        if todo:
            for i, err in zip(todo, self.persist([items[i] for i in todo])):
                errors[i] = err
        for (slot, key, checksum), err in zip(items, errors):
            if err is None:
                self._blocks[key] = (slot.size, checksum)
                self._reserved -= slot.size
                self._used += slot.size
                slot.persisted = None
        return errors

    def _take_doomed(self) -> list[bytes]:
        with self._dlock:
            doomed, self._doomed = self._doomed, []
        return [key for key in doomed if key not in self._blocks]

    def _put_rows(self, rows: list[tuple[int, Slot, bytes, int, int]]) -> None:
        """Write ``rows`` (and delete the removed blocks' rows first) in one transaction.
        The caller holds the write lock."""
        doomed = self._take_doomed()
        while rows or doomed:
            try:
                with self._env.begin(write=True) as txn:
                    for key in doomed:
                        txn.delete(key, db=self._data)
                        txn.delete(key, db=self._meta)
                        txn.delete(key, db=self._owners)
                    owner_of = self.owner_of
                    for _, slot, key, checksum, seq in rows:
                        txn.put(key, b"" if slot.data is None else slot.data, db=self._data)
                        txn.put(key, _META.pack(slot.size, checksum, seq), db=self._meta)
                        owner = owner_of(key) if owner_of is not None else ""
                        if owner:
                            txn.put(key, owner.encode(), db=self._owners)
                        else:
                            txn.delete(key, db=self._owners)
                self._measure(cover=True)
                return
            except lmdb.MapFullError:
                if not self._grow():
                    raise OSError(errno.ENOSPC, f"ssd: LMDB map full at {self.map_bytes} bytes "
                                                f"({self.path})") from None
            except _DAMAGE as exc:
                self._quarantine(f"LMDB reports damage on a write ({exc})", list(self._blocks), self.quarantines)
                raise OSError(errno.EIO, f"ssd: LMDB write failed at {self.path}: {exc}") from exc
            except lmdb.Error as exc:
                with self._dlock:
                    self._doomed[:0] = doomed     # retried with the next transaction
                raise OSError(errno.EIO, f"ssd: LMDB write failed at {self.path}: {exc}") from exc

    def flush(self) -> None:
        """Delete the rows of removed blocks now (one transaction); run outside the pool's
        lock. A failure is logged; the deletes are retried with the next transaction."""
        if not self._doomed:
            return
        with self._wlock:
            if self._fd < 0:
                return
            try:
                self._guard()
                self._put_rows([])
            except OSError as exc:
                log.warning("ssd tier at %s: deleting removed blocks failed: %s", self.path, exc)

    def abort(self, slot: Slot) -> None:
        """Give the slot back; bytes :meth:`persist` wrote for it are deleted with the next
        transaction (unless the key was committed since)."""
        self._reserved -= slot.size
        slot.data = None
        if slot.persisted is not None:
            with self._dlock:
                self._doomed.append(slot.persisted)
            slot.persisted = None

    def _read_in(self, txn: lmdb.Transaction, key: bytes, sink: Sink[T]) -> T | None:
        info = self._blocks.get(key)
        if info is None:
            return None
        buf = txn.get(key, db=self._data)
        if buf is None:
            return None
        if len(buf) != info[0] or checksum_of(buf) != info[1]:
            raise IntegrityError(f"ssd block {key.hex()[:16]} failed its checksum")
        return sink(np.frombuffer(buf, dtype=np.uint8))

    def read(self, key: bytes, sink: Sink[T]) -> T | None:
        """Verifies the checksum before ``sink`` sees the bytes; the view is valid only
        during the call. Raises IntegrityError on a mismatch (the pool drops the block). A
        damaged file is quarantined first: then this and every block it held are misses."""
        if key not in self._blocks:
            return None
        out = self.read_many([key], [sink])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def read_many(self, keys: Sequence[bytes], sinks: Sequence[Sink[T]]) -> list[T | None | Exception]:
        """One read transaction for all keys; per-block exceptions are returned in place."""
        out: list[T | None | Exception] = []
        self._guard()
        seen = self.quarantines
        try:
            with self._reading():
                self._check()
                with self._env.begin(buffers=True) as txn:
                    for key, sink in zip(keys, sinks):
                        try:
                            out.append(self._read_in(txn, key, sink))
                        except _DAMAGE:
                            raise
                        except Exception as exc:  # noqa: BLE001 — handed back per block to the pool
                            out.append(exc)
        except (_Damaged, *_DAMAGE) as exc:
            self._quarantine(f"LMDB reports damage on a read ({exc})" if not isinstance(exc, _Damaged)
                             else str(exc), list(self._blocks), seen)
            return [None] * len(keys)
        return out

    def remove(self, key: bytes) -> int:
        """Forget the block now (it is a miss at once, its bytes are free in the books); its
        rows are deleted by the next transaction or :meth:`flush`."""
        info = self._blocks.pop(key, None)
        if info is None:
            return 0
        self._used -= info[0]
        with self._dlock:
            self._doomed.append(key)
        return info[0]

    @property
    def pending_deletes(self) -> int:
        """Removed blocks whose rows are still on disk (until the next transaction)."""
        return len(self._doomed)

    def close(self) -> None:
        self.flush()
        with self._wlock:
            if self._fd >= 0:
                self._close_env()
            self._unlock()
