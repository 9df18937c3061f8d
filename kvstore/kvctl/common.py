"""What every kvctl command shares: where the store (and the cluster) is, the token, how
results are printed (a table, or ``--json``), block-key arguments and exit codes.

Where the store is, first found wins: ``--store`` / ``--token`` / ``--redis``; then the
environment (``KVSTORE_STORE_TOKEN``, ``KVSTORE_REDIS_URL``), except with ``--stack``, which
names the stack acted on; then the file ``kvstore up``
writes for its stack (:func:`up_file`: the store nodes' addresses, the engines', and the
path of the stack's ``auth.env``, which holds the tokens and a private Redis's URL; not read
for a ``--store`` that no running stack holds); then 127.0.0.1:50051.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.admin.client import AdminClient
from kvstore.auth import ENGINE_TOKEN_ENV, REDIS_URL_ENV, STORE_TOKEN_ENV
from kvstore.child_process import pid_alive
from kvstore.client import StoreClient
from kvstore.config import parse_bytes
from kvstore.errors import InvalidArgument
from kvstore.pool.quotas import check_namespace

DEFAULT_STORE = "127.0.0.1:50051"
UP_FILE_ENV = "KVSTORE_UP_FILE"
# Exit codes: 0 done as asked; 1 an error (bad argument, refused, unreachable); 2 usage
# (argparse); 3 the command ran but did not do all it was asked (blocks left behind, fewer
# bytes freed than asked, keys that could not be moved), the JSON says so with success false.
EXIT_OK, EXIT_ERROR, EXIT_INCOMPLETE = 0, 1, 3


def up_dir() -> str:
    """Where ``kvstore up`` records its stacks: ``$XDG_RUNTIME_DIR/kvstore``, else
    ``~/.cache/kvstore`` (one ``up-<pid>.json`` per running ``kvstore up``, mode 0600)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore")


def up_file(pid: int | None = None) -> str:
    """The record of the ``kvstore up`` with process id ``pid`` (default: this process):
    ``$KVSTORE_UP_FILE`` when set (one record, whoever wrote it), else
    ``up_dir()/up-<pid>.json``."""
    explicit = os.environ.get(UP_FILE_ENV)
    if explicit:
        return explicit
    return os.path.join(up_dir(), f"up-{os.getpid() if pid is None else pid}.json")


def running_stacks() -> list[dict[str, Any]]:
    """The records of every running ``kvstore up`` (see :func:`up_dir`; only
    ``$KVSTORE_UP_FILE`` when set), oldest pid first; a record that does not parse or whose
    ``kvstore up`` has exited is skipped. Each has ``path`` added."""
    explicit = os.environ.get(UP_FILE_ENV)
    paths = [explicit] if explicit else sorted(glob.glob(os.path.join(up_dir(), "up-*.json")))
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        pid = doc.get("pid") if isinstance(doc, dict) else None
        if isinstance(pid, int) and pid_alive(pid):
            out.append({**doc, "path": path})
    return sorted(out, key=lambda d: d["pid"])


def stale_records(directory: str | None = None) -> list[str]:
    """The ``up-<pid>.json`` records in ``directory`` (default :func:`up_dir`) whose ``kvstore
    up`` has exited without removing its own (a ``kill -9``)."""
    stale = []
    for path in sorted(glob.glob(os.path.join(directory or up_dir(), "up-*.json"))):
        pid = os.path.basename(path)[3:-5]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.append(path)
    return stale


def no_stack_hint() -> str:
    """Why kvctl asked the default address: no ``kvstore up`` of this user is running (and
    which recorded ones have exited), no ``--store`` was given."""
    explicit = os.environ.get(UP_FILE_ENV)
    exited = ([explicit] if os.path.exists(explicit) else []) if explicit else stale_records()
    said = "names a stack that has exited" if len(exited) == 1 else "name stacks that have exited"
    stale = f"; {', '.join(exited)} {said}" if exited else ""
    return (f" (no kvstore up of this user is running{stale}, and no --store was given: "
            f"{DEFAULT_STORE} is only the default)")


def read_up_file(stack: int | None = None, store: str | None = None) -> dict[str, Any] | None:
    """The record of the running stack kvctl talks to: the one whose ``kvstore up`` has pid
    ``stack`` when given; else the one holding node ``store`` when given (``localhost``,
    ``127.0.0.1`` and ``::1`` taken for one host here; kvctl then connects to the address
    the stack recorded), None when no stack holds it: a stack's tokens go to the nodes it
    started only, never to another address, where anyone on the host may be listening;
    else the only one running (None when none is).
    Raises ValueError when ``stack`` is not running or does not hold ``store``, or when
    several are and neither ``stack`` nor ``store`` says which."""
    stacks = running_stacks()

    def holds(doc: dict[str, Any]) -> bool:
        return any(same_node(str(store), s) for s in doc.get("stores", ()))

    if stack is not None:
        mine = next((doc for doc in stacks if doc["pid"] == stack), None)
        if mine is None:
            raise ValueError(f"no kvstore up with pid {stack} is running; running: {_listing(stacks) or 'none'}")
        if store and not holds(mine):
            raise ValueError(f"the kvstore up with pid {stack} has no node {store} (its stores: "
                             f"{', '.join(mine.get('stores', []))}); its tokens go to its own nodes only")
        return mine
    if store:
        return next((doc for doc in stacks if holds(doc)), None)
    if len(stacks) > 1:
        raise ValueError(f"{len(stacks)} kvstore up stacks are running ({_listing(stacks)}); "
                         "pick one with --stack PID, or a node with --store")
    return stacks[0] if stacks else None


LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]").lower(), port


def same_node(a: str, b: str) -> bool:
    """Whether addresses ``a`` and ``b`` (``host:port``) may name one node: the same port, and
    the same host or two names of the loopback host. Only for finding which stack a
    ``--store`` means: ``localhost`` and ``::1`` are other sockets than ``127.0.0.1`` (any
    local user may bind ``[::1]`` on the port a stack holds on 127.0.0.1, and ``localhost``
    resolves to ``::1`` first), so kvctl then connects to the stack's own address
    (:meth:`Target.own`), and tokens go to exact addresses only (:func:`same_address`)."""
    (ha, pa), (hb, pb) = _host_port(a), _host_port(b)
    return pa == pb and (ha == hb or (ha in LOOPBACK and hb in LOOPBACK))


def same_address(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` (``host:port``) are one socket address: the same host (case
    and IPv6 brackets aside) and port."""
    return _host_port(a) == _host_port(b)


def _listing(stacks: list[dict[str, Any]]) -> str:
    return ", ".join(f"pid {d['pid']}: front door {d.get('frontdoor')}, stores {','.join(d.get('stores', []))}"
                     for d in stacks)


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of an ``auth.env`` (empty when it cannot be read)."""
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                k, sep, v = line.strip().partition("=")
                if sep and k:
                    out[k] = v
    except OSError:
        pass
    return out


@dataclass
class Target:
    """Where kvctl's calls go. ``source`` says how ``store`` was found (for messages)."""

    store: str
    token: str | None
    redis_url: str | None
    engine_token: str | None
    timeout_s: float
    source: str = "flag"
    engines: list[str] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)
    vllm: dict[str, Any] | None = None   # a vLLM stack's key spec (launcher/stack_record.py)
    # tokens read from a stack's auth.env go to that stack's own nodes and engines only
    token_from_stack: bool = False
    engine_token_from_stack: bool = False

    def token_for(self, address: str) -> str | None:
        """The store token to send ``address``: a stack's only to the exact address of one
        of the stack's nodes."""
        if self.token_from_stack and not any(same_address(address, s) for s in self.stores):
            return None
        return self.token

    def store_client(self, address: str | None = None, timeout_s: float | None = None) -> StoreClient:
        """A gRPC client of the node at ``address`` (default ``store``), carrying the token
        :meth:`token_for` allows there."""
        address = address or self.store
        return StoreClient(address, auth_token=self.token_for(address), timeout_s=timeout_s or self.timeout_s,
                           data_path="grpc")

    def admin_client(self, address: str | None = None) -> AdminClient:
        """An Admin API client of the node at ``address`` (default ``store``), carrying the
        token :meth:`token_for` allows there."""
        address = address or self.store
        return AdminClient(address, self.token_for(address), self.timeout_s)

    def engine_token_for(self, address: str) -> str | None:
        """The engines' token to send ``address``: a stack's only to the exact address of
        one of the stack's engines."""
        if self.engine_token_from_stack and not any(same_address(address, e) for e in self.engines):
            return None
        return self.engine_token

    def own(self, address: str) -> str:
        """The stack's own address of the node or engine ``address`` names (``localhost:P``
        or ``[::1]:P`` for one the stack holds on ``127.0.0.1:P``), else ``address``: kvctl
        connects there, never to whoever listens on the other name."""
        return next((a for a in [*self.stores, *self.engines] if same_node(address, a)), address)


def check_address(address: str, flag: str) -> str:
    """``address`` if it is ``host:port`` with a port in 1..65535 (gRPC would wrap 99999 to
    34463 and connect there), else ValueError naming ``flag``."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{flag} {address!r} is not host:port with a port in 1..65535")
    return address


def resolve_target(args: argparse.Namespace) -> Target:
    if args.store:
        check_address(args.store, "--store")
    up = read_up_file(getattr(args, "stack", None), args.store)
    auth = read_env_file(up["auth_env"]) if up and up.get("auth_env") else {}
    store, source = args.store, "--store"
    if not store and up and up.get("stores"):
        store, source = up["stores"][0], up["path"]
    if not store:
        store, source = DEFAULT_STORE, "default"
    env = _environment(args, up)
    given = args.token or env.get(STORE_TOKEN_ENV)
    token = given or auth.get(STORE_TOKEN_ENV) or None
    redis_url = getattr(args, "redis", None) or env.get(REDIS_URL_ENV) or auth.get(REDIS_URL_ENV) or None
    given_engine = getattr(args, "engine_token", None) or env.get(ENGINE_TOKEN_ENV)
    engine_token = given_engine or auth.get(ENGINE_TOKEN_ENV) or None
    target = Target(store, token, redis_url, engine_token, args.timeout, source,
                    list(up.get("engines", [])) if up else [], list(up.get("stores", [])) if up else [],
                    token_from_stack=not given and token is not None,
                    engine_token_from_stack=not given_engine and engine_token is not None,
                    vllm=up.get("vllm") if up else None)
    target.store = target.own(store)   # the stack's own address of it: localhost may resolve to someone's [::1]
    return target


def _environment(args: argparse.Namespace, up: dict[str, Any] | None) -> dict[str, str]:
    """The kvctl settings taken from the environment: none with ``--stack`` (the stack named
    is the one acted on: a shell that sourced another stack's auth.env had sent ``--stack A
    flush`` to that other stack), and a note on stderr for each one so ignored."""
    names = (STORE_TOKEN_ENV, REDIS_URL_ENV, ENGINE_TOKEN_ENV)
    env = {name: os.environ[name] for name in names if os.environ.get(name)}
    if getattr(args, "stack", None) is None or up is None:
        return env
    if env:
        print(f"kvctl: --stack {args.stack}: using that stack's auth.env, not {', '.join(sorted(env))} from the "
              "environment", file=sys.stderr)
    return {}


def emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    """Print ``doc`` as JSON with ``--json``, else ``text``."""
    if getattr(args, "json", False):
        print(json.dumps(doc, indent=2, sort_keys=False))
    else:
        print(text)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an "s" unless ``n`` is 1: "1 block", "3 blocks"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def mib(n: int) -> str:
    """Bytes in MiB for a table or message: one decimal from 0.1 MiB up, four below (8,192
    bytes: ``0.0078``, not ``0.0``), ``<0.0001`` for fewer than 53 bytes, ``0`` for none."""
    x = n / 2**20
    if n == 0 or abs(x) >= 0.1:
        return "0" if n == 0 else f"{x:,.1f}"
    return f"{x:.4f}" if abs(x) >= 5e-5 else "<0.0001"


MAX_WIRE_BYTES = (1 << 64) - 1   # a byte count on the Admin API is a uint64


def bytes_flag(text: str, what: str) -> int:
    """``--bytes`` (``"64MiB"``, ``"1048576"``) → bytes for the Admin API. Raises
    InvalidArgument naming the flag when it is not a size or exceeds a uint64 (protobuf's
    own error named neither)."""
    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise InvalidArgument(f"--bytes: {exc}") from None
    if n > MAX_WIRE_BYTES:
        raise InvalidArgument(f"--bytes: {what} is at most 2**64 - 1 bytes, got {text}")
    return n


def size_text(n: int) -> str:
    """Bytes for a message: ``1,048,576 bytes (1.0 MiB)``."""
    return f"{n:,} bytes ({mib(n)} MiB)"


def parse_keys(hexes: list[str]) -> list[bytes]:
    """Hex block keys → bytes; a key is 32 bytes (SHA-256) or 16 (XXH3-128). Raises
    ValueError naming the one that is not."""
    keys = []
    for h in hexes:
        try:
            keys.append(bytes.fromhex(h))
        except ValueError:
            raise ValueError(f"{h!r} is not a block key: a key is hex digits (0-9, a-f), 64 of them (SHA-256) "
                             "or 32 (XXH3-128)") from None
    for h, key in zip(hexes, keys):
        if len(key) not in (16, 32):
            raise ValueError(f"{h!r} is not a block key: keys are 64 hex digits (SHA-256) or 32 (XXH3-128); "
                             "kvctl ls prints their first 16 (which inspect takes, and rm, demote and promote "
                             "with --prefix), kvctl ls --full-keys whole keys")
    return keys


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (and <= ``maximum`` when given), else
    a usage error naming the rule."""
    rule = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number {rule}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be a whole number {rule}, got {text}")
        return value
    return parse


list_limit = whole_number(0, 2**32 - 1)   # ListBlocks' uint32: a larger one was protobuf's "Value out of range"


def namespace_arg(text: str) -> str:
    """An argparse type: a namespace as every wire takes it (kvstore/pool/quotas.py
    ``check_namespace``: 1-256 printable ASCII characters) or ``''`` (the blocks put without
    one), else a usage error — a name no node can hold would match nothing, silently."""
    if text == "":
        return text
    try:
        return check_namespace(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fail(args: argparse.Namespace, message: str, code: int = EXIT_ERROR) -> int:
    print(f"kvctl {args.command}: {message}", file=sys.stderr)
    return code
