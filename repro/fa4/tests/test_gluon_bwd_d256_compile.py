"""The Gluon backward at head size 256 (``repro.fa4.gluon_bwd``'s ``_gluon_bwd_d256_kernel``, issue #42),
compiled offline for sm_90a on the CPU as ``test_gluon_bwd`` compiles the D 64/128 kernel: its launches
at D = 256 (bf16 and fp16, causal or not; dQ by TMA bulk reductions, the launcher's default, and by
atomics for bf16) must compile to wgmma and TMA loads, fit Hopper's 227 KiB of shared memory per
block, give the load warp its registers (setmaxnreg 24) and stay within SPILL_BUDGET. The GPU check is
``repro.fa4.lab.gluon_bwd_d256_check``.
"""

from __future__ import annotations

import pytest

from paperclub.lab import HOPPER_SMEM_PER_BLOCK
from repro.fa4.gluon_bwd import D256_TMA_STAGES, GLUON_BWD_DEFAULTS, _constexprs
from repro.fa4.tests.test_gluon_bwd import _case_id, compile_cases, needs_gluon

#: (D, causal, dtype), dq: the four launches with the default dQ (TMA) and the atomic cross-check in bf16
CASES = [((256, c, t), "tma") for c in (False, True) for t in ("bf16", "fp16")] + [
    ((256, c, "bf16"), "atomic") for c in (False, True)
]
#: Spilled bytes (ptxas stores) allowed, as compiled on 2026-12-01 (Triton 3.6): 0 with the TMA dQ
#: and no mask, 4 (one scalar of the dV consumer, the default partition, at its S^T product) causal,
#: 12 / 4 with the atomics. A change that spills more should say why.
SPILL_BUDGET = {("tma", False): 0, ("tma", True): 4, ("atomic", False): 12, ("atomic", True): 4}


@pytest.fixture(scope="module")
def compile_rows(tmp_path_factory) -> dict:
    """CASES compiled offline for sm_90a in one subprocess."""
    return compile_cases(CASES, tmp_path_factory)


@needs_gluon
@pytest.mark.parametrize("case, dq", CASES, ids=[_case_id(c, dq) for c, dq in CASES])
def test_gluon_backward_d256_compiles_for_sm90(compile_rows, case, dq):
    row = compile_rows[(case, dq)]
    print(row)
    assert "error" not in row, row["error"]
    assert row["target_ok"] and row["wgmma"] > 0 and row["tma_loads"] > 0, row
    assert 24 in row["setmaxnreg"], row
    assert 0 < row["shared"] <= HOPPER_SMEM_PER_BLOCK, f"shared memory {row['shared']} B > 227 KiB"
    if dq == "tma":
        assert row["atomic_count"] == 0 and row["bulk_reduce"] >= 2, row
    else:
        assert row["bulk_reduce"] == 0 and any(a.endswith("add.f32") for a in row["atomics"]), row
    if "ptxas_error" in row:
        pytest.fail(f"ptxas: {row['ptxas_error']}")
    if "spill_stores" not in row:
        pytest.skip("this Triton bundles no ptxas: registers and spills not checked")
    assert row["spill_stores"] <= SPILL_BUDGET[(dq, case[1])], row


def test_gluon_backward_d256_launch_choices():
    """D = 256: 64 keys per program; two Q/dO stages with the atomic dQ, D256_TMA_STAGES with the bulk
    reductions (their staging tiles leave room for one); block_m 64 only."""
    assert 256 in GLUON_BWD_DEFAULTS
    cx = _constexprs(256, True, dq_tma=False)
    assert (cx["BLOCK_N"], cx["BLOCK_M"], cx["NUM_STAGES"]) == (64, 64, 2)
    assert _constexprs(256, False)["NUM_STAGES"] == D256_TMA_STAGES == 1
    assert _constexprs(128, False)["BLOCK_N"] == 128
    with pytest.raises(ValueError, match="block_m = 64 only"):
        _constexprs(256, False, block_m=128)
    with pytest.raises(ValueError, match=r"expected one of \(64, 128, 256\)"):
        _constexprs(192, False)
