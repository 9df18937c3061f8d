"""vLLM's KV events in the router (scheduler/vllm/events.py): vLLM's own ZeroMQ publisher
(``vllm.distributed.kv_events.ZmqEventPublisher``) and a real vLLM server with its prefix
cache on, translated into the router's index replica under the connector's block keys."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

pytest.importorskip("vllm")

from engines.vllm.launch import VLLMServerSpec, ipc_endpoints, start_servers  # noqa: E402
from engines.vllm.layout import PagedLayout  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.events.channel import LocalEventChannel  # noqa: E402
from kvstore.events.replica import IndexReplica  # noqa: E402
from kvstore.index.keys import KVLayout  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402
from scheduler.vllm.events import VLLMEventBridge  # noqa: E402

ENGINE = "vllm-prefill-0"
BS = 4


def held(replica: IndexReplica, layout: PagedLayout, tokens: list[int], salt: str | None) -> tuple[str, ...]:
    """The tiers ENGINE holds of the prompt's longest cached prefix, as the router sees them."""
    return replica.match(layout.keys(tokens, salt)).per_node.get(ENGINE, ())


def wait_until(check, timeout_s: float = 10.0, poke=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        if poke is not None:
            poke()
        time.sleep(0.05)


@pytest.fixture
def wire(tmp_path):
    """(publish(events), bridge, replica, layout, publisher) over ipc sockets in a private
    directory: a vLLM publisher whose replay buffer holds 20 batches, and a started bridge."""
    import tempfile

    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    short = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")      # ours alone (0700), short enough for ipc
    pub_ep, replay_ep = ipc_endpoints(short, "p")
    publisher = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, buffer_steps=20)
    layout = PagedLayout("tiny", "r1", KVLayout(dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
                                                 block_size=BS))
    replica = IndexReplica(LocalEventChannel())
    bridge = VLLMEventBridge(ENGINE, pub_ep, layout, replica, replay_endpoint=replay_ep).start()

    def publish(*events) -> None:
        publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    # ZeroMQ drops what a PUB sends before the SUB has joined: send empty batches until one
    # arrives (the bridge then replays the ones it missed from the buffer).
    wait_until(lambda: bridge.stats.batches > 0, poke=publish)
    yield publish, bridge, replica, layout, publisher
    bridge.stop()
    publisher.shutdown()
    for name in os.listdir(short):
        os.unlink(os.path.join(short, name))
    os.rmdir(short)


def stored(hashes, tokens, parent=None, extra=None, **kw):
    from vllm.distributed.kv_events import BlockStored
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=kw.pop("bs", BS),
                       lora_id=None, medium=kw.pop("medium", "GPU"), lora_name=kw.pop("lora_name", None),
                       extra_keys=extra, **kw)


def removed(hashes, medium="GPU"):
    from vllm.distributed.kv_events import BlockRemoved
    return BlockRemoved(block_hashes=hashes, medium=medium)


def test_vllm_events_become_the_connectors_keys_per_tenant_and_removals_and_clears_apply(wire) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared
    publish, bridge, replica, layout, _ = wire
    prompt = list(range(100, 114))       # 3 full blocks of 4 and 2 tokens more
    publish(stored([b"h1" * 16, b"h2" * 16], prompt[:8], extra=[("alice",), None]))
    publish(stored([b"h3" * 16], prompt[8:12], parent=b"h2" * 16, extra=[None]))
    wait_until(lambda: len(held(replica, layout, prompt, "alice")) == 3)
    assert held(replica, layout, prompt, "alice") == ("hbm",) * 3
    assert held(replica, layout, prompt, "bob") == ()          # another tenant's keys: no hit
    assert held(replica, layout, prompt, None) == ()

    publish(stored([b"h3" * 16], prompt[8:12], parent=b"h2" * 16, extra=[None], medium="CPU"))
    publish(removed([b"h3" * 16]))                             # gone from HBM, still in vLLM's CPU tier
    wait_until(lambda: held(replica, layout, prompt, "alice") == ("hbm", "hbm", "dram"))
    publish(removed([b"h2" * 16]))
    wait_until(lambda: len(held(replica, layout, prompt, "alice")) == 1)

    # Blocks the connector's keys do not cover are skipped, never keyed as something else.
    skipped = bridge.stats.skipped
    other = list(range(500, 508))
    publish(stored([b"l1" * 16, b"l2" * 16], other, lora_name="adapter-a"),
            stored([b"m1" * 16], other[:4], extra=[("alice", ("mm-hash", 0))]),
            stored([b"x1" * 16], other, bs=8),                        # another block size
            stored([b"o1" * 16], other[4:8], parent=b"unknown" * 4))   # a parent it never saw
    wait_until(lambda: bridge.stats.skipped == skipped + 5)
    assert held(replica, layout, other, "alice") == () and held(replica, layout, other, None) == ()

    publish(AllBlocksCleared())
    wait_until(lambda: held(replica, layout, prompt, "alice") == ())
    assert bridge.stats.clears == 1 and bridge.stats.bad == 0


