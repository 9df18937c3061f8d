"""The one way the front door ends a background task of its own (health checks, the
connection guard's sweeper, the status page's sampler, a stream's writer, the vLLM
instances' watcher)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has ended; its CancelledError
    is not raised here (nor is one cancelling the caller while it waits)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
