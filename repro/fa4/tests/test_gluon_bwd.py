"""The warp-specialised Gluon backward (``bwd="gluon"``, ``repro.fa4.gluon_bwd``).

Gluon kernels do not run under TRITON_INTERPRET, so on the CPU the kernel is compiled offline for
sm_90a (Triton's compiler and its bundled ptxas need no GPU) at D 64/128, causal or not, bf16/fp16:
each must compile to wgmma, TMA loads and fp32 atomics, fit the H100's 227 KiB of shared memory
per block and stay within SPILL_BUDGET. ``bwd="gluon"`` must be refused, with a reason, where it
cannot run. The tests marked ``gpu`` run ``test_gpu_bwd``'s matrix (same shapes, fp64 reference,
cuDNN's error beside ours) with ``bwd="gluon"``, behind the Triton and the Gluon forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from paperclub.triton_compat import interpreting
from repro.fa4 import attention_any_d, gluon_bwd
from repro.fa4.gluon_bwd import (
    BISECT,
    COMPILE_CASES,
    check_device,
    gluon_attention_backward,
)
from repro.fa4.gluon_fwd import HAS_GLUON
from repro.fa4.tests import test_gpu_bwd as matrix
from repro.fa4.tests.offline_compile import compile_offline

needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon)")
H100_SMEM_PER_BLOCK = 227 * 1024
#: Spilled bytes (ptxas, stores) allowed per head dim, as compiled on 2026-11-25 (Triton 3.6): none at
#: D = 64; at D = 128 44 (causal 108) bytes of scalars, where the Triton one-pass kernel spills
#: 630-780 bytes of its dK/dV tiles. A change that spills more should say why.
SPILL_BUDGET = {64: 0, 128: 128}


def _case_id(case):
    d, causal, dtype = case
    return f"d{d}-{'causal' if causal else 'full'}-{dtype}"


@pytest.fixture(scope="module")
def compile_rows(tmp_path_factory) -> dict:
    """All COMPILE_CASES compiled offline for sm_90a in one subprocess (see offline_compile)."""
    rows = compile_offline("repro.fa4.gluon_bwd", COMPILE_CASES, tmp_path_factory.mktemp("triton-cache"))
    return {(x["d"], x["causal"], x["dtype"]): x for x in rows}


@needs_gluon
@pytest.mark.parametrize("case", [tuple(c) for c in COMPILE_CASES], ids=[_case_id(c) for c in COMPILE_CASES])
def test_gluon_backward_compiles_for_sm90(compile_rows, case):
    row = compile_rows[case]
    print(row)
    assert "error" not in row, row["error"]
    assert row["target_ok"] and row["wgmma"] > 0 and row["tma_loads"] > 0, row
    assert any(a.endswith("add.f32") for a in row["atomics"]), f"no fp32 atomic adds for dQ: {row}"
    assert 24 in row["setmaxnreg"], row  # the load warp gives its registers to the consumers
    assert 0 < row["shared"] <= H100_SMEM_PER_BLOCK, f"shared memory {row['shared']} B > 227 KiB"
    if "ptxas_error" in row:
        pytest.fail(f"ptxas: {row['ptxas_error']}")
    if "spill_stores" not in row:
        pytest.skip("this Triton bundles no ptxas: registers and spills not checked")
    assert row["spill_stores"] <= SPILL_BUDGET[case[0]], row


@needs_gluon
def test_every_bisect_variant_compiles_and_leaves_out_its_part(tmp_path_factory):
    """The fault-locating variants (gluon_bwd.BISECT, run one per process on the GPU by
    `python -m repro.fa4.gluon_bwd --bisect`) compile for sm_90a, and each leaves out what it says:
    no fp32 atomics without the dQ atomics (1), fewer wgmma without a product (2, 4, 8), fewer TMA
    copies without LSE / delta (16)."""
    cases = [[128, False, "bf16", None, None, s] for s in BISECT]
    rows = {
        r["skip"]: r for r in compile_offline("repro.fa4.gluon_bwd", cases, tmp_path_factory.mktemp("tc"))
    }
    for s, r in rows.items():
        assert "error" not in r, (s, r["error"])
    full = rows[0]
    assert rows[1]["atomics"] == [] and full["atomics"]
    for s in (2, 4, 8):
        assert rows[s]["wgmma"] < full["wgmma"], (s, rows[s]["wgmma"], full["wgmma"])
    assert rows[16]["tma_loads"] < full["tma_loads"]
    with pytest.raises(ValueError, match="bit mask"):
        gluon_bwd._constexprs(128, False, skip=32)


def test_gluon_backward_refused_where_it_cannot_run():
    q = torch.randn(1, 16, 2, 64)
    if interpreting():  # the CPU test run: refused before anything is launched
        with pytest.raises(ValueError, match="interpreter"):
            attention_any_d(q, q, q, bwd="gluon")
    with pytest.raises(RuntimeError, match="Hopper|Gluon"):
        check_device(q)  # CPU tensors
    with pytest.raises(RuntimeError, match="Hopper|Gluon"):
        gluon_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 16), False, 0.125)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        qc = q.to("cuda", torch.bfloat16)
        with pytest.raises(RuntimeError, match="Hopper"):
            check_device(qc)


def test_gluon_backward_configuration_errors():
    from repro.fa4.gluon_bwd import _constexprs

    assert _constexprs(128, True)["BLOCK_N"] == 128
    with pytest.raises(ValueError, match="head dim"):
        _constexprs(96, False)
    with pytest.raises(ValueError, match="block_m"):
        _constexprs(128, False, block_m=32)
    with pytest.raises(ValueError, match="num_stages"):
        _constexprs(128, False, num_stages=0)


# --------------------------------------------------------------------------------------------
# H100: test_gpu_bwd's matrix with bwd="gluon" (its test body, called, not collected twice).
# --------------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param(
        d, causal, dtype, fwd, id=f"d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}-gluon-{fwd}"
    )
    for d in (64, 128)
    for causal in (False, True)
    for dtype in (torch.bfloat16, torch.float16)
    for fwd in ("triton", "gluon")
]


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal, dtype, fwd", GPU_CASES)
def test_gpu_gluon_backward_matrix(d, causal, dtype, fwd):
    matrix.test_gpu_backward_matrix(d, causal, dtype, "gluon", fwd)


@pytest.mark.parametrize(
    "device, cap, dtype, d, causal, want",
    [
        ("cuda", (9, 0), torch.bfloat16, 128, False, "gluon"),
        ("cuda", (9, 0), torch.float16, 64, True, "gluon"),
        ("cuda", (9, 0), torch.float32, 128, True, "fused"),  # fp32: the Triton backwards only
        ("cuda", (9, 0), torch.bfloat16, 32, False, "fa2"),  # D 32: not a Gluon head dim
        ("cuda", (8, 0), torch.bfloat16, 128, True, "fused"),  # not Hopper
        ("cuda", (10, 0), torch.bfloat16, 128, False, "fa2"),
        ("cpu", None, torch.bfloat16, 128, True, "fused"),  # the interpreter
    ],
)
def test_auto_backward_picks_gluon_only_on_hopper(device, cap, dtype, d, causal, want, monkeypatch):
    """bwd="auto" is the Gluon backward exactly where it runs (sm_90, bf16/fp16, D 64/128), else the
    faster Triton backward by causality; FA4_GLUON_BWD_BROKEN's flag sends Hopper back to those."""
    from types import SimpleNamespace

    from repro.fa4 import auto_backward

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(gluon_bwd, "HAS_GLUON", True)
    q = SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 8, 2, d))
    assert auto_backward(q, causal) == want
    monkeypatch.setattr(gluon_bwd, "KNOWN_BROKEN_ON_GPU", True)
    assert auto_backward(q, causal) == ("fused" if causal else "fa2")


