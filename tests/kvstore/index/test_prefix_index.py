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


def test_add_reports_new_copies_and_metadata_is_kept(index: PrefixIndex) -> None:
    assert not index.add(K[0], "A", "dram", 99, 7)       # already there: nothing changes
    assert index.add(K[5], "C", "hbm", 64, 2**64 - 1)
    e = index.entry(K[5])
    assert (e.size, e.checksum, e.hits, e.locations) == (64, 2**64 - 1, 0, {"C": ("hbm",)})
    assert index.entry(K[1]).locations == {"A": ("dram",), "B": ("dram", "ssd")}
    index.check_integrity()


def test_node_counts_entries_and_slot_reuse(index: PrefixIndex) -> None:
    assert index.node_blocks("A") == 4 and index.node_blocks("B") == 2 and index.node_blocks("Z") == 0
    assert sorted(index.nodes()) == ["A", "B"]
    assert sorted(index.node_entries("B")) == sorted([(K[0], "ssd", 10), (K[1], "ssd", 10), (K[1], "dram", 10)])
    assert index.node_entries("Z") == []
    index.remove(K[4], "A", "dram")
    index.check_integrity()
    index.add(K[5], "B", "ssd", 20)                        # reuses K4's slot
    assert K[4] not in index and index.entry(K[5]).size == 20 and index.entry(K[5]).hits == 0
    index.clear_node("B")
    assert index.nodes() == ["A"] and index.node_blocks("B") == 0
    index.check_integrity()


def test_many_nodes_and_unknown_tiers() -> None:
    """More (node, tier) pairs than one machine word; tiers outside hbm/dram/ssd rank after them."""
    idx = PrefixIndex(capacity=1)
    nodes = [f"engine-{i}" for i in range(40)]
    for n in nodes:
        for k in K[:3]:
            idx.add(k, n, "ssd")
            idx.add(k, n, "cxl")
        idx.add(K[0], n, "hbm")
    m = idx.match(K)
    assert m.blocks == 3 and len(m.per_node) == 40
    assert all(t == ("hbm", "ssd", "ssd") for t in m.per_node.values())
    assert idx.entry(K[1]).locations["engine-7"] == ("ssd", "cxl")
    for n in nodes[::2]:
        assert idx.clear_node(n) == 3
    assert sorted(idx.match(K).per_node) == sorted(nodes[1::2])
    idx.check_integrity()


@pytest.mark.parametrize("chain", [1, 16, 1000])
def test_random_operations_keep_the_invariants(chain: int) -> None:
    """A model check: random adds/removes/clears against a dict of sets."""
    import random

    rng = random.Random(chain)
    keys = [rng.randbytes(32) for _ in range(chain)]
    idx, model = PrefixIndex(capacity=4), {}
    for _ in range(3000):
        op, k = rng.random(), rng.choice(keys)
        node, tier = rng.choice("ABC"), rng.choice(("hbm", "dram", "ssd"))
        if op < 0.55:
            assert idx.add(k, node, tier) == ((node, tier) not in model.get(k, set()))
            model.setdefault(k, set()).add((node, tier))
        elif op < 0.95:
            had = (node, tier) in model.get(k, set())
            assert idx.remove(k, node, tier) == had
            model.get(k, set()).discard((node, tier))
        else:
            held = sum(any(n == node for n, _ in locs) for locs in model.values())
            assert idx.clear_node(node) == held
            model = {key: {(n, t) for n, t in locs if n != node} for key, locs in model.items()}
        model = {key: locs for key, locs in model.items() if locs}
    idx.check_integrity()
    assert len(idx) == len(model) and all(k in idx for k in model)
    prefix = 0
    while prefix < len(keys) and keys[prefix] in model:
        prefix += 1
    assert idx.longest_prefix(keys) == idx.match(keys).blocks == prefix
