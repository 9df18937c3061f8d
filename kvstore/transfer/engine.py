"""The Mooncake Transfer Engine, wrapped: one engine per process, started on first use.

A store node registers its DRAM slab with its engine and announces ``host:rpc_port``
(:class:`NodeTransferEngine`); a reader registers a receive buffer with its own engine and
reads leased blocks straight out of the node's slab (kvstore/transfer/te_transport.py).
Metadata goes through Mooncake's P2P handshake (``P2PHANDSHAKE``, no server) or its HTTP
metadata server (``http://host:port/metadata``); the PyPI wheels carry no Redis plugin.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from kvstore.errors import Unavailable

log = logging.getLogger(__name__)
PROTOCOLS = ("tcp", "rdma")
# The binding's blocking waits spin on the batch's status with the GIL released: a waiting
# reader burns a core its own engine's workers (and, over loopback, the node's) need. On 2
# cores a 16 MiB read took 7.0-10.3 ms so and 4.8-5.7 ms polling each piece's status with
# naps of this long between polls (benchmarks/te_probe.py's machine, best of 11).
POLL_NAP_S = 50e-6
DONE, FAILED, TIMED_OUT, IN_FLIGHT = 1, -1, -2, 0  # TransferEngineHandle.wait_piece
_engines: dict[tuple[str, str, str], TransferEngineHandle] = {}
_engines_lock = threading.Lock()


class TransferEngineUnavailable(Unavailable):
    """The transfer engine cannot run here (not installed, no libibverbs, init failed)."""


class TransferEngineHandle:
    """One initialised ``mooncake.engine.TransferEngine`` and the memory registered with it.

    Invariant: every buffer handed to a transfer lies in a registered region that stays
    alive (referenced here) until :meth:`unregister`.
    """

    def __init__(self, host: str, metadata: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 device: str = "") -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"transfer engine protocol must be one of {PROTOCOLS}, got {protocol!r}")
        os.environ.setdefault("GLOG_minloglevel", "2")   # Mooncake logs every handshake at INFO
        try:
            from mooncake.engine import TransferEngine
        except (ImportError, OSError) as exc:
            raise TransferEngineUnavailable(f"cannot import mooncake.engine: {exc}") from None
        self.engine = TransferEngine()
        # P2P handshake: the segment is found at host:rpc_port. With a metadata server the
        # segment name is what initialize() is given, so it must be unique: host:free port.
        p2p = metadata == "P2PHANDSHAKE"
        name = host if p2p else f"{host}:{_free_port(host)}"
        rc = self.engine.initialize(name, metadata, protocol, device)
        if rc != 0:
            raise TransferEngineUnavailable(f"TransferEngine.initialize({name!r}, {metadata!r}, "
                                            f"{protocol!r}) returned {rc}")
        self.host, self.metadata, self.protocol = host, metadata, protocol
        self.endpoint = f"{host}:{self.engine.get_rpc_port()}" if p2p else name
        self._regions: dict[int, Any] = {}
        self._lock = threading.Lock()    # guards _regions
        log.info("transfer engine (%s, metadata %s) at %s", protocol, metadata, self.endpoint)

    def register(self, array: np.ndarray) -> int:
        """Register ``array``'s bytes; returns their address. Raises TransferEngineUnavailable."""
        addr = int(array.ctypes.data)
        with self._lock:
            rc = self.engine.register_memory(addr, int(array.nbytes))
            if rc != 0:
                raise TransferEngineUnavailable(f"register_memory of {array.nbytes} bytes returned {rc}")
            self._regions[addr] = array
        return addr

    def unregister(self, addr: int) -> None:
        with self._lock:
            if self._regions.pop(addr, None) is not None:
                self.engine.unregister_memory(addr)

    def registered(self, addr: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``addr`` lie inside one registered region."""
        with self._lock:
            return any(start <= addr and addr + nbytes <= start + array.nbytes
                       for start, array in self._regions.items())

    def read_piece(self, endpoint: str, local: int, remote: int, length: int) -> int:
        """Start reading ``length`` bytes at ``remote`` of the engine at ``endpoint`` into
        ``local`` (registered), without waiting; returns a transfer id for
        :meth:`wait_piece`, or 0 (or less) when the engine refused it. One transfer per
        batch: only a one-transfer batch can be polled without blocking."""
        return self.engine.batch_transfer_async_read(endpoint, [local], [remote], [length])

    def wait_piece(self, transfer_id: int, deadline: float) -> int:
        """Wait for a transfer of :meth:`read_piece`, polling its status with naps of
        :data:`POLL_NAP_S` instead of spinning. Returns :data:`DONE`, :data:`FAILED` (the
        engine refused or failed it), :data:`TIMED_OUT` (the engine's own timeout ended it;
        the id is spent in both cases) or
        :data:`IN_FLIGHT` when ``deadline`` (monotonic seconds; ``math.inf``: none) came
        first: the engine may still write into the transfer's buffer, which must then stay
        alive and unused until :meth:`ended` says so."""
        if transfer_id <= 0:
            return FAILED
        check, nap, clock = self.engine.transfer_check_status, time.sleep, time.monotonic
        while True:
            status = check(transfer_id)  # 1 done, 0 in flight, -1 failed, -2 timed out
            if status:
                return DONE if status == 1 else TIMED_OUT if status == -2 else FAILED
            if clock() > deadline:
                return IN_FLIGHT
            nap(POLL_NAP_S)

    def ended(self, transfer_id: int) -> bool:
        """Whether a transfer that :meth:`wait_piece` left IN_FLIGHT has ended since (then
        its id is spent: ask no more)."""
        return self.engine.transfer_check_status(transfer_id) != 0


def local_address_toward(host: str) -> str:
    """This host's own address on the route to ``host`` (the source address the kernel picks;
    a UDP ``connect`` sends nothing): ``127.0.0.1`` toward a node on this host, the address on
    the shared network toward a node on another, so the reader's engine announces an address
    the node can reach. ``127.0.0.1`` when there is no route."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_engine(host: str = "127.0.0.1", metadata: str = "P2PHANDSHAKE",
                   protocol: str = "tcp") -> TransferEngineHandle:
    """This process's engine for (host, metadata, protocol), started on first use. Raises
    TransferEngineUnavailable."""
    with _engines_lock:
        key = (host, metadata, protocol)
        if key not in _engines:
            _engines[key] = TransferEngineHandle(host, metadata, protocol)
        return _engines[key]


