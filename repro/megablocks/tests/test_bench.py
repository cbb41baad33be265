"""The benchmark's plumbing on CPU (tiny shape, fp32, Triton interpreter, a timer that runs each
candidate once): routings, checks before timing, the rows it writes. Speed is not tested here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from repro.megablocks import bench


@pytest.mark.parametrize("routing", bench.ROUTINGS)
def test_routings(routing):
    weights, indices = bench.make_routing(64, 8, 2, routing, "cpu")
    assert indices.shape == (64, 2) and (indices[:, 0] != indices[:, 1]).all()
    assert torch.allclose(weights.sum(-1), torch.ones(64))
    counts = torch.bincount(indices.reshape(-1), minlength=8)
    if routing == "balanced":
        assert (counts == 16).all()
    else:
        assert counts.max() > 16


def test_useful_flops():
    # SwiGLU: three d x f matmuls per assignment, 2 flops each, backward twice the forward
    assert bench.useful_flops(10, 2, 4, 8) == 3 * 3 * 2 * 10 * 2 * 4 * 8


def test_run_config_checks_and_rows():
    calls = []

    def once(fn, warmup, rep):
        fn()
        calls.append(1)
        return 2.0

    notes = []
    dims = dict(E=4, k=2, d=32, f=32, T=24)
    rows = bench.run_config(
        "tiny",
        dims,
        "skewed",
        device="cpu",
        dtype=torch.float32,
        block_size=16,
        rounds=1,
        timer=once,
        notes=notes,
    )
    by = {r["impl"]: r for r in rows}
    for name in ("ours_sparse", "ours_grouped", "capacity_1.0", "capacity_2.0"):
        assert by[name]["check"] == "ok", by[name]["check"]
        assert by[name]["ms"] == 2.0 and by[name]["tflops"] is not None
    assert 0.0 <= by["capacity_1.0"]["drop_rate"] <= 1.0
    assert by["capacity_2.0"]["drop_rate"] <= by["capacity_1.0"]["drop_rate"]
    assert by["ours_sparse"]["drop_rate"] == 0.0
    assert any("megablocks" in n for n in notes)  # the peer's absence is noted, not an error
    assert set(by) >= {"ours_sparse", "ours_grouped", "capacity_1.0", "capacity_2.0"}


def test_main_flow_with_budget(monkeypatch, tmp_path):
    """main(): every configuration, then the tuning variants under kernel_config, the percentage of
    the ceiling, the notes, and the budget cut, with run_config and the GPU parts faked."""
    from repro.megablocks import kernels

    seen = []

    def fake_run_config(shape, dims, routing, *, notes, only=None, config="default", base_ms=None, **kw):
        seen.append((shape, routing, config, dict(kernels.GPU_CONFIG), only, base_ms))
        notes.append("megablocks: not installed")
        impls = only or ("ours_sparse", "torch_grouped_mm")
        return [
            dict(shape=shape, routing=routing, impl=i, config=config, ms=2.0, tflops=100.0, check="ok")
            for i in impls
            if i
        ]

    written = {}
    monkeypatch.setattr(bench, "run_config", fake_run_config)
    monkeypatch.setattr(bench, "ceilings", lambda: {"matmul_bf16_tflops": 800.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(
        bench.Report, "write", lambda self, out_dir=None, **kw: written.update(r=self, out=out_dir)
    )
    bench.main(["--out", str(tmp_path), "--budget-s", "1000"])
    report = written["r"]
    assert written["out"] == tmp_path
    main_rows = [s for s in seen if s[2] == "default"]
    assert [(s[0], s[1]) for s in main_rows] == [(sh, r) for sh in bench.SHAPES for r in bench.ROUTINGS]
    tune = [s for s in seen if s[2].startswith("tune:")]
    prev = "num_warps=8,num_stages=3,gmm_n=128"  # bench.PREVIOUS_DEFAULT
    labels = [
        "tune:default",
        "tune:gmm_tma=False",
        "tune:fused_glue=False",
        f"tune:{prev}",
        "tune:gmm_wgrad_tma=True",
    ]
    # each variant on both shapes (8e-top2 first), the variants in order
    assert [(s[0], s[2]) for s in tune] == [
        (f"{shape} (tuning)", label) for label in labels for shape in ("8e-top2", "64e-top8")
    ]
    by = {(s[0].split()[0], s[2]): s for s in tune}
    assert by["8e-top2", "tune:default"][3]["group_m"] == 8  # the default is the grouped order
    assert (
        by["64e-top8", f"tune:{prev}"][3]["gmm_n"] == 128
        and by["64e-top8", f"tune:{prev}"][3]["num_warps"] == 8
    )
    assert by["8e-top2", "tune:gmm_tma=False"][3]["gmm_tma"] is False
    assert by["8e-top2", "tune:fused_glue=False"][3]["fused_glue"] is False
    assert by["8e-top2", "tune:default"][3]["gmm_tma"] is True  # the default is the TMA kernel
    assert by["8e-top2", "tune:default"][3]["gmm_wgrad_tma"] is False  # the wgrad's TMA kernel is not
    assert by["64e-top8", "tune:gmm_wgrad_tma=True"][3]["gmm_wgrad_tma"] is True
    assert kernels.GPU_CONFIG["gmm_wgrad_tma"] is False  # restored
    assert kernels.GPU_CONFIG["dense_n"] == 128 and kernels.GPU_CONFIG["group_m"] == 8  # restored
    assert kernels.GPU_CONFIG["gmm_n"] == 256 and kernels.GPU_CONFIG["num_warps"] == 4
    assert kernels.GPU_CONFIG["fused_glue"] is True
    # torch_grouped_mm runs once per shape, at the default; its time is that shape's later baseline
    assert all(("torch_grouped_mm" in s[4]) == (s[2] == "tune:default") for s in tune)
    assert by["8e-top2", "tune:default"][5] is None and by["64e-top8", f"tune:{prev}"][5] == 2.0
    assert tune[0] == seen[len(main_rows)]  # after the main table
    assert "tune:default is GPU_CONFIG" in report.notes
    assert all(r["pct_of_matmul"] == 12.5 for r in report.rows)
    assert report.notes.count("megablocks: not installed") == 1
    # a budget too small for anything but the first configuration
    seen.clear()
    bench.main(["--quick", "--budget-s", "15"])
    assert len(seen) == 0 or all(s[2] == "default" for s in seen)
    assert "skipped" in written["r"].notes
    # --tune-first: the tuning rows come before the main table
    seen.clear()
    bench.main(["--tune-first", "--budget-s", "1000"])
    assert seen[0][2] == "tune:default" and seen[-1][2] == "default"
    assert len([s for s in seen if s[2].startswith("tune:")]) == 2 * len(labels)


def test_megablocks_probe_reports_failure():
    """The child process that tries megablocks first: without megablocks it exits non-zero and the
    note carries its message (on the GPU machine the same path guards against a faulting peer)."""
    ok, note = bench.probe_megablocks(quick=True, timeout_s=120)
    assert not ok
    assert "megablocks probe failed (exit 3)" in note and "import megablocks failed" in note


def test_tuning_budget_cut(monkeypatch):
    """With each configuration taking 10 s (a fake clock) and a 100 s budget: the main table, then
    the first two tuning variants on both shapes; the rest skipped with one note naming them."""
    clock = [0.0]
    seen = []

    def fake_run_config(shape, dims, routing, *, notes, only=None, config="default", base_ms=None, **kw):
        clock[0] += 10.0
        seen.append((shape, config))
        return [dict(shape=shape, routing=routing, impl="ours_sparse", config=config, ms=2.0, check="ok")]

    written = {}
    monkeypatch.setattr(bench, "run_config", fake_run_config)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # bench's only
    monkeypatch.setattr(bench, "ceilings", lambda: {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.Report, "write", lambda self, out_dir=None, **kw: written.update(r=self))
    bench.main(["--budget-s", "100"])
    tune = [s for s in seen if s[1].startswith("tune:")]
    assert len(seen) - len(tune) == len(bench.SHAPES) * len(bench.ROUTINGS)
    assert tune == [
        (f"{shape} (tuning)", label)
        for label in ("tune:default", "tune:gmm_tma=False")
        for shape in ("8e-top2", "64e-top8")
    ]
    notes = written["r"].notes
    skipped = (
        "tuning rows skipped (budget 100 s): 8e-top2 tune:fused_glue=False; 64e-top8 tune:fused_glue=False; "
    )
    assert skipped + "8e-top2 tune:num_warps=8,num_stages=3,gmm_n=128; " in notes
    assert "64e-top8 tune:num_warps=8,num_stages=3,gmm_n=128; 8e-top2 tune:gmm_wgrad_tma=True; " in notes
    assert notes.count("64e-top8 tune:gmm_wgrad_tma=True") == 1