def test_sweep_report_rows(tmp_path):
    """The GPU sweep's rows become a Report: a fault is named as such, a shape that ran keeps its error,
    a group the budget did not reach stays one row; the boundary shapes are valid matrix rows."""
    rows = [
        {"d": 128, "causal": False, "dtype": "bf16", "fwd": "gluon", "shape": 0, "B_Sq_Sk_H_Hkv": [1, 1, 1, 8, 2],
         "status": "failed (exit 1)", "error": "...Search for `cudaErrorIllegalInstruction' in ..."},
        {"d": 128, "causal": False, "dtype": "bf16", "fwd": "gluon", "shape": 2, "B_Sq_Sk_H_Hkv": [2, 1000, 1000, 8, 8],
         "status": "ran", "rel_err_vs_fa2": 7.5e-5},
        {"d": 64, "causal": True, "dtype": "fp16", "fwd": "gluon", "status": "not run: budget"},
    ]  # fmt: skip
    rep = gluon_bwd.sweep_report(rows, "test", measure_ceilings=False)
    assert [r["status"] for r in rep.rows] == [
        "failed (exit 1): an illegal instruction",
        "ran",
        "not run: budget",
    ]
    assert (
        rep.rows[1]["S_q"] == 1000 and rep.rows[1]["rel_err_vs_fa2"] == 7.5e-5 and rep.rows[2]["S_q"] is None
    )
    assert all(len(s) == 5 and s[3] % s[4] == 0 for s in gluon_bwd.BOUNDARY_SHAPES)


