"""The figures of docs/benchmarks.md and the README's headline table, generated from
benchmarks/results/*.json (kept in the repository: a benchmark run is committed with the
tables it gives).

    python benchmarks/report.py           # rewrite every table between its markers
    python benchmarks/report.py --check   # exit 1, naming the tables, when one is not what the JSONs give

Each table sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``; above its rows
it names the date, the commit and the machine of its JSON (``run``, written by
``benchmarks/run_info.py``). A benchmark without a JSON here is "not measured"; where
docs/benchmarks.md's recorded table (``<!-- recorded -->``) holds an earlier figure of it,
that figure is shown with its date instead, and the row leaves the recorded table as soon as
the benchmark's JSON holds that figure (one home per figure; a JSON of some rows leaves the
others recorded).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"


@dataclass(frozen=True)
class Row:
    path: str           # dotted path into the JSON: "ratios.get_1MiB_vs_mooncake"
    label: str
    target: str = ""    # as text: "≥ 3", "≤ 0.5", "0" (must be 0)
    fmt: str = "{:.3g}"


@dataclass(frozen=True)
class Table:
    name: str           # the marker's name and the JSON's stem
    rows: tuple[Row, ...]


def _r(path: str, label: str = "", target: str = "", fmt: str = "{:.3g}") -> Row:
    return Row(path, label or f"`{path.rsplit('.', 1)[-1]}`", target, fmt)


INT, MS, GBPS, TWO = "{:,.0f}", "{:.0f} ms", "{:.2f} GB/s", "{:.2f}"
VLLM_SETUPS = (("recompute", "recompute"), ("kvstore", "kvstore"), ("mooncake", "Mooncake Store connector"),
               ("lmcache", "LMCache MP connector"))
TABLES: tuple[Table, ...] = (
    Table("pool", (_r("ratios.dram_get_1MiB_vs_copyto", target="≥ 0.5", fmt=TWO),
                   _r("ratios.dram_put_1MiB_vs_copyto", target="≥ 0.5", fmt=TWO),
                   _r("ratios.ssd_get_1MiB_vs_lmdb_raw", target="≥ 0.5", fmt=TWO),
                   _r("ratios.dram_batch_64KiB_blocks_per_s", target="≥ 50,000", fmt=INT),
                   _r("ratios.hbm_get_1MiB_vs_copyto", fmt=TWO))),
    Table("dataplane", (_r("ratios.get_1MiB_vs_mooncake", target="≥ 3", fmt=TWO),
                        _r("ratios.put_1MiB_vs_mooncake", target="≥ 3", fmt=TWO),
                        _r("ratios.get_16MiB_vs_mooncake", target="≥ 3", fmt=TWO),
                        _r("ratios.get_1MiB_vs_redis", target="≥ 5", fmt=TWO),
                        _r("ratios.put_1MiB_vs_redis", target="≥ 5", fmt=TWO),
                        _r("ratios.batch_64KiB_vs_mooncake", target="≥ 5", fmt=TWO),
                        _r("ratios.get_1MiB_vs_copyto", target="≥ 0.4", fmt=TWO),
                        _r("ratios.te_tcp_get_16MiB_vs_mooncake", target="≥ 1", fmt=TWO),
                        _r("ratios.get_1MiB_single_vs_redis_pipelined", fmt=TWO),
                        _r("ratios.put_1MiB_single_vs_redis_pipelined", fmt=TWO))),
    Table("te_probe", (_r("te_tcp_get_into_best_gbps", fmt=GBPS), _r("te_tcp_get_bytes_best_gbps", fmt=GBPS),
                       _r("te_raw_read_best_gbps", fmt=GBPS), _r("grpc_stream_get_best_gbps", fmt=GBPS),
                       _r("te_vs_grpc_stream", fmt=TWO))),
    Table("index", (_r("ratios.keys_vs_raw_sha256", target="≥ 0.8", fmt=TWO),
                    _r("ratios.lookup_block_probes_per_s", target="≥ 1,000,000", fmt=INT),
                    _r("ratios.lookup_vs_raw_dict", fmt=TWO),
                    _r("ratios.bytes_per_indexed_block", target="≤ 300", fmt=INT),
                    _r("ratios.event_lag_p99_ms", target="≤ 10 ms", fmt="{:.2f} ms"),
                    _r("figures.event_lag_p50_ms", fmt="{:.2f} ms"))),
    Table("scheduler", (_r("ratios.decision_p99_ms_64_instances", target="≤ 1.0 ms", fmt="{:.2f} ms"),
                        _r("ratios.decision_p99_ms_16_instances", fmt="{:.2f} ms"),
                        _r("ratios.decision_p50_ms_64_instances", fmt="{:.2f} ms"),
                        _r("ratios.match_share_of_decision_p50_64", fmt=TWO))),
    Table("simulate", tuple(
        [_r(f"ratios.{k}", f"`{k}` (mean of seeds 0–9)", t, "{:.3f}") for k, t in (
            ("conductor_vs_least_loaded_avg_ttft", "≤ 0.55"), ("conductor_vs_local_cache_aware_avg_ttft", "≤ 0.85"),
            ("rejected_predictive_vs_late", "≤ 0.86"), ("rejected_predictive_vs_current", "≤ 0.952"),
            ("wasted_prefill_predictive_vs_current", "≤ 0.6"))]
        + [_r(f"ratios_oracle.{k}", f"`{k}`, oracle predictors", fmt="{:.3f}") for k in (
            "conductor_vs_least_loaded_avg_ttft", "conductor_vs_local_cache_aware_avg_ttft",
            "rejected_predictive_vs_current", "wasted_prefill_predictive_vs_current")]
        + [_r("ratios.rejected_current_vs_late", fmt="{:.3f}"),
           _r("ratios.capacity_disagg_vs_colocated_tbt100ms", fmt="{:.3f}"),
           _r("ratios.unbounded_pool_hit_vs_best_possible", fmt="{:.3f}"),
           _r("ratios.wall_s_full_trace_conductor", target="≤ 30 s", fmt="{:.1f} s")]
        + [_r(f"ratios.conductor_vs_best_peer_router_{k}_ttft",
              f"`conductor_vs_best_peer_router_{k}_ttft` (Dynamo, llm-d, SGLang; mean of seeds 0–9)", "≤ 0.9",
              "{:.3f}") for k in ("avg", "p99")]
        + [_r("ratios.conductor_no_queue_vs_best_peer_router_p99_ttft",
              "`conductor_no_queue_vs_best_peer_router_p99_ttft` (the Conductor's p99 with every queue wait taken out)",
              fmt="{:.3f}")])),
    Table("vllm", tuple(
        [_r(f"setups.{k}.ttft_reuse_p50_ms", f"{label}: TTFT p50, requests with a reusable prefix", fmt=MS)
         for k, label in VLLM_SETUPS]
        + [_r(f"setups.{k}.load_ms_per_block", f"{label}: load per block", fmt="{:.2f} ms")
           for k, label in VLLM_SETUPS[1:]]
        + [_r("ratios.ttft_hit_vs_recompute", target="≤ 0.5", fmt="{:.3f}"),
           _r("ratios.ttft_hit_vs_mooncake_connector", target="≤ 0.8", fmt="{:.3f}"),
           _r("ratios.ttft_hit_vs_lmcache_connector", target="≤ 0.8", fmt="{:.3f}"),
           _r("ratios.ttft_hit_p99_vs_mooncake_connector", fmt="{:.3f}"),
           _r("ratios.load_ms_per_block_vs_mooncake_connector", fmt="{:.3f}"),
           _r("setups.recompute_tp2.ttft_reuse_p50_ms", "recompute, TP 2: TTFT p50, requests with a reusable prefix",
              fmt=MS),
           _r("setups.kvstore_tp2.ttft_reuse_p50_ms", "kvstore, TP 2: TTFT p50, requests with a reusable prefix",
              fmt=MS),
           _r("setups.mooncake_tp2.ttft_reuse_p50_ms",
              "Mooncake Store connector, TP 2: TTFT p50, requests with a reusable prefix", fmt=MS),
           _r("ratios.ttft_hit_tp2_vs_recompute_tp2", target="≤ 0.5", fmt="{:.3f}"),
           _r("ratios.ttft_hit_tp2_vs_mooncake_connector_tp2", fmt="{:.3f}"),
           _r("hold_ms_p99_after_finish", "`hold_ms_p99_after_finish` (kvstore kv_both: a finished request's "
              "blocks free again)", "≤ 20 ms", "{:.1f} ms")])),
    Table("vllm_pd", tuple(
        [_r(f"results.{t}.{k}", f"{t}: {label}", fmt=f) for t in ("disaggregated", "colocated") for k, label, f in (
            ("completed", "completed", INT), ("rejected", "rejected (429)", INT), ("itl_p99_s", "ITL p99", "{:.3f} s"),
            ("ttft_p50_s", "TTFT p50", "{:.2f} s"), ("goodput_rps", "goodput", "{:.3f} req/s"),
            ("output_tokens_per_s", "output tokens/s", "{:.1f}"))]
        + [_r("ratios.itl_p99_disagg_vs_colocated", target="≤ 0.5", fmt="{:.3f}"),
           _r("ratios.goodput_disagg_vs_colocated", target="≥ 1.2", fmt="{:.1f}"),
           _r("ratios.throughput_disagg_vs_colocated", fmt="{:.2f}")])),
    Table("routers", tuple(
        [_r(f"results.{p}.{k}", f"{p}: {label}", fmt=f) for p in ("conductor", "least_loaded", "local_cache_aware",
                                                                   "dynamo_kv", "llmd", "sglang_cache_aware")
         for k, label, f in (("ttft_p50_s", "TTFT p50", "{:.3f} s"), ("ttft_p99_s", "TTFT p99", "{:.3f} s"),
                             ("goodput_rps", "goodput", "{:.3f} req/s"))]
        + [_r("ratios.conductor_vs_best_peer_router_ttft_p50_live", target="≤ 0.9", fmt="{:.3f}"),
           _r("ratios.conductor_vs_best_peer_router_ttft_p99_live", fmt="{:.3f}"),
           _r("ratios.conductor_vs_best_peer_router_goodput_live", fmt="{:.3f}")])),
    Table("vllm_events", (_r("stored_blocks_per_s", fmt=INT), _r("stored_tokens_per_s", fmt=INT),
                          _r("removed_blocks_per_s", fmt=INT), _r("keys_only_blocks_per_s", fmt=INT),
                          _r("stored_vs_keys_only", fmt=TWO))),
    Table("faults", (_r("unclean_total", "unclean or 5xx answers, every run", "0", INT),
                     _r("overload.non_429_failures", "failures other than 429 under overload", "0", INT))),
    Table("kill9", (_r("cycles", fmt=INT), _r("acked_blocks", "acknowledged blocks", fmt=INT),
                    _r("wrong_bytes", "blocks with wrong bytes", "0", INT),
                    _r("lost_acked", "acknowledged blocks lost", "0", INT),
                    _r("usage_mismatches", "SSD usage against the LMDB file, mismatches", "0", INT))),
)

# The README's headline: (label, JSON stem, path, target, format).
HEADLINE: tuple[tuple[str, str, str, str, str], ...] = (
    ("vLLM TTFT on a prefix hit, kvstore ÷ recompute", "vllm", "ratios.ttft_hit_vs_recompute", "≤ 0.5", "{:.3f}"),
    ("vLLM TTFT on a prefix hit, kvstore ÷ Mooncake Store connector", "vllm",
     "ratios.ttft_hit_vs_mooncake_connector", "≤ 0.8", "{:.3f}"),
    ("vLLM TTFT on a prefix hit, kvstore ÷ LMCache connector", "vllm", "ratios.ttft_hit_vs_lmcache_connector",
     "≤ 0.8", "{:.3f}"),
    ("same-host get of 1 MiB, kvstore ÷ Mooncake Store", "dataplane", "ratios.get_1MiB_vs_mooncake", "≥ 3", TWO),
    ("256 × 64 KiB batched get, kvstore ÷ Mooncake Store", "dataplane", "ratios.batch_64KiB_vs_mooncake", "≥ 5", TWO),
    ("batched 1 MiB put, kvstore ÷ Redis pipelined", "dataplane", "ratios.put_1MiB_vs_redis", "≥ 5", TWO),
    ("ITL p99, disaggregated ÷ colocated vLLM", "vllm_pd", "ratios.itl_p99_disagg_vs_colocated", "≤ 0.5", "{:.3f}"),
    ("Conductor ÷ least-loaded avg TTFT (simulated, Mooncake Fig. 5: 0.58)", "simulate",
     "ratios.conductor_vs_least_loaded_avg_ttft", "≤ 0.55", "{:.3f}"),
    ("Conductor decision p99 at 64 prefill instances", "scheduler", "ratios.decision_p99_ms_64_instances", "≤ 1.0 ms",
     "{:.2f} ms"),
    ("acknowledged SSD blocks lost over `kill -9` cycles", "kill9", "lost_acked", "0", INT),
)

RECORDED = re.compile(r"<!-- recorded -->\n(.*?)<!-- /recorded -->\n", re.S)
ROW = re.compile(r"^\| *`?([a-z_0-9]+)`? *\| *`([^`]+)` *\| *([^|]+?) *\| *([0-9-]+) *\|$")


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def lookup(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def recorded(doc: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(benchmark, path) → (value as written, date) of docs/benchmarks.md's recorded table."""
    m = RECORDED.search(doc)
    out = {}
    for line in (m.group(1).splitlines() if m else []):
        row = ROW.match(line.strip())
        if row:
            out[(row.group(1), row.group(2))] = (row.group(3), row.group(4))
    return out


