"""Helpers of the same-host data plane tests (tests/kvstore/dataplane/test_dataplane.py,
test_dataplane_writes.py, test_control_channel.py, all in tests/kvstore/dataplane/); their fixtures (``slab_node``,
``client_of``) are in tests/conftest.py."""
from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np

from kvstore.dataplane.control_client import UdsControl
from kvstore.dataplane.local import LocalDataPlane
from kvstore.pool.pool import KVPool

MIB = 1 << 20


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def block_of(i: int, size: int = 64 << 10) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def socket_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvstore-test-{uuid.uuid4().hex[:8]}.sock")  # < 108 bytes


def plane_of(pool: KVPool, path: str) -> LocalDataPlane:
    from kvstore.dataplane.host import DataPlaneHost
    info = DataPlaneHost(pool, path).info()
    return LocalDataPlane(info, UdsControl(path))
