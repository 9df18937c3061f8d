"""The one translation between kvstore's errors (kvstore/errors.py) and the status a wire
carries: a gRPC status code (plus trailing metadata ``kvstore-error`` naming the class, so a
kvstore client gets the very class back while any other gRPC client reads the code), and the
status byte of a same-host / TCP control frame (kvstore/wire/frame_codec.py).

========================  ===================  ============
class                     gRPC status          frame status
========================  ===================  ============
InvalidArgument           INVALID_ARGUMENT     1
LeaseExpired              ABORTED              2
CapacityError             RESOURCE_EXHAUSTED   3
IntegrityError            DATA_LOSS            4
ReservationExpired        ABORTED              5
Unavailable               UNAVAILABLE          6
KVStoreError (any other)  INTERNAL             7
Unauthenticated           UNAUTHENTICATED      8
QuotaExceeded             RESOURCE_EXHAUSTED   9
FailedPrecondition        FAILED_PRECONDITION  10
========================  ===================  ============

The store API (kvstore/service.py), the same-host control channel and the Admin service
(kvstore/admin/) all answer through this table.

A gRPC failure with no kvstore class (the node is down, a deadline passed, an UNKNOWN from a
bug) reads as :class:`Unavailable` naming the code: a caller treats the node as gone.
Codes: https://grpc.github.io/grpc/core/md_doc_statuscodes.html
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvstore.errors import (
    CapacityError,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    QuotaExceeded,
    ReservationExpired,
    Unauthenticated,
    Unavailable,
)

ERROR_METADATA_KEY = "kvstore-error"
_CLASSES: tuple[type[KVStoreError], ...] = (InvalidArgument, LeaseExpired, CapacityError, IntegrityError,
                                            ReservationExpired, Unavailable, KVStoreError, Unauthenticated,
                                            QuotaExceeded, FailedPrecondition)
BY_NAME: dict[str, type[KVStoreError]] = {cls.__name__: cls for cls in _CLASSES}
GRPC_CODE: dict[type[KVStoreError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, LeaseExpired: grpc.StatusCode.ABORTED,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED, IntegrityError: grpc.StatusCode.DATA_LOSS,
    ReservationExpired: grpc.StatusCode.ABORTED, Unavailable: grpc.StatusCode.UNAVAILABLE,
    KVStoreError: grpc.StatusCode.INTERNAL, Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED, FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION}
# a code without the metadata (another server, an interceptor, the Admin service): the class it
# stands for; RESOURCE_EXHAUSTED is a tenant's quota there (a node names CapacityError itself)
_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceeded,
    grpc.StatusCode.DATA_LOSS: IntegrityError, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated, grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition}
FRAME_OK = 0
FRAME_ERRORS: dict[int, type[KVStoreError]] = {i: cls for i, cls in enumerate(_CLASSES, 1)}
_FRAME_STATUS = {cls: code for code, cls in FRAME_ERRORS.items()}


def kvstore_class(exc: BaseException) -> type[KVStoreError]:
    """The class of :data:`_CLASSES` ``exc`` is (its nearest base among them)."""
    for cls in type(exc).__mro__:
        if cls in GRPC_CODE:
            return cls
    return KVStoreError


# -- gRPC --------------------------------------------------------------------------------------
def grpc_abort(context: grpc.ServicerContext, exc: KVStoreError) -> NoReturn:
    """End a call with ``exc``'s status code and message, its class named in the trailing
    metadata (``kvstore-error``). Raises (as ``context.abort`` does)."""
    cls = kvstore_class(exc)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, cls.__name__),))
    context.abort(GRPC_CODE[cls], str(exc))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


F = TypeVar("F", bound=Callable[..., Any])


def refusing(method: F) -> F:
    """A servicer method (unary or streaming) whose kvstore errors, raised anywhere under it,
    end the call with their status (:func:`grpc_abort`) instead of gRPC's UNKNOWN."""
    @functools.wraps(method)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except KVStoreError as exc:
            grpc_abort(context, exc)
    return call  # type: ignore[return-value]


def from_rpc_error(exc: grpc.RpcError, address: str) -> KVStoreError:
    """The kvstore error a failed call on the node at ``address`` stands for: the class the
    node named, else the one its code stands for, else :class:`Unavailable` naming the code."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    named = next((m.value for m in trailing or () if m.key == ERROR_METADATA_KEY), None)
    cls = BY_NAME.get(named) if isinstance(named, str) else _BY_CODE.get(code) if code is not None else None
    where = f"store node at {address}: {code.name if code else 'error'}: {detail}"
    if cls is None or cls is KVStoreError:
        return Unavailable(where)
    return cls(where if issubclass(cls, Unavailable) else detail)  # a node it cannot use: say which


# -- control frames ----------------------------------------------------------------------------
def frame_status(exc: KVStoreError) -> int:
    """The status byte of a control frame answering ``exc``."""
    return _FRAME_STATUS[kvstore_class(exc)]


def frame_error(status: int, message: bytes) -> KVStoreError:
    """The error a control frame's non-zero ``status`` and its message stand for."""
    return FRAME_ERRORS.get(status, KVStoreError)(message.decode(errors="replace"))
