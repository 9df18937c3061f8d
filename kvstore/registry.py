"""Name → class registries (tiers, eviction policies, block transports): a class registers
itself under a name with a decorator, and configuration picks it by that name."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def registrar(table: dict[str, Any]) -> Callable[[str], Callable[[type], type]]:
    """A decorator factory for ``table``: ``@register("name")`` on a class puts it in
    ``table`` under ``name`` and sets its ``name`` attribute."""
    def register(name: str) -> Callable[[type], type]:
        def deco(cls: type) -> type:
            table[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls
        return deco
    return register
