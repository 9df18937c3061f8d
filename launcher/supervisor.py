"""The supervisor of ``kvstore up``: child processes started, watched and restarted with
back-off (``Child``, ``Stack``), readiness waits for gRPC and HTTP services, free ports, and
the stop on SIGTERM/SIGINT."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.child_process import guarded_argv
from kvstore.errors import Unavailable
from kvstore.port_hold import HELD_ENV, family, held, hold


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now (as the services bind, with
    SO_REUSEADDR: a port whose last connections linger in TIME-WAIT after a stack stopped is
    free, and was refused for a minute; with SO_REUSEPORT too where this process's supervisor
    holds its ports, as the services then bind: kvstore/port_hold.py)."""
    return _bindable(host, port, reuse_port=held())


def _bindable(host: str, port: int, reuse_port: bool = False) -> bool:
    with socket.socket(family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taker(host: str, holds: list[socket.socket], first: int = 0,
               skip: frozenset[int] = frozenset()) -> Callable[[], int]:
    """A source of ports for a stack's services: free ones the system picks (``first`` 0), or
    ``first``, ``first + 1``, ... in turn (``kvstore up --service-ports``), passing over the
    ports in ``skip`` (the front door's), never one twice. Each port is held
    (:func:`kvstore.port_hold.hold`, the socket appended to ``holds``, a stack's
    :attr:`Stack.holds`) until the stack stops, so no other user's process can bind it; a free
    port is the hold's own bind, never probed and released. A port something is bound to,
    even a hold or listener of this user's, is not free (a hold beside another stack's
    SO_REUSEPORT listener would share its connections); one whose last connections linger in
    TIME-WAIT is. Each call raises RuntimeError naming a port that is not free on ``host`` or
    past 65535."""
    nxt = [first]

    def take() -> int:
        if not first:
            return _take_held(host, 0, holds, "")   # a held port stays bound: never picked twice
        while nxt[0] in skip:
            nxt[0] += 1
        port = nxt[0]
        nxt[0] += 1
        if port > 65535:
            raise RuntimeError(f"--service-ports {first}: ran past port 65535")
        return _take_held(host, port, holds, f"--service-ports {first}: ")
    return take


def _take_held(host: str, port: int, holds: list[socket.socket], flag: str) -> int:
    """Hold ``port`` (0: a free one) and return it. A port anything is bound to is refused first,
    a hold or listener of this user's too (the hold, SO_REUSEPORT, could bind beside it and share
    its connections)."""
    if port and not _bindable(host, port):
        raise RuntimeError(f"{flag}port {port} on {host} is not free")
    try:
        sock = hold(host, port)
    except OSError as exc:
        raise RuntimeError(f"{flag}port {port or '(any)'} on {host} is not free ({exc.strerror or exc})") from None
    holds.append(sock)
    return sock.getsockname()[1]


_RUN_HOLDS: dict[int, socket.socket] = {}   # port → hold: the front door's, for a whole kvstore up


def hold_front_door(host: str, port: int) -> int:
    """Hold the front door's ``port`` of ``host`` (0: a free one, the hold's own bind) from
    ``kvstore up``'s preflight until :func:`release_front_door`, across every stack it starts
    (a comparison's set-ups, one after another): no other user can take it between the pick
    and the front door's start, or between two set-ups. Returns the port. Raises RuntimeError
    when it is not free (anything bound to it, this user's too)."""
    holds: list[socket.socket] = []
    port = _take_held(host, port, holds, "")
    _RUN_HOLDS[port] = holds[0]
    return port


def release_front_door(port: int | None = None) -> None:
    """Close the hold of :func:`hold_front_door` on ``port`` (None: every one; ``kvstore up`` is
    ending)."""
    for p in list(_RUN_HOLDS) if port is None else [port]:
        sock = _RUN_HOLDS.pop(p, None)
        if sock is not None:
            sock.close()


MAX_RESTARTS = 5          # per child within RESTART_WINDOW_S; one more crash stops the stack
RESTART_WINDOW_S = 300.0
BACKOFF_S = (0.5, 8.0)   # first restart delay, doubling up to the second
STOP_DEADLINE_S = 9.5    # SIGTERM, then SIGKILL of what is left (children force themselves at 8 s)


@dataclass
class Child:
    """One supervised process: how to start it again, and its crashes so far."""

    name: str
    proc: subprocess.Popen
    respawn: Callable[[], subprocess.Popen] | None = None   # starts it again (None: it cannot be)
    crashes: list[float] = field(default_factory=list)   # monotonic instants of recent crashes
    restart_at: float | None = None


# resource_tracker's lines about a killed process's shared memory: "...resource_tracker.py:NNN:
# UserWarning: resource_tracker: There appear to be N leaked shared_memory objects ..." and the
# "warnings.warn(" line after it
_TRACKER_NOTE = re.compile(r"resource_tracker\.py:\d+: UserWarning: resource_tracker: |"
                           r"^\s*warnings\.warn\('resource_tracker: ")


@dataclass
class Stack:
    """Child processes of one ``kvstore up``; stopped all at once (SIGTERM, then SIGKILL).

    :meth:`supervise` restarts a child that exited unasked, after a back-off (0.5 s doubling
    to 8 s), at most ``max_restarts`` times within ``RESTART_WINDOW_S``; one crash more is
    an error that stops the stack."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    log_dir: str = "var/up/logs"
    env: dict[str, str] = field(default_factory=dict)   # added to each child's environment (tokens)
    log_level: str | None = None      # each child's --log-level (kvstore up's own); None: the children's default
    max_restarts: int = MAX_RESTARTS
    children: dict[str, Child] = field(default_factory=dict)
    restarts: int = 0
    stopping: bool = False            # set once a stop began: a signal then kills the children
    handlers_installed: bool = False
    holds: list[socket.socket] = field(default_factory=list)   # its services' ports (port_taker), until stop
    front_door_held: bool = False     # its front door's port is held by the run (hold_front_door)

    def hold_port(self, host: str, port: int) -> None:
        """Hold ``port`` of ``host`` (the front door's) until the stack stops, unless the run
        holds it already (:func:`hold_front_door`). Raises RuntimeError when it is taken."""
        if port in _RUN_HOLDS:
            self.front_door_held = True
        else:
            _take_held(host, port, self.holds, "")

    def start(self, name: str, *argv: str) -> None:
        self.adopt(name, self._spawn(name, argv, "wb"), respawn=lambda: self._spawn(name, argv, "ab"))

    def adopt(self, name: str, proc: subprocess.Popen,
              respawn: Callable[[], subprocess.Popen] | None = None) -> None:
        """A process started elsewhere; stopped with the stack, and restarted as the others
        are by calling ``respawn`` (which returns the new process; None: never restarted,
        its exit stops the stack)."""
        self.children[name] = Child(name, proc, respawn)
        self.procs.append((name, proc))

    def _spawn(self, name: str, argv: tuple[str, ...], mode: str) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"{name}.log"), mode) as log:
            level = ["--log-level", self.log_level] if self.log_level else []
            env = {**os.environ, **self.env, **({HELD_ENV: "1"} if self.holds or self.front_door_held else {})}
            return subprocess.Popen(guarded_argv([sys.executable, "-m", "launcher", *level, *argv], env=env),
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def pid(self, name: str) -> int:
        return self.children[name].proc.pid

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = self.log_tail(name)
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def supervise(self, now: float | None = None) -> None:
        """Restart children that exited (call it every fraction of a second). Raises
        RuntimeError when one cannot be restarted or crashed too often."""
        now = time.monotonic() if now is None else now
        for child in self.children.values():
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart_at = None
                    assert child.respawn is not None   # only a restartable child is scheduled
                    child.proc = child.respawn()
                    self.procs = [(n, child.proc if n == child.name else p) for n, p in self.procs]
                    self.restarts += 1
                    print(f"kvstore up: {child.name} restarted (pid {child.proc.pid})", flush=True)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            self.sweep([child.proc.pid], sockets=False)
            child.crashes = [t for t in child.crashes if now - t < RESTART_WINDOW_S] + [now]
            if child.respawn is None or len(child.crashes) > self.max_restarts:
                why = "it cannot be restarted" if child.respawn is None else \
                    f"{self.max_restarts} restarts within {RESTART_WINDOW_S:.0f} s already"
                raise RuntimeError(f"{child.name} exited ({how}); {why}; its log ends:\n"
                                   f"{self.log_tail(child.name)}")
            delay = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (len(child.crashes) - 1))
            child.restart_at = now + delay
            print(f"kvstore up: {child.name} exited unasked ({how}); restart {len(child.crashes)} of "
                  f"{self.max_restarts} in {delay:.1f} s (log: {self.log_dir}/{child.name}.log)", flush=True)
            last = self.log_error(child.name)
            if last:
                print(f"kvstore up: {child.name}'s last error: {last}", flush=True)

    def log_error(self, name: str) -> str:
        """The last line of a child's log tail that names an error (``Error``, ``ERROR``,
        ``Traceback``), trimmed; "" when none does."""
        hits = [ln.strip() for ln in self.log_tail(name, 60).splitlines()
                if "Error" in ln or "ERROR" in ln or "Traceback" in ln]
        return hits[-1][:300] if hits else ""

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of a child's log, without Python's resource_tracker
        notes: a killed node's tracker reports the slab it then unlinks as "leaked", once
        per kill, which is its cleanup, not a fault (it had filled the tail an operator
        reads when ``kvstore up`` gives up)."""
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                kept = [line for line in f.readlines() if not _TRACKER_NOTE.search(line)]
            return "".join(kept[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """SIGTERM every child (front door first), SIGKILL those still running after
        ``deadline_s``, then remove what a killed child left (its /dev/shm slab, its Unix
        sockets)."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + deadline_s
        killed = []
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.append(proc.pid)
            if proc.returncode < 0:
                killed.append(proc.pid)
        self.sweep(killed)
        for sock in self.holds:     # every child is gone: their ports are free again
            sock.close()
        self.holds.clear()

    def sweep(self, pids: list[int], sockets: bool = True) -> None:
        """Unlink the shared-memory slabs of these (dead) children and (``sockets``) the
        data-plane sockets under the data directory (once every node has stopped)."""
        import glob
        for pid in pids:
            for path in glob.glob(f"/dev/shm/kvstore-{pid}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        root = os.path.dirname(os.path.abspath(self.log_dir))
        for path in glob.glob(os.path.join(root, "store", "*", "dataplane.sock")) if sockets else ():
            with contextlib.suppress(OSError):
                os.unlink(path)


def _wait_grpc(stack: Stack, address: str, timeout_s: float) -> None:
    import grpc
    deadline = time.monotonic() + timeout_s
    channel = grpc.insecure_channel(address)
    try:
        while True:
            stack.check_alive()
            ready = grpc.channel_ready_future(channel)
            try:
                ready.result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                ready.cancel()   # its polling thread ends now, not on the closed channel (a traceback)
                if time.monotonic() > deadline:
                    raise Unavailable(f"{address} not ready after {timeout_s} s") from None
    finally:
        channel.close()


def _wait_http(stack: Stack, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stack.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise Unavailable(f"{url} not ready after {timeout_s} s")
        time.sleep(0.2)



class _Stopped(BaseException):
    """Raised by the signal handler of ``kvstore up`` to unwind to its ``finally``."""


def _install_stop_handlers(stack: Stack) -> None:
    """SIGTERM/SIGINT: the first unwinds to the caller's stop of every child (raising
    :class:`_Stopped`); one once ``stack.stopping`` is set kills every child at once."""
    def handler(signum: int, _frame: object) -> None:
        if not stack.stopping:
            stack.stopping = True
            raise _Stopped(signal.Signals(signum).name)
        for _, proc in stack.procs:
            if proc.poll() is None:
                proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _serve_until_signal(stack: Stack) -> None:
    """Supervise the children until SIGTERM/SIGINT, then return (the caller stops them)."""
    if not stack.handlers_installed:
        _install_stop_handlers(stack)
        stack.handlers_installed = True
    try:
        while True:
            stack.supervise()
            time.sleep(0.2)
    except (_Stopped, KeyboardInterrupt) as exc:
        stack.stopping = True
        print(f"kvstore up: {exc or 'SIGINT'}: stopping", flush=True)

