"""Damage never kills a node (kvstore/tiers/ssd.py): a truncated or corrupt LMDB file is
found at open and before every read, moved aside, and the rest keeps serving; an unusable
data directory is a one-line error, or with ``--ssd-on-error disable`` a node without SSD."""
from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import pytest

from kvstore.client import StoreClient
from kvstore.integrity import checksum_of
from kvstore.pool.pool import KVPool
from kvstore.tiers.ssd import SsdTier
from tests.helpers.ssd_helpers import BLOCK, damage_lines, fill_ssd, serve_node, ssd_block, ssd_key


def _damaged_record_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "damaged record" in r.getMessage()]


def _damaged_record_line(path: Path, blocks: int) -> str:
    """The one line an open logs for ``blocks`` damaged records dropped."""
    return (f"ssd tier at {path}: {blocks} blocks had a damaged record (unreadable, a key of a length the key "
            "spec cannot make, or a size that does not match the bytes stored); dropped")


@pytest.mark.parametrize("keep", [0.5, 4096])
def test_a_truncated_file_is_moved_aside_at_open(tmp_path: Path, caplog, keep: float) -> None:
    path = tmp_path / "ssd"
    fill_ssd(path, 20)
    data = path / "data.mdb"
    os.truncate(data, int(data.stat().st_size * keep) if keep < 1 else int(keep))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        assert tier.quarantines == 1 and tier.usage().blocks == 0 and tier.used_bytes == 0
        assert len(damage_lines(caplog)) == 1
        assert glob.glob(f"{path}.damaged-*")          # kept aside for a person to look at
        tier.put(ssd_key(1), ssd_block(1), checksum_of(ssd_block(1)))  # the fresh environment works
        assert tier.get(ssd_key(1)) == ssd_block(1)
    finally:
        tier.close()
    reopened = SsdTier(64 << 20, str(path))           # and survives a restart
    assert reopened.quarantines == 0 and reopened.get(ssd_key(1)) == ssd_block(1)
    reopened.close()


def test_garbage_file_is_moved_aside_at_open(tmp_path: Path, caplog) -> None:
    path = tmp_path / "ssd"
    path.mkdir()
    (path / "data.mdb").write_bytes(os.urandom(3 * 4096))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    assert tier.quarantines == 1 and len(damage_lines(caplog)) == 1
    tier.close()


