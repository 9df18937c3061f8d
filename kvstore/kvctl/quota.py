"""kvctl commands on tenants: ``quota set|get|list|rm`` (hard per-namespace byte quotas,
enforced at put, kept in the node's data directory) and ``namespaces`` (per-tenant
accounting: bytes, blocks, hits, misses, quota evictions)."""
from __future__ import annotations

import argparse
from typing import Any

from tabulate import tabulate

from kvstore.errors import InvalidArgument
from kvstore.kvctl.cluster import pick_nodes
from kvstore.kvctl.common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    Target,
    add_json,
    bytes_flag,
    emit,
    mib,
    namespace_arg,
    size_text,
)


def cmd_quota(t: Target, args: argparse.Namespace) -> int:
    if args.action in ("set", "get", "rm") and not args.namespace:
        raise InvalidArgument(f"quota {args.action} needs --namespace N")
    if args.action == "set" and args.bytes is None:
        raise InvalidArgument("quota set needs --bytes B (e.g. 2GiB)")
    nbytes = bytes_flag(args.bytes, "a quota") if args.bytes is not None else 0
    docs: list[dict[str, Any]] = []
    lines: list[str] = []
    found_any = False
    for node in pick_nodes(t, args.node):
        with t.admin_client(node.address) as admin:
            if args.action == "list":
                quotas = admin.list_quotas()["quotas"]
                docs.append({"node": node.node_id, "quotas": quotas})
                lines.append(f"{node.node_id}:")
                lines.append(tabulate([[q["namespace"], q["bytes"], mib(q["bytes"]), mib(q["used_bytes"])]
                                       for q in quotas], headers=["namespace", "quota bytes", "quota MiB", "used MiB"],
                                       disable_numparse=True))
                found_any = True
                continue
            method = {"set": "SetQuota", "get": "GetQuota", "rm": "RemoveQuota"}[args.action]
            r = admin.quota(method, args.namespace, nbytes)
        docs.append({"node": node.node_id, **r})
        found_any = found_any or r["found"] or args.action == "set"
        ns = repr(args.namespace)
        if args.action == "set":
            was = f" (was {size_text(r['previous_bytes'])})" if r["found"] else " (had none)"
            lines.append(f"{node.node_id}: quota of {ns} set to {size_text(r['bytes'])}{was}; "
                         f"it holds {size_text(r['used_bytes'])}")
        elif args.action == "get":
            lines.append(f"{node.node_id}: {ns} " + (f"has a quota of {size_text(r['bytes'])}" if r["found"]
                                                     else "has no quota") + f"; holds {size_text(r['used_bytes'])}")
        else:
            lines.append(f"{node.node_id}: " + (f"removed the quota of {ns} ({size_text(r['bytes'])})"
                                               if r["found"] else f"{ns} had no quota; nothing removed"))
    emit(args, {"success": found_any, "action": args.action, "nodes": docs}, "\n".join(lines))
    return EXIT_OK if found_any else EXIT_INCOMPLETE


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def cmd_namespaces(t: Target, args: argparse.Namespace) -> int:
    docs, rows = [], []
    for node in pick_nodes(t, args.node):
        with t.admin_client(node.address) as admin:
            s = admin.stats()
        docs.append({"node": node.node_id, **s})
        for n in s["namespaces"]:
            lh, lm = int(n.get("lookup_hits", 0)), int(n.get("lookup_misses", 0))
            n["lookup_hit_ratio"] = lh / (lh + lm) if lh + lm else None
            n["read_success_ratio"] = n["hits"] / (n["hits"] + n["misses"]) if n["hits"] + n["misses"] else None
            rows.append([node.node_id, n["namespace"] or "-", n["blocks"], mib(n["bytes"]),
                         n["quota_bytes"] if n.get("quota_bytes") is not None else "", lh, lm,
                         _ratio(n["lookup_hit_ratio"]), n["hits"], n["misses"], _ratio(n["read_success_ratio"]),
                         n["evictions"], n["rejected_puts"]])
    emit(args, {"nodes": docs}, tabulate(rows, headers=[
        "node", "namespace", "blocks", "MiB", "quota bytes", "lookup hits", "lookup misses", "lookup hit ratio",
        "read hits", "read misses", "read success", "quota evictions", "rejected puts"]))
    return EXIT_OK


def add_commands(sub: Any) -> None:
    p = sub.add_parser("quota", help="per-tenant byte quotas: set, get, list, rm")
    p.add_argument("action", choices=["set", "get", "list", "rm"])
    p.add_argument("--namespace", type=namespace_arg,
                   help="the tenant's namespace (key-<16 hex> for an API key; see kvctl lookup)")
    p.add_argument("--bytes", help="quota set: the limit, e.g. 2GiB or 1073741824")
    p.add_argument("--node", help="a node id or address (default: every node; a quota is per node)")
    add_json(p)
    p.set_defaults(func=cmd_quota)
    p = sub.add_parser("namespaces", help="per-tenant accounting: blocks, bytes, lookup hit ratio (reuse), "
                                          "read success, quota evictions")
    p.add_argument("--node", help="a node id or address (default: every node)")
    add_json(p)
    p.set_defaults(func=cmd_namespaces)
