"""The pool behind the real gRPC store service (kvstore/service.py, kvstore/client.py,
kvstore/kvctl/): concurrent puts of one key from two writer processes, a writer killed in
the middle of a large put, chain puts, pins, the eviction policy switch and the extended
tier stats, through the client and kvctl. The stream guards: tests/kvstore/wire/test_stream_guard.py."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore import kvctl
from kvstore.client import StoreClient
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.service import serve_store

MIB = 1 << 20
KEY = bytes(range(32))

# 8 threads of one process put KEY at once, each with its own 1 MiB payload.
WRITER = r"""
import json, sys, threading
import numpy as np
from kvstore.client import StoreClient
address, proc = sys.argv[1], int(sys.argv[2])
key = bytes(range(32))
payloads = [np.random.default_rng(proc * 100 + t).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
            for t in range(8)]
barrier, results = threading.Barrier(8), [None] * 8
def run(t):
    with StoreClient(address, timeout_s=60) as c:
        c.wait_ready(30)
        barrier.wait()
        r = c.put(key, payloads[t])
        results[t] = [r.ok, r.existed, r.error]
threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
for th in threads: th.start()
for th in threads: th.join()
print(json.dumps(results), flush=True)
"""

# Streams the first 8 MiB of a 32 MiB block, says so, then hangs until killed.
STALLED_WRITER = r"""
import sys, time
import grpc
from protos import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
address, key = sys.argv[1], bytes.fromhex(sys.argv[2])
def chunks():
    yield pb.PutChunk(key=key, size=32 << 20, checksum=1, data=b"\1" * (1 << 20))
    for _ in range(7):
        yield pb.PutChunk(data=b"\1" * (1 << 20))
    print("SENT", flush=True)
    time.sleep(3600)
pb_grpc.KVStoreStub(grpc.insecure_channel(address)).Put(chunks())
"""


def _payload(proc: int, thread: int) -> bytes:
    return np.random.default_rng(proc * 100 + thread).integers(0, 256, MIB, dtype=np.uint8).tobytes()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
def node(make_dram, make_ssd):
    """A store node (DRAM 64 MiB over SSD 128 MiB, reservations time out after 3 s)."""
    pool = KVPool([make_dram(64 * MIB), make_ssd(128 * MIB)], settings=PoolSettings(reservation_timeout_s=3.0))
    server, port = serve_store(pool, workers=24)
    client = StoreClient(f"127.0.0.1:{port}", timeout_s=60)
    client.wait_ready(10)
    yield pool, client
    client.close()
    server.stop(grace=None).wait()
    pool.check_integrity()


def _used(pool: KVPool) -> tuple[int, int]:
    s = pool.stats()[0]
    return s.used_bytes, s.reserved_bytes


def test_two_processes_eight_threads_put_one_key(node) -> None:
    """Concurrent puts of one key: every caller sees success; whenever the key exists, a get returns
    one writer's whole payload."""
    pool, client = node
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, client.address, str(p)], stdout=subprocess.PIPE,
                              text=True) for p in (1, 2)]
    payloads = {_payload(p, t) for p in (1, 2) for t in range(8)}
    seen = set()
    try:
        while any(p.poll() is None for p in procs):
            got = client.get(KEY)
            if got is not None:
                assert got in payloads  # whole, and exactly one writer's
                seen.add(got)
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = [r for out in outs for r in out]
    assert len(results) == 16 and all(ok for ok, _, _ in results), results
    assert sum(not existed for _, existed, _ in results) == 1
    final = client.get(KEY)
    assert final in payloads and seen <= {final}
    assert _used(pool) == (MIB, 0) and pool.stats()[0].blocks == 1