def _met(value: Any, target: str) -> str:
    """``met`` or ``**missed**`` for a value (or a recorded figure as text) against a target."""
    if isinstance(value, str):
        found = re.match(r"[0-9][0-9,.]*", value)
        value = float(found.group(0).replace(",", "")) if found else None
    if not target or not isinstance(value, (int, float)):
        return ""
    number = re.search(r"[0-9][0-9,.]*", target)
    if number is None:
        return ""
    bound = float(number.group(0).replace(",", ""))
    if target.startswith("≥"):
        ok = value >= bound
    elif target.startswith("≤"):
        ok = value <= bound
    else:
        ok = value == bound
    return "met" if ok else "**missed**"


def _value(fmt: str, value: Any) -> str:
    if value is None:
        return "–"
    return fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def provenance(data: dict[str, Any] | None, name: str, recorded_rows: bool = False) -> str:
    if data is None and recorded_rows:
        return (f"No benchmarks/results/{name}.json here: the figures are the recorded ones "
                "([Recorded figures](#recorded-figures)).")
    if data is None:
        return f"Not measured here: no benchmarks/results/{name}.json."
    run = data.get("run") or {}
    machine = (run.get("machine") or {}).get("summary", "machine not recorded")
    date, commit = run.get("date", "on an unrecorded date"), run.get("commit", "unknown")
    rest = " Rows marked recorded are not in the JSON." if recorded_rows else ""
    return f"Measured {date} at commit `{commit}` on {machine}.{rest}"


