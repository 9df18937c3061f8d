"""What the router and its health checks need of an engine's client (:class:`EngineLink`):
the built-in engines' :class:`engines.client.EngineClient` (gRPC) and a vLLM instance's
:class:`scheduler.vllm_instances.VLLMClient` (HTTP) both answer it, so one
:class:`scheduler.router.Router` (generic in the client) routes over either."""
from __future__ import annotations

from typing import Any, Protocol, TypeVar


class EngineLink(Protocol):
    address: str   # where the engine answers, for messages

    async def load(self) -> Any:
        """The engine's load now; raises KVStoreError (or times out) when it cannot answer."""
        ...

    async def close(self) -> None:
        """Release the connection; the client is not used after."""
        ...


C = TypeVar("C", bound=EngineLink)   # the engine client a router and its instances hold
