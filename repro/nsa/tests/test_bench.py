"""The benchmark's plumbing on the CPU (the timings themselves need the GPU job)."""

from __future__ import annotations

import json
import sys

import torch

from repro.nsa import bench


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

    run = bench.fwd_bwd(f, (x, y))
    run()
    run()
    assert len(seen) == 2  # one forward per call, none when the closure is built
    assert x.grad is None and y.grad is None  # gradients are returned, not accumulated


def test_rows_sample_includes_the_last_position(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    rows = bench.sample_rows(100, torch.Generator().manual_seed(0))
    assert rows.max().item() == 99 and rows.unique().numel() == rows.numel()
    assert rows.min().item() >= 0


def _toy(monkeypatch):
    """The bench at a toy size on the CPU (Triton's interpreter), with a one-call timer."""
    import time

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "HQ", 2)
    monkeypatch.setattr(bench, "H", 1)
    monkeypatch.setattr(bench, "D", 16)
    monkeypatch.setattr(bench, "DTYPE", torch.float32)  # the interpreter's bf16 path is twice as slow
    # few selected blocks: the interpreter runs the selected branch's T x S block loads one by one
    small = dict(block_len=32, stride=16, select_len=16, n_select=2, n_initial=1, n_local=1, window=32)
    monkeypatch.setattr(bench, "PAPER", bench.ref.NSAConfig(**small))
    fla_small = dict(block_len=16, stride=16, select_len=16, n_select=2, n_initial=1, n_local=1)
    monkeypatch.setattr(bench, "FLA_SETUP", bench.ref.NSAConfig(**fla_small))
    monkeypatch.setattr(bench, "_rounds", lambda t: 1)
    monkeypatch.setattr(bench, "SDPA_BACKENDS", {"sdpa-math": "MATH"})
    monkeypatch.setattr(bench, "FA4_MAX_T", 0)
    monkeypatch.setattr(bench, "load_fla", lambda: (None, "fla left out of the CPU test"))

    def timer(fn, warmup, rep):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(bench, "TIMER", timer)


def test_plan_puts_the_first_forward_first_and_decode_last():
    steps = bench.plan([8192, 16384], 16)
    assert [s.name for s in steps[:4]] == [
        "train fwd T=8192 core",
        "train fwd T=8192 peers",
        "train fwd+bwd T=8192 core",
        "train fwd+bwd T=8192 peers",
    ]
    assert [s.section for s in steps[-2:]] == ["decode", "decode"]
    assert bench.predict(steps[0], {}) is None  # the first step always runs


def test_prediction_counts_compile_once_and_scales_with_length():
    done = {("train", "fwd", "core"): [(8192, 20.0, 2.0)]}
    # a second length: the first step's check (compile) once, its timing times (T / T0)^2
    assert bench.predict(bench.Step("train", "fwd", 16384, "core"), done) == 20.0 + 8.0
    # a pass not run yet: a multiple of the first forward core step
    fb = bench.Step("train", "fwd+bwd", 8192, "core")
    assert bench.predict(fb, done) == bench.FIRST_COST[("fwd+bwd", "core")] * 22.0


def test_budget_cut_keeps_the_rows_reached_and_names_the_rest(tmp_path, capsys, monkeypatch):
    """A budget of 0 s: the first step (ours against SDPA, forward, at the first length) still runs and
    is written; every other step is named in the notes as not measured."""
    _toy(monkeypatch)
    bench.run(str(tmp_path), budget_s=0.0, quick=False, lengths=[32, 64], decode_batch=2)
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = doc["rows"]
    assert {(r["section"], r["impl"], r["pass"], r["T"]) for r in rows} == {
        ("train", "nsa", "fwd", 32),
        ("train", "sdpa-math", "fwd", 32),
    }
    assert all(r["check"] == "ok" and r["ms"] is not None for r in rows)
    notes = doc["notes"]
    assert "Not measured (time budget of 0 s)" in notes
    for name in (
        "train fwd T=32 peers",
        "train fwd+bwd T=32 core",
        "train fwd T=64 core",
        "decode T=64 B=2",
    ):
        assert name in notes
    out = capsys.readouterr().out
    assert "plan of 10 steps" in out and "nsa: check ok" in out and "timed nsa" in out


