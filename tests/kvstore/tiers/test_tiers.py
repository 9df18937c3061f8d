"""Byte tiers (kvstore/tiers): the registry, the extent allocator, the two-phase put of every
tier, the DRAM shared-memory slab (mapped by name from another process), the HBM slab on the
CPU (and on CUDA where present), and the SSD (LMDB) tier with per-block checksums, usage that
survives a restart, a map grown on demand and an injected write fault."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvstore.errors import CapacityError, IntegrityError, InvalidArgument
from kvstore.integrity import checksum_of
from kvstore.tiers import TIERS
from kvstore.tiers.dram import PAGE_BYTES, DramTier, ExtentAllocator, SlabReader
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.ssd import SsdTier


def _block(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).tobytes()


@pytest.fixture
def make_hbm():
    made: list[HbmTier] = []

    def make(capacity_bytes: int, device: str = "cpu") -> HbmTier:
        made.append(HbmTier(capacity_bytes, device=device))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


@pytest.fixture(params=["dram", "hbm", "ssd"])
def any_tier(request, make_dram, make_ssd, make_hbm):
    return {"dram": make_dram, "hbm": make_hbm, "ssd": make_ssd}[request.param](16 * PAGE_BYTES)


def test_registry_names_every_tier() -> None:
    assert TIERS["dram"] is DramTier and TIERS["ssd"] is SsdTier and TIERS["hbm"] is HbmTier


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


# -- every tier: the two-phase put ------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, PAGE_BYTES, 5 * PAGE_BYTES + 7])
def test_put_get_get_into_remove(any_tier, size: int) -> None:
    tier = any_tier
    data = _block(size)
    tier.put(b"k", data, checksum_of(data))
    fp = tier.footprint(size)         # a slab's whole pages, the size elsewhere
    assert tier.used_bytes == fp and tier.contains(b"k") and tier.info(b"k") == (size, checksum_of(data))
    assert tier.get(b"k") == data
    out = np.full(size + 8, 0xAB, dtype=np.uint8)
    assert tier.get_into(b"k", out) == size
    assert out[:size].tobytes() == data and (out[size:] == 0xAB).all()
    assert list(tier.keys()) == [(b"k", size)]
    assert tier.remove(b"k") == fp and tier.remove(b"k") == 0
    assert tier.get(b"k") is None and tier.get_into(b"k", out) is None
    assert tier.usage().used_bytes == 0 and tier.usage().blocks == 0


def test_reserve_write_in_chunks_commit_and_abort(any_tier) -> None:
    tier = any_tier
    data = _block(3 * PAGE_BYTES + 100, 1)
    slot = tier.reserve(len(data))
    fp = tier.footprint(len(data))
    assert tier.usage().reserved_bytes == fp and tier.usage().used_bytes == fp
    for off in range(0, len(data), 5000):
        tier.write(slot, off, data[off:off + 5000])
    assert tier.get(b"k") is None  # not readable before commit
    tier.commit(slot, b"k", checksum_of(data))
    assert tier.get(b"k") == data and tier.usage().reserved_bytes == 0
    slot = tier.reserve(PAGE_BYTES)
    tier.write(slot, 0, _block(100))
    tier.abort(slot)
    assert tier.usage().used_bytes == fp and tier.usage().reserved_bytes == 0
    assert [k for k, _ in tier.keys()] == [b"k"]


def test_reserve_says_none_when_full_and_raises_when_never(any_tier) -> None:
    tier = any_tier
    slots = [tier.reserve(4 * PAGE_BYTES) for _ in range(4)]
    assert all(s is not None for s in slots) and tier.reserve(1) is None and not tier.fits(1)
    with pytest.raises(CapacityError):
        tier.reserve(16 * PAGE_BYTES + 1)
    tier.abort(slots[0])
    assert tier.fits(4 * PAGE_BYTES) and not tier.fits(4 * PAGE_BYTES + 1)


def test_put_existing_key_is_a_no_op(any_tier) -> None:
    tier = any_tier
    tier.put(b"k", b"first", checksum_of(b"first"))
    tier.put(b"k", b"second", checksum_of(b"second"))
    assert tier.get(b"k") == b"first" and tier.used_bytes == tier.footprint(5)


def test_a_slab_counts_the_pages_its_blocks_take(make_dram) -> None:
    """A slab tier's usage is the pages its blocks take, not their sizes: 16 empty or
    one-byte blocks fill a 16-page slab (used = capacity), and the 17th does not fit; sizes
    stay exact in the blocks' own records."""
    tier = make_dram(16 * PAGE_BYTES)
    assert tier.footprint(0) == tier.footprint(1) == PAGE_BYTES and tier.footprint(PAGE_BYTES + 8) == 2 * PAGE_BYTES
    for i in range(16):
        data = b"x" * (i % 2)
        tier.put(b"k%d" % i, data, checksum_of(data))
    assert tier.usage().used_bytes == tier.capacity_bytes == 16 * PAGE_BYTES and tier.usage().blocks == 16
    assert tier.reserve(1) is None and tier.info(b"k1") == (1, checksum_of(b"x"))
    assert tier.remove(b"k0") == PAGE_BYTES and tier.reserve(1) is not None


