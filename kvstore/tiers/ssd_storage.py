"""The LMDB environment under an SSD tier (kvstore/tiers/ssd.py): opening it and reading its
books, the size check that keeps a truncated file from being touched (SIGBUS), quarantine of
a damaged environment, growth of the map and the count of reads in flight.

LMDB maps its file, so touching a page past the end of a truncated file is SIGBUS; the tier
therefore checks the file's size against the pages LMDB uses (``(last_pgno + 1) * page
size``) when it opens and before every read and write (one ``fstat``), and treats LMDB's own
corruption errors the same way; at open, a child process first reads every record
(kvstore/tiers/ssd_directory.py ``probe_faults``), since a damaged page can also lead LMDB
outside the file with the size intact, and its death by a signal is damage. A damaged
environment is moved aside (``ssd.damaged-<unix time>``; the newest ``KEEP_DAMAGED`` are
kept, older ones removed)
and an empty one opened in its place; the blocks it held are
reported to the pool (``on_lost``) as lost, one log line says what happened and
``quarantines`` counts it. A ``data.mdb`` or ``lock.mdb`` that is not a regular file (a
symbolic link, a FIFO, a device, a directory) is damage too, found with ``lstat`` before
anything opens or probes it: LMDB would follow a link and write outside the directory, and
a FIFO would hang the probe.

The directory is this user's alone, held by one tier at a time from open to close (a second
node on it fails at once instead of sharing the LMDB environment, whose books would diverge),
and its damaged environments are moved aside in it: kvstore/tiers/ssd_directory.py.

The third database, ``owners`` (key → the tenant's namespace, utf-8; kvstore/pool/tenants.py),
keeps a block's tenant across a restart: read at open into ``recovered_owners``. A row that
is not a namespace is left out (the block is then unattributed, ``""``) with one log line.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lmdb

from kvstore.index.keys import VALID_KEY_BYTES
from kvstore.tiers.ssd_directory import (
    aside_name,
    check_private,
    drop_old_damaged,
    metas_valid,
    odd_files,
    probe_faults,
    take_lock,
    unlock,
)

log = logging.getLogger("kvstore.tiers.ssd")
_META = struct.Struct("<QQQ")  # size, checksum, write sequence
_MIN_MAP = 64 << 20
# LMDB errors that mean the file is damaged (any other LMDB error at open: the directory is
# unusable, an OSError for the caller).
_DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
           lmdb.VersionMismatchError, lmdb.BadTxnError)




class _Damaged(Exception):
    """The environment is damaged (the message says how); it must be quarantined."""


class SsdStorage:
    """The environment side of :class:`kvstore.tiers.ssd.SsdTier` (a mixin: the tier holds
    the state these methods use)."""

    path: str
    fsync: str
    max_map_bytes: int
    _initial_map: int
    _blocks: dict[bytes, tuple[int, int]]
    _used: int
    _seq: int
    _readers: int
    _growing: bool
    _cv: threading.Condition
    _wlock: threading.RLock
    _dlock: threading.Lock
    _doomed: list[bytes]
    _fd: int
    _lock_fd: int
    _need: int
    _env: lmdb.Environment
    _data: Any
    _meta: Any
    _owners: Any
    recovered_owners: dict[bytes, str]
    quarantines: int
    on_lost: Callable[[list[bytes]], None] | None

    if TYPE_CHECKING:
        @property
        def map_bytes(self) -> int: ...   # the tier's (SsdTier.map_bytes: the LMDB map's size)

    # -- opening, damage and quarantine ----------------------------------------------------
    def _open(self, load: bool) -> None:
        """Open (creating) the environment at :attr:`path`; with ``load``, read the books
        of what it holds. Raises OSError (one line) when the directory cannot be used (not
        this user's alone, or another tier holds its lock) and _Damaged when the file is
        damaged or data.mdb / lock.mdb is not a regular file (checked before anything opens
        them, the lock held first)."""
        data = os.path.join(self.path, "data.mdb")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)   # every tenant's blocks: this user only
            st = os.stat(self.path)
            if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "permission denied")
        except OSError as exc:
            raise OSError(exc.errno, f"ssd tier: cannot use data directory {self.path}: "
                                     f"{exc.strerror or exc}") from None
        check_private(self.path, st)
        self._lock_fd = take_lock(self.path, self._lock_fd)
        odd = odd_files(self.path)
        if odd:
            raise _Damaged("; ".join(odd))
        exists, on_disk = self._on_disk(data, load)
        try:
            self._env = lmdb.open(self.path, map_size=min(self.max_map_bytes, max(self._initial_map, 2 * on_disk)),
                                  max_dbs=3, sync=self.fsync == "commit", metasync=self.fsync == "commit",
                                  readahead=False, lock=True, mode=0o600)
        except _DAMAGE as exc:
            raise _Damaged(f"LMDB cannot open it ({exc})") from None
        except lmdb.Error as exc:
            if exists and not metas_valid(data):   # LMDB says so in a plain Error (e.g. a bad version)
                raise _Damaged(f"its meta pages are damaged ({exc})") from None
            raise OSError(errno.EIO, f"ssd tier: cannot use data directory {self.path}: {exc}") from None
        self._fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._open_books(load)
        except (*_DAMAGE, struct.error) as exc:
            self._close_env()
            raise _Damaged(f"LMDB reports damage ({exc})") from None
        except _Damaged:
            self._close_env()
            raise

    def _on_disk(self, data: str, load: bool) -> tuple[bool, int]:
        """Whether ``data`` (data.mdb) exists and its size, once it is known fit to open:
        raises _Damaged when it is shorter than LMDB's meta pages or (with ``load``) reading
        its records kills a checking process; OSError when it cannot be used."""
        try:
            exists = os.path.exists(data)
            on_disk = os.path.getsize(data) if exists else 0
            if exists and not os.access(data, os.R_OK | os.W_OK):
                raise PermissionError(errno.EACCES, "permission denied")
        except OSError as exc:
            raise OSError(exc.errno, f"ssd tier: cannot use data directory {self.path}: "
                                     f"{exc.strerror or exc}") from None
        if on_disk == 0 and exists:
            # Holds nothing to lose: LMDB starts it afresh. LMDB writes its meta pages as it
            # creates the file, so this is a crash in that instant or a file emptied from
            # outside; said in case it is the second.
            log.warning("ssd tier at %s: data.mdb is empty (0 bytes); starting it afresh (if it held "
                        "blocks, something outside emptied it, and they are gone)", self.path)
        elif 0 < on_disk < 2 * mmap.PAGESIZE:
            raise _Damaged(f"data.mdb is {on_disk} bytes, shorter than LMDB's two meta pages")
        elif load and on_disk and (fault := probe_faults(self.path)) is not None:
            raise _Damaged(f"reading its records killed a checking process with {fault} (a damaged page "
                           f"points LMDB outside the file)")
        return exists, on_disk

    def _open_books(self, load: bool) -> None:
        """Open the three databases of the environment just opened; with ``load``, read the
        books of what it holds."""
        self._measure()
        self._check()
        self._data = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._owners = self._env.open_db(b"owners")
        self._measure()
        if load:
            rows = self._read_books()
            for (size, checksum, seq), key in sorted(rows, key=lambda r: r[0][2]):
                self._blocks[key] = (size, checksum)
                self._seq = max(self._seq, seq)
            self._used = sum(size for size, _ in self._blocks.values())
            self.recovered_owners = self._load_owners()

    def _unlock(self) -> None:
        """Let go of the directory's lock (at close, or when opening failed)."""
        unlock(self._lock_fd)
        self._lock_fd = -1

    def _read_books(self) -> list[tuple[tuple[int, int, int], bytes]]:
        """The ``meta`` rows ((size, checksum, write sequence), key) whose block is stored
        with that many bytes. A row that cannot be read, whose key is of a length the key
        spec cannot make (kvstore/index/keys.py ``VALID_KEY_BYTES``: no wire stores one), or
        whose block is missing or of another size (a damaged record LMDB does not detect: a
        flipped bit in a size once stopped the node from starting), is deleted with its
        block, one log line with the count; a block of the right size whose bytes are
        damaged fails its checksum on read."""
        rows: list[tuple[tuple[int, int, int], bytes]] = []
        bad: list[bytes] = []
        with self._env.begin(buffers=True) as txn:   # no copies: only the values' lengths are read
            for view, raw in txn.cursor(db=self._meta):
                key = bytes(view)
                if len(key) not in VALID_KEY_BYTES:
                    bad.append(key)
                    continue
                try:
                    size, checksum, seq = _META.unpack(raw)
                except struct.error:
                    bad.append(key)
                    continue
                value = txn.get(key, db=self._data)
                if value is None or len(value) != size:
                    bad.append(key)
                    continue
                rows.append(((size, checksum, seq), key))
        if bad:
            with self._env.begin(write=True) as wtxn:
                for key in bad:
                    for db in (self._data, self._meta, self._owners):
                        wtxn.delete(key, db=db)
            log.warning("ssd tier at %s: %d blocks had a damaged record (unreadable, a key of a length the "
                        "key spec cannot make, or a size that does not match the bytes stored); dropped",
                        self.path, len(bad))
        return rows

    def _load_owners(self) -> dict[bytes, str]:
        """The ``owners`` rows of blocks held: key → namespace. Rows that are not a
        namespace are left out (one log line with their count)."""
        from kvstore.errors import InvalidArgument
        from kvstore.pool.quotas import check_namespace
        out: dict[bytes, str] = {}
        bad = 0
        with self._env.begin(db=self._owners) as txn:
            for key, raw in txn.cursor():
                key = bytes(key)
                if key not in self._blocks:
                    continue
                try:
                    out[key] = check_namespace(bytes(raw).decode())
                except (UnicodeDecodeError, InvalidArgument):
                    bad += 1
        if bad:
            log.warning("ssd tier at %s: %d blocks have a damaged tenant record; they are unattributed",
                        self.path, bad)
        return out

    def _measure(self, cover: bool = False) -> None:
        """Record the bytes of data.mdb LMDB's pages use (after opening and every write).
        ``cover`` (right after this tier's own write transaction): extend the file to them.
        LMDB counts in ``last_pgno`` the pages a transaction copied and freed again before
        its commit ("loose" pages, e.g. of a transaction deleting many rows) but never writes
        them, so the file can end short of that count with nothing damaged; the size check
        then took a healthy environment for a truncated one and moved it aside. The pages
        added are free ones (zeros), which LMDB writes in full before it reads them."""
        self._need = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        if cover and os.fstat(self._fd).st_size < self._need:
            fd = os.open(os.path.join(self.path, "data.mdb"), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, max(self._need, os.fstat(fd).st_size))
            finally:
                os.close(fd)

    def _check(self) -> None:
        """Raises _Damaged when data.mdb is shorter than LMDB's pages (a read there would
        be SIGBUS). One fstat. The need is read before the size: a write transaction on
        another thread may grow both in between, and the file never shrinks by itself."""
        need = self._need
        size = os.fstat(self._fd).st_size
        if size < need:
            raise _Damaged(f"data.mdb shrank to {size} bytes; LMDB's pages need {need}")

    def _close_env(self) -> None:
        try:
            self._env.close()
        except Exception:  # noqa: BLE001, S110 — closing a damaged environment
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
                aside = aside_name(self.path)
                try:
                    os.rename(self.path, aside)   # the entry itself: a link is moved, never its target
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
        drop_old_damaged(self.path, aside)
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
