"""Fault injection against a real ``kvstore up``: start the stack as a user does, drive it
with streaming clients, ``kill -9`` one of its processes, and sort every answer into what
it was. Used by ``benchmarks/bench_faults.py`` (the figures) and ``tests/benchmarks/test_faults.py``.

Every answer is one of: ``ok`` (a complete stream ending in ``[DONE]``, no error event);
``rejected`` (429 with ``Retry-After`` and OpenAI's error shape); ``clean`` (another 4xx/5xx
in OpenAI's error shape, or a stream that ends with an error event and ``[DONE]``);
``refused`` (the connection was refused: nothing listens) and ``cut`` (the connection
closed before or during the answer) — fair only when the front door itself died;
``unclean`` (anything else: a 5xx without the shape, a stream cut off, a
reset mid-answer). Hardening wants ``unclean`` at 0.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
UNCLEAN: Counter = Counter()   # what each ``unclean`` answer was, for the report


def children(pid: int) -> dict[str, int]:
    """The child processes of ``pid`` by service name (``store``, ``prefill-0``,
    ``decode-0``, ``scheduler``, ...; a vLLM instance as ``port:N``), read from /proc."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        args = [a.decode() for a in argv if a]
        if "engines.vllm.api_server" in args:      # a vLLM instance: by its port (UpStack names it)
            out["port:" + args[args.index("--port") + 1]] = int(entry)
            continue
        if "launcher" not in args:
            continue
        if "--engine-id" in args:
            out[args[args.index("--engine-id") + 1]] = int(entry)
        elif "--node-id" in args:
            out[args[args.index("--node-id") + 1]] = int(entry)
        elif "scheduler" in args:
            out["scheduler"] = int(entry)
    return out


@dataclass
class UpStack:
    """A ``python -m launcher up --port 0`` in ``data_dir``: :meth:`start`, :meth:`stop`."""

    data_dir: str
    flags: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    url: str = ""
    output: list[str] = field(default_factory=list)
    vllm_ports: dict[str, str] = field(default_factory=dict)   # vLLM instance name -> "port:N"

    def start(self, timeout_s: float = 240.0) -> UpStack:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher", "--log-level", "WARNING", "up",
                                      "--engine", "builtin", "--port", "0", "--data-dir", self.data_dir, *self.flags],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("kvstore up ended:\n" + "".join(self.output))
            self.output.append(line)
            m = re.search(r"front door\s+(http://\S+)", line)
            if m:
                self.url = m.group(1)
            m = re.search(r"^vLLM \S+\s+(\S+) http://\S+:(\d+)", line)
            if m:
                self.vllm_ports[m.group(1)] = "port:" + m.group(2)
            if "serving; Ctrl-C" in line:
                os.set_blocking(self.proc.stdout.fileno(), False)
                return self
        raise RuntimeError("kvstore up not serving in time:\n" + "".join(self.output))

    def read_output(self) -> str:
        if self.proc is not None and self.proc.stdout is not None:
            try:
                chunk = self.proc.stdout.read()
            except (OSError, ValueError):
                chunk = None
            if chunk:
                self.output.append(chunk)
        return "".join(self.output)

    def children(self) -> dict[str, int]:
        assert self.proc is not None
        out = children(self.proc.pid)
        for name, port in self.vllm_ports.items():
            if port in out:
                out[name] = out.pop(port)
        return out

    def kill9(self, name: str) -> int:
        pid = self.children()[name]
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self, timeout_s: float = 10.0) -> float:
        """SIGTERM ``kvstore up``; returns the seconds it took to exit (killed after
        ``timeout_s`` + 5, then the seconds are ``inf``)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return float("inf")
        return time.monotonic() - t0


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                      stream: bool = True) -> str:
    """One completion; returns its outcome (see the module docstring)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    status = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            status = resp.status
            data = await resp.read()
            if resp.status != 200:
                try:
                    shaped = "message" in json.loads(data)["error"]
                except (ValueError, KeyError, TypeError):
                    shaped = False
                if resp.status == 429:
                    return "rejected" if shaped and "Retry-After" in resp.headers else "unclean"
                return "clean" if shaped else "unclean"
            if not stream:
                return "ok" if "choices" in json.loads(data) else "unclean"
            events = [ln[6:] for ln in data.split(b"\n") if ln.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                return "unclean"
            last = json.loads(events[-2]) if len(events) > 1 else {}
            return "clean" if "error" in last else "ok"
    except aiohttp.ClientConnectorError:
        return "refused"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError):
        return "cut"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        UNCLEAN[f"{type(exc).__name__} (status {status})"] += 1
        return "unclean"


async def clients(url: str, n: int, seconds: float, max_tokens: int = 8,
                  log: list[tuple[float, float, str]] | None = None,
                  stop: threading.Event | None = None) -> Counter:
    """``n`` streaming clients, each sending one request after the other for ``seconds``
    or until ``stop`` is set (a client rejected with 429 waits a little before its next).
    Returns the outcomes; ``log`` gets (start, end, outcome) per request (monotonic s)."""
    counts: Counter = Counter()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        end = time.monotonic() + seconds

        async def client(i: int) -> None:
            k = 0
            while time.monotonic() < end and not (stop is not None and stop.is_set()):
                t0 = time.monotonic()
                prompt = f"client {i} request {k}: " + "the pool remembers every block. " * (1 + k % 4)
                outcome = await one_request(session, url, prompt, max_tokens)
                counts[outcome] += 1
                if log is not None:
                    log.append((t0, time.monotonic(), outcome))
                k += 1
                if outcome in ("rejected", "refused", "clean"):
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(client(i) for i in range(n)))
    return counts


async def burst(url: str, n: int, max_tokens: int = 16) -> tuple[Counter, float]:
    """``n`` streaming requests at once, one per client; returns the outcomes and seconds."""
    connector = aiohttp.TCPConnector(limit=0)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:
        outcomes = await asyncio.gather(*(one_request(s, url, f"burst client {i}: hello pool " * 3,
                                                      max_tokens) for i in range(n)))
    return Counter(outcomes), time.monotonic() - t0


def recovery_s(log: list[tuple[float, float, str]], killed_at: float) -> float:
    """Seconds from the kill to the end of the first request sent after it that succeeded
    (inf when none did)."""
    ends = [end for start, end, outcome in log if start >= killed_at and outcome == "ok"]
    return (min(ends) - killed_at) if ends else float("inf")


def failed_in_flight(log: list[tuple[float, float, str]], killed_at: float) -> Counter:
    """Outcomes other than ok of the requests in flight at the kill or sent after it."""
    return Counter(o for start, end, o in log if end >= killed_at and o != "ok")
