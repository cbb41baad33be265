"""The benchmark's helpers for the flash-attn-4 peer and the Nsight Compute summary.

The CPU tests check the plumbing (error text, the import guard, the output adapter, the CSV
reduction); the ``gpu`` test runs flash-attn-4 itself against the float64 reference and is
skipped without a GPU, or where flash-attn-4 is not installed or does not run.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from repro.fa4 import bench


def test_error_text_is_one_line_and_bounded():
    exc = RuntimeError("compile failed:\n  line 1\n\tline 2  " + "x" * 1000)
    text = bench.error_text(exc, limit=80)
    assert "\n" not in text and "\t" not in text
    assert text.startswith("RuntimeError: compile failed: line 1 line 2 x")
    assert len(text) == 80 and text.endswith("...")
    assert bench.error_text(ValueError()) == "ValueError"
    assert bench.error_text(KeyError("k"), limit=400) == "KeyError: 'k'"


def test_load_flash_attn_4_reports_a_failed_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # makes `import flash_attn.cute` raise
    fn, why = bench.load_flash_attn_4()
    assert fn is None
    assert why.startswith("import flash_attn.cute failed: ")


def test_fa4_cute_returns_the_output_not_the_lse():
    q = torch.randn(1, 4, 2, 8)
    seen = {}

    def fake(q_, k_, v_, causal=False):
        seen["causal"] = causal
        return q_ * 2, torch.zeros(1, 2, 4)

    out = bench.fa4_cute(fake, q, q, q, True)()
    assert torch.equal(out, q * 2) and seen["causal"] is True
    assert torch.equal(bench.fa4_cute(lambda a, b, c, causal: a, q, q, q, False)(), q)


def test_rel_err():
    ref = torch.ones(10, dtype=torch.float64)
    assert bench.rel_err(ref, ref) == 0.0
    assert math.isclose(bench.rel_err(ref * 1.01, ref), 0.01, rel_tol=1e-9)
    assert math.isclose(bench.rel_err(ref.bfloat16() * 2, ref), 1.0, rel_tol=1e-9)  # computed in float64


def test_smoke_error_reads_the_smoke_json(tmp_path):
    assert bench._smoke_error(tmp_path) == "no smoke-test result found"
    doc = {"notes": "Relative L2 errors. flash-attn-4 failed on this GPU: DSLRuntimeError: no sm90 kernel"}
    (tmp_path / "dev-fa4-smoke.json").write_text(json.dumps(doc))
    assert bench._smoke_error(tmp_path) == "failed on this GPU: DSLRuntimeError: no sm90 kernel"
    (tmp_path / "dev-fa4-smoke.json").write_text(json.dumps({"notes": "Relative L2 errors."}))
    assert bench._smoke_error(tmp_path) == "smoke test passed"


# Three kernels as ncu's raw page prints them with --csv: a header, a units row, one row per kernel.
NCU_RAW = """==PROF== Connected to process 123
"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active","sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_selected_per_issue_active.ratio","gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
"","","nsecond","register/thread","%","%","ratio","ratio","ratio","ratio","%"
"0","_fwd_kernel","2,401,600","255","61.2","20.5","0.90","0.10","0.35","1","3.58"
"1","cudnn_generated_fort_native_sdpa_sm90_flash_fprop","1,650,000","168","88.0","31.0","0.05","0.02","0.40","1.00","4.77"
"2","vectorized_elementwise_kernel","1,200","16","","","0","0","0","1","0"
"""


def test_ncu_summary_picks_metrics_units_and_top_stalls():
    items = bench.ncu_summary(NCU_RAW, top_stalls=2)
    assert [i["kernel"] for i in items] == [
        "_fwd_kernel",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
        "vectorized_elementwise_kernel",
    ]
    ours, cudnn, fill = items
    assert math.isclose(ours["duration (us)"], 2401.6) and math.isclose(cudnn["duration (us)"], 1650.0)
    assert ours["registers/thread"] == 255.0
    assert ours["tensor pipe %"] == 61.2 and cudnn["XU (MUFU, exp2) pipe %"] == 31.0
    assert fill["tensor pipe %"] is None  # empty cells and absent metrics both read as missing
    assert ours["achieved occupancy %"] is None
    assert ours["DRAM throughput %"] == 3.58  # ncu's newer metric name, the second candidate
    assert ours["stalls"] == ["barrier 0.90", "wait 0.35"]  # "selected" (1.0) is not a stall
    assert cudnn["stalls"] == ["wait 0.40", "barrier 0.05"]


def test_ncu_summary_of_an_empty_report():
    assert bench.ncu_summary("==PROF== No kernels were profiled.\n") == []


def test_ncu_summary_cli_needs_no_gpu(tmp_path, capsys):
    f = tmp_path / "raw.csv"
    f.write_text(NCU_RAW)
    bench.main(["--ncu-summary", str(f)])
    out = capsys.readouterr().out
    assert "_fwd_kernel" in out and "barrier 0.90" in out and "| kernel |" in out


@pytest.mark.gpu
def test_gpu_flash_attn_4_matches_reference():
    """flash-attn-4 on this GPU against float64, at the tolerances our own kernel meets; skipped where
    it is not installed or does not run (bench.py records that answer with its error)."""
    from repro.fa4.reference import attention_exact

    fn, why = bench.load_flash_attn_4()
    if fn is None:
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, 128, generator=g).cuda().bfloat16().requires_grad_() for _ in range(3))
    for causal in (False, True):
        try:
            out = bench.fa4_cute(fn, q, k, v, causal)()
        except Exception as exc:  # noqa: BLE001 - a peer that fails to compile here is skipped, not ours
            pytest.skip(f"flash-attn-4 does not run here: {bench.error_text(exc, 300)}")
        ref = attention_exact(q, k, v, causal=causal)
        assert bench.rel_err(out, ref) < 1.5e-2
        do = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
        for name, a, r in zip("qkv", grads, ref_grads, strict=True):
            assert bench.rel_err(a, r) < 3e-2, f"d{name}"


@pytest.mark.parametrize("sweep", ["GLUON_SWEEP", "GLUON_COMBOS"])
def test_gluon_sweep_plan_is_small_and_valid(sweep):
    from repro.fa4.gluon_fwd import KNOBS, _constexprs

    plan = bench.gluon_sweep_plan(sweep=getattr(bench, sweep))
    shapes = {(s, c) for s, c, _, _ in plan}
    assert len(shapes) == 6 and len(plan) + len(shapes) <= 66  # + one cuDNN row per shape
    if sweep == "GLUON_SWEEP":
        assert any(kw.get("num_consumers") == 1 for *_, kw in plan)
    for *_, kw in plan:  # every setting is one the launcher accepts, and its row names every knob it sets
        st = bench.gluon_sweep_settings(kw)
        assert set(kw) <= set(st)
        cx = _constexprs(128, False, st["lazy_rescale"], 8.0, st["num_consumers"], st["pingpong_sync"],
                         **{k: st[k] for k in KNOBS})  # fmt: skip
        assert (cx["BLOCK_N"], cx["NUM_STAGES"]) == (st["block_n"], st["num_stages"])


def test_trial_row_records_errors():
    report = bench.Report(
        package="fa4", title="t", columns=["x", "ms", "tflops", "note"], measure_ceilings=False
    )
    bench.trial_row(report, {"x": 1}, lambda: 2.0, 4e9)
    bench.trial_row(report, {"x": 2}, lambda: (1.0, "ok"), 4e9)
    bench.trial_row(report, {"x": 3}, lambda: 1 / 0, 4e9)
    assert report.rows[0]["tflops"] == pytest.approx(2.0) and report.rows[1]["note"] == "ok"
    assert math.isnan(report.rows[2]["ms"]) and report.rows[2]["note"].startswith("ZeroDivisionError")
