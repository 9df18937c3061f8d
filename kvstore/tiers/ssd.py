"""The SSD tier: blocks in LMDB under a data directory, each with its checksum (verified on
every read), usage accounting that survives restart (rebuilt from what is on disk when
opened), an LMDB map grown as needed and a configurable fsync policy.

Damage never kills the node. LMDB maps its file, so touching a page past the end of a
truncated file is SIGBUS; the tier therefore checks the file's size against the pages LMDB
uses (``(last_pgno + 1) * page size``) when it opens and before every read, write and remove
(one ``fstat``), and treats LMDB's own corruption errors the same way. A damaged
environment is moved aside (``ssd.damaged-<unix time>``) and an empty one opened in its
place; the blocks it held are reported to the pool (``on_lost``) as lost, one log line says
what happened and ``quarantines`` counts it."""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import lmdb
import numpy as np

from kvstore.errors import IntegrityError
from kvstore.integrity import checksum_of
from kvstore.tiers.base import Sink, Slot, T, TableTier, register_tier
from kvstore.tiers.buffers import host_u8, nbytes

log = logging.getLogger(__name__)
_META = struct.Struct("<QQQ")  # size, checksum, write sequence
FSYNC_POLICIES = ("never", "commit")
_MIN_MAP = 64 << 20
# LMDB errors that mean the file is damaged (any other LMDB error at open: the directory is
# unusable, an OSError for the caller).
_DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
           lmdb.VersionMismatchError, lmdb.BadTxnError)


class _Damaged(Exception):
    """The environment is damaged (the message says how); it must be quarantined."""