def test_the_connectors_events_put_the_pools_blocks_on_the_instances_pool_node_by_tier(wire) -> None:
    """Events as the connector makes them (engines/vllm/connector_events.py), through vLLM's
    publisher: the pool's blocks land on ``<engine>/pool`` under their own keys, by tier,
    without a parent the bridge saw; a loss takes the block off; a clear of the instance's
    hits clears its pool node too."""
    from vllm.distributed.kv_events import AllBlocksCleared

    from engines.vllm.connector_events import PoolEventBook
    from scheduler.vllm.pool_events import pool_node
    publish, bridge, replica, layout, _ = wire
    prompt = list(range(40, 56))                  # 4 blocks of 4
    keys = layout.keys(prompt, "alice")
    node = pool_node(ENGINE)
    book = PoolEventBook(BS)
    book.looked_up(keys, ("dram", "dram", "ssd"), prompt, "alice", None)   # another instance stored these
    publish(*book.take())
    wait_until(lambda: len(replica.match(keys).per_node.get(node, ())) == 3)
    assert replica.match(keys).per_node[node] == ("dram", "dram", "ssd")
    assert held(replica, layout, prompt, "alice") == ()     # not the instance's own cache
    book.looked_up(keys, ("dram",), prompt, "alice", None)  # the pool lost block 1
    publish(*book.take())
    # the bridge counts a removal once the replica applied it: wait for the count too
    wait_until(lambda: len(replica.match(keys).per_node.get(node, ())) == 1 and bridge.stats.removed >= 1)
    assert bridge.stats.removed == 1 and bridge.stats.bad == 0
    publish(AllBlocksCleared())
    wait_until(lambda: node not in replica.match(keys).per_node)


def sent(publisher) -> None:
    """Until vLLM's publisher thread has sent (and buffered) every batch handed to it."""
    wait_until(lambda: publisher._event_queue.unfinished_tasks == 0)


def test_a_lost_batch_is_replayed_and_one_the_replay_lost_drops_the_instances_hits(wire) -> None:
    publish, bridge, replica, layout, publisher = wire
    prompt = list(range(7, 19))
    keep = [b"k1" * 16, b"k2" * 16, b"k3" * 16]
    publish(stored(keep, prompt, extra=[("t",), None, None]))
    wait_until(lambda: len(held(replica, layout, prompt, "t")) == 3)

    bridge.stop()                         # two batches are published while nobody listens
    publish(removed([keep[2]]))
    publish()
    sent(publisher)
    bridge.start()
    wait_until(lambda: bridge.stats.replayed >= 2, poke=publish)
    assert held(replica, layout, prompt, "t") == ("hbm", "hbm")    # the lost removal was replayed
    assert bridge.stats.gaps >= 1 and bridge.stats.clears == 0

    bridge.stop()                         # 25 lost: the buffer (20 batches) cannot cover them
    publish(removed([keep[1]]))
    for _ in range(24):
        publish()
    sent(publisher)
    bridge.start()
    # the bridge counts a clear before it drops the hits: wait for the drop too
    wait_until(lambda: bridge.stats.clears == 1 and held(replica, layout, prompt, "t") == (), poke=publish)
    assert held(replica, layout, prompt, "t") == ()      # no stale hit: every one dropped
    publish(stored(keep[:1], prompt[:4], extra=[("t",)]))   # vLLM re-announces what it reuses
    wait_until(lambda: held(replica, layout, prompt, "t") == ("hbm",))


