"""The store node's gRPC service and its client (kvstore/service.py, kvstore/client.py): a real
server on 127.0.0.1 (port 0) over real DRAM + SSD tiers."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.pool.pool import KVPool, checksum_of
from kvstore.service import serve_store
from kvstore.wire.channel import CHUNK_BYTES
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _block(i: int, size: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


@pytest.fixture
def client(store_node):
    _, address = store_node
    with StoreClient(address, timeout_s=30) as c:
        c.wait_ready(10)
        yield c


@pytest.fixture
def stub(store_node):
    _, address = store_node
    channel = grpc.insecure_channel(address)
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


def test_health(client: StoreClient) -> None:
    assert client.health() == "SERVING"


def test_16mib_block_roundtrip_is_byte_identical(client: StoreClient) -> None:
    data = _block(16, 16 << 20)
    assert client.put(_key(16), data).ok
    got = client.get(_key(16))
    assert got is not None and len(got) == len(data) and got == data
    assert client.lookup([_key(16)]).blocks == 1


@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1])
def test_roundtrip_around_chunk_boundaries(client: StoreClient, size: int) -> None:
    data = _block(size, size)
    assert client.put((b"k%d" % size).ljust(32, b"."), data).ok
    assert client.get((b"k%d" % size).ljust(32, b".")) == data


def test_batched_put_and_get(client: StoreClient) -> None:
    blocks = [(_key(i), _block(i, 1000 + i * 37)) for i in range(64)]
    results = client.put_blocks(blocks)
    assert [r.key for r in results] == [k for k, _ in blocks]
    assert all(r.ok and not r.existed for r in results)
    assert client.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    fresh = [(_key(100 + i), _block(100 + i)) for i in range(2)]
    mixed = client.put_blocks([fresh[0], blocks[5], fresh[1]])  # one key already exists
    assert [(r.ok, r.existed) for r in mixed] == [(True, False), (True, True), (True, False)]
    assert client.get_blocks([k for k, _ in fresh]) == [d for _, d in fresh]
    assert client.put_blocks([]) == [] and client.get_blocks([]) == []


def test_get_with_a_missing_key_in_the_middle(client: StoreClient) -> None:
    client.put_blocks([(_key(1), _block(1)), (_key(3), _block(3))])
    keys = [_key(1), _key(2), _key(3)]
    assert client.get_blocks(keys) == [_block(1), None, _block(3)]
    assert client.get_blocks(keys, stop_at_miss=True) == [_block(1), None]
    assert client.get_blocks([_key(2), _key(1)], stop_at_miss=True) == [None]


def test_lookup(client: StoreClient) -> None:
    chain = [(_key(i), _block(i)) for i in range(4)]
    client.put_blocks(chain[:3])
    r = client.lookup([k for k, _ in chain])
    assert r.blocks == 3 and r.tiers == ("dram",) * 3
    assert client.lookup([_key(9)] + [k for k, _ in chain]).blocks == 0
    assert client.lookup([]).blocks == 0


def test_stats_and_evict(store_node, client: StoreClient) -> None:
    pool, _ = store_node
    client.put_blocks([(_key(i), _block(i)) for i in range(3)])
    client.get(_key(0))
    node, stats = client.stats()
    assert node == pool.node_id
    by = {s.name: s for s in stats}
    assert list(by) == ["dram", "ssd"]
    assert (by["dram"].blocks, by["dram"].used_bytes, by["dram"].hits) == (3, 3 * 4096, 1)
    assert by["dram"].capacity_bytes == 64 << 20 and by["dram"].device == "cpu"
    assert client.evict("dram", 4096) == (4096, 1)  # LRU first: block 1, demoted to SSD
    assert client.lookup([_key(0), _key(1), _key(2)]).tiers == ("dram", "ssd", "dram")
    by = {s.name: s for s in client.stats()[1]}
    assert (by["dram"].evictions, by["dram"].demotions, by["ssd"].blocks) == (1, 1, 1)
    assert client.evict("ssd", 1 << 30) == (4096, 1)
    assert client.lookup([_key(0), _key(1)]).blocks == 1


def test_evict_unknown_tier_is_invalid_argument(client: StoreClient) -> None:
    with pytest.raises(InvalidArgument) as exc:
        client.evict("nvme", 1)
    assert "dram" in str(exc.value) and "ssd" in str(exc.value)


@pytest.mark.parametrize("length", [1, 15, 17, 31, 33, 56, 64, 65])
def test_keys_the_key_spec_cannot_make_are_refused(store_node, client: StoreClient, stub, length: int) -> None:
    """The key spec makes 16 (XXH3-128) or 32 (SHA-256) byte keys: any other length is
    INVALID_ARGUMENT naming the length and the valid ones, on every call that takes keys."""
    pool, _ = store_node
    bad = b"k" * length
    with pytest.raises(InvalidArgument, match=f"{length} bytes.*16 .*32 "):
        client.put(bad, b"data")
    calls = [lambda: stub.Put(iter([pb.PutChunk(key=bad, size=4, checksum=checksum_of(b"data"), data=b"data")])),
             lambda: stub.Put(iter([pb.PutChunk(key=_key(1), parent=bad, size=4, checksum=checksum_of(b"data"),
                                                data=b"data")])),
             lambda: stub.Lookup(pb.LookupRequest(keys=[_key(1), bad])),
             lambda: list(stub.Get(pb.GetRequest(keys=[bad]))),
             lambda: stub.Pin(pb.PinRequest(keys=[bad])),
             lambda: stub.Unpin(pb.UnpinRequest(keys=[bad])),
             lambda: stub.LeaseBlocks(pb.LeaseBlocksRequest(keys=[bad])),
             lambda: stub.ReserveBlocks(pb.ReserveBlocksRequest(keys=[bad], sizes=[4]))]
    for call in calls:
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, call
        assert f"{length} bytes" in exc.value.details()
    assert sum(s.blocks for s in pool.stats()) == 0
    for good in (b"k" * 16, b"k" * 32):
        assert client.put(good, b"data").ok and client.get(good) == b"data"


def test_a_call_over_the_key_limit_is_refused_at_once(client: StoreClient, stub) -> None:
    """200,000 keys in one call held a worker for 22 s; now any call naming more than
    MAX_KEYS_PER_CALL keys is refused before any work, naming the limit."""
    many = [_key(i) for i in range(200_000)]
    calls = [lambda: stub.Lookup(pb.LookupRequest(keys=many)),
             lambda: list(stub.Get(pb.GetRequest(keys=many))),
             lambda: stub.Pin(pb.PinRequest(keys=many)),
             lambda: stub.Unpin(pb.UnpinRequest(keys=many)),
             lambda: stub.LeaseBlocks(pb.LeaseBlocksRequest(keys=many))]
    for call in calls:
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(MAX_KEYS_PER_CALL) in exc.value.details()
        assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    got = list(stub.Get(pb.GetRequest(keys=many[:MAX_KEYS_PER_CALL])))  # the limit itself is served
    assert len(got) == MAX_KEYS_PER_CALL and all(c.missing for c in got)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -1.0, 1e12])
def test_a_pin_ttl_that_is_not_a_finite_positive_time_is_refused(client: StoreClient, stub, ttl: float) -> None:
    assert client.put(_key(1), b"data").ok
    with pytest.raises(grpc.RpcError) as exc:
        stub.Pin(pb.PinRequest(keys=[_key(1)], ttl_s=ttl))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in exc.value.details()
    assert client.pin([_key(1)], ttl_s=60.0) == 1 and client.pin([_key(1)]) == 1  # 0: the node's default


def test_wrong_checksum_is_not_stored(client: StoreClient, stub) -> None:
    good, bad = _block(1), _block(2)
    chunks = [pb.PutChunk(key=_key(1), size=len(good), checksum=checksum_of(good), data=good),
              pb.PutChunk(key=_key(2), size=len(bad), checksum=checksum_of(bad) ^ 1, data=bad[:1000]),
              pb.PutChunk(data=bad[1000:])]
    resp = stub.Put(iter(chunks))
    assert [(r.key, r.ok) for r in resp.results] == [(_key(1), True), (_key(2), False)]
    assert resp.results[1].error
    assert client.lookup([_key(2)]).blocks == 0 and client.get(_key(2)) is None
    assert client.get(_key(1)) == good


def test_short_block_is_not_stored(client: StoreClient, stub) -> None:
    data = _block(1)
    resp = stub.Put(iter([pb.PutChunk(key=_key(1), size=len(data) + 10, checksum=checksum_of(data),
                                      data=data)]))
    assert not resp.results[0].ok and "bytes" in resp.results[0].error
    assert client.get(_key(1)) is None


@pytest.mark.parametrize("chunks", [
    [pb.PutChunk(data=b"no key")],
    [pb.PutChunk(key=b"k" * 32, size=2, checksum=0, data=b"too many bytes")],
], ids=["no-key", "oversize"])
def test_malformed_put_stream_is_invalid_argument(client: StoreClient, stub, chunks) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        stub.Put(iter(chunks))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.get(b"k" * 32) is None


def test_auth_token(make_dram) -> None:
    pool = KVPool([make_dram(1 << 20)])
    server, port = serve_store(pool, auth_token="s3cret")
    address = f"127.0.0.1:{port}"
    try:
        for token in (None, "wrong"):
            with StoreClient(address, auth_token=token, timeout_s=10) as c:
                for call in (c.health, lambda: c.put(b"k" * 32, b"v"), lambda: c.get(b"k" * 32),
                             lambda: c.lookup([b"k" * 32]), c.stats):
                    with pytest.raises(Unavailable, match="UNAUTHENTICATED"):
                        call()
        assert pool.lookup([b"k" * 32])[0] == 0
        with StoreClient(address, auth_token="s3cret", timeout_s=10) as c:
            assert c.health() == "SERVING"
            assert c.put(b"k" * 32, b"v").ok and c.get(b"k" * 32) == b"v"
    finally:
        server.stop(grace=None).wait()
        pool.close()


def test_unreachable_node_is_unavailable() -> None:
    with StoreClient("127.0.0.1:1", timeout_s=2) as c:
        with pytest.raises(Unavailable):
            c.health()


def test_a_put_chunk_that_does_not_parse_is_refused_and_the_server_still_stops(make_dram) -> None:
    """A client-streamed message that does not parse is refused, not left unfinished in gRPC,
    so ``server.stop()`` does not hang (a case tests/kvstore/test_fuzz_store_grpc.py can reach)."""
    import threading
    pool = KVPool([make_dram(1 << 20)])
    server, port = serve_store(pool)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        put = channel.stream_unary("/kvstore.v1.KVStore/Put", lambda b: b, pb.PutResponse.FromString)
        for raw in (b"\xff", b"\x0a\x05ab"):  # a bad tag; a length past the end
            with pytest.raises(grpc.RpcError) as exc:
                put(iter([raw]), timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PutChunk" in exc.value.details()
    stopper = threading.Thread(target=lambda: server.stop(grace=None).wait(), daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "the store server did not stop"
    pool.close()


def test_the_client_splits_a_chain_longer_than_the_node_takes(client: StoreClient, monkeypatch) -> None:
    """StoreClient reads and looks up more keys than MAX_KEYS_PER_CALL in parts (here the
    client's limit is lowered to 3; the node's stays what it is)."""
    monkeypatch.setattr("kvstore.client.MAX_KEYS_PER_CALL", 3)
    blocks = [(_key(i), _block(i, 100)) for i in range(8)]
    assert all(r.ok for r in client.put_blocks(blocks))
    keys = [k for k, _ in blocks]
    assert client.lookup(keys).blocks == 8 and len(client.lookup(keys).tiers) == 8
    assert client.lookup(keys[:4] + [_key(99)] + keys[5:]).blocks == 4
    assert client.get_blocks(keys) == [d for _, d in blocks]
    got = client.get_blocks(keys[:4] + [_key(99)] + keys[5:], stop_at_miss=True)
    assert got[:4] == [d for _, d in blocks[:4]] and all(g is None for g in got[4:]) and len(got) <= 6
    assert client.get_blocks(keys[:2] + [_key(99)] + keys[3:]) == [d for _, d in blocks[:2]] + [None] + \
        [d for _, d in blocks[3:]]


def test_a_chain_get_reads_in_windows_linked_as_one_read(store_node, client: StoreClient, stub, monkeypatch) -> None:
    """A prefix-chain Get reads its chain in windows of about CHAIN_WINDOW_BYTES (here two
    4 KiB blocks), never all of it at once: the same bytes and misses as one read, and the
    pool links the chain across windows as one read does."""
    import tracemalloc

    import kvstore.service
    from kvstore.wire import proto_codec as codec
    pool, _ = store_node
    monkeypatch.setattr(kvstore.service, "CHAIN_WINDOW_BYTES", 2 * 4096)
    blocks = [(_key(i), _block(i)) for i in range(7)]
    assert all(r.ok for r in client.put_blocks(blocks))             # put unlinked
    keys = [k for k, _ in blocks]
    assert not pool._place.parents
    hits = pool.stats()[0].hits

    def chain_get(ks: list[bytes]) -> list[bytes | None]:    # the gRPC Get itself (not the slab path)
        return codec.blocks_of(stub.Get(pb.GetRequest(keys=ks, stop_at_miss=True), timeout=30))
    assert chain_get(keys) == [d for _, d in blocks]
    assert pool._place.parents == {keys[i]: keys[i - 1] for i in range(1, 7)}
    assert pool.stats()[0].hits == hits + 7                        # one hit a block, windows or not
    got = chain_get(keys[:5] + [_key(99), keys[6]])
    assert got == [d for _, d in blocks[:5]] + [None]
    # a 1-byte block, then one 1 MiB block named 199 times: the node holds one window of
    # about 8 MiB at a time (the pool stops each by the sizes it holds), not 199 MiB
    monkeypatch.setattr(kvstore.service, "CHAIN_WINDOW_BYTES", 8 << 20)
    big = _block(7, 1 << 20)
    assert client.put(_key(7), big).ok and client.put(_key(8), b"t").ok
    tracemalloc.start()
    try:
        received = 0
        for chunk in stub.Get(pb.GetRequest(keys=[_key(8)] + [_key(7)] * 199, stop_at_miss=True), timeout=60):
            received += len(chunk.data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert received == 1 + (199 << 20)
    assert peak < 64 << 20, f"peak {peak >> 20} MiB while a 199 MiB chain was read"
