"""Every module of the store imports on its own, first, in a fresh interpreter: an import
cycle shows only when its modules load in one order (``kvstore.dataplane.control_client``
first once hit ``kvstore.limits`` half-initialised through the SSD tier), so importing the
package once proves nothing."""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import kvstore

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    names = ["kvstore"]
    names += [m.name for m in pkgutil.walk_packages(kvstore.__path__, "kvstore.") if not m.name.endswith("__main__")]
    return sorted(names)


def test_every_store_module_imports_first_in_a_fresh_interpreter() -> None:
    names = _modules()
    assert len(names) > 50, names      # the walk found the package, not an empty path
    # One interpreter per module, a few at a time: each must import as the first thing it loads.
    procs = {}
    failed = {}
    for name in names:
        procs[name] = subprocess.Popen([sys.executable, "-c", f"import {name}"], cwd=ROOT,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if len(procs) >= 4:
            _reap(procs, failed)
    while procs:
        _reap(procs, failed)
    assert not failed, "\n".join(f"{n}: {err.strip().splitlines()[-1] if err.strip() else '?'}"
                                 for n, err in sorted(failed.items()))


def _reap(procs: dict[str, subprocess.Popen], failed: dict[str, str]) -> None:
    name = next(iter(procs))
    p = procs.pop(name)
    _, err = p.communicate(timeout=120)
    if p.returncode != 0:
        failed[name] = err
