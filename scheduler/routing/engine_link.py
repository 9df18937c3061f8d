"""What the router and its health checks need of an engine's client (:class:`EngineLink`):
the built-in engines' :class:`engines.client.EngineClient` (gRPC) and a vLLM instance's
:class:`scheduler.vllm.instances.VLLMClient` (HTTP) both answer it, so one
:class:`scheduler.routing.router.Router` (generic in the client) routes over either."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from engines.types import EngineInfo
from kvstore.errors import InvalidArgument

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class EngineLink(Protocol):
    address: str   # where the engine answers, for messages

    async def load(self) -> Any:
        """The engine's load now; raises KVStoreError (or times out) when it cannot answer."""
        ...

    async def close(self) -> None:
        """Release the connection; the client is not used after."""
        ...


C = TypeVar("C", bound=EngineLink)   # the engine client a router and its instances hold


def check_compatible(infos: Sequence[EngineInfo]) -> None:
    """Raises InvalidArgument when the engines disagree on the model, its revision, the KV
    layout, the block size or the vocabulary (one router keys one model's prompts)."""
    first = infos[0]
    for info in infos[1:]:
        for name in ("model_id", "revision", "layout", "block_size", "vocab_size"):
            if getattr(info, name) != getattr(first, name):
                raise InvalidArgument(f"engines disagree on {name}: {info.engine_id} has "
                                      f"{getattr(info, name)!r}, {first.engine_id} has {getattr(first, name)!r}")
