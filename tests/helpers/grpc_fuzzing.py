"""Fuzzing any gRPC service of this project from its descriptor: a hypothesis strategy for
each request message (fields drawn by type, with the values that break things — keys of
every length, NaN and infinite floats, the largest integers — mixed with plausible ones),
and :func:`call_fuzzed`, which sends one request over a real channel and checks the answer
is a clean one: OK or a status the servicer chose (never UNKNOWN, the mark of an exception
that escaped it, and never a hang)."""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import strategies as st

TIMEOUT_S = 20.0
# statuses a servicer answers on purpose; UNKNOWN (an exception escaped), DEADLINE_EXCEEDED
# (a hang) and the rest are failures
CLEAN = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE})

_KEY_LENGTHS = st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33, 56, 64, 65])
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -1.0, 1e-9, 1.0, 5.0, 3600.0, 1e300]))


def _ints(bits: int, signed: bool = False) -> st.SearchStrategy[int]:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return st.one_of(st.integers(0, 4), st.integers(lo, hi), st.sampled_from([lo, hi]))


def _scalar(field: FD, keys: st.SearchStrategy[bytes], overrides: dict[str, st.SearchStrategy[Any]],
            strings: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    if field.name in overrides:
        return overrides[field.name]
    t = field.type
    if t == FD.TYPE_BYTES:
        return keys if "key" in field.name or field.name == "parent" else st.binary(max_size=256)
    if t == FD.TYPE_STRING:
        return strings
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return _FLOATS
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return _ints(64)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return _ints(32)
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return _ints(64, signed=True)
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32, FD.TYPE_ENUM):
        return _ints(32, signed=True)
    raise NotImplementedError(f"field {field.full_name} of type {t}")


def message(cls: type, known_keys: list[bytes] = (), overrides: dict[str, st.SearchStrategy[Any]] | None = None,
            strings: list[str] = (), max_repeated: int = 6,
            lists: dict[str, st.SearchStrategy[list[Any]]] | None = None) -> st.SearchStrategy[Any]:
    """Requests of message class ``cls``: each field set or left unset at random. Keys
    (bytes fields named ``*key*`` or ``parent``) are of every length or one of
    ``known_keys``; strings are random or one of ``strings``; ``overrides`` maps a field
    name to its own strategy (for a repeated field: of one item), ``lists`` a repeated
    field's name to a strategy of whole lists."""
    overrides, lists = overrides or {}, lists or {}
    keys = st.one_of(_KEY_LENGTHS.flatmap(lambda n: st.binary(min_size=n, max_size=n)),
                     *( [st.sampled_from(list(known_keys))] if known_keys else []))
    text = st.one_of(st.text(max_size=40), *([st.sampled_from(list(strings))] if strings else []))
    fields = {}
    for f in cls.DESCRIPTOR.fields:
        if f.type in (FD.TYPE_MESSAGE, FD.TYPE_GROUP):
            continue  # no request of this project nests messages
        if f.name in lists:
            fields[f.name] = lists[f.name]
            continue
        one = _scalar(f, keys, overrides, text)
        fields[f.name] = st.lists(one, max_size=max_repeated) if f.is_repeated else one
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def call_fuzzed(channel: grpc.Channel, service: str, method: Any, request: Any,
                metadata: tuple = ()) -> tuple[grpc.StatusCode, Any]:
    """Call ``method`` (a MethodDescriptor of ``service``) with ``request`` (a message, or a
    list of them for a client stream) and consume the whole answer. Returns (status, the
    response or the list of streamed ones). Raises AssertionError for an unclean status."""
    path = f"/{service}/{method.name}"
    out_cls = _class_of(method.output_type)
    ser, de = (lambda m: m.SerializeToString()), out_cls.FromString
    kind = (method.client_streaming, method.server_streaming)
    try:
        if kind == (False, False):
            resp = channel.unary_unary(path, ser, de)(request, timeout=TIMEOUT_S, metadata=metadata)
        elif kind == (False, True):
            resp = list(channel.unary_stream(path, ser, de)(request, timeout=TIMEOUT_S, metadata=metadata))
        elif kind == (True, False):
            resp = channel.stream_unary(path, ser, de)(iter(request), timeout=TIMEOUT_S, metadata=metadata)
        else:
            resp = list(channel.stream_stream(path, ser, de)(iter(request), timeout=TIMEOUT_S, metadata=metadata))
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in CLEAN, f"{method.name}({request!r:.300}) -> {code.name}: {exc.details()}"
        assert exc.details(), f"{method.name}: {code.name} without a message"
        return code, None
    return grpc.StatusCode.OK, resp


def call_raw(channel: grpc.Channel, service: str, method: Any, raw: bytes,
             metadata: tuple = ()) -> grpc.StatusCode:
    """Send ``raw`` bytes as the serialized request of ``method``; a request that does not
    parse may be INTERNAL (gRPC's own answer), anything else as :func:`call_fuzzed`."""
    path = f"/{service}/{method.name}"
    kind = (method.client_streaming, method.server_streaming)

    def ident(b: bytes) -> bytes:
        return b

    try:
        if kind == (False, False):
            channel.unary_unary(path, ident, ident)(raw, timeout=TIMEOUT_S, metadata=metadata)
        elif kind == (False, True):
            list(channel.unary_stream(path, ident, ident)(raw, timeout=TIMEOUT_S, metadata=metadata))
        elif kind == (True, False):
            channel.stream_unary(path, ident, ident)(iter([raw]), timeout=TIMEOUT_S, metadata=metadata)
        else:
            list(channel.stream_stream(path, ident, ident)(iter([raw]), timeout=TIMEOUT_S, metadata=metadata))
    except grpc.RpcError as exc:
        code = exc.code()
        parse_error = code == grpc.StatusCode.INTERNAL and "deserializ" in (exc.details() or "").lower()
        assert code in CLEAN or parse_error, f"{method.name}(raw {raw[:64].hex()}) -> {code.name}: {exc.details()}"
        return code
    return grpc.StatusCode.OK


_CLASSES: dict[str, type] = {}


def _class_of(desc: Any) -> type:
    from google.protobuf import message_factory
    if desc.full_name not in _CLASSES:
        _CLASSES[desc.full_name] = message_factory.GetMessageClass(desc)
    return _CLASSES[desc.full_name]


def request_class(method: Any) -> type:
    return _class_of(method.input_type)


def assert_stops(server: grpc.Server, timeout_s: float = 10.0) -> None:
    """Stop ``server`` and fail if that takes longer than ``timeout_s`` (``stop`` itself can
    block forever on a call gRPC left unfinished)."""
    import threading
    t = threading.Thread(target=lambda: server.stop(grace=None).wait(), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the gRPC server did not stop within {timeout_s} s"