def test_an_emptied_file_starts_afresh_with_one_warning(tmp_path: Path, caplog) -> None:
    """An empty data.mdb holds nothing to quarantine (LMDB writes its meta pages as it
    creates the file; empty, it was emptied from outside or the node died in that instant):
    the tier starts afresh, with one warning saying so, no ERROR and nothing moved aside."""
    path = tmp_path / "ssd"
    fill_ssd(path, 5)
    os.truncate(path / "data.mdb", 0)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        warned = [r for r in caplog.records if "data.mdb is empty" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING and not damage_lines(caplog)
        assert tier.quarantines == 0 and tier.usage().blocks == 0 and not glob.glob(f"{path}.damaged-*")
        tier.put(ssd_key(1), ssd_block(1), checksum_of(ssd_block(1)))
        assert tier.get(ssd_key(1)) == ssd_block(1)
    finally:
        tier.close()


def test_meta_pages_of_another_data_version_are_moved_aside_at_open(tmp_path: Path, caplog) -> None:
    """Bytes over the data-version field of both meta pages: LMDB refuses the file with a
    plain lmdb.Error ("data format ... not supported"), which is damage, not an unusable
    directory: moved aside with one line, the node serves on."""
    path = tmp_path / "ssd"
    fill_ssd(path, 5)
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    for page in (0, 4096):
        raw[page + 20:page + 24] = (0x77, 0x66, 0x55, 0x44)
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
        tier = SsdTier(64 << 20, str(path))
    try:
        assert tier.quarantines == 1 and tier.usage().blocks == 0 and len(damage_lines(caplog)) == 1
        assert glob.glob(f"{path}.damaged-*")
        tier.put(ssd_key(1), ssd_block(1), checksum_of(ssd_block(1)))
        assert tier.get(ssd_key(1)) == ssd_block(1)
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
            assert pool.put(ssd_key(i), ssd_block(i)).ok
        on_ssd = [i for i in range(12) if pool.lookup([ssd_key(i)]).tiers == ("ssd",)]
        in_dram = [i for i in range(12) if pool.lookup([ssd_key(i)]).tiers == ("dram",)]
        assert len(on_ssd) >= 6 and in_dram
        data = tmp_path / "ssd" / "data.mdb"
        os.truncate(data, data.stat().st_size // 3)
        with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
            got = pool.get_many([ssd_key(i) for i in range(12)])
            again = pool.get_many([ssd_key(i) for i in on_ssd])
        assert all(got[i] is None for i in on_ssd) and all(g is None for g in again)
        assert all(got[i] == ssd_block(i) for i in in_dram)
        assert len(damage_lines(caplog)) == 1
        ssd_stats = next(s for s in pool.stats() if s.name == "ssd")
        assert ssd_stats.quarantines == 1
        assert ssd_stats.integrity_failures == len(on_ssd) and ssd_stats.blocks == 0
        assert ssd_stats.used_bytes == 0
        pool.check_integrity()
        assert pool.lookup([ssd_key(on_ssd[0])]) == (0, ())
        for i in range(12, 24):                       # puts and demotions go on into the fresh env
            assert pool.put(ssd_key(i), ssd_block(i)).ok
        assert any(pool.lookup([ssd_key(i)]).tiers == ("ssd",) for i in range(12, 24))
        assert all(pool.get(ssd_key(i)) == ssd_block(i) for i in range(12, 24))
        pool.check_integrity()
    finally:
        pool.close()


def test_a_shrink_before_a_write_is_caught(tmp_path: Path) -> None:
    tier = SsdTier(64 << 20, str(tmp_path / "ssd"))
    lost: list[list[bytes]] = []
    tier.on_lost = lost.append
    try:
        for i in range(10):
            tier.put(ssd_key(i), ssd_block(i), checksum_of(ssd_block(i)))
        os.truncate(tmp_path / "ssd" / "data.mdb", 8192)
        tier.put(ssd_key(99), ssd_block(99), checksum_of(ssd_block(99)))
        assert sorted(lost[0]) == sorted(ssd_key(i) for i in range(10))
        assert tier.get(ssd_key(99)) == ssd_block(99) and tier.usage().blocks == 1
    finally:
        tier.close()


def test_an_unusable_directory_is_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "ssd").write_text("not a directory")
    with pytest.raises(OSError, match="ssd tier: cannot use data directory"):
        SsdTier(64 << 20, str(tmp_path / "ssd"))


def test_serve_on_an_unusable_directory_exits_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "data" / "node-0").mkdir(parents=True)
    (tmp_path / "data" / "node-0" / "ssd").write_text("not a directory")
    out = serve_node(tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot use data directory" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_a_data_directory_that_cannot_hold_the_node_is_one_line_even_without_ssd(tmp_path: Path) -> None:
    """--ssd-on-error disable drops the SSD tier, not the node's own files (quotas, the
    data-plane socket): a --data-dir that is a file says so in one line (it logged 'serving
    without an SSD tier' and then died on 'Not a directory')."""
    (tmp_path / "data").write_text("a file, not a directory")
    out = serve_node(tmp_path, "--ssd-on-error", "disable")
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
        assert client.put_blocks([(ssd_key(1), ssd_block(1))])[0].ok and client.get(ssd_key(1)) == ssd_block(1)
    assert "serving without an SSD tier" in (tmp_path / "n1.log").read_text()


def test_truncating_a_running_node_s_file(tmp_path: Path, spawn_store_node) -> None:
    """A real node process: SSD blocks are misses, DRAM blocks are served, one log line and
    the counters say what happened; a restart on the damaged directory works."""
    flags = ("--dram", "1MiB", "--ssd", "16MiB", "--transfer-engine", "off")
    proc, address = spawn_store_node("n2", *flags)
    keys = [ssd_key(i) for i in range(40)]
    with StoreClient(address) as client:
        assert all(r.ok for r in client.put_blocks([(k, ssd_block(i)) for i, k in enumerate(keys)]))
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
        assert all(got[keys.index(k)] == ssd_block(keys.index(k)) for k in in_dram)
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
        assert client.put_blocks([(keys[0], ssd_block(0))])[0].ok and client.get(keys[0]) == ssd_block(0)


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
        assert client.put_blocks([(ssd_key(1), ssd_block(1))])[0].ok and client.get(ssd_key(1)) == ssd_block(1)
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
    fill_ssd(path, 10)
    env = lmdb.open(str(path), max_dbs=3)
    meta, data = env.open_db(b"meta"), env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for i, bit in ((3, 63), (4, 40)):
            raw = bytearray(txn.get(ssd_key(i), db=meta))
            raw[bit // 8] ^= 1 << (bit % 8)
            txn.put(ssd_key(i), bytes(raw), db=meta)
        txn.delete(ssd_key(5), db=data)
        txn.put(ssd_key(6), b"short", db=meta)
        flipped = bytearray(txn.get(ssd_key(7), db=data))
        flipped[100] ^= 0xFF
        txn.put(ssd_key(7), bytes(flipped), db=data)
    env.close()
    with caplog.at_level(logging.WARNING):
        pool = KVPool([make_dram(2 * BLOCK), SsdTier(64 << 20, str(path))], promote_on_hit=False)
        try:
            assert _damaged_record_lines(caplog) == [_damaged_record_line(path, 4)]
            assert pool.tiers[1].used_bytes == 6 * BLOCK
            for i in (0, 1, 2, 8, 9):
                assert pool.get(ssd_key(i)) == ssd_block(i)
            for i in (3, 4, 5, 6, 7):
                assert pool.get(ssd_key(i)) is None
            assert any("failed its checksum" in r.getMessage() and ssd_key(7).hex()[:16] in r.getMessage()
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
    fill_ssd(path, 3)
    env = lmdb.open(str(path), max_dbs=3)
    meta, data = env.open_db(b"meta"), env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for odd in (b"short", b"l" * 64):
            txn.put(odd, txn.get(ssd_key(0), db=data), db=data)
            txn.put(odd, txn.get(ssd_key(0), db=meta), db=meta)
    env.close()
    with caplog.at_level(logging.WARNING):
        pool = KVPool([make_dram(2 * BLOCK), SsdTier(64 << 20, str(path))], promote_on_hit=False)
        try:
            assert _damaged_record_lines(caplog) == [_damaged_record_line(path, 2)]
            ssd = pool.tiers[1]
            assert ssd.used_bytes == 3 * BLOCK and sorted(k for k, _ in ssd.keys()) == [ssd_key(i) for i in range(3)]
            assert all(pool.get(ssd_key(i)) == ssd_block(i) for i in range(3))
            assert pool.get(b"short") is None
        finally:
            pool.close()
    env = lmdb.open(str(path), max_dbs=3, readonly=True)  # and gone from the file
    with env.begin() as txn:
        assert [txn.get(b"short", db=env.open_db(name, txn=txn)) for name in (b"meta", b"blocks")] == [None, None]
    env.close()


def test_removing_many_blocks_is_not_taken_for_damage(tmp_path: Path, caplog) -> None:
    """A transaction that deletes many rows frees pages it copied itself ("loose" pages), which
    LMDB counts in ``last_pgno`` but never writes: the file was then shorter than the size
    check's need, and the next read or write moved a healthy environment aside (every SSD
    block lost) after a node evicted or removed many blocks at once."""
    path = tmp_path / "ssd"
    tier = SsdTier(64 << 20, str(path))
    try:
        tier.put(ssd_key(5000), ssd_block(5000), checksum_of(ssd_block(5000)))
        for i in range(3000):
            tier.put(ssd_key(i), b"", checksum_of(b""))
        for i in range(3000):
            tier.remove(ssd_key(i))
        with caplog.at_level(logging.ERROR, logger="kvstore.tiers.ssd"):
            tier.flush()                                  # one transaction deleting 3000 rows
            assert tier.read(ssd_key(5000), bytes) == ssd_block(5000)
        assert tier.quarantines == 0 and not damage_lines(caplog)
    finally:
        tier.close()
    reopened = SsdTier(64 << 20, str(path))   # and a stop right after such a transaction is no damage
    try:
        assert reopened.quarantines == 0 and reopened.read(ssd_key(5000), bytes) == ssd_block(5000)
    finally:
        reopened.close()
