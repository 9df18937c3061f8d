"""Who holds which blocks, as the live router sees it: the store's own index, replicated from
KV events (:class:`kvstore.events.IndexReplica`), no guess.

Every store node publishes each copy it takes or drops (tiers ``dram``/``ssd``/``hbm``), and
every prefill engine publishes its own device cache (tier ``hbm``,
:class:`engines.local_cache.LocalBlockCache`), to one channel — the Redis Stream given by
``--kv-events`` (``kvstore up`` starts a private Redis for it). The router's replica applies
them in each node's order; a lost event (a sequence gap, a replica that started late) makes
it fetch that node's snapshot — ``Snapshot`` on the store node's or the engine's gRPC API —
and go on from there; an engine or node that restarts opens a new epoch with
``NodeCleared``, dropping what it held.

:func:`split_hits` turns one replica lookup into the decision API's inputs: per prefill
instance its own hit by tier, and the pool's hit (the store node holding the longest prefix).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Mapping

from engines.client import engine_snapshot
from kvstore.events.channel import make_channel
from kvstore.events.event import NodeSnapshot
from kvstore.events.replica import IndexReplica
from kvstore.index.prefix_index import PrefixMatch
from scheduler.policy.views import NO_HIT, TierHit

log = logging.getLogger(__name__)
StoreAddress = Callable[[str], "str | None"]


def snapshot_source(engines: Mapping[str, str], engine_token: str | None, stores: StoreAddress,
                    store_token: str | None) -> Callable[[str], NodeSnapshot]:
    """Node id → its snapshot: an engine's (``engines``: engine id → host:port) over the
    engine API, else a store node's (``stores(node)``: its host:port or None, asked each
    time so that a node that joined later is found). Raises KeyError for a node neither
    knows, or Unavailable/KVStoreError from the call; the replica then drops the node and
    retries."""
    from kvstore.client import StoreClient

    def fetch(node: str) -> NodeSnapshot:
        if node in engines:
            return engine_snapshot(engines[node], engine_token)
        address = stores(node)
        if address is None:
            raise KeyError(f"no address known for node {node!r} (not an engine, not a registered store node)")
        client = StoreClient(address, auth_token=store_token, timeout_s=10.0)
        try:
            snap = client.snapshot()
        finally:
            client.close()
        if snap.node != node:
            raise KeyError(f"store node at {address} is {snap.node!r}, not {node!r}")
        return snap
    return fetch


def store_address_of(store: object, address: str | None) -> StoreAddress:
    """Node id → address of a store node, asked when its snapshot is needed: a cluster's
    registered member (``store`` a :class:`kvstore.cluster.client.ClusterClient`), else the
    one node at ``address`` (the snapshot then checks that it is that node)."""
    from kvstore.cluster.client import ClusterClient

    def find(node: str) -> str | None:
        if isinstance(store, ClusterClient):
            return next((n.address for n in store.nodes() if n.node_id == node), None)
        return address
    return find


def start_replica(redis_url: str, engines: Mapping[str, str], engine_token: str | None,
                  stores: StoreAddress, store_token: str | None) -> IndexReplica:
    """A running replica of every node publishing to the Redis Stream at ``redis_url`` (read
    from its oldest kept event, so what was published before the router started counts)."""
    replica = IndexReplica(make_channel(redis_url, token=store_token),   # entries sealed with the store token
                           snapshot_source(engines, engine_token, stores, store_token))
    log.info("index replica over KV events in %s (%d engines)", replica.channel.description, len(engines))
    return replica.start()


def split_hits(match: PrefixMatch, engine_ids: Iterable[str],
               ignored: Container[str] = ()) -> tuple[dict[str, TierHit], TierHit]:
    """(engine id → its own hit by tier, the pool's hit) from one replica lookup: the pool is
    every node that is not an engine, and its hit the longest of theirs (a read fetches a
    prefix from one node); a node in ``ignored`` counts for neither."""
    engines = set(engine_ids)
    own: dict[str, TierHit] = {}
    pool: tuple[str, ...] = ()
    for node, tiers in match.per_node.items():
        if node in ignored:
            continue
        if node in engines:
            own[node] = TierHit.from_tiers(tiers)
        elif len(tiers) > len(pool):
            pool = tiers
    return own, TierHit.from_tiers(pool) if pool else NO_HIT
