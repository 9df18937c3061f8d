"""Every wire of a store node carries the same write-and-lease contract (kvstore/wire/types.py):
each put option, each read and lease option and each error round-trips over

- ``grpc``: the gRPC stream (``Put`` / ``Get``; ``StoreClient(data_path="grpc")``);
- ``uds``: the same-host path, control over the node's Unix socket (frames,
  kvstore/wire/frame_codec.py);
- ``grpc-control``: the same-host path, control over gRPC (``LeaseBlocks``,
  ``ReserveBlocks``, ``CommitBlocks``; a node that serves no socket);
- ``te-tcp``: the transfer engine over TCP (a node process running one; leases over its
  read-only TCP control channel, bytes read by this process's engine). It carries no puts.

Real servers and sockets: the first three serve an in-process pool (DRAM 32 MiB over SSD 64
MiB), so the test reads what the pool recorded (chain links, checksums, lease deadlines);
the transfer-engine node is a ``kvstore serve`` process. The namespace and the identity tag
travel inside the key and the block bytes (kvstore/identity.py), so the bytes and keys
checked here cover them; the namespace as a put option (tenant books, quotas) is checked over
every put wire in tests/kvstore/wire/test_wire_namespace.py. tests/kvstore/wire/test_wire_errors.py checks the error
table itself.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.dataplane.control import Control
from kvstore.dataplane.control_client import UdsControl
from kvstore.dataplane.grpc_control import GrpcControl
from kvstore.errors import InvalidArgument, Unauthenticated, Unavailable
from kvstore.integrity import checksum_of
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.node import StoreNode
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.wire.channel import CHUNK_BYTES
from kvstore.wire.types import ELSEWHERE, MAPPED, MISS, LookupResult

TOKEN = "conformance-token"
IN_PROCESS = ("grpc", "uds", "grpc-control")
WIRES = IN_PROCESS + ("te-tcp",)
LEASE_WIRES = ("uds", "grpc-control", "te-tcp")
SIZES = [0, 1, 4096, 100_000, CHUNK_BYTES + 17]   # an empty block, and one over a gRPC chunk


def key(tag: str, i: int = 0) -> bytes:
    return (tag.encode() + bytes(16))[:12] + i.to_bytes(4, "big")      # 16 bytes (xxh3_128 keys)


def blocks_of(tag: str, sizes: list[int] = SIZES) -> list[tuple[bytes, bytes]]:
    return [(key(tag, i), os.urandom(n)) for i, n in enumerate(sizes)]


@dataclass
class Wire:
    """One wire under test: ``client`` reads (and, but for ``te-tcp``, writes) over it;
    ``control``: its lease carrier (None on ``grpc``, which leases nothing); ``pool``: the
    node's pool when it runs in this process; ``stop``: stops the node."""

    name: str
    address: str
    client: Any
    control: Control | None
    pool: KVPool | None
    stop: Callable[[], None]
    seed: Callable[[list[tuple[bytes, bytes]]], None]   # puts blocks for a read test (any path)


def _in_process(name: str, make_dram: Any, make_ssd: Any) -> Iterator[Wire]:
    pool = KVPool([make_dram(32 << 20), make_ssd(64 << 20)],
                  settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    path = os.path.join(tempfile.gettempdir(), f"kvstore-wire-{uuid.uuid4().hex[:8]}.sock")
    node = StoreNode.serve(pool, auth_token=TOKEN, dataplane_socket=path if name == "uds" else None)
    client = StoreClient(node.address, auth_token=TOKEN, data_path="grpc" if name == "grpc" else "auto")
    control: Control | None = None
    if name != "grpc":
        assert client.data_path_in_use == f"same-host/{'uds' if name == 'uds' else 'grpc'}"
        control = client._local().control
    try:
        yield Wire(name, node.address, client, control, pool, node.stop, lambda b: _seed(pool, b))
    finally:
        client.close()
        node.stop(grace_s=None)


def _seed(pool: KVPool, blocks: list[tuple[bytes, bytes]]) -> None:
    assert all(pool.put(k, d).ok for k, d in blocks)


@pytest.fixture(scope="module")
def te_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """A ``kvstore serve`` process with a transfer engine (tcp) and TOKEN; (Popen, address)."""
    pytest.importorskip("mooncake.engine")
    import subprocess
    import sys

    import grpc

    from launcher.supervisor import free_port
    port = free_port()
    tmp = tmp_path_factory.mktemp("te-node")
    log = open(tmp / "node.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve", "--node-id",
                             "wire-te", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp),
                             "--dram", "32MiB", "--ssd", "0", "--transfer-engine", "tcp", "--auth-token", TOKEN],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        yield proc, address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _te(address: str) -> Iterator[Wire]:
    from kvstore.transfer import TransferEngineTransport
    writer = StoreClient(address, auth_token=TOKEN, data_path="grpc")
    t = TransferEngineTransport(address, auth_token=TOKEN)
    assert t.control is not None, "the node announces its TCP control channel"

    def seed(blocks: list[tuple[bytes, bytes]]) -> None:
        assert all(r.ok for r in writer.put_blocks(blocks))

    try:
        yield Wire("te-tcp", address, t, t.control, None, lambda: None, seed)
    finally:
        t.close()
        writer.close()


