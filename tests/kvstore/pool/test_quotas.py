"""Per-tenant quotas and accounting (kvstore/pool/tenants.py, kvstore/pool/quotas.py): a tenant over
its quota evicts only its own blocks (never another tenant's), a put it cannot make room
for is refused naming the quota (RESOURCE_EXHAUSTED over gRPC), quotas persist in the
node's data dir and survive a restart, and kvctl quota/namespaces drive them."""
from __future__ import annotations

import json
import os
import random

import pytest

from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, QuotaExceeded
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.pool.quotas import QuotaStore
from kvstore.pool.tenants import attach, namespace_stats
from tests.helpers.kvctl_helpers import TOKEN, block, kvctl, kvctl_env

BLOCK = 16 << 10


@pytest.fixture
def pool(make_dram, make_ssd):
    p = KVPool([make_dram(2 << 20), make_ssd(8 << 20)], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    yield p
    p.close()


def _owners(pool):
    books = pool._place.tenants
    return {k: books.namespace_of(k) for book in pool._place.books for k in book.blocks}


def test_a_quotad_tenant_never_evicts_another_tenants_blocks(pool):
    books = attach(pool)
    books.quotas.set("small", 10 * BLOCK)
    others = [block(i, b"other") for i in range(40)]
    for key in others:
        assert pool.put(key, os.urandom(BLOCK), namespace="other").ok
    rng = random.Random(7)
    for i in range(300):     # far more than its quota, with reads between, some of them pinned
        key = block(i, b"small")
        assert pool.put(key, os.urandom(BLOCK), namespace="small").ok
        if rng.random() < 0.3:
            pool.get(block(rng.randrange(i + 1), b"small"))
        if i % 50 == 0:
            pool.pin([key], ttl_s=600)
        stats = namespace_stats(pool)
        assert stats["small"].bytes <= 10 * BLOCK
        assert all(pool.contains(k) for k in others), f"put {i} of 'small' took another tenant's block"
    pool.check_integrity()
    stats = namespace_stats(pool)
    assert stats["other"].blocks == 40 and stats["other"].evictions == 0
    assert stats["small"].blocks == 10 and stats["small"].evictions == 290 and stats["small"].quota_bytes == 10 * BLOCK
    assert sum(stats["small"].tier_bytes.values()) == 10 * BLOCK
    assert set(_owners(pool).values()) == {"small", "other"}
    # The pinned ones were never the victims.
    assert all(pool.contains(block(i, b"small")) for i in range(0, 300, 50))


def test_a_put_it_cannot_make_room_for_is_refused_naming_the_quota(pool):
    books = attach(pool)
    books.quotas.set("t", 2 * BLOCK)
    keys = [block(i) for i in range(3)]
    for key in keys[:2]:
        assert pool.put(key, os.urandom(BLOCK), namespace="t").ok
    pool.pin(keys[:2], hard=True)
    with pytest.raises(QuotaExceeded, match=r"namespace 't' is at its quota of 32768 bytes"):
        pool.reserve(keys[2], BLOCK, namespace="t")
    r = pool.put(keys[2], os.urandom(BLOCK), namespace="t")
    assert not r.ok and "quota" in r.error and not pool.contains(keys[2])
    with pytest.raises(QuotaExceeded, match="exceeds its quota"):
        pool.reserve(block(9), 3 * BLOCK, namespace="t")
    assert namespace_stats(pool)["t"].rejected_puts == 3
    assert pool.put(keys[2], os.urandom(BLOCK)).ok          # unattributed: no quota
    assert namespace_stats(pool)[""].blocks == 1
    pool.check_integrity()


def test_a_block_counts_the_pages_it_takes_so_tiny_blocks_cannot_outrun_a_quota(pool):
    """A quota charges a block its whole 4 KiB pages (what it takes of the DRAM slab): a
    quota of 0 refuses even an empty block, and one-byte blocks under a 16,000-byte quota
    are held three at a time (3 pages), not 16,000."""
    books = attach(pool)
    books.quotas.set("zero", 0)
    with pytest.raises(QuotaExceeded, match="a block taking 4096 bytes"):
        pool.reserve(block(1, b"zero"), 0, namespace="zero")
    assert not pool.put(block(2, b"zero"), b"", namespace="zero").ok and not pool.contains(block(2, b"zero"))
    books.quotas.set("tiny", 16000)
    for i in range(50):
        assert pool.put(block(i, b"tiny"), b"x", namespace="tiny").ok
    stats = namespace_stats(pool)["tiny"]
    assert (stats.blocks, stats.bytes, stats.evictions) == (3, 3 * 4096, 47)
    assert pool.stats()[0].used_bytes == 3 * 4096      # the slab's pages, as the quota counts them
    pool.check_integrity()


def test_a_put_its_pinned_blocks_leave_no_room_for_evicts_nothing(pool):
    """A hard-pinned block of 4 BLOCKs and two small ones under a 6-BLOCK quota: a 4-BLOCK
    put cannot fit whatever is evicted, so it is refused before either small one goes."""
    books = attach(pool)
    books.quotas.set("t", 6 * BLOCK)
    big = block(0, b"big")
    assert pool.put(big, os.urandom(4 * BLOCK), namespace="t").ok
    pool.pin([big], hard=True)
    small = [block(i, b"small") for i in range(1, 3)]
    for key in small:
        assert pool.put(key, os.urandom(BLOCK), namespace="t").ok
    with pytest.raises(QuotaExceeded, match="would not make room.*nothing was evicted"):
        pool.reserve(block(9), 4 * BLOCK, namespace="t")
    stats = namespace_stats(pool)["t"]
    assert all(pool.contains(k) for k in small) and stats.evictions == 0 and stats.rejected_puts == 1
    assert pool.put(block(10), os.urandom(2 * BLOCK), namespace="t").ok    # room made by evicting: still served
    assert namespace_stats(pool)["t"].evictions == 2 and pool.contains(big)
    pool.check_integrity()


def test_hits_misses_and_pending_bytes(pool):
    books = attach(pool)
    books.quotas.set("t", 4 * BLOCK)
    keys = [block(i) for i in range(6)]
    for key in keys:
        pool.put(key, os.urandom(BLOCK), namespace="t")      # the first two are evicted for the last two
    assert [pool.get(k) is not None for k in keys] == [False, False, True, True, True, True]
    s = namespace_stats(pool)["t"]
    assert (s.hits, s.misses, s.blocks, s.evictions) == (4, 2, 4, 2)
    pool.get(block(99))
    assert namespace_stats(pool)[""].misses == 1               # no one held it
    res = pool.reserve(block(50), BLOCK, namespace="t")        # in flight: counts toward the quota
    assert books.pending_of("t") == BLOCK
    pool.abort(res)
    assert books.pending_of("t") == 0


def test_quota_file_persists_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "n" / "quotas.json"
    q = QuotaStore(str(path))
    assert q.set("key-a", 1 << 20) is None and q.set("key-a", 2 << 20) == 1 << 20
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert json.loads(path.read_text()) == {"version": 1, "quotas": {"key-a": 2 << 20}}
    assert QuotaStore(str(path)).get("key-a") == 2 << 20
    assert q.remove("key-a") == 2 << 20 and QuotaStore(str(path)).all() == {}
    with pytest.raises(InvalidArgument):
        q.set("", 5)
    with pytest.raises(InvalidArgument):
        q.set("x", -1)
    path.write_text('{"version": 1, "quotas": {"a": "lots"}}')
    with pytest.raises(InvalidArgument, match="not a version-1 quota file"):
        QuotaStore(str(path))


def test_kvctl_quota_over_grpc_and_across_a_restart(spawn_store_node, tmp_path):
    flags = ("--dram", "4MiB", "--ssd", "0", "--auth-token", TOKEN, "--transfer-engine", "off")
    proc, address = spawn_store_node("qnode", *flags)
    env = kvctl_env(tmp_path)
    rc, doc, err = kvctl(env, "--store", address, "quota", "set", "--namespace", "key-q", "--bytes", "32KiB")
    assert rc == 0, err
    assert doc["nodes"][0]["bytes"] == 32768 and doc["nodes"][0]["found"] is False
    with StoreClient(address, auth_token=TOKEN, data_path="grpc") as c:
        assert all(r.ok for r in c.put_blocks([(block(i), os.urandom(BLOCK)) for i in range(2)], namespace="key-q"))
        assert c.put_blocks([(block(0, b"o"), os.urandom(BLOCK))], namespace="key-o")[0].ok
        assert c.pin([block(0), block(1)], hard=True) == 2
        with pytest.raises(QuotaExceeded, match="'key-q' is at its quota of 32768 bytes"):
            c.put_blocks([(block(2), os.urandom(BLOCK))], namespace="key-q")
    rc, doc, _ = kvctl(env, "--store", address, "namespaces")
    by = {n["namespace"]: n for n in doc["nodes"][0]["namespaces"]}
    assert by["key-q"]["bytes"] == 2 * BLOCK and by["key-q"]["rejected_puts"] == 1 and by["key-o"]["blocks"] == 1
    rc, doc, _ = kvctl(env, "--store", address, "quota", "list")
    assert rc == 0 and [(q["namespace"], q["bytes"], q["used_bytes"]) for q in doc["nodes"][0]["quotas"]] == [
        ("key-q", 32768, 2 * BLOCK)]

    proc.terminate()
    proc.wait(timeout=20)
    _, address = spawn_store_node("qnode", *flags)                 # same data dir
    rc, doc, _ = kvctl(env, "--store", address, "quota", "get", "--namespace", "key-q")
    assert rc == 0 and doc["nodes"][0]["found"] and doc["nodes"][0]["bytes"] == 32768
    rc, doc, _ = kvctl(env, "--store", address, "quota", "rm", "--namespace", "key-q")
    assert rc == 0 and doc["nodes"][0]["found"]
    rc, doc, _ = kvctl(env, "--store", address, "quota", "get", "--namespace", "key-q")
    assert rc == 3 and not doc["success"]
    assert kvctl(env, "--store", address, "quota", "set", "--namespace", "key-q")[0] == 1    # no --bytes


def test_kvctl_quota_sizes_are_exact_and_bounded(spawn_store_node, tmp_path):
    """A size goes to the node exactly (it went through float: 2**64 - 1 became 2**64 and
    protobuf refused it with "Value out of range"); over the Admin API's uint64 is exit 1
    naming --bytes; a quota of 0 is kept as 0."""
    _, address = spawn_store_node("qbig", "--dram", "4MiB", "--ssd", "0", "--auth-token", TOKEN,
                                  "--transfer-engine", "off")
    env = kvctl_env(tmp_path)
    for text, want in (("18446744073709551615", (1 << 64) - 1), ("9007199254740993", (1 << 53) + 1),
                       ("1.5KiB", 1536), ("0", 0)):
        rc, doc, err = kvctl(env, "--store", address, "quota", "set", "--namespace", "key-big", "--bytes", text)
        assert rc == 0, err
        rc, doc, err = kvctl(env, "--store", address, "quota", "get", "--namespace", "key-big")
        assert rc == 0 and doc["nodes"][0]["found"] and doc["nodes"][0]["bytes"] == want, (text, doc, err)
    rc, _, err = kvctl(env, "--store", address, "quota", "set", "--namespace", "key-big", "--bytes",
                       "18446744073709551616")
    assert rc == 1 and "--bytes" in err and "2**64 - 1" in err, err
    with StoreClient(address, auth_token=TOKEN, data_path="grpc") as c:       # a tenant without a quota
        assert c.put_blocks([(block(0, b"f"), os.urandom(BLOCK))], namespace="key-free")[0].ok
    assert kvctl(env, "--store", address, "quota", "set", "--namespace", "key-small", "--bytes", "50KiB")[0] == 0
    rc, doc, _ = kvctl(env, "--store", address, "namespaces")        # 0 is a quota, not "none"
    by = {n["namespace"]: n for n in doc["nodes"][0]["namespaces"]}
    assert rc == 0 and by["key-big"]["quota_bytes"] == 0 and "quota_bytes" not in by["key-free"], by
    rc, text, err = kvctl(env, "--store", address, "namespaces", json_out=False)
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("qbig")}
    assert rc == 0 and len(rows["key-big"]) == len(rows["key-free"]) + 1, (text, err)   # its quota column
    assert "51200" in rows["key-small"], text                       # exact bytes: a small quota is not "0"


