"""kvctl commands on blocks: ``ls``, ``inspect``, ``rm``, ``flush``, ``demote``,
``promote`` (the store's Admin API, store token only)."""
from __future__ import annotations

import argparse
from typing import Any

from tabulate import tabulate

from kvstore.errors import InvalidArgument
from kvstore.kvctl.cluster import NodeRef, pick_nodes
from kvstore.kvctl.common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    Target,
    add_json,
    emit,
    list_limit,
    namespace_arg,
    parse_keys,
    plural,
    size_text,
)


def _short(key_hex: str) -> str:
    return key_hex[:16]


def _pin_text(b: dict[str, Any]) -> str:
    return "hard" if b["pin"] == "hard" else (f"soft {b['pin_ttl_s']:.0f}s" if b["pin"] == "soft" else "")


def cmd_ls(t: Target, args: argparse.Namespace) -> int:
    nodes = pick_nodes(t, args.node)
    out: list[dict[str, Any]] = []
    matched = 0
    for node in nodes:
        left = args.limit - len(out) if args.limit else 0
        full = args.limit and left <= 0   # still asked, for its count of matches (one block, dropped)
        with t.admin_client(node.address) as admin:
            r = admin.list_blocks(args.tier, args.namespace, args.key_prefix or "", 1 if full else left)
        matched += r["matched"]
        if not full:
            out += [{"node": node.node_id, **b} for b in r["blocks"]]
    rows = [[b["key"] if args.full_keys else _short(b["key"]), b["node"], ",".join(b["tiers"]), b["size"],
             b["namespace"] or "-", _pin_text(b), "yes" if b["leased"] else ""] for b in out]
    text = tabulate(rows, headers=["key", "node", "tiers", "bytes", "namespace", "pin", "leased"])
    text += f"\n{len(out)} of {plural(matched, 'matching block')} on {plural(len(nodes), 'node')}"
    emit(args, {"blocks": out, "listed": len(out), "matched": matched, "nodes": [n.node_id for n in nodes]}, text)
    return EXIT_OK


def _whole_key(t: Target, nodes: list[NodeRef], text: str) -> bytes | None:
    """The block key ``text`` names: itself when whole (64 or 32 hex digits), else the one
    key on ``nodes`` that starts with it (what ``ls`` prints is its first 16 digits); None
    when no block's does. Raises InvalidArgument when it is not hex or several keys start
    with it."""
    if len(text) in (32, 64) or not text or any(c not in "0123456789abcdefABCDEF" for c in text):
        return parse_keys([text])[0]
    keys: set[str] = set()
    for node in nodes:
        with t.admin_client(node.address) as admin:
            keys.update(b["key"] for b in admin.list_blocks(key_prefix=text.lower(), limit=2)["blocks"])
    if len(keys) > 1:
        raise InvalidArgument(f"{len(keys)}+ block keys start with {text!r} ({', '.join(sorted(keys)[:2])}, ...): "
                              "give more of the key (kvctl ls --full-keys prints whole keys)")
    return bytes.fromhex(keys.pop()) if keys else None


def cmd_inspect(t: Target, args: argparse.Namespace) -> int:
    nodes = pick_nodes(t, args.node)
    whole = _whole_key(t, nodes, args.key)
    if whole is None:
        text = f"no block key starts with {args.key} on {', '.join(n.node_id for n in nodes)}"
        emit(args, {"success": False, "key": args.key.lower(), "found": False, "copies": []}, text)
        return EXIT_INCOMPLETE
    key = whole
    found: list[dict[str, Any]] = []
    for node in nodes:
        with t.admin_client(node.address) as admin:
            r = admin.inspect(key)
        if r["found"]:
            found.append({"node": node.node_id, **r["block"]})
    lines = [f"block {key.hex()}"]
    for b in found:
        lines.append(f"  on {b['node']}: {b['size']:,} bytes in {', '.join(b['tiers'])}; namespace "
                     f"{b['namespace'] or '- (unattributed)'}; pin {_pin_text(b) or 'none'}; "
                     f"{'leased now' if b['leased'] else 'not leased'}; parent {b['parent'] or '-'}; "
                     f"checksum {b['checksum']:016x}")
    if not found:
        lines.append(f"  not held on {', '.join(n.node_id for n in nodes)}")
    emit(args, {"success": bool(found), "key": key.hex(), "found": bool(found), "copies": found}, "\n".join(lines))
    return EXIT_OK if found else EXIT_INCOMPLETE


