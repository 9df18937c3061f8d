"""The demo's PNGs (scheduler/replay/plots.py) from a report read back from its JSON, as
``benchmarks/vllm_serving.py --plots docs`` draws docs/demo_hit_ratio.png from
benchmarks/results/serving.json: the JSON's requests keep their prompt and cached tokens only,
and the hit-ratio curve follows them (it was flat at 0)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.replay.compare_setups import SetupComparison
from scheduler.replay.plots import _cumulative_hit, write_plots

pytest.importorskip("matplotlib")
SERVING = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "serving.json"


def test_a_report_read_back_from_json_plots_its_hit_ratio_in_prompt_tokens(tmp_path):
    doc = json.loads(SERVING.read_text())
    c = SetupComparison.from_dict(doc)
    for run in c.runs:
        sent = [r for r in doc["setups"][run.name]["requests"] if r["status"] != "skipped"]
        want = sum(r["cached_tokens"] for r in sent if r["status"] == "ok") / sum(r["prompt_tokens"] for r in sent)
        ys = _cumulative_hit(run.report, "tokens")
        assert len(ys) == len(sent) and ys[-1] == pytest.approx(want)
        assert _cumulative_hit(run.report, "blocks")[-1] == 0.0          # the JSON keeps no trace blocks
    kvstore = {run.name: run for run in c.runs}["kvstore"]
    assert _cumulative_hit(kvstore.report, "tokens")[-1] > 0.3
    paths = write_plots(c, tmp_path)
    assert {p.name for p in paths} == {"demo_ttft_cdf.png", "demo_hit_ratio.png"}
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
