"""The benchmark's plumbing on the CPU (the timings themselves need the GPU job)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from paperclub.bench import Budget, Plan, bwd_only, fwd_bwd
from repro.nsa import bench, window
from repro.nsa import reference as ref


def test_load_fla_reports_a_failed_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.nsa.parallel", None)  # makes the import raise
    fn, why = bench.load_fla()
    assert fn is None
    assert why.startswith("import fla.ops.nsa failed: ")


def test_fwd_bwd_draws_one_cotangent_and_differentiates_every_leaf():
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    seen = []

    def f():
        out = x * y
        seen.append(out)
        return out

    run = fwd_bwd(f, (x, y))
    run()
    run()
    assert len(seen) == 2  # one forward per call, none when the closure is built
    assert x.grad is None and y.grad is None  # gradients are returned, not accumulated


def test_rows_sample_includes_the_last_position():
    rows = bench.sample_rows(100, torch.Generator().manual_seed(0), "cpu")
    assert rows.max().item() == 99 and rows.unique().numel() == rows.numel()
    assert rows.min().item() >= 0


def toy(clock_step: float = 0.0) -> tuple[bench.Setup, list]:
    """The bench at a toy size on the CPU (Triton's interpreter), with a one-call timer; each timed call
    also moves ``clock`` (a fake clock for a Budget) on by ``clock_step`` seconds."""
    import time

    clock = [0.0]

    def timer(fn, warmup, rep):
        t0 = time.perf_counter()
        fn()
        clock[0] += clock_step
        return (time.perf_counter() - t0) * 1e3

    # few selected blocks: the interpreter runs the selected branch's T x S block loads one by one
    small = ref.NSAConfig(
        block_len=32, stride=16, select_len=16, n_select=2, n_initial=1, n_local=1, window=32
    )
    fla_small = ref.NSAConfig(block_len=16, stride=16, select_len=16, n_select=2, n_initial=1, n_local=1)
    setup = bench.Setup(
        hq=2, h=1, d=16, dv=None, device="cpu", dtype=torch.float32, extra_nsa=(),  # fp32: the interpreter's bf16 is slower
        paper=small, fla_setting=fla_small, sdpa_backends=(("sdpa-math", "MATH"),), fa4_max_t=0,
        rounds=lambda t: 1, timer=timer, fla=lambda: (None, "fla left out of the CPU test"),
    )  # fmt: skip
    return setup, clock


def test_plan_puts_the_first_forward_first_and_decode_last():
    steps = bench.plan_steps([8192, 16384], 16)
    assert [s.name for s in steps[:6]] == [
        "train fwd T=8192 core",
        "train fwd T=8192 peers",
        "train bwd T=8192 core",
        "train bwd T=8192 peers",
        "train fwd+bwd T=8192 core",
        "train fwd+bwd T=8192 peers",
    ]
    assert [s.data[0] for s in steps[-2:]] == ["decode", "decode"]
    assert (
        Plan(steps, Budget(None), log=lambda _: None).predict(steps[0]) is None
    )  # the first step always runs


def test_prediction_counts_compile_once_and_scales_with_length():
    steps = {s.name: s for s in bench.plan_steps([8192, 16384], 16)}
    plan = Plan(list(steps.values()), Budget(None), log=lambda _: None)
    plan.record(steps["train fwd T=8192 core"], check_s=20.0, time_s=2.0)
    # a second length: the first step's check (compile) once, its timing times (T / T0)^2
    assert plan.predict(steps["train fwd T=16384 core"]) == 20.0 + 8.0
    # a pass not run yet: a multiple of the first forward core step
    fb = steps["train fwd+bwd T=8192 core"]
    assert plan.predict(fb) == bench.FIRST_COST[("fwd+bwd", "core")] * 22.0


def test_train_flops_count_the_papers_nine_64ths():
    """The matmul count of the paper's configuration at 64k with one head size (D = 128): the
    compressed branch (about T/32 keys a query), its keys again for the scores (QK^T only), n l'
    selected and w window keys, 9/64 of full causal attention's (to 1%; the first positions see fewer
    keys). At the paper's Dk = 192, Dv = 128 the forward is 2 (Dk + Dv) per key and head, the backward
    alone 2 (3 Dk + 2 Dv), the scores 2 Dk per compressed key."""
    setup = bench.Setup(d=128, dv=None)
    full = bench.train_flops("sdpa-cudnn", "fwd", 65536, setup)
    assert abs(full - 4 * 64 * 128 * 65536 * 65537 / 2) < 1
    assert abs(bench.train_flops("nsa", "fwd", 65536, setup) / full - 9 / 64) < 0.01 * 9 / 64
    # the backward is 2.5 forwards for every branch but the scores
    assert bench.train_flops("ours-slc", "fwd+bwd", 8192, setup) == 3.5 * bench.train_flops(
        "ours-slc", "fwd", 8192, setup
    )
    paper = bench.Setup()
    assert (paper.d, paper.d_v, paper.heads()) == (192, 128, "dk192-dv128")
    keys = 8192 * 8193 / 2
    assert bench.train_flops("sdpa-flash", "fwd", 8192, paper) == 64 * 2 * (192 + 128) * keys
    assert bench.train_flops("sdpa-flash", "bwd", 8192, paper) == 64 * 2 * (3 * 192 + 2 * 128) * keys
    n = bench.keys_per_query(8192, paper.paper)
    nsa_bwd = bench.train_flops("nsa", "bwd", 8192, paper)
    assert nsa_bwd == 64 * 2 * (3 * 192 + 2 * 128) * (n["cmp"] + n["slc"] + n["win"])  # no scores
    fb = bench.train_flops("nsa", "fwd+bwd", 8192, paper)
    assert fb == bench.train_flops("nsa", "fwd", 8192, paper) + nsa_bwd


def test_budget_cut_keeps_the_rows_reached_and_names_the_rest(tmp_path, capsys):
    """A budget spent by the first step (the toy timer moves a fake clock past it): that step (ours
    against SDPA, forward, at the first length) still runs and is written; every other step is named
    in the notes as not measured."""
    setup, clock = toy(clock_step=100.0)
    budget = Budget(1.0, clock=lambda: clock[0])
    bench.run(setup, tmp_path, budget, [32, 64], 2)
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = doc["rows"]
    assert {(r["section"], r["impl"], r["pass"], r["T"]) for r in rows} == {
        ("train", "nsa", "fwd", 32),
        ("train", "sdpa-math", "fwd", 32),
    }
    assert all(r["check"] == "ok" and r["ms"] is not None for r in rows)
    notes = doc["notes"]
    assert "Not measured (time budget of 1 s)" in notes
    for name in (
        "train fwd T=32 peers",
        "train bwd T=32 core",
        "train fwd+bwd T=32 core",
        "train fwd T=64 core",
        "decode T=64 B=2",
    ):
        assert name in notes
    out = capsys.readouterr().out
    assert "14 steps" in out and "nsa: check ok" in out and "timed nsa" in out


def test_every_step_at_toy_size_is_checked_timed_and_written(tmp_path, monkeypatch):
    """The whole plan at one toy length: both passes, both groups and decode, each row checked (the
    absent fla as a failed check, not timed), and the report rewritten after every step."""
    setup, _ = toy()
    writes = []
    real = bench.Report.write

    def write(self, **kw):
        writes.append(len(self.rows))
        return real(self, **kw)

    monkeypatch.setattr(bench.Report, "write", write)
    bench.run(setup, tmp_path, Budget(None), [32], 2, quick=True, tag="toy")
    assert writes[:-1] == sorted(writes[:-1]) and len(writes) == 8  # 7 steps, then the final write
    (written,) = tmp_path.glob("*.json")
    assert written.name.endswith("-toy.json"), written.name  # --tag names the file
    rows = json.loads(written.read_text())["rows"]
    got = {(r["impl"], r["pass"]): r for r in rows}
    for impl in ("nsa", "sdpa-math", "ours-cmp+slc", "ours-slc"):
        for p in ("fwd", "bwd", "fwd+bwd"):
            assert got[(impl, p)]["check"] == "ok" and got[(impl, p)]["ms"] is not None, (impl, p)
    assert got[("nsa", "fwd")]["speedup_vs_full"] is not None and got[("nsa", "fwd")]["tflops"] > 0
    assert got[("fla-slc", "fwd")]["check"].startswith("failed") and got[("fla-slc", "fwd")]["ms"] is None
    for impl in ("nsa-decode", "sdpa-decode"):
        assert got[(impl, "decode")]["check"] == "ok"


def test_only_runs_the_steps_named_and_refuses_a_typo(tmp_path):
    setup, _ = toy()
    bench.run(setup, tmp_path, Budget(None), [32], 2, only=("decode*",))
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    assert {r["section"] for r in rows} == {"decode"}
    try:
        bench.run(setup, tmp_path, Budget(None), [32], 2, only=("decod",))
    except ValueError as exc:
        assert "no step of that name" in str(exc)
    else:
        raise AssertionError("a pattern matching no step must be refused")


def test_rows_at_separate_key_and_value_head_sizes(tmp_path):
    """The bench at a toy shape with Dv != Dk (the paper's kind, §4.1): forward and backward alone of
    nsa and full attention checked and timed; the extra nsa row with the window
    through repro.fa4 checked and timed where repro.fa4 has its window, else a failed check, not a
    timing; the file is tagged with the head sizes."""
    setup, _ = toy()
    setup = replace(setup, d=16, dv=32, extra_nsa=(("nsa-fa4win", {"window_kernel": "fa4"}),))
    available, _ = window.fa4_window_available()
    only = ("train fwd T=32 core", "train bwd T=32 core", "train fwd T=32 extra")
    path = bench.run(setup, tmp_path, Budget(None), [32], 2, only=only, tag=setup.heads())
    assert path.name.endswith("-dk16-dv32.json")
    rows = {(r["impl"], r["pass"]): r for r in json.loads(path.read_text())["rows"]}
    for impl in ("nsa", "sdpa-math"):
        for p in ("fwd", "bwd"):
            assert rows[(impl, p)]["check"] == "ok" and rows[(impl, p)]["ms"] is not None, (impl, p)
    extra = rows[("nsa-fa4win", "fwd")]
    if available:  # repro.fa4 has its sliding window: the row runs and is checked like nsa's
        assert extra["check"] == "ok" and extra["ms"] is not None
    else:
        assert extra["check"].startswith("failed") and extra["ms"] is None


def test_bwd_only_runs_one_forward_and_many_backwards():
    x = torch.randn(3, 4, requires_grad=True)
    forwards = []

    def f():
        forwards.append(1)
        return x * 2

    run = bwd_only(f, (x,))
    for _ in range(3):
        run()
    assert len(forwards) == 1 and x.grad is None
