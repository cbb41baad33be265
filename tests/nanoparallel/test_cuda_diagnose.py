"""nanoparallel.cuda.lab.diagnose and nccl_info without a GPU: plans, arithmetic, dry runs, log parsing.

The measurements need GPUs (nanoparallel/cuda/gpu_plan.sh runs them); what can go wrong before
that is here: a cause or size missing from the plan, bandwidth or ratios computed from the wrong
row, a report the site cannot read, NCCL's log attributed to the wrong variant. The raw-copy probe
itself runs under the interpreter in test_cuda_bandwidth_kernels_interpret.py.
"""

from __future__ import annotations

import json

import pytest

from nanoparallel.cost_model import bus_factor
from nanoparallel.cuda import ALGORITHMS
from nanoparallel.cuda.lab.diagnose import (
    COLUMNS,
    GRIDS,
    PATTERNS,
    SIZES,
    finish,
    main,
    peers_of,
    plan,
    plots,
)
from nanoparallel.cuda.lab.nccl_info import marker_elements, parse_log


def test_plan_covers_every_cause_at_every_size():
    cases = plan(4, 132)
    have = {(c["section"], c["variant"], c["bytes"]) for c in cases}
    for pattern in PATTERNS:
        for way in ("read", "write"):
            assert any(c["variant"] == f"{pattern}_{way}" for c in cases), (pattern, way)
    for nbytes in SIZES:
        for coll, algos in ALGORITHMS.items():
            assert (coll, "nccl", nbytes) in have, (coll, nbytes)
            for algo in algos:
                if (coll, algo) in (("all_reduce", "one_shot"), ("all_reduce", "one_shot_push")):
                    continue  # (W-1) n bytes per rank: 3x the ring's at 4 GPUs, measured before (cuda-x4)
                if (coll, algo) == ("reduce_scatter", "ring"):
                    continue
                assert (coll, algo, nbytes) in have, (coll, algo, nbytes)
    for (coll, algo), (steps, per_sm) in GRIDS.items():
        grid = {
            (c["steps"], c["programs"])
            for c in cases
            if (c["section"], c["variant"]) == (coll, algo) and c["tunable"]
        }
        assert len(grid) == len(steps) * len(per_sm), (coll, algo, grid)
    assert all(c["programs"] is None or 1 <= c["programs"] <= 264 for c in cases)


def test_patterns_name_the_right_peers():
    assert [peers_of("pair", r, 4) for r in range(4)] == [[1], [0], [], []]
    assert [peers_of("ring", r, 4) for r in range(4)] == [[1], [2], [3], [0]]
    assert peers_of("all_peers", 2, 4) == [0, 1, 3]
    assert [peers_of("incast", r, 4) for r in range(4)] == [[], [0], [0], [0]]
    with pytest.raises(ValueError, match="pattern must be one of"):
        peers_of("star", 0, 4)


def test_finish_computes_bandwidth_and_ratios_per_section_and_size():
    rows = [
        dict(section="all_to_all", variant="nccl", bytes=1 << 30, time_us=1000.0),
        dict(section="all_to_all", variant="pairwise", bytes=1 << 30, time_us=2000.0),
        dict(section="all_reduce", variant="nccl", bytes=1 << 30, time_us=4000.0),
        dict(section="all_reduce", variant="ring", bytes=1 << 30, time_us=3000.0),
        dict(section="nvlink", variant="ring_read", bytes=1 << 20, time_us=10.0),
        dict(section="broadcast", variant="ring", bytes=1 << 20, checked=False),
    ]
    finish(rows, world=4)
    assert rows[0]["GBps"] == round((1 << 30) / 1e-3 / 1e9, 2)
    assert rows[0]["busbw_GBps"] == round(rows[0]["GBps"] * bus_factor("all_to_all", 4), 2)
    assert rows[1]["vs_nccl"] == 0.5
    assert rows[2]["busbw_GBps"] == round(rows[2]["GBps"] * 1.5, 2)  # all-reduce: 2(n-1)/n = 1.5 at n = 4
    assert rows[3]["vs_nccl"] == round(4 / 3, 3)
    assert rows[4]["busbw_GBps"] == rows[4]["GBps"] and "vs_nccl" not in rows[4]  # no send/recv row
    assert "GBps" not in rows[5]  # a row whose check failed has no time


def test_dry_run_writes_a_report(tmp_path, capsys):
    main(["--world-size", "3", "--dry-run", "--sm-count", "16", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-cuda-x3-diagnose-dry-run.json")
    doc = json.loads(path.read_text())
    assert doc["package"] == "nanoparallel" and doc["columns"] == COLUMNS
    assert len(doc["rows"]) == len(plan(3, 16)) and "DRY RUN" in doc["notes"]
    assert "| nvlink | all_peers_write |" in capsys.readouterr().out


def test_every_plot_selects_a_line_of_several_points():
    """A plot whose filter matches no rows (a wrong column value, a grid that is not the plan's)
    draws an empty figure on the site; each must find at least one series with two x values."""
    sm = 132
    rows = plan(4, sm)
    for p in plots(sm):
        chosen = [
            r for r in rows if all(r.get(k) == v for k, v in p["where"].items()) and r[p["x"]] is not None
        ]
        xs_per_series = {}
        for r in chosen:
            xs_per_series.setdefault((r.get(p.get("facet")), r[p["series"]]), set()).add(r[p["x"]])
        assert max((len(xs) for xs in xs_per_series.values()), default=0) >= 2, p["title"]


def test_nccl_log_is_attributed_to_the_variant_that_ran():
    lines = ["host:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0"]
    lines.append(
        "host:1:1 [0] NCCL INFO 24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels"
    )
    for i in range(2):
        if i:
            lines.append("host:1:1 [0] NCCL INFO NCCL_ALGO set by environment to Ring")
        lines.append(
            f"NCCL INFO AllReduce: {marker_elements(i) * 4} Bytes -> Algo RING proto LL channel{{Lo..Hi}}={{0..0}}"
        )
        proto = "SIMPLE" if i else "LL128"
        lines.append(
            f"NCCL INFO AllReduce: 67108864 Bytes -> Algo RING proto {proto} channel{{Lo..Hi}}={{0..23}}"
        )
        lines.append(
            "NCCL INFO AllGather: 67108864 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..15} comm 0x2"
        )
        lines.append("NCCL INFO Broadcast: 4 Bytes -> Algo RING proto LL")  # no channel range: still read
    choices, init = parse_log(lines)
    assert choices[("default", "all_reduce", 64 << 20)] == ("RING", "LL128", 24)
    assert choices[("ring/simple", "all_reduce", 64 << 20)] == ("RING", "SIMPLE", 24)
    assert choices[("default", "all_gather", 64 << 20)] == ("RING", "SIMPLE", 16)
    assert choices[("default", "broadcast", 4)] == ("RING", "LL", None)
    assert len(init["default"]) == 2 and "set by environment" in init["ring/simple"][0]
