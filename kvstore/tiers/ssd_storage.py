"""The LMDB environment under an SSD tier (kvstore/tiers/ssd.py): opening it and reading its
books, the size check that keeps a truncated file from being touched (SIGBUS), quarantine of
a damaged environment, growth of the map and the count of reads in flight.

LMDB maps its file, so touching a page past the end of a truncated file is SIGBUS; the tier
therefore checks the file's size against the pages LMDB uses (``(last_pgno + 1) * page
size``) when it opens and before every read and write (one ``fstat``), and treats LMDB's own
corruption errors the same way; at open, a child process first reads every record
(``_PROBE``), since a damaged page can also lead LMDB outside the file with the size
intact, and its death by a signal is damage. A damaged environment is moved aside
(``ssd.damaged-<unix time>``; the newest :data:`KEEP_DAMAGED` are kept, older ones removed)
and an empty one opened in its place; the blocks it held are
reported to the pool (``on_lost``) as lost, one log line says what happened and
``quarantines`` counts it. A ``data.mdb`` or ``lock.mdb`` that is not a regular file (a
symbolic link, a FIFO, a device, a directory) is damage too, found with ``lstat`` before
anything opens or probes it: LMDB would follow a link and write outside the directory, and
a FIFO would hang the probe.

The directory is this user's alone: made 0700, and one that is another user's or writable
by group or others is refused (another user could plant such links there). The tier holds
an exclusive ``flock`` on ``kvstore.lock`` in it (its holder's pid written in it) from open
to close, so a second node on the same directory fails at once instead of sharing the LMDB
environment (their books diverge and reads fail with MDB_MAP_RESIZED).

The third database, ``owners`` (key → the tenant's namespace, utf-8; kvstore/pool/tenants.py),
keeps a block's tenant across a restart: read at open into ``recovered_owners``. A row that
is not a namespace is left out (the block is then unattributed, ``""``) with one log line.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lmdb

from kvstore.index.keys import VALID_KEY_BYTES

log = logging.getLogger("kvstore.tiers.ssd")
_META = struct.Struct("<QQQ")  # size, checksum, write sequence
_MIN_MAP = 64 << 20
# LMDB errors that mean the file is damaged (any other LMDB error at open: the directory is
# unusable, an OSError for the caller).
_DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
           lmdb.VersionMismatchError, lmdb.BadTxnError)


KEEP_DAMAGED = 2   # moved-aside environments kept (the newest) for a post-mortem; older ones are removed
_ASIDE = re.compile(r"[0-9]+(-[0-9]+)?")   # what follows ``.damaged-`` in a name _aside_name makes
LOCK_FILE = "kvstore.lock"   # the tier's own lock in its directory (flock; the holder's pid in it)
_LMDB_FILES = ("data.mdb", "lock.mdb")


def _what(path: str, mode: int) -> str:
    """What the entry at ``path`` (of ``lstat`` mode ``mode``) is, when not a regular file."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"of file type {stat.S_IFMT(mode):o}"


_META_PAGE = struct.Struct("<II")   # a meta page's magic and data version, after its 16-byte page header
_MAGIC, _VERSION = 0xBEEFC0DE, 1   # LMDB's MDB_MAGIC and MDB_DATA_VERSION (lmdb.h, mdb.c)


def _metas_valid(data: str) -> bool:
    """Whether both of LMDB's meta pages at the head of ``data`` carry its magic and data
    version (LMDB refuses the file unless both do; its pages are the OS page size, as LMDB
    makes them). False when they cannot be read."""
    page = mmap.PAGESIZE
    try:
        with open(data, "rb") as f:
            head = f.read(2 * page)
    except OSError:
        return False
    return len(head) == 2 * page and all(_META_PAGE.unpack_from(head, at + 16) == (_MAGIC, _VERSION)
                                         for at in (0, page))


