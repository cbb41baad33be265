"""nanoparallel.cuda.diagnose without a GPU: its plan, its arithmetic, and a dry run that writes JSON.

The measurements themselves need two GPUs (nanoparallel/cuda/gpu_run.sh runs them); what can go
wrong before that is here: a section or size missing from the plan, bandwidth or ratios computed
from the wrong row, a report that the site cannot read.
"""

from __future__ import annotations

import json

from nanoparallel.cuda import ALGORITHMS
from nanoparallel.cuda.diagnose import COLUMNS, SIZES, finish, main, plan, program_counts


def test_plan_covers_every_cause_at_every_size():
    cases = plan(2, 132)
    have = {(c["section"], c["variant"], c["bytes"]) for c in cases}
    for nbytes in SIZES:
        for variant in (
            "nccl_sendrecv",
            "triton_read",
            "triton_write",
            "copy_engine_read",
            "copy_engine_write",
        ):
            assert ("nvlink", variant, nbytes) in have, (variant, nbytes)
        for variant in ("nccl", *ALGORITHMS["all_to_all"]):
            assert ("all_to_all", variant, nbytes) in have, (variant, nbytes)
        for variant in ("nccl", "one_shot", "one_shot_push", "one_shot_pipelined"):
            assert ("all_reduce", variant, nbytes) in have, (variant, nbytes)
    grids = {c["programs"] for c in cases if c["variant"] == "triton_read"}
    assert grids == set(program_counts(132)) and max(grids) == 264
    host = {c["variant"] for c in cases if c["section"] == "host"}
    assert {"all_to_all_uncached", "all_to_all_cached", "all_reduce_one_shot"} <= host
    assert all(c["programs"] is None or c["programs"] <= 264 for c in cases)


def test_finish_computes_bandwidth_and_ratios_per_section_and_size():
    rows = [
        dict(section="all_to_all", variant="nccl", bytes=1 << 30, time_us=1000.0),
        dict(section="all_to_all", variant="push", bytes=1 << 30, time_us=2000.0),
        dict(section="all_reduce", variant="nccl", bytes=1 << 30, time_us=4000.0),
        dict(section="all_reduce", variant="one_shot", bytes=1 << 30, time_us=3000.0),
        dict(section="nvlink", variant="triton_read", bytes=1 << 20, time_us=10.0),
        dict(section="host_parts", variant="cache_lookup", bytes=32, host_us=0.3),
    ]
    finish(rows, world=2)
    assert rows[0]["GBps"] == round((1 << 30) / 1e-3 / 1e9, 2)
    assert rows[0]["busbw_GBps"] == round(rows[0]["GBps"] / 2, 2)  # all-to-all: (n-1)/n
    assert rows[1]["vs_nccl"] == 0.5
    assert rows[2]["busbw_GBps"] == rows[2]["GBps"]  # all-reduce: 2(n-1)/n = 1 at n = 2
    assert rows[3]["vs_nccl"] == round(4 / 3, 3)
    assert rows[4]["busbw_GBps"] == rows[4]["GBps"] and "vs_nccl" not in rows[4]  # no send/recv row
    assert "GBps" not in rows[5]


def test_dry_run_writes_a_report(tmp_path, capsys):
    main(["--world-size", "3", "--dry-run", "--sm-count", "16", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-cuda-x3-diagnose-dry-run.json")
    doc = json.loads(path.read_text())
    assert doc["package"] == "nanoparallel" and doc["columns"] == COLUMNS
    assert len(doc["rows"]) == len(plan(3, 16)) and "DRY RUN" in doc["notes"]
    assert "| nvlink | triton_write |" in capsys.readouterr().out


def test_every_plot_selects_a_line_of_several_points():
    """A plot whose filter matches no rows (a wrong column value, a grid that is not the plan's)
    draws an empty figure on the site; each must find at least one series with two x values."""
    from nanoparallel.cuda.diagnose import plots

    sm = 132
    rows = plan(2, sm)
    for p in plots(2 * sm):
        chosen = [
            r for r in rows if all(r.get(k) == v for k, v in p["where"].items()) and r[p["x"]] is not None
        ]
        xs_per_series = {}
        for r in chosen:
            xs_per_series.setdefault((r.get(p.get("facet")), r[p["series"]]), set()).add(r[p["x"]])
        assert max((len(xs) for xs in xs_per_series.values()), default=0) >= 2, p["title"]