def render_table(table: Table, rec: dict[tuple[str, str], tuple[str, str]]) -> str:
    data = load(table.name)
    some = any((table.name, row.path) in rec for row in table.rows)
    lines = [provenance(data, table.name, some), "", "| figure | value | target | |", "|---|---|---|---|"]
    for row in table.rows:
        value = lookup(data, row.path) if data is not None else None
        if value is not None or (data is not None and (table.name, row.path) not in rec):
            target = row.target or "–"
            lines.append(f"| {row.label} | {_value(row.fmt, value)} | {target} | {_met(value, row.target)} |")
        elif (table.name, row.path) in rec:
            value, date = rec[(table.name, row.path)]
            met = _met(value, row.target)
            lines.append(f"| {row.label} | {value} (recorded {date}) | {row.target or '–'} | {met} |")
        else:
            lines.append(f"| {row.label} | not measured | {row.target or '–'} | |")
    return "\n".join(lines) + "\n"


def render_headline(rec: dict[tuple[str, str], tuple[str, str]]) -> str:
    lines = ["| figure | latest | target | | measured |", "|---|---|---|---|---|"]
    for label, name, path, target, fmt in HEADLINE:
        data = load(name)
        value = lookup(data, path) if data is not None else None
        if data is not None and (value is not None or (name, path) not in rec):
            when = (data.get("run") or {}).get("date", "–")
            lines.append(f"| {label} | {_value(fmt, value)} | {target} | {_met(value, target)} | {when} |")
        elif (name, path) in rec:
            value, date = rec[(name, path)]
            lines.append(f"| {label} | {value} | {target} | {_met(value, target)} | {date} |")
        else:
            lines.append(f"| {label} | not measured | {target} | | – |")
    return "\n".join(lines) + "\n"