def test_a_tenants_ssd_blocks_stay_its_own_across_a_restart(make_dram, make_ssd, caplog):
    """The SSD tier records each block's tenant with it (its ``owners`` table), whether put
    there or demoted there from DRAM; a reopened node's books give them back to it. A damaged
    record makes its block unattributed, with a log line, never a crash."""
    import lmdb
    pool = KVPool([make_dram(4 * BLOCK), make_ssd(64 * BLOCK)], settings=PoolSettings(high_watermark=1.0,
                                                                                      low_watermark=1.0))
    attach(pool)
    direct = [block(i, b"direct") for i in range(3)]
    for key in direct:
        assert pool.put(key, os.urandom(BLOCK), tier="ssd", namespace="key-ssd").ok
    demoted = [block(i, b"demoted") for i in range(8)]   # DRAM holds 4: the oldest go down to SSD
    for key in demoted:
        assert pool.put(key, os.urandom(BLOCK), namespace="key-dram").ok
    plain = block(0, b"plain")
    assert pool.put(plain, os.urandom(BLOCK), tier="ssd").ok
    pool.evict("dram", 4 * BLOCK)                        # the rest of DRAM too
    assert all(pool._place.find(k) is not None for k in demoted)   # on SSD now (read back below)
    path = pool.tiers[1].path
    pool.close()

    with lmdb.open(path, max_dbs=3) as env:              # damage two records
        owners = env.open_db(b"owners")
        with env.begin(write=True, db=owners) as txn:
            assert bytes(txn.get(direct[0])) == b"key-ssd" and txn.get(plain) is None
            txn.put(direct[1], b"\xff\xfe")
            txn.put(direct[2], b"tab\there")
    again = KVPool([make_ssd(64 * BLOCK)])
    with caplog.at_level("WARNING", logger="kvstore.tiers.ssd"):
        books = attach(again)
    assert "2 blocks have a damaged tenant record" in caplog.text
    assert [books.namespace_of(k) for k in direct] == ["key-ssd", "", ""]
    assert {books.namespace_of(k) for k in demoted} == {"key-dram"} and books.namespace_of(plain) == ""
    stats = namespace_stats(again)
    assert (stats["key-dram"].blocks, stats["key-ssd"].blocks, stats[""].blocks) == (8, 1, 3)
    again.close()