@pytest.mark.parametrize("s_q", [1, 64, 113, 1000, 2048])
def test_pad_stats_aligns_every_tma_box(s_q):
    """PAD_STATS: each head's LSE / delta row padded to whole 64-entry tiles, values kept, so that the
    start (b H + h) S_stat + m of every 1-D TMA box is a multiple of 16 bytes; rows already whole are
    passed through as they are."""
    lse, delta = torch.randn(2, 3, s_q), torch.randn(2, 3, s_q)
    lp, dp, s_stat = gluon_bwd.pad_stats(lse, delta, 64)
    assert s_stat % 64 == 0 and s_stat - s_q < 64 and lp.shape == dp.shape == (2, 3, s_stat)
    assert torch.equal(lp[..., :s_q], lse) and torch.equal(dp[..., :s_q], delta)
    assert not lp[..., s_q:].any() and not dp[..., s_q:].any()
    starts = [(bh * s_stat + m) * 4 for bh in range(6) for m in range(0, s_q, 64)]
    assert all(x % 16 == 0 for x in starts)
    if s_q % 64 == 0:
        assert lp is lse and dp is delta


# --------------------------------------------------------------------------------------------
# The dQ variants (gluon_bwd.DQ_VARIANTS: TMA bulk reductions, deferred dQ product; off by default)
# --------------------------------------------------------------------------------------------

#: Spilled bytes allowed for the variants, as compiled on 2026-11-26 (Triton 3.6): dq_tma alone spills
#: about as much as the default at D = 128 (24 / causal 96 bytes against 44 / 92); the deferred dQ
#: product holds its dQ tile beside S^T, dK and dV and spills 360-660 bytes at D = 128, which the GPU
#: timing has to pay for. None at D = 64.
VARIANT_SPILL_BUDGET = {(64, False): 0, (64, True): 0, (128, False): 128, (128, True): 768}


def _variant_id(case):
    d, causal, dtype, _, _, _, tma_on, defer_on = case
    name = next(n for n, f in gluon_bwd.DQ_VARIANTS.items() if f == (tma_on, defer_on))
    return f"{name}-d{d}-{'causal' if causal else 'full'}-{dtype}"


@pytest.fixture(scope="module")
def variant_rows(tmp_path_factory) -> dict:
    """gluon_bwd.VARIANT_COMPILE_CASES compiled offline for sm_90a in one subprocess."""
    cases = gluon_bwd.VARIANT_COMPILE_CASES
    rows = compile_offline("repro.fa4.gluon_bwd", cases, tmp_path_factory.mktemp("triton-cache-dq"))
    return {_variant_id(c): r for c, r in zip(cases, rows, strict=True)}


