"""Fuzz target of the store node's gRPC servicer (kvstore/service.py StoreServicer) on a real
server over a real DRAM + SSD pool: every RPC of protos/kvstore.proto gets requests drawn from
its message descriptor (tests/helpers/grpc_fuzzing.py), and raw bytes as its serialized request.
Every answer must be OK or a status the servicer chose, with a message — never UNKNOWN (an
exception escaped), never a hang — and the node must still put and get byte-identical
blocks afterwards. Short deterministic runs here; ``make fuzz`` runs them long."""
from __future__ import annotations

import os
import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.client import StoreClient
from kvstore.pool.pool import KVPool, PoolSettings, checksum_of
from kvstore.service import serve_store
from kvstore.tiers.dram import DramTier
from kvstore.tiers.ssd import SsdTier
from protos import kvstore_pb2 as pb
from tests.helpers.fuzzing import Counter, fuzz_settings, run_target
from tests.helpers.grpc_fuzzing import assert_stops, call_fuzzed, call_raw, message, request_class

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
STORED = [bytes([i]) * 32 for i in range(1, 5)] + [bytes([9]) * 16]
STRINGS = ["dram", "ssd", "hbm", "lru", "lfu", "fifo", "s3fifo", ""]
OVERRIDES = {"bytes": st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1)),   # Evict
             "sizes": st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A store node over DRAM (16 MiB, with its same-host data plane) + SSD (32 MiB);
    reservations time out in 1 s, so fuzzed ones free their room quickly."""
    tiers = [DramTier(16 << 20), SsdTier(32 << 20, str(tmp_path_factory.mktemp("fuzz-ssd")))]
    pool = KVPool(tiers, settings=PoolSettings(reservation_timeout_s=1.0))
    for i, key in enumerate(STORED):
        assert pool.put(key, bytes([i]) * 5000).ok
    server, port = serve_store(pool)
    yield pool, f"127.0.0.1:{port}"
    assert_stops(server)
    pool.close()
    for t in tiers:
        t.close()


def _put_stream(chunk: st.SearchStrategy) -> st.SearchStrategy:
    """Put streams: fuzzed chunks, or well-formed blocks with one field changed."""
    def good(key: bytes, data: bytes) -> list:
        return [pb.PutChunk(key=key, size=len(data), checksum=checksum_of(data), data=data)]
    well_formed = st.tuples(st.sampled_from(STORED + [os.urandom(32)]), st.binary(max_size=3000)).map(
        lambda kd: good(*kd))
    return st.one_of(st.lists(chunk, max_size=5), well_formed)


def _still_serves(address: str) -> None:
    with StoreClient(address, timeout_s=30) as c:
        assert c.health() == "SERVING"
        for key, size in ((os.urandom(32), 70_000), (os.urandom(16), 1)):
            data = os.urandom(size)
            assert c.put(key, data).ok and c.get(key) == data
        c.stats()


def test_fuzz_store_grpc_messages(node) -> None:
    pool, address = node
    counter = Counter()
    methods = list(SERVICE.methods)
    strategies = {}
    for m in methods:
        one = message(request_class(m), STORED, OVERRIDES, STRINGS)
        strategies[m.name] = _put_stream(one) if m.client_streaming else one
    calls = st.sampled_from(methods).flatmap(lambda m: st.tuples(st.just(m), strategies[m.name]))
    seen: dict[str, set] = {}

    with grpc.insecure_channel(address) as channel:
        @fuzz_settings(400)
        @given(call=calls)
        def target(call) -> None:
            method, request = call
            counter()
            code, _ = call_fuzzed(channel, SERVICE.full_name, method, request)
            seen.setdefault(method.name, set()).add(code.name)

        run_target("store gRPC messages", target, counter)
    time.sleep(1.1)  # fuzzed reservations time out
    _still_serves(address)
    assert len(seen) == len(methods), f"RPCs never fuzzed: {set(m.name for m in methods) - set(seen)}"
    assert "INVALID_ARGUMENT" in set().union(*seen.values())


def test_fuzz_store_grpc_raw_bytes(node) -> None:
    pool, address = node
    counter = Counter()
    methods = list(SERVICE.methods)

    with grpc.insecure_channel(address) as channel:
        @fuzz_settings(300)
        @given(method=st.sampled_from(methods), raw=st.binary(max_size=300))
        def target(method, raw: bytes) -> None:
            counter()
            call_raw(channel, SERVICE.full_name, method, raw)

        run_target("store gRPC raw bytes", target, counter)
    time.sleep(1.1)
    _still_serves(address)
