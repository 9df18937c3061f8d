"""Capacity at the SLOs: how much load kvstore serves against vLLM alone with the same share of
requests within both SLOs. This is goodput as DistServe (Zhong et al., OSDI'24) defines it — the
highest request rate at which an SLO-attainment goal holds — where the demo's
``goodput_kvstore_vs_vllm`` (benchmarks/vllm_serving.py) counts the requests that met both SLOs
at one load.

The demo's comparison (``kvstore up --replay`` over vLLM: the same trace requests through the same
front door, two instances of the bench checkpoint, one per core, each with a KV cache of 10,240
tokens; TTFT ≤ 2 s, mean ITL ≤ 0.2 s) replayed at a sweep of speeds, vLLM alone and kvstore at
each (``--setups vllm,kvstore``). A speed's request rate is the requests over the trace span they
arrive in, times the speed. Per set-up and rate: the SLO attainment (requests that met both SLOs
over requests sent; a rejected or failed request misses), pooled over ``--repeats`` replays of
each rate (a few requests decide an attainment near the goal). A set-up's capacity at a goal: the
highest rate before its attainment first falls below the goal, interpolated linearly between the
last swept rate that holds it and the next; a set-up that holds it at every swept rate has at
least the highest one (``lower_bound``), one that holds it at none has no figure.

Keys: ``sweep`` (per speed, per set-up: ``attainment``, ``met_slo``, ``requests``, ``rejected``,
``ttft_missed``, ``itl_missed``, ``not_completed`` over the repeats pooled; ``ttft_p50_s``,
``ttft_p99_s``, ``itl_p99_s``, ``goodput_rps`` their means over the repeats; ``attainments``,
each repeat's), ``capacity.<set-up>.<goal>``
(``rate_rps``, ``lower_bound``), ``ratios.capacity_kvstore_vs_vllm_at_<goal %>`` (kvstore's
capacity ÷ vLLM alone's; ``ratios.…_lower_bound`` true where it is one). No target: the issue's
goodput target is the demo's figure. About 20 minutes per repeat with the default speeds.

    python benchmarks/bench_capacity.py [--speeds 1,2,3,4,6] [--goals 0.5,0.6,0.7,0.8,0.9] [--requests 100]
                                        [--repeats 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
RESULTS = ROOT / "benchmarks" / "results" / "capacity.json"
SETUPS = ("vllm", "kvstore")
WINDOW_S = 180.0    # kvstore up --replay's default --window-s: the demo's requests


def trace_span_s(requests: int) -> float:
    """Seconds of trace time the replayed requests arrive over (at speed 1)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from scheduler.trace import load_trace, select_window
    chosen = select_window(load_trace(TRACE), 0, requests, WINDOW_S)
    stamps = [r.timestamp_ms for r in chosen]
    return (max(stamps) - min(stamps)) / 1000.0


def replay(speed: float, requests: int, timeout_s: float) -> dict[str, Any]:
    """``kvstore up --replay`` of vLLM alone and kvstore at ``speed``: its JSON report."""
    from benchmarks.vllm_serving import up_replay
    report = up_replay(["--requests", str(requests), "--window-s", str(WINDOW_S), "--speed", str(speed),
                        "--setups", ",".join(SETUPS)], timeout_s)
    if "error" in report:
        raise RuntimeError(f"speed {speed}: {report['error']}")
    return report


def point(setup: dict[str, Any]) -> dict[str, Any]:
    """One set-up's figures at one rate, from its part of the replay report: with why the
    requests that did not meet both SLOs missed (``ttft_missed``: completed over the TTFT SLO;
    ``itl_missed``: completed within it but over the ITL SLO; ``not_completed``)."""
    report = setup["report"]
    sent = report["requests_sent"]
    ok = [r for r in setup["requests"] if r["status"] == "ok"]
    ttft_missed = sum(r["ttft_s"] is None or r["ttft_s"] > report["ttft_slo_s"] for r in ok)
    return {"attainment": report["met_slo"] / sent if sent else 0.0, "met_slo": report["met_slo"],
            "requests": sent, "rejected": report["rejected"], "ttft_missed": ttft_missed,
            "itl_missed": len(ok) - report["met_slo"] - ttft_missed, "not_completed": sent - len(ok),
            "ttft_p50_s": report["ttft_p50_s"], "ttft_p99_s": report["ttft_p99_s"],
            "itl_p99_s": report["tbt_p99_s"], "goodput_rps": report["goodput_rps"]}


POOLED = ("met_slo", "requests", "rejected", "ttft_missed", "itl_missed", "not_completed")
AVERAGED = ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps")


def pooled(points: list[dict[str, Any]]) -> dict[str, Any]:
    """One set-up's figures at one rate over its repeats (:func:`point` each): the counts
    summed, the attainment of the sum, the latencies and goodput averaged, each repeat's
    attainment kept."""
    out: dict[str, Any] = {k: sum(p[k] for p in points) for k in POOLED}
    out["attainment"] = out["met_slo"] / out["requests"] if out["requests"] else 0.0
    for k in AVERAGED:
        values = [p[k] for p in points if p[k] is not None]
        out[k] = sum(values) / len(values) if values else None
    out["attainments"] = [p["attainment"] for p in points]
    return out


