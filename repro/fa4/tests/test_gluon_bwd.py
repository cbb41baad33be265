"""The warp-specialised Gluon backward (``bwd="gluon"``, ``repro.fa4.gluon_bwd``).

Gluon kernels do not run under TRITON_INTERPRET, so on the CPU the kernel is compiled offline for
sm_90a (``repro.fa4.lab.compile`` through ``paperclub.lab.offline``: Triton's compiler and its bundled
ptxas need no GPU) at D 64/128, causal or not, bf16/fp16, with either dQ accumulation (TMA bulk
reductions, the default; fp32 atomics, the cross-check): each must compile to wgmma and TMA loads,
add dQ the way it says, fit the H100's 227 KiB of shared memory per block and stay within its spill
budget. ``bwd="gluon"`` must be refused, with a reason, where it cannot run. The tests marked ``gpu``
run ``test_gpu_bwd``'s matrix (same shapes, fp64 reference, cuDNN's error beside ours) with
``bwd="gluon"``, behind the Triton and the Gluon forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from paperclub.lab import CPU_JOBS, offline
from paperclub.triton_compat import interpreting
from repro.fa4 import attention_any_d, gluon_bwd
from repro.fa4.gluon_bwd import check_device, gluon_attention_backward
from repro.fa4.gluon_fwd import HAS_GLUON
from repro.fa4.tests import test_gpu_bwd as matrix

needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon)")
from paperclub.lab import HOPPER_SMEM_PER_BLOCK as H100_SMEM_PER_BLOCK  # noqa: E402

#: Spilled bytes (ptxas, stores) allowed per head dim, as compiled on 2026-11-25 / -26 (Triton 3.6):
#: none at D = 64; at D = 128 44 (causal 92) bytes of scalars with the atomic adds, 24 / 96 with the
#: bulk reductions, where the Triton one-pass kernel spills 630-780 bytes of its dK/dV tiles. A change
#: that spills more should say why.
SPILL_BUDGET = {64: 0, 128: 128}
#: The compiled cases: (D, causal, dtype) x the two ways of adding dQ.
COMPILE_CASES = [[d, c, t] for d in SPILL_BUDGET for c in (False, True) for t in ("bf16", "fp16")]
DQ = {"tma": True, "atomic": False}


def _case_id(case, dq):
    d, causal, dtype = case
    return f"{dq}-d{d}-{'causal' if causal else 'full'}-{dtype}"


CASES = [(tuple(c), dq) for dq in DQ for c in COMPILE_CASES]


def compile_cases(cases, tmp_path_factory) -> dict:
    """((D, causal, dtype), dq) cases compiled offline for sm_90a (paperclub.lab.offline, one
    process per CPU): case -> compile report row."""
    specs = [dict(kernel="gluon_bwd", d=d, causal=c, dtype=t, dq_tma=DQ[dq]) for (d, c, t), dq in cases]
    rows = offline(
        "repro.fa4.lab.compile:checks",
        specs,
        cache_dir=tmp_path_factory.mktemp("triton-cache"),
        jobs=CPU_JOBS,
    )
    return {key: row for key, row in zip(cases, rows, strict=True)}


@pytest.fixture(scope="module")
def compile_rows(tmp_path_factory) -> dict:
    """COMPILE_CASES x DQ compiled offline for sm_90a."""
    return compile_cases(CASES, tmp_path_factory)


@needs_gluon
@pytest.mark.parametrize("case, dq", CASES, ids=[_case_id(c, dq) for c, dq in CASES])
def test_gluon_backward_compiles_for_sm90(compile_rows, case, dq):
    """Each way of adding dQ compiles for sm_90a and does what it says in the PTX. dq "tma" (the
    default): every dQ add is a TMA tensor bulk reduction (``cp.reduce.async.bulk.tensor ... add``, at
    least one per consumer, each committed as a bulk group and waited on before its staging tile is
    rewritten), no ``red``/``atom.global`` left, and the staging tiles' shared memory on top of the
    atomic form's; dq "atomic" (the cross-check): per-element fp32 atomic adds, no bulk reduction.
    Both issue the same wgmma. Fails if the reduction falls back to atomics, is never waited on, on a
    compile error, more than 227 KiB of shared memory or spills over budget."""
    d = case[0]
    row = compile_rows[(case, dq)]
    print(row)
    assert "error" not in row, row["error"]
    assert row["target_ok"] and row["wgmma"] > 0 and row["tma_loads"] > 0, row
    assert 24 in row["setmaxnreg"], row  # the load warp gives its registers to the consumers
    assert 0 < row["shared"] <= H100_SMEM_PER_BLOCK, f"shared memory {row['shared']} B > 227 KiB"
    if dq == "tma":
        base = compile_rows[(case, "atomic")]
        assert row["atomic_count"] == 0 and row["atomics"] == [], (
            f"atomics left beside the bulk reductions: {row}"
        )
        assert row["bulk_reduce"] >= 2, row
        kinds = row["bulk_reduce_kinds"]
        assert all(".tensor." in k and ".add" in k and "global.shared::cta" in k for k in kinds), row
        assert row["bulk_commit"] >= row["bulk_reduce"] and row["bulk_wait"] > row["bulk_reduce"], row
        # the staging tiles: 2 consumers x BLOCK_M x D/2 fp32 beyond the atomic form's shared memory
        assert row["shared"] >= base["shared"] + 2 * 64 * (d // 2) * 4, (row["shared"], base["shared"])
        assert row["wgmma"] == base["wgmma"], (row["wgmma"], base["wgmma"])
    else:
        assert row["bulk_reduce"] == 0 and any(a.endswith("add.f32") for a in row["atomics"]), row
    if "ptxas_error" in row:
        pytest.fail(f"ptxas: {row['ptxas_error']}")
    if "spill_stores" not in row:
        pytest.skip("this Triton bundles no ptxas: registers and spills not checked")
    assert row["spill_stores"] <= SPILL_BUDGET[d], row


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
    with pytest.raises(TypeError, match="dq_tma must be True or False"):
        _constexprs(128, False, dq_tma=1)


# --------------------------------------------------------------------------------------------
# H100: test_gpu_bwd's matrix with bwd="gluon" (its test body, called, not collected twice).
# --------------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param(
        d, causal, dtype, fwd, id=f"d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}-gluon-{fwd}"
    )
    for d in (64, 128, 256)
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
        ("cuda", (9, 0), torch.bfloat16, 256, True, "gluon"),  # the 256 tile (D 129-256 padded)
        ("cuda", (9, 0), torch.float32, 128, True, "fused"),  # fp32: the Triton backwards only
        ("cuda", (9, 0), torch.bfloat16, 32, False, "fa2"),  # D 32: not a Gluon head dim
        ("cuda", (8, 0), torch.bfloat16, 128, True, "fused"),  # not Hopper
        ("cuda", (10, 0), torch.bfloat16, 128, False, "fa2"),
        ("cpu", None, torch.bfloat16, 128, True, "fused"),  # the interpreter
    ],
)
def test_auto_backward_picks_gluon_only_on_hopper(device, cap, dtype, d, causal, want, monkeypatch):
    """bwd="auto" is the Gluon backward exactly where it runs (sm_90, bf16/fp16, tiles 64/128/256), else the
    faster Triton backward by causality; a Triton without Gluon sends Hopper back to those."""
    from types import SimpleNamespace

    from repro.fa4 import auto_backward

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(gluon_bwd, "HAS_GLUON", True)
    q = SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 8, 2, d))
    assert auto_backward(q, causal) == want
    monkeypatch.setattr(gluon_bwd, "HAS_GLUON", False)
    assert auto_backward(q, causal) == ("fused" if causal else "fa2")


@pytest.mark.parametrize("s_q", [1, 64, 113, 1000, 2048])
def test_pad_stats_aligns_every_tma_box(s_q):
    """pad_stats: each head's LSE / delta row padded to whole 64-entry tiles, values kept, so that the
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
# dQ accumulation: TMA bulk reductions (the default) or fp32 atomics (the cross-check)
# --------------------------------------------------------------------------------------------


