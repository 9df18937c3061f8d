"""A membership record: each store node keeps a record ``kvstore:nodes:<node_id>`` (JSON) alive
in the registry (kvstore/cluster/membership.py) with a TTL heartbeat; this module reads and
writes one.

Records are sealed with the store token. Every reader of the registry (engines, the
scheduler, the vLLM connector, kvctl) sends the store token to the addresses it lists, so a
record anyone who can write to Redis could forge would hand them the token. A node with a
token therefore writes ``{"body": ..., "mac": hex}``: the body holds the record, when it was
sealed and its TTL, and the MAC is an HMAC-SHA256 under the token over the record's key and
the body. Both sides read the time off the Redis server (``TIME``), so no two hosts' clocks
are compared. A reader with a token lists only records whose MAC verifies, sealed no longer
ago than their TTL (+ :data:`CLOCK_SLACK_S`: a record replayed after its node stopped is as
dead as the node within the same TTL) and no older than a record of that node it has
already listed (an earlier life, or an earlier beat, written back over the live one). A
reader without a token sends none, so it takes every well-formed record. (A node without a
token writes an unsealed record; a reader with one refuses it.) Whatever a record holds, it
is left out (and logged) or listed: never an exception that would stop the listing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

KEY_PREFIX = "kvstore:nodes:"
LEFT_PREFIX = "kvstore:left:"    # a life's clean stop: a key per <node id>:<epoch>, kept LEFT_TTL_S
LEFT_TTL_S = 3600.0              # how long a clean stop is remembered, seconds
# How far past its TTL a sealed record may be read, seconds (by the Redis server's clock: the
# round trips between reading the clock and writing or reading the record).
CLOCK_SLACK_S = 2.0
MAX_RECORD_BYTES = 64 << 10      # a record is a few hundred bytes; a larger value is not one
MAC_CONTEXT = b"kvstore membership record v1\0"


class NotSealedForThisToken(ValueError):
    """A record whose seal does not verify under the reader's store token, or that is not
    sealed while the reader holds one: another cluster's, a forgery, or the reader's token
    is wrong or stale."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A live store node as announced. ``tiers``: (name, capacity_bytes, used_bytes) each;
    ``free_bytes``: what placement may still put there (below the low watermark);
    ``te_endpoint``: its transfer engine (host:rpc_port), "" for none; ``epoch``: start time
    in ns, so a restarted node is told apart from its previous life; ``draining``: the node
    is being emptied (``kvctl drain``), so placement puts no new blocks there."""

    node_id: str
    address: str
    tiers: tuple[tuple[str, int, int], ...] = ()
    free_bytes: int = 0
    te_endpoint: str = ""
    epoch: int = 0
    draining: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Any) -> NodeInfo:
        """The record ``d`` (a decoded JSON object). Raises ValueError naming the field that
        is missing or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError("the record is not a JSON object")
        d = dict(d)
        tiers = d.get("tiers", ())
        if not isinstance(tiers, list | tuple) or not all(
                isinstance(t, list | tuple) and len(t) == 3 and isinstance(t[0], str)
                and all(whole(x) for x in t[1:]) for t in tiers):
            raise ValueError("tiers: not a list of [name, capacity_bytes, used_bytes]")
        d["tiers"] = tuple(tuple(t) for t in tiers)
        types = {"node_id": str, "address": str, "free_bytes": int, "te_endpoint": str, "epoch": int, "draining": bool}
        for name, kind in types.items():
            if name in d and not (isinstance(d[name], kind) and (kind is bool or not isinstance(d[name], bool))):
                raise ValueError(f"{name}: not a {kind.__name__}")
        try:
            return cls(**d)
        except TypeError as exc:   # a field missing or unknown
            raise ValueError(str(exc)) from None


def whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def left_key(node_id: str, epoch: int) -> str:
    """The key noting that life ``epoch`` of ``node_id`` stopped cleanly: one per life, each
    with its own TTL, so lives of one id do not overwrite one another's and lapse on their own
    (a hash per id has one TTL for all its fields: refreshed by each stop, it would keep every
    life of an id restarted more often than :data:`LEFT_TTL_S`). The epoch, a whole number,
    comes last: no other (id, epoch) gives the same key."""
    return f"{LEFT_PREFIX}{node_id}:{int(epoch)}"


def mac(token: str, key: str, body: str) -> str:
    return hmac.new(token.encode(), MAC_CONTEXT + key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def _json(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ValueError(f"not JSON ({type(exc).__name__})") from None


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def seal(info: NodeInfo, token: str | None, now: float, ttl_s: float) -> str:
    """The registry value announcing ``info`` for ``ttl_s`` seconds: sealed (MAC under
    ``token``, dated ``now``: the Redis server's time, unix seconds) when there is a token,
    else the bare record."""
    if not token:
        return json.dumps({"info": asdict(info)}, separators=(",", ":"))
    body = json.dumps({"info": asdict(info), "sealed_at": now, "ttl_s": ttl_s}, separators=(",", ":"), sort_keys=True)
    return json.dumps({"body": body, "mac": mac(token, KEY_PREFIX + info.node_id, body)},
                      separators=(",", ":"))


def unseal(key: str, value: str | bytes, token: str | None, now: float) -> tuple[NodeInfo, float | None]:
    """The node announced at registry ``key`` by ``value``, and when the record was sealed
    (None for an unsealed one), at ``now`` (the Redis server's time). With a token, the value
    must be sealed under it, no older than its TTL + :data:`CLOCK_SLACK_S`, and name the node
    its key does. Raises ValueError saying what is wrong (a forged, stale, unsealed or
    malformed record), and nothing else whatever the value holds."""
    doc = document(value)
    sealed_at: float | None = None
    if "body" in doc:
        inner = opened(key, doc, token)
        if not _number(inner.get("sealed_at")) or not _number(inner.get("ttl_s")):
            raise ValueError("body: not an object with a record, sealed_at and ttl_s")
        sealed_at = float(inner["sealed_at"])
        age, ttl_s = now - sealed_at, float(inner["ttl_s"])
        if token and not -CLOCK_SLACK_S <= age <= ttl_s + CLOCK_SLACK_S:
            raise ValueError(f"sealed {age:.1f} s ago, its TTL {ttl_s:g} s (replayed after its node stopped)")
        info = NodeInfo.from_dict(inner.get("info"))
    elif token:
        raise NotSealedForThisToken("unsealed: its node runs without the store token this reader holds")
    else:
        info = NodeInfo.from_dict(doc.get("info"))
    if KEY_PREFIX + info.node_id != key:
        raise ValueError(f"names node {info.node_id!r}")
    return info, sealed_at


def document(value: str | bytes) -> dict[str, Any]:
    """A registry value as a JSON object; ValueError when it is too large or not one."""
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(value):,} bytes, over {MAX_RECORD_BYTES:,}")
    doc = _json(value)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def opened(key: str, doc: dict[str, Any], token: str | None) -> dict[str, Any]:
    """The object sealed in ``doc`` (``{"body": JSON text, "mac": hex}``) at ``key``, its MAC
    checked under ``token`` when there is one. Raises NotSealedForThisToken when it does not
    verify, ValueError when the body is not a JSON object."""
    body = doc.get("body")
    if not isinstance(body, str):
        raise ValueError("body is not a string")
    if token and not hmac.compare_digest(str(doc.get("mac", "")), mac(token, key, body)):
        raise NotSealedForThisToken("its seal does not verify under this store token (forged, or another "
                                    "cluster's, or the token is wrong)")
    inner = _json(body)
    if not isinstance(inner, dict):
        raise ValueError("body: not a JSON object")
    return inner
