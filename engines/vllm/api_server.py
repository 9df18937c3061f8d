"""vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``) with its API key
(``VLLM_API_KEY``) required on every path but ``/health``: ``python -m engines.vllm.api_server
ARGS...`` (engines/vllm/launch.py starts it so).

vLLM 0.32's key guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(vllm/entrypoints/serve/middleware/authenticate.py): ``/invocations`` serves the same
completions to any caller, with any ``cache_salt`` — that is, in any tenant's namespace of the
pool — and ``/tokenize``, ``/metrics`` and the rest answer too. ``kvstore up --engine vllm``
gives its instances a key only the front door holds, so here every request without it is a
401; ``/health`` stays open for readiness probes. ``/metrics`` also takes the read-only
metrics token (``KVSTORE_METRICS_TOKEN``, kvstore/auth.py) as every kvstore metrics port does, so
a Prometheus scraper needs not the key, which runs requests.

Where ``kvstore up`` holds the instance's port (kvstore/port_hold.py), the server binds it with
SO_REUSEPORT, beside the hold (vLLM's API server binds without it)."""
from __future__ import annotations

import os
from typing import Any

from kvstore.auth import METRICS_TOKEN_ENV, bearer_matches
from kvstore.port_hold import held

OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"


def _is_scraper(header: str | None) -> bool:
    """Whether ``header`` carries the metrics token (none set: no one is)."""
    token = os.environ.get(METRICS_TOKEN_ENV)
    return bool(token) and bearer_matches(header, token or "")


def guard_every_path() -> None:
    """Make vLLM's AuthenticationMiddleware (present only when a key is set) check every path
    but :data:`OPEN_PATHS`, instead of its guarded prefixes; :data:`METRICS_PATH` also takes
    the metrics token when ``KVSTORE_METRICS_TOKEN`` is set."""
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware import authenticate

    def __call__(self: Any, scope: Any, receive: Any, send: Any) -> Any:   # replaces the method
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            headers = Headers(scope=scope)
            scrape = path == METRICS_PATH and _is_scraper(headers.get("authorization"))
            if path not in OPEN_PATHS and not scrape and not self.verify_token(headers):
                return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)

    authenticate.AuthenticationMiddleware.__call__ = __call__   # type: ignore[method-assign]


def bind_beside_hold() -> None:
    """Make vLLM's API server bind its port with SO_REUSEPORT (its ``run_server`` asks for
    none): the port's hold (kvstore/port_hold.py) lets only such a socket of this user bind."""
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.launchers.api_server import entry
    setup_server = launcher.setup_server

    def setup_server_beside_hold(args: Any, *, reuse_port: bool) -> Any:
        return setup_server(args, reuse_port=True)

    entry.setup_server = setup_server_beside_hold   # the name run_server calls


def main() -> None:
    """vLLM's API server (what ``python -m vllm.entrypoints.openai.api_server`` runs), guarded.
    Called from this module, which stays ``__main__``: vLLM's CPU platform spawns the engine
    core process, and a spawned child imports its parent's main module again, which here is
    this one (80 ms), not vLLM's API server with its whole HTTP stack (8 s of a 20-s start)."""
    from vllm.entrypoints.launchers.api_server.entry import main as serve
    guard_every_path()
    if held():
        bind_beside_hold()
    serve()


if __name__ == "__main__":
    main()
