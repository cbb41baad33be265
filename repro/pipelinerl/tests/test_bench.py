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


def test_mode_order_rotates_per_seed():
    from repro.pipelinerl.bench import MODES, mode_order

    assert mode_order(0) == list(MODES)  # one seed: the order the bench always had
    orders = [mode_order(k) for k in range(len(MODES))]
    assert all(sorted(o) == sorted(MODES) for o in orders)
    assert {o[0] for o in orders} == set(MODES)  # each mode runs first once in three seeds
    assert mode_order(len(MODES)) == mode_order(0)


def test_bench_real_runs_per_seed(pretrained):
    """Two seeds of the three real runs on the tiny test config (3 steps each): run rows per seed
    in the rotated order, the trainer's time shares filled in, and the per-seed ratio notes."""
    from repro.pipelinerl.bench import mode_order, ratio_notes, real_runs
    from repro.pipelinerl.tests.conftest import MODEL, TASK

    s = dict(
        task=TASK, model=MODEL, slots=8, batch_size=4, attempts=2, max_lag=8, lr=1e-2, device="cpu",
    )  # fmt: skip
    report = Report(package="pipelinerl", title="t", columns=COLUMNS, measure_ceilings=False)
    results, _ = real_runs(report, s, pretrained, per_mode=60.0, seeds=2, steps=3)
    runs = [r for r in report.rows if r["kind"] == "run"]
    assert [(r["seed"], r["mode"]) for r in runs] == [(k, m) for k in (0, 1) for m in mode_order(k)]
    assert mode_order(1)[0] != mode_order(0)[0]
    for r in runs:
        assert r["check"] == "ok" and r["samples"] == 12 and r["reward_eq_samples"] is not None
        assert 0 <= r["aborted"] <= r["dropped"]
        assert r["ms_per_step"] > 0 and r["trainer_train_ms"] > 0 and r["swap_s"] >= 0
        shares = [r[f"trainer_{k}_share"] for k in ("wait", "train", "bcast")]
        assert all(0 <= x <= 1 for x in shares) and sum(shares) <= 1 + 1e-9
        assert r["trainer_train_ms"] == pytest.approx(r["trainer_train_share"] * r["ms_per_step"])
        res = results[r["seed"]][r["mode"]]
        assert r["trainer_wait_ms"] == pytest.approx(1e3 * sum(x["wait_s"] for x in res.steps) / 3)
    assert {r["seed"] for r in report.rows if r["kind"] == "curve"} == {0, 1}

    def ratio(k: int, mode: str) -> float:
        return results[k][mode].summary["samples_per_s"] / results[k]["conventional"].summary["samples_per_s"]

    notes = ratio_notes(results)
    assert len(notes) == 2
    for line, mode in zip(notes, ("pipeline", "async"), strict=True):
        r0, r1 = ratio(0, mode), ratio(1, mode)
        assert f"{mode} / conventional samples per second seed 0 {r0:.3f}, seed 1 {r1:.3f};" in line
        assert f"mean {(r0 + r1) / 2:.3f}, min {min(r0, r1):.3f}" in line
        assert "2 of 2 seeds" in line
    # one seed: the notes as the bench always wrote them
    assert ratio_notes({0: results[0]}) == [
        f"real run: pipeline / conventional samples per second = {ratio(0, 'pipeline'):.3f} (target 1.5)",
        f"real run: async / conventional samples per second = {ratio(0, 'async'):.2f} (overlap alone)",
    ]


def test_bench_refuses_zero_seeds():
    from repro.pipelinerl.bench import main

    with pytest.raises(SystemExit, match="--seeds must be >= 1, got 0"):
        main(["--seeds", "0"])