def test_a_block_is_its_committing_writers_even_when_another_tenant_reserved_it_first(store_node):
    """Tenant A's Put of a key stops mid-block (its reservation open, then cancelled) while
    tenant B puts the same key whole: the block is B's, so A's quota never evicts it and B's
    books count it (it was booked to A, who never stored it, and A's next put under its quota
    evicted B's block)."""
    import threading
    import time

    import grpc

    from kvstore.integrity import checksum_of
    from protos import kvstore_pb2 as pb
    from protos import kvstore_pb2_grpc as pb_grpc

    pool, address = store_node
    books = attach(pool)
    books.quotas.set("tenant-a", BLOCK)
    shared, data = block(1, b"shared"), os.urandom(BLOCK)
    stop = threading.Event()

    def stalled():      # A: the header and half the bytes, then nothing until cancelled
        yield pb.PutChunk(key=shared, size=BLOCK, checksum=checksum_of(data), data=data[:BLOCK // 2])
        stop.wait(10)

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        a_call = stub.Put.future(stalled(), metadata=[("kvstore-namespace", "tenant-a")])
        deadline = time.monotonic() + 5
        while not any(s.reserved_bytes for s in pool.stats()):
            assert time.monotonic() < deadline, "A's reservation never opened"
            time.sleep(0.01)
        b = stub.Put(iter([pb.PutChunk(key=shared, size=BLOCK, checksum=checksum_of(data), data=data)]),
                     metadata=[("kvstore-namespace", "tenant-b")])
        assert b.results[0].ok and not b.results[0].existed
        a_call.cancel()
        stop.set()
        assert books.namespace_of(shared) == "tenant-b"
        own = block(2, b"a-own")   # A at its quota of one block: evicts its own only
        a = stub.Put(iter([pb.PutChunk(key=own, size=BLOCK, checksum=checksum_of(data), data=data)]),
                     metadata=[("kvstore-namespace", "tenant-a")])
        assert a.results[0].ok
    assert pool.contains(shared) and pool.get(shared) == data
    stats = namespace_stats(pool)
    assert stats["tenant-b"].blocks == 1 and stats["tenant-a"].blocks == 1 and stats["tenant-a"].evictions == 0
    pool.check_integrity()


def test_namespaces_holding_nothing_are_forgotten_not_kept_forever(pool):
    """A client naming a namespace per request: once their blocks are gone, the books (and
    /metrics, which reads them) keep at most about IDLE_NAMESPACES namespaces, while every
    namespace that holds a block, or has a quota, stays with its figures."""
    from prometheus_client import generate_latest

    from kvstore.metrics import StoreMetrics
    from kvstore.pool.tenants import IDLE_NAMESPACES

    attach(pool)
    pool._place.tenants.quotas.set("quotad", 1 << 20)
    kept = block(0, b"keep")
    assert pool.put(kept, os.urandom(BLOCK), namespace="keeper").ok
    n = 3 * IDLE_NAMESPACES
    for i in range(n):
        key = block(i, b"req")
        assert pool.put(key, b"x" * 64, namespace=f"req-{i}").ok
        assert pool.get(key) is not None
        assert pool.remove(key) > 0
    stats = namespace_stats(pool)
    assert len(stats) <= 2 * IDLE_NAMESPACES + 3, len(stats)
    assert stats["keeper"].blocks == 1 and stats["quotad"].quota_bytes == 1 << 20
    assert f"req-{n - 1}" in stats                    # the newest are still there
    text = generate_latest(StoreMetrics(pool).registry).decode()
    assert text.count('namespace="req-') <= 16 * IDLE_NAMESPACES
    assert 'namespace="keeper"' in text
