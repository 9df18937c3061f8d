"""What one call on a store node's wire may ask for, checked at the edges (the gRPC servicer,
the same-host Unix-socket and TCP control frames, the engines' servicer) before any work.

- A block key is what the key spec makes (kvstore/index/keys.py): 32 bytes (SHA-256) or 16
  bytes (XXH3-128); any other length is refused, naming the length and the valid ones.
- One call names at most :data:`MAX_KEYS_PER_CALL` keys (Lookup, Get, Pin, Unpin, a lease, a
  reservation, a commit, an abort), so no call holds a worker for long: a Get of 8192 keys
  (half of them held) took 0.65 s on this project's 2-core VM at a load average of 35, a
  Lookup 4 ms, where one Get of 200,000 keys took 22 s. A longer call is refused at once
  (200,000 keys: 43 ms), naming the limit; ``StoreClient`` splits longer chains itself
  (8192 blocks are 131,072 tokens at 16-token blocks).
- A TTL (pins, leases) is a finite number of seconds in (0, :data:`MAX_TTL_S`], or 0 for the
  node's default; NaN, infinities and negative values are refused.

Each check raises :class:`~kvstore.errors.InvalidArgument` with a message naming the field.

How long one stream may hold the store node's gRPC port (kvstore/service.py ``grpc_server``):

- Streams (Put, Get, Snapshot) run on their own :data:`STREAM_WORKERS` threads, never on the
  server's ``workers`` (Health, Lookup, Admin, the data plane's control calls): eight stalled
  streams sharing the node's 8 threads froze every call on its port, Health included.
- A stream that makes no progress for :data:`STREAM_IDLE_S` — a Put whose next chunk does not
  come, a Get or Snapshot whose reader takes no more bytes (HTTP/2 flow control), a streamed
  call whose request never comes — is ended ``DEADLINE_EXCEEDED`` with a message naming the
  limit; a Put's open reservation is aborted (no partial block). The time the node itself
  spends reading or writing blocks does not count, so a long transfer that keeps moving
  (a chain read in ``CHAIN_WINDOW_BYTES`` windows) is never cut.
- A stream whose peer trickles — one message every few seconds, each within the idle
  limit — is ended the same way once its waits on the peer add up to more than
  :data:`STREAM_IDLE_S` plus :data:`STREAM_WAIT_PER_MESSAGE_S` per message moved (messages
  carry up to 1 MiB of block bytes: a peer slower than about 1 MiB/s). A Put holds one
  block's reservation at a time (a header before the previous block is whole, or a chunk
  with neither key nor data, is ``INVALID_ARGUMENT``).
- At most :data:`MAX_OPEN_STREAMS` streams are open at once (running, or queued for a stream
  thread while their caller still waits); one more is refused at once,
  ``RESOURCE_EXHAUSTED`` (a ``CapacityError``), rather than queued behind stalled ones.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore.errors import InvalidArgument
from kvstore.index.keys import KEY_BYTES, VALID_KEY_BYTES

MAX_KEYS_PER_CALL = 8192
MAX_TTL_S = 86400.0            # a pin or lease asked for longer than a day is a mistake
STREAM_WORKERS = 16            # a store node's threads for streams (Put, Get, Snapshot)
STREAM_IDLE_S = 10.0           # a stream that moves no message for this long is ended
STREAM_WAIT_PER_MESSAGE_S = 1.0  # and one that waited on its peer longer than STREAM_IDLE_S + this per message
MAX_OPEN_STREAMS = 128         # streams running or queued for a stream thread; more are refused
_VALID_TEXT = " or ".join(f"{n} ({name})" for name, n in sorted(KEY_BYTES.items(), key=lambda kv: kv[1]))


def check_key(key: bytes, field: str = "key", allow_empty: bool = False) -> None:
    """Refuse a block key of a length the key spec cannot make (``allow_empty``: b"" too,
    where the wire uses it for "none"). Raises InvalidArgument naming ``field``."""
    n = len(key)
    if n in VALID_KEY_BYTES or (allow_empty and n == 0):
        return
    raise InvalidArgument(f"{field}: a block key of {n} bytes; the key spec makes {_VALID_TEXT} bytes")


def check_count(n: int, field: str = "keys", limit: int = MAX_KEYS_PER_CALL) -> None:
    """Refuse a call naming more than ``limit`` items. Raises InvalidArgument."""
    if n > limit:
        raise InvalidArgument(f"{field}: {n} in one call; at most {limit} (split the call)")


def check_keys(keys: Sequence[bytes], field: str = "keys", allow_empty: bool = False,
               limit: int = MAX_KEYS_PER_CALL) -> None:
    """:func:`check_count` and :func:`check_key` of each of ``keys``."""
    check_count(len(keys), field, limit)
    for i, key in enumerate(keys):
        if len(key) not in VALID_KEY_BYTES:
            check_key(key, f"{field}[{i}]", allow_empty)


def check_ttl(ttl_s: float | None, field: str = "ttl_s", limit: float = MAX_TTL_S) -> float | None:
    """A TTL as the pool takes it: None for 0/None (the node's default), else seconds in
    ``(0, limit]``. Raises InvalidArgument for NaN, an infinity, a negative or a longer one."""
    if ttl_s is None or ttl_s == 0:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) \
            or not 0 < ttl_s <= limit:
        raise InvalidArgument(f"{field} {ttl_s!r}: 0 (the node's default) or a number of seconds "
                              f"in (0, {limit:.0f}]")
    return float(ttl_s)


# The longest key a store node keeps internally (the same-host data plane's spare slots are
# reserved under placeholder keys before their block's key is known); the wire takes only
# the key spec's lengths (:func:`check_key`).
MAX_KEY_BYTES = 64