def _keys_command(t: Target, args: argparse.Namespace, method: str, verb: str) -> int:
    if args.prefix:
        keys, prefixes = [], list(args.keys)
        if any(not p for p in prefixes):
            raise InvalidArgument("an empty key prefix would match every block; use kvctl flush")
    else:
        keys, prefixes = parse_keys(args.keys), []
    per_node: list[dict[str, Any]] = []
    done: set[str] = set()
    failures: dict[str, list[str]] = {}
    freed = 0
    for node in pick_nodes(t, args.node):
        with t.admin_client(node.address) as admin:
            r = admin.keys_call(method, keys, prefixes)
        per_node.append({"node": node.node_id, **r})
        done.update(r["done"])
        freed += r["freed_bytes"]
        for f in r["failed"]:
            failures.setdefault(f["key"], []).append(f"{node.node_id}: {f['reason']}")
    asked = {k.hex() for k in keys}
    # A key is left undone only when no node did it (it is on one node of a cluster at most, usually).
    failed = {k: why for k, why in failures.items() if k not in done and (not asked or k in asked)}
    # A prefix no block starts with is left undone as a key not held is (exit 3 either way).
    seen = done | set(failures)
    unmatched = [p for p in prefixes if not any(k.startswith(p.lower()) for k in seen)]
    lines = [f"{verb} {plural(len(done), 'block')}" + (f", {size_text(freed)} freed" if method == "Remove" else "")]
    lines += [f"  {_short(k)}: not {verb}: {'; '.join(why)}" for k, why in sorted(failed.items())]
    lines += [f"  no block starts with {p}" for p in unmatched]
    ok = not failed and not unmatched
    emit(args, {"success": ok, verb: sorted(done), "freed_bytes": freed,
                "failed": {k: why for k, why in sorted(failed.items())}, "unmatched_prefixes": unmatched,
                "nodes": per_node}, "\n".join(lines))
    return EXIT_OK if ok else EXIT_INCOMPLETE


def cmd_rm(t: Target, args: argparse.Namespace) -> int:
    return _keys_command(t, args, "Remove", "removed")


def cmd_demote(t: Target, args: argparse.Namespace) -> int:
    return _keys_command(t, args, "Demote", "demoted")


def cmd_promote(t: Target, args: argparse.Namespace) -> int:
    return _keys_command(t, args, "Promote", "promoted")


def cmd_flush(t: Target, args: argparse.Namespace) -> int:
    nodes = pick_nodes(t, args.node)
    reports = []
    for node in nodes:
        with t.admin_client(node.address) as admin:
            reports.append({"node": node.node_id, **admin.flush(args.tier, args.namespace, args.force)})
    left: dict[str, int] = {}
    for r in reports:
        for reason, n in r["left"].items():
            left[reason] = left.get(reason, 0) + n
    success = all(r["success"] for r in reports)
    scope = f" of namespace {args.namespace!r}" if args.namespace is not None else ""
    lines = [f"{r['node']}: reset {', '.join(r['tiers'])}: dropped {plural(r['dropped_blocks'], 'block')}{scope}, "
             f"{size_text(r['freed_bytes'])}" for r in reports]
    if not success:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(left.items()))
        hint = "; unpin them or give --force" if any("pinned" in k for k in left) else ""
        lines.append(f"not flushed: {plural(sum(left.values()), 'block')} left behind ({why}){hint}")
    emit(args, {"success": success, "left_blocks": sum(left.values()), "left": left,
                "reason": "" if success else "blocks left behind: " + ", ".join(f"{n} {r}" for r, n in left.items()),
                "nodes": reports}, "\n".join(lines))
    return EXIT_OK if success else EXIT_INCOMPLETE


def add_commands(sub: Any) -> None:
    node_help = "a node id or address (default: every node of the cluster, or --store)"
    p = sub.add_parser("ls", help="list blocks: key, node, tiers, size, namespace, pin, lease")
    p.add_argument("--node", help=node_help)
    p.add_argument("--tier", help="only blocks with a copy in this tier")
    p.add_argument("--namespace", type=namespace_arg,
                   help="only this tenant's blocks ('' : those put without a namespace)")
    p.add_argument("--key-prefix", metavar="HEX", help="only keys starting with these hex digits")
    p.add_argument("--limit", type=list_limit, default=100, help="list at most N blocks (0: up to 10000 a node)")
    p.add_argument("--full-keys", action="store_true", help="print whole keys (JSON always has them)")
    add_json(p)
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("inspect", help="one block: copies, size, namespace, pin, lease, parent")
    p.add_argument("key", metavar="KEY", help="block key in hex, or its start as kvctl ls prints it "
                   "(when one block's key starts so)")
    p.add_argument("--node", help=node_help)
    add_json(p)
    p.set_defaults(func=cmd_inspect)
    for name, func, text in (("rm", cmd_rm, "remove blocks (every copy; not a leased one)"),
                             ("demote", cmd_demote, "move blocks one tier down"),
                             ("promote", cmd_promote, "copy blocks to the top tier")):
        p = sub.add_parser(name, help=text)
        p.add_argument("keys", nargs="+", metavar="KEY", help="block keys in hex")
        p.add_argument("--prefix", action="store_true",
                       help="each KEY is a hex prefix: act on every block whose key starts with it")
        p.add_argument("--node", help=node_help)
        add_json(p)
        p.set_defaults(func=func)
    p = sub.add_parser("flush", help="drop every block of a tier / namespace (exit 3 when pinned ones stay)")
    p.add_argument("--tier", help="only this tier (default: every tier)")
    p.add_argument("--namespace", type=namespace_arg, help="only this tenant's blocks ('' : those put without one)")
    p.add_argument("--force", action="store_true", help="drop pinned blocks too (leased ones always stay)")
    p.add_argument("--node", help=node_help)
    add_json(p)
    p.set_defaults(func=cmd_flush)
