"""The pool behind the real gRPC store service (kvstore/service.py, kvstore/client.py,
kvstore/kvctl/): concurrent puts of one key from two writer processes, a writer killed in
the middle of a large put, a stalled put timing out, stalled streams ended at the idle limit
without freezing the port, a Put holding one reservation at a time, a trickling peer ended, chain puts, pins, the
eviction policy switch and the extended tier stats, through the client and kvctl."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import kvstore.service
from kvstore import kvctl
from kvstore.client import StoreClient
from kvstore.errors import CapacityError
from kvstore.integrity import checksum_of
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.service import serve_store
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

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


def test_a_stalled_put_times_out_and_reports_it(make_dram) -> None:
    pool = KVPool([make_dram(8 * MIB)], settings=PoolSettings(reservation_timeout_s=0.3))
    server, port = serve_store(pool)
    stub_channel = __import__("grpc").insecure_channel(f"127.0.0.1:{port}")
    go = threading.Event()
    data = b"\2" * (2 * MIB)

    def chunks():
        yield pb.PutChunk(key=_key(1), size=len(data), checksum=checksum_of(data), data=data[:MIB])
        go.wait(10)
        yield pb.PutChunk(data=data[MIB:])

    result: dict[str, pb.PutResponse] = {}
    writer = threading.Thread(target=lambda: result.setdefault(
        "r", pb_grpc.KVStoreStub(stub_channel).Put(chunks())))
    try:
        writer.start()
        time.sleep(0.6)
        assert pool.stats()[0].used_bytes == 0  # expired: space free, nothing visible
        go.set()
        writer.join(10)
        r = result["r"].results[0]
        assert not r.ok and "timed out" in r.error and not pool.contains(_key(1))
    finally:
        go.set()
        stub_channel.close()
        server.stop(grace=None).wait()
        pool.close()


def test_stalled_streams_end_at_the_idle_limit_and_never_freeze_the_port(make_dram, monkeypatch) -> None:
    """More stalled streams than the node has threads, of either kind — Puts that send a
    block's first chunk and stop, Gets whose reader takes nothing — leave Health and Lookup
    answering at once (they froze the whole port); one stream past MAX_OPEN_STREAMS is
    refused at once; each stalled stream ends DEADLINE_EXCEEDED, naming the limit, within
    the (shortened) idle limit of its start, and no Put leaves a partial block."""
    idle_s = 1.5
    monkeypatch.setattr(kvstore.service, "STREAM_IDLE_S", idle_s)
    monkeypatch.setattr(kvstore.service, "STREAM_WORKERS", 6)
    monkeypatch.setattr(kvstore.service, "MAX_OPEN_STREAMS", 12)
    pool = KVPool([make_dram(64 * MIB)])
    server, port = serve_store(pool, workers=4)
    address = f"127.0.0.1:{port}"
    big = bytes(range(256)) * (32 * 1024)   # 8 MiB; a Get of it 16 times outruns any flow-control window
    release = threading.Event()
    channels = [grpc.insecure_channel(address) for _ in range(7)]

    def stalled_put(key: bytes):
        yield pb.PutChunk(key=key, size=1000, checksum=1, data=b"\1" * 10)
        release.wait(60)

    try:
        with StoreClient(address, timeout_s=2, data_path="grpc") as client:   # the streams, not the slab
            assert client.put(_key(99), big).ok
            opened = time.monotonic()
            puts = [pb_grpc.KVStoreStub(channels[0]).Put.future(stalled_put(_key(i))) for i in range(6)]
            gets = [pb_grpc.KVStoreStub(ch).Get(pb.GetRequest(keys=[_key(99)] * 16)) for ch in channels[1:]]
            time.sleep(0.3)
            t0 = time.monotonic()
            assert client.health() == "SERVING" and client.lookup([_key(0), _key(1)]).blocks == 0
            with pytest.raises(CapacityError, match="MAX_OPEN_STREAMS"):   # 12 open: refused, not queued
                client.get(_key(99))
            assert time.monotonic() - t0 < 2
            # 12 streams on 6 stream threads: two rounds, each stream ended within idle_s (+ the
            # watchdog's tick, idle_s / 4) of waiting on its peer
            ended_by = opened + 2 * idle_s * 1.25 + 1
            for f in puts:
                exc = f.exception(timeout=max(0.1, ended_by - time.monotonic()))
                assert exc is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert "STREAM_IDLE_S" in exc.details()
            time.sleep(max(0.0, ended_by - time.monotonic()))
            for g in gets:   # a reader that never read: what was sent, then the status (no more bytes)
                with pytest.raises(grpc.RpcError) as info:
                    for _ in g:
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
                assert "STREAM_IDLE_S" in info.value.details()
            assert client.lookup([_key(i) for i in range(6)]).blocks == 0 and not any(
                pool.contains(_key(i)) for i in range(6))
            assert _used(pool) == (len(big), 0)   # the stalled Puts' reservations aborted
            assert client.get(_key(99)) == big     # the node serves streams again
    finally:
        release.set()
        for ch in channels:
            ch.close()
        server.stop(grace=None).wait()
        pool.close()


@contextlib.contextmanager
def _raw_node(tier) -> Iterator[tuple[KVPool, int, pb_grpc.KVStoreStub]]:
    """A store node on ``tier`` and a raw stub of its gRPC port (to send what StoreClient
    never would); all closed after."""
    pool = KVPool([tier])
    server, port = serve_store(pool)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pool, port, pb_grpc.KVStoreStub(channel)
    finally:
        channel.close()
        server.stop(grace=None).wait()
        pool.close()


def test_a_put_holds_one_reservation_at_a_time_and_refuses_empty_chunks(make_dram) -> None:
    """A header before the previous block's bytes are all in (each header reserved its
    block's size, so four header-only chunks emptied the tier), and a chunk with neither
    key nor data (an idle writer's keep-alive), end the Put INVALID_ARGUMENT naming the
    block; nothing of it is stored or left reserved."""
    with _raw_node(make_dram(16 * MIB)) as (pool, port, stub):
        with StoreClient(f"127.0.0.1:{port}", data_path="grpc") as client:
            kept = [(_key(50 + i), bytes([i]) * MIB) for i in range(8)]
            assert all(r.ok for r in client.put_blocks(kept))
        headers_only = [pb.PutChunk(key=_key(i), size=12 * MIB, checksum=1) for i in range(4)]
        empty_chunk = [pb.PutChunk(key=_key(9), size=MIB, checksum=1, data=b"\1" * 10), pb.PutChunk()]
        for chunks, words in ((headers_only, "a header came after 0 of its 12582912 bytes"),
                              (empty_chunk, "neither a key nor data")):
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(iter(chunks), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert words in info.value.details() and chunks[0].key.hex()[:16] in info.value.details()
        deadline = time.monotonic() + 5
        while _used(pool)[1] and time.monotonic() < deadline:   # the reservation aborted as the call ends
            time.sleep(0.05)
        assert _used(pool)[1] == 0 and not any(pool.contains(_key(i)) for i in (0, 1, 2, 3, 9))
        pool.check_integrity()
        with StoreClient(f"127.0.0.1:{port}", data_path="grpc") as client:   # the node takes puts again
            assert all(r.ok for r in client.put_blocks(kept)) and client.get(kept[0][0]) == kept[0][1]


def test_a_peer_that_trickles_is_ended_by_its_total_wait(make_dram, monkeypatch) -> None:
    """A writer sending a chunk every 0.5 s, and a reader taking a message every 0.25 s —
    each wait within the (shortened) idle limit of 3 s, so the idle limit alone held them
    for good — are ended DEADLINE_EXCEEDED once their waits add up to more than 3 s plus
    0.02 s per message, naming STREAM_WAIT_PER_MESSAGE_S; the Put's reservation is aborted."""
    monkeypatch.setattr(kvstore.service, "STREAM_IDLE_S", 3.0)
    monkeypatch.setattr(kvstore.service, "STREAM_WAIT_PER_MESSAGE_S", 0.02)
    big = bytes(range(256)) * (32 * 1024)   # 8 MiB

    def trickle():
        yield pb.PutChunk(key=_key(1), size=32 * MIB, checksum=1, data=b"\1" * 1024)
        for _ in range(30):
            time.sleep(0.5)
            yield pb.PutChunk(data=b"\1" * 1024)

    with _raw_node(make_dram(64 * MIB)) as (pool, port, stub):
        with StoreClient(f"127.0.0.1:{port}", data_path="grpc") as client:
            assert client.put(_key(2), big).ok
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(trickle(), timeout=30)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
        assert "STREAM_WAIT_PER_MESSAGE_S" in info.value.details()
        assert time.monotonic() - t0 < 10   # 30 chunks would take 15 s
        reader = stub.Get(pb.GetRequest(keys=[_key(2)] * 16), timeout=60)   # 128 MiB: past any window
        taken = 0
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in reader:
                taken += 1
                time.sleep(0.25)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
        assert "STREAM_WAIT_PER_MESSAGE_S" in info.value.details()
        assert taken < 128 and time.monotonic() - t0 < 60
        deadline = time.monotonic() + 5
        while _used(pool)[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _used(pool) == (len(big), 0) and not pool.contains(_key(1))


def test_streams_whose_callers_gave_up_in_the_queue_leave_room_for_new_ones(make_dram, monkeypatch) -> None:
    """Stalled streams hold both stream threads; Gets queued behind them whose callers' 0.5 s
    deadlines passed no longer count toward MAX_OPEN_STREAMS, so a new Get is queued, not
    refused (it was RESOURCE_EXHAUSTED for as long as the slow streams held the threads),
    and is served once the threads are free."""
    monkeypatch.setattr(kvstore.service, "STREAM_WORKERS", 2)
    monkeypatch.setattr(kvstore.service, "MAX_OPEN_STREAMS", 4)
    release = threading.Event()

    def stalled_put(key: bytes):
        yield pb.PutChunk(key=key, size=1000, checksum=1, data=b"\1" * 10)
        release.wait(30)

    with _raw_node(make_dram(16 * MIB)) as (pool, port, stub):
        try:
            with StoreClient(f"127.0.0.1:{port}", data_path="grpc") as client:
                assert client.put(_key(7), b"\7" * 4096).ok
            puts = [stub.Put.future(stalled_put(_key(i)), timeout=30) for i in range(2)]
            time.sleep(0.3)
            for _ in range(2):   # queued behind the two stalled Puts until their callers give up
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Get(pb.GetRequest(keys=[_key(7)]), timeout=0.5))
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            got: dict[str, object] = {}

            def read() -> None:
                try:
                    with StoreClient(f"127.0.0.1:{port}", timeout_s=20, data_path="grpc") as reader_client:
                        got["bytes"] = reader_client.get(_key(7))
                except CapacityError as exc:
                    got["error"] = exc
            reader = threading.Thread(target=read)
            reader.start()
            time.sleep(0.5)
            assert "error" not in got, got   # queued: 2 running + 1 caller still waiting < 4
            release.set()
            reader.join(20)
            assert got == {"bytes": b"\7" * 4096}, got
            for f in puts:
                f.exception(timeout=10)
        finally:
            release.set()   # the stalled Puts' writers end, whatever failed


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
