"""The benchmark's code paths on CPU (tiny shapes): every candidate passes its correctness check."""

from __future__ import annotations

import json


def test_bench_cpu_smoke(tmp_path):
    from repro.usp import bench

    bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--budget-s", "60"])
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    impls = {r["impl"] for r in rows}
    assert {
        "full sdpa",
        "usp n=1 (auto)",
        "usp n=1 (sdpa)",
        "ring n=2 zigzag (auto)",
        "ring n=4 contiguous (auto)",
    } <= impls
    assert all(r["check"] == "ok" for r in rows), [r for r in rows if r["check"] != "ok"]
    assert all(r["ms"] and r["ms"] > 0 for r in rows)
    # the emulated ring's per-rank time is its total over the N ranks
    for r in rows:
        assert abs(r["ms_per_rank"] * r["ring"] - r["ms"]) < 1e-9 * r["ms"] + 1e-12
