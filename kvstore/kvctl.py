"""kvctl: the admin CLI of a store node (cache tiers and eviction), over its gRPC API.

    kvctl tiers                      capacity, used bytes, blocks, hits, evictions per tier
    kvctl evict --tier T --bytes N   evict at least N bytes from tier T (LRU first, demoting)
    kvctl health                     is the node serving
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tabulate import tabulate

from kvstore.config import parse_bytes
from kvstore.errors import KVStoreError


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def cmd_tiers(client, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    node, stats = client.stats()
    if args.json:
        print(json.dumps({"node_id": node, "tiers": [asdict(s) for s in stats]}, indent=2))
        return 0
    rows = [[s.name, s.device, _mib(s.capacity_bytes), _mib(s.used_bytes),
             f"{100 * s.used_bytes / s.capacity_bytes:.1f}", s.blocks, s.hits, s.misses,
             s.evictions, s.demotions, s.promotions, s.integrity_failures] for s in stats]
    print(f"node {node} at {args.store}")
    print(tabulate(rows, headers=["tier", "device", "capacity MiB", "used MiB", "used %", "blocks",
                                  "hits", "misses", "evictions", "demotions", "promotions",
                                  "integrity failures"]))
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
    parser.add_argument("--token", help="bearer token, if the node requires one")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the node (default %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("tiers", help="show each tier's capacity, usage and counters")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_tiers)
    p = sub.add_parser("evict", help="evict bytes from a tier")
    p.add_argument("--tier", required=True, help="tier name: dram or ssd")
    p.add_argument("--bytes", required=True, help="how much to evict, e.g. 64MiB or 1048576")
    p.set_defaults(func=cmd_evict)
    p = sub.add_parser("health", help="check that the node serves")
    p.set_defaults(func=cmd_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvstore.client import StoreClient
    try:
        with StoreClient(args.store, auth_token=args.token, timeout_s=args.timeout) as client:
            return args.func(client, args)
    except (KVStoreError, ValueError) as exc:
        print(f"kvctl {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
