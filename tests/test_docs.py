"""The docs stay true as code moves: every relative link in README.md and docs/*.md
points at a file that exists, and every repository path named in backticks in docs/ (like
``kvstore/pool/pool.py`` or ``tests/kvstore/index/test_keys.py::test_x``) exists, and no code or test cites the
design files a clone does not have (docs/README.md says why). The README stays a front page
(at most 300 lines; every other topic has its home in docs/), nothing in the product speaks
of its development history, and the benchmark figures are the tables benchmarks/report.py
generates from benchmarks/results/*.json."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
# A backticked word is taken as a repository path when it starts at a top-level entry of
# the repository and has no spaces or placeholders: `kvstore/pool/pool.py`, `docs/grafana/`.
TOP_LEVEL = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith("."))
PATHLIKE = re.compile(r"^[A-Za-z0-9_.\-/]+(::[A-Za-z0-9_\[\]\-]+)?$")


def _prose(text: str) -> str:
    """The text without fenced code blocks (diagrams and byte layouts, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(path.read_text()).splitlines() if line.startswith("#")}


def links_missing(doc: Path, text: str) -> list[str]:
    """Relative links of ``text`` (a page at ``doc``) whose file, or whose #anchor in a
    Markdown file, does not exist."""
    missing = []
    for link in LINK.findall(_prose(text)):
        if "://" in link or link.startswith("mailto:"):
            continue
        file, _, anchor = link.partition("#")
        target = doc.parent / file if file else doc
        if not target.exists():
            missing.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            missing.append(link)
    return missing


def paths_in(text: str) -> list[str]:
    """The words of ``text`` in backticks that name repository paths (outside code blocks)."""
    out = []
    for word in CODE.findall(_prose(text)):
        if PATHLIKE.match(word) and "/" in word.split("::")[0] and word.split("/", 1)[0] in TOP_LEVEL:
            out.append(word)
    return out


def paths_missing(text: str) -> list[str]:
    """Paths named in ``text`` that do not exist (for ``file::test``: a file without that test)."""
    missing = []
    for word in paths_in(text):
        file, _, test = word.partition("::")
        target = ROOT / file
        if not target.exists() or (test and f"def {test.split('[')[0]}(" not in target.read_text()):
            missing.append(word)
    return missing


def test_docs_exist_and_are_linked_from_the_readme() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "architecture.md", "key-spec.md", "wires.md", "extending.md", "benchmarks.md"} <= names
    readme_links = LINK.findall((ROOT / "README.md").read_text())
    assert "docs/README.md" in readme_links, "the README links the design docs' index"
    index_links = LINK.findall((ROOT / "docs" / "README.md").read_text())
    for page in sorted(names - {"README.md"}):
        assert page in index_links, f"docs/README.md does not link {page}"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(doc: Path) -> None:
    missing = links_missing(doc, doc.read_text())
    assert not missing, f"{doc.relative_to(ROOT)} links to files or anchors that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_in_backticks_exists(doc: Path) -> None:
    missing = paths_missing(doc.read_text())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_checks_catch_what_moved() -> None:
    """The checkers are not vacuous: on a page naming a moved module, a missing test, a dead
    link and a dead anchor they report each, and they see the real paths of the docs."""
    page = ("See `kvstore/pool/pool.py`, `kvstore/no_such_module.py`, `tests/test_docs.py::test_nothing_here`,\n"
            "`tests/test_docs.py::test_the_checks_catch_what_moved`, `a phrase/with spaces`, `/dev/shm/x`,\n"
            "[gone](no-such-page.md), [arch](architecture.md#7-how-a-request-flows), "
            "[dead](architecture.md#no-such-section).\n```\n`kvstore/in_a_code_block.py`\n```\n")
    assert paths_in(page) == ["kvstore/pool/pool.py", "kvstore/no_such_module.py",
                              "tests/test_docs.py::test_nothing_here",
                              "tests/test_docs.py::test_the_checks_catch_what_moved"]
    assert paths_missing(page) == ["kvstore/no_such_module.py", "tests/test_docs.py::test_nothing_here"]
    assert links_missing(ROOT / "docs" / "x.md", page) == ["no-such-page.md", "architecture.md#no-such-section"]
    assert len(paths_in((ROOT / "docs" / "architecture.md").read_text())) > 40


def test_no_code_cites_design_files_outside_the_repository() -> None:
    packages = ("kvstore", "engines", "scheduler", "launcher", "tests", "benchmarks", "protos", "configs", "docs")
    files = [p for d in packages for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".proto", ".toml", ".md")]
    files += [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    stale = re.compile(r"DESIGN\.md|BENCHMARKS\.md|issue[ ]case")
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in files if p.is_file()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if stale.search(line)]
    assert len(files) > 100 and not hits, f"cite docs/ (file and section) instead: {hits}"


