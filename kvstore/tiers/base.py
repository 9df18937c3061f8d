"""The abstract tier and the registry tiers are picked from."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterator

TIERS: dict[str, Callable[..., "Tier"]] = {}


def register_tier(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        TIERS[name] = cls
        cls.name = name
        return cls
    return deco


class Tier(ABC):
    """Stores whole blocks by key, within ``capacity_bytes``.

    Invariant: ``used_bytes`` is the sum of the sizes of the blocks held. ``put`` either
    stores the whole block or raises and stores nothing.
    """

    name: str = "tier"
    device: str = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes

    @abstractmethod
    def put(self, key: bytes, data: bytes | memoryview, checksum: int) -> None:
        """Store ``data``. Raises CapacityError when it does not fit now, OSError on a
        failed write; in both cases nothing is stored."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, or None on a miss. Raises IntegrityError when the bytes do not
        match their checksum (the tier has dropped the block by then)."""

    @abstractmethod
    def remove(self, key: bytes) -> int:
        """Drop the block; returns the bytes freed (0 when absent)."""

    @abstractmethod
    def keys(self) -> Iterator[tuple[bytes, int]]:
        """(key, size) of every block held, oldest write first."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    def fits(self, size: int) -> bool:
        """Whether a block of ``size`` bytes could be put now without eviction."""
        return self.used_bytes + size <= self.capacity_bytes

    def close(self) -> None:
        """Release the tier's resources."""