def test_every_step_at_toy_size_is_checked_timed_and_written(tmp_path, monkeypatch):
    """The whole plan at one toy length: both passes, both groups and decode, each row checked (the
    absent fla as a failed check, not timed), and the report rewritten after every step."""
    _toy(monkeypatch)
    writes = []
    real = bench.Report.write

    def write(self, **kw):
        writes.append(len(self.rows))
        return real(self, **kw)

    monkeypatch.setattr(bench.Report, "write", write)
    bench.run(str(tmp_path), budget_s=1e9, quick=True, lengths=[32], decode_batch=2, tag="toy")
    assert writes[:-1] == sorted(writes[:-1]) and len(writes) == 6  # 5 steps, then the final write
    (written,) = tmp_path.glob("*.json")
    assert written.name.endswith("-toy.json"), written.name  # --tag names the file
    rows = json.loads(written.read_text())["rows"]
    got = {(r["impl"], r["pass"]): r for r in rows}
    for impl in ("nsa", "sdpa-math", "ours-cmp+slc", "ours-slc"):
        for p in ("fwd", "fwd+bwd"):
            assert got[(impl, p)]["check"] == "ok" and got[(impl, p)]["ms"] is not None, (impl, p)
    assert got[("nsa", "fwd")]["speedup_vs_full"] is not None
    assert got[("fla-slc", "fwd")]["check"].startswith("failed") and got[("fla-slc", "fwd")]["ms"] is None
    for impl in ("nsa-decode", "sdpa-decode"):
        assert got[(impl, "decode")]["check"] == "ok"


def test_breakdown_times_every_stage_and_the_whole(tmp_path, monkeypatch):
    """The forward by stage at a toy size: a checked, timed row per stage and for the whole, their
    shares of the whole, and a sum-of-stages row that is the stages' medians added."""
    _toy(monkeypatch)
    path = bench.run_breakdown(str(tmp_path), 40, torch.Generator().manual_seed(0))
    assert path.name.endswith("-breakdown.json")
    rows = {r["stage"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == [*bench.STAGES, *bench.ALTERNATIVES, "whole", "sum-of-stages"]
    for stage in (*bench.STAGES, *bench.ALTERNATIVES, "whole"):
        r = rows[stage]
        assert r["check"] == "ok" and r["ms"] > 0 and r["T"] == 40, stage
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert abs(r["share_of_whole"] - r["ms"] / rows["whole"]["ms"]) < 1e-9
    total = sum(rows[s]["ms"] for s in bench.STAGES)
    assert abs(rows["sum-of-stages"]["ms"] - total) < 1e-9 * total
    # the whole runs every stage once more (and its input checks): same order of magnitude
    assert 0.2 < rows["sum-of-stages"]["share_of_whole"] < 5.0


def test_slc_backward_rows_are_checked_timed_and_written(tmp_path, monkeypatch):
    """``--slc-bwd`` at a toy size: the query-major and the block-major backward each get a checked,
    timed ``bwd`` and ``fwd+bwd`` row (the block-major one checked against the query-major gradients),
    the absent fla a failed check; the file is <device>-slc-bwd.json. Fails if the settings do not
    reach the backward (a candidate left on the default path would still pass its check, so the test
    also counts each backward's dK/dV launches), or a row is missing."""
    from repro.nsa import kernels as kn
    from repro.nsa.tests.helpers import dispatched

    _toy(monkeypatch)
    monkeypatch.setattr(
        bench, "SLC_BWD_IMPLS", {k: bench.SLC_BWD_IMPLS[k] for k in ("ours-slc", "ours-slc-tiled")}
    )
    default = bench.ops.TILED_SLC_BWD
    with dispatched(kn, ("_slc_bwd_dkdv_kernel", "_slc_bwd_dkdv_tiled_kernel")) as (_, launches):
        path = bench.run_slc_backward(
            str(tmp_path), [24], (None, "fla left out"), torch.Generator().manual_seed(0)
        )
    assert path.name.endswith("-slc-bwd.json")
    assert launches.count("_slc_bwd_dkdv_tiled_kernel") >= 4  # check + timing of both tiled rows
    assert launches.count("_slc_bwd_dkdv_kernel") >= 2  # and of the query-major rows
    assert bench.ops.TILED_SLC_BWD is default  # restored after each call
    rows = {(r["impl"], r["pass"]): r for r in json.loads(path.read_text())["rows"]}
    for impl in ("ours-slc", "ours-slc-tiled"):
        for p in ("bwd", "fwd+bwd"):
            assert rows[(impl, p)]["check"] == "ok" and rows[(impl, p)]["ms"] > 0, (impl, p)
    assert rows[("fla-slc", "bwd")]["check"].startswith("failed") and rows[("fla-slc", "bwd")]["ms"] is None