@pytest.fixture(params=WIRES)
def wire(request: pytest.FixtureRequest, make_dram: Any, make_ssd: Any) -> Iterator[Wire]:
    if request.param == "te-tcp":
        yield from _te(request.getfixturevalue("te_node")[1])
    else:
        yield from _in_process(request.param, make_dram, make_ssd)


@pytest.fixture(params=IN_PROCESS)
def put_wire(request: pytest.FixtureRequest, make_dram: Any, make_ssd: Any) -> Iterator[Wire]:
    yield from _in_process(request.param, make_dram, make_ssd)


@pytest.fixture(params=LEASE_WIRES)
def lease_wire(request: pytest.FixtureRequest, make_dram: Any, make_ssd: Any) -> Iterator[Wire]:
    if request.param == "te-tcp":
        yield from _te(request.getfixturevalue("te_node")[1])
    else:
        yield from _in_process(request.param, make_dram, make_ssd)


# -- lookups -----------------------------------------------------------------------------------
def test_a_lookups_purpose_and_tenant_reach_the_pool(put_wire: Wire) -> None:
    """What a lookup is for and whose it is reach the node's lookup books over every wire
    that carries lookups (docs/metrics.md): a reuse lookup counts, a hand-off lookup counts
    apart, a probe counts nothing; the misses are the named tenant's."""
    from kvstore.pool.tenants import namespace_stats, tenants_of
    assert put_wire.pool is not None
    tenants_of(put_wire.pool)                      # the pool keeps tenant books
    held = blocks_of("look", [64, 64])
    put_wire.seed(held)
    keys = [k for k, _ in held] + [key("look-miss")]
    c = put_wire.client
    assert c.lookup(keys, "reuse", "tenant-w").blocks == 2
    assert c.lookup(keys, "handoff").blocks == 2 and c.lookup(keys, "probe").blocks == 2
    dram = put_wire.pool.stats()[0]
    assert (dram.lookup_hits, dram.lookup_misses, dram.handoff_lookups) == (2, 1, 2)
    assert namespace_stats(put_wire.pool)["tenant-w"].lookup_misses == 1


def test_a_lookup_is_one_lookup_result_on_every_layer(put_wire: Wire) -> None:
    """The pool, the wire's control channel and the client hand on the same LookupResult:
    the longest held prefix and the tier of each of its blocks, never another shape."""
    assert put_wire.pool is not None
    held = blocks_of("shape", [64, 64])
    put_wire.seed(held)
    keys = [k for k, _ in held] + [key("shape-miss")]
    want = LookupResult(2, ("dram", "dram"))
    answers = [put_wire.pool.lookup(keys, "probe"), put_wire.client.lookup(keys, "probe")]
    answers += [put_wire.control.lookup(keys, "probe")] if put_wire.control is not None else []
    assert all(type(a) is LookupResult and a == want for a in answers), answers


# -- puts --------------------------------------------------------------------------------------
def test_a_put_stores_the_bytes_and_their_checksum(put_wire: Wire) -> None:
    blocks = blocks_of(f"bytes-{put_wire.name}")
    results = put_wire.client.put_blocks(blocks)
    assert [(r.key, r.ok, r.existed, r.error) for r in results] == [(k, True, False, "") for k, _ in blocks]
    pool = put_wire.pool
    for k, d in blocks:
        assert pool.get(k) == d
        assert pool._place.find(k)[1].checksum == checksum_of(d)
    assert put_wire.client.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]


def test_a_put_again_is_existed(put_wire: Wire) -> None:
    blocks = blocks_of(f"again-{put_wire.name}", [4096, 8192])
    assert all(r.ok and not r.existed for r in put_wire.client.put_blocks(blocks))
    assert [(r.ok, r.existed) for r in put_wire.client.put_blocks(blocks)] == [(True, True)] * 2


@pytest.mark.parametrize("chain, parent", [(True, True), (True, False), (False, True), (False, False)])
def test_chain_and_parent_reach_the_pool(put_wire: Wire, chain: bool, parent: bool) -> None:
    """``chain``: block i extends block i - 1; ``parent``: the key the first block extends."""
    tag = f"c{int(chain)}{int(parent)}-{put_wire.name}"
    head = key(tag, 99)
    assert put_wire.client.put(head, b"h" * 4096).ok
    blocks = blocks_of(tag, [4096, 4096, 4096])
    keys = [k for k, _ in blocks]
    assert all(r.ok for r in put_wire.client.put_blocks(blocks, chain=chain, parent=head if parent else None))
    links = put_wire.pool._place.parents
    assert [links.get(k) for k in keys] == [head if parent else None] + ([keys[0], keys[1]] if chain else [None] * 2)


