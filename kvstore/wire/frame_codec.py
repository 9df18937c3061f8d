"""The codec of the light control channel (a Unix domain socket for same-host clients, TCP
for transfer-engine readers): every frame ↔ the domain types of kvstore/wire/types.py, both
directions, in this one module. No pickle: struct-packed, little-endian. The socket I/O is
kvstore/dataplane/framing.py; the error status byte is kvstore/wire/errors.py's.

Frame: ``<B op | status> <I payload bytes>`` then the payload. A request gets exactly one
reply, except RELEASE, which gets none (a reader releases its lease without waiting).

- HELLO: auth token (utf-8) → empty.
- LOOKUP: keys → ``<I`` prefix blocks, tier names joined by ``,``.
- LEASE: ``<dB`` ttl seconds, flags (1: stop at miss, 2: chain); keys → ``<Qd`` lease id,
  deadline; per key ``<QQQQ`` state, offset, size, checksum.
- RELEASE: ``<Q`` lease id → no reply.
- RESERVE: ``<B`` flags (2: chain, 4: a namespace follows); with flag 4 the namespace
  (``<H`` length + utf-8); parent (keys, 0 or 1); keys; ``<Q`` size per key → per key
  ``<BQQd`` state (0 open, 1 existed, 2 failed, 3 over the namespace's quota), reservation
  id, offset, write-by time (monotonic seconds); then the errors of the failed and refused ones.
- COMMIT: ``<I`` n, ``<Q`` per reservation id; the keys to commit as and their parents, n of
  each or none (b"" or none: keep, no parent); ``<QI`` size, count of spare slots wanted;
  ``<B`` sections: 1 = ``<Q`` per id, the writer's xxh3_64 of each filled slot (absent: the
  node checksums the slots);
  2 = ``<I`` count, ``<Q`` each: spare slots of this connection given back unused;
  4 = the namespace (``<H`` length + utf-8) the blocks belong to, assigned to each at commit
  (a spare slot was reserved before its tenant was known) → per id
  ``<B`` 0 stored, 1 existed, 2 failed; the failed ones' errors. When the commit succeeded
  and asked for spares, a second frame follows the reply: ``<QI`` size, count granted,
  ``<BQQd`` each (the node reserves them after replying, while the writer copies on).
  A client may send several COMMITs before reading their replies (they come in order).
- ABORT: ``<Q`` per reservation id → empty.

Keys: ``<IB`` count, length (all keys that long, concatenated) or length 0 (each key
prefixed by its ``<B`` length). Errors: ``<H`` length + utf-8 each. A reply with a non-zero
status carries the error message; the status names its class (kvstore/wire/errors.py).
Every decoder of a request raises InvalidArgument (or struct.error / IndexError, which the
server answers as InvalidArgument) for a malformed payload.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.errors import InvalidArgument
from kvstore.limits import check_count, check_key
from kvstore.pool.quotas import check_namespace
from kvstore.wire.errors import FRAME_ERRORS, FRAME_OK
from kvstore.wire.types import (
    SLOT_FAILED,
    SLOT_QUOTA,
    BlockLocation,
    LeaseGrant,
    LeaseRequest,
    LookupResult,
    PutResult,
    ReserveRequest,
    SlotGrant,
)

HEADER = struct.Struct("<BI")
OP_HELLO, OP_LOOKUP, OP_LEASE, OP_RELEASE, OP_RESERVE, OP_COMMIT, OP_ABORT = range(1, 8)
FLAG_STOP_AT_MISS, FLAG_CHAIN, FLAG_NAMESPACE = 1, 2, 4
COMMIT_CHECKSUMS, COMMIT_GIVE_BACK, COMMIT_NAMESPACE = 1, 2, 4  # the COMMIT frame's optional sections
LEASE_HEAD = struct.Struct("<dB")
LEASE_REPLY = struct.Struct("<Qd")
LOCATION = struct.Struct("<QQQQ")
SLOT = struct.Struct("<BQQd")
SPARE_ASK = struct.Struct("<QI")
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
KEYS_HEAD = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096          # any frame before the connection's token was checked
MAX_LEASE_KEYS = (MAX_FRAME_BYTES - LEASE_REPLY.size) // LOCATION.size  # a LEASE reply fits a frame
OK = FRAME_OK
ERRORS = FRAME_ERRORS
_COMMIT_CODE = {(True, False): 0, (True, True): 1}  # (ok, existed) -> code; anything else 2


# -- keys and errors ---------------------------------------------------------------------------
def encode_keys(keys: Sequence[bytes]) -> bytes:
    n = len(keys)
    length = len(keys[0]) if n else 0
    if n and 0 < length < 256 and all(len(k) == length for k in keys):
        return KEYS_HEAD.pack(n, length) + b"".join(keys)
    if any(len(k) > 255 for k in keys):
        raise InvalidArgument("a block key is at most 255 bytes on the control channel")
    return KEYS_HEAD.pack(n, 0) + b"".join(bytes((len(k),)) + k for k in keys)


def decode_keys(buf: bytes, pos: int, allow_empty: bool = False) -> tuple[list[bytes], int]:
    """Keys at ``pos`` of ``buf`` and the position after them. Raises InvalidArgument for a
    truncated list, more than :data:`~kvstore.limits.MAX_KEYS_PER_CALL` keys, or a key of a
    length the key spec cannot make (``allow_empty``: b"" too, the wire's "none")."""
    if pos + KEYS_HEAD.size > len(buf):
        raise InvalidArgument("truncated key list")
    n, length = KEYS_HEAD.unpack_from(buf, pos)
    pos += KEYS_HEAD.size
    check_count(n)
    if length:
        check_key(b"\0" * length, "keys")
        end = pos + n * length
        if end > len(buf):
            raise InvalidArgument("truncated key list")
        return [buf[i:i + length] for i in range(pos, end, length)], end
    keys = []
    for i in range(n):
        if pos >= len(buf):
            raise InvalidArgument("truncated key list")
        k = buf[pos]
        if pos + 1 + k > len(buf):
            raise InvalidArgument("truncated key list")
        key = buf[pos + 1:pos + 1 + k]
        check_key(key, f"keys[{i}]", allow_empty)
        keys.append(key)
        pos += 1 + k
    return keys, pos


def encode_errors(errors: Sequence[str]) -> bytes:
    out = []
    for e in errors:
        raw = e.encode()[:65535]
        out.append(struct.pack("<H", len(raw)) + raw)
    return b"".join(out)


def decode_errors(buf: bytes, pos: int, count: int) -> list[str]:
    out = []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", buf, pos)
        out.append(bytes(buf[pos + 2:pos + 2 + n]).decode(errors="replace"))
        pos += 2 + n
    return out


def _ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}Q", *ids)


