"""Shared pytest fixtures. Append fixtures; keep each group under its own heading."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest


# -- store core: tiers, pool and store service ------------------------------------------------
@pytest.fixture
def make_dram() -> Iterator[Callable[..., "object"]]:
    """Factory of DRAM tiers (shared-memory slabs); every slab is closed and unlinked after
    the test, so no /dev/shm segment leaks."""
    from kvstore.tiers.dram import DramTier

    made: list[DramTier] = []

    def make(capacity_bytes: int) -> DramTier:
        tier = DramTier(capacity_bytes)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def make_ssd(tmp_path: Path) -> Iterator[Callable[..., "object"]]:
    """Factory of SSD tiers on a real LMDB directory under ``tmp_path`` (default ``ssd``);
    closed after the test."""
    from kvstore.tiers.ssd import SsdTier

    made: list[SsdTier] = []

    def make(capacity_bytes: int, name: str = "ssd") -> SsdTier:
        tier = SsdTier(capacity_bytes, str(tmp_path / name))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def store_node(make_dram, make_ssd) -> Iterator[tuple["object", str]]:
    """A real store service on 127.0.0.1 (port 0) over a DRAM (64 MiB) + SSD (256 MiB) pool.
    Yields (pool, "127.0.0.1:port")."""
    from kvstore.pool import KVPool
    from kvstore.service import serve_store

    pool = KVPool([make_dram(64 << 20), make_ssd(256 << 20)])
    server, port = serve_store(pool)
    yield pool, f"127.0.0.1:{port}"
    server.stop(grace=None).wait()
