"""The namespace (a put's tenant, kvstore/pool/tenants.py) as a put option of the write-and-lease
contract, over every put wire of tests/kvstore/wire/test_wire_conformance.py: the gRPC stream (call
metadata), the same-host path with control over the Unix socket (RESERVE and COMMIT frames;
a spare slot gets its tenant at commit) and with control over gRPC (``ReserveBlocks`` /
``CommitBlocks`` fields). Real in-process store nodes, real sockets, the pool's own books.
A namespaced put on a same-host wire must stay on that wire: the gRPC ``Put`` stream of the
client is made to fail there, so a put that fell back to it fails the test."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.errors import InvalidArgument, QuotaExceeded
from kvstore.pool.tenants import TenantBooks, attach, namespace_stats
from kvstore.wire import frame_codec as w
from kvstore.wire.types import ReserveRequest
from tests.kvstore.wire.test_wire_conformance import IN_PROCESS, Wire, _in_process, blocks_of, key

BS = 4096


@pytest.fixture(params=IN_PROCESS)
def put_wire(request: pytest.FixtureRequest, make_dram: Any, make_ssd: Any) -> Iterator[Wire]:
    for wire in _in_process(request.param, make_dram, make_ssd):
        if wire.name != "grpc":   # a namespaced put must not fall back to the gRPC stream here
            def no_stream(*_: Any, name: str = wire.name, **__: Any) -> Any:
                raise AssertionError(f"a put on the {name} wire went over the gRPC Put stream")
            wire.client._stub.Put = no_stream
        yield wire


def _books(wire: Wire) -> TenantBooks:
    return attach(wire.pool)


def test_the_namespace_reaches_the_tenant_books(put_wire: Wire) -> None:
    """A put's tenant owns its blocks in the pool; a put without one belongs to ""."""
    books = _books(put_wire)
    tenant, nobody = blocks_of(f"ns-{put_wire.name}", [BS, BS]), blocks_of(f"nn-{put_wire.name}", [BS])
    assert all(r.ok for r in put_wire.client.put_blocks(tenant, namespace="tenant-a"))
    assert all(r.ok for r in put_wire.client.put_blocks(nobody))
    assert [books.namespace_of(k) for k, _ in tenant + nobody] == ["tenant-a", "tenant-a", ""]
    stats = namespace_stats(put_wire.pool)
    assert (stats["tenant-a"].bytes, stats["tenant-a"].blocks) == (2 * BS, 2)
    assert books.pending_of("tenant-a") == 0   # ("" may hold spare slots in stock)


def test_one_block_puts_through_spare_slots_are_the_tenants(put_wire: Wire) -> None:
    """One-block puts of one size go through spare slots on the socket (reserved before
    their tenant is known; the first ones even before the node had tenant books): each is
    assigned its namespace at commit. The RESERVE frames are counted to show the spares were
    used."""
    assert put_wire.client.put(key(f"warm-{put_wire.name}"), b"w" * BS).ok   # unattributed: stocks spares
    books = _books(put_wire)
    reserves = 0
    ctl = put_wire.control
    if ctl is not None:
        real = ctl.reserve

        def counted(*a: Any, **kw: Any) -> Any:
            nonlocal reserves
            reserves += 1
            return real(*a, **kw)
        ctl.reserve = counted  # type: ignore[method-assign]
    blocks = blocks_of(f"sp-{put_wire.name}", [BS] * 8)
    for k, d in blocks:
        assert put_wire.client.put_blocks([(k, d)], namespace="tenant-s")[0].ok
    assert [books.namespace_of(k) for k, _ in blocks] == ["tenant-s"] * 8
    assert books.used("tenant-s") == 8 * BS and books.used("") == BS   # ("": the warm-up block)
    assert books.pending_of("tenant-s") == 0 and books.pending_of("") == sum(
        size for _, t, size in books.pending.values() if t.name == "")   # only spares still in stock
    assert put_wire.client.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    if put_wire.name == "uds":
        assert reserves < 8, f"{reserves} RESERVE frames for 8 one-block puts: the spare slots went unused"


def test_a_put_over_its_tenants_quota_is_quota_exceeded(put_wire: Wire) -> None:
    """Over its quota with no block it can evict (its own are pinned): QuotaExceeded, and
    nothing of the refused put is stored."""
    books = _books(put_wire)
    books.quotas.set("tenant-q", 2 * BS)
    for k, _ in blocks_of(f"q-{put_wire.name}", [BS, BS]):
        assert put_wire.client.put_blocks([(k, b"q" * BS)], namespace="tenant-q")[0].ok
        put_wire.pool.pin([k], hard=True)
    refused = key(f"q3-{put_wire.name}")
    with pytest.raises(QuotaExceeded, match="tenant-q"):
        put_wire.client.put_blocks([(refused, b"q" * BS)], namespace="tenant-q")
    with pytest.raises(QuotaExceeded, match="tenant-q"):   # in a batch too
        put_wire.client.put_blocks([(refused, b"q" * BS), (key(f"q4-{put_wire.name}"), b"q" * BS)],
                                   namespace="tenant-q")
    assert put_wire.pool.get(refused) is None
    assert books.used("tenant-q") == 2 * BS and books.pending_of("tenant-q") == 0