@needs_gluon
@pytest.mark.parametrize(
    "case", gluon_bwd.VARIANT_COMPILE_CASES, ids=[_variant_id(c) for c in gluon_bwd.VARIANT_COMPILE_CASES]
)
def test_dq_variant_compiles_for_sm90(variant_rows, compile_rows, case):
    """Each dQ variant compiles for sm_90a and does what it says in the PTX. dq_tma: every dQ add is a
    TMA tensor bulk reduction (``cp.reduce.async.bulk.tensor ... add``, at least one per consumer, each
    committed as a bulk group and waited on before its staging tile is rewritten) and no
    ``red``/``atom.global`` is left; without it the per-element fp32 atomics stay. dq_defer: one more dQ
    product (the last step's, after the loop) than the default kernel, so more wgmma. Fails if the
    reduction falls back to atomics, is never waited on, or the deferral does not happen; and, as the
    default's test, on a compile error, more than 227 KiB of shared memory or spills over budget."""
    d, causal, dtype, _, _, _, tma_on, defer_on = case
    row = variant_rows[_variant_id(case)]
    base = compile_rows[(d, causal, dtype)]
    print(row)
    assert "error" not in row, row["error"]
    assert row["target_ok"] and row["wgmma"] > 0 and row["tma_loads"] > 0, row
    assert 24 in row["setmaxnreg"], row
    assert 0 < row["shared"] <= H100_SMEM_PER_BLOCK, f"shared memory {row['shared']} B > 227 KiB"
    if tma_on:
        assert row["atomic_count"] == 0 and row["atomics"] == [], (
            f"atomics left beside the bulk reductions: {row}"
        )
        assert row["bulk_reduce"] >= 2, row
        kinds = row["bulk_reduce_kinds"]
        assert all(".tensor." in k and ".add" in k and "global.shared::cta" in k for k in kinds), row
        assert row["bulk_commit"] >= row["bulk_reduce"] and row["bulk_wait"] > row["bulk_reduce"], row
        # the staging tiles: 2 consumers x BLOCK_M x D/2 fp32 beyond the default's shared memory
        assert row["shared"] >= base["shared"] + 2 * 64 * (d // 2) * 4, (row["shared"], base["shared"])
    else:
        assert row["bulk_reduce"] == 0 and any(a.endswith("add.f32") for a in row["atomics"]), row
    if defer_on:
        assert row["wgmma"] > base["wgmma"], (row["wgmma"], base["wgmma"])
    else:
        assert row["wgmma"] == base["wgmma"], (row["wgmma"], base["wgmma"])
    if "ptxas_error" in row:
        pytest.fail(f"ptxas: {row['ptxas_error']}")
    if "spill_stores" not in row:
        pytest.skip("this Triton bundles no ptxas: registers and spills not checked")
    assert row["spill_stores"] <= VARIANT_SPILL_BUDGET[(d, defer_on)], row


def test_dq_variant_options_and_errors():
    """The variants' options: named consistently (DQ_VARIANTS, variant_env), TMA on and defer off by default, checked
    (a non-bool flag, a skip bit the deferred variant does not take, an unknown variant name all raise,
    naming the argument); the bisect plan runs each variant beside a plain default run; the public
    switches reach only the backwards they apply to. Fails if a default flips or a check goes."""
    assert gluon_bwd.DQ_VARIANTS["atomic"] == (False, False)
    assert gluon_bwd.DQ_TMA and not gluon_bwd.DQ_DEFER  # unless the environment says otherwise
    cx = gluon_bwd._constexprs(128, True)
    assert cx["DQ_TMA"] is False and cx["DQ_DEFER"] is False  # the kernel's own defaults: explicit
    assert gluon_bwd._constexprs(64, False, dq_tma=True, dq_defer=True)["DQ_DEFER"] is True
    with pytest.raises(TypeError, match="dq_tma must be True or False"):
        gluon_bwd._constexprs(128, False, dq_tma=1)
    with pytest.raises(ValueError, match="with dq_defer, skip must be one of"):
        gluon_bwd._constexprs(128, False, skip=2, dq_defer=True)
    assert gluon_bwd._constexprs(128, False, skip=17, dq_defer=True)["SKIP"] == 17
    assert gluon_bwd.variant_env("tma-defer") == {"FA4_GLUON_BWD_DQ_TMA": "1", "FA4_GLUON_BWD_DQ_DEFER": "1"}
    with pytest.raises(ValueError, match="dQ variant must be one of"):
        gluon_bwd.variant_env("bulk")
    plan = gluon_bwd.bisect_plan(("atomic", "tma", "tma-defer"))
    assert plan[: len(BISECT)] == [("atomic", s) for s in BISECT]
    assert plan[len(BISECT) :] == [("tma", s) for s in gluon_bwd.VARIANT_BISECT] + [
        ("tma-defer", s) for s in gluon_bwd.VARIANT_BISECT
    ]
    assert gluon_bwd.bisect_plan(("defer",))[0] == ("atomic", 0)
    assert all(s in gluon_bwd.DEFER_SKIPS for s in gluon_bwd.VARIANT_BISECT)
    q = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError, match="bwd_dq_defer applies to bwd='gluon' only"):
        attention_any_d(q, q, q, bwd="fused", bwd_dq_defer=True)
    with pytest.raises(ValueError, match="bwd_dq_tma applies to bwd='fused' or 'gluon' only"):
        attention_any_d(q, q, q, bwd="fa2", bwd_dq_tma=True)


