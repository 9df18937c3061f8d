"""The SSD tier's data directory (kvstore/tiers/ssd_directory.py): this user's alone, held by
one tier at a time, LMDB's files regular files (a link or a FIFO is damage, moved aside
untouched), and the moved-aside copies of damaged environments: never renamed over, the
newest kept, a copy a person renamed never removed."""
from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.integrity import checksum_of
from kvstore.tiers.ssd import SsdTier
from tests.helpers.ssd_helpers import damage_lines, fill_ssd, serve_node, ssd_block, ssd_key


def _outside(tmp_path: Path, name: str, content: bytes) -> Path:
    """A file outside the SSD directory, one an attacker would like overwritten."""
    victim = tmp_path / "outside" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(content)
    return victim


@pytest.mark.parametrize(("name", "kind"), [("lock.mdb", "link"), ("data.mdb", "link"), ("data.mdb", "empty-link"),
                                          ("data.mdb", "directory")])
def test_lmdb_files_that_are_not_regular_files_are_moved_aside_untouched(tmp_path: Path, caplog, name: str,
                                                                         kind: str) -> None:
    """A data.mdb or lock.mdb that is a symbolic link or a directory is damage, found
    (lstat) before LMDB or the start-up probe touches it: LMDB overwrote a linked lock.mdb's
    target and wrote blocks into a linked empty data.mdb's. Moved aside (the link itself,
    not its target) with one line naming what it was; the tier starts empty and works."""
    import stat
    path = tmp_path / "ssd"
    fill_ssd(path, 3)
    entry = path / name
    entry.unlink()
    victim = None
    if kind == "directory":
        entry.mkdir()
        what = "a directory"
    else:
        victim = _outside(tmp_path, name, b"" if kind == "empty-link" else b"precious data\n" * 100)
        entry.symlink_to(victim)
        what = f"a symbolic link (to {victim})"
    before = victim.read_bytes() if victim else b""
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        lines = damage_lines(caplog)
        assert tier.quarantines == 1 and tier.usage().blocks == 0
        assert len(lines) == 1 and f"{name} is {what}, not a regular file" in lines[0]
        aside = glob.glob(f"{path}.damaged-*")
        assert len(aside) == 1
        moved = os.lstat(os.path.join(aside[0], name)).st_mode      # the entry itself went aside
        assert stat.S_ISDIR(moved) if kind == "directory" else stat.S_ISLNK(moved)
        assert all(stat.S_ISREG(os.lstat(path / f).st_mode) for f in ("data.mdb", "lock.mdb"))
        tier.put(ssd_key(1), ssd_block(1), checksum_of(ssd_block(1)))
        assert tier.get(ssd_key(1)) == ssd_block(1)
    finally:
        tier.close()
    if victim is not None:
        assert victim.read_bytes() == before         # nothing written through the link


def test_a_fifo_named_data_mdb_does_not_hang_start_up(tmp_path: Path) -> None:
    """A FIFO named data.mdb hung start-up for good (the probe, then LMDB, read it; in a
    child process here, since LMDB's open holds the interpreter). It is damage: moved aside
    with one line, the tier starts empty and works."""
    import stat
    path = tmp_path / "ssd"
    fill_ssd(path, 3)
    (path / "data.mdb").unlink()
    os.mkfifo(path / "data.mdb")
    script = ("import logging, sys\nlogging.basicConfig(level=logging.ERROR)\n"
              "from kvstore.integrity import checksum_of\nfrom kvstore.tiers.ssd import SsdTier\n"
              "t = SsdTier(64 << 20, sys.argv[1]); t.put(b'k' * 32, b'v' * 100, checksum_of(b'v' * 100))\n"
              "print(t.quarantines, t.get(b'k' * 32) == b'v' * 100); t.close()")
    try:
        out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        os.close(os.open(path / "data.mdb", os.O_WRONLY | os.O_NONBLOCK))   # let a probe stuck in it go
        pytest.fail("opening a tier over a FIFO named data.mdb hung")
    assert out.returncode == 0 and out.stdout.split() == ["1", "True"], out.stderr
    lines = [line for line in out.stderr.splitlines() if "is damaged" in line]
    assert len(lines) == 1 and "data.mdb is a FIFO, not a regular file" in lines[0], out.stderr
    aside = glob.glob(f"{path}.damaged-*")
    assert len(aside) == 1 and stat.S_ISFIFO(os.lstat(os.path.join(aside[0], "data.mdb")).st_mode)


