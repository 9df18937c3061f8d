"""Fixtures of the pool tests (tests/test_pool*.py, as ``pytest_plugins``): a factory of
pools that checks every pool's invariants after the test, and small pools over real tiers."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.pool.pool import KVPool
from tests.helpers.pool_helpers import BS, EXACT


@pytest.fixture
def make_pool() -> Iterator[Callable[..., KVPool]]:
    """Factory of pools (settings default to EXACT); each is checked (``check_integrity``)
    and closed after the test."""
    made: list[KVPool] = []

    def make(tiers: Any, **kw: Any) -> KVPool:
        kw.setdefault("settings", EXACT)
        made.append(KVPool(tiers, **kw))
        return made[-1]

    yield make
    for pool in made:
        pool.check_integrity()
        pool.close()


@pytest.fixture
def dram_pool(make_dram: Callable[..., Any], make_pool: Callable[..., KVPool]) -> KVPool:
    return make_pool([make_dram(3 * BS)])


@pytest.fixture
def two_tier_pool(make_dram: Callable[..., Any], make_ssd: Callable[..., Any],
                  make_pool: Callable[..., KVPool]) -> KVPool:
    return make_pool([make_dram(2 * BS), make_ssd(8 * BS)])
