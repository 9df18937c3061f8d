"""Eviction policies: small strategy objects, picked by name from a registry, that order one
tier's blocks for eviction. The pool tells a policy what enters (``admit``), what is read
(``access``) and what leaves (``forget``); the policy answers one question, ``victim``: the
next block to evict among those the pool says are eligible (leased, pinned and blocked chain
heads never are). Chain order (tails before heads) is the pool's rule, applied on top.

- ``lru``: least recently used first (the default).
- ``lfu``: least frequently used first, least recent among equals.
- ``fifo``: oldest insertion first; reads change nothing.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP'23, "FIFO queues are all you need for cache
  eviction"): a small FIFO for new blocks (10 % of them), a main FIFO for blocks read again,
  a ghost FIFO of recently evicted keys that admits a returning key straight to main;
  two-bit frequency counters.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvstore.errors import InvalidArgument
from kvstore.registry import registrar

Eligible = Callable[[bytes], bool]
POLICIES: dict[str, type[EvictionPolicy]] = {}


register_policy = registrar(POLICIES)


def make_policy(name: str) -> EvictionPolicy:
    """A new, empty policy by name. Raises InvalidArgument naming the valid ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"unknown eviction policy {name!r}; valid: {sorted(POLICIES)}") from None


class EvictionPolicy(ABC):
    """Orders the blocks of one tier. Invariant: ``keys()`` are exactly the blocks admitted
    and not yet forgotten. ``victim`` never returns an ineligible key."""

    name = "policy"

    @abstractmethod
    def admit(self, key: bytes) -> None: ...

    def access(self, key: bytes) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """A read of ``key`` (lookups and existence checks are not reads)."""

    @abstractmethod
    def forget(self, key: bytes, evicted: bool = False) -> None: ...

    @abstractmethod
    def victim(self, eligible: Eligible) -> bytes | None:
        """The next block to evict among those ``eligible`` accepts; None when none is."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every block, roughly in eviction order (to carry the order over on a switch)."""


@register_policy("lru")
class LruPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._q: OrderedDict[bytes, None] = OrderedDict()

    def admit(self, key: bytes) -> None:
        self._q[key] = None
        self._q.move_to_end(key)

    def access(self, key: bytes) -> None:
        if key in self._q:
            self._q.move_to_end(key)

    def forget(self, key: bytes, evicted: bool = False) -> None:
        self._q.pop(key, None)

    def victim(self, eligible: Eligible) -> bytes | None:
        return next((k for k in self._q if eligible(k)), None)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._q))


@register_policy("fifo")
class FifoPolicy(LruPolicy):
    def access(self, key: bytes) -> None:
        pass


@register_policy("lfu")
class LfuPolicy(EvictionPolicy):
    """Frequency buckets of insertion-ordered keys: O(1) admit/access/forget."""

    def __init__(self) -> None:
        self._freq: dict[bytes, int] = {}
        self._buckets: dict[int, OrderedDict[bytes, None]] = {}

    def _place(self, key: bytes, freq: int) -> None:
        self._freq[key] = freq
        self._buckets.setdefault(freq, OrderedDict())[key] = None

    def _unplace(self, key: bytes) -> int | None:
        freq = self._freq.pop(key, None)
        if freq is not None:
            bucket = self._buckets[freq]
            del bucket[key]
            if not bucket:
                del self._buckets[freq]
        return freq

    def admit(self, key: bytes) -> None:
        self._unplace(key)
        self._place(key, 0)

    def access(self, key: bytes) -> None:
        freq = self._unplace(key)
        if freq is not None:
            self._place(key, freq + 1)

    def forget(self, key: bytes, evicted: bool = False) -> None:
        self._unplace(key)

    def victim(self, eligible: Eligible) -> bytes | None:
        for freq in sorted(self._buckets):
            for key in self._buckets[freq]:
                if eligible(key):
                    return key
        return None

    def keys(self) -> Iterator[bytes]:
        return iter([k for f in sorted(self._buckets) for k in self._buckets[f]])


@register_policy("s3fifo")
class S3FifoPolicy(EvictionPolicy):
    SMALL_RATIO = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}

    def admit(self, key: bytes) -> None:
        self.forget(key)
        returning = key in self._ghost
        if returning:
            del self._ghost[key]
        (self._main if returning else self._small)[key] = None
        self._freq[key] = 0

    def access(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def forget(self, key: bytes, evicted: bool = False) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]
        if evicted:
            self._ghost[key] = None
            while len(self._ghost) > max(1, len(self._freq)):
                self._ghost.popitem(last=False)

    def victim(self, eligible: Eligible) -> bytes | None:
        # Each block can be looked at a few times (a move to main, MAX_FREQ decrements, one
        # ineligible rotation): a bound that ends the search when nothing is eligible.
        budget = (self.MAX_FREQ + 2) * len(self._freq) + 1
        while budget > 0 and self._freq:
            budget -= 1
            small = bool(self._small) and (
                not self._main or len(self._small) >= self.SMALL_RATIO * len(self._freq))
            queue = self._small if small else self._main
            key, _ = queue.popitem(last=False)
            if self._freq[key] > 0:
                if small:
                    self._main[key] = None  # read again while new: to main
                    self._freq[key] = 0
                else:
                    self._main[key] = None  # reinsert with one access fewer
                    self._freq[key] -= 1
                continue
            queue[key] = None
            if eligible(key):
                queue.move_to_end(key, last=False)  # stays the next candidate until forgotten
                return key
        return None

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._small) + list(self._main))