DEMO_SETUPS = (("vllm", "vLLM alone"), ("kvstore", "kvstore"), ("recompute", "recompute"))


def _demo_rows(setups: dict[str, Any]) -> list[tuple[str, list[str]]]:
    def rep(name: str, key: str) -> Any:
        return setups.get(name, {}).get("report", {}).get(key)

    def sec(v: Any) -> str:
        return "–" if v is None else f"{v:.2f} s"
    rows: list[tuple[str, list[str]]] = []
    rows.append(("hit ratio: instance-local / pool (tokens)",
                 [f"{_value(TWO, setups.get(n, {}).get('hit_ratio_local'))} / "
                  f"{_value(TWO, setups.get(n, {}).get('hit_ratio_pool'))}" for n, _ in DEMO_SETUPS]))
    rows.append(("prefill tokens computed", [_value(INT, rep(n, "prefill_tokens")) for n, _ in DEMO_SETUPS]))
    rows.append(("TTFT p50", [sec(rep(n, "ttft_p50_s")) for n, _ in DEMO_SETUPS]))
    rows.append(("TTFT p99", [sec(rep(n, "ttft_p99_s")) for n, _ in DEMO_SETUPS]))
    rows.append(("ITL p99", [sec(rep(n, "tbt_p99_s")) for n, _ in DEMO_SETUPS]))
    rows.append(("goodput (req/s, both SLOs met)", [_value("{:.3f}", rep(n, "goodput_rps")) for n, _ in DEMO_SETUPS]))
    rows.append(("completed / rejected", [f"{rep(n, 'completed')} / {rep(n, 'rejected')}" for n, _ in DEMO_SETUPS]))
    rows.append(("KV memory", [_value("{:,.0f} MiB", (setups.get(n, {}).get("memory_bytes_total") or 0) / 2**20)
                               for n, _ in DEMO_SETUPS]))
    return rows