def test_a_restarted_instance_leaves_no_hit_of_the_old_one(tmp_path, wire) -> None:
    """The new instance's first batches are lost before the subscriber reconnects and its
    numbers can run past the old one's: the disconnect itself drops the old hits."""
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    publish, bridge, replica, layout, publisher = wire
    prompt = list(range(30, 38))
    for _ in range(8):
        publish()
    publish(stored([b"r1" * 16, b"r2" * 16], prompt, extra=[("t",), None]))
    wait_until(lambda: held(replica, layout, prompt, "t") == ("hbm", "hbm"))
    publisher.shutdown()
    publisher._pub.close(linger=0)   # what a stopped process does to its socket
    publisher._replay.close(linger=0)
    # the bridge counts a clear before it drops the hits: wait for the drop too
    wait_until(lambda: bridge.stats.clears == 1 and held(replica, layout, prompt, "t") == ())
    assert held(replica, layout, prompt, "t") == ()
    again = ZmqEventPublisher(0, endpoint=bridge.endpoint, replay_endpoint=bridge.replay_endpoint, buffer_steps=20)
    try:
        for _ in range(20):
            again.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: bridge.stats.batches > 0 and bridge.last_seq is not None and bridge.last_seq >= 19,
                   poke=lambda: again.publish(KVEventBatch(ts=time.time(), events=[])))
        assert held(replica, layout, prompt, "t") == ()
    finally:
        again.shutdown()


def test_only_what_the_connector_keys_alike_is_kept(wire) -> None:
    """Exactly the blocks the connector would key the same: extras after the first block
    (multimodal) end the run, another KV group, a token list that does not match its
    hashes (masked blocks), and a hash vLLM reuses for other tokens drops its old key;
    vLLM's offloading (CPU) events carry no salt, so they only add a tier to a known block."""
    publish, bridge, replica, layout, _ = wire
    a = list(range(200, 212))
    publish(stored([b"a1" * 16, b"a2" * 16, b"a3" * 16], a, extra=[("t",), None, ("mm", 0)]))
    wait_until(lambda: bridge.stats.skipped >= 1)
    assert held(replica, layout, a, "t") == ("hbm", "hbm")     # the third block had an image in it
    b = list(range(300, 308))
    publish(stored([b"b1" * 16, b"b2" * 16], b, extra=[("t",), None], group_idx=1),     # a sliding-window group
            stored([b"c1" * 16, b"c2" * 16], b[:4], extra=[("t",), None]))             # 2 hashes, 1 block of tokens
    wait_until(lambda: bridge.stats.skipped >= 5)
    assert held(replica, layout, b, "t") == ()
    publish(stored([b"a1" * 16], list(range(900, 904)), extra=[("t",)]))   # hash a1 now names other tokens
    # the old key's removal reaches the replica before the new key's store: wait for both
    wait_until(lambda: held(replica, layout, a, "t") == () and held(replica, layout, list(range(900, 904)), "t"))
    assert held(replica, layout, list(range(900, 904)), "t") == ("hbm",)
    publish(stored([b"a1" * 16], list(range(900, 904)), medium="CPU"),     # no extras: never keyed as "default"
            stored([b"zz" * 16], list(range(700, 704)), medium="CPU"))
    wait_until(lambda: bridge.stats.stored >= 4)
    publish(removed([b"a1" * 16]))
    wait_until(lambda: held(replica, layout, list(range(900, 904)), "t") == ("dram",))
    assert held(replica, layout, list(range(900, 904)), None) == ()
    assert held(replica, layout, list(range(700, 704)), None) == ()
    publish(removed([b"a1" * 16], medium="CPU"))
    wait_until(lambda: held(replica, layout, list(range(900, 904)), "t") == ())