def test_write_accepts_arrays_and_tensors(any_tier) -> None:
    tier = any_tier
    arr = np.arange(1024, dtype=np.float32)
    ten = torch.arange(512, dtype=torch.float16)
    tier.put(b"a", arr, checksum_of(arr))
    tier.put(b"t", ten, checksum_of(ten.numpy()))
    assert tier.get(b"a") == arr.tobytes() and tier.get(b"t") == ten.numpy().tobytes()
    out = torch.empty(512, dtype=torch.float16)
    assert tier.get_into(b"t", out) == 1024 and torch.equal(out, ten)
    with pytest.raises(InvalidArgument, match="holds"):
        tier.get_into(b"a", np.empty(10, dtype=np.uint8))


# -- DRAM ----------------------------------------------------------------------------------------
def test_dram_slab_is_mapped_by_name_from_another_process(make_dram) -> None:
    tier = make_dram(4 * PAGE_BYTES)
    data = _block(3000, seed=1)
    tier.put(b"k", data, checksum_of(data))
    offset, size, checksum = tier.locate(b"k")
    peer = shared_memory.SharedMemory(name=tier.shm_name)  # a reader on the same host
    try:
        assert bytes(peer.buf[offset:offset + 3000]) == data
    finally:
        peer.close()
    code = ("import sys, numpy as np; from kvstore.tiers.dram import SlabReader\n"
            "r = SlabReader(sys.argv[1]); out = np.empty(int(sys.argv[3]), np.uint8)\n"
            "r.read_into(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), out)\n"
            "sys.stdout.buffer.write(out.tobytes()); r.close()")
    got = subprocess.run([sys.executable, "-c", code, tier.shm_name, str(offset), str(size), str(checksum)],
                         capture_output=True, check=True, timeout=60).stdout
    assert got == data and os.path.exists(f"/dev/shm/{tier.shm_name}")  # the reader did not unlink it


def test_slab_reader_rejects_bytes_that_fail_their_checksum(make_dram) -> None:
    tier = make_dram(4 * PAGE_BYTES)
    data = _block(100)
    tier.put(b"k", data, checksum_of(data))
    tier._slab[10] ^= 0xFF
    assert tier.verify(b"k") is False
    reader = SlabReader(tier.shm_name)
    try:
        with pytest.raises(IntegrityError):
            reader.read_into(0, 100, checksum_of(data), np.empty(100, np.uint8))
    finally:
        reader.close()


def test_dram_close_unlinks_the_slab() -> None:
    tier = DramTier(PAGE_BYTES)
    name = tier.shm_name
    assert os.path.exists(f"/dev/shm/{name}")
    tier.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    tier.close()  # idempotent