@register_tier("ssd")
class SsdTier(TableTier):
    """Blocks in an LMDB environment at ``path``.

    Two named databases: ``blocks`` (key → bytes) and ``meta`` (key → size, checksum, write
    sequence); both change in one transaction, so a block is on disk completely or not at
    all. ``fsync``: ``"never"`` (the OS flushes; a machine crash may lose the last puts) or
    ``"commit"`` (each commit is durable). The map starts at ``initial_map_bytes`` (or twice
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
        self._need = 0               # bytes of data.mdb that LMDB's pages use
        self._wlock = threading.RLock()      # one LMDB write transaction (or map change) at a time
        self._dlock = threading.Lock()
        self._doomed: list[bytes] = []       # removed blocks whose rows await their delete
        self.quarantines = 0
        self.write_fault: Callable[[bytes], None] | None = None
        try:
            self._open(load=True)
        except _Damaged as exc:
            self._quarantine(str(exc), lost=None)

    # -- opening, damage and quarantine ----------------------------------------------------
    def _open(self, load: bool) -> None:
        """Open (creating) the environment at :attr:`path`; with ``load``, read the books
        of what it holds. Raises OSError (one line) when the directory cannot be used and
        _Damaged when the file is damaged."""
        data = os.path.join(self.path, "data.mdb")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)   # every tenant's blocks: this user only
            on_disk = os.path.getsize(data) if os.path.exists(data) else 0
            if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK) or (
                    os.path.exists(data) and not os.access(data, os.R_OK | os.W_OK)):
                raise PermissionError(errno.EACCES, "permission denied")
        except OSError as exc:
            raise OSError(exc.errno, f"ssd tier: cannot use data directory {self.path}: "
                                     f"{exc.strerror or exc}") from None
        if 0 < on_disk < 2 * 4096:
            raise _Damaged(f"data.mdb is {on_disk} bytes, shorter than LMDB's two meta pages")
        try:
            self._env = lmdb.open(self.path, map_size=min(self.max_map_bytes, max(self._initial_map, 2 * on_disk)),
                                  max_dbs=2, sync=self.fsync == "commit", metasync=self.fsync == "commit",
                                  readahead=False, lock=True, mode=0o600)
        except _DAMAGE as exc:
            raise _Damaged(f"LMDB cannot open it ({exc})") from None
        except lmdb.Error as exc:
            raise OSError(errno.EIO, f"ssd tier: cannot use data directory {self.path}: {exc}") from None
        self._fd = os.open(data, os.O_RDONLY)
        try:
            self._measure()
            self._check()
            self._data = self._env.open_db(b"blocks")
            self._meta = self._env.open_db(b"meta")
            self._measure()
            if load:
                with self._env.begin(db=self._meta) as txn:
                    rows = [(_META.unpack(raw), bytes(key)) for key, raw in txn.cursor()]
                for (size, checksum, seq), key in sorted(rows, key=lambda r: r[0][2]):
                    self._blocks[key] = (size, checksum)
                    self._seq = max(self._seq, seq)
                self._used = sum(size for size, _ in self._blocks.values())
        except (*_DAMAGE, struct.error) as exc:
            self._close_env()
            raise _Damaged(f"LMDB reports damage ({exc})") from None
        except _Damaged:
            self._close_env()
            raise

    def _measure(self) -> None:
        """Record the bytes of data.mdb LMDB's pages use (after opening and every write)."""
        self._need = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]

    def _check(self) -> None:
        """Raises _Damaged when data.mdb is shorter than LMDB's pages (a read there would
        be SIGBUS). One fstat."""
        size = os.fstat(self._fd).st_size
        if size < self._need:
            raise _Damaged(f"data.mdb shrank to {size} bytes; LMDB's pages need {self._need}")

    def _close_env(self) -> None:
        try:
            self._env.close()
        except Exception:  # noqa: BLE001 — closing a damaged environment
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _quarantine(self, reason: str, lost: list[bytes] | None, seen: int | None = None) -> None:
        """Move the damaged environment aside and open an empty one in its place (waiting
        for reads in flight); report the blocks it held to :attr:`on_lost`. ``seen``: the
        :attr:`quarantines` count when the damage was seen (another thread may have replaced
        the environment since: then nothing is done). Raises OSError when the directory
        cannot be moved or reopened."""
        with self._wlock, self._cv:
            if seen is not None and seen != self.quarantines:
                return
            self._growing = True
            self._cv.wait_for(lambda: self._readers == 0)
            try:
                if self._fd >= 0:
                    self._close_env()
                aside = f"{self.path}.damaged-{int(time.time())}"
                n = 1
                while os.path.exists(aside):
                    aside, n = f"{self.path}.damaged-{int(time.time())}-{n}", n + 1
                try:
                    os.rename(self.path, aside)
                except OSError as exc:
                    raise OSError(exc.errno, f"ssd tier: {self.path} is damaged ({reason}) and cannot "
                                             f"be moved aside: {exc.strerror}") from None
                self._blocks = {}
                self._used = 0
                self._seq = 0
                with self._dlock:
                    self._doomed = []
                self.quarantines += 1
                what = "its blocks are lost" if lost is None else f"{len(lost)} blocks lost"
                log.error("ssd tier at %s is damaged: %s; moved it to %s and opened an empty one (%s); "
                          "the other tiers keep serving", self.path, reason, aside, what)
                try:
                    self._open(load=False)
                except _Damaged as exc:
                    raise OSError(errno.EIO, f"ssd tier: a fresh environment at {self.path} is damaged "
                                             f"too: {exc}") from None
            finally:
                self._growing = False
                self._cv.notify_all()
        if lost and self.on_lost is not None:
            self.on_lost(lost)

    def _guard(self) -> None:
        """Before touching LMDB: quarantine a damaged environment. Raises OSError when it
        cannot be replaced."""
        seen = self.quarantines
        try:
            self._check()
        except _Damaged as exc:
            self._quarantine(str(exc), list(self._blocks), seen)

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
            rows = []
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
                slot.persisted, slot.data = key, None
                self._seq = max(self._seq, seq)
        return errors

    def commit_many(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        """Publish persisted slots (books only); slots not persisted yet are persisted
        first, in one LMDB transaction."""
        errors: list[Exception | None] = [None] * len(items)
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
                    for _, slot, key, checksum, seq in rows:
                        txn.put(key, b"" if slot.data is None else slot.data, db=self._data)
                        txn.put(key, _META.pack(slot.size, checksum, seq), db=self._meta)
                self._measure()
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

    def _grow(self) -> bool:
        """Double the map (up to ``max_map_bytes``) once no read is in flight."""
        new = min(self.max_map_bytes, 2 * self.map_bytes)
        if new <= self.map_bytes:
            return False
        with self._cv:
            self._growing = True
            self._cv.wait_for(lambda: self._readers == 0)
            try:
                self._env.set_mapsize(new)
            finally:
                self._growing = False
                self._cv.notify_all()
        return True

    @contextmanager
    def _reading(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._growing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                if self._readers == 0:
                    self._cv.notify_all()

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
