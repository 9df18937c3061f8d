"""3 cycles of benchmarks/bench_kill9.py: a store node process killed with SIGKILL under
puts and restarted on its data directory (``--ssd-fsync commit``): no wrong bytes, no
acknowledged SSD block lost, usage equal to what the LMDB file holds after each restart."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kill9_cycles_lose_nothing_committed(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_kill9", ROOT / "benchmarks" / "bench_kill9.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = bench.run_cycles(3, str(tmp_path / "data"), str(tmp_path / "node.log"), seed=1, put_s=(0.2, 0.4))
    assert out["acked_blocks"] > 0 and out["in_flight_at_kill"] >= 0
    assert out["wrong_bytes"] == 0 and out["lost_acked"] == 0 and out["usage_mismatches"] == 0, out
    assert all(c["ssd_blocks"] == c["disk_blocks"] for c in out["per_cycle"])
    assert out["per_cycle"][-1]["checked"] >= out["acked_blocks"]
