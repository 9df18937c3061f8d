"""What a pool user needs of the pool: :class:`BlockStore`, the calls that both a client of
one store node (:class:`kvstore.client.StoreClient`) and a client of a cluster of them
(:class:`kvstore.cluster.client.ClusterClient`) answer, so that the engines and the
scheduler work with either. A structural type (:class:`typing.Protocol`): neither client
inherits from it."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.wire.types import LookupResult, PutResult


class BlockStore(Protocol):
    """Block reads, writes and prefix lookups, by key (bytes), on one node or a cluster.

    A call may raise :class:`kvstore.errors.KVStoreError`: ``Unavailable`` when the store
    cannot be reached, ``InvalidArgument`` when it rejects the request as malformed. A
    cluster client answers a failed node's share as misses (reads, lookups) or as results
    with ``ok=False`` (puts) instead.
    """

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse", namespace: str | None = None) -> LookupResult:
        """Longest prefix of the key chain ``keys`` (head first) that the store holds, and
        the tier of each of its blocks; renews nothing. ``purpose``: reuse, handoff or probe
        (what the store's lookup books count it as: kvstore/pool/reads.py); ``namespace``:
        the tenant looking (None: not said)."""
        ...

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Bytes of each key, None for a miss; with ``stop_at_miss`` the list ends at the
        first miss."""
        ...

    def put_blocks(self, blocks: Sequence[tuple[bytes, bytes]], chain: bool = False,
                   parent: bytes | None = None, namespace: str | None = None) -> list[PutResult]:
        """Put ``(key, bytes)`` blocks; one result per block, in order. ``chain``: the blocks
        form one prefix chain (head first) extending ``parent``, so the tail is evicted
        before the head. ``namespace``: the tenant the blocks belong to (kvstore/pool/tenants.py:
        per-tenant accounting and byte quotas; None: unattributed); its quota refusing a
        block is ``QuotaExceeded`` from one node, ``ok=False`` naming it from a cluster."""
        ...

    def close(self) -> None:
        """Release channels and mappings; the store is not used after."""
        ...
