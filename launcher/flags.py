"""The flags of the ``kvstore`` command's subcommands that are shared or long: a store node's
(``kvstore serve``), the tiers (from kvstore/tiers/registry.py), the replay's, the scheduler's
and the API keys'; defaults from the environment where a secret must stay off the command line."""
from __future__ import annotations

import argparse
import json

from kvstore.config import (
    EVICTION_POLICIES,
    SSD_ON_ERROR,
    TRANSFER_ENGINES,
    StoreConfig,
    TierSpec,
    non_negative_int,
    positive_int,
)
from kvstore.pool.types import PoolSettings
from kvstore.tiers import registry
from kvstore.tiers.ssd import FSYNC_POLICIES
from scheduler.policy.registry import DEFAULT_POLICY
from scheduler.policy.registry import POLICIES as SCHEDULING_POLICIES


def _positive_finite(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number{' of ' + unit if unit else ''}, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be > 0{' ' + unit if unit else ''} and finite, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    return _positive_finite(text, "seconds")


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0 (a speed factor)."""
    return _positive_finite(text, "")


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0–65535 (0: the system picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def addresses(text: str) -> str:
    """argparse type: one or more ``host:port`` addresses, comma-separated (returned as
    given), each port 1–65535 — refused at once rather than waited for."""
    for address in (a.strip() for a in text.split(",")):
        host, sep, port = address.rpartition(":")
        if not address or not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"not a host:port address (port 1-65535): {address!r}")
    return text


def json_object(text: str) -> dict:
    """A flag's JSON object (``--vllm-hf-overrides``); ArgumentTypeError for other JSON or
    none."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}")
    return value


def http_url(text: str) -> str:
    """argparse type: an ``http://`` or ``https://`` URL with a host (a bare ``host:port``
    is refused naming the scheme it lacks, rather than found unreachable)."""
    from urllib.parse import urlsplit
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"not an http:// URL: {text!r} (e.g. http://127.0.0.1:8000)")
    return text.rstrip("/")


def env_redis() -> str | None:
    """The Redis URL of the environment (kvstore.auth.REDIS_URL_ENV), which may hold a password."""
    import os

    from kvstore.auth import REDIS_URL_ENV
    return os.environ.get(REDIS_URL_ENV) or None


def env_events() -> str | None:
    """The KV events' Redis URL of the environment (kvstore.events.channel.EVENTS_URL_ENV)."""
    import os

    from kvstore.events.channel import EVENTS_URL_ENV
    return os.environ.get(EVENTS_URL_ENV) or None


def tier_size_flags() -> list[str]:
    """Tier kinds sized by a flag of their own (``--dram 1GiB``): those with a
    ``<kind>_bytes`` StoreConfig field; every kind takes ``--tier KIND=SIZE``."""
    return [k for k in registry.names() if f"{k}_bytes" in StoreConfig.__dataclass_fields__]


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """``--tier KIND=SIZE`` (repeatable, fastest first) and ``--<kind> SIZE``, from
    kvstore/tiers/registry.py."""
    p.add_argument("--tier", action="append", type=_tier_arg, metavar="KIND=SIZE",
                   help=f"a tier of the node, fastest first (repeatable; KIND one of {registry.names()}), "
                        f"e.g. --tier dram=1GiB --tier ssd=4GiB; replaces the per-kind size flags")
    for name in tier_size_flags():
        k = registry.kind(name)
        gib, mib = divmod(k.default_bytes, 1 << 30)
        default = "0: none" if not k.default_bytes else f"{gib}GiB" if not mib else f"{k.default_bytes >> 20}MiB"
        p.add_argument(f"--{name}", dest=f"{name}_bytes", metavar="SIZE",
                       help=f"{k.help}: capacity, e.g. 2GiB (default {default})")


