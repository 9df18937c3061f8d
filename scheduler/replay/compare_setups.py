"""kvstore against vLLM as it is: the same trace requests replayed through the same front door on
the same vLLM instances' configuration under several set-ups (``kvstore up``'s report over vLLM;
launcher/vllm_setups.py runs them), side by side.

A set-up's figures are the client's (:class:`scheduler.replay.report.Report`: TTFT, ITL, goodput,
completed / rejected, prompt and cached tokens from ``usage``) and its instances' own
Prometheus counters, read before and after the replay (:func:`cache_hits`): vLLM's
``vllm:prefix_cache_hits`` (prompt tokens found in an instance's own prefix cache) and
``vllm:external_prefix_cache_hits`` (prompt tokens its KV connector loaded — from kvstore's
pool), so the hit ratio splits into instance-local and pool. Ratios divide kvstore's figure by
the other set-up's (below 1 is better for TTFT and tokens computed, above 1 for goodput)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tabulate import tabulate

from scheduler.replay.report import Report, RequestOutcome, token_rows_note

# vLLM's counters of prompt tokens served from a cache (vllm/v1/metrics/loggers.py, 0.32)
LOCAL_HITS = "vllm:prefix_cache_hits"
POOL_HITS = "vllm:external_prefix_cache_hits"
PROMPT_TOKENS = "vllm:prompt_tokens"


def cache_hits(metrics_texts: Sequence[str]) -> dict[str, float]:
    """``{"local": ..., "pool": ..., "prompt": ...}``: prompt tokens served from the instances'
    own prefix caches, loaded through their KV connectors, and prompt tokens in all, summed
    over the instances' ``/metrics`` texts (Prometheus format; prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {"local": 0.0, "pool": 0.0, "prompt": 0.0}
    names = {LOCAL_HITS: "local", POOL_HITS: "pool", PROMPT_TOKENS: "prompt"}
    for text in metrics_texts:
        for family in text_string_to_metric_families(text):
            key = names.get(family.name)
            if key is None:
                continue
            out[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


@dataclass(frozen=True)
class SetupRun:
    """One set-up's replay: ``name`` (``vllm``, ``kvstore``, ``recompute``), ``label`` (for
    people), ``what`` (one line: what it runs), ``report`` (the client's view), ``hits``
    (prompt tokens by source during the replay, :func:`cache_hits` after less before),
    ``memory`` (bytes of KV memory it uses, by kind), ``startup_s`` (its services' start).
    Its dict carries each request's outcome in arrival order (``requests``)."""

    name: str
    label: str
    what: str
    report: Report
    hits: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    startup_s: float = 0.0

    def hit_ratio(self, source: str) -> float | None:
        """Prompt tokens served from ``source`` ("local" or "pool") / prompt tokens the
        instances received (None when they received none)."""
        prompt = self.hits.get("prompt") or 0.0
        return self.hits.get(source, 0.0) / prompt if prompt else None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "what": self.what, "report": self.report.to_dict(),
                "hit_tokens": self.hits, "hit_ratio_local": self.hit_ratio("local"),
                "hit_ratio_pool": self.hit_ratio("pool"), "memory_bytes": self.memory,
                "memory_bytes_total": sum(self.memory.values()), "startup_s": self.startup_s,
                "requests": [{"status": o.status, "code": o.code, "ttft_s": o.ttft_s, "prompt_tokens": o.prompt_tokens,
                              "cached_tokens": o.cached_tokens} for o in self.report.outcomes]}


def _report_from_dict(d: dict[str, Any], requests: list[dict[str, Any]]) -> Report:
    """A :class:`Report` back from :meth:`SetupRun.to_dict`'s ``report`` and ``requests``
    (outcomes with their TTFT, prompt and cached tokens: enough to plot, not every gap)."""
    fields = {k: v for k, v in d.items() if k in Report.__dataclass_fields__}
    outcomes = tuple(RequestOutcome(r["status"], r.get("code", ""), r.get("ttft_s"),
                                    prompt_tokens=r.get("prompt_tokens", 0), cached_tokens=r.get("cached_tokens", 0))
                     for r in requests)
    return Report(**fields, outcomes=outcomes)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def outputs_equal(a: Report, b: Report) -> float | None:
    """The fraction of requests completed in both replays whose generated tokens are equal
    (outcomes are in arrival order in both; None when none completed in both)."""
    pairs = [(x.token_ids, y.token_ids) for x, y in zip(a.outcomes, b.outcomes)
             if x.status == "ok" and y.status == "ok"]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None