DEMO_RATIOS = (("TTFT p50, kvstore ÷ vLLM alone", "ttft_p50_kvstore_vs_vllm"),
               ("TTFT p99, kvstore ÷ vLLM alone", "ttft_p99_kvstore_vs_vllm"),
               ("goodput, kvstore ÷ vLLM alone", "goodput_kvstore_vs_vllm"),
               ("TTFT p50, kvstore ÷ recompute", "ttft_p50_kvstore_vs_recompute"),
               ("prefill tokens computed, kvstore ÷ vLLM alone", "prefill_tokens_kvstore_vs_vllm"))


def render_demo() -> str:
    """The README's demo table: the three set-ups of benchmarks/results/serving.json side by
    side, then kvstore's ratios against their targets."""
    data = load("serving")
    if data is None:
        return "Not measured here: no benchmarks/results/serving.json.\n"
    st = data.get("settings", {})
    lines = [provenance(data, "serving") + f" {st.get('requests')} trace requests at speed {st.get('speed')}, "
             f"2 vLLM instances per set-up, each with its own KV cache of {st.get('instance_kv_tokens'):,} tokens "
             f"({(st.get('instance_kv_vs_working_set') or 0):.0%} of the working set); SLOs: TTFT ≤ "
             f"{data['setups']['kvstore']['report']['ttft_slo_s']:g} s, mean ITL ≤ "
             f"{data['setups']['kvstore']['report']['tbt_slo_s']:g} s.", "",
             "| | " + " | ".join(label for _, label in DEMO_SETUPS) + " |", "|---|---|---|---|"]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in _demo_rows(data.get("setups", {}))]
    lines += ["", "| kvstore's ratio | value | target | |", "|---|---|---|---|"]
    for label, key in DEMO_RATIOS:
        value, target = lookup(data, f"ratios.{key}"), (data.get("targets") or {}).get(key, "")
        target = target.replace("<=", "≤").replace(">=", "≥")
        lines.append(f"| {label} | {_value('{:.3f}', value)} | {target or '–'} | {_met(value, target)} |")
    return "\n".join(lines) + "\n"


