"""kvctl: the admin CLI of a store node (cache tiers and eviction), over its gRPC API.

    kvctl tiers                      capacity, used, leased and pinned bytes, counters per tier
    kvctl evict --tier T --bytes N   evict at least N bytes from tier T (policy order, demoting)
    kvctl pin KEY... [--hard|--ttl S]   pin blocks by key (hex); --prefix: KEYs are one chain
    kvctl unpin KEY... [--prefix]    drop pins
    kvctl policy [--tier T] NAME     switch the eviction policy (lru, lfu, fifo, s3fifo)
    kvctl health                     is the node serving
    kvctl watch [--interval S] [--count N]   a refreshing view of tiers, hit ratio and rates
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from tabulate import tabulate

from kvstore import kvctl_watch
from kvstore.auth import STORE_TOKEN_ENV, token_from
from kvstore.config import parse_bytes
from kvstore.errors import KVStoreError


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def cmd_tiers(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    node, stats = client.stats()
    if args.json:
        print(json.dumps({"node_id": node, "tiers": [asdict(s) for s in stats]}, indent=2))
        return 0
    rows = [[s.name, s.device, s.policy, _mib(s.capacity_bytes), _mib(s.used_bytes),
             f"{100 * s.used_bytes / s.capacity_bytes:.1f}", _mib(s.leased_bytes), _mib(s.pinned_bytes),
             s.blocks, s.hits, s.misses, s.evictions, s.demotions, s.promotions, s.integrity_failures,
             s.quarantines]
            for s in stats]
    print(f"node {node} at {args.store}")
    print(tabulate(rows, headers=["tier", "device", "policy", "capacity MiB", "used MiB", "used %",
                                  "leased MiB", "pinned MiB", "blocks", "hits", "misses", "evictions",
                                  "demotions", "promotions", "integrity failures", "quarantines"]))
    return 0


def _keys(hexes: list[str]) -> list[bytes]:
    """Hex block keys → bytes; a key is 32 bytes (SHA-256) or 16 (XXH3-128)."""
    try:
        keys = [bytes.fromhex(h) for h in hexes]
    except ValueError as exc:
        raise ValueError(f"block keys are hex strings: {exc}") from None
    for h, key in zip(hexes, keys):
        if len(key) not in (16, 32):
            raise ValueError(f"{h!r} is not a block key: keys are 64 hex digits (SHA-256) or 32 (XXH3-128)")
    return keys


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def cmd_pin(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    n = client.pin(_keys(args.keys), hard=args.hard, ttl_s=args.ttl, prefix=args.prefix)
    kind = "hard" if args.hard else (f"soft, TTL {args.ttl} s" if args.ttl else "soft, the node's default TTL")
    print(f"pinned {n} of {len(args.keys)} blocks, {kind}")
    return 0


def cmd_unpin(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    print(f"unpinned {client.unpin(_keys(args.keys), prefix=args.prefix)} blocks")
    return 0


def cmd_policy(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    for tier, old in sorted(client.set_policy(args.name, args.tier).items()):
        print(f"{tier}: {old} -> {args.name}")
    return 0


def cmd_evict(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    freed, blocks = client.evict(args.tier, parse_bytes(args.bytes))
    print(f"evicted {blocks} blocks, {freed} bytes ({_mib(freed)} MiB) from {args.tier}")
    return 0


def cmd_health(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    print(client.health())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="127.0.0.1:50051", help="store node address host:port (default %(default)s)")
    parser.add_argument("--token", help="bearer token, if the node requires one (default: KVSTORE_STORE_TOKEN)")
    parser.add_argument("--timeout", type=_positive, default=10.0, help="seconds to wait for the node (default %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("tiers", help="show each tier's capacity, usage and counters")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_tiers)
    p = sub.add_parser("evict", help="evict bytes from a tier")
    p.add_argument("--tier", required=True, help="tier name: hbm, dram or ssd")
    p.add_argument("--bytes", required=True, help="how much to evict, e.g. 64MiB or 1048576")
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
            g.add_argument("--ttl", type=_positive, metavar="S", help="soft pin TTL in seconds (default: the node's)")
        p.set_defaults(func=func)
    p = sub.add_parser("policy", help="switch the eviction policy at run time")
    p.add_argument("name", choices=["lru", "lfu", "fifo", "s3fifo"])
    p.add_argument("--tier", help="tier name (default: every tier)")
    p.set_defaults(func=cmd_policy)
    p = sub.add_parser("health", help="check that the node serves")
    p.set_defaults(func=cmd_health)
    kvctl_watch.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvstore.client import StoreClient
    if args.command == "watch":
        return kvctl_watch.run([args.store], token_from(args.token, STORE_TOKEN_ENV), args.timeout, args)
    try:
        with StoreClient(args.store, auth_token=token_from(args.token, STORE_TOKEN_ENV), timeout_s=args.timeout) as client:
            return args.func(client, args)
    except (KVStoreError, ValueError) as exc:
        print(f"kvctl {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `kvctl tiers | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