def test_a_writer_killed_mid_put_leaves_nothing(node) -> None:
    """Kill a writer in the middle of a large put: within the
    reservation timeout the key is absent and its space free; a new put succeeds."""
    pool, client = node
    key = _key(7)
    proc = subprocess.Popen([sys.executable, "-c", STALLED_WRITER, client.address, key.hex()],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SENT"
        deadline = time.monotonic() + 10
        while _used(pool) != (32 * MIB, 32 * MIB) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _used(pool) == (32 * MIB, 32 * MIB)  # reserved, being written...
        assert client.lookup([key]).blocks == 0 and client.get(key) is None  # ...and invisible
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    while _used(pool) != (0, 0) and time.monotonic() - killed < pool.settings.reservation_timeout_s + 1:
        time.sleep(0.02)
    assert _used(pool) == (0, 0) and client.lookup([key]).blocks == 0 and client.get(key) is None
    data = np.random.default_rng(7).integers(0, 256, 32 * MIB, dtype=np.uint8).tobytes()
    assert client.put(key, data).ok and client.get(key) == data


def test_chain_put_over_the_wire_evicts_the_tail_first(make_dram) -> None:
    pool = KVPool([make_dram(3 * 4096)], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    server, port = serve_store(pool)
    try:
        with StoreClient(f"127.0.0.1:{port}") as c:
            chain = [(_key(i), bytes([i]) * 4096) for i in (1, 2, 3)]
            assert all(r.ok for r in c.put_blocks(chain, chain=True))
            c.put(_key(9), b"\x09" * 4096)
            assert c.lookup([k for k, _ in chain]).blocks == 2
            assert c.evict("dram", 1 << 30) == (3 * 4096, 3)
            unlinked = [(_key(i), bytes([i]) * 4096) for i in (11, 12, 13)]
            c.put_blocks(unlinked)  # not a chain: plain LRU takes the oldest, the head
            c.put(_key(19), b"\x13" * 4096)
            assert c.lookup([k for k, _ in unlinked]).blocks == 0
    finally:
        server.stop(grace=None).wait()
        pool.close()


def test_pin_counts_distinct_blocks_of_a_chain_that_repeats_one(node, capsys) -> None:
    """Pin (plain or ``prefix``) over [A, B, A, B] reports the 2 blocks pinned, as Unpin
    reports the 2 pins dropped; kvctl asked for 2 blocks and pinned them all."""
    pool, client = node
    a, b = _key(1), _key(2)
    client.put_blocks([(a, b"a" * 4096), (b, b"b" * 4096)], chain=True)
    assert client.pin([a, b, a, b], prefix=True, hard=True) == 2
    assert client.pin([a, b, a, b]) == 2
    assert {s.name: s for s in client.stats()[1]}["dram"].pinned_bytes == 2 * 4096
    assert client.unpin([a, b, a, b], prefix=True) == 2 and not pool._place.pins
    assert kvctl.main(["--store", client.address, "pin", a.hex(), a.hex(), b.hex()]) == 0
    assert "pinned 2 of 2 blocks" in capsys.readouterr().out


def test_pins_policy_and_stats_through_client_and_kvctl(node, capsys) -> None:
    pool, client = node
    chain = [(_key(i), bytes([i]) * 4096) for i in range(4)]
    client.put_blocks(chain[:3], chain=True)
    keys = [k for k, _ in chain]
    assert client.pin(keys[:1], hard=True) == 1
    assert client.pin(keys, prefix=True, ttl_s=60) == 3
    by = {s.name: s for s in client.stats()[1]}
    assert by["dram"].pinned_bytes == 3 * 4096 and by["dram"].policy == "lru" and by["dram"].leased_bytes == 0
    lease = pool.acquire(keys, ttl_s=30)
    assert {s.name: s for s in client.stats()[1]}["dram"].leased_bytes == 3 * 4096
    pool.release(lease)
    assert client.unpin(keys[1:2]) == 1 and client.unpin(keys, prefix=True) == 2
    assert client.set_policy("s3fifo", "dram") == {"dram": "lru"}
    with pytest.raises(Exception, match="valid"):
        client.set_policy("mru")

    base = ["--store", client.address]
    assert kvctl.main(base + ["pin", keys[0].hex(), keys[1].hex(), "--hard"]) == 0
    assert f"{client.address}: pinned 2 of 2 blocks, hard" in capsys.readouterr().out
    assert kvctl.main(base + ["pin", keys[0].hex(), "--ttl", "5"]) == 0     # a soft pin over a hard one: still hard
    assert "soft, TTL 5.0 s (a block pinned hard stays hard: unpin it first)" in capsys.readouterr().out
    assert kvctl.main(base + ["unpin", "--prefix"] + [k.hex() for k in keys]) == 0
    assert "unpinned 2 of 4 blocks" in capsys.readouterr().out
    assert kvctl.main(base + ["unpin", keys[3].hex()]) == 3       # a pin not on this node: nothing done
    assert "unpinned 0 of 1 block: 1 of the named blocks are not pinned on this node" in capsys.readouterr().out
    assert kvctl.main(base + ["pin", "--prefix"] + [k.hex() for k in keys]) == 0    # the held 3 of 4
    assert "pinned 3 of 4 blocks" in capsys.readouterr().out
    assert kvctl.main(base + ["pin", "--prefix", keys[3].hex()]) == 3                # its head is not held
    assert "holds no block of the chain's head" in capsys.readouterr().out
    assert kvctl.main(base + ["pin", keys[3].hex(), "--json"]) == 3                 # not held: says so
    assert json.loads(capsys.readouterr().out)["reason"] == "1 of the named blocks are not held on this node"
    assert kvctl.main(base + ["unpin", "--prefix"] + [k.hex() for k in keys]) == 0
    capsys.readouterr()
    assert kvctl.main(base + ["policy", "--tier", "dram", "lfu"]) == 0
    assert "dram: s3fifo -> lfu" in capsys.readouterr().out
    assert kvctl.main(base + ["pin", "zz"]) == 1 and "hex" in capsys.readouterr().err
    assert kvctl.main(base + ["tiers"]) == 0
    table = capsys.readouterr().out
    assert "leased MiB" in table and "pinned MiB" in table and "lfu" in table
    assert kvctl.main(base + ["tiers", "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    assert {t["name"]: t["policy"] for t in tiers} == {"dram": "lfu", "ssd": "lru"}
    assert {"leased_bytes", "pinned_bytes", "reserved_bytes"} <= set(tiers[0])
