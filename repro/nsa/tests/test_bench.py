"""The benchmark's plumbing on the CPU (the timings themselves need the GPU job)."""

from __future__ import annotations

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
