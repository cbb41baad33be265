"""The benchmark's correctness gates and sizes, on the CPU configuration (the GPU run uses the same code)."""

from __future__ import annotations

import pytest

from paperclub.bench import Report
from repro.pipelinerl.bench import COLUMNS, engine_rows, settings, train_rows
from repro.pipelinerl.model import Policy, flat_weights
from repro.pipelinerl.pipeline import Config


@pytest.mark.parametrize("task", ["sort", "sort-long"])
@pytest.mark.parametrize("cuda", [False, True])
def test_settings_make_valid_configs(cuda, task):
    s = settings(cuda, quick=False, task_name=task)
    for mode in ("pipeline", "async", "conventional"):
        Config(
            mode=mode, max_lag=s["max_lag"], batch_size=s["batch_size"], attempts=s["attempts"], slots=s["slots"],
            task=s["task"], model=s["model"],
        ).validate()  # fmt: skip


def test_bench_checks_pass_before_timing():
    s = settings(False, quick=True)
    weights = flat_weights(Policy(s["model"]))
    report = Report(package="pipelinerl", title="t", columns=COLUMNS, measure_ceilings=False)
    engine_rows(report, s, weights, rounds=1)
    train_rows(report, s, weights, rounds=1)
    assert [r["check"] for r in report.rows] == ["ok", "ok"]
    assert all(r["ms"] > 0 for r in report.rows)


def test_bench_refuses_a_negative_max_lag():
    from repro.pipelinerl.bench import main

    with pytest.raises(SystemExit, match="--max-lag must be >= 0 samples, got -1"):
        main(["--max-lag", "-1"])
