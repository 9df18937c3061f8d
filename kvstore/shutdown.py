"""Stopping a service on SIGTERM or SIGINT within a bound, whatever state it is in.

The first signal starts the graceful stop and arms a watchdog; if the stop has not ended
the process after ``grace_s`` seconds (a handler stuck in a read, a transfer engine that
will not let go, a worker thread the interpreter waits for at exit), the watchdog removes
what the process must not leave behind (its shared-memory segments and socket files,
registered with :func:`leave_nothing`), logs one line and ends the process with
``os._exit``. A second signal does the same at once. A stop that ends in time leaves with
:meth:`Shutdown.exit` (``os._exit`` too: the interpreter's own exit would join worker
threads and run native destructors, and a stuck one there is out of a watchdog's reach).
Every service of ``kvstore`` stops this way, so SIGTERM or SIGINT ends each within
``GRACE_S`` + a fraction of a second.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

GRACE_S = 8.0          # graceful stop budget, seconds; then forced (kvstore up waits 10 s in all)
FORCED_EXIT_CODE = 3   # the exit status of a stop the watchdog had to force

_paths: list[str] = []
_paths_lock = threading.Lock()


def leave_nothing(*paths: str | None) -> None:
    """Register files (``/dev/shm/<name>``, a socket path) a forced exit unlinks."""
    with _paths_lock:
        _paths.extend(p for p in paths if p)


def force_exit(reason: str, code: int = FORCED_EXIT_CODE) -> None:
    """Unlink the registered files and end the process now (no atexit, no thread joins)."""
    with _paths_lock:
        paths = list(_paths)
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        sys.stderr.write(f"{reason}; forced exit (status {code})\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


class Shutdown:
    """Signal handling for one service process: :meth:`install` (main thread), then
    :meth:`wait` until SIGTERM/SIGINT (or :meth:`trigger`), then the caller stops gracefully;
    the watchdog armed by the first signal forces the exit after ``grace_s``."""

    def __init__(self, name: str, grace_s: float = GRACE_S) -> None:
        self.name = name
        self.grace_s = grace_s
        self.event = threading.Event()
        self.signals = 0
        self._armed = False

    def install(self, on_signal: Callable[[], None] | None = None) -> Shutdown:
        """Handle SIGINT and SIGTERM with :meth:`trigger` (then ``on_signal``, e.g. an
        event loop's stop). Must run in the main thread."""
        def handler(signum: int, _frame: object) -> None:
            self.trigger(signal.Signals(signum).name)
            if on_signal is not None:
                on_signal()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)
        return self

    def trigger(self, why: str = "stop") -> None:
        """Start stopping: the first call arms the watchdog, a second forces the exit now."""
        self.signals += 1
        if self.signals > 1:
            force_exit(f"{self.name}: second {why} while stopping")
        self.event.set()
        self.arm(why)

    def arm(self, why: str = "stop") -> None:
        """Start the watchdog (idempotent): the process ends ``grace_s`` from now at the latest."""
        if self._armed:
            return
        self._armed = True
        started = time.monotonic()

        def watchdog() -> None:
            time.sleep(self.grace_s)
            force_exit(f"{self.name}: still running {time.monotonic() - started:.1f} s after {why}")

        threading.Thread(target=watchdog, name="shutdown-watchdog", daemon=True).start()

    def exit(self, code: int = 0) -> None:
        """End the process once the graceful stop is done: flush logs and stdio, then
        ``os._exit``, so nothing the interpreter would still run at exit (joins of worker
        threads, native libraries' destructors) can hold it."""
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    def wait(self) -> None:
        """Block until a signal (or :meth:`trigger`)."""
        while not self.event.wait(0.5):
            pass
