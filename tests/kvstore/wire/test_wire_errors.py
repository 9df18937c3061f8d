"""The one error translation (kvstore/wire/errors.py): every kvstore error class raised by a
servicer reaches a kvstore client as that class with its message, over a real gRPC server,
and as that class over a real control-channel socket; a client that is not kvstore's reads
the documented gRPC status code. A failure with no kvstore class reads as Unavailable."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from kvstore.dataplane import framing
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
from kvstore.wire.errors import GRPC_CODE, frame_error, frame_status, from_rpc_error, refusing

CLASSES = [InvalidArgument, LeaseExpired, CapacityError, IntegrityError, ReservationExpired, Unavailable,
           Unauthenticated, KVStoreError, QuotaExceeded, FailedPrecondition]
CODES = {InvalidArgument: "INVALID_ARGUMENT", LeaseExpired: "ABORTED", CapacityError: "RESOURCE_EXHAUSTED",
         IntegrityError: "DATA_LOSS", ReservationExpired: "ABORTED", Unavailable: "UNAVAILABLE",
         Unauthenticated: "UNAUTHENTICATED", KVStoreError: "INTERNAL", QuotaExceeded: "RESOURCE_EXHAUSTED",
         FailedPrecondition: "FAILED_PRECONDITION"}


class Raiser:
    """A servicer whose method ``Raise`` raises the class its request names."""

    @refusing
    def Raise(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cls = next(c for c in CLASSES if c.__name__ == request.decode())
        raise cls(f"a {cls.__name__} from the node")


@pytest.fixture(scope="module")
def raiser() -> Iterator[grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    method = grpc.unary_unary_rpc_method_handler(Raiser().Raise)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Raiser", {"Raise": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(grace=None).wait()


def _call(channel: grpc.Channel, name: str) -> Any:
    return channel.unary_unary("/test.Raiser/Raise")(name.encode(), timeout=10)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_error_crosses_grpc_as_its_class_and_code(raiser: grpc.Channel, cls: type[KVStoreError]) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _call(raiser, cls.__name__)
    assert caught.value.code().name == CODES[cls] == GRPC_CODE[cls].name   # what any gRPC client reads
    got = from_rpc_error(caught.value, "127.0.0.1:1")
    if cls is KVStoreError:   # no class of its own: the node is not usable
        assert type(got) is Unavailable and "INTERNAL" in str(got)
        return
    assert type(got) is cls and f"a {cls.__name__} from the node" in str(got)
    if issubclass(cls, Unavailable):   # says which node and what it answered
        assert "store node at 127.0.0.1:1" in str(got) and CODES[cls] in str(got)


def test_a_failure_without_a_class_is_unavailable() -> None:
    with grpc.insecure_channel("127.0.0.1:1") as channel:   # nothing listens there
        with pytest.raises(grpc.RpcError) as caught:
            _call(channel, "InvalidArgument")
    got = from_rpc_error(caught.value, "127.0.0.1:1")
    assert type(got) is Unavailable and "UNAVAILABLE" in str(got)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_error_crosses_a_control_socket_as_its_class(cls: type[KVStoreError]) -> None:
    node, client = socket.socketpair()
    with node, client:
        framing.write_frame(node, frame_status(cls("the reason")), b"the reason")
        status, reply = framing.read_frame(client)
        got = frame_error(status, reply)
    assert type(got) is cls and str(got) == "the reason"


def test_frame_status_bytes_are_distinct_and_stable() -> None:
    """The status byte is on the wire: these values must not change."""
    assert [frame_status(c("")) for c in CLASSES] == [1, 2, 3, 4, 5, 6, 8, 7, 9, 10]
