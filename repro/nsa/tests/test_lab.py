"""The lab's GPU scripts on the CPU at a toy size (Triton's interpreter): their rows are checked, timed
and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from paperclub.testing import dispatched
from repro.nsa import Switches, selected
from repro.nsa import reference as ref
from repro.nsa.lab import breakdown, slc_backward
from repro.nsa.tests.test_bench import toy


def breakdown_rows(path, pass_: str, t: int) -> dict[str, dict]:
    """A breakdown file's rows by stage, each of pass ``pass_`` and length ``t``; the stage rows, the
    references, the whole: checked and timed; sum-of-stages the stages' medians added and glue the
    whole minus that, so that the stages and the glue add up to the whole."""
    rows = {r["stage"]: r for r in json.loads(path.read_text())["rows"]}
    stages = breakdown.STAGES_OF[pass_]
    for stage, r in rows.items():
        assert r["pass"] == pass_ and r["T"] == t, stage
        if stage in ("sum-of-stages", "glue"):
            continue
        assert r["check"] == "ok" and r["ms"] > 0, (stage, r["check"])
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert abs(r["share_of_whole"] - r["ms"] / rows["whole"]["ms"]) < 1e-9
    total = sum(rows[s]["ms"] for s in stages)
    assert abs(rows["sum-of-stages"]["ms"] - total) < 1e-9 * total
    assert abs(rows["sum-of-stages"]["ms"] + rows["glue"]["ms"] - rows["whole"]["ms"]) < 1e-9 * total
    # the whole runs every stage once more (and its input checks): same order of magnitude
    assert 0.2 < rows["sum-of-stages"]["share_of_whole"] < 5.0
    # matmul FLOPs: the branches' add up to the whole's; the cuDNN row is the rate's yardstick
    branches = [s for s in stages if s in ("cmp", "slc", "win")]
    extra = rows["scores"]["gflop"] if pass_ == "fwd" else 0.0
    assert abs(sum(rows[s]["gflop"] for s in branches) + extra - rows["whole"]["gflop"]) < 1e-9
    for stage in (*branches, "whole", "sdpa-cudnn"):
        r = rows[stage]
        assert abs(r["tflops"] - r["gflop"] / r["ms"]) < 1e-9 * r["tflops"], stage
        assert (
            abs(r["rate_vs_cudnn"] - r["tflops"] / rows["sdpa-cudnn"]["tflops"]) < 1e-9 * r["rate_vs_cudnn"]
        )
    return rows


def toy_breakdown():
    """The bench's toy setup with SDPA's math backend standing in for cuDNN's (the rate's yardstick)."""
    setup, _ = toy()
    return replace(setup, sdpa_backends=(("sdpa-cudnn", "MATH"),))


def test_breakdown_times_every_stage_and_the_whole(tmp_path):
    """The forward by stage at a toy size: a checked, timed row per stage, alternative, reference and
    the whole, their shares of the whole, and sum-of-stages and glue rows that add up to it."""
    path = breakdown.run(toy_breakdown(), tmp_path, 40, torch.Generator().manual_seed(0))
    assert path.name.endswith("-breakdown-d16-T40.json")
    rows = breakdown_rows(path, "fwd", 40)
    assert list(rows) == [
        *breakdown.STAGES,
        *breakdown.ALTERNATIVES,
        "sdpa-cudnn",
        "whole",
        "sum-of-stages",
        "glue",
    ]


def test_breakdown_bwd_times_every_backward_stage_and_the_whole(tmp_path):
    """``--pass bwd`` at a toy size: a row per backward stage (gate, win, slc, cmp, dq-sum), each
    checked against the reference's autograd (dK, dV through a cotangent zero but on the sampled
    rows), the whole backward checked against the stages' gradients, all timed; the stages and the
    glue add up to the whole."""
    setup = toy_breakdown()
    path = breakdown.run(setup, tmp_path, 40, torch.Generator().manual_seed(0), "bwd")
    assert path.name.endswith("-breakdown-bwd-d16-T40.json")
    rows = breakdown_rows(path, "bwd", 40)
    assert list(rows) == [*breakdown.BWD_STAGES, "sdpa-cudnn", "whole", "sum-of-stages", "glue"]


def test_grad_check_compares_whole_key_gradients_from_sampled_rows():
    """breakdown.grad_check's premise, on the reference itself (no kernels): with the cotangent zero
    but on the sampled rows, the whole dK, dV are the sampled rows' alone, so the reference on those
    rows matches; a reference with the window one shorter does not."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 40, 2, 16, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)
    )
    out = ref.sliding_window_attention(q, k, v, 8)
    pos = torch.tensor([3, 17, 39])
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    names = ("dq", "dk", "dv")

    def rows(w):
        return lambda *x: ref.sliding_window_attention(*x, w, q_pos=pos)

    breakdown.grad_check("win", out, (q, k, v), do, rows(8), 1, pos, names)
    with pytest.raises(AssertionError, match="win backward: d"):
        breakdown.grad_check("win", out, (q, k, v), do, rows(7), 1, pos, names)


