"""Byte tiers (kvstore/tiers): the DRAM shared-memory slab and its extent allocator, the SSD
(LMDB) tier with per-block checksums and usage that survives a restart."""
from __future__ import annotations

import os
from multiprocessing import shared_memory
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import CapacityError, IntegrityError
from kvstore.pool import checksum_of
from kvstore.tiers import TIERS
from kvstore.tiers.dram import PAGE_BYTES, DramTier, ExtentAllocator
from kvstore.tiers.ssd import SsdTier


def _block(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def test_registry_names_both_tiers() -> None:
    assert TIERS["dram"] is DramTier and TIERS["ssd"] is SsdTier


# -- extent allocator -----------------------------------------------------------------------
def _free_runs(a: ExtentAllocator) -> list[tuple[int, int]]:
    return list(zip(a._starts, a._lengths))


def test_allocator_first_fit_and_full() -> None:
    a = ExtentAllocator(10)
    assert [a.alloc(3), a.alloc(3), a.alloc(3)] == [0, 3, 6]
    assert a.alloc(2) is None and a.alloc(1) == 9
    assert a.free_pages == 0 and a.alloc(1) is None


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1), (0, 2, 1, 3)])
def test_allocator_coalesces_back_to_one_run(order: tuple[int, ...]) -> None:
    a = ExtentAllocator(16)
    starts = [a.alloc(4) for _ in range(4)]
    assert starts == [0, 4, 8, 12] and a.free_pages == 0
    for i in order:
        a.free(starts[i], 4)
        runs = _free_runs(a)
        assert all(s1 + l1 < s2 for (s1, l1), (s2, _) in zip(runs, runs[1:])), runs  # never adjacent
    assert a.free_pages == 16 and _free_runs(a) == [(0, 16)]
    assert a.alloc(16) == 0


def test_allocator_fragmentation_then_coalesce() -> None:
    a = ExtentAllocator(8)
    s = [a.alloc(1) for _ in range(8)]
    for i in (1, 3, 5):
        a.free(s[i], 1)
    assert a.free_pages == 3 and a.alloc(2) is None  # 3 free pages, no run of 2
    a.free(s[2], 1)
    assert _free_runs(a) == [(1, 3), (5, 1)]
    assert a.alloc(3) == 1
    a.free(1, 3)
    for i in (0, 4, 6, 7):
        a.free(s[i], 1)
    assert a.free_pages == 8 and _free_runs(a) == [(0, 8)]


# -- DRAM tier ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, PAGE_BYTES - 1, PAGE_BYTES, PAGE_BYTES + 1, 5 * PAGE_BYTES + 7])
def test_dram_put_get_get_into_remove(make_dram, size: int) -> None:
    tier = make_dram(16 * PAGE_BYTES)
    data = _block(size)
    tier.put(b"k", data, checksum_of(data))
    assert tier.used_bytes == size
    assert tier.get(b"k") == data
    out = np.full(size + 8, 0xAB, dtype=np.uint8)
    assert tier.get_into(b"k", out) == size
    assert out[:size].tobytes() == data and (out[size:] == 0xAB).all()
    assert tier.verify(b"k")
    assert list(tier.keys()) == [(b"k", size)]
    assert tier.remove(b"k") == size
    assert tier.get(b"k") is None and tier.get_into(b"k", out) is None
    assert tier.remove(b"k") == 0
    assert tier.used_bytes == 0 and tier._alloc.free_pages == 16


def test_dram_slab_is_mapped_by_name(make_dram) -> None:
    tier = make_dram(4 * PAGE_BYTES)
    data = _block(3000, seed=1)
    tier.put(b"k", data, checksum_of(data))
    peer = shared_memory.SharedMemory(name=tier.shm_name)  # a reader on the same host
    try:
        assert bytes(peer.buf[:3000]) == data
    finally:
        peer.close()


def test_dram_capacity_error_when_full(make_dram) -> None:
    tier = make_dram(3 * PAGE_BYTES)
    blocks = {bytes([i]): _block(PAGE_BYTES, i) for i in range(3)}
    for k, v in blocks.items():
        assert tier.fits(len(v))
        tier.put(k, v, checksum_of(v))
    assert not tier.fits(1)
    with pytest.raises(CapacityError):
        tier.put(b"x", b"y", checksum_of(b"y"))
    assert tier.get(b"x") is None and tier.used_bytes == 3 * PAGE_BYTES
    tier.remove(b"\x01")  # a one-page hole in the middle
    assert tier.fits(PAGE_BYTES) and not tier.fits(PAGE_BYTES + 1)
    with pytest.raises(CapacityError):
        big = _block(2 * PAGE_BYTES)
        tier.put(b"big", big, checksum_of(big))
    for k in (b"\x00", b"\x02"):
        tier.remove(k)
    big = _block(3 * PAGE_BYTES)
    tier.put(b"big", big, checksum_of(big))  # the holes coalesced back to one run
    assert tier.get(b"big") == big


