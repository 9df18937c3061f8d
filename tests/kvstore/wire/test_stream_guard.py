"""The store node's guards on its gRPC streams (kvstore/wire/stream_guard.py), on a real
node: a stalled put timing out, stalled streams ended at the idle limit without freezing the
port, a Put holding one reservation at a time, a trickling peer ended, and streams whose
callers gave up leaving room for new ones."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

import kvstore.service
from kvstore.client import StoreClient
from kvstore.errors import CapacityError
from kvstore.integrity import checksum_of
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.service import serve_store
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

MIB = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _used(pool: KVPool) -> tuple[int, int]:
    s = pool.stats()[0]
    return s.used_bytes, s.reserved_bytes


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
            # read only well after the Gets' limit: a Get read before the node ended it would
            # take every byte (on a loaded machine the second round starts late); one the node
            # never ended still takes every byte, and fails below
            time.sleep(max(0.0, ended_by + 4.0 - time.monotonic()))
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
