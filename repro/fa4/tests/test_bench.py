"""The benchmark's plumbing: its candidates are valid configs, its parts and settings are checked, and
the helpers for the flash-attn-4 peer.

The CPU tests check the plumbing (the import guard, the output adapter, the parts and --set); the
``gpu`` test runs flash-attn-4 itself against the float64 reference and is skipped without a GPU, or
where flash-attn-4 is not installed or does not run. (The Nsight Compute summary and the error text
are paperclub's: tests/test_bench_lab.py, tests/test_bench_sweep.py.)
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from repro.fa4 import bench


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


def test_candidates_are_valid_switches():
    """Every candidate of ours the bench builds (the ablation, the comparison, the backward comparison,
    the peer rows) is a Switches the entry point accepts and resolves at the bench's head dim: an unknown
    field or a combination the API refuses fails here, not on the GPU."""
    from repro.fa4.api import Switches, resolve

    named = {**bench.ABLATIONS, **bench.BWD_IMPLS, "best": bench.OURS_BEST, "gluon": bench.OURS_GLUON}
    for name, changes in named.items():
        sw = Switches(**bench.switches(changes))
        resolved = resolve(sw, bench.HEAD_DIM, False)
        assert resolved.block_m and resolved.bwd_block_m, name
    assert bench.switches({}) == {} and bench.switches({"tma": True}) == {"tma": True}
    assert set(bench.DEFAULT_PARTS) < set(bench.PARTS)


def test_parts_and_settings_are_checked(monkeypatch, capsys):
    """--only names parts (a typo stops the bench, listing them); --set changes the base config every
    candidate is built from, type-checked; both before any GPU work."""
    for argv, message in (
        (["--only", "bwdd"], "no part of that name; known: bwd, compare, rescale, peer, fa4-smoke, heads"),
        (["--set", "lazy_rescale=1"], "expected a bool"),
        (["--set", "bwd_dq_defer=True"], "not a field of Switches"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--set", "lazy_rescale=False", "--only", "bwd"])
    # the part run gets the changed config as its base, and its candidates are built on it
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bwd_compare", lambda *a, **kw: seen.update(kw))
    bench.main(["--set", "lazy_rescale=False", "--only", "bwd"])
    assert seen["base"] == bench.Switches(lazy_rescale=False)
    assert bench.switches({"tma": True}, seen["base"]) == {"lazy_rescale": False, "tma": True}
    assert bench.switches({"tma": True}) == {"tma": True}


def test_head_rows_count_the_callers_work():
    """The head-size part: TFLOP/s count the caller's head sizes and the visible scores (so padding
    shows as lower TFLOP/s); the tiles of its shapes are the verified ones up to 128 and 256 above,
    exact (flops_ratio 1) at 64, 128, 256; every window row fits its length."""
    from repro.fa4.api import head_layout

    assert bench.attention_flops(1, 8, 8, 64, 64, "fwd", 1.0) == 2 * bench.HEADS * 64 * 128
    assert bench.attention_flops(1, 8, 8, 64, 64, "fwd+bwd", 0.5) == 3.5 * bench.HEADS * 64 * 128
    assert bench._visible(4, True, None) == pytest.approx(10 / 16)
    assert bench._visible(4, False, (1, 0)) == pytest.approx(7 / 16)
    for d, d_v in bench.HEAD_SHAPES:
        lay = head_layout(d, d_v)
        assert lay.verified == (d <= 128)
        assert (lay.flops_ratio() == 1) == (d in (64, 128, 256) and d_v == d)
    assert all(w[0] < bench.HEAD_SEQLENS[-1] for w in bench.WINDOWS)


def test_check_tolerance_refuses_a_reference_the_yardstick_disagrees_with():
    """3x the yardstick's distance, at least 2e-2; two SDPA backends that disagree beyond
    REFERENCE_AGREEMENT give no reference (a tolerance from their distance would pass anything)."""
    from repro.fa4.bench import REFERENCE_AGREEMENT, _tolerance

    assert _tolerance(3.2e-3) == 2e-2 and _tolerance(1e-2) == pytest.approx(3e-2)
    for bad in (1.4, REFERENCE_AGREEMENT * 1.01, float("nan")):
        with pytest.raises(AssertionError, match="no reference"):
            _tolerance(bad)