def test_quarantine_never_renames_over_a_link(tmp_path: Path, caplog) -> None:
    """The name a damaged directory is moved to may be taken by a dangling link: it counts
    as taken (lexists), so the directory goes to the next name instead of the rename
    failing (ENOTDIR) or landing where the link points."""
    import time
    path = tmp_path / "ssd"
    fill_ssd(path, 3)
    os.truncate(path / "data.mdb", 4096)
    now = int(time.time())
    for t in range(now - 1, now + 30):
        os.symlink(tmp_path / f"nowhere-{t}", f"{path}.damaged-{t}")
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        assert tier.quarantines == 1
        aside = [p for p in glob.glob(f"{path}.damaged-*") if not os.path.islink(p)]
        assert len(aside) == 1 and os.path.isfile(os.path.join(aside[0], "data.mdb"))
        assert not glob.glob(str(tmp_path / "nowhere-*"))
    finally:
        tier.close()


def test_a_new_directory_is_private_and_one_open_to_others_is_refused(tmp_path: Path) -> None:
    """kvstore makes the SSD directory 0700 (its lock file 0600); an existing one that group
    or others can write is refused with one error naming it, its mode and the fix, and
    nothing is written into it (another user could have planted links there)."""
    import stat
    path = tmp_path / "ssd"
    SsdTier(64 << 20, str(path)).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((path / "kvstore.lock").stat().st_mode) == 0o600
    for mode in (0o777, 0o770, 0o702):
        loose = tmp_path / f"loose-{mode:o}"
        loose.mkdir()
        os.chmod(loose, mode)
        with pytest.raises(OSError) as err:
            SsdTier(64 << 20, str(loose))
        assert (f"ssd tier: refusing data directory {loose}: mode {mode:04o} lets group or others write to it"
                in str(err.value)) and f"chmod 700 {loose}" in str(err.value)
        assert os.listdir(loose) == []
        os.chmod(loose, 0o700)                        # the fix it names works
        SsdTier(64 << 20, str(loose)).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    path.mkdir(mode=0o700)
    os.chown(path, 4242, -1)
    with pytest.raises(OSError, match=f"refusing data directory {path}: it is owned by uid 4242, not this "
                                      f"process's uid 0 .*chmod 700 {path}"):
        SsdTier(64 << 20, str(path))
    assert os.listdir(path) == []


def test_serve_on_a_directory_open_to_others_exits_with_one_line(tmp_path: Path) -> None:
    ssd = tmp_path / "data" / "node-0" / "ssd"
    ssd.mkdir(parents=True)
    os.chmod(ssd, 0o777)
    out = serve_node(tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "mode 0777" in lines[0] and f"chmod 700 {ssd}" in lines[0], out.stderr


def test_a_second_tier_on_the_same_directory_fails_at_once(tmp_path: Path) -> None:
    """Each tier holds an exclusive flock on kvstore.lock in its directory from open to
    close (two nodes on one LMDB diverged, then failed reads with MDB_MAP_RESIZED): a second
    opener, in this process or another, fails at once naming the directory and the holder's
    pid, and touches nothing; the lock follows a quarantine to the fresh directory and is
    let go at close."""
    path = tmp_path / "ssd"
    first = SsdTier(64 << 20, str(path))
    try:
        for i in range(3):
            first.put(ssd_key(i), ssd_block(i), checksum_of(ssd_block(i)))
        with pytest.raises(OSError, match=f"data directory {path} is in use by another SSD tier "
                                          f"\\(this process, pid {os.getpid()}\\)"):
            SsdTier(64 << 20, str(path))
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from kvstore.tiers.ssd import SsdTier\n"
             "try:\n    SsdTier(64 << 20, sys.argv[1])\nexcept OSError as e:\n    sys.exit(str(e))",
             str(path)], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert child.returncode == 1 and f"in use by another SSD tier (pid {os.getpid()})" in child.stderr
        assert all(first.get(ssd_key(i)) == ssd_block(i) for i in range(3)) and not glob.glob(f"{path}.damaged-*")
        os.truncate(path / "data.mdb", 8192)          # quarantined while held: the new directory is held too
        first.put(ssd_key(9), ssd_block(9), checksum_of(ssd_block(9)))
        assert first.quarantines == 1 and first.get(ssd_key(9)) == ssd_block(9)
        with pytest.raises(OSError, match="in use by another SSD tier"):
            SsdTier(64 << 20, str(path))
        assert (path / "kvstore.lock").read_text() == f"{os.getpid()}\n"
    finally:
        first.close()
    second = SsdTier(64 << 20, str(path))             # let go at close
    try:
        assert second.quarantines == 0 and second.get(ssd_key(9)) == ssd_block(9)
    finally:
        second.close()