def test_dq_options_and_errors():
    """The dQ options: TMA on by default, atomics by ``dq_tma=False`` / ``bwd_dq_tma=False``; a non-bool
    flag raises naming it; the switch reaches only the backwards it applies to; the removed deferred
    product is refused by name, with its reason, whatever the backward. Fails if a default flips or a
    check goes."""
    assert gluon_bwd.DQ_TMA is True
    assert gluon_bwd._constexprs(128, True)["DQ_TMA"] is True
    assert gluon_bwd._constexprs(64, False, dq_tma=False)["DQ_TMA"] is False
    q = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError, match="bwd_dq_tma applies to bwd='fused' or 'gluon' only"):
        attention_any_d(q, q, q, bwd="fa2", bwd_dq_tma=True)
    for bwd in ("gluon", "fused", "fa2"):
        with pytest.raises(ValueError, match="bwd_dq_defer: .*wrong dQ on an H100"):
            attention_any_d(q, q, q, bwd=bwd, bwd_dq_defer=True)


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("FA4_GLUON_BWD_DQ_TRY") != "1",
    reason="the atomic-add cross-check of the Gluon backward runs only with FA4_GLUON_BWD_DQ_TRY=1 (16 more "
    "GPU cases; it was the default, GPU-tested as such, until 2026-11-27)",
)
@matrix.FUSED_CLAIM
@pytest.mark.parametrize("d, causal, dtype, fwd", GPU_CASES)
def test_gpu_gluon_backward_atomic_dq_matrix(d, causal, dtype, fwd):
    """test_gpu_bwd's matrix (same shapes, fp64 reference, cuDNN's error beside ours, same tolerances)
    with bwd="gluon" adding dQ by fp32 atomics (``bwd_dq_tma=False``). Fails if an atomic add misses a
    tile, adds one twice or adds the next batch's rows."""
    matrix.test_gpu_backward_matrix(d, causal, dtype, "gluon", fwd, extra={"bwd_dq_tma": False})
