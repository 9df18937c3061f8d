"""Damage never kills a node (kvstore/tiers/ssd.py): a truncated or corrupt LMDB file is
found at open and before every read, moved aside, and the rest keeps serving; an unusable
data directory is a one-line error, or with ``--ssd-on-error disable`` a node without SSD."""
from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.integrity import checksum_of
from kvstore.pool.pool import KVPool
from kvstore.tiers.ssd import SsdTier

BLOCK = 64 << 10


def _block(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _fill_ssd(path: Path, n: int) -> None:
    tier = SsdTier(64 << 20, str(path))
    for i in range(n):
        tier.put(_key(i), _block(i), checksum_of(_block(i)))
    tier.close()


def _damage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]


def _damaged_record_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "damaged record" in r.getMessage()]


def _damaged_record_line(path: Path, blocks: int) -> str:
    """The one line an open logs for ``blocks`` damaged records dropped."""
    return (f"ssd tier at {path}: {blocks} blocks had a damaged record (unreadable, a key of a length the key "
            "spec cannot make, or a size that does not match the bytes stored); dropped")


@pytest.mark.parametrize("keep", [0.5, 4096])
def test_a_truncated_file_is_moved_aside_at_open(tmp_path: Path, caplog, keep: float) -> None:
    path = tmp_path / "ssd"
    _fill_ssd(path, 20)
    data = path / "data.mdb"
    os.truncate(data, int(data.stat().st_size * keep) if keep < 1 else int(keep))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        assert tier.quarantines == 1 and tier.usage().blocks == 0 and tier.used_bytes == 0
        assert len(_damage_lines(caplog)) == 1
        assert glob.glob(f"{path}.damaged-*")          # kept aside for a person to look at
        tier.put(_key(1), _block(1), checksum_of(_block(1)))  # the fresh environment works
        assert tier.get(_key(1)) == _block(1)
    finally:
        tier.close()
    reopened = SsdTier(64 << 20, str(path))           # and survives a restart
    assert reopened.quarantines == 0 and reopened.get(_key(1)) == _block(1)
    reopened.close()


def test_garbage_file_is_moved_aside_at_open(tmp_path: Path, caplog) -> None:
    path = tmp_path / "ssd"
    path.mkdir()
    (path / "data.mdb").write_bytes(os.urandom(3 * 4096))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    assert tier.quarantines == 1 and len(_damage_lines(caplog)) == 1
    tier.close()


