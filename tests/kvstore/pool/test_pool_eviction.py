"""Eviction policies (kvstore/pool/eviction.py) and the chain rule of a tier's books
(kvstore/pool/ledger.py): each policy's order, eligibility, S3-FIFO's queues and ghost, and
"within one prefix chain, tails go before heads" on top of any policy."""
from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.pool.eviction import POLICIES, make_policy
from kvstore.pool.ledger import BlockMeta, TierLedger

ALL = lambda k: True  # noqa: E731


def _admitted(name: str, keys: bytes):  # type: ignore[no-untyped-def]
    policy = make_policy(name)
    for k in keys:
        policy.admit(bytes([k]))
    return policy


def _order(policy, eligible=ALL) -> list[int]:  # type: ignore[no-untyped-def]
    """Victims one after another until none is left (each one forgotten as evicted)."""
    out = []
    while (key := policy.victim(eligible)) is not None:
        out.append(key[0])
        policy.forget(key, evicted=True)
    return out


def test_registry_and_unknown_policy() -> None:
    assert {"lru", "lfu", "fifo", "s3fifo"} <= set(POLICIES)
    with pytest.raises(InvalidArgument, match="s3fifo"):
        make_policy("clock")


def test_lru_takes_the_least_recently_read() -> None:
    p = _admitted("lru", b"\x01\x02\x03\x04")
    p.access(b"\x01")
    p.access(b"\x03")
    assert _order(p) == [2, 4, 1, 3]


def test_fifo_ignores_reads() -> None:
    p = _admitted("fifo", b"\x01\x02\x03")
    p.access(b"\x01")
    assert _order(p) == [1, 2, 3]


def test_lfu_takes_the_least_frequent_then_least_recent() -> None:
    p = _admitted("lfu", b"\x01\x02\x03\x04")
    for k in b"\x01\x01\x02\x03":
        p.access(bytes([k]))
    assert _order(p) == [4, 2, 3, 1]


def test_s3fifo_small_queue_main_queue_and_ghost() -> None:
    p = _admitted("s3fifo", bytes(range(1, 11)))
    p.access(b"\x01")  # read again while new: 1 moves to main instead of going
    assert p.victim(ALL) == b"\x02"
    p.forget(b"\x02", evicted=True)
    p.admit(b"\x02")  # back from the ghost: straight to main
    assert b"\x02" in p._main and b"\x01" not in p._small
    order = _order(p)
    assert order[-2:] == [1, 2] and sorted(order) == list(range(1, 11))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victim_respects_eligibility_and_terminates(name: str) -> None:
    p = _admitted(name, b"\x01\x02\x03")
    for k in b"\x01\x02\x03":
        p.access(bytes([k]))
    assert p.victim(lambda k: k == b"\x02") == b"\x02"
    assert p.victim(lambda k: False) is None  # nothing eligible: no endless loop
    assert sorted(p.keys()) == [b"\x01", b"\x02", b"\x03"]
    p.forget(b"\x02")
    assert sorted(_order(p)) == [1, 3] and list(p.keys()) == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_ledger_evicts_a_chain_tail_first_under_any_policy(name: str, make_dram) -> None:
    parents: dict[bytes, bytes] = {}
    book = TierLedger(make_dram(4096), make_policy(name), parents)
    for k in b"abcde":  # chain a <- b <- c, and d <- e
        book.add(bytes([k]), BlockMeta(1, 0))
    for child, parent in ((b"b", b"a"), (b"c", b"b"), (b"e", b"d")):
        parents[child] = parent
        book.link(child, parent)
    held = {b"c"}  # the chain's tail is leased: its head and middle are blocked too
    victims = []
    while (v := book.victim(lambda k: k not in held)) is not None:
        victims.append(v)
        book.drop(v, evicted=True)
    assert victims.index(b"e") < victims.index(b"d") and set(victims) == {b"d", b"e"}
    held.clear()
    rest = []
    while (v := book.victim(ALL)) is not None:
        rest.append(v)
        book.drop(v, evicted=True)
    assert rest == [b"c", b"b", b"a"]