def test_a_tenant_over_its_quota_evicts_its_own_blocks_only(put_wire: Wire) -> None:
    """Tenant a (quota: 3 blocks) puts 8 blocks one by one (through spare slots on the
    socket, whose quota is checked at commit): its oldest blocks are evicted, tenant b's
    never."""
    books = _books(put_wire)
    books.quotas.set("tenant-a", 3 * BS)
    other = blocks_of(f"b-{put_wire.name}", [BS] * 4)
    assert all(r.ok for r in put_wire.client.put_blocks(other, namespace="tenant-b"))
    mine = blocks_of(f"a-{put_wire.name}", [BS] * 8)
    for k, d in mine:
        assert put_wire.client.put_blocks([(k, d)], namespace="tenant-a")[0].ok
    stats = namespace_stats(put_wire.pool)
    assert (stats["tenant-a"].bytes, stats["tenant-a"].evictions) == (3 * BS, 5)
    assert [put_wire.pool.get(k) is not None for k, _ in mine] == [False] * 5 + [True] * 3
    assert put_wire.client.get_blocks([k for k, _ in other]) == [d for _, d in other]
    assert stats["tenant-b"].bytes == 4 * BS and stats["tenant-b"].evictions == 0


@pytest.mark.parametrize("bad", ["", "tab\there", "x" * 257, "caf\u00e9"])
def test_a_malformed_namespace_is_invalid_argument(put_wire: Wire, bad: str) -> None:
    """Refused before anything is stored ("" is no namespace at the client: an
    unattributed put); the node refuses them too (the frames' decoder, below; the gRPC
    servicers through check_namespace)."""
    blocks = blocks_of(f"bad-{put_wire.name}", [BS])
    if not bad:
        assert put_wire.client.put_blocks(blocks, namespace=bad)[0].ok
        assert _books(put_wire).namespace_of(blocks[0][0]) == ""
        return
    with pytest.raises(InvalidArgument, match="namespace"):
        put_wire.client.put_blocks(blocks, namespace=bad)
    assert put_wire.pool.get(blocks[0][0]) is None


def test_the_node_refuses_a_malformed_namespace(put_wire: Wire) -> None:
    """Past the client's check: the node's RESERVE / COMMIT decoders and servicers refuse it."""
    k, bad = key(f"nbad-{put_wire.name}"), "x" * 257
    if put_wire.control is None:
        from kvstore.wire import proto_codec as codec
        from kvstore.wire.errors import from_rpc_error
        grpc = pytest.importorskip("grpc")
        c = put_wire.client
        with pytest.raises(grpc.RpcError) as err:
            c._stub.Put(codec.put_chunks([(k, b"n" * BS)]), metadata=c._meta + codec.namespace_metadata(bad))
        with pytest.raises(InvalidArgument, match="namespace"):
            raise from_rpc_error(err.value, c.address)
    else:
        with pytest.raises(InvalidArgument, match="namespace"):
            put_wire.control.reserve([(k, BS)], namespace=bad)
        (slot,) = put_wire.control.reserve([(k, BS)])
        with pytest.raises(InvalidArgument, match="namespace"):
            put_wire.control.commit([slot.res_id], [k], namespace=bad)
        put_wire.control.abort([slot.res_id])
    assert put_wire.pool.get(k) is None


def test_the_frames_carry_the_namespace_both_ways() -> None:
    """The RESERVE and COMMIT frames' namespace round-trips; one that is not utf-8 or not a
    namespace is refused by the decoder."""
    req = ReserveRequest([(key("f", 1), BS)], True, key("f", 0), "tenant-e")
    assert w.decode_reserve_request(w.reserve_request(req)) == req
    assert w.decode_reserve_request(w.reserve_request(req._replace(namespace=None))).namespace is None
    commit = w.CommitRequest([7], [key("f", 1)], [None], (BS, 4), [123], [9], "tenant-e")
    assert w.decode_commit_request(w.commit_request(commit)) == commit._replace(res_ids=(7,), checksums=(123,),
                                                                                give_back=(9,))
    raw = bytearray(w.reserve_request(req))
    raw[3] = 0xFF   # inside the namespace's utf-8
    with pytest.raises(InvalidArgument, match="utf-8"):
        w.decode_reserve_request(bytes(raw))
    bad = w.reserve_request(req._replace(namespace="a\nb"))
    with pytest.raises(InvalidArgument, match="namespace"):
        w.decode_reserve_request(bad)