def encode_namespace(namespace: str) -> bytes:
    """``<H`` length + utf-8 of a put's tenant."""
    raw = namespace.encode()
    if len(raw) > 65535:
        raise InvalidArgument(f"a namespace of {len(raw)} bytes does not fit a frame")
    return struct.pack("<H", len(raw)) + raw


def decode_namespace(buf: bytes, pos: int) -> tuple[str, int]:
    """The namespace at ``pos`` of ``buf`` (checked: kvstore/pool/quotas.py ``check_namespace``)
    and the position after it. Raises InvalidArgument for a truncated or malformed one."""
    if pos + 2 > len(buf):
        raise InvalidArgument("truncated namespace")
    (n,) = struct.unpack_from("<H", buf, pos)
    if pos + 2 + n > len(buf):
        raise InvalidArgument("truncated namespace")
    try:
        value = bytes(buf[pos + 2:pos + 2 + n]).decode()
    except UnicodeDecodeError:
        raise InvalidArgument("a namespace that is not utf-8") from None
    return check_namespace(value), pos + 2 + n


def _failed(state: int) -> bool:
    return state == SLOT_FAILED or state == SLOT_QUOTA


# -- LOOKUP ------------------------------------------------------------------------------------
LOOKUP_PURPOSES = ("reuse", "handoff", "probe")   # the byte after the keys: its index


def lookup_request(keys: Sequence[bytes], purpose: str = "reuse", namespace: str | None = None) -> bytes:
    """The keys, then one byte: the lookup's purpose (kvstore/pool/reads.py), then the
    tenant looking (ASCII, to the end of the frame; none: not said)."""
    return encode_keys(keys) + bytes((LOOKUP_PURPOSES.index(purpose),)) + (namespace or "").encode("ascii")


def decode_lookup_request(buf: bytes) -> tuple[list[bytes], str, str | None]:
    """(keys, purpose, namespace or None); a frame without the purpose byte is a reuse
    lookup, an unknown purpose a probe (counted nowhere). Raises InvalidArgument for a
    malformed namespace."""
    keys, pos = decode_keys(buf, 0)
    if pos >= len(buf):
        return keys, "reuse", None
    code = buf[pos]
    purpose = LOOKUP_PURPOSES[code] if code < len(LOOKUP_PURPOSES) else "probe"
    rest = buf[pos + 1:]
    if not rest:
        return keys, purpose, None
    try:
        return keys, purpose, check_namespace(rest.decode("ascii"))
    except UnicodeDecodeError:
        raise InvalidArgument("a lookup's namespace is printable ASCII") from None


