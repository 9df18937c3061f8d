"""Every module of the store imports on its own, first, in a fresh interpreter: an import
cycle shows only when its modules load in one order (``kvstore.dataplane.control_client``
first once hit ``kvstore.limits`` half-initialised through the SSD tier), so importing the
package once proves nothing."""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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

    def imports(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    with ThreadPoolExecutor(4) as pool:     # one interpreter per module, a few at a time
        failed = {n: r.stderr.strip() for n, r in zip(names, pool.map(imports, names)) if r.returncode}
    assert not failed, "\n".join(f"{n}: {err.splitlines()[-1] if err else '?'}" for n, err in sorted(failed.items()))
