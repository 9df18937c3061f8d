"""kvctl: the admin CLI of a kvstore cluster, over the store nodes' gRPC Store and Admin
APIs and the membership registry. Every command takes ``--json``; exit codes: 0 done as
asked, 1 an error (bad argument, refused, unreachable), 2 a usage error, 3 ran but did not
do all it was asked (blocks left behind, fewer bytes freed than asked, keys not moved).

Admin calls need the store token (KVSTORE_STORE_TOKEN, --token): an admin sees every
tenant's blocks, so tenants never hold it. After `kvstore up`, kvctl finds the stack's
store, engines and tokens by itself (flags win).

    kvctl tiers | health | policy NAME          one node's tiers, liveness, eviction policy
    kvctl nodes                                 the cluster: address, tiers, use, health, epoch
    kvctl lookup --prompt TEXT | --tokens IDS   a prompt's block keys and where each block is
    kvctl ls | inspect KEY                      blocks: key, node, tiers, size, namespace, pin
    kvctl rm | demote | promote KEY... [--prefix]
    kvctl flush [--tier T] [--namespace N] [--force]
    kvctl evict --tier T --bytes N              says demoted versus dropped
    kvctl pin KEY... [--hard|--ttl S] | unpin KEY...
    kvctl drain NODE [--cancel]                 move a node's blocks to the others before scale-in
    kvctl quota set|get|list|rm --namespace N [--bytes B]
    kvctl namespaces                            per-tenant bytes, blocks, hits, misses
    kvctl watch [--interval S] [--count N]      a refreshing view of tiers, hit ratio and rates
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvstore.errors import KVStoreError, Unavailable
from kvstore.kvctl import blocks, cluster, lookup, quota, tiers, watch
from kvstore.kvctl.common import DEFAULT_STORE, EXIT_ERROR, no_stack_hint, positive, resolve_target, up_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description=(__doc__ or "").replace("``", "`"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="a store node host:port (default: the running kvstore up's, from "
                                        f"{up_dir()}/up-PID.json, else 127.0.0.1:50051)")
    parser.add_argument("--stack", type=int, metavar="PID",
                        help="which kvstore up to talk to when several are running (the pid each prints)")
    parser.add_argument("--token", help="the store token (admin calls need it; default: KVSTORE_STORE_TOKEN, "
                                        "else kvstore up's auth.env)")
    parser.add_argument("--redis", metavar="URL", help="the membership registry: every node of the cluster "
                                                       "(default: KVSTORE_REDIS_URL, else kvstore up's)")
    parser.add_argument("--timeout", type=positive, default=10.0,
                        help="seconds to wait for a node (default %(default)s)")
    parser.add_argument("--json", dest="json_first", action="store_true",
                        help="print JSON instead of text (also taken after the command)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (tiers, cluster, lookup, blocks, quota, watch):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.json_first:          # `kvctl --json inspect KEY` as `kvctl inspect KEY --json`
        args.json = True
    target = None
    try:
        target = resolve_target(args)
        return int(args.func(target, args))
    except (KVStoreError, ValueError) as exc:
        message = str(exc)
        if isinstance(exc, Unavailable) and target is not None and target.source == "default" \
                and DEFAULT_STORE in message:
            message += no_stack_hint()
        print(f"kvctl {args.command}: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):      # a script reading stdout gets the failure as JSON too
            print(json.dumps({"success": False, "error": message}))
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. `kvctl ls | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