def test_only_the_newest_damaged_environments_are_kept(tmp_path: Path, caplog) -> None:
    """A disk damaging the tier again and again does not fill itself with moved-aside
    copies: the newest KEEP_DAMAGED stay for a post-mortem, older ones are removed with a
    line each, and a link of such a name is neither removed nor followed."""
    from kvstore.tiers.ssd_directory import KEEP_DAMAGED
    path = tmp_path / "ssd"
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not the tier's")
    os.symlink(target, f"{path}.damaged-1")
    kept_marks = []
    for round_ in range(KEEP_DAMAGED + 3):
        fill_ssd(path, 2)
        (path / f"round-{round_}").write_text("")
        os.truncate(path / "data.mdb", 4096)
        with caplog.at_level(logging.WARNING, logger="kvstore.tiers.ssd"):
            tier = SsdTier(64 << 20, str(path))
        assert tier.quarantines == 1
        tier.close()
        kept_marks.append(f"round-{round_}")
    aside = [p for p in glob.glob(f"{path}.damaged-*") if not os.path.islink(p)]
    assert len(aside) == KEEP_DAMAGED
    marks = sorted(m for p in aside for m in os.listdir(p) if m.startswith("round-"))
    assert marks == sorted(kept_marks[-KEEP_DAMAGED:])       # the newest ones
    removed = [r for r in caplog.records if "an older damaged environment" in r.getMessage()]
    assert len(removed) == 3
    assert os.path.islink(f"{path}.damaged-1") and (target / "keep.txt").read_text() == "not the tier's"


def test_a_moved_aside_copy_a_person_renamed_is_never_removed(tmp_path: Path, caplog) -> None:
    """Only the names the tier gives its moved-aside environments (``.damaged-<time>`` and
    ``-<n>``) are removed when older than the newest KEEP_DAMAGED: a directory a person
    renamed to keep for a post-mortem (``ssd.damaged-<time>.keep``, ``ssd.damaged-old``)
    is not the tier's (it was taken for the oldest, and removed)."""
    from kvstore.tiers.ssd_directory import KEEP_DAMAGED
    path = tmp_path / "ssd"
    kept = [tmp_path / "ssd.damaged-1700000000.keep", tmp_path / "ssd.damaged-old"]
    for d in kept:
        d.mkdir()
        (d / "data.mdb").write_text("a person's copy")
    for _ in range(KEEP_DAMAGED + 1):
        fill_ssd(path, 2)
        os.truncate(path / "data.mdb", 4096)
        with caplog.at_level(logging.WARNING, logger="kvstore.tiers.ssd"):
            tier = SsdTier(64 << 20, str(path))
        assert tier.quarantines == 1
        tier.close()
    for d in kept:
        assert (d / "data.mdb").read_text() == "a person's copy"
    ours = [p for p in glob.glob(f"{path}.damaged-*") if Path(p) not in kept]
    assert len(ours) == KEEP_DAMAGED
    assert len([r for r in caplog.records if "an older damaged environment" in r.getMessage()]) == 1