def test_slc_backward_rows_are_checked_timed_and_written(tmp_path):
    """The selected backward's sweep at a toy size: the block-major default and the query-major backward
    each get a checked, timed ``bwd`` and ``fwd+bwd`` row (the block-major one checked against the
    query-major gradients), the absent fla a failed check; the file is <device>-slc-bwd.json. Fails if
    the switches do not reach the backward (a candidate left on the default path would still pass its
    check, so the test also counts each backward's dK/dV launches), or a row is missing."""
    setup, _ = toy()
    impls = {k: slc_backward.IMPLS[k] for k in ("ours-slc-tiled", "ours-slc")}
    with dispatched(selected, ("_slc_bwd_dkdv_kernel", "_slc_bwd_dkdv_tiled_kernel")) as (_, launches):
        path = slc_backward.run(
            setup, tmp_path, [24], (None, "fla left out"), torch.Generator().manual_seed(0), impls
        )
    assert path.name.endswith("-slc-bwd.json")
    assert launches.count("_slc_bwd_dkdv_tiled_kernel") >= 4  # check + timing of both tiled rows
    assert launches.count("_slc_bwd_dkdv_kernel") >= 2  # and of the query-major rows
    rows = {(r["impl"], r["pass"]): r for r in json.loads(path.read_text())["rows"]}
    for impl in ("ours-slc", "ours-slc-tiled"):
        for p in ("bwd", "fwd+bwd"):
            assert rows[(impl, p)]["check"] == "ok" and rows[(impl, p)]["ms"] > 0, (impl, p)
    assert rows[("ours-slc", "bwd")]["changes"] == "slc_backward='query-major'"
    assert rows[("fla-slc", "bwd")]["check"].startswith("failed") and rows[("fla-slc", "bwd")]["ms"] is None
    assert Switches().slc_backward == "block-major"  # the baseline row is the default


def test_fixed_costs_counts_the_layers_launches_and_host_waits():
    """lab/fixed_costs (in a process of its own: it compiles nothing but needs Triton without the
    interpreter) at a small length and the paper's head sizes: the forward is six Triton launches and
    no other device work; the backward seven launches (Eq. 5's backward one of them since 29 November)
    and at most 45 PyTorch ops with device work (66 before issue #39's cuts: the gate's and the strided
    backward's fp32 copies, the lse's zero gradient, then the gate's products and row sums); neither
    makes the host wait for the device."""
    out = subprocess.run(
        [sys.executable, "-m", "repro.nsa.lab.fixed_costs", "--t", "256", "--json"],
        capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "TRITON_INTERPRET": "0"},
    )  # fmt: skip
    res = json.loads(out.stdout)
    fwd, bwd = res["forward"], res["backward"]
    assert [k for k, _ in fwd["launches"]] == [
        "_strided_fwd_kernel", "_scores_kernel", "_topn_rows_kernel", "_slc_fwd_kernel",
        "_strided_fwd_kernel", "_gate_sum_kernel",
    ]  # fmt: skip
    assert fwd["ops"] == {} and fwd["sync"] == [] and bwd["sync"] == []
    assert [k for k, _ in bwd["launches"]] == [
        "_gate_bwd_kernel", "_strided_bwd_dq_kernel", "_strided_bwd_dkdv_kernel", "_slc_bwd_dq_kernel",
        "_slc_bwd_dkdv_tiled_kernel", "_strided_bwd_dq_kernel", "_strided_bwd_dkdv_kernel",
    ]  # fmt: skip
    assert sum(bwd["ops"].values()) <= 45, bwd["ops"]
    assert bwd["ops"]["_to_copy.default"] <= 9


def test_decode_host_runs_the_step_as_two_launches():
    """lab/decode_host (a process of its own, Triton without the interpreter) at a small cache: a
    decode step is the two kernels of decode.py and nothing else launched, and its host time is
    reported (how long is a property of the machine, not asserted)."""
    out = subprocess.run(
        [sys.executable, "-m", "repro.nsa.lab.decode_host", "--b", "2", "--t", "512", "--calls", "5",
         "--heads", "192,128"],
        capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "TRITON_INTERPRET": "0"},
    )  # fmt: skip
    assert "B=2 T=512 Dk=192 Dv=128" in out.stdout and out.stdout.rstrip().endswith(", 2 launches"), (
        out.stdout
    )