def test_a_batch_that_cannot_be_applied_drops_the_hits_and_the_bridge_goes_on() -> None:
    """Fed by hand (no sockets: the seqs are the test's alone), batches that cannot be read
    or applied whole each drop the hits, the bridge's seq moves on (it never wedges
    replaying the bad batch), and the next good batch is applied."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    layout = PagedLayout("tiny", "r1", KVLayout(dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
                                                 block_size=BS))
    replica = IndexReplica(LocalEventChannel())
    bridge = VLLMEventBridge(ENGINE, "ipc:///nonexistent", layout, replica)
    prompt = list(range(4))
    good = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[stored([b"g1" * 16], prompt, extra=[("t",)])]))
    odd = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[stored([[1, 2]], prompt, extra=[("t",)])]))
    deep = b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 5000 + b"\x90"
    seq = 0
    bridge.receive(seq, good)
    assert held(replica, layout, prompt, "t") == ("hbm",)
    for garbage in (b"\xc1 not msgpack", b"\x93\x00\x01\xc0", b"\x81\x00\x00", deep, odd):
        clears = bridge.stats.clears
        seq += 1
        bridge.receive(seq, garbage)
        assert bridge.last_seq == seq and bridge.stats.clears == clears + 1, garbage[:8]   # never wedged
        assert held(replica, layout, prompt, "t") == ()
        seq += 1
        bridge.receive(seq, good)
        assert held(replica, layout, prompt, "t") == ("hbm",)
    assert bridge.stats.bad == 5
    bridge.receive(0, b"\x92\xcb" + b"\x00" * 8 + b"\x90")   # seq back to 0: the instance restarted
    assert bridge.last_seq == 0 and held(replica, layout, prompt, "t") == ()


def test_endpoints_and_paths_are_checked() -> None:
    from scheduler.vllm.router import _endpoints
    assert _endpoints("ipc:///tmp/a.sock,ipc:///tmp/b.sock") == ("ipc:///tmp/a.sock", "ipc:///tmp/b.sock")
    assert _endpoints("tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", None)
    for bad in ("", "http://x", "ipc:///a,ipc:///b,ipc:///c", "/tmp/a.sock"):
        with pytest.raises(InvalidArgument):
            _endpoints(bad)
    with pytest.raises(InvalidArgument, match="too long"):
        ipc_endpoints("/tmp/" + "d" * 120, "vllm-prefill-0")


def test_a_vllm_server_with_prefix_caching_shows_its_own_blocks_to_the_router(tmp_path, same_host_store) -> None:
    """A real vLLM (kv_both, its prefix cache on, KV events on a private ipc socket): after a
    prompt is served for tenant alice, the router sees the instance hold every full block
    of it under alice's keys, and none under bob's."""
    from engines.vllm.checkpoint import write_checkpoint
    from scheduler.vllm.instances import VLLMModel
    from scheduler.vllm.router import connect_vllm
    _, address = same_host_store
    model_dir = write_checkpoint(str(tmp_path / "tiny-llama"), "tiny", max_model_len=2048)
    import tempfile
    events_dir = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")
    endpoints = ipc_endpoints(events_dir, "c0")
    spec = VLLMServerSpec(model_dir, free_port(), "kv_both", address, kv_cache_bytes=32 << 20, max_model_len=2048,
                          prefix_caching=True, kv_events=endpoints)
    (server,) = start_servers([spec], tmp_path / "logs", ["c0"], timeout_s=300)
    model = VLLMModel.from_dir(model_dir)
    prompt = [(i * 37) % (model.vocab_size - 5) + 5 for i in range(100)]   # 3 full blocks of 32 tokens

    async def run() -> tuple[int, int, int, int]:
        router = await connect_vllm(model, (), (), address, topology="colocated", colocated_urls=[server.url],
                                    kv_events=[",".join(endpoints)])
        try:
            (engine_id,) = router.prefill
            assert router.cluster_view(router.prompt_keys(prompt, "alice")).prefill[0].hit.blocks == 0
            await router.prefill[engine_id].client.prefill("r1", prompt, "alice")
            deadline = time.monotonic() + 20
            while True:
                hit = router.cluster_view(router.prompt_keys(prompt, "alice")).prefill[0].hit.blocks
                if hit == 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            bob = router.cluster_view(router.prompt_keys(prompt, "bob")).prefill[0].hit.blocks
            (bridge,) = router.bridges
            # a prompt of no full block after one whose lookup found blocks in the pool: its
            # lookup finds nothing and is served (it once took the tiers of the lookup before)
            client = router.prefill[engine_id].client
            deadline = time.monotonic() + 20
            keys = router.prompt_keys(prompt, "alice")
            while (await asyncio.to_thread(router.store.lookup, keys, "probe")).blocks < 3:
                assert time.monotonic() < deadline, "the connector did not save the prompt's blocks"
                await asyncio.sleep(0.1)
            await client.prefill("r2", prompt[:99] + [7], "alice")
            short = await client.prefill("r3", prompt[:5], "alice")
            assert short.cached_tokens == 0
            return hit, bob, bridge.stats.stored, bridge.stats.bad
        finally:
            await router.close()

    try:
        hit, bob, stored_blocks, bad = asyncio.run(run())
    finally:
        server.stop(grace_s=10)
        for name in os.listdir(events_dir):
            os.unlink(os.path.join(events_dir, name))
        os.rmdir(events_dir)
    assert hit == 3, f"the router saw {hit} of the prompt's 3 blocks on the instance ({stored_blocks} stored)"
    assert bob == 0
    assert bad == 0
