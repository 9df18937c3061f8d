"""kvctl commands on one node's tiers: ``tiers``, ``evict``, ``pin``, ``unpin``,
``policy``, ``health``."""
from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from tabulate import tabulate

from kvstore.kvctl.common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    Target,
    add_json,
    bytes_flag,
    emit,
    mib,
    parse_keys,
    plural,
    positive,
    size_text,
)
from kvstore.pool.eviction import POLICIES
from kvstore.pool.types import lookup_hit_ratio, read_success_ratio


def cmd_tiers(t: Target, args: argparse.Namespace) -> int:
    with t.store_client() as client:
        node, stats = client.stats()
    rows = [[s.name, s.device, s.policy, mib(s.capacity_bytes), mib(s.used_bytes),
             f"{100 * s.used_bytes / s.capacity_bytes:.1f}" if s.capacity_bytes else "-",
             mib(s.leased_bytes), mib(s.pinned_bytes), s.blocks, s.lookup_hits, s.lookup_misses, s.handoff_lookups,
             s.hits, s.misses, s.evictions, s.demotions, s.promotions, s.integrity_failures, s.quarantines]
            for s in stats]
    lookup, read = lookup_hit_ratio(stats), read_success_ratio(stats)
    text = f"node {node} at {t.store}\n" + tabulate(rows, headers=[
        "tier", "device", "policy", "capacity MiB", "used MiB", "used %", "leased MiB", "pinned MiB", "blocks",
        "lookup hits", "lookup misses", "hand-off lookups", "read hits", "read misses", "evictions",
        "demotions", "promotions", "integrity failures", "quarantines"])
    text += (f"\nlookup hit ratio (reuse: blocks found / blocks looked up): {_ratio(lookup)}; "
             f"read success ratio (blocks served / blocks read): {_ratio(read)}")
    emit(args, {"node_id": node, "address": t.store, "lookup_hit_ratio": lookup, "read_success_ratio": read,
                "tiers": [asdict(s) for s in stats]}, text)
    return EXIT_OK


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def cmd_evict(t: Target, args: argparse.Namespace) -> int:
    asked = bytes_flag(args.bytes, "an eviction")
    with t.admin_client() as admin:
        r = admin.evict(args.tier, asked)
    blocks = r["demoted"] + r["dropped"]
    short = r["freed_bytes"] < asked
    doc: dict[str, Any] = {"success": not short, "address": t.store, **r}
    text = (f"{t.store}: evicted {plural(blocks, 'block')}, {size_text(r['freed_bytes'])} from {r['tier']}: "
            f"{r['demoted']} demoted to the next tier (still served from there), "
            f"{r['dropped']} dropped from the node")
    if short:
        text += f"\nfreed {size_text(r['freed_bytes'])} of the {size_text(asked)} asked: {r['reason']}"
    emit(args, doc, text)
    return EXIT_INCOMPLETE if short else EXIT_OK


def cmd_pin(t: Target, args: argparse.Namespace) -> int:
    keys = parse_keys(args.keys)
    with t.store_client() as client:
        n = client.pin(keys, hard=args.hard, ttl_s=args.ttl, prefix=args.prefix)
    asked = len(set(keys))   # the node counts distinct blocks
    kind = "hard" if args.hard else (f"soft, TTL {args.ttl} s" if args.ttl else "soft, the node's default TTL")
    note = "" if args.hard else "a block pinned hard stays hard: unpin it first"
    # --prefix pins the chain's held prefix, whatever its length; none held (its head is
    # not there) is the incomplete case, as for rm/demote/promote --prefix
    done = n > 0 if args.prefix else n == asked
    text = f"{t.store}: pinned {n} of {plural(asked, 'block')}, {kind}" + (f" ({note})" if note else "")
    doc: dict[str, Any] = {"success": done, "address": t.store, "pinned": n, "asked": asked, "kind": kind}
    if note:
        doc["note"] = note
    if args.prefix and not n:
        doc["reason"] = "the node holds no block of the chain's head"
    elif not done:
        doc["reason"] = f"{asked - n} of the named blocks are not held on this node"
    if "reason" in doc:
        text += f": {doc['reason']}"
    emit(args, doc, text)
    return EXIT_OK if done else EXIT_INCOMPLETE


def cmd_unpin(t: Target, args: argparse.Namespace) -> int:
    keys = parse_keys(args.keys)
    with t.store_client() as client:
        n = client.unpin(keys, prefix=args.prefix)
    asked = len(set(keys))
    done = n > 0 if args.prefix else n == asked
    doc: dict[str, Any] = {"success": done, "address": t.store, "unpinned": n, "asked": asked}
    text = f"{t.store}: unpinned {n} of {plural(asked, 'block')}"
    if not done:   # a pin it did not find may be on another node (--store picks the node)
        doc["reason"] = (f"{asked - n if not args.prefix else asked} of the named blocks are not pinned on this "
                         "node (not held here, or not pinned)")
        text += f": {doc['reason']}"
    emit(args, doc, text)
    return EXIT_OK if done else EXIT_INCOMPLETE


def cmd_policy(t: Target, args: argparse.Namespace) -> int:
    with t.store_client() as client:
        previous = client.set_policy(args.name, args.tier)
    emit(args, {"success": True, "address": t.store, "policy": args.name, "previous": previous},
         "\n".join(f"{t.store} {tier}: {old} -> {args.name}" for tier, old in sorted(previous.items())))
    return EXIT_OK


def cmd_health(t: Target, args: argparse.Namespace) -> int:
    with t.store_client() as client:
        status = client.health()
    emit(args, {"address": t.store, "status": status}, status)
    return EXIT_OK


def add_commands(sub: Any) -> None:
    p = sub.add_parser("tiers", help="each tier's capacity, usage and counters; the lookup hit ratio (reuse) "
                                      "and the read success ratio")
    add_json(p)
    p.set_defaults(func=cmd_tiers)
    p = sub.add_parser("evict", help="evict bytes from a tier (says demoted vs dropped; exit 3 when short)")
    p.add_argument("--tier", required=True, help="tier name: hbm, dram or ssd")
    p.add_argument("--bytes", required=True, help="how much to evict, e.g. 64MiB or 1048576")
    add_json(p)
    p.set_defaults(func=cmd_evict)
    for name, func, text in (("pin", cmd_pin, "pin blocks (hard: never evicted; soft: last resort)"),
                             ("unpin", cmd_unpin, "drop pins")):
        p = sub.add_parser(name, help=text)
        p.add_argument("keys", nargs="+", metavar="KEY", help="block keys in hex")
        p.add_argument("--prefix", action="store_true",
                       help="the KEYs are one prefix chain, head first: act on its held prefix")
        if name == "pin":
            g = p.add_mutually_exclusive_group()
            g.add_argument("--hard", action="store_true", help="a hard pin (until unpinned)")
            g.add_argument("--ttl", type=positive, metavar="S", help="soft pin TTL in seconds (default: the node's)")
        add_json(p)
        p.set_defaults(func=func)
    p = sub.add_parser("policy", help="switch the eviction policy at run time")
    p.add_argument("name", choices=POLICIES)   # the registry itself: a policy registered later is valid too
    p.add_argument("--tier", help="tier name (default: every tier)")
    add_json(p)
    p.set_defaults(func=cmd_policy)
    p = sub.add_parser("health", help="check that the node serves")
    add_json(p)
    p.set_defaults(func=cmd_health)
