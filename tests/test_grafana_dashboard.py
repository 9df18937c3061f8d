"""The Grafana dashboard (docs/grafana/kvstore.json) asks only for series that kvstore
exports: every ``kvstore_*`` name in its queries is one the real registries of a store node,
an engine and the front door expose (families as prometheus-client reports them, with the
``_total`` / ``_bucket`` / ``_sum`` / ``_count`` samples their types add)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from engines.metrics import EngineMetrics
from engines.model import ModelConfig, load_model
from engines.prefill import PrefillEngine
from kvstore.metrics import StoreMetrics
from kvstore.pool.pool import KVPool
from scheduler.frontdoor.metrics import FrontdoorMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvstore.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("", "_sum", "_count"), "info": ("_info",), "unknown": ("",)}


def series_names(registry: CollectorRegistry) -> set[str]:
    return {f.name + suffix for f in registry.collect() for suffix in SUFFIXES[f.type]}


def queries(doc: dict) -> list[str]:
    out = []
    for panel in doc["panels"]:
        out += [t["expr"] for t in panel.get("targets", ())]
    return out + [v["query"]["query"] for v in doc["templating"]["list"] if isinstance(v.get("query"), dict)]


def test_dashboard_queries_name_only_exported_series(make_dram):
    doc = json.loads(DASHBOARD.read_text())
    pool = KVPool([make_dram(4 << 20)])
    engine = PrefillEngine(load_model(ModelConfig(block_size=16)), None, "prefill-0")
    exported = (series_names(StoreMetrics(pool).registry) | series_names(EngineMetrics(engine).registry)
                | series_names(FrontdoorMetrics().registry))
    asked = {name for q in queries(doc) for name in re.findall(r"\bkvstore_[a-z_]+\b", q)}
    assert asked, "the dashboard asks for no kvstore series"
    assert asked <= exported, f"not exported: {sorted(asked - exported)}"
    # each side of kvstore has panels
    for prefix in ("kvstore_tier_", "kvstore_block_", "kvstore_put_seconds", "kvstore_engine_prefill",
                   "kvstore_engine_prompt_tokens", "kvstore_scheduler_ttft", "kvstore_scheduler_requests_rejected"):
        assert any(a.startswith(prefix) for a in asked), prefix


def test_dashboard_is_importable_grafana_json():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] == "kvstore" and doc["schemaVersion"] >= 36
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in doc["templating"]["list"]}
    for q in queries(doc):
        assert q.count("(") == q.count(")") and q.count("{") == q.count("}"), q
        assert set(re.findall(r"\$(\w+)", q)) <= variables | {"__rate_interval", "__range"}, q
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