def test_dram_put_existing_key_is_a_no_op(make_dram) -> None:
    tier = make_dram(4 * PAGE_BYTES)
    tier.put(b"k", b"first", checksum_of(b"first"))
    tier.put(b"k", b"second", checksum_of(b"second"))
    assert tier.get(b"k") == b"first" and tier.used_bytes == 5


def test_dram_verify_detects_corruption(make_dram) -> None:
    tier = make_dram(4 * PAGE_BYTES)
    data = _block(100)
    tier.put(b"k", data, checksum_of(data))
    tier._slab[10] ^= 0xFF
    with pytest.raises(IntegrityError):
        tier.verify(b"k")
    assert tier.get(b"k") is None and tier.used_bytes == 0


def test_dram_close_unlinks_the_slab() -> None:
    tier = DramTier(PAGE_BYTES)
    name = tier.shm_name
    assert os.path.exists(f"/dev/shm/{name}")
    tier.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    tier.close()  # idempotent


# -- SSD tier -------------------------------------------------------------------------------
def test_ssd_put_get_remove(make_ssd) -> None:
    tier = make_ssd(1 << 20)
    a, b = _block(1000, 1), _block(5000, 2)
    tier.put(b"a", a, checksum_of(a))
    tier.put(b"b", b, checksum_of(b))
    tier.put(b"a", b, checksum_of(b))  # existing key: no-op
    assert tier.get(b"a") == a and tier.get(b"b") == b and tier.get(b"c") is None
    assert tier.used_bytes == 6000
    assert list(tier.keys()) == [(b"a", 1000), (b"b", 5000)]
    assert tier.remove(b"a") == 1000 and tier.remove(b"a") == 0
    assert tier.get(b"a") is None and tier.used_bytes == 5000


def test_ssd_usage_survives_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    tier = SsdTier(1 << 20, path)
    sizes = {bytes([i]) * 8: 100 * (i + 1) for i in range(5)}
    for k, n in sizes.items():
        d = _block(n, n)
        tier.put(k, d, checksum_of(d))
    tier.remove(bytes([2]) * 8)
    stored = sum(sizes.values()) - 300
    assert tier.used_bytes == stored
    tier.close()
    tier = SsdTier(1 << 20, path)
    try:
        assert tier.used_bytes == stored
        assert [k for k, _ in tier.keys()] == [bytes([i]) * 8 for i in (0, 1, 3, 4)]  # write order
        assert tier.get(bytes([4]) * 8) == _block(500, 500)
        d = _block(10, 10)
        tier.put(b"new", d, checksum_of(d))  # sequence numbers continue after the restart
        assert [k for k, _ in tier.keys()][-1] == b"new"
    finally:
        tier.close()


def test_ssd_flipped_byte_is_an_integrity_error(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    data = _block(4096, 7)
    tier = SsdTier(1 << 20, path)
    tier.put(b"k", data, checksum_of(data))
    tier.put(b"other", b"fine", checksum_of(b"fine"))
    tier.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        raw = bytearray(txn.get(b"k"))
        raw[1234] ^= 0x01
        txn.put(b"k", bytes(raw))
    env.close()
    tier = SsdTier(1 << 20, path)
    try:
        assert tier.used_bytes == 4096 + 4
        with pytest.raises(IntegrityError):
            tier.get(b"k")
        assert tier.get(b"k") is None  # the block is gone, not returned
        assert tier.used_bytes == 4 and [k for k, _ in tier.keys()] == [b"other"]
        assert tier.get(b"other") == b"fine"
    finally:
        tier.close()


def test_ssd_capacity_error(make_ssd) -> None:
    tier = make_ssd(10_000)
    with pytest.raises(CapacityError):
        tier.put(b"huge", _block(10_001), 0)
    d = _block(6000)
    tier.put(b"a", d, checksum_of(d))
    assert tier.fits(4000) and not tier.fits(4001)
    with pytest.raises(CapacityError):
        tier.put(b"b", d, checksum_of(d))  # 12,000 bytes would exceed the 10,000-byte capacity
    assert tier.get(b"b") is None and tier.used_bytes == 6000


def test_ssd_rejects_bad_fsync_policy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never"):
        SsdTier(1 << 20, str(tmp_path / "x"), fsync="always")


@pytest.mark.parametrize("cls, args", [(DramTier, ()), (SsdTier, ("/nonexistent-never-created",))])
def test_tier_rejects_nonpositive_capacity(cls, args) -> None:
    with pytest.raises(ValueError):
        cls(0, *args)
