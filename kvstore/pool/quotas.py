"""Per-tenant byte quotas of one store node, kept in a JSON file in the node's data
directory (``<data_dir>/<node_id>/quotas.json``, mode 0600; never pickle), so they survive
a restart. The file::

    {"version": 1, "quotas": {"key-0123456789abcdef": 1073741824, ...}}

A quota is a hard limit, in bytes, on the blocks one namespace holds on this node (each
block counted once at its size, whichever tiers hold copies). Enforced at put by
:class:`kvstore.pool.tenants.TenantBooks`.
"""
from __future__ import annotations

import json
import os
import threading

from kvstore.errors import InvalidArgument

QUOTA_FILE = "quotas.json"
FORMAT_VERSION = 1
MAX_NAMESPACE_CHARS = 256


def check_namespace(namespace: str) -> str:
    """``namespace`` if it names a tenant (1-256 printable ASCII characters: what a gRPC
    metadata value carries, https://grpc.io/docs/guides/metadata/, so every wire takes the
    same names); raises InvalidArgument otherwise."""
    if not isinstance(namespace, str) or not namespace or len(namespace) > MAX_NAMESPACE_CHARS \
            or not namespace.isascii() or not namespace.isprintable():
        raise InvalidArgument(f"a namespace is 1-{MAX_NAMESPACE_CHARS} printable ASCII characters, "
                              f"got {namespace!r}")
    return namespace


def accounting_namespace(salt: str) -> str:
    """The tenant name a put carries for a key salt (``KeyExtras.namespace``: the front
    door's tenant, a vLLM request's ``cache_salt``): the salt itself when it is a namespace
    (:func:`check_namespace`), else ``salt-`` + the first 32 hex digits of its SHA-256 (a
    client-chosen salt may be any string; the tenant books still see one stable name)."""
    try:
        return check_namespace(salt)
    except InvalidArgument:
        return salt_namespace(salt)


def salt_namespace(salt: str) -> str:
    """The tenant name of a key salt that is not shown as is: ``salt-`` + the first 32 hex
    digits of its SHA-256 (stable, and names no secret)."""
    import hashlib
    return "salt-" + hashlib.sha256(str(salt).encode(errors="surrogatepass")).hexdigest()[:32]


class QuotaStore:
    """namespace -> quota bytes, persisted at ``path`` (None: in memory only). Thread-safe.

    Raises InvalidArgument (at construction) when the file exists but is not a quota file
    this version wrote, naming the file: a node refuses to start on quotas it cannot read
    rather than serve without them."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._quotas: dict[str, int] = {}
        if path is not None and os.path.exists(path):
            self._quotas = self._read(path)

    @staticmethod
    def _read(path: str) -> dict[str, int]:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"quota file {path}: cannot read it: {exc}") from None
        quotas = doc.get("quotas") if isinstance(doc, dict) and doc.get("version") == FORMAT_VERSION else None
        if not isinstance(quotas, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in quotas.items()):
            raise InvalidArgument(f"quota file {path}: not a version-{FORMAT_VERSION} quota file "
                                  '({"version": 1, "quotas": {namespace: bytes}})')
        return dict(quotas)

    def _save(self) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": FORMAT_VERSION, "quotas": self._quotas}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())   # on disk before the rename: a power loss leaves the old file or the new
        os.replace(tmp, self.path)
        dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)          # the rename itself
        finally:
            os.close(dfd)

    def get(self, namespace: str) -> int | None:
        """The namespace's quota in bytes, or None when it has none."""
        return self._quotas.get(namespace)

    def all(self) -> dict[str, int]:
        with self._lock:
            return dict(self._quotas)

    def set(self, namespace: str, nbytes: int) -> int | None:
        """Set a quota (bytes >= 0); returns the previous one. Persisted before it returns."""
        check_namespace(namespace)
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgument(f"a quota is a whole number of bytes >= 0, got {nbytes!r}")
        with self._lock:
            old = self._quotas.get(namespace)
            self._quotas[namespace] = nbytes
            self._save()
            return old

    def remove(self, namespace: str) -> int | None:
        """Drop a quota; returns it (None when there was none)."""
        with self._lock:
            old = self._quotas.pop(namespace, None)
            if old is not None:
                self._save()
            return old