def test_an_emptied_file_starts_afresh_with_one_warning(tmp_path: Path, caplog) -> None:
    """An empty data.mdb holds nothing to quarantine (LMDB writes its meta pages as it
    creates the file; empty, it was emptied from outside or the node died in that instant):
    the tier starts afresh, with one warning saying so, no ERROR and nothing moved aside."""
    path = tmp_path / "ssd"
    _fill_ssd(path, 5)
    os.truncate(path / "data.mdb", 0)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        warned = [r for r in caplog.records if "data.mdb is empty" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING and not _damage_lines(caplog)
        assert tier.quarantines == 0 and tier.usage().blocks == 0 and not glob.glob(f"{path}.damaged-*")
        tier.put(_key(1), _block(1), checksum_of(_block(1)))
        assert tier.get(_key(1)) == _block(1)
    finally:
        tier.close()


def test_meta_pages_of_another_data_version_are_moved_aside_at_open(tmp_path: Path, caplog) -> None:
    """Bytes over the data-version field of both meta pages: LMDB refuses the file with a
    plain lmdb.Error ("data format ... not supported"), which is damage, not an unusable
    directory: moved aside with one line, the node serves on."""
    path = tmp_path / "ssd"
    _fill_ssd(path, 5)
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    for page in (0, 4096):
        raw[page + 20:page + 24] = (0x77, 0x66, 0x55, 0x44)
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        assert tier.quarantines == 1 and tier.usage().blocks == 0 and len(_damage_lines(caplog)) == 1
        assert glob.glob(f"{path}.damaged-*")
        tier.put(_key(1), _block(1), checksum_of(_block(1)))
        assert tier.get(_key(1)) == _block(1)
    finally:
        tier.close()


def test_a_file_that_shrinks_under_a_running_pool(make_dram, tmp_path: Path, caplog) -> None:
    """SSD blocks become misses counted as integrity failures, DRAM blocks keep serving, one
    log line; no SIGBUS (this test would die by the signal without the size check)."""
    dram = make_dram(4 * BLOCK)
    ssd = SsdTier(64 << 20, str(tmp_path / "ssd"))
    pool = KVPool([dram, ssd], promote_on_hit=False)
    try:
        for i in range(12):
            assert pool.put(_key(i), _block(i)).ok
        on_ssd = [i for i in range(12) if pool.lookup([_key(i)]).tiers == ("ssd",)]
        in_dram = [i for i in range(12) if pool.lookup([_key(i)]).tiers == ("dram",)]
        assert len(on_ssd) >= 6 and in_dram
        data = tmp_path / "ssd" / "data.mdb"
        os.truncate(data, data.stat().st_size // 3)
        with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
            got = pool.get_many([_key(i) for i in range(12)])
            again = pool.get_many([_key(i) for i in on_ssd])
        assert all(got[i] is None for i in on_ssd) and all(g is None for g in again)
        assert all(got[i] == _block(i) for i in in_dram)
        assert len(_damage_lines(caplog)) == 1
        ssd_stats = next(s for s in pool.stats() if s.name == "ssd")
        assert ssd_stats.quarantines == 1
        assert ssd_stats.integrity_failures == len(on_ssd) and ssd_stats.blocks == 0
        assert ssd_stats.used_bytes == 0
        pool.check_integrity()
        assert pool.lookup([_key(on_ssd[0])]) == (0, ())
        for i in range(12, 24):                       # puts and demotions go on into the fresh env
            assert pool.put(_key(i), _block(i)).ok
        assert any(pool.lookup([_key(i)]).tiers == ("ssd",) for i in range(12, 24))
        assert all(pool.get(_key(i)) == _block(i) for i in range(12, 24))
        pool.check_integrity()
    finally:
        pool.close()


def test_a_shrink_before_a_write_is_caught(tmp_path: Path) -> None:
    tier = SsdTier(64 << 20, str(tmp_path / "ssd"))
    lost: list[list[bytes]] = []
    tier.on_lost = lost.append
    try:
        for i in range(10):
            tier.put(_key(i), _block(i), checksum_of(_block(i)))
        os.truncate(tmp_path / "ssd" / "data.mdb", 8192)
        tier.put(_key(99), _block(99), checksum_of(_block(99)))
        assert sorted(lost[0]) == sorted(_key(i) for i in range(10))
        assert tier.get(_key(99)) == _block(99) and tier.usage().blocks == 1
    finally:
        tier.close()


def test_an_unusable_directory_is_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "ssd").write_text("not a directory")
    with pytest.raises(OSError, match="ssd tier: cannot use data directory"):
        SsdTier(64 << 20, str(tmp_path / "ssd"))


def _serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "serve", "--port", "0", "--dram", "4MiB",
                           "--ssd", "16MiB", "--transfer-engine", "off", "--data-dir", str(tmp_path / "data"),
                           *flags], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_serve_on_an_unusable_directory_exits_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "data" / "node-0").mkdir(parents=True)
    (tmp_path / "data" / "node-0" / "ssd").write_text("not a directory")
    out = _serve(tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot use data directory" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_a_data_directory_that_cannot_hold_the_node_is_one_line_even_without_ssd(tmp_path: Path) -> None:
    """--ssd-on-error disable drops the SSD tier, not the node's own files (quotas, the
    data-plane socket): a --data-dir that is a file says so in one line (it logged 'serving
    without an SSD tier' and then died on 'Not a directory')."""
    (tmp_path / "data").write_text("a file, not a directory")
    out = _serve(tmp_path, "--ssd-on-error", "disable")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot hold the node's files" in lines[0] and "--data-dir" in lines[0], out.stderr


def test_serve_with_ssd_on_error_disable_serves_dram_only(tmp_path: Path, spawn_store_node) -> None:
    (tmp_path / "data" / "n1").mkdir(parents=True)
    (tmp_path / "data" / "n1" / "ssd").write_text("not a directory")
    _, address = spawn_store_node("n1", "--dram", "4MiB", "--ssd", "16MiB", "--transfer-engine", "off",
                                  "--ssd-on-error", "disable")
    with StoreClient(address) as client:
        _, stats = client.stats()
        assert [s.name for s in stats] == ["dram"]
        assert client.put_blocks([(_key(1), _block(1))])[0].ok and client.get(_key(1)) == _block(1)
    assert "serving without an SSD tier" in (tmp_path / "n1.log").read_text()


def test_truncating_a_running_node_s_file(tmp_path: Path, spawn_store_node) -> None:
    """A real node process: SSD blocks are misses, DRAM blocks are served, one log line and
    the counters say what happened; a restart on the damaged directory works."""
    flags = ("--dram", "1MiB", "--ssd", "16MiB", "--transfer-engine", "off")
    proc, address = spawn_store_node("n2", *flags)
    keys = [_key(i) for i in range(40)]
    with StoreClient(address) as client:
        assert all(r.ok for r in client.put_blocks([(k, _block(i)) for i, k in enumerate(keys)]))
        tiers = {}
        for k in keys:
            tiers[k] = client.lookup([k]).tiers[0]
        on_ssd = [k for k in keys if tiers[k] == "ssd"]
        in_dram = [k for k in keys if tiers[k] == "dram"]
        assert len(on_ssd) >= 20 and in_dram
        data = tmp_path / "data" / "n2" / "ssd" / "data.mdb"
        os.truncate(data, data.stat().st_size // 2)
        got = client.get_blocks(keys)
        assert proc.poll() is None
        assert all(got[keys.index(k)] is None for k in on_ssd)
        assert all(got[keys.index(k)] == _block(keys.index(k)) for k in in_dram)
        assert client.get_blocks(on_ssd) == [None] * len(on_ssd)
        ssd = next(s for s in client.stats()[1] if s.name == "ssd")
        assert ssd.quarantines == 1 and ssd.integrity_failures == len(on_ssd) and ssd.blocks == 0
    log = (tmp_path / "n2.log").read_text()
    assert log.count("is damaged") == 1, log
    proc.kill()
    proc.wait()
    os.truncate(tmp_path / "data" / "n2" / "ssd" / "data.mdb", 5000)  # damaged again, at rest
    proc, address = spawn_store_node("n2", *flags)
    with StoreClient(address) as client:
        ssd = next(s for s in client.stats()[1] if s.name == "ssd")
        assert ssd.quarantines == 1 and ssd.blocks == 0
        assert client.put_blocks([(keys[0], _block(0))])[0].ok and client.get(keys[0]) == _block(0)


def test_a_page_that_leads_lmdb_outside_the_file_is_moved_aside_at_start(tmp_path: Path, spawn_store_node) -> None:
    """One 2-byte field of a leaf page (its first node's offset, 64 KiB on) made LMDB read
    past the end of the file at the start's scan: SIGBUS, the node died at every start. A
    child process reads the records first; its death is damage: moved aside, the node
    serves, the block is a miss. (A real node: in this process the fault would end pytest.)"""
    path = tmp_path / "data" / "n3" / "ssd"
    key = b"\x42" * 32
    tier = SsdTier(64 << 20, str(path))
    tier.put(key, b"x" * 100, checksum_of(b"x" * 100))
    tier.close()
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = raw.find(key) // 4096          # a leaf page holding the key (LMDB's page: the OS page)
    raw[page * 4096 + 16:page * 4096 + 18] = (0xF0, 0xFF)   # mp_ptrs[0] = 0xFFF0
    data.write_bytes(bytes(raw))
    proc, address = spawn_store_node("n3", "--ssd", "16MiB", "--dram", "1MiB", "--transfer-engine", "off")
    with StoreClient(address) as client:
        assert client.get(key) is None
        ssd = next(s for s in client.stats()[1] if s.name == "ssd")
        assert ssd.quarantines == 1 and ssd.blocks == 0
        assert client.put_blocks([(_key(1), _block(1))])[0].ok and client.get(_key(1)) == _block(1)
    assert proc.poll() is None
    log = (tmp_path / "n3.log").read_text()
    assert log.count("is damaged") == 1 and "SIGBUS" in log, log
    assert glob.glob(f"{path}.damaged-*")


def test_damaged_records_are_dropped_at_open_with_one_line(make_dram, tmp_path: Path, caplog) -> None:
    """Records LMDB cannot see are damaged — a flipped bit in a block's size (bit 63 once made
    the node unable to start; bit 40 silently evicted good blocks to fit), a block whose
    bytes are gone, a record too short to read — are dropped at open with one log line; the
    other blocks serve and the books count only them. A block whose bytes are damaged fails
    its checksum on read: a miss and a log line."""
    import lmdb
    path = tmp_path / "ssd"
    _fill_ssd(path, 10)
    env = lmdb.open(str(path), max_dbs=3)
    meta, data = env.open_db(b"meta"), env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for i, bit in ((3, 63), (4, 40)):
            raw = bytearray(txn.get(_key(i), db=meta))
            raw[bit // 8] ^= 1 << (bit % 8)
            txn.put(_key(i), bytes(raw), db=meta)
        txn.delete(_key(5), db=data)
        txn.put(_key(6), b"short", db=meta)
        flipped = bytearray(txn.get(_key(7), db=data))
        flipped[100] ^= 0xFF
        txn.put(_key(7), bytes(flipped), db=data)
    env.close()
    with caplog.at_level(logging.WARNING):
        pool = KVPool([make_dram(2 * BLOCK), SsdTier(64 << 20, str(path))], promote_on_hit=False)
        try:
            assert _damaged_record_lines(caplog) == [_damaged_record_line(path, 4)]
            assert pool.tiers[1].used_bytes == 6 * BLOCK
            for i in (0, 1, 2, 8, 9):
                assert pool.get(_key(i)) == _block(i)
            for i in (3, 4, 5, 6, 7):
                assert pool.get(_key(i)) is None
            assert any("failed its checksum" in r.getMessage() and _key(7).hex()[:16] in r.getMessage()
                       for r in caplog.records)
        finally:
            pool.close()
    reopened = SsdTier(64 << 20, str(path))      # the dropped records are gone from the file too
    assert reopened.usage().blocks == 5
    reopened.close()


def test_records_under_a_key_of_the_wrong_length_are_dropped_at_open(make_dram, tmp_path: Path, caplog) -> None:
    """Block keys are 16 or 32 bytes (the key spec; no wire stores another): a record under
    a 5- or a 64-byte key, however sound its size and bytes, is damaged — dropped at open with
    the other damaged records' one log line, never loaded, counted or served."""
    import lmdb
    path = tmp_path / "ssd"
    _fill_ssd(path, 3)
    env = lmdb.open(str(path), max_dbs=3)
    meta, data = env.open_db(b"meta"), env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for odd in (b"short", b"l" * 64):
            txn.put(odd, txn.get(_key(0), db=data), db=data)
            txn.put(odd, txn.get(_key(0), db=meta), db=meta)
    env.close()
    with caplog.at_level(logging.WARNING):
        pool = KVPool([make_dram(2 * BLOCK), SsdTier(64 << 20, str(path))], promote_on_hit=False)
        try:
            assert _damaged_record_lines(caplog) == [_damaged_record_line(path, 2)]
            ssd = pool.tiers[1]
            assert ssd.used_bytes == 3 * BLOCK and sorted(k for k, _ in ssd.keys()) == [_key(i) for i in range(3)]
            assert all(pool.get(_key(i)) == _block(i) for i in range(3))
            assert pool.get(b"short") is None
        finally:
            pool.close()
    env = lmdb.open(str(path), max_dbs=3, readonly=True)  # and gone from the file
    with env.begin() as txn:
        assert [txn.get(b"short", db=env.open_db(name, txn=txn)) for name in (b"meta", b"blocks")] == [None, None]
    env.close()


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
    _fill_ssd(path, 3)
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
        lines = _damage_lines(caplog)
        assert tier.quarantines == 1 and tier.usage().blocks == 0
        assert len(lines) == 1 and f"{name} is {what}, not a regular file" in lines[0]
        aside = glob.glob(f"{path}.damaged-*")
        assert len(aside) == 1
        moved = os.lstat(os.path.join(aside[0], name)).st_mode      # the entry itself went aside
        assert stat.S_ISDIR(moved) if kind == "directory" else stat.S_ISLNK(moved)
        assert all(stat.S_ISREG(os.lstat(path / f).st_mode) for f in ("data.mdb", "lock.mdb"))
        tier.put(_key(1), _block(1), checksum_of(_block(1)))
        assert tier.get(_key(1)) == _block(1)
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
    _fill_ssd(path, 3)
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
    _fill_ssd(path, 3)
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
    out = _serve(tmp_path)
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
            first.put(_key(i), _block(i), checksum_of(_block(i)))
        with pytest.raises(OSError, match=f"data directory {path} is in use by another SSD tier "
                                          f"\\(this process, pid {os.getpid()}\\)"):
            SsdTier(64 << 20, str(path))
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from kvstore.tiers.ssd import SsdTier\n"
             "try:\n    SsdTier(64 << 20, sys.argv[1])\nexcept OSError as e:\n    sys.exit(str(e))",
             str(path)], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert child.returncode == 1 and f"in use by another SSD tier (pid {os.getpid()})" in child.stderr
        assert all(first.get(_key(i)) == _block(i) for i in range(3)) and not glob.glob(f"{path}.damaged-*")
        os.truncate(path / "data.mdb", 8192)          # quarantined while held: the new directory is held too
        first.put(_key(9), _block(9), checksum_of(_block(9)))
        assert first.quarantines == 1 and first.get(_key(9)) == _block(9)
        with pytest.raises(OSError, match="in use by another SSD tier"):
            SsdTier(64 << 20, str(path))
        assert (path / "kvstore.lock").read_text() == f"{os.getpid()}\n"
    finally:
        first.close()
    second = SsdTier(64 << 20, str(path))             # let go at close
    try:
        assert second.quarantines == 0 and second.get(_key(9)) == _block(9)
    finally:
        second.close()
def test_removing_many_blocks_is_not_taken_for_damage(tmp_path: Path, caplog) -> None:
    """A transaction that deletes many rows frees pages it copied itself ("loose" pages), which
    LMDB counts in ``last_pgno`` but never writes: the file was then shorter than the size
    check's need, and the next read or write moved a healthy environment aside (every SSD
    block lost) after a node evicted or removed many blocks at once."""
    path = tmp_path / "ssd"
    tier = SsdTier(64 << 20, str(path))
    try:
        tier.put(_key(5000), _block(5000), checksum_of(_block(5000)))
        for i in range(3000):
            tier.put(_key(i), b"", checksum_of(b""))
        for i in range(3000):
            tier.remove(_key(i))
        with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
            tier.flush()                                  # one transaction deleting 3000 rows
            assert tier.read(_key(5000), bytes) == _block(5000)
        assert tier.quarantines == 0 and not _damage_lines(caplog)
    finally:
        tier.close()
    reopened = SsdTier(64 << 20, str(path))   # and a stop right after such a transaction is no damage
    try:
        assert reopened.quarantines == 0 and reopened.read(_key(5000), bytes) == _block(5000)
    finally:
        reopened.close()


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
        _fill_ssd(path, 2)
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
        _fill_ssd(path, 2)
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