def lookup_reply(result: LookupResult) -> bytes:
    return U32.pack(result.blocks) + ",".join(result.tiers).encode()


def decode_lookup_reply(reply: bytes) -> LookupResult:
    (n,) = U32.unpack_from(reply, 0)
    return LookupResult(n, tuple(reply[4:].decode().split(",")) if n else ())


# -- LEASE / RELEASE ---------------------------------------------------------------------------
def lease_request(req: LeaseRequest) -> bytes:
    flags = (FLAG_STOP_AT_MISS if req.stop_at_miss else 0) | (FLAG_CHAIN if req.chain else 0)
    return LEASE_HEAD.pack(req.ttl_s or 0.0, flags) + encode_keys(req.keys)


def decode_lease_request(p: bytes) -> LeaseRequest:
    """At most MAX_KEYS_PER_CALL keys, so the reply fits a frame."""
    ttl, flags = LEASE_HEAD.unpack_from(p, 0)
    keys, _ = decode_keys(p, LEASE_HEAD.size)
    return LeaseRequest(keys, ttl or None, bool(flags & FLAG_STOP_AT_MISS), bool(flags & FLAG_CHAIN))


def lease_reply(lease_id: int, deadline: float, flat: Sequence[int]) -> bytes:
    """``flat``: state, offset, size, checksum per key (DataPlaneHost.lease_flat)."""
    return LEASE_REPLY.pack(lease_id, deadline) + struct.pack(f"<{len(flat)}Q", *flat)


def decode_lease_reply(reply: bytes) -> LeaseGrant:
    lease_id, deadline = LEASE_REPLY.unpack_from(reply, 0)
    blocks = [BlockLocation(*t) for t in LOCATION.iter_unpack(memoryview(reply)[LEASE_REPLY.size:])]
    return LeaseGrant(lease_id, deadline, blocks)


def release_request(lease_id: int) -> bytes:
    return U64.pack(lease_id)


def decode_release_request(p: bytes) -> int:
    """Raises InvalidArgument for a payload that is not one lease id."""
    if len(p) != U64.size:
        raise InvalidArgument(f"malformed RELEASE frame of {len(p)} bytes")
    return int(U64.unpack(p)[0])


# -- RESERVE -----------------------------------------------------------------------------------
def reserve_request(req: ReserveRequest) -> bytes:
    flags = (FLAG_CHAIN if req.chain else 0) | (FLAG_NAMESPACE if req.namespace else 0)
    return (bytes((flags,)) + (encode_namespace(req.namespace) if req.namespace else b"")
            + encode_keys([req.parent] if req.parent else [])
            + encode_keys([k for k, _ in req.items]) + struct.pack(f"<{len(req.items)}Q", *(s for _, s in req.items)))


def decode_reserve_request(p: bytes) -> ReserveRequest:
    """Raises InvalidArgument for a malformed payload, including more than one parent."""
    flags, pos = p[0], 1
    namespace = None
    if flags & FLAG_NAMESPACE:
        namespace, pos = decode_namespace(p, pos)
    parents, pos = decode_keys(p, pos, allow_empty=True)
    if len(parents) > 1:
        raise InvalidArgument(f"parent: RESERVE carries {len(parents)} parents; at most 1 (the key the first "
                              "block extends)")
    keys, pos = decode_keys(p, pos)
    sizes = struct.unpack_from(f"<{len(keys)}Q", p, pos)
    return ReserveRequest(list(zip(keys, sizes)), bool(flags & FLAG_CHAIN), parents[0] if parents else None,
                          namespace)


def slots(grants: Sequence[SlotGrant]) -> bytes:
    """The ``<BQQd`` records of ``grants`` (a RESERVE reply's, a spare grant's)."""
    return b"".join(SLOT.pack(g.state, g.res_id, g.offset, g.write_by) for g in grants)


def reserve_reply(grants: Sequence[SlotGrant]) -> bytes:
    return slots(grants) + encode_errors([g.error for g in grants if _failed(g.state)])


def decode_reserve_reply(reply: bytes, n: int) -> list[SlotGrant]:
    end = n * SLOT.size
    raw = list(SLOT.iter_unpack(memoryview(reply)[:end]))
    errors = iter(decode_errors(reply, end, sum(_failed(s) for s, _, _, _ in raw)))
    return [SlotGrant(s, rid, off, next(errors) if _failed(s) else "", by) for s, rid, off, by in raw]


def spare_grant(size: int, grants: Sequence[SlotGrant]) -> bytes:
    """The frame of spare slots that follows a COMMIT reply which asked for some."""
    return SPARE_ASK.pack(size, len(grants)) + slots(grants)