def test_tests_name_the_behaviour_they_check() -> None:
    """A test says what it checks, not which numbered case of some issue it was ("Case 3:",
    "Cases 1, 6 and 8 are marked"): the issue is not in the clone."""
    numbered = re.compile(r"\b[Cc]ases? [0-9]+\b|\btest_case[0-9]")
    files = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_docs.py"]
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in files
            for n, line in enumerate(p.read_text().splitlines(), 1) if numbered.search(line)]
    assert len(files) > 100 and not hits, f"name the behaviour instead: {hits}"


README_MAX_LINES = 300
# The project's development history, which belongs to `git log`: numbered work sessions,
# numbered issues or stops, and what the product did in the past.
HISTORY = re.compile(r"\bsession [0-9]|\bissue [0-9#]|\bstop [0-9]|\bused to\b", re.I)
# A commit named in prose (outside code spans and blocks): 7 to 40 hex digits, letters and digits both.
COMMIT = re.compile(r"(?<![-\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
PRODUCT_DIRS = ("kvstore", "engines", "scheduler", "launcher", "tests", "benchmarks", "protos", "configs", "docs")


def history_in(text: str) -> list[str]:
    """The phrases of ``text`` that speak of the development history, and the commits its prose
    names (a commit inside backticks, such as a benchmark's provenance, is not history)."""
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    return [m.group(0) for m in HISTORY.finditer(text)] + COMMIT.findall(prose)


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move topics to docs/ (at most {README_MAX_LINES})"


def test_no_page_code_or_test_speaks_of_the_development_history() -> None:
    files = [p for d in PRODUCT_DIRS for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md", ".toml", ".proto")]
    files += [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    hits = []
    for p in files:
        text = p.read_text(errors="replace")
        found = history_in(text) if p.suffix == ".md" else [m.group(0) for m in HISTORY.finditer(text)]
        hits += [f"{p.relative_to(ROOT)}: {h!r}" for h in found]
    assert len(files) > 100 and not hits, f"speak of the product as it is (its history is git log): {hits}"


def test_the_history_check_catches_what_it_should() -> None:
    # the sample is put together at run time, so that this file itself speaks no history
    sess, iss, stp, past, rev = "sess" + "ion", "iss" + "ue", "st" + "op", "used" + " to", "5a11" + "e9c"
    page = (f"Measured in {sess} 39, fixed in {rev}; the node {past} crash ({iss} 14, {stp} 3).\n"
            "A session token, `3475fc0ab`, the TTFT p50, key-0123456789abcdef, reused tokens.\n"
            "```\ncommit 8ddf783 in a code block\n```\n")
    assert history_in(page) == [f"{sess} 3", past, f"{iss} 1", f"{stp} 3", rev]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_tables_are_generated_from_the_results() -> None:
    """docs/benchmarks.md's tables and the README's headline are what benchmarks/report.py
    makes of benchmarks/results/*.json (a recorded figure stands only where its JSON is
    absent); each benchmark of docs/benchmarks.md has its table."""
    report = _report()
    stale = [str(path.relative_to(ROOT)) for path, text in report.generate().items() if path.read_text() != text]
    assert not stale, f"run python benchmarks/report.py: stale tables in {stale}"
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")}
    for name in sorted(scripts):
        assert name in doc, f"docs/benchmarks.md has no section for {name}.py"
    assert {t.name for t in report.TABLES} >= {"pool", "dataplane", "index", "scheduler", "simulate", "vllm",
                                               "vllm_pd", "vllm_events", "faults", "kill9"}


def test_the_report_marks_what_is_not_measured(tmp_path) -> None:
    """Without a JSON a table says so (or shows the recorded figure with its date); with one it
    names the run's date, commit and machine, and whether each target held."""
    report = _report()
    table = next(t for t in report.TABLES if t.name == "scheduler")
    report.RESULTS = tmp_path
    assert "Not measured here" in report.render_table(table, {})
    rec = {("scheduler", "ratios.decision_p99_ms_64_instances"): ("0.38 ms", "2026-12-06")}
    recorded = report.render_table(table, rec)
    assert "0.38 ms (recorded 2026-12-06) | ≤ 1.0 ms | met" in recorded
    (tmp_path / "scheduler.json").write_text(json.dumps({
        "ratios": {"decision_p99_ms_64_instances": 1.5},
        "run": {"date": "2026-12-07", "commit": "0123456789ab", "machine": {"summary": "a test machine"}}}))
    measured = report.render_table(table, {})
    assert "Measured 2026-12-07 at commit `0123456789ab` on a test machine." in measured
    assert "| 1.50 ms | ≤ 1.0 ms | **missed** |" in measured