# Run in a child process when a tier opens an environment that holds blocks: it reads every
# record as the tier will (each value's first and last byte: a block is one run of pages), so
# that a damaged page whose offsets lead LMDB past what the file backs (SIGBUS) or out of its
# map (SIGSEGV) kills the child, not the node. An LMDB error exits 1: the tier's own open
# reports that. Only lmdb is imported (tens of ms); the reads go through the page cache the
# tier's own scan then uses.
_PROBE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=3, readahead=False)
with env.begin(buffers=True) as txn:
    for name in (b"meta", b"blocks", b"owners"):
        try:
            db = env.open_db(name, txn=txn, create=False)
        except lmdb.NotFoundError:
            continue
        for key, value in txn.cursor(db=db):
            if len(value):
                value[0], value[len(value) - 1]
"""


def _probe_faults(path: str) -> str | None:
    """Read every record of the LMDB environment at ``path`` in a child process (see
    ``_PROBE``); the signal that killed it (``"SIGBUS"``), else None (read through, or an
    LMDB error the caller's own open meets)."""
    proc = subprocess.run([sys.executable, "-I", "-c", _PROBE, path], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if proc.returncode >= 0:
        return None
    try:
        return signal.Signals(-proc.returncode).name
    except ValueError:
        return f"signal {-proc.returncode}"


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
        self._check_private(st)
        self._take_lock()
        odd = []   # data.mdb / lock.mdb that are not regular files: LMDB would follow or block on them
        for name in _LMDB_FILES:
            entry = os.path.join(self.path, name)
            try:
                mode = os.lstat(entry).st_mode
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise OSError(exc.errno, f"ssd tier: cannot use data directory {self.path}: {name}: "
                                         f"{exc.strerror or exc}") from None
            if not stat.S_ISREG(mode):
                odd.append(f"{name} is {_what(entry, mode)}, not a regular file")
        if odd:
            raise _Damaged("; ".join(odd))
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
        elif load and on_disk and (fault := _probe_faults(self.path)) is not None:
            raise _Damaged(f"reading its records killed a checking process with {fault} (a damaged page "
                           f"points LMDB outside the file)")
        try:
            self._env = lmdb.open(self.path, map_size=min(self.max_map_bytes, max(self._initial_map, 2 * on_disk)),
                                  max_dbs=3, sync=self.fsync == "commit", metasync=self.fsync == "commit",
                                  readahead=False, lock=True, mode=0o600)
        except _DAMAGE as exc:
            raise _Damaged(f"LMDB cannot open it ({exc})") from None
        except lmdb.Error as exc:
            if exists and not _metas_valid(data):   # LMDB says so in a plain Error (e.g. a bad version)
                raise _Damaged(f"its meta pages are damaged ({exc})") from None
            raise OSError(errno.EIO, f"ssd tier: cannot use data directory {self.path}: {exc}") from None
        self._fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
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
        except (*_DAMAGE, struct.error) as exc:
            self._close_env()
            raise _Damaged(f"LMDB reports damage ({exc})") from None
        except _Damaged:
            self._close_env()
            raise

    def _check_private(self, st: os.stat_result) -> None:
        """Refuse a directory (``st``: its ``stat``) that is not this user's alone: another
        user's, or writable by group or others (anyone who can write it can put a link to
        their choice of file where LMDB's files go). Raises OSError naming the fix."""
        uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
        if st.st_uid != uid:
            raise OSError(errno.EACCES, f"ssd tier: refusing data directory {self.path}: it is owned by uid "
                                        f"{st.st_uid}, not this process's uid {uid} (mode {mode:04o}); it must be "
                                        f"this user's alone: chown {uid} {self.path} && chmod 700 {self.path}")
        if mode & 0o022:
            raise OSError(errno.EACCES, f"ssd tier: refusing data directory {self.path}: mode {mode:04o} lets "
                                        f"group or others write to it; it must be this user's alone: "
                                        f"chmod 700 {self.path}")

    def _take_lock(self) -> None:
        """Hold an exclusive ``flock`` on :data:`LOCK_FILE` in the directory (made 0600, never
        through a link) until :meth:`_unlock`, and write this process's pid into it. Kept
        when the one held is that file already; after a quarantine (the directory moved aside
        with the lock in it) the new directory's is taken, then the old one let go. Raises
        OSError when another holder has it (naming its pid) or it cannot be made."""
        lock = os.path.join(self.path, LOCK_FILE)
        if self._lock_fd >= 0:
            try:
                here, held = os.lstat(lock), os.fstat(self._lock_fd)
                if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                    return
            except FileNotFoundError:
                pass
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            reason = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
            raise OSError(exc.errno, f"ssd tier: cannot use data directory {self.path}: {LOCK_FILE}: "
                                     f"{reason}") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise OSError(errno.EINVAL, f"ssd tier: cannot use data directory {self.path}: {LOCK_FILE} is "
                                            f"{_what(lock, mode)}, not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                who = (("this process, " if pid == str(os.getpid()) else "") + f"pid {pid}") if pid.isdigit() \
                    else "its pid not recorded"
                raise OSError(errno.EBUSY, f"ssd tier: data directory {self.path} is in use by another SSD tier "
                                           f"({who}): two nodes cannot share one; stop that one or give this node "
                                           f"another data directory") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        old, self._lock_fd = self._lock_fd, fd
        if old >= 0:
            os.close(old)

    def _unlock(self) -> None:
        """Let go of the directory's lock (at close, or when opening failed)."""
        if self._lock_fd >= 0:
            try:
                os.ftruncate(self._lock_fd, 0)   # no stale pid left behind
            except OSError:
                pass
            os.close(self._lock_fd)
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
                aside = self._aside_name()
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
        self._drop_old_damaged(aside)
        if lost and self.on_lost is not None:
            self.on_lost(lost)

    def _asides(self) -> tuple[str, dict[str, tuple[int, ...]]]:
        """This tier's parent directory and the names in it that :meth:`_aside_name` makes
        (``<dir>.damaged-<time>[-<n>]``, whatever they are now), each with its order key
        ``(time, n)`` (``(time,)`` for the first of a second). Raises OSError."""
        parent, base = os.path.split(os.path.abspath(self.path))
        prefix = base + ".damaged-"
        return parent, {n: tuple(int(part) for part in n[len(prefix):].split("-")) for n in os.listdir(parent)
                        if n.startswith(prefix) and _ASIDE.fullmatch(n[len(prefix):])}

    def _aside_name(self) -> str:
        """A free name to move the environment to: ``<path>.damaged-<unix time>``, or with
        ``-<n>`` past every ``n`` already used in that second (a removed older one's name is
        never reused, so names sort as the environments were moved). A name taken, even by a
        link, is never renamed over."""
        t = int(time.time())
        first = f"{self.path}.damaged-{t}"
        _, names = self._asides()
        used = [order[1] if len(order) > 1 else 0 for order in names.values() if order[0] == t]
        if not used and not os.path.lexists(first):
            return first
        n = 1 + max(used, default=0)
        while os.path.lexists(f"{first}-{n}"):
            n += 1
        return f"{first}-{n}"

    def _drop_old_damaged(self, aside: str) -> None:
        """Remove this tier's moved-aside environments beyond the newest :data:`KEEP_DAMAGED`
        (``aside``, the one just made, and the newest others by the time in their names): a
        failing disk quarantining again and again would otherwise fill itself, each copy up
        to the tier's size. Only directories named as :meth:`_aside_name` names them are
        removed (a link or file of that name is left, never followed; another name, e.g. a
        copy a person renamed to keep, is never touched), each with a log line; a failure
        to remove is logged."""
        try:
            parent, names = self._asides()
            older = {n: order for n, order in names.items() if os.path.join(parent, n) != os.path.abspath(aside)
                     and stat.S_ISDIR(os.lstat(os.path.join(parent, n)).st_mode)}
        except OSError as exc:
            log.warning("ssd tier at %s: cannot list moved-aside environments: %s", self.path, exc)
            return
        for name in sorted(older, key=older.__getitem__, reverse=True)[KEEP_DAMAGED - 1:]:
            old = os.path.join(parent, name)
            try:
                shutil.rmtree(old)
                log.warning("ssd tier at %s: removed %s, an older damaged environment (the newest %d are kept)",
                            self.path, old, KEEP_DAMAGED)
            except OSError as exc:
                log.warning("ssd tier at %s: cannot remove %s: %s", self.path, old, exc)

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
