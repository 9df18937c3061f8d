"""kvctl commands on the cluster: ``nodes`` (the membership registry in Redis, or the one
``--store`` node without it) and ``drain`` (empty a node onto the others before scale-in)."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from kvstore.auth import STORE_TOKEN_ENV
from kvstore.cluster.membership import NodeInfo, RedisRegistry
from kvstore.errors import InvalidArgument, KVStoreError, Unauthenticated
from kvstore.kvctl.common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    Target,
    add_json,
    emit,
    mib,
    plural,
    size_text,
)

DRAIN_BATCH = 256            # blocks read, written and removed per step of a drain


@dataclass(frozen=True)
class NodeRef:
    """A node kvctl talks to; ``info``: its membership record (None without Redis)."""

    node_id: str
    address: str
    info: NodeInfo | None = None


def cluster_nodes(t: Target) -> list[NodeRef]:
    """The live nodes in the registry (``--redis``), else the ``--store`` node alone."""
    if t.redis_url:
        return [NodeRef(n.node_id, n.address, n) for n in registry_nodes(t.redis_url, t.token)]
    with t.store_client() as client:
        node_id, _ = client.stats()
    return [NodeRef(node_id, t.store)]


def registry_nodes(redis_url: str, token: str | None) -> list[NodeInfo]:
    """The nodes registered in the Redis at ``redis_url`` whose records are sealed under
    ``token``. Raises KVStoreError when the registry cannot be read, and Unauthenticated
    when it holds records and none is sealed under ``token`` — a wrong or stale token, not
    an empty cluster (an empty listing let ls, namespaces and flush report nothing done,
    exit 0)."""
    reg = RedisRegistry(redis_url, token)
    try:
        listed = reg.nodes()
    except Exception as exc:  # noqa: BLE001 - redis-py raises its own error types
        raise KVStoreError(f"membership registry (Redis): {exc}") from None
    finally:
        reg.close()
    if not listed and reg.unverified:
        raise Unauthenticated(
            f"UNAUTHENTICATED: the membership registry holds {plural(reg.unverified, 'node record')} and none is "
            f"sealed under the store token kvctl sends: it is wrong or stale (kvctl takes it from --token, then "
            f"{STORE_TOKEN_ENV}, then the stack's auth.env)")
    return listed


def pick_nodes(t: Target, which: str | None) -> list[NodeRef]:
    """``which`` (a node id or address) among the cluster's nodes, or all of them. Raises
    InvalidArgument naming the live nodes when it is none of them."""
    nodes = cluster_nodes(t)
    if not which:
        return nodes
    chosen = [n for n in nodes if which in (n.node_id, n.address)]
    if not chosen:
        raise InvalidArgument(f"no live node {which!r}; live: {', '.join(n.node_id for n in nodes) or 'none'}")
    return chosen


def _health(t: Target, address: str) -> str:
    try:
        with t.store_client(address, min(t.timeout_s, 3.0)) as c:
            return c.health()
    except KVStoreError as exc:
        return f"unreachable ({exc})"


def cmd_nodes(t: Target, args: argparse.Namespace) -> int:
    rows, docs = [], []
    for n in cluster_nodes(t):
        health = _health(t, n.address)
        tiers: list[dict[str, Any]]
        if n.info is not None:
            tiers = [{"name": a, "capacity_bytes": c, "used_bytes": u} for a, c, u in n.info.tiers]
            epoch, draining, free = n.info.epoch, n.info.draining, n.info.free_bytes
        else:
            with t.store_client(n.address) as c:
                tiers = [{"name": s.name, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes}
                         for s in c.stats()[1]]
            with t.admin_client(n.address) as admin:
                draining = bool(admin.stats()["draining"])
            epoch, free = 0, 0
        docs.append({"node_id": n.node_id, "address": n.address, "health": health, "epoch": epoch,
                     "draining": draining, "free_bytes": free, "tiers": tiers,
                     "registry": "redis" if n.info is not None else "none (one node, --store)"})
        use = ", ".join(f"{x['name']} {mib(x['used_bytes'])}/{mib(x['capacity_bytes'])}" for x in tiers)
        rows.append([n.node_id, n.address, use, health, "yes" if draining else "", epoch or "-"])
    text = tabulate(rows, headers=["node", "address", "tiers used/capacity MiB", "health", "draining", "epoch"])
    if not t.redis_url:
        text += "\n(no Redis given: the --store node alone; --redis URL or KVSTORE_REDIS_URL lists the cluster)"
    emit(args, {"nodes": docs}, text)
    return EXIT_OK


def _progress(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def _move_batch(t: Target, source: NodeRef, blocks: list[dict[str, Any]], targets: dict[str, list[Any]],
                failed: dict[str, str], placed: dict[str, str]) -> list[bytes]:
    """Copy ``blocks`` (ListBlocks entries) from ``source`` to the other nodes (re-pinning
    pinned ones there, keeping each block's namespace and chain parent); a block goes where
    its parent went (``placed``: key hex -> node id, filled in here) while that node has
    room, else to the roomiest. Returns the keys now safe to remove from ``source``."""
    keys = [bytes.fromhex(b["key"]) for b in blocks]
    with t.store_client(source.address) as src:
        data = src.get_blocks(keys)
    moved: list[bytes] = []
    for b, key, d in zip(blocks, keys, data):
        if d is None:
            failed[b["key"]] = "gone or unreadable on the source (evicted, or its checksum failed)"
            continue
        node_id = placed.get(b["parent"], "")
        if node_id not in targets or targets[node_id][1] < len(d):
            node_id = max(targets, key=lambda n: targets[n][1])
        client, _ = targets[node_id]
        try:
            r = client.put_blocks([(key, d)], parent=bytes.fromhex(b["parent"]) if b["parent"] else None,
                                  namespace=b["namespace"] or None)[0]
        except KVStoreError as exc:
            failed[b["key"]] = f"{node_id} refused it: {exc}"
            continue
        if not r.ok:
            failed[b["key"]] = f"{node_id} refused it: {r.error}"
            continue
        targets[node_id][1] -= len(d)
        placed[b["key"]] = node_id
        if b["pin"]:
            client.pin([key], hard=b["pin"] == "hard", ttl_s=max(1.0, b["pin_ttl_s"]) if b["pin"] == "soft" else None)
        moved.append(key)
    return moved


def cmd_drain(t: Target, args: argparse.Namespace) -> int:
    if not t.redis_url:
        raise InvalidArgument("drain moves blocks to the other nodes of a cluster: give --redis URL "
                              "(or KVSTORE_REDIS_URL) so kvctl finds them")
    nodes = cluster_nodes(t)
    source = next((n for n in nodes if args.node in (n.node_id, n.address)), None)
    if source is None:
        raise InvalidArgument(f"no live node {args.node!r}; live: {', '.join(n.node_id for n in nodes) or 'none'}")
    with t.admin_client(source.address) as admin:
        if args.cancel:
            admin.set_draining(False)
            emit(args, {"success": True, "node": source.node_id, "draining": False},
                 f"{source.node_id}: no longer draining; placement puts new blocks there again")
            return EXIT_OK
        others = [n for n in nodes if n.node_id != source.node_id and not (n.info and n.info.draining)]
        if not others:     # refused before the node is marked: a refused drain changes nothing
            raise InvalidArgument(f"{source.node_id} is the only node not draining: nowhere to move its blocks")
        admin.set_draining(True)
        _progress(args, f"{source.node_id}: draining (placement puts no new blocks there); moving its blocks to "
                        f"{', '.join(n.node_id for n in others)}")
        targets: dict[str, list[Any]] = {
            n.node_id: [t.store_client(n.address),
                        n.info.free_bytes if n.info else 0] for n in others}
        failed: dict[str, str] = {}
        placed: dict[str, str] = {}
        moved = moved_bytes = 0
        total = admin.list_blocks(limit=1)["matched"]
        t0 = time.monotonic()
        try:
            while True:
                listing = admin.list_blocks(limit=DRAIN_BATCH + len(failed))["blocks"]
                batch = [b for b in listing if b["key"] not in failed][:DRAIN_BATCH]
                if not batch:
                    break
                done = _move_batch(t, source, batch, targets, failed, placed)
                if done:
                    r = admin.keys_call("Remove", done)
                    for f in r["failed"]:
                        failed[f["key"]] = f"copied, but not removed from {source.node_id}: {f['reason']}"
                    moved += len(r["done"])
                    moved_bytes += r["freed_bytes"]
                _progress(args, f"  moved {moved} of {plural(total, 'block')} ({size_text(moved_bytes)}), "
                                f"{len(failed)} could not move, {time.monotonic() - t0:.1f} s")
        finally:
            for client, _ in targets.values():
                client.close()
        left = admin.list_blocks(limit=1)["matched"]
    success = not failed and left == 0
    lines = [(f"{source.node_id}: moved {plural(moved, 'block')} ({size_text(moved_bytes)}) to "
              f"{', '.join(targets)}; {left} left on it; it stays draining (kvctl drain {source.node_id} --cancel "
              f"takes new blocks again)")]
    lines += [f"  {k[:16]}: {why}" for k, why in sorted(failed.items())]
    emit(args, {"success": success, "node": source.node_id, "moved_blocks": moved, "moved_bytes": moved_bytes,
                "left_blocks": left, "failed": failed, "targets": list(targets), "draining": True}, "\n".join(lines))
    return EXIT_OK if success else EXIT_INCOMPLETE


def add_commands(sub: Any) -> None:
    p = sub.add_parser("nodes", help="the cluster's nodes: address, tiers, use, health, draining, epoch")
    add_json(p)
    p.set_defaults(func=cmd_nodes)
    p = sub.add_parser("drain", help="move a node's blocks to the other nodes and stop placing new ones on it")
    p.add_argument("node", metavar="NODE", help="node id or address")
    p.add_argument("--cancel", action="store_true", help="end draining: the node takes new blocks again")
    add_json(p)
    p.set_defaults(func=cmd_drain)
