"""kvctl's block commands on a real store node process (``launcher serve`` with a store
token): ls, inspect, demote, promote, evict (demoted vs dropped, exit 3 when short), flush
(a hard pin left behind is exit 3, named; --force; --tier ssd only SSD), rm (keys and
--prefix), nodes without Redis, lookup keyed as the engines key."""
from __future__ import annotations

import os
import re

import pytest

from kvstore.client import StoreClient
from kvstore.index.keys import KeyExtras, block_keys
from tests.helpers.kvctl_helpers import TOKEN, block, kvctl, kvctl_env

BLOCK = 256 << 10


@pytest.fixture
def node(spawn_store_node, tmp_path):
    _, address = spawn_store_node("node-a", "--dram", "4MiB", "--ssd", "16MiB", "--auth-token", TOKEN,
                                  "--transfer-engine", "off")
    env = kvctl_env(tmp_path)
    with StoreClient(address, auth_token=TOKEN, data_path="grpc") as client:
        yield address, env, client


def _keys(doc):
    return {b["key"] for b in doc["blocks"]}


def test_ls_inspect_demote_promote(node):
    address, env, client = node
    a = [(block(i, b"a"), os.urandom(BLOCK)) for i in range(4)]
    b = [(block(i, b"b"), os.urandom(BLOCK)) for i in range(2)]
    assert all(r.ok for r in client.put_blocks(a, chain=True, namespace="key-aaaa"))
    assert all(r.ok for r in client.put_blocks(b, namespace="key-bbbb"))
    rc, doc, err = kvctl(env, "--store", address, "ls")
    assert rc == 0, err
    assert doc["matched"] == 6 and {x["node"] for x in doc["blocks"]} == {"node-a"}
    assert {x["namespace"] for x in doc["blocks"]} == {"key-aaaa", "key-bbbb"}
    rc, doc, _ = kvctl(env, "--store", address, "ls", "--namespace", "key-aaaa", "--limit", "2")
    assert rc == 0 and doc["matched"] == 4 and doc["listed"] == 2
    assert kvctl(env, "--store", address, "ls", "--tier", "ssd")[1]["matched"] == 0
    rc, _, err = kvctl(env, "--store", address, "ls", "--limit", "-1")   # listed nothing, silently
    assert rc == 2 and "--limit" in err and "in 0..4294967295" in err, err
    rc, _, err = kvctl(env, "--store", address, "ls", "--limit", "99999999999999999999")   # over ListBlocks' uint32
    assert rc == 2 and "--limit" in err and "in 0..4294967295" in err, err
    for command in ("ls", "flush"):          # a name no wire carries matched nothing, silently
        rc, _, err = kvctl(env, "--store", address, command, "--namespace", "ünï")
        assert rc == 2 and "printable ASCII" in err, err

    key = a[1][0].hex()
    rc, doc, err = kvctl(env, "--store", address, "inspect", key)
    assert rc == 0 and doc["found"], err
    copy = doc["copies"][0]
    assert copy["tiers"] == ["dram"] and copy["size"] == BLOCK and copy["namespace"] == "key-aaaa"
    assert copy["parent"] == a[0][0].hex()                      # put as one chain
    rc, doc, err = kvctl(env, "--store", address, "inspect", key[:16])   # the key as ls prints it
    assert rc == 0 and doc["key"] == key and doc["copies"][0]["size"] == BLOCK, err
    rc, _, err = kvctl(env, "--store", address, "inspect", b"a-".hex(), json_out=False)   # four keys start so
    assert rc == 1 and "block keys start with '612d'" in err and "give more of the key" in err, err
    rc, doc, _ = kvctl(env, "--store", address, "inspect", "ffff")
    assert rc == 3 and not doc["found"] and doc["copies"] == []

    rc, doc, _ = kvctl(env, "--store", address, "demote", key)
    assert rc == 0 and doc["demoted"] == [key]
    assert kvctl(env, "--store", address, "inspect", key)[1]["copies"][0]["tiers"] == ["ssd"]
    rc, doc, _ = kvctl(env, "--store", address, "demote", key)  # in the last tier already
    assert rc == 3 and not doc["success"] and "last tier" in doc["failed"][key][0]
    rc, doc, _ = kvctl(env, "--store", address, "promote", key)
    assert rc == 0 and doc["promoted"] == [key]
    assert kvctl(env, "--store", address, "inspect", key)[1]["copies"][0]["tiers"] == ["dram", "ssd"]
    assert client.get(a[1][0]) == a[1][1]                       # the bytes came through every move

    rc, doc, _ = kvctl(env, "--store", address, "inspect", block(99).hex())
    assert rc == 3 and not doc["found"] and doc["success"] is False   # every exit 3 says success: false


