"""Store node configuration: one frozen dataclass, built in one place from a TOML file and
command-line flags (flags win)."""
from __future__ import annotations

import re
import tomllib
from argparse import ArgumentTypeError
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

from kvstore.pool.eviction import POLICIES
from kvstore.pool.types import PoolSettings
from kvstore.tiers import registry
from kvstore.tiers.ssd import FSYNC_POLICIES

TRANSFER_ENGINES = ("auto", "tcp", "rdma", "off")
SSD_ON_ERROR = ("fail", "disable")
EVICTION_POLICIES = POLICIES   # the registry itself, not a copy: a policy registered later is valid too
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise ArgumentTypeError(f"must be {'> 0' if least == 1 else f'>= {least}'}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number > 0."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return _whole_number(text, 0)


def parse_bytes(text: str | int) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` → bytes. Raises ValueError naming the units."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text) if isinstance(text, str) else None
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use a whole number of bytes or a string with a unit "
                         f"({', '.join(u for u in _UNITS if u)}), e.g. \"1.5GiB\"")
    # exact (Fraction, not float): "18446744073709551615" is that many bytes, not 2**64
    size = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    if size.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(size)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier of a node: a kind of kvstore/tiers/registry.py and its capacity in bytes."""

    kind: str
    capacity_bytes: int

    def __post_init__(self) -> None:
        if self.kind not in registry.KINDS:
            raise ValueError(f"unknown tier {self.kind!r}; tiers: {registry.names()}")
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) \
                or not 0 < self.capacity_bytes < 2**63:   # above: an OverflowError sizing the file
            raise ValueError(f"tier {self.kind}: capacity must be a whole number of bytes in (0, 2**63), "
                             f"got {self.capacity_bytes!r}")

    @classmethod
    def parse(cls, text: str) -> TierSpec:
        """``"dram=1GiB"`` → TierSpec("dram", 1073741824). Raises ValueError."""
        name, sep, size = text.partition("=")
        if not sep:
            raise ValueError(f"a tier is KIND=SIZE (KIND one of {registry.names()}), got {text!r}")
        return cls(name.strip(), parse_bytes(size))


def _legacy_field(kind: str) -> str:
    """The StoreConfig field that sized a tier of this kind before tiers were a list."""
    return f"{kind}_bytes"


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """A store node. Sizes in bytes, times in seconds; ``ssd_fsync`` is ``never`` or
    ``commit``. The tiers: ``tiers``, an ordered list (fastest first) of
    :class:`TierSpec` (kinds from kvstore/tiers/registry.py), or when empty one tier per
    kind whose ``<kind>_bytes`` field is > 0 (``hbm_bytes`` > 0 adds an HBM tier on
    ``hbm_device`` — ``auto``: CUDA when present, else the CPU — above DRAM);
    :meth:`tier_list` gives the one in force. Watermarks, policy, lease TTL and reservation
    timeout are the pool's (kvstore/pool/types.py ``PoolSettings``)."""

    node_id: str = "node-0"
    host: str = "127.0.0.1"
    port: int = 50051
    dram_bytes: int = registry.DRAM.default_bytes
    ssd_bytes: int = registry.SSD.default_bytes
    data_dir: str = "var/store"
    ssd_fsync: str = "never"
    # An SSD data directory that cannot be used at start: "fail" (the node does not start,
    # one-line error) or "disable" (the node starts without its SSD tier, and logs so).
    ssd_on_error: str = "fail"
    promote_on_hit: bool = True
    auth_token: str | None = None
    redis_url: str | None = None      # KV events go to this Redis; None: an in-process channel
    hbm_bytes: int = registry.HBM.default_bytes
    hbm_device: str = "auto"
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    eviction_policy: str = "lru"
    lease_ttl_s: float = 5.0
    reservation_timeout_s: float = 30.0
    # Cluster (kvstore/cluster): membership at redis_url (None: an embedded registry) and the
    # across-host transfer engine (kvstore/transfer): auto (tcp when the node joins a cluster
    # through redis_url, else off: the same-host path needs none) | tcp | rdma | off. Mooncake's
    # engine has no authentication and listens on every interface (docs/cluster.md, trust boundary).
    heartbeat_s: float = 1.0
    node_ttl_s: float = 3.0
    transfer_engine: str = "auto"
    te_metadata: str = "P2PHANDSHAKE"    # or Mooncake's HTTP metadata server, http://host:port/metadata
    # Register only a staging area of this size with the transfer engine, holding the blocks
    # being read (kvstore/transfer/staging.py); 0 registers the whole DRAM slab.
    te_staging_bytes: int = 64 << 20
    advertise_host: str | None = None    # host others reach this node at (default: host)
    # Readers on other hosts lease blocks over a compact TCP channel on this port (0: a free
    # one, announced in BlockTransfer.Info); it runs beside the transfer engine.
    control_port: int = 0
    # Same-host data plane (kvstore/dataplane): the Unix control socket; "auto": <data_dir>/<node_id>/
    # dataplane.sock (when that path is too long for a socket, <node_id>-<pid>.sock in a directory of
    # this user's alone: $XDG_RUNTIME_DIR/kvstore, else <tmp>/kvstore-<uid>, mode 0700), "": none.
    dataplane_socket: str = "auto"
    # After serving a request on a control channel (Unix socket or TCP), a connection's thread
    # polls this long for the next one before it sleeps: a woken thread costs 20-60 us on a VM.
    dataplane_poll_us: int = 200
    # Allocate and map the DRAM slab's pages in the background from the start: a put into a
    # never-touched page costs a page fault per 4 KiB (1 MiB: 0.9 ms instead of 0.07).
    dram_prefault: bool = True
    # Prometheus text on GET /metrics at http://host:metrics_port (kvstore/metrics.py); it takes
    # auth_token when one is set. 0: a free port; None: no metrics port.
    metrics_port: int | None = None
    # The tiers, fastest first; empty: one per kind whose <kind>_bytes field above is > 0.
    tiers: tuple[TierSpec, ...] = ()

    def __post_init__(self) -> None:
        for name in ("port", "control_port", "dram_bytes", "ssd_bytes", "hbm_bytes", "dataplane_poll_us",
                     "te_staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        for name in ("promote_on_hit", "dram_prefault"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.node_id, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.node_id):
            raise ValueError(f"node_id must be 1-64 letters, digits, '.', '_' or '-' (starting with a "
                             f"letter or digit), got {self.node_id!r}")
        self._check_tiers()
        self.pool_settings()  # validates watermarks, policy and times
        if self.ssd_fsync not in FSYNC_POLICIES:
            raise ValueError(f"ssd_fsync must be one of {FSYNC_POLICIES}, got {self.ssd_fsync!r}")
        if self.ssd_on_error not in SSD_ON_ERROR:
            raise ValueError(f"ssd_on_error must be one of {SSD_ON_ERROR}, got {self.ssd_on_error!r}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if not 0 < self.heartbeat_s < self.node_ttl_s:
            raise ValueError(f"need 0 < heartbeat_s < node_ttl_s, got {self.heartbeat_s} and {self.node_ttl_s}")
        if self.transfer_engine not in TRANSFER_ENGINES:
            raise ValueError(f"transfer_engine must be one of {TRANSFER_ENGINES}, got {self.transfer_engine!r}")
        for name in ("port", "control_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.dataplane_poll_us > 10_000:
            raise ValueError(f"dataplane_poll_us must be at most 10000 (10 ms of polling after each request), "
                             f"got {self.dataplane_poll_us}")
        if self.metrics_port is not None and (isinstance(self.metrics_port, bool) or not isinstance(
                self.metrics_port, int) or not 0 <= self.metrics_port < 65536):
            raise ValueError(f"metrics_port must be in [0, 65535] (0: a free port), got {self.metrics_port!r}")
        if self.metrics_port and self.metrics_port in (self.port, self.control_port):
            raise ValueError(f"metrics_port {self.metrics_port} is taken by the gRPC or control port: the metrics "
                             f"port needs one of its own (0 picks a free one)")
        if self.control_port and self.control_port == self.port:
            raise ValueError(f"control_port and port are both {self.port}: the control channel needs a port "
                             f"of its own (0 picks a free one)")

    def _check_tiers(self) -> None:
        if not isinstance(self.tiers, tuple) or not all(isinstance(t, TierSpec) for t in self.tiers):
            raise ValueError(f"tiers must be a tuple of TierSpec, got {self.tiers!r}")
        kinds = [t.kind for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"tiers: each kind at most once, got {kinds}")
        if kinds != registry.ordered(kinds):
            raise ValueError(f"tiers must run fastest first ({registry.names()}), got {kinds}")
        if not self.tier_list():
            sizes = ", ".join(_legacy_field(k) for k in registry.names() if _legacy_field(k) in _FIELDS)
            raise ValueError(f"a store node needs a tier: tiers, or {sizes} > 0")

    def tier_list(self) -> tuple[TierSpec, ...]:
        """The node's tiers, fastest first: ``tiers``, or when empty one per kind whose
        ``<kind>_bytes`` field is > 0."""
        if self.tiers:
            return self.tiers
        return tuple(TierSpec(k, getattr(self, _legacy_field(k))) for k in registry.names()
                     if _legacy_field(k) in _FIELDS and getattr(self, _legacy_field(k)) > 0)

    @classmethod
    def load(cls, path: str | None = None, **overrides: Any) -> StoreConfig:
        """Defaults, then the TOML file at ``path`` (keys = field names), then ``overrides``
        whose value is not None. Raises ValueError for unknown keys, naming the valid ones."""
        values: dict[str, Any] = {}
        if path:
            with open(path, "rb") as f:
                try:
                    values.update(tomllib.load(f))
                except tomllib.TOMLDecodeError as exc:
                    raise ValueError(f"{path} is not valid TOML: {exc}") from None
                except UnicodeDecodeError as exc:   # TOML is UTF-8
                    raise ValueError(f"{path} is not valid TOML: not UTF-8 text ({exc.reason} at byte "
                                     f"{exc.start})") from None
            if values.get("tiers", None) == []:
                raise ValueError(f"{path}: tiers = [] names no tier; list at least one (fastest first), "
                                 f"e.g. tiers = [\"dram=1GiB\"], or leave it out for the defaults")
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("tiers") is not None:   # a list on the command line replaces the file's
            values.pop("tiers", None)
            for k in registry.names():
                values.pop(_legacy_field(k), None)
        values.update(given)
        unknown = sorted(set(values) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown store settings {unknown}; valid: {sorted(_FIELDS)}")
        sized = [k for k in registry.names() if _legacy_field(k) in values]
        if values.get("tiers") and sized:
            raise ValueError(f"give the tiers either as a list (tiers) or by size "
                             f"({', '.join(_legacy_field(k) for k in sized)}), not both")
        for key in [_legacy_field(k) for k in registry.names()] + ["te_staging_bytes"]:
            if key in values:
                values[key] = parse_bytes(values[key])
        if "tiers" in values:
            values["tiers"] = tuple(_tier_spec(t) for t in values["tiers"] or ())
        return replace(cls(), **values)

    def tier_capacity(self, kind: str) -> int:
        """Bytes of this node's tier of ``kind`` (0 when it has none)."""
        return next((t.capacity_bytes for t in self.tier_list() if t.kind == kind), 0)

    def transfer_protocol(self) -> str | None:
        """The transfer engine's protocol this node runs (``tcp`` or ``rdma``), or None for
        none: ``auto`` is ``tcp`` for a node in a Redis cluster and none otherwise."""
        if self.transfer_engine == "auto":
            return "tcp" if self.redis_url else None
        return None if self.transfer_engine == "off" else self.transfer_engine

    def dataplane_socket_path(self) -> str | None:
        """The Unix control socket of the same-host data plane, or None for none. Raises
        OSError when ``auto`` needs its private directory (:func:`private_socket_dir`) and
        cannot have it."""
        if self.dataplane_socket == "auto":
            import os
            path = os.path.abspath(os.path.join(self.data_dir, self.node_id, "dataplane.sock"))
            if len(os.fsencode(path)) < MAX_SOCKET_PATH:     # sun_path counts bytes
                return path
            return private_socket_path(f"{self.node_id}-{os.getpid()}.sock")
        return self.dataplane_socket or None

    def pool_settings(self) -> PoolSettings:
        """The pool's settings. Raises ValueError naming the valid values."""
        return PoolSettings(policy=self.eviction_policy, high_watermark=self.high_watermark,
                            low_watermark=self.low_watermark, lease_ttl_s=self.lease_ttl_s,
                            reservation_timeout_s=self.reservation_timeout_s,
                            promote_on_hit=self.promote_on_hit)


_FIELDS = frozenset(f.name for f in fields(StoreConfig))


def _tier_spec(item: Any) -> TierSpec:
    """A tier as TOML gives it (``{kind = "dram", bytes = "1GiB"}``), as ``"dram=1GiB"`` or
    a TierSpec. Raises ValueError."""
    if isinstance(item, TierSpec):
        return item
    if isinstance(item, str):
        return TierSpec.parse(item)
    if isinstance(item, dict) and set(item) == {"kind", "bytes"}:
        return TierSpec(str(item["kind"]), parse_bytes(item["bytes"]))
    raise ValueError(f"a tier is {{kind = NAME, bytes = SIZE}} or 'NAME=SIZE', got {item!r}")

MAX_SOCKET_PATH = 100    # bytes: sun_path holds 108 on Linux, 104 on macOS


def private_socket_path(name: str) -> str:
    """``name`` in :func:`private_socket_dir`, chosen so the path fits a Unix socket. Raises
    OSError as that does."""
    import os
    return os.path.join(private_socket_dir(MAX_SOCKET_PATH - 1 - len(os.fsencode(name))), name)


def private_socket_dir(max_len: int = MAX_SOCKET_PATH - 40) -> str:
    """A directory for Unix sockets that only this user can enter (mode 0700, owned by this
    user, not a link), created when missing: ``$XDG_RUNTIME_DIR/kvstore`` (the login's
    private runtime directory), else ``<tmp>/kvstore-<uid>`` — never a name in the shared
    ``/tmp`` itself, where another user could take it first (a file there, or a socket of
    their own, and the node could not start); the first whose path is under ``max_len``
    characters (else the last). Raises OSError naming the directory when one of another
    user's, or open to others, stands there."""
    import os
    import stat
    import tempfile
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [os.path.join(runtime, "kvstore")] if runtime and os.path.isabs(runtime) else []
    candidates.append(os.path.join(tempfile.gettempdir(), f"kvstore-{os.getuid()}"))
    path = next((c for c in candidates if len(os.fsencode(c)) < max_len), candidates[-1])
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a directory of this user's alone (mode 0700): kvstore's Unix sockets "
                      "cannot go there; give a shorter --data-dir (a store node: or --dataplane-socket a path)")
    return path
