"""The lab's GPU scripts on the CPU at a toy size (Triton's interpreter): their rows are checked, timed
and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from paperclub.testing import dispatched
from repro.nsa import Switches, selected
from repro.nsa.lab import breakdown, slc_backward
from repro.nsa.tests.test_bench import toy


def test_breakdown_times_every_stage_and_the_whole(tmp_path):
    """The forward by stage at a toy size: a checked, timed row per stage and for the whole, their
    shares of the whole, and a sum-of-stages row that is the stages' medians added."""
    setup, _ = toy()
    path = breakdown.run(setup, tmp_path, 40, torch.Generator().manual_seed(0))
    assert path.name.endswith("-breakdown-d16-T40.json")
    rows = {r["stage"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == [*breakdown.STAGES, *breakdown.ALTERNATIVES, "whole", "sum-of-stages"]
    for stage in (*breakdown.STAGES, *breakdown.ALTERNATIVES, "whole"):
        r = rows[stage]
        assert r["check"] == "ok" and r["ms"] > 0 and r["T"] == 40, stage
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert abs(r["share_of_whole"] - r["ms"] / rows["whole"]["ms"]) < 1e-9
    total = sum(rows[s]["ms"] for s in breakdown.STAGES)
    assert abs(rows["sum-of-stages"]["ms"] - total) < 1e-9 * total
    # the whole runs every stage once more (and its input checks): same order of magnitude
    assert 0.2 < rows["sum-of-stages"]["share_of_whole"] < 5.0


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
    no other device work; the backward six launches and at most 57 PyTorch ops with device work (66
    before issue #39's cuts: the gate's and the strided backward's fp32 copies, the lse's zero
    gradient); neither makes the host wait for the device."""
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
    assert len(bwd["launches"]) == 6 and sum(bwd["ops"].values()) <= 57, bwd["ops"]
    assert bwd["ops"]["_to_copy.default"] <= 11


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
