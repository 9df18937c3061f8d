"""Shared by the SSD tier's tests: seeded blocks and keys, an SSD tier filled with them, the
damage lines a quarantine logs, a ``kvstore serve`` run to its exit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.integrity import checksum_of
from kvstore.tiers.ssd import SsdTier

BLOCK = 64 << 10


def ssd_block(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def ssd_key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def fill_ssd(path: Path, n: int) -> None:
    tier = SsdTier(64 << 20, str(path))
    for i in range(n):
        tier.put(ssd_key(i), ssd_block(i), checksum_of(ssd_block(i)))
    tier.close()


def damage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]


def serve_node(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "serve", "--port", "0", "--dram", "4MiB",
                           "--ssd", "16MiB", "--transfer-engine", "off", "--data-dir", str(tmp_path / "data"),
                           *flags], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