def test_evict_says_demoted_or_dropped_and_fails_when_short(node):
    address, env, client = node
    items = [(block(i), os.urandom(BLOCK)) for i in range(4)]
    client.put_blocks(items)
    rc, doc, err = kvctl(env, "--store", address, "evict", "--tier", "dram", "--bytes", "512KiB")
    assert rc == 0, err
    assert doc["success"] and doc["demoted"] == 2 and doc["dropped"] == 0 and doc["freed_bytes"] == 2 * BLOCK
    rc, text, _ = kvctl(env, "--store", address, "evict", "--tier", "dram", "--bytes", "256KiB", json_out=False)
    assert rc == 0 and "1 demoted to the next tier (still served from there), 0 dropped" in text
    assert client.pin([items[3][0]], hard=True) == 1
    rc, doc, _ = kvctl(env, "--store", address, "evict", "--tier", "dram", "--bytes", "1GiB")
    assert rc == 3 and not doc["success"]
    assert doc["freed_bytes"] == 0 and "leased or hard-pinned" in doc["reason"]
    rc, doc, _ = kvctl(env, "--store", address, "evict", "--tier", "ssd", "--bytes", "256KiB")
    assert rc == 0 and doc["dropped"] == 1 and doc["demoted"] == 0      # nothing below SSD


def test_flush_with_a_hard_pin_exits_non_zero_naming_it(node):
    address, env, client = node
    items = [(block(i), os.urandom(BLOCK)) for i in range(5)]
    client.put_blocks(items)
    assert client.pin([items[0][0]], hard=True) == 1
    rc, doc, _ = kvctl(env, "--store", address, "flush")
    assert rc == 3 and doc["success"] is False
    assert doc["left_blocks"] == 1 and doc["left"] == {"hard-pinned": 1} and "hard-pinned" in doc["reason"]
    assert doc["nodes"][0]["tiers"] == ["dram", "ssd"] and doc["nodes"][0]["dropped_blocks"] == 4
    rc, text, _ = kvctl(env, "--store", address, "flush", json_out=False)
    assert rc == 3 and "1 block left behind (1 hard-pinned)" in text and "--force" in text
    rc, doc, _ = kvctl(env, "--store", address, "flush", "--force")
    assert rc == 0 and doc["success"] and doc["nodes"][0]["dropped_blocks"] == 1
    assert kvctl(env, "--store", address, "ls")[1]["matched"] == 0


def test_flush_of_one_tier_or_namespace_touches_nothing_else(node):
    address, env, client = node
    items = [(block(i), os.urandom(BLOCK)) for i in range(3)]
    client.put_blocks(items[:2], namespace="key-one")
    client.put_blocks(items[2:], namespace="key-two")
    kvctl(env, "--store", address, "demote", items[0][0].hex())           # now in SSD only
    rc, doc, _ = kvctl(env, "--store", address, "flush", "--tier", "ssd")
    assert rc == 0 and doc["nodes"][0]["tiers"] == ["ssd"] and doc["nodes"][0]["dropped_blocks"] == 1
    assert _keys(kvctl(env, "--store", address, "ls")[1]) == {items[1][0].hex(), items[2][0].hex()}
    rc, doc, _ = kvctl(env, "--store", address, "flush", "--namespace", "key-two")
    assert rc == 0 and doc["nodes"][0]["dropped_blocks"] == 1
    assert _keys(kvctl(env, "--store", address, "ls")[1]) == {items[1][0].hex()}