def test_sweep_report_names_the_dq_variant():
    """The sweep's rows say which dQ variant ran (rows from before the variants: the default)."""
    rows = [
        {"d": 128, "causal": True, "dtype": "bf16", "fwd": "gluon", "dq": "tma-defer", "shape": 1,
         "B_Sq_Sk_H_Hkv": [2, 113, 113, 8, 2], "status": "ran", "rel_err_vs_fa2": 1e-4},
        {"d": 64, "causal": False, "dtype": "fp16", "fwd": "gluon", "status": "not run: budget"},
    ]  # fmt: skip
    rep = gluon_bwd.sweep_report(rows, "test", measure_ceilings=False)
    assert [r["dq"] for r in rep.rows] == ["tma-defer", "atomic"]


def test_bench_dq_rows_use_valid_switches():
    """The bench's --gluon-bwd-dq rows: the three variants, each a valid ``attention`` switch set with
    bwd="gluon" (an unknown switch name would fail here, not on the GPU)."""
    from repro.fa4 import Switches
    from repro.fa4.bench import GLUON_BWD_DQ_IMPLS

    flags = {(sw["bwd_dq_tma"], sw["bwd_dq_defer"]) for sw in GLUON_BWD_DQ_IMPLS.values()}
    default = (gluon_bwd.DQ_TMA, gluon_bwd.DQ_DEFER)
    assert flags == {f for f in gluon_bwd.DQ_VARIANTS.values() if f != default}
    for sw in GLUON_BWD_DQ_IMPLS.values():
        assert Switches(**sw).bwd == "gluon"


def test_bench_dq_rows_can_be_chosen_by_name():
    """``--gluon-bwd-dq atomic,defer`` times those two variants only (a variant whose GPU sweep has not
    passed stays out of the process: a fault would take every row down); an unknown name stops the
    bench with the known ones listed."""
    from repro.fa4.bench import gluon_bwd_dq_impls

    assert list(gluon_bwd_dq_impls("atomic, defer")) == [
        "fa4-gluon-gluonbwd-dqatomic",
        "fa4-gluon-gluonbwd-dqdefer",
    ]
    with pytest.raises(SystemExit, match="unknown variant.*'fast'.*known: atomic, defer, tma-defer"):
        gluon_bwd_dq_impls("atomic,fast")
    with pytest.raises(SystemExit, match="unknown variant"):
        gluon_bwd_dq_impls(",")


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("FA4_GLUON_BWD_DQ_TRY") != "1",
    reason="the dQ variants other than the default run only with FA4_GLUON_BWD_DQ_TRY=1 (a fault in an "
    "untried one would end the process's CUDA context and fail every GPU test after it), after "
    "`python -m repro.fa4.gluon_bwd --sweep OUT S matrix VARIANT` (one process per group) has passed",
)
@matrix.FUSED_CLAIM
@pytest.mark.parametrize(
    "variant",
    [
        "atomic",  # the default until 2026-11-27, GPU-tested as such; now the cross-check
        *(
            pytest.param(
                v,
                marks=pytest.mark.xfail(
                    reason=f"{v}: the deferred dQ product was wrong on an H100 (defer's sweep, 2026-11-27)"
                ),
            )
            for v in ("defer", "tma-defer")
        ),
    ],
)
@pytest.mark.parametrize("d, causal, dtype, fwd", GPU_CASES)
def test_gpu_gluon_backward_dq_variant_matrix(d, causal, dtype, fwd, variant, monkeypatch):
    """test_gpu_bwd's matrix (same shapes, fp64 reference, cuDNN's error beside ours, same tolerances)
    with bwd="gluon" running dQ variant ``variant`` (the module flags that attention() takes when its
    switches leave them None). Fails if the bulk reductions add a tile twice, miss one or add the next
    batch's rows, or the deferred product pairs a step's dS with another step's rows."""
    tma_on, defer_on = gluon_bwd.DQ_VARIANTS[variant]
    monkeypatch.setattr(gluon_bwd, "DQ_TMA", tma_on)
    monkeypatch.setattr(gluon_bwd, "DQ_DEFER", defer_on)
    matrix.test_gpu_backward_matrix(d, causal, dtype, "gluon", fwd)