def capacity(rates: list[float], attainment: list[float], goal: float) -> dict[str, Any]:
    """The highest rate before ``attainment`` first falls below ``goal`` (rates ascending),
    interpolated to the first rate that misses it; None when the lowest rate misses it."""
    for i, (rate, share) in enumerate(zip(rates, attainment)):
        if share >= goal:
            continue
        if i == 0:
            return {"rate_rps": None, "lower_bound": False}
        r0, a0 = rates[i - 1], attainment[i - 1]
        return {"rate_rps": r0 + (a0 - goal) / (a0 - share) * (rate - r0), "lower_bound": False}
    return {"rate_rps": rates[-1], "lower_bound": True}


def ratios(caps: dict[str, dict[str, dict[str, Any]]], goals: list[float]) -> dict[str, Any]:
    """kvstore's capacity ÷ vLLM alone's at each goal (None where vLLM alone's is a lower bound
    or either has none; flagged a lower bound where kvstore's is one)."""
    out: dict[str, Any] = {}
    for goal in goals:
        key = f"capacity_kvstore_vs_vllm_at_{round(goal * 100)}"
        k, v = caps["kvstore"][str(goal)], caps["vllm"][str(goal)]
        ok = k["rate_rps"] is not None and v["rate_rps"] and not v["lower_bound"]
        out[key] = k["rate_rps"] / v["rate_rps"] if ok else None
        out[f"{key}_lower_bound"] = bool(ok and k["lower_bound"])
    return out


def run(speeds: list[float], goals: list[float], requests: int, timeout_s: float,
        repeats: int = 1) -> dict[str, Any]:
    span = trace_span_s(requests)
    sweep = []
    t0 = time.monotonic()
    for n, speed in enumerate(sorted(speeds)):
        rate = requests / (span / speed)
        points: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
        for k in range(repeats):
            print(f"== speed {speed:g} ({rate:.2f} req/s), {n + 1} of {len(speeds)}, replay {k + 1} of {repeats}; "
                  f"{time.monotonic() - t0:.0f} s so far", flush=True)
            report = replay(speed, requests, timeout_s)
            for name in SETUPS:
                points[name].append(point(report["setups"][name]))
            print("   " + "; ".join(f"{name}: {p[-1]['met_slo']} of {p[-1]['requests']} met both SLOs, TTFT p50 "
                                    f"{p[-1]['ttft_p50_s'] or 0:.2f} s" for name, p in points.items()), flush=True)
        sweep.append({"speed": speed, "rate_rps": rate, "setups": {name: pooled(points[name]) for name in SETUPS}})
    rates = [row["rate_rps"] for row in sweep]
    caps = {name: {str(g): capacity(rates, [row["setups"][name]["attainment"] for row in sweep], g) for g in goals}
            for name in SETUPS}
    settings = {"requests": requests, "repeats": repeats, "window_s": WINDOW_S, "trace_span_s": span,
                "speeds": sorted(speeds),
                "goals": goals, "setups": list(SETUPS), "wall_s": time.monotonic() - t0,
                "slos": "TTFT <= 2 s, mean ITL of a request <= 0.2 s (kvstore up's defaults)",
                "replay": "kvstore up --replay over vLLM at its defaults (make demo's set-up), --setups vllm,kvstore"}
    return {"settings": settings, "sweep": sweep, "capacity": caps, "ratios": ratios(caps, goals)}


def _numbers(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not comma-separated numbers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers > 0")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--speeds", type=_numbers, default=[1.0, 2.0, 3.0, 4.0, 6.0],
                   help="replay speeds to sweep, comma-separated")
    p.add_argument("--goals", type=_numbers, default=[0.5, 0.6, 0.7, 0.8, 0.9],
                   help="SLO-attainment goals (fractions of the requests) to give each set-up's capacity at")
    p.add_argument("--requests", type=int, default=100, help="trace requests per replay (the demo's)")
    p.add_argument("--repeats", type=int, default=2, help="replays of each speed, pooled")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="limit on one replay of both set-ups")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats: at least 1")
    if any(g > 1 for g in args.goals):
        p.error("--goals: fractions of the requests, at most 1")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.run_info import write_results
    try:
        result = run(args.speeds, args.goals, args.requests, args.timeout_s, args.repeats)
    except RuntimeError as exc:
        print(f"bench_capacity: {exc}", file=sys.stderr)
        return 1
    write_results(RESULTS, result)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    for name in SETUPS:
        print(f"  {name}: " + ", ".join(f"at {float(g):.0%}: " + ("none (missed at the lowest rate)"
                                                                 if c["rate_rps"] is None else
                                                                 f"{c['rate_rps']:.2f} req/s"
                                                                 f"{' or more' if c['lower_bound'] else ''}")
                                        for g, c in result["capacity"][name].items()))
    for key, value in result["ratios"].items():
        if not key.endswith("_lower_bound"):
            print(f"  {key}: {'-' if value is None else f'{value:.2f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
