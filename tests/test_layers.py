"""Which package may import which: the layering docs/architecture.md draws, checked on every
module's imports (read with ``ast``, so a function-local import counts too)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "engines", "scheduler", "launcher")

# The layers, lowest first: each imports only the ones below it.
BELOW = {"kvstore": set(), "engines": {"kvstore"}, "scheduler": {"kvstore", "engines"},
         "launcher": {"kvstore", "engines", "scheduler"}}

# The scheduler's roles: pure decisions at the bottom, the HTTP front doors at the top;
# config.py, trace.py and stats.py are shared by the rest.
SCHEDULER = {
    "scheduler.policy": set(),
    "scheduler.trace": set(),
    "scheduler.stats": set(),
    "scheduler.config": {"scheduler.policy"},
    "scheduler.routing": {"scheduler.policy"},
    "scheduler.sim": {"scheduler.policy", "scheduler.trace", "scheduler.stats"},
    "scheduler.replay": {"scheduler.sim", "scheduler.trace", "scheduler.stats"},
    "scheduler.frontdoor": {"scheduler.config", "scheduler.policy", "scheduler.routing", "scheduler.replay",
                            "scheduler.trace", "scheduler.stats"},
    "scheduler.vllm": {"scheduler.config", "scheduler.frontdoor", "scheduler.policy", "scheduler.routing",
                       "scheduler.trace"},
}

# The pool sits on the tiers and the index; the wires, the service and the cluster sit on it.
POOL_MAY_IMPORT = {"kvstore.pool", "kvstore.errors", "kvstore.index", "kvstore.integrity", "kvstore.registry",
                   "kvstore.tiers", "kvstore.limits"}


def imports_of(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def unit(module: str) -> str:
    """The unit a rule speaks of: ``scheduler.policy``, ``scheduler.config``, ``kvstore.pool``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("scheduler", "kvstore") and len(parts) > 1 else parts[0]


def violations(module: str, imported: set[str]) -> list[str]:
    out = []
    top = module.split(".")[0]
    for m in sorted(imported):
        other = m.split(".")[0]
        if other != top and other not in BELOW[top]:
            out.append(f"{module} imports {m}: {top} sits below {other}")
        if top == "scheduler" == other and unit(m) != unit(module) and unit(module) in SCHEDULER \
                and unit(m) not in SCHEDULER[unit(module)]:
            out.append(f"{module} imports {m}: {unit(module)} may import only {sorted(SCHEDULER[unit(module)])}")
        if unit(module) == "kvstore.pool" and other == "kvstore" and unit(m) not in POOL_MAY_IMPORT:
            out.append(f"{module} imports {m}: the pool may import only {sorted(POOL_MAY_IMPORT)}")
    return out


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            mods[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return mods


def test_every_module_imports_only_what_its_layer_may() -> None:
    mods = _modules()
    assert len(mods) > 150 and "scheduler.policy.conductor" in mods and "kvstore.pool.pool" in mods
    bad = [v for name, path in sorted(mods.items()) for v in violations(name, imports_of(path.read_text()))]
    assert not bad, "\n".join(bad)


def test_every_scheduler_module_has_a_rule() -> None:
    units = {unit(m) for m in _modules() if m.startswith("scheduler.") and m != "scheduler.__init__"}
    assert units <= set(SCHEDULER), sorted(units - set(SCHEDULER))


def test_the_check_catches_a_module_that_reaches_up() -> None:
    src = "import launcher.cli\nfrom scheduler.frontdoor.server import Frontdoor\nfrom kvstore.service import X\n"
    assert violations("kvstore.pool.pool", imports_of(src)) == [
        "kvstore.pool.pool imports kvstore.service: the pool may import only " + str(sorted(POOL_MAY_IMPORT)),
        "kvstore.pool.pool imports launcher.cli: kvstore sits below launcher",
        "kvstore.pool.pool imports scheduler.frontdoor.server: kvstore sits below scheduler"]
    assert violations("scheduler.policy.conductor", imports_of("def f():\n    import scheduler.routing.router\n")) \
        == ["scheduler.policy.conductor imports scheduler.routing.router: scheduler.policy may import only []"]
    assert violations("scheduler.vllm.app", imports_of("from scheduler.frontdoor.app import make_app\n")) == []
