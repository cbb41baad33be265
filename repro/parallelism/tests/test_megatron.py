"""Claims of Megatron-LM (shoeybi2019megatron §3): the tensor-parallel MLP and attention blocks equal the
unsharded blocks, forward and backward, with one all-reduce per block in each pass (two per layer).

Tensor-parallel groups of 1, 2 and 4 ranks of the session's gloo world; float64 throughout, tolerance
common.TOL64 (only the all-reduce's order of additions differs from the reference).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from paperclub.testing import assert_rel_close
from repro.parallelism.tests import worker
from repro.parallelism.tests.common import SETTINGS, TOL64, expected_shard_grads, layer_cases, reference_block


def check_block(world4, case, block: str) -> list[dict]:
    results = [r for r in world4.run(worker.run_tensor_parallel, case, block, timeout=90) if r is not None]
    assert len(results) == case.t
    ref = reference_block(case, block)
    for rank, r in enumerate(results):
        # every rank ends with the whole block's output and the whole input gradient (after f's all-reduce)
        assert_rel_close(r["y"], ref["y"], TOL64, f"{block} output, rank {rank} ({case})")
        assert_rel_close(r["dx"], ref["dx"], TOL64, f"{block} input gradient, rank {rank} ({case})")
        want = expected_shard_grads(ref, case, rank)
        for name, got in r["grads"].items():
            assert_rel_close(got, want[name], TOL64, f"{block} d{name}, rank {rank} ({case})")
    return results


@pytest.mark.claim("parallelism/megatron-mlp-exact", section="§3, Fig. 3a (arXiv v4)")
@settings(max_examples=6, **SETTINGS)
@given(case=layer_cases())
def test_tensor_parallel_mlp_equals_unsharded(world4, case):
    """GeLU(X A_i) B_i on each rank, summed by one all-reduce (g); the backward's one all-reduce (f)."""
    results = check_block(world4, case, "mlp")
    for r in results:
        assert set(r["grads"]) == {"w_1", "b_1", "w_2", "b_2"}
        want = {"all_reduce/fwd": 1} if case.t > 1 else {}
        assert r["fwd"] == want and r["bwd"] == ({"all_reduce/bwd": 1} if case.t > 1 else {})


@pytest.mark.claim("parallelism/megatron-attention-exact", section="§3, Fig. 3b (arXiv v4)")
@settings(max_examples=6, **SETTINGS)
@given(case=layer_cases())
def test_tensor_parallel_attention_equals_unsharded(world4, case):
    """Each rank its a/t heads: column-parallel Q, K, V, row-parallel output projection, one all-reduce."""
    results = check_block(world4, case, "attention")
    for r in results:
        assert set(r["grads"]) == {"w_qkv", "b_qkv", "w_o", "b_o"}
        assert r["fwd"] == ({"all_reduce/fwd": 1} if case.t > 1 else {})
        assert r["bwd"] == ({"all_reduce/bwd": 1} if case.t > 1 else {})


@pytest.mark.claim("parallelism/megatron-two-allreduces", section="§3, Fig. 4 (arXiv v4)")
@settings(max_examples=5, **SETTINGS)
@given(case=layer_cases(ts=(2, 4)))
def test_layer_runs_two_allreduces_each_way(world4, case):
    """A whole layer (layer norms, residuals): equal to the unsharded layer, and exactly two all-reduces
    in the forward and two in the backward are counted on every rank, nothing else."""
    for r in check_block(world4, case, "layer"):
        assert r["fwd"] == {"all_reduce/fwd": 2}, r["fwd"]
        assert r["bwd"] == {"all_reduce/bwd": 2}, r["bwd"]
