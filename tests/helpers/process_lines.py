"""Reading a started process's output line by line, for tests that wait for a banner line
(``kvstore up`` prints each service's address as it comes up)."""
from __future__ import annotations

import subprocess
import threading


def collect_lines(proc: subprocess.Popen, marker: str) -> tuple[list[str], threading.Event]:
    """Read ``proc``'s stdout (text mode) in a daemon thread into the returned list; the event
    is set at the first line that starts with ``marker``."""
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):
                seen.set()
    threading.Thread(target=read, daemon=True).start()
    return lines, seen
