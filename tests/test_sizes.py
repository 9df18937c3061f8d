"""No source file over 400 lines, no function over 80: a longer one is split along its seams
(docs/testing.md). Checked on every module of the product and its benchmarks, read with
``ast`` (a method, a nested function and an ``async def`` count as functions; a function's
lines run from its ``def``, or its first decorator, to its last line)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "engines", "scheduler", "launcher", "benchmarks")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# Files allowed over the limits, each with its reason; nothing is.
ALLOWED: dict[str, str] = {}


def too_long(name: str, source: str) -> list[str]:
    """What in the module ``name`` (its ``source``) is over the limits, one line each."""
    out = []
    lines = source.count("\n") + (not source.endswith("\n") and bool(source))
    if lines > MAX_FILE_LINES:
        out.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{name}:{node.lineno}: {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
    return out


def _sources() -> dict[str, Path]:
    return {path.relative_to(ROOT).as_posix(): path for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_source_file_or_function_is_too_long() -> None:
    sources = _sources()
    assert len(sources) > 200 and "kvstore/service.py" in sources and "launcher/cli.py" in sources
    bad = [line for name, path in sources.items() if name not in ALLOWED
           for line in too_long(name, path.read_text())]
    assert not bad, "split along their seams:\n" + "\n".join(bad)


def test_the_allow_list_names_only_files_still_too_long() -> None:
    """An entry whose file was split (or is gone) leaves the list."""
    sources = _sources()
    stale = [name for name in ALLOWED if name not in sources or not too_long(name, sources[name].read_text())]
    assert not stale, f"no longer too long, take them off ALLOWED: {stale}"


def test_the_check_catches_a_long_file_and_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"@staticmethod\ndef long():\n{body}\n\nasync def short():\n    pass\n"
    source += "\n" * (MAX_FILE_LINES + 1 - source.count("\n"))
    assert too_long("m.py", source) == [f"m.py: {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})",
                                        f"m.py:2: long is {MAX_FUNCTION_LINES + 2} lines (at most "
                                        f"{MAX_FUNCTION_LINES})"]
    assert too_long("m.py", "def f():\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1)) == []