def _attainment(p: dict) -> str:
    """'171 of 200 (86%: 76%, 96%), 0.31 s': pooled, each replay's share where there were several."""
    shares = f": {', '.join(f'{a:.0%}' for a in p['attainments'])}" if len(p.get("attainments", [])) > 1 else ""
    return f"{p['met_slo']} of {p['requests']} ({p['attainment']:.0%}{shares}), {_value('{:.2f} s', p['ttft_p50_s'])}"


def render_capacity() -> str:
    """capacity.json: vLLM alone's and kvstore's SLO attainment per rate, capacities, ratios."""
    data = load("capacity")
    if data is None:
        return "Not measured here: no benchmarks/results/capacity.json.\n"
    lines = [provenance(data, "capacity"), "", "| speed | requests/s | vLLM alone: met both SLOs, TTFT p50 | "
             "kvstore: met both SLOs, TTFT p50 |", "|---|---|---|---|"]
    for row in data["sweep"]:
        cells = [_attainment(p) for p in (row["setups"]["vllm"], row["setups"]["kvstore"])]
        lines.append(f"| {row['speed']:g} | {row['rate_rps']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "| SLO attainment goal | vLLM alone | kvstore | kvstore ÷ vLLM alone |", "|---|---|---|---|"]
    for goal in data["settings"]["goals"]:
        caps = [data["capacity"][name][str(goal)] for name in ("vllm", "kvstore")]
        cells = [("–" if c["rate_rps"] is None else f"{'≥ ' if c['lower_bound'] else ''}{c['rate_rps']:.2f} req/s")
                 for c in caps]
        key = f"capacity_kvstore_vs_vllm_at_{round(goal * 100)}"
        ratio = data["ratios"].get(key)
        mark = "≥ " if data["ratios"].get(f"{key}_lower_bound") else ""
        lines.append(f"| {goal:.0%} | " + " | ".join(cells) + f" | {mark}{_value('{:.2f}', ratio)} (`{key}`) |")
    return "\n".join(lines) + "\n"


def render_recorded(doc: str) -> str:
    """The recorded table less the rows whose figure a benchmark's JSON now holds (a JSON of
    some of a benchmark's rows, e.g. ``bench_vllm.py --only-new-rows``, leaves the others here)."""
    m = RECORDED.search(doc)
    if not m:
        return doc

    def measured(line: str) -> bool:
        row = ROW.match(line.strip())
        data = load(row.group(1)) if row else None
        return row is not None and data is not None and lookup(data, row.group(2)) is not None
    kept = [line for line in m.group(1).splitlines() if not measured(line)]
    return doc[:m.start(1)] + "\n".join(kept) + "\n" + doc[m.end(1):]


def fill(text: str, name: str, body: str) -> str:
    start, end = f"<!-- report:{name} -->\n", f"<!-- /report:{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"markers {start.strip()} … {end} are missing")
    head, rest = text.split(start, 1)
    return head + start + body + end + rest.split(end, 1)[1]


def generate() -> dict[Path, str]:
    doc, readme = DOC.read_text(), README.read_text()
    rec = recorded(doc)
    new_doc = render_recorded(doc)
    for table in TABLES:
        new_doc = fill(new_doc, table.name, render_table(table, rec))
    new_doc = fill(new_doc, "capacity", render_capacity())
    readme = fill(readme, "headline", render_headline(rec))
    return {DOC: new_doc, README: fill(readme, "demo", render_demo())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated table is stale")
    args = p.parse_args(argv)
    stale = []
    for path, text in generate().items():
        if path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: run python benchmarks/report.py", file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale and not args.check else "tables up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