def test_a_block_larger_than_every_tier_fails_with_the_reason(put_wire: Wire) -> None:
    big = key(f"big-{put_wire.name}")
    (r,) = put_wire.client.put_blocks([(big, os.urandom(80 << 20))])
    assert (r.key, r.ok) == (big, False) and r.error
    assert put_wire.pool.get(big) is None


def test_pins_round_trip(put_wire: Wire) -> None:
    """Pins go over gRPC from every client: ``hard``, ``ttl_s``, ``prefix``."""
    blocks = blocks_of(f"pin-{put_wire.name}", [4096, 4096, 4096])
    keys = [k for k, _ in blocks]
    assert all(r.ok for r in put_wire.client.put_blocks(blocks, chain=True))
    before = time.monotonic()
    assert put_wire.client.pin(keys[:1], hard=False, ttl_s=120.0) == 1
    pin = put_wire.pool._place.pins[keys[0]]
    assert not pin.hard and before + 120.0 <= pin.until <= time.monotonic() + 120.0
    assert put_wire.client.pin(keys + [key("absent", 7)], hard=True, prefix=True) == 3
    assert all(put_wire.pool._place.pins[k].hard for k in keys)
    assert put_wire.client.unpin(keys, prefix=True) == 3 and not put_wire.pool._place.pins


# -- reads -------------------------------------------------------------------------------------
def test_reads_are_byte_identical_and_misses_are_none(wire: Wire) -> None:
    blocks = blocks_of(f"read-{wire.name}", [1, 4096, 100_000, CHUNK_BYTES + 17])
    wire.seed(blocks)
    keys = [k for k, _ in blocks]
    missing = key(f"none-{wire.name}")
    assert wire.client.get_blocks(keys) == [d for _, d in blocks]
    assert wire.client.get_blocks([keys[0], missing, keys[1]]) == [blocks[0][1], None, blocks[1][1]]
    assert wire.client.get_blocks([keys[0], missing, keys[1]], stop_at_miss=True) == [blocks[0][1], None]
    outs = [np.zeros(len(d), np.uint8) for _, d in blocks]
    assert wire.client.get_into(keys, outs) == [len(d) for _, d in blocks]
    assert [o.tobytes() for o in outs] == [d for _, d in blocks]


def test_a_block_in_another_tier_is_read_over_the_stream(put_wire: Wire) -> None:
    """A block on SSD is leased as ELSEWHERE on the same-host wires and read over gRPC."""
    k, d = key(f"ssd-{put_wire.name}"), os.urandom(50_000)
    assert put_wire.pool.put(k, d, tier="ssd").ok
    if put_wire.control is not None:
        grant = put_wire.control.lease([k])
        put_wire.control.release(grant.lease_id)
        assert grant.blocks[0].state == ELSEWHERE
    assert put_wire.client.get_blocks([k]) == [d]


# -- leases ------------------------------------------------------------------------------------
def test_lease_ttl_stop_at_miss_and_locations(lease_wire: Wire) -> None:
    blocks = blocks_of(f"lease-{lease_wire.name}", [4096, 8192])
    lease_wire.seed(blocks)
    keys = [k for k, _ in blocks]
    missing = key(f"gone-{lease_wire.name}")
    ctl = lease_wire.control
    before = time.monotonic()
    grant = ctl.lease([keys[0], missing, keys[1]], ttl_s=42.0)
    after = time.monotonic()
    ctl.release(grant.lease_id)
    assert grant.lease_id and before + 42.0 <= grant.deadline <= after + 42.0
    assert [b.state for b in grant.blocks] == [MAPPED, MISS, MAPPED]
    assert [(b.size, b.checksum) for b in grant.blocks[::2]] == [(len(d), checksum_of(d)) for _, d in blocks]
    cut = ctl.lease([keys[0], missing, keys[1]], stop_at_miss=True)
    ctl.release(cut.lease_id)
    assert [b.state for b in cut.blocks] == [MAPPED, MISS]
    none = ctl.lease([missing])
    assert (none.lease_id, [b.state for b in none.blocks]) == (0, [MISS])


@pytest.fixture(params=("uds", "grpc-control"))
def same_host_wire(request: pytest.FixtureRequest, make_dram: Any, make_ssd: Any) -> Iterator[Wire]:
    yield from _in_process(request.param, make_dram, make_ssd)