def decode_spare_grant(frame: bytes) -> list[tuple[int, SlotGrant]]:
    size, count = SPARE_ASK.unpack_from(frame, 0)
    return [(size, SlotGrant(st, rid, off, "", by)) for st, rid, off, by in
            SLOT.iter_unpack(memoryview(frame)[SPARE_ASK.size:SPARE_ASK.size + count * SLOT.size])]


# -- COMMIT / ABORT ----------------------------------------------------------------------------
class CommitRequest(NamedTuple):
    """A COMMIT: filled slots ``res_ids`` named ``keys`` (b"": keep the reserved key) with
    chain ``parents`` (b"" / None: none); ``spare`` = (size, count) slots wanted for the next
    puts; ``checksums``: the writer's xxh3_64 per slot (None: the node takes them);
    ``give_back``: unused spare slots to abort; ``namespace``: the tenant each block is
    assigned to at commit (None: as reserved)."""

    res_ids: Sequence[int]
    keys: Sequence[bytes]
    parents: Sequence[bytes | None] | None = None
    spare: tuple[int, int] = (0, 0)
    checksums: Sequence[int] | None = None
    give_back: Sequence[int] = ()
    namespace: str | None = None


def commit_request(req: CommitRequest) -> bytes:
    n, give_back, checksums, namespace = len(req.res_ids), req.give_back, req.checksums, req.namespace
    sections = ((COMMIT_CHECKSUMS if checksums else 0) | (COMMIT_GIVE_BACK if give_back else 0)
                | (COMMIT_NAMESPACE if namespace else 0))
    return (U32.pack(n) + _ids(req.res_ids) + encode_keys(req.keys)
            + encode_keys([p or b"" for p in req.parents] if req.parents else [b""] * n)
            + SPARE_ASK.pack(*req.spare) + bytes((sections,)) + (_ids(checksums) if checksums else b"")
            + (U32.pack(len(give_back)) + _ids(give_back) if give_back else b"")
            + (encode_namespace(namespace) if namespace else b""))


def decode_commit_request(p: bytes) -> CommitRequest:
    """Raises InvalidArgument for a malformed payload, including keys, parents or checksums
    that are not one per reservation id (keys and parents may also be none at all)."""
    (n,) = U32.unpack_from(p, 0)
    check_count(n, "reservation ids")
    ids = struct.unpack_from(f"<{n}Q", p, 4)
    keys, pos = decode_keys(p, 4 + 8 * n, allow_empty=True)
    parents, pos = decode_keys(p, pos, allow_empty=True)
    for name, got in (("keys", keys), ("parents", parents)):
        if got and len(got) != n:
            raise InvalidArgument(f"{name}: COMMIT of {n} reservation ids carries {len(got)} {name}; "
                                  "one per id (or none)")
    spare = SPARE_ASK.unpack_from(p, pos)
    sections = p[pos + SPARE_ASK.size]
    pos += SPARE_ASK.size + 1
    checksums = None
    if sections & COMMIT_CHECKSUMS:
        if pos + 8 * n > len(p):
            raise InvalidArgument(f"checksums: COMMIT of {n} reservation ids carries {(len(p) - pos) // 8} "
                                  "checksums; one per id")
        checksums = struct.unpack_from(f"<{n}Q", p, pos)
        pos += 8 * n
    back: tuple[int, ...] = ()
    if sections & COMMIT_GIVE_BACK:
        (m,) = U32.unpack_from(p, pos)
        check_count(m, "spare ids given back")
        back = struct.unpack_from(f"<{m}Q", p, pos + 4)
        pos += 4 + 8 * m
    namespace = None
    if sections & COMMIT_NAMESPACE:
        namespace, pos = decode_namespace(p, pos)
    if pos != len(p):
        raise InvalidArgument(f"commit frame has {len(p) - pos} bytes past its sections")
    return CommitRequest(ids, keys, [q or None for q in parents], (spare[0], spare[1]), checksums, back, namespace)


def commit_reply(results: Sequence[PutResult]) -> bytes:
    codes = bytes(_COMMIT_CODE.get((r.ok, r.existed), 2) for r in results)
    return codes + encode_errors([r.error for r in results if not r.ok])


def decode_commit_reply(reply: bytes, keys: Sequence[bytes]) -> list[PutResult]:
    n = len(keys)
    codes = reply[:n]
    it = iter(decode_errors(reply, n, sum(c == 2 for c in codes)))
    return [PutResult(k, c != 2, c == 1, next(it) if c == 2 else "") for k, c in zip(keys, codes)]


def abort_request(res_ids: Sequence[int]) -> bytes:
    return _ids(res_ids)


def decode_abort_request(p: bytes) -> tuple[int, ...]:
    check_count(len(p) // 8, "reservation ids")
    return struct.unpack(f"<{len(p) // 8}Q", p)
