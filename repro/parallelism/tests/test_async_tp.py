"""Claims of wang2023overlap: the all-gather + matmul and matmul + reduce-scatter pairs decompose into
ring steps (transfer of one block while the matmul of another runs) that compute the same results; the
sequence-parallel layer built on the decomposed pairs (async tensor parallelism) equals the plain one.

Groups of 1-4 ranks (3 included: nothing assumes a power of two). float64, tolerance common.TOL64:
the gathered operand and the all-gather + matmul are the same products row for row, the reduce-scatter
adds the t partial sums in another order.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.parallelism.tests import worker
from repro.parallelism.tests.common import SETTINGS, TOL64, check_sequence_parallel, layer_cases
from repro.parallelism.tests.worker import MatmulCase


@st.composite
def matmul_cases(draw) -> MatmulCase:
    return MatmulCase(
        seed=draw(st.integers(0, 2**16)),
        m=draw(st.integers(1, 4)),
        b=draw(st.integers(1, 2)),
        k=draw(st.integers(1, 8)),
        n=draw(st.integers(1, 8)),
        t=draw(st.integers(1, 4)),
    )


@pytest.mark.claim(
    "parallelism/decomposition-exact",
    section="Decomposition: AllGather + Einsum, Einsum + ReduceScatter (ASPLOS 2023)",
)
@settings(max_examples=10, **SETTINGS)
@given(case=matmul_cases())
def test_decomposed_collective_matmuls_equal_the_plain_pairs(world4, case):
    """Per rank: the gathered A and A W (all-gather + matmul) and sum_q P_q W_q, this rank's rows
    (matmul + reduce-scatter), decomposed and plain, against the products computed here; the decomposed
    forms send t - 1 ring steps each and run no collective."""
    results = [r for r in world4.run(worker.run_decomposition, case, timeout=90) if r is not None]
    assert len(results) == case.t
    inputs = [worker.matmul_inputs(case, r) for r in range(case.t)]
    a = inputs[0][0]
    total = sum(p @ w for _, p, w in inputs)  # every rank's partial product, summed
    m = case.m
    for rank, r in enumerate(results):
        w = inputs[rank][2]
        for form in ("plain", "decomposed"):
            got = r[form]
            assert torch.equal(got["a"], a), f"{form} gathered A, rank {rank} ({case})"
            assert_rel_close(got["ag"], a @ w, TOL64, f"{form} all-gather + matmul, rank {rank} ({case})")
            want = total[rank * m : (rank + 1) * m]
            assert_rel_close(got["rs"], want, TOL64, f"{form} matmul + reduce-scatter, rank {rank} ({case})")
        if case.t > 1:
            assert r["plain"]["counts"] == {"all_gather/fwd": 1, "reduce_scatter/fwd": 1}
            assert r["decomposed"]["counts"] == {"ring_shift/fwd": 2 * (case.t - 1)}


@pytest.mark.claim(
    "parallelism/decomposition-exact",
    section="Decomposition: AllGather + Einsum, Einsum + ReduceScatter (ASPLOS 2023)",
)
@settings(max_examples=4, **SETTINGS)
@given(case=layer_cases(ts=(2, 4)))
def test_async_tp_layer_equals_unsharded(world4, case):
    """The sequence-parallel layer with every all-gather + matmul and matmul + reduce-scatter decomposed
    (forward and backward) equals the unsharded layer, and communicates only by ring steps except the
    backward's re-gathering of the column-parallel inputs (2 all-gathers)."""
    for r in check_sequence_parallel(world4, case, overlap=True):
        steps = case.t - 1
        assert r["fwd"] == {"ring_shift/fwd": 4 * steps}, r["fwd"]
        assert r["bwd"] == {"ring_shift/bwd": 4 * steps, "all_gather/bwd": 2}, r["bwd"]
