"""Claims of korthikanti2022reducing (§4): sequence parallelism equals the unsharded layer with
all-gathers and reduce-scatters in place of the all-reduces, and the per-layer activation memory of §4
is what the autograd graph keeps, byte for byte.

Exactness in float64 (common.TOL64). Memory in bfloat16 with dropout on (the paper's setting: 16-bit
activations, 1-byte masks), measured by SavedActivations on every rank and compared with the formula
exactly (integers).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from repro.parallelism.sequence_parallel import activation_bytes
from repro.parallelism.tests import worker
from repro.parallelism.tests.common import SETTINGS, check_sequence_parallel, layer_cases


@pytest.mark.claim("parallelism/sp-exact", section="§4.2.2 (arXiv v1)")
@settings(max_examples=6, **SETTINGS)
@given(case=layer_cases())
def test_sequence_parallel_layer_equals_unsharded(world4, case):
    check_sequence_parallel(world4, case, overlap=False)


@pytest.mark.claim("parallelism/sp-collectives", section="§4.2.2 (arXiv v1)")
@settings(max_examples=4, **SETTINGS)
@given(case=layer_cases(ts=(2, 4)))
def test_sequence_parallel_collectives(world4, case):
    """Forward: 2 all-gathers + 2 reduce-scatters, no all-reduce. Backward: 2 reduce-scatters, 2
    all-gathers (the reduce-scatters' conjugates) and 2 more (the column-parallel inputs gathered again)."""
    for r in check_sequence_parallel(world4, case, overlap=False):
        assert r["fwd"] == {"all_gather/fwd": 2, "reduce_scatter/fwd": 2}, r["fwd"]
        assert r["bwd"] == {"all_gather/bwd": 4, "reduce_scatter/bwd": 2}, r["bwd"]


@pytest.mark.claim("parallelism/activation-memory", section="§4.1-4.2.2 (arXiv v1)")
@settings(max_examples=8, **SETTINGS)
@given(case=layer_cases(dtype="bfloat16", p_drop=0.1))
def test_activation_memory_matches_the_formulas(world4, case):
    """Per rank: s b h (34 + 5as/h) at t = 1, s b h (10 + 24/t + 5as/(ht)) with tensor parallelism and
    s b h (34 + 5as/h) / t with sequence parallelism; the layer norms' statistics (two per norm and
    token, which the paper leaves out) are counted apart."""
    for sp in (False, True):
        results = [r for r in world4.run(worker.measure_activations, case, sp, timeout=90) if r is not None]
        want = activation_bytes(case.s, case.b, case.h, case.heads, case.t, sequence_parallel=sp)
        tokens = case.s // case.t if sp else case.s
        for rank, r in enumerate(results):
            assert r["bytes"] == want, f"rank {rank}, sequence_parallel={sp}: {r['bytes']} != {want} ({case})"
            assert r["stats_elements"] == 2 * 2 * tokens * case.b
    if case.t > 1:  # sequence parallelism divides the 10 s b h that tensor parallelism leaves whole
        tp = activation_bytes(case.s, case.b, case.h, case.heads, case.t, sequence_parallel=False)
        sp_ = activation_bytes(case.s, case.b, case.h, case.heads, case.t, sequence_parallel=True)
        assert tp - sp_ == 10 * case.s * case.b * case.h * (case.t - 1) // case.t
