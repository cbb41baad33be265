"""nanoparallel.cuda.lab.tuning: the script that turns a GPU run's result files into auto's tables.

Synthetic sweep and diagnose rows stand in for a run, so each rule can be seen to hold: the
fastest checked algorithm wins a size, a choice within the margin is kept (noise does not flip the
table), bounds are measured sizes, an unchecked or failed row never wins, steps and programs come
from the diagnose grid (one value for the all-to-all), the generated module reads back as the
same tables, and the summary report pairs each size's auto row with NCCL's.
"""

from __future__ import annotations

import json

import pytest

from nanoparallel.cost_model import bus_factor
from nanoparallel.cuda.lab.tuning import (
    Policy,
    algorithm_tables,
    build,
    knob_tables,
    main,
    module_text,
    pins,
    policies,
    policy_for,
    summary_report,
)

M = 1 << 20


def sweep_rows(times: dict, coll: str = "all_gather") -> list[dict]:
    """Rows like nanoparallel.cuda.sweep's: times[bytes][algorithm] = us (None: check failed)."""
    rows = []
    for nbytes, at in times.items():
        for algo, us in at.items():
            impl = "nccl" if algo == "nccl" else "nanoparallel"
            row = dict(collective=coll, impl=impl, algorithm=algo, bytes=nbytes, checked=us is not None)
            if us is not None:
                bw = nbytes / us / 1e3
                row.update(time_us=us, busbw_GBps=round(bw * bus_factor(coll, 4), 2))
            rows.append(row)
    return rows


def test_the_fastest_checked_algorithm_wins_from_the_size_where_it_won():
    times = {
        16: {"nccl": 40.0, "direct": 30.0, "push_pipelined": 45.0, "auto": 29.0},
        64 << 10: {"nccl": 40.0, "direct": 30.5, "push_pipelined": 30.0},  # within the margin: keep direct
        16 * M: {"nccl": 70.0, "direct": 84.0, "push_pipelined": 60.0},
        64 * M: {"nccl": 200.0, "direct": 320.0, "push_pipelined": 190.0, "pairwise": None},  # failed check
        256 * M: {"nccl": 680.0, "direct": 1260.0, "push_pipelined": 700.0, "pairwise": 650.0},
    }
    table = algorithm_tables(sweep_rows(times))["all_gather"]
    assert table == ((0, "direct"), (16 * M, "push_pipelined"), (256 * M, "pairwise"))


def test_a_failed_or_untimed_row_never_wins_and_auto_is_not_a_candidate():
    times = {1024: {"direct": 50.0, "pairwise": None, "auto": 1.0}}
    assert algorithm_tables(sweep_rows(times))["all_gather"] == ((0, "direct"),)


def test_steps_and_programs_come_from_the_diagnose_grid():
    rows = []
    for nbytes, best in ((64 * M, (8, 264)), (256 * M, (16, 264)), (1 << 30, (16, 132))):
        for steps in (4, 8, 16):
            for programs in (132, 264):
                t = 100.0 if (steps, programs) == best else 120.0
                rows.append(dict(section="broadcast", variant="ring", bytes=nbytes, steps=steps, programs=programs,
                                 tunable=True, time_us=t))  # fmt: skip
                rows.append(dict(section="all_to_all", variant="pairwise", bytes=nbytes, steps=steps,
                                 programs=programs, tunable=True, time_us=100.0 if steps == 8 else 130.0))  # fmt: skip
    rows.append(dict(section="broadcast", variant="nccl", bytes=64 * M, time_us=90.0))
    base = Policy(algorithms={}, steps={"broadcast/ring": ((0, 16),)})
    steps, programs = knob_tables(rows, sm_count=132, base=base)
    assert steps["broadcast/ring"] == ((0, 16), (64 * M, 8), (256 * M, 16))
    assert programs["broadcast/ring"] == ((0, 2.0), (1 << 30, 1.0))
    # the all-to-all: one value for every size (ranks of an uneven call hold different sizes)
    assert steps["all_to_all/pairwise"] == ((0, 8),)


def test_generated_module_reads_back_as_the_same_tables(tmp_path):
    table = policies()
    text = module_text(table, "python -m nanoparallel.cuda.lab.tuning (test)")
    space: dict = {}
    exec(compile(text, "auto_tables.py", "exec"), space)
    again = {w: Policy(**p) for w, p in space["POLICIES"].items()}
    assert again == table
    assert "<< 20" in text and '"source"' in text


def test_build_replaces_only_what_was_measured():
    base = policies()
    times = {
        16: {"nccl": 40.0, "direct": 30.0},
        64 * M: {"nccl": 200.0, "direct": 320.0, "push_pipelined": 190.0},
    }
    doc = dict(title="GPU collectives on 4 GPUs: ...", device="NVIDIA H100", date="2026-11-28T00:00:00",
               rows=sweep_rows(times))  # fmt: skip
    new = build([doc], [], base)
    assert new[4].algorithms["all_gather"] == ((0, "direct"), (64 * M, "push_pipelined"))
    assert new[4].algorithms["all_reduce"] == base[4].algorithms["all_reduce"]  # not in this sweep
    assert new[2] == base[2] and "NVIDIA H100 x4 sweep 2026-11-28" in new[4].source
    with pytest.raises(ValueError, match="cannot tell the world size"):
        build([dict(doc, title="something else")], [], base)


def test_pins_and_summary(tmp_path):
    table = policies()
    algos, steps = pins(table)
    assert algos[(4, "all_reduce", 1 << 30)] == policy_for(4).algorithm("all_reduce", 1 << 30)
    assert steps[(2, "all_reduce/one_shot_pipelined", 1 << 30)] == 16
    times = {
        1024: {"nccl": 40.0, "direct": 30.0},
        64 * M: {"nccl": 200.0, "direct": 320.0, "copy_engine": 300.0},
    }
    docs = [
        dict(title=f"GPU collectives on {w} GPUs", device="NVIDIA H100", date="2026-11-28T00:00:00",
             peer="NCCL", environment={"device": "NVIDIA H100", "device_count": 4}, rows=sweep_rows(times))
        for w in (2, 4)
    ]  # fmt: skip
    # a fixed policy, not the committed tables (those change with every GPU run): direct everywhere
    fixed = {w: Policy(algorithms={"all_gather": ((0, "direct"),)}) for w in (2, 4)}
    rep = summary_report(docs, fixed)
    got = {(r["gpus"], r["bytes"]): r for r in rep.rows}
    assert set(got) == {(2, 1024), (4, 1024), (2, 64 * M), (4, 64 * M)}
    assert got[(4, 1024)]["auto"] == "direct" and got[(4, 1024)]["speedup_vs_nccl"] == round(40 / 30, 3)
    assert got[(4, 64 * M)]["busbw_vs_nccl"] == pytest.approx(200 / 320, abs=2e-3)
    # the command line: tables, pins and summary from files
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"x{i}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "auto_tables.py"
    main(["--sweep", *map(str, paths), "--write", str(out), "--summary", str(tmp_path), "--pins"])
    assert "POLICIES" in out.read_text() and list(tmp_path.glob("*-cuda-summary.json"))
