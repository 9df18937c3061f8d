"""A client of a store node's Admin service (protos/admin.proto), for kvctl. Replies are
plain dicts (protobuf's JSON mapping field names, keys as hex), ready to print as JSON."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import grpc
from google.protobuf.json_format import MessageToDict

from kvstore.auth import bearer_metadata
from kvstore.wire.errors import from_rpc_error
from protos import admin_pb2 as apb
from protos import admin_pb2_grpc as apb_grpc


def _hexify(value: Any, key: str = "") -> Any:
    """MessageToDict writes bytes as base64; block keys read better (and match kvctl's
    arguments) as hex."""
    import base64
    if isinstance(value, dict):
        return {k: _hexify(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_hexify(v, key) for v in value]
    if key in ("key", "parent", "done") and isinstance(value, str):
        return base64.b64decode(value).hex()
    # a uint64 above 2**53 stays quoted: the checksum and byte counts (a quota of 2**64 - 1)
    if (key == "checksum" or key.endswith("bytes")) and isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def to_dict(msg: Any) -> dict[str, Any]:
    """A reply as a dict: snake_case fields, defaults included, uint64s as ints, keys hex."""
    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
                      unquote_int64_if_possible=True)
    return _hexify(d)


class AdminClient:
    """Admin calls on the node at ``address`` (host:port) with the store token ``token``.
    Raises the kvstore error the node answered (kvstore/wire/errors.py): InvalidArgument for
    a refused argument, FailedPrecondition, Unauthenticated for a missing or wrong token (an
    Unavailable naming UNAUTHENTICATED), Unavailable when the node cannot be reached."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = apb_grpc.AdminStub(self._channel)
        self._meta = bearer_metadata(token)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> dict[str, Any]:
        try:
            reply = getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._meta)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None
        return to_dict(reply)

    def list_blocks(self, tier: str | None = None, namespace: str | None = None, key_prefix: str = "",
                    limit: int = 0) -> dict[str, Any]:
        req = apb.ListBlocksRequest(tier=tier or "", key_prefix=key_prefix, limit=limit)
        if namespace is not None:
            req.namespace = namespace
        return self._call("ListBlocks", req)

    def inspect(self, key: bytes) -> dict[str, Any]:
        return self._call("Inspect", apb.InspectRequest(key=key))

    def keys_call(self, method: str, keys: Sequence[bytes], prefixes: Sequence[str] = ()) -> dict[str, Any]:
        """``Remove``, ``Demote`` or ``Promote`` of ``keys`` and every key starting with a
        hex prefix in ``prefixes``."""
        return self._call(method, apb.KeysRequest(keys=list(keys), key_prefixes=list(prefixes)))

    def flush(self, tier: str | None = None, namespace: str | None = None, force: bool = False) -> dict[str, Any]:
        req = apb.FlushRequest(tier=tier or "", force=force)
        if namespace is not None:
            req.namespace = namespace
        return self._call("Flush", req)

    def evict(self, tier: str, nbytes: int) -> dict[str, Any]:
        return self._call("Evict", apb.EvictRequest(tier=tier, bytes=nbytes))

    def set_draining(self, draining: bool) -> dict[str, Any]:
        return self._call("SetDraining", apb.DrainRequest(draining=draining))

    def stats(self) -> dict[str, Any]:
        return self._call("Stats", apb.StatsRequest())

    def quota(self, method: str, namespace: str, nbytes: int = 0) -> dict[str, Any]:
        """``SetQuota``, ``GetQuota`` or ``RemoveQuota``."""
        return self._call(method, apb.QuotaRequest(namespace=namespace, bytes=nbytes))

    def list_quotas(self) -> dict[str, Any]:
        return self._call("ListQuotas", apb.ListQuotasRequest())