def shutdown_engines(metadata: str | None = None) -> int:
    """Drop this process's engines (those using ``metadata``, or all): each unregisters from
    its metadata service as it is destroyed, so call this while that service still runs.
    Returns how many were dropped."""
    with _engines_lock:
        keys = [k for k in _engines if metadata is None or k[1] == metadata]
        for key in keys:
            del _engines[key]
    gc.collect()
    return len(keys)


class NodeTransferEngine:
    """A store node's side: what it registers with its engine — a staging area of
    ``staging_bytes`` holding only the blocks being read (``staging``, kvstore/transfer/
    staging.py), or with ``staging_bytes`` 0 its whole DRAM slab (mapped by name).

    ``endpoint`` (host:rpc_port) and ``slab_address`` (the registered region's address,
    ``slab_bytes`` long) go into the node's membership record and ``BlockTransfer.Info``; an
    offset in a lease answer is read at ``slab_address + offset``.
    """

    def __init__(self, shm_name: str, host: str, protocol: str = "tcp",
                 metadata: str = "P2PHANDSHAKE", staging_bytes: int = 0) -> None:
        from kvstore.transfer.staging import StagingArea
        self.handle = process_engine(host, metadata, protocol)
        self._shm: shared_memory.SharedMemory | None = None
        self.staging: StagingArea | None = None
        if staging_bytes:
            self.staging = StagingArea(staging_bytes)
            self._slab = self.staging.buf
        else:
            # Mapped by name in the node's own process (the slab's creator, which unlinks it).
            self._shm = shared_memory.SharedMemory(name=shm_name)
            self._slab = np.ndarray((self._shm.size,), dtype=np.uint8, buffer=self._shm.buf)
        self.slab_address = self.handle.register(self._slab)
        self.slab_bytes = int(self._slab.nbytes)
        self.endpoint = self.handle.endpoint
        self.protocol = protocol

    def close(self) -> None:
        self.handle.unregister(self.slab_address)
        self._slab = None  # type: ignore[assignment]
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:
                pass
