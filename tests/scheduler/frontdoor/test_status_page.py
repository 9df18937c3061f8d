"""The front door's status page in a real headless browser (Chromium from Debian's packages,
``make system-deps``): a store node, a prefill and a decode engine (the tiny model) and a
front door with an API key on 127.0.0.1; after some traffic — admitted requests that hit the
cache and rejected ones — Chromium loads ``/status``, its script fetches ``/status.json``
and renders it, and the test reads the rendered DOM."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest

from scheduler.config import FrontdoorConfig
from tests.helpers.frontdoor_cluster import Cluster, call, complete

KEY = "status-page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make system-deps "
                                "installs Debian's chromium package)")


class DomIndex(HTMLParser):
    """The text of every element with an ``id``, and the cells of each table row carrying a
    ``data-*`` attribute, from a dumped DOM."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.attrs_by_id: dict[str, dict[str, str]] = {}
        self.rows: list[tuple[dict[str, str], list[tuple[dict[str, str], str]]]] = []
        self.polylines: list[dict[str, str]] = []
        self._open: list[tuple[str, str | None]] = []     # (tag, id) of the elements open
        self._text: dict[str, list[str]] = {}
        self._row: tuple[dict[str, str], list[tuple[dict[str, str], str]]] | None = None
        self._cell: tuple[dict[str, str], list[str]] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "polyline":
            self.polylines.append(a)
            return
        if "id" in a:
            self._text[a["id"]] = []
            self.attrs_by_id[a["id"]] = a
        self._open.append((tag, a.get("id")))
        if tag == "tr":
            self._row = (a, [])
        elif tag == "td" and self._row is not None:
            self._cell = (a, [])

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            t, ident = self._open.pop()
            if ident is not None:
                self.by_id[ident] = "".join(self._text.pop(ident)).strip()
            if t == tag:
                break
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row[1].append((self._cell[0], "".join(self._cell[1]).strip()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        for ident in self._text:
            self._text[ident].append(data)
        if self._cell is not None:
            self._cell[1].append(data)

    def row(self, **data: str) -> dict[str, str]:
        """The one row whose ``data-*`` attributes include ``data``: its cells by their
        ``data-field`` (and ``cells``: every cell's text in order)."""
        want = {f"data-{k}": v for k, v in data.items()}
        found = [r for r in self.rows if want.items() <= r[0].items()]
        assert len(found) == 1, f"{len(found)} rows with {want}: {[r[0] for r in self.rows]}"
        cells = found[0][1]
        out = {a["data-field"]: text for a, text in cells if "data-field" in a}
        out["cells"] = json.dumps([text for _, text in cells])
        return out


def dump_dom(url: str, profile: str) -> str:
    """The DOM of ``url`` after its scripts ran (Chromium headless, 10 s of virtual time)."""
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-extensions", f"--user-data-dir={profile}", "--virtual-time-budget=10000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def feed(url: str) -> dict[str, Any]:
    status, _, body = call(url, "/status.json", headers=AUTH)
    assert status == 200, body
    return json.loads(body)


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def size(n: int) -> str:
    """Bytes as the page writes them."""
    for unit, b in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= b:
            return f"{n / b:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[Cluster, str]]:
    c = Cluster(str(tmp_path_factory.mktemp("status")))
    # 200 KV tokens per decode instance: a 64-token prompt is admitted, a 400-token one
    # rejected (decode_capacity), whatever the predictors say.
    url = c.frontdoor(FrontdoorConfig(api_keys=frozenset({KEY}), decode_kv_capacity_tokens=200))
    yield c, url
    c.close()


def test_status_page_renders_traffic_in_headless_chromium(stack, tmp_path):
    cluster, url = stack
    prompt = "The status page shows what the cluster does: nodes, tiers, queues."   # 64 bytes
    told = [complete(url, {"prompt": prompt, "max_tokens": 4}, AUTH)["usage"] for _ in range(3)]
    assert [u["completion_tokens"] for u in told] == [4, 4, 4]
    for _ in range(2):
        status, _, body = call(url, "/v1/completions", {"prompt": "x" * 400, "max_tokens": 4}, AUTH)
        assert status == 429 and json.loads(body)["error"]["code"] == "decode_capacity"
    after = time.time()
    deadline = time.monotonic() + 15     # the feed samples anew at most once a second
    while feed(url)["sampled_at"] < after and time.monotonic() < deadline:
        time.sleep(0.2)

    html = dump_dom(f"{url}/status#key={KEY}", str(tmp_path / "profile"))
    assert 'data-state="ready"' in html, html[-3000:]
    dom = DomIndex(html)
    assert dom.attrs_by_id["status"]["class"] in ("badge ok", "badge degraded"), dom.by_id
    assert dom.by_id["status"] in ("ok", "degraded")
    now = feed(url)   # what the page fetched: the counters have not moved since the traffic

    assert dom.by_id["model"] == now["model"] and dom.by_id["policy"] == now["policy"]
    assert dom.by_id["admitted"] == "3"
    assert dom.by_id["inflight"] == "0"
    assert dom.by_id["admitted-window"] == "3" and dom.by_id["rejected-window"] == "2"
    assert json.loads(dom.row(reason="decode_capacity")["cells"]) == ["decode_capacity", "2"]

    # The hit ratios: the first prompt was cold, the next two reused its 4 full blocks, as
    # their clients were told; the prefill engine's reuse lookups found none of the 4 blocks
    # the first time and all 4 the next two; every prompt token went to decode (a hand-off,
    # not a hit).
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in told] == [0, 64, 64]
    assert now["hit_ratio"]["tokens"] == pytest.approx(128 / sum(u["prompt_tokens"] for u in told))
    assert now["hit_ratio"]["lookups"] == pytest.approx(8 / 12)
    assert now["hit_ratio"]["handoff"] == pytest.approx(1.0)
    assert dom.by_id["hit-tokens"] == pct(now["hit_ratio"]["tokens"])
    assert dom.by_id["hit-lookups"] == pct(now["hit_ratio"]["lookups"])
    assert dom.by_id["hit-reads"] == pct(now["hit_ratio"]["reads"])
    assert dom.by_id["hit-handoff"] == pct(now["hit_ratio"]["handoff"])
    assert any(p.get("data-series") == "tokens" for p in dom.polylines)

    # Tiers as the pool counts them.
    dram = next(s for s in cluster.pool.stats() if s.name == "dram")
    node_id = cluster.pool.node_id
    row = dom.row(node=node_id, tier="dram")
    assert row["blocks"] == str(dram.blocks) and dram.blocks > 0
    assert row["hits"] == str(dram.hits) and row["misses"] == str(dram.misses)
    assert row["lookup-hits"] == str(dram.lookup_hits) and row["lookup-misses"] == str(dram.lookup_misses)
    assert row["used"] == f"{size(dram.used_bytes)} of {size(dram.capacity_bytes)}"
    assert row["use"].endswith(pct(dram.used_bytes / dram.capacity_bytes))
    assert json.loads(row["cells"])[2] == "up"
    assert dom.row(node=node_id, tier="ssd")["blocks"] == str(next(s for s in cluster.pool.stats()
                                                                   if s.name == "ssd").blocks)

    # Instances and their queues (idle now).
    assert dom.row(instance="prefill-0")["queued"] == "0"
    assert dom.row(instance="decode-0")["running"] == "0"
    assert json.loads(dom.row(instance="decode-0")["cells"])[:3] == ["decode-0", "decode", "up"]


def test_status_page_without_the_key_asks_for_it(stack, tmp_path):
    _, url = stack
    html = dump_dom(f"{url}/status", str(tmp_path / "profile"))
    assert 'data-state="need-key"' in html
    dom = DomIndex(html)
    assert dom.by_id["error"] == "an API key is needed"
    assert "prefill-0" not in html                        # no data without the key
    wrong = dump_dom(f"{url}/status#key=wrong", str(tmp_path / "profile2"))
    assert 'data-state="need-key"' in wrong and "that API key was refused" in wrong


def test_status_feed_takes_the_api_key_and_the_page_holds_no_data(stack):
    _, url = stack
    assert call(url, "/status.json")[0] == 401
    assert call(url, "/status.json", headers={"Authorization": "Bearer wrong"})[0] == 401
    status, headers, body = call(url, "/status")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b"prefill-0" not in body and b"status.js" in body
    csp = headers["Content-Security-Policy"]   # the browser tests above render under it
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, headers, _ = call(url, "/status.js")
    assert status == 200 and "javascript" in headers["Content-Type"]
    snap = feed(url)
    assert {i["id"] for i in snap["instances"]} == {"prefill-0", "decode-0"}
    assert snap["nodes"] and snap["nodes"][0]["state"] == "up"
    assert {t["name"] for t in snap["nodes"][0]["tiers"]} == {"dram", "ssd"}
    assert 0 <= (snap["hit_ratio"]["lookups"] or 0) <= 1 and 0 <= (snap["hit_ratio"]["reads"] or 0) <= 1


def test_status_page_names_a_store_node_that_is_down(stack, tmp_path):
    """Last in the module: the store node stops; the feed and the page list it down, with
    the reason, and the engines are still shown."""
    cluster, url = stack
    cluster.store_server.stop(None).wait()
    deadline = time.monotonic() + 15     # the feed samples anew at most once a second
    while (snap := feed(url))["nodes"][0]["state"] == "up" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert snap["nodes"][0]["state"].startswith("down: ") and snap["nodes"][0]["tiers"] == []
    dom = DomIndex(dump_dom(f"{url}/status#key={KEY}", str(tmp_path / "profile")))
    cells = json.loads(dom.row(node=snap["nodes"][0]["node_id"])["cells"])
    assert cells[2].startswith("down: ")
    assert dom.row(instance="prefill-0")["queued"] == "0"