@dataclass(frozen=True)
class SetupComparison:
    """Set-ups replayed on the same requests (``runs``, in the order they ran) and what was
    replayed (``settings``)."""

    runs: tuple[SetupRun, ...]
    settings: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> SetupRun | None:
        return next((r for r in self.runs if r.name == name), None)

    def ratios(self) -> dict[str, float | None]:
        """kvstore / vLLM alone and kvstore / recompute of the headline figures (None where a
        set-up did not run or a figure is missing)."""
        kvstore = self.get("kvstore")
        out: dict[str, float | None] = {}
        for tag in ("vllm", "recompute"):
            other = self.get(tag)
            for key, attr in (("ttft_p50", "ttft_p50_s"), ("ttft_p99", "ttft_p99_s"), ("itl_p99", "tbt_p99_s"),
                              ("goodput", "goodput_rps"), ("prefill_tokens", "prefill_tokens")):
                out[f"{key}_kvstore_vs_{tag}"] = (None if kvstore is None or other is None else
                                                  _ratio(getattr(kvstore.report, attr), getattr(other.report, attr)))
        return out

    def output_match(self) -> dict[str, float | None]:
        """Per set-up, the fraction of requests whose greedy output equals recompute's."""
        base = self.get("recompute")
        return {r.name: outputs_equal(r.report, base.report) if base else None for r in self.runs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SetupComparison:
        """Back from :meth:`to_dict` (a report's JSON), for plotting it again."""
        runs = tuple(SetupRun(name, r["label"], r["what"], _report_from_dict(r["report"], r.get("requests", [])),
                              r.get("hit_tokens", {}), r.get("memory_bytes", {}), r.get("startup_s", 0.0))
                     for name, r in d["setups"].items())
        return cls(runs, d.get("settings", {}))

    def to_dict(self) -> dict[str, Any]:
        return {"setups": {r.name: r.to_dict() for r in self.runs}, "ratios": self.ratios(),
                "output_match_vs_recompute": self.output_match(), "settings": self.settings}


def _sec(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def format_setups(c: SetupComparison) -> str:
    """The set-ups side by side (a plain-text table, tabulate), kvstore's ratios last."""
    runs = c.runs
    ratios = c.ratios()
    rows: list[list[str]] = []

    def row(name: str, cell, ratio_key: str | None = None, recompute_key: str | None = None) -> None:
        vs = [_share(ratios.get(k)) if k else "" for k in (ratio_key, recompute_key)]
        rows.append([name, *(cell(r) for r in runs), *vs])
    row("completed / sent", lambda r: f"{r.report.completed} / {r.report.requests_sent}")
    row("rejected / failed / skipped", lambda r: f"{r.report.rejected} / {r.report.failed} / {r.report.skipped}")
    row("hit ratio, instance-local (tokens)", lambda r: _share(r.hit_ratio("local")))
    row("hit ratio, pool (tokens)", lambda r: _share(r.hit_ratio("pool")))
    row("prefill tokens computed", lambda r: f"{r.report.prefill_tokens:,}",
        "prefill_tokens_kvstore_vs_vllm", "prefill_tokens_kvstore_vs_recompute")
    row("TTFT p50", lambda r: _sec(r.report.ttft_p50_s), "ttft_p50_kvstore_vs_vllm", "ttft_p50_kvstore_vs_recompute")
    row("TTFT p99", lambda r: _sec(r.report.ttft_p99_s), "ttft_p99_kvstore_vs_vllm", "ttft_p99_kvstore_vs_recompute")
    row("ITL p99", lambda r: _sec(r.report.tbt_p99_s), "itl_p99_kvstore_vs_vllm", "itl_p99_kvstore_vs_recompute")
    row("met both SLOs", lambda r: f"{r.report.met_slo} of {r.report.requests_sent}")
    row("goodput (req/s)", lambda r: f"{r.report.goodput_rps:.3f}", "goodput_kvstore_vs_vllm",
        "goodput_kvstore_vs_recompute")
    row("KV memory", lambda r: _mib(sum(r.memory.values())))
    heads = ["", *(r.label for r in runs), "kvstore / vLLM", "kvstore / recompute"]
    table = tabulate(rows, headers=heads, disable_numparse=True)
    first = runs[0].report
    lines = [table, f"SLOs: TTFT <= {first.ttft_slo_s:g} s, mean ITL of a request <= {first.tbt_slo_s:g} s"]
    lines += [f"{r.label}: {r.what}" for r in runs]
    note = token_rows_note(*(r.report for r in runs))
    match = {k: v for k, v in c.output_match().items() if v is not None and k != "recompute"}
    if match:
        lines.append("greedy output equal to recompute's: " + ", ".join(f"{k} {v:.0%}" for k, v in match.items()))
    return "\n".join(lines + ([note] if note else []))
