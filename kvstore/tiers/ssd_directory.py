"""The SSD tier's data directory (kvstore/tiers/ssd_storage.py opens the LMDB environment in
it): this user's alone (0700; one that is another user's or writable by group or others is
refused), held by one tier at a time (an exclusive ``flock`` on :data:`LOCK_FILE`, its
holder's pid in it), LMDB's files regular files (a link or a FIFO is damage), and the checks
that tell a damaged file before LMDB touches it: its meta pages, and a child process that
reads every record (:func:`probe_faults`); a damaged environment moved aside
(:func:`aside_name`), the newest :data:`KEEP_DAMAGED` of them kept (:func:`drop_old_damaged`)."""
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
import time

log = logging.getLogger("kvstore.tiers.ssd")
KEEP_DAMAGED = 2   # moved-aside environments kept (the newest) for a post-mortem; older ones are removed
_ASIDE = re.compile(r"[0-9]+(-[0-9]+)?")   # what follows ``.damaged-`` in a name aside_name makes
LOCK_FILE = "kvstore.lock"   # the tier's own lock in its directory (flock; the holder's pid in it)
LMDB_FILES = ("data.mdb", "lock.mdb")


def what_is(path: str, mode: int) -> str:
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


def metas_valid(data: str) -> bool:
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


def probe_faults(path: str) -> str | None:
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


def check_private(path: str, st: os.stat_result) -> None:
    """Refuse a directory (``st``: its ``stat``) that is not this user's alone: another
    user's, or writable by group or others (anyone who can write it can put a link to
    their choice of file where LMDB's files go). Raises OSError naming the fix."""
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:
        raise OSError(errno.EACCES, f"ssd tier: refusing data directory {path}: it is owned by uid "
                                    f"{st.st_uid}, not this process's uid {uid} (mode {mode:04o}); it must be "
                                    f"this user's alone: chown {uid} {path} && chmod 700 {path}")
    if mode & 0o022:
        raise OSError(errno.EACCES, f"ssd tier: refusing data directory {path}: mode {mode:04o} lets "
                                    f"group or others write to it; it must be this user's alone: "
                                    f"chmod 700 {path}")


def take_lock(path: str, held_fd: int) -> int:
    """The descriptor of an exclusive ``flock`` on :data:`LOCK_FILE` in the directory ``path``
    (made 0600, never through a link), held until :func:`unlock`, with this process's pid
    written into it. ``held_fd`` (-1: none) is kept when it is that file already; after a
    quarantine (the directory moved aside with the lock in it) the new directory's is taken,
    then the old one let go. Raises OSError when another holder has it (naming its pid) or it
    cannot be made."""
    lock = os.path.join(path, LOCK_FILE)
    if held_fd >= 0:
        try:
            here, held = os.lstat(lock), os.fstat(held_fd)
            if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                return held_fd
        except FileNotFoundError:
            pass
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        reason = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise OSError(exc.errno, f"ssd tier: cannot use data directory {path}: {LOCK_FILE}: "
                                 f"{reason}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"ssd tier: cannot use data directory {path}: {LOCK_FILE} is "
                                        f"{what_is(lock, mode)}, not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = (("this process, " if pid == str(os.getpid()) else "") + f"pid {pid}") if pid.isdigit() \
                else "its pid not recorded"
            raise OSError(errno.EBUSY, f"ssd tier: data directory {path} is in use by another SSD tier "
                                       f"({who}): two nodes cannot share one; stop that one or give this node "
                                       f"another data directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    if held_fd >= 0:
        os.close(held_fd)
    return fd


def unlock(fd: int) -> None:
    """Let go of the directory's lock ``fd`` from :func:`take_lock` (-1: none held)."""
    if fd >= 0:
        try:
            os.ftruncate(fd, 0)   # no stale pid left behind
        except OSError:
            pass
        os.close(fd)


def odd_files(path: str) -> list[str]:
    """What is wrong with LMDB's files in ``path``: each of data.mdb / lock.mdb that exists
    and is not a regular file (LMDB would follow a link or block on a FIFO), found with
    ``lstat`` before anything opens them. Raises OSError when one cannot be looked at."""
    odd = []
    for name in LMDB_FILES:
        entry = os.path.join(path, name)
        try:
            mode = os.lstat(entry).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise OSError(exc.errno, f"ssd tier: cannot use data directory {path}: {name}: "
                                     f"{exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            odd.append(f"{name} is {what_is(entry, mode)}, not a regular file")
    return odd


def asides(path: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The parent directory of the tier's directory ``path`` and the names in it that :func:`aside_name` makes
    (``<dir>.damaged-<time>[-<n>]``, whatever they are now), each with its order key
    ``(time, n)`` (``(time,)`` for the first of a second). Raises OSError."""
    parent, base = os.path.split(os.path.abspath(path))
    prefix = base + ".damaged-"
    return parent, {n: tuple(int(part) for part in n[len(prefix):].split("-")) for n in os.listdir(parent)
                    if n.startswith(prefix) and _ASIDE.fullmatch(n[len(prefix):])}


def aside_name(path: str) -> str:
    """A free name to move the environment to: ``<path>.damaged-<unix time>``, or with
    ``-<n>`` past every ``n`` already used in that second (a removed older one's name is
    never reused, so names sort as the environments were moved). A name taken, even by a
    link, is never renamed over."""
    t = int(time.time())
    first = f"{path}.damaged-{t}"
    _, names = asides(path)
    used = [order[1] if len(order) > 1 else 0 for order in names.values() if order[0] == t]
    if not used and not os.path.lexists(first):
        return first
    n = 1 + max(used, default=0)
    while os.path.lexists(f"{first}-{n}"):
        n += 1
    return f"{first}-{n}"


def drop_old_damaged(path: str, aside: str) -> None:
    """Remove this tier's moved-aside environments beyond the newest :data:`KEEP_DAMAGED`
    (``aside``, the one just made, and the newest others by the time in their names): a
    failing disk quarantining again and again would otherwise fill itself, each copy up
    to the tier's size. Only directories named as :func:`aside_name` names them are
    removed (a link or file of that name is left, never followed; another name, e.g. a
    copy a person renamed to keep, is never touched), each with a log line; a failure
    to remove is logged."""
    try:
        parent, names = asides(path)
        older = {n: order for n, order in names.items() if os.path.join(parent, n) != os.path.abspath(aside)
                 and stat.S_ISDIR(os.lstat(os.path.join(parent, n)).st_mode)}
    except OSError as exc:
        log.warning("ssd tier at %s: cannot list moved-aside environments: %s", path, exc)
        return
    for name in sorted(older, key=older.__getitem__, reverse=True)[KEEP_DAMAGED - 1:]:
        old = os.path.join(parent, name)
        try:
            shutil.rmtree(old)
            log.warning("ssd tier at %s: removed %s, an older damaged environment (the newest %d are kept)",
                        path, old, KEEP_DAMAGED)
        except OSError as exc:
            log.warning("ssd tier at %s: cannot remove %s: %s", path, old, exc)
