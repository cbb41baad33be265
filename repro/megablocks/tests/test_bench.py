"""The benchmark's plumbing on CPU (tiny shape, fp32, Triton interpreter, a timer that runs each
candidate once): routings, checks before timing, the rows it writes. Speed is not tested here."""

from __future__ import annotations

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