# -- HBM -----------------------------------------------------------------------------------------
def test_hbm_without_a_gpu_runs_on_the_cpu_and_says_so(make_hbm) -> None:
    tier = make_hbm(4 * PAGE_BYTES, device="cpu")
    assert tier.device == "cpu"
    if not torch.cuda.is_available():
        assert make_hbm(PAGE_BYTES, device="auto").device == "cpu"
        with pytest.raises(InvalidArgument, match="cpu"):
            HbmTier(PAGE_BYTES, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hbm_on_cuda(make_hbm) -> None:
    tier = make_hbm(8 * PAGE_BYTES, device="cuda")
    assert tier.device.startswith("cuda")
    data = _block(5000, 3)
    tier.put(b"k", data, checksum_of(data))
    assert tier.get(b"k") == data and tier.verify(b"k")
    dev = torch.empty(5000, dtype=torch.uint8, device="cuda")
    assert tier.get_into(b"k", dev) == 5000 and dev.cpu().numpy().tobytes() == data
    host = np.empty(5000, np.uint8)
    assert tier.get_into(b"k", host) == 5000 and host.tobytes() == data
    tier.put(b"d", dev, checksum_of(data))  # device to device
    assert tier.get(b"d") == data


# -- SSD -----------------------------------------------------------------------------------------
def test_ssd_usage_survives_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    tier = SsdTier(1 << 20, path)
    sizes = {bytes([i]) * 32: 100 * (i + 1) for i in range(5)}
    for k, n in sizes.items():
        d = _block(n, n)
        tier.put(k, d, checksum_of(d))
    tier.remove(bytes([2]) * 32)
    stored = sum(sizes.values()) - 300
    assert tier.used_bytes == stored
    tier.close()
    tier = SsdTier(1 << 20, path)
    try:
        assert tier.used_bytes == stored and tier.usage().blocks == 4
        assert [k for k, _ in tier.keys()] == [bytes([i]) * 32 for i in (0, 1, 3, 4)]  # write order
        assert tier.get(bytes([4]) * 32) == _block(500, 500)
        d = _block(10, 10)
        tier.put(b"n" * 32, d, checksum_of(d))  # sequence numbers continue after the restart
        assert [k for k, _ in tier.keys()][-1] == b"n" * 32
    finally:
        tier.close()


def test_ssd_flipped_byte_is_an_integrity_error(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    data = _block(4096, 7)
    tier = SsdTier(1 << 20, path)
    tier.put(b"k" * 32, data, checksum_of(data))
    tier.put(b"o" * 32, b"fine", checksum_of(b"fine"))
    tier.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        raw = bytearray(txn.get(b"k" * 32))
        raw[1234] ^= 0x01
        txn.put(b"k" * 32, bytes(raw))
    env.close()
    tier = SsdTier(1 << 20, path)
    try:
        out = np.zeros(4096, np.uint8)
        with pytest.raises(IntegrityError):
            tier.get_into(b"k" * 32, out)
        assert not out.any()  # verified before the copy: no wrong byte reached the caller
        assert tier.read_many([b"k" * 32, b"o" * 32], [bytes, bytes])[1] == b"fine"
        assert tier.remove(b"k" * 32) == 4096 and tier.used_bytes == 4  # the pool drops it like this
    finally:
        tier.close()


def test_ssd_write_fault_stores_nothing(make_ssd) -> None:
    tier = make_ssd(1 << 20)

    def fault(key: bytes) -> None:
        if key == b"b":
            raise OSError(errno.EIO, "injected I/O error")

    tier.write_fault = fault
    slots = [tier.reserve(100) for _ in range(3)]
    for i, slot in enumerate(slots):
        tier.write(slot, 0, bytes([i]) * 100)
    keys = [b"a", b"b", b"c"]
    errors = tier.commit_many([(slots[i], keys[i], checksum_of(bytes([i]) * 100)) for i in range(3)])
    assert [e is None for e in errors] == [True, False, True] and errors[1].errno == errno.EIO
    assert tier.get(b"a") == bytes([0]) * 100 and tier.get(b"b") is None and tier.get(b"c") == bytes([2]) * 100
    assert tier.usage().reserved_bytes == 100  # the failed slot stays reserved until aborted
    tier.abort(slots[1])
    assert tier.usage() == type(tier.usage())(1 << 20, 200, 0, 2)


def test_ssd_map_grows_on_demand(tmp_path: Path) -> None:
    tier = SsdTier(8 << 20, str(tmp_path / "ssd"), initial_map_bytes=1 << 20)
    try:
        start = tier.map_bytes
        blocks = {bytes([i]): _block(1 << 20, i) for i in range(6)}
        for k, d in blocks.items():
            tier.put(k, d, checksum_of(d))
        assert tier.map_bytes > start and tier.map_bytes <= tier.max_map_bytes
        assert all(tier.get(k) == d for k, d in blocks.items())
    finally:
        tier.close()


def test_ssd_map_full_at_its_limit_is_enospc(tmp_path: Path) -> None:
    tier = SsdTier(8 << 20, str(tmp_path / "ssd"), max_map_bytes=1 << 20, initial_map_bytes=1 << 20)
    try:
        with pytest.raises(OSError) as exc:
            tier.put(b"k", _block(2 << 20), 0)
        assert exc.value.errno == errno.ENOSPC and tier.used_bytes == 0 and tier.get(b"k") is None
    finally:
        tier.close()


def test_ssd_fsync_on_commit(tmp_path: Path) -> None:
    tier = SsdTier(1 << 20, str(tmp_path / "ssd"), fsync="commit")
    try:
        tier.put(b"k", b"durable", checksum_of(b"durable"))
        assert tier.get(b"k") == b"durable"
    finally:
        tier.close()
    with pytest.raises(ValueError, match="never"):
        SsdTier(1 << 20, str(tmp_path / "x"), fsync="always")


@pytest.mark.parametrize("cls, args", [(DramTier, ()), (SsdTier, ("/nonexistent-never-created",)),
                                       (HbmTier, ())])
def test_tier_rejects_nonpositive_capacity(cls, args) -> None:
    with pytest.raises(ValueError):
        cls(0, *args)


def _rss_of_mapping(address: int) -> int:
    """Resident bytes of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_dram_prefault_maps_the_whole_slab_without_touching_stored_bytes() -> None:
    """The slab's pages become resident in the background; a block written while that
    runs keeps its bytes; close() stops the thread first (no madvise on an unmapped range)."""
    size = 64 << 20
    tier = DramTier(size, prefault=True)
    try:
        data = os.urandom(3 << 20)
        slot = tier.reserve(len(data))
        tier.write(slot, 0, data)           # while the pre-faulting may still run
        tier.commit(slot, b"k" * 16, checksum_of(data))
        assert tier._prefault is not None and tier._prefault.done.wait(30)
        assert tier._prefault.populated == size
        assert _rss_of_mapping(int(tier._slab.ctypes.data)) >= size - (1 << 20)
        assert tier.read(b"k" * 16, bytes) == data
    finally:
        tier.close()
    assert not tier._prefault._thread.is_alive()


def test_dram_prefault_stops_at_close_while_running() -> None:
    tier = DramTier(512 << 20, prefault=True)
    tier.close()                            # at once: the thread stops after its current chunk
    assert tier._prefault.done.is_set() and not tier._prefault._thread.is_alive()
    from kvstore.tiers.prefault import CHUNK_BYTES
    assert tier._prefault.populated % CHUNK_BYTES == 0    # whole madvise calls only
    plain = DramTier(1 << 20)
    assert plain._prefault is None                        # off unless asked for (the node asks)
    plain.close()


def test_store_config_dram_prefault_is_a_bool() -> None:
    from kvstore.config import StoreConfig
    assert StoreConfig().dram_prefault is True
    with pytest.raises(ValueError, match="dram_prefault must be true or false"):
        StoreConfig(dram_prefault="yes")
