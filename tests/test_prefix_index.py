"""The prefix index (kvstore/index/prefix_index.py): longest prefix anywhere, per-node
matches with the tier of each block, copy removal and node clearing."""
from __future__ import annotations

import pytest

from kvstore.index.prefix_index import PrefixIndex

K = [bytes([i]) * 32 for i in range(6)]


@pytest.fixture
def index() -> PrefixIndex:
    idx = PrefixIndex()
    # node A holds K0..K2 in dram; node B holds K0, K1 in ssd and K1 also in dram; K3 nowhere.
    for k in K[:3]:
        idx.add(k, "A", "dram", 10)
    idx.add(K[0], "B", "ssd", 10)
    idx.add(K[1], "B", "ssd", 10)
    idx.add(K[1], "B", "dram", 10)
    idx.add(K[4], "A", "dram", 10)  # beyond a gap: never part of a prefix
    return idx


def test_longest_prefix(index: PrefixIndex) -> None:
    assert index.longest_prefix(K) == 3
    assert index.longest_prefix(K[1:]) == 2
    assert index.longest_prefix(K[3:]) == 0
    assert index.longest_prefix([]) == 0


def test_match_per_node_with_fastest_tier(index: PrefixIndex) -> None:
    m = index.match(K)
    assert m.blocks == 3
    assert m.per_node == {"A": ("dram", "dram", "dram"), "B": ("ssd", "dram")}
    assert m.node_blocks("A") == 3 and m.node_blocks("B") == 2 and m.node_blocks("C") == 0
    assert index.match(K, nodes=["B"]).per_node == {"B": ("ssd", "dram")}
    assert index.match(K, nodes=["B"]).blocks == 3


def test_match_global_prefix_spans_nodes() -> None:
    idx = PrefixIndex()
    idx.add(K[0], "A", "dram")
    idx.add(K[1], "B", "ssd")
    idx.add(K[2], "A", "dram")
    m = idx.match(K)
    assert m.blocks == 3  # held anywhere, even if no node holds the whole chain
    assert m.per_node == {"A": ("dram",)}


@pytest.mark.parametrize("tiers, best", [(("ssd", "dram"), "dram"), (("dram", "hbm"), "hbm"),
                                         (("ssd", "hbm", "dram"), "hbm")])
def test_fastest_tier_wins(tiers: tuple[str, ...], best: str) -> None:
    idx = PrefixIndex()
    for t in tiers:
        idx.add(K[0], "A", t)
    assert idx.match(K[:1]).per_node == {"A": (best,)}


def test_remove_one_copy_keeps_key_visible(index: PrefixIndex) -> None:
    assert index.remove(K[1], "B", "dram")
    assert K[1] in index
    assert index.match(K).per_node["B"] == ("ssd", "ssd")
    assert not index.remove(K[1], "B", "dram")  # already gone
    assert not index.remove(K[3], "A", "dram")  # never there
    assert index.remove(K[1], "B", "ssd")
    assert index.match(K).per_node["B"] == ("ssd",)
    assert index.remove(K[1], "A", "dram")
    assert K[1] not in index
    assert index.longest_prefix(K) == 1


def test_clear_node_drops_its_hits(index: PrefixIndex) -> None:
    assert index.clear_node("A") == 4
    m = index.match(K)
    assert "A" not in m.per_node
    assert m.blocks == 2 and m.per_node == {"B": ("ssd", "dram")}
    assert K[2] not in index and K[4] not in index
    assert index.clear_node("A") == 0
    assert index.clear_node("B") == 2
    assert len(index) == 0


def test_touch_records_hits(index: PrefixIndex) -> None:
    before = index.entry(K[0]).last_access
    index.touch([K[0], K[3]])
    assert index.entry(K[0]).hits == 1 and index.entry(K[0]).last_access >= before
    assert index.entry(K[3]) is None