def test_rm_keys_and_prefixes(node):
    address, env, client = node
    items = [(block(i, b"x"), os.urandom(4096)) for i in range(3)] + [(block(0, b"y"), os.urandom(4096))]
    client.put_blocks(items)
    rc, doc, _ = kvctl(env, "--store", address, "rm", items[0][0].hex())
    assert rc == 0 and doc["removed"] == [items[0][0].hex()] and doc["freed_bytes"] > 0
    rc, doc, _ = kvctl(env, "--store", address, "rm", "--prefix", b"x-".hex())
    assert rc == 0 and set(doc["removed"]) == {items[1][0].hex(), items[2][0].hex()}
    rc, doc, err = kvctl(env, "--store", address, "rm", items[0][0].hex())   # gone already
    assert rc == 3, err
    assert "not held" in doc["failed"][items[0][0].hex()][0]
    assert kvctl(env, "--store", address, "rm", "--prefix", "zz")[0] == 1   # not hex
    rc, doc, _ = kvctl(env, "--store", address, "rm", "--prefix", b"x-".hex())   # nothing left to match
    assert rc == 3 and not doc["success"] and doc["unmatched_prefixes"] == [b"x-".hex()], doc
    rc, doc, _ = kvctl(env, "--store", address, "demote", "--prefix", b"x-".hex(), b"y-".hex())
    assert rc == 3 and doc["unmatched_prefixes"] == [b"x-".hex()] and doc["demoted"] == [items[3][0].hex()]
    assert _keys(kvctl(env, "--store", address, "ls")[1]) == {items[3][0].hex()}


def test_nodes_without_redis_and_lookup(node):
    address, env, client = node
    rc, doc, err = kvctl(env, "--store", address, "nodes")
    assert rc == 0, err
    (n,) = doc["nodes"]
    assert n["node_id"] == "node-a" and n["address"] == address and n["health"] == "SERVING"
    assert [t["name"] for t in n["tiers"]] == ["dram", "ssd"] and n["draining"] is False

    tokens = list(range(10, 30))
    keys = block_keys(tokens, 4, KeyExtras(model="m", namespace="key-0123456789abcdef"))
    client.put_blocks([(k, b"kv" * 100) for k in keys[:3]], chain=True)
    client.pin(keys[:1], hard=True)
    rc, doc, err = kvctl(env, "--store", address, "lookup", "--tokens", ",".join(map(str, tokens)),
                         "--model", "m", "--block-size", "4", "--namespace", "key-0123456789abcdef")
    assert rc == 0, err
    assert [b["key"] for b in doc["blocks"]] == [k.hex() for k in keys]
    assert doc["held_prefix_blocks"] == 3
    assert doc["blocks"][0]["copies"] == [{"node": "node-a", "tiers": ["dram"], "size": 200, "pin": "hard",
                                           "namespace": ""}]
    assert doc["blocks"][3]["copies"] == []
    base = ("--store", address, "lookup", "--tokens", "1,2,3,4", "--model", "m")
    for layout, said in (('{"x": 1}', "missing dtype.*unknown x"), ("nope", "not JSON"), ("[1]", "got list")):
        rc, _, err = kvctl(env, *base, "--block-size", "4", "--layout", layout)
        assert rc == 1 and re.search(said, err) and "Traceback" not in err, err
    rc, _, err = kvctl(env, *base, "--block-size", "0")
    assert rc == 1 and "--block-size is tokens per block, >= 1; got 0" in err, err


def test_evicting_a_promoted_block_keeps_its_lower_copy_and_says_so(node):
    """A promoted block keeps its SSD copy; evicting it from DRAM leaves it served from SSD:
    'demoted' (still served), not 'dropped from the node' as the demotion counter said."""
    address, env, client = node
    key = block(7)
    assert all(r.ok for r in client.put_blocks([(key, os.urandom(BLOCK))]))
    for verb in ("demote", "promote"):
        rc, doc, err = kvctl(env, "--store", address, verb, key.hex())
        assert rc == 0, (verb, doc, err)
    assert kvctl(env, "--store", address, "inspect", key.hex())[1]["copies"][0]["tiers"] == ["dram", "ssd"]
    rc, doc, err = kvctl(env, "--store", address, "evict", "--tier", "dram", "--bytes", "256KiB")
    assert rc == 0, err
    assert doc["demoted"] == 1 and doc["dropped"] == 0
    assert kvctl(env, "--store", address, "inspect", key.hex())[1]["copies"][0]["tiers"] == ["ssd"]