def _tier_arg(text: str) -> TierSpec:
    try:
        return TierSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def setup_names(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated set-ups of ``kvstore up --replay`` over vLLM, returned in
    the order they run (:data:`launcher.vllm_setups.COMPARED`)."""
    from launcher.vllm_setups import COMPARED
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(COMPARED))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: not a set-up "
                                         f"(choose from {', '.join(COMPARED)})")
    return tuple(n for n in COMPARED if n in names)


def add_replay_flags(p: argparse.ArgumentParser, setups: bool = False) -> None:
    p.add_argument("--requests", type=positive_int, default=100, help="requests to replay")
    p.add_argument("--start", type=non_negative_int, default=0, help="index of the trace request the window starts at")
    p.add_argument("--window-s", type=positive_seconds, default=180.0, metavar="S",
                   help="replay the --requests requests of the conversations with the most turns within S trace "
                        "seconds from --start (their reuse: a later turn extends an earlier prompt)")
    p.add_argument("--contiguous", action="store_true",
                   help="replay the --requests consecutive requests from --start instead (little reuse)")
    p.add_argument("--speed", type=positive_number, default=4.0,
                   help="replay speed factor (timestamps are divided by it; kvstore up: 2 over vLLM, 4 on the "
                        "built-in engines)")
    p.add_argument("--tokens-per-block", type=positive_int, default=64,
                   help="tokens each trace hash id (a 512-token block) becomes; 512 replays the real lengths "
                        "(kvstore up: 32 over vLLM, 64 on the built-in engines)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="kvstore up over vLLM: replay on three set-ups one after another (vLLM alone, kvstore, "
                        "recompute) and print them side by side; on the built-in engines and kvstore replay: "
                        "twice, pool on then pool off (every prompt recomputed: \"prefix_cache\": false)")
    if setups:
        p.add_argument("--setups", type=setup_names, default=None, metavar="LIST",
                       help="over vLLM with --compare: the set-ups to run, comma-separated, of vllm, kvstore, "
                            "recompute (default: all three)")
    p.add_argument("--plots", metavar="DIR", help="with --compare, write the TTFT CDF and hit ratio PNGs here")
    p.add_argument("--max-output-tokens", type=positive_int, default=16, help="cap on each request's output_length")
    p.add_argument("--ttft-slo-s", type=positive_seconds, default=2.0, help="TTFT SLO for goodput (seconds)")
    p.add_argument("--tbt-slo-s", type=positive_seconds, default=0.2, help="TBT SLO for goodput (seconds)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON here")


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-inflight", type=int, default=64,
                   help="admission bound: requests in flight before new ones get HTTP 429")
    p.add_argument("--max-inflight-per-tenant", type=non_negative_int, default=None, metavar="N",
                   help="admission bound per tenant: one tenant's requests in flight before its new ones get "
                        "HTTP 429, so that no tenant takes every slot (default: half of --max-inflight when "
                        "the front door has API keys, none without; 0: none)")
    p.add_argument("--admit-ttft-s", type=float, default=30.0,
                   help="admission bound: reject (429), before any prefill, a request whose predicted TTFT "
                        "exceeds this many seconds (default %(default)s; your TTFT SLO turns away what would miss "
                        "it: docs/benchmarks.md, 'Admission at the demo's SLO')")
    p.add_argument("--admit-tbt-s", type=float, default=0.0,
                   help="admission bound: reject (429) when the predicted TBT exceeds this (0: no TBT SLO)")
    # The registry itself, not a copy: a policy registered later is accepted too.
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=SCHEDULING_POLICIES,
                   help="scheduling policy: the Conductor, a baseline or a peer router (docs/routers.md)")
    p.add_argument("--decode-max-running", type=int, default=64,
                   help="requests one decode instance takes at once (admission's decode capacity)")
    p.add_argument("--balancing-threshold", type=float, default=1.0,
                   help="fetch a better cached prefix only when it saves this many times its transfer time")
    p.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="HTTP connections the front door keeps open at once; one more closes the longest "
                        "idle (default: 1024, fewer under a lower open-files limit)")
    p.add_argument("--idle-timeout-s", type=positive_seconds, default=None, metavar="S",
                   help="close an HTTP connection idle S seconds after its last response (default: 75)")
    p.add_argument("--head-timeout-s", type=positive_seconds, default=None, metavar="S",
                   help="close a new HTTP connection that has not sent a whole request head within S seconds, "
                        "however slowly it sends (default: 15)")


def connection_flags(args: argparse.Namespace) -> list[str]:
    """``--max-connections``, ``--idle-timeout-s``, ``--head-timeout-s`` as given to ``kvstore up``,
    for its front door."""
    return [f"--{name.replace('_', '-')}={value}" for name in ("max_connections", "idle_timeout_s", "head_timeout_s")
            if (value := getattr(args, name)) is not None]


def add_api_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="serve only callers sending 'Authorization: Bearer KEY' (repeatable; others get "
                        "401); without keys every caller is served")
    p.add_argument("--api-keys-file", metavar="FILE",
                   help="more API keys, one per line ('#' starts a comment); unlike --api-key, not shown by ps")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvstore serve`` (a store node; StoreConfig's fields, see kvstore/config.py)."""
    p.add_argument("--config", metavar="TOML", help="settings file (keys: the StoreConfig fields); flags win")
    p.add_argument("--node-id", help="node id, one per live node of a cluster (default node-0): a node "
                   "started while another live one holds the id stays out of the cluster, logging so, until "
                   "that one stops")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, help="gRPC port (default 50051; 0 picks a free one)")
    add_tier_flags(p)
    p.add_argument("--data-dir", help="where the SSD tier keeps its LMDB (default var/store)")
    p.add_argument("--ssd-fsync", choices=FSYNC_POLICIES, help="SSD durability (default never)")
    p.add_argument("--ssd-on-error", choices=SSD_ON_ERROR,
                   help="an SSD data directory that cannot be used at start: fail (exit with the error; "
                        "default) or disable (serve without the SSD tier)")
    p.add_argument("--hbm-device", help="HBM tier device: auto (CUDA if present, else cpu), cpu, cuda:0, ...")
    p.add_argument("--policy", choices=EVICTION_POLICIES,
                   help=f"eviction policy (default {PoolSettings().policy})")
    p.add_argument("--high-watermark", type=float, help="evict once a put would fill a tier above this "
                   "fraction of its capacity (default 0.95)")
    p.add_argument("--low-watermark", type=float, help="... down to this fraction (default 0.90)")
    p.add_argument("--lease-ttl", type=float, metavar="S", help="read lease TTL, seconds (default 5)")
    p.add_argument("--reservation-timeout", type=float, metavar="S",
                   help="an unfinished put frees its space after this many seconds (default 30)")
    p.add_argument("--auth-token", help="require this bearer token from clients (default: the "
                   "KVSTORE_STORE_TOKEN environment variable, which keeps it off the command line)")
    p.add_argument("--dataplane-socket", metavar="PATH", help="Unix socket of the same-host data plane's "
                   "control channel (default auto: <data-dir>/<node-id>/dataplane.sock; '' for none)")
    p.add_argument("--redis", metavar="URL", default=env_redis(), help="publish KV events to this Redis "
                   "(redis://[:password@]host:port/db) and register the node there (cluster membership); "
                   "default: KVSTORE_REDIS_URL, else in-process, single node")
    p.add_argument("--heartbeat", type=float, metavar="S", help="membership heartbeat, seconds (default 1)")
    p.add_argument("--node-ttl", type=float, metavar="S",
                   help="membership TTL: a node silent this long leaves lookups (default 3); a node "
                        "restarted within it registers once its previous life's record lapses")
    p.add_argument("--transfer-engine", choices=TRANSFER_ENGINES,
                   help="Mooncake Transfer Engine for across-host reads: auto (tcp when the node joins a "
                        "cluster with --redis, else off), tcp, rdma or off (default auto). It has no "
                        "authentication and listens on every interface: a private fabric only")
    p.add_argument("--te-metadata", metavar="URL", help="transfer engine metadata: P2PHANDSHAKE (default) "
                   "or Mooncake's HTTP metadata server http://host:port/metadata")
    p.add_argument("--te-staging", metavar="SIZE", help="register only a staging area of this size with the "
                   "transfer engine, holding the blocks being read (default 64MiB); 0 registers the whole "
                   "DRAM slab: every block reachable by any peer of the engine")
    p.add_argument("--advertise-host", help="host other machines reach this node at (default --host)")
    p.add_argument("--dram-prefault", action=argparse.BooleanOptionalAction, default=None,
                   help="allocate and map the DRAM slab's pages in the background from the start, so no "
                        "put pays page faults (default on; --no-dram-prefault takes memory as blocks arrive)")
    p.add_argument("--dataplane-poll-us", type=int, metavar="US",
                   help="after a request on the data plane's control channel, poll this many microseconds "
                        "for the next one before sleeping: faster back-to-back puts and gets for that much "
                        "CPU per request (default 200; 0 never polls)")
    p.add_argument("--control-port", type=port_number, metavar="PORT",
                   help="TCP port (on --host) where transfer-engine readers lease blocks: compact frames, "
                        "about 0.3 ms a lease instead of about 1.1 ms over gRPC (default 0: a free port, "
                        "announced to readers)")
    p.add_argument("--metrics-port", type=port_number, metavar="PORT",
                   help="serve Prometheus metrics on GET /metrics at this port of --host (0 picks a free one); "
                        "it takes the node's --auth-token when one is set (default: no metrics port)")