def test_a_chain_lease_links_the_chain_in_the_pool(same_host_wire: Wire) -> None:
    """(te-tcp's LEASE is the uds frame itself; its node's pool is not in this process.)"""
    lease_wire = same_host_wire
    blocks = blocks_of(f"lchain-{lease_wire.name}", [4096, 4096, 4096])
    lease_wire.seed(blocks)
    keys = [k for k, _ in blocks]
    links = lease_wire.pool._place.parents
    grant = lease_wire.control.lease(keys[:2])
    lease_wire.control.release(grant.lease_id)
    assert [links.get(k) for k in keys] == [None, None, None]
    grant = lease_wire.control.lease(keys, chain=True)
    lease_wire.control.release(grant.lease_id)
    assert [links.get(k) for k in keys] == [None, keys[0], keys[1]]


# -- errors ------------------------------------------------------------------------------------
def _calls(wire: Wire) -> list[Callable[[list[bytes]], Any]]:
    """The wire's calls that name keys: its reads and, where it has them, leases and puts."""
    calls: list[Callable[[list[bytes]], Any]] = [lambda keys: wire.client.get_blocks(keys)]
    if wire.control is not None:
        calls.append(lambda keys: wire.control.lease(keys))
    if wire.name != "te-tcp":
        calls.append(lambda keys: wire.client.put_blocks([(k, b"x") for k in keys]))
    return calls


def test_a_malformed_key_is_invalid_argument(wire: Wire) -> None:
    for call in _calls(wire):
        with pytest.raises(InvalidArgument, match="7 bytes"):
            call([b"k" * 7])


def test_too_many_keys_is_invalid_argument(wire: Wire) -> None:
    keys = [key("many", i) for i in range(MAX_KEYS_PER_CALL + 1)]
    if wire.control is not None:
        with pytest.raises(InvalidArgument, match=f"at most {MAX_KEYS_PER_CALL}"):
            wire.control.lease(keys)
    if wire.name == "grpc":   # the client splits long reads itself; the node refuses one call
        from protos import kvstore_pb2 as pb
        with pytest.raises(InvalidArgument, match=f"at most {MAX_KEYS_PER_CALL}"):
            wire.client._call(wire.client._stub.Lookup, pb.LookupRequest(keys=keys))


@pytest.mark.parametrize("ttl", [math.nan, -1.0, math.inf, 1e9])
def test_a_lease_ttl_that_is_not_seconds_is_invalid_argument(lease_wire: Wire, ttl: float) -> None:
    with pytest.raises(InvalidArgument, match="TTL"):
        lease_wire.control.lease([key("ttl")], ttl_s=ttl)


def test_a_wrong_token_is_unauthenticated(wire: Wire) -> None:
    if wire.name == "te-tcp":
        from kvstore.dataplane.control_client import TcpControl
        from kvstore.transfer import TransferEngineTransport
        with pytest.raises(Unauthenticated):
            TransferEngineTransport(wire.address, auth_token="wrong")
        with pytest.raises(Unauthenticated):
            TcpControl(wire.control.path, "wrong")
        return
    with StoreClient(wire.address, auth_token="wrong", data_path="grpc") as c:
        with pytest.raises(Unauthenticated, match="UNAUTHENTICATED"):
            c.get_blocks([key("auth")])
        if wire.name == "grpc-control":
            with pytest.raises(Unauthenticated):
                GrpcControl(c._stub, c._call).lease([key("auth")])
    if wire.name == "uds":
        with pytest.raises(Unauthenticated):
            UdsControl(wire.control.path, "wrong")


def test_a_stopped_node_is_unavailable(wire: Wire, spawn_store_node: Any) -> None:
    if wire.name == "te-tcp":   # a node of its own, killed under the reader
        from kvstore.transfer import TransferEngineTransport
        proc, address = spawn_store_node("wire-te-gone", "--dram", "8MiB", "--ssd", "0", "--transfer-engine", "tcp")
        t = TransferEngineTransport(address)
        try:
            proc.kill()
            proc.wait()
            with pytest.raises(Unavailable):
                t.get_blocks([key("gone")])
        finally:
            t.close()
        return
    control = wire.control
    wire.stop()
    for call in _calls(wire):
        with pytest.raises(Unavailable):
            call([key("gone")])
    if control is not None:
        with pytest.raises(Unavailable):
            control.lease([key("gone")])


def test_stats_round_trip_field_for_field(put_wire: Wire) -> None:
    """Every TierStats field crosses the wire (they map by name, kvstore/wire/proto_codec.py)."""
    assert put_wire.client.put(key(f"stats-{put_wire.name}"), b"s" * 4096).ok
    node_id, tiers = put_wire.client.stats()
    assert node_id == put_wire.pool.node_id and tiers == put_wire.pool.stats()
