"""The one error hierarchy of kvstore. Only the edges (gRPC servicers, the HTTP front
door, the CLIs) map these to status codes; a cache miss is ``None`` or 0, never an error."""
from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class CapacityError(KVStoreError):
    """A tier cannot make room for a block (too large, or everything left is leased/pinned)."""


class IntegrityError(KVStoreError):
    """Block bytes do not match the checksum taken at put."""


class LeaseExpired(KVStoreError):
    """A read outlived its lease; the bytes it would return cannot be trusted."""


class ReservationExpired(KVStoreError):
    """A two-phase put was written to or committed after its reservation timed out (or was
    aborted); its space is already free and the key was not stored."""


class InvalidArgument(KVStoreError):
    """A caller passed a value outside what the API accepts; the message says which."""


class Cancelled(KVStoreError):
    """The caller went away (its call was cancelled) before the work began; nothing was
    done for it. Mapped to gRPC CANCELLED."""


class Unavailable(KVStoreError):
    """A service kvstore depends on (a store node, an engine) cannot be reached."""


class QuotaExceeded(CapacityError):
    """A tenant's put would take its namespace over its byte quota and evicting the
    tenant's own blocks cannot make room (they are leased or pinned); the message names the
    namespace and the quota. Mapped to gRPC RESOURCE_EXHAUSTED."""


class FailedPrecondition(KVStoreError):
    """The node is not in the state the call needs (e.g. draining a node that has no
    cluster membership); the message says which. Mapped to gRPC FAILED_PRECONDITION."""


class Unauthenticated(Unavailable):
    """A store node refused the caller's credentials (a missing or wrong token). A subclass
    of :class:`Unavailable`: to a caller, a node that refuses it cannot be used either."""
