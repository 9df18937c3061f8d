"""Child processes: starting one safely from a process that runs gRPC (:func:`guarded_argv`), and
whether one still runs (:func:`pid_alive`).

What a child must do before its program runs — take a death signal (``PR_SET_PDEATHSIG``:
SIGTERM when the process that started it dies, even by SIGKILL), or bind to some CPUs — is
done here by a small exec shim, not by ``subprocess.Popen(preexec_fn=...)``. A
``preexec_fn`` makes Python fork (no vfork or posix_spawn), and a fork runs gRPC's fork
handlers: with a channel busy in another thread, grpcio 1.80–1.85 restarts its epoll poller in
the child, which dies of SIGABRT ("epoll_wait error: Bad file descriptor") before it can exec
(grpc/grpc#43055; 2 of 100 children here, against 0 of 100 without ``preexec_fn``). Without
one, Python spawns the child with vfork and no fork handler runs.

The shim is ``python -I -S -c CODE``: no site, no package of ours imported, ~20 ms. It sets
the death signal, exits when its parent is already gone (the signal would never come), sets
the CPU affinity, restores what the interpreter changed (SIGPIPE and SIGXFSZ ignored, a
coerced ``LC_CTYPE``), then execs the program: the death signal survives ``execve``.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence

_SHIM = (
    "import os, signal, sys\n"
    "ppid, sig, cpus, keep_lc_ctype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == '1'\n"
    "if sig:\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG\n"
    "    if os.getppid() != ppid:\n"
    "        sys.exit('the process that started this one is gone')\n"
    "if cpus:\n"
    "    os.sched_setaffinity(0, [int(c) for c in cpus.split(',')])\n"
    "for s in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; an ignored signal outlives exec\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "if not keep_lc_ctype:  # PEP 538 coerced this interpreter's C locale into the environment\n"
    "    os.environ.pop('LC_CTYPE', None)\n"
    "try:\n"
    "    os.execvp(sys.argv[5], sys.argv[5:])\n"
    "except OSError as exc:\n"
    "    print(f'cannot run {sys.argv[5]}: {exc}', file=sys.stderr)\n"
    "    os._exit(127)\n"
)


def guarded_argv(argv: Sequence[str], die_with_parent: bool = True, cpus: Iterable[int] = (),
                 env: Mapping[str, str] | None = None) -> list[str]:
    """``argv`` run through the exec shim (the module docstring): SIGTERM when the calling
    process dies (``die_with_parent``; Linux), bound to ``cpus`` when given. ``env``: the
    environment the child is given (default: this process's), which the program gets unchanged.
    Pass the result to ``subprocess.Popen`` without ``preexec_fn``; the child's pid is the
    program's. Raises ValueError for an empty command, FileNotFoundError for a program not
    found (here, as ``Popen`` would, not in the child)."""
    if not argv:
        raise ValueError("guarded_argv: an empty command")
    env = os.environ if env is None else env
    if shutil.which(argv[0], path=env.get("PATH")) is None:
        raise FileNotFoundError(f"no such program: {argv[0]!r}")
    sig = int(signal.SIGTERM) if die_with_parent and sys.platform.startswith("linux") else 0
    cpu_list = ",".join(str(int(c)) for c in cpus)
    keep = "1" if "LC_CTYPE" in env else "0"
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), str(sig), cpu_list, keep, *argv]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
