"""Hosts on this machine alone: each a Linux network namespace with its own address on a
private bridge, for the multi-host harness (``benchmarks/multihost.py``).

:class:`Topology` ``(n, prefix)`` makes a bridge ``PREFIX-br`` holding ``198.18.X.254/24``
in the root namespace, and hosts ``PREFIX-h1`` .. ``PREFIX-hN``, host ``i`` at
``198.18.X.i/24`` on a veth pair whose root-side end is ``PREFIX-vI``. The addresses come from
198.18.0.0/15, the range set aside for network benchmarks (RFC 2544), so none stands for a
real host; the hosts get no default route, so nothing in them reaches past the bridge.

Every name starts with :data:`BASE` ("kvh"), then the run's own part (``kvh<pid>``): a run
never touches another live run's names, and :func:`sweep` removes those of runs whose
process is gone (a killed run), killing what still runs in their namespaces by pid.
:meth:`Topology.up` sweeps first; :meth:`Topology.down` runs on exit, at interpreter exit
and on SIGTERM/SIGINT too.

Each host has its own ``/dev/shm`` as well (``/dev/shm/PREFIX-hI`` bound over it in the mount
namespace ``ip netns exec`` makes): hosts share the kernel, so a store node's shared-memory slab
would otherwise be mapped by a client on another host (kvstore's ``auto`` transport takes the
mapped slab when the node's boot id is its own) and no byte would cross the bridge. Processes
of one host share theirs, as on a real host.

A link cut (:meth:`Topology.cut`) sets the root-side veth down: the host's peers then see
timeouts (no reset, as a pulled cable), while inside the host the interface stays up.
Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2); :func:`unavailable` says why not.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

BASE = "kvh"
SHM = "/dev/shm"
# run inside a host: its own /dev/shm (a directory of the real one bound over it), then the command
_OWN_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'


def _ip(*args: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can): not root, no
    ``ip``, or the kernel refuses (a container without CAP_NET_ADMIN)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root for the multi-host harness"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{BASE}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _owner(name: str) -> int | None:
    """The pid in a harness name (``kvh<pid>-...``), None for a name of another shape."""
    head = name[len(BASE):].split("-", 1)[0]
    return int(head) if name.startswith(BASE) and head.isdigit() else None


def _remove(namespaces: Sequence[str], links: Sequence[str]) -> None:
    for ns in namespaces:
        shutil.rmtree(os.path.join(SHM, ns), ignore_errors=True)
        for pid in _ip("netns", "pids", ns, check=False).split():
            try:   # what still runs inside (a killed run's services), by pid
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", ns, check=False)
    for link in links:     # veths die with their peer's namespace; the bridge does not
        _ip("link", "del", link, check=False)


def _ours() -> tuple[list[str], list[str]]:
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line.strip()]
    links = [line.split(": ")[1].split("@")[0] for line in _ip("-o", "link", "show", check=False).splitlines()
             if ": " in line]
    shm = os.listdir(SHM) if os.path.isdir(SHM) else []     # a host's /dev/shm outlives nothing of its run
    return (sorted({n for n in namespaces + shm if n.startswith(BASE)}),
            [x for x in links if x.startswith(BASE)])


def sweep() -> list[str]:
    """Remove the namespaces and links of harness runs whose process is gone; returns their
    names."""
    namespaces, links = _ours()
    stale_ns = [n for n in namespaces if (p := _owner(n)) is None or not _alive(p)]
    stale_links = [x for x in links if (p := _owner(x)) is None or not _alive(p)]
    _remove(stale_ns, stale_links)
    return stale_ns + stale_links


class Topology:
    """``n`` hosts on a private bridge (see the module's docstring). ``subnet`` picks the
    third octet (198.18.SUBNET.0/24; by default the first from the pid's on that no interface
    holds yet, at :meth:`up`, so two runs at once do not share addresses)."""

    def __init__(self, n: int, subnet: int | None = None) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"between 1 and 250 hosts, got {n}")
        self.n = n
        self.prefix = f"{BASE}{os.getpid()}"
        self.subnet = subnet
        self.net = f"198.18.{os.getpid() % 250 if subnet is None else subnet}"
        self.bridge = f"{self.prefix}-br"
        self.root_address = f"{self.net}.254"
        self._up = False
        self._old_handlers: dict[int, Any] = {}

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        return f"{self.net}.{i}"

    def veth(self, i: int) -> str:
        return f"{self.prefix}-v{i}"

    def up(self) -> Topology:
        sweep()
        self.down()            # this run's own names, should a previous up() have failed midway
        if self.subnet is None:
            used = {line.split("inet 198.18.", 1)[1].split(".")[0]
                    for line in _ip("-o", "-4", "addr", "show", check=False).splitlines() if "inet 198.18." in line}
            first = os.getpid() % 250
            self.net = "198.18." + next(str(k) for k in ((first + j) % 250 for j in range(250)) if str(k) not in used)
        self.root_address = f"{self.net}.254"
        self._up = True
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(1, self.n + 1):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.join(SHM, ns), 0o700)
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.down()
        old = self._old_handlers.get(signum)
        if callable(old):
            old(signum, frame)
        else:
            sys.exit(128 + signum)

    def down(self) -> None:
        """Kill what runs in the hosts, remove them and the bridge. Idempotent."""
        namespaces, links = _ours()
        _remove([n for n in namespaces if n.startswith(self.prefix + "-")],
                [x for x in links if x.startswith(self.prefix + "-")])
        if self._up:
            self._up = False
            atexit.unregister(self.down)
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()

    def cut(self, *hosts: int) -> None:
        """Cut the hosts' links (their root-side veth down): a partition of them from the rest."""
        for i in hosts:
            _ip("link", "set", self.veth(i), "down")

    def heal(self, *hosts: int) -> None:
        for i in hosts:
            _ip("link", "set", self.veth(i), "up")

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``i`` (its network namespace and its own /dev/shm)."""
        return ["ip", "netns", "exec", self.ns(i), "sh", "-c", _OWN_SHM, os.path.join(SHM, self.ns(i)), *argv]

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` (``subprocess.Popen`` keywords)."""
        return subprocess.Popen(self.argv(i, argv), **kw)

    def run(self, i: int, argv: Sequence[str], timeout_s: float = 60.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``i`` to its end; its output captured as text."""
        return subprocess.run(self.argv(i, argv), capture_output=True, text=True, timeout=timeout_s, env=env)

    def pids(self, i: int) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.ns(i), check=False).split()]

    def __enter__(self) -> Topology:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
