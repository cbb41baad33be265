"""Strategies and single-device references shared by the claim tests (run in the pytest process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.parallelism.megatron import shard_weights
from repro.parallelism.reference import (
    LayerWeights,
    attention_core,
    merge_heads,
    reference_layer,
    split_heads,
)
from repro.parallelism.tests import worker
from repro.parallelism.tests.worker import LayerCase, layer_inputs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# float64 shards against the float64 reference: the only differences are the order of the
# all-reduce / reduce-scatter additions (t <= 4 terms) and of the matmuls' blocking, ~1e-16 relative;
# 1e-10 leaves room for cancellation in small gradients without hiding a wrong shard (O(1) errors).
TOL64 = 1e-10


@st.composite
def layer_cases(draw, ts=(1, 2, 4), dtype="float64", p_drop=0.0) -> LayerCase:
    """A small layer on t ranks: heads a multiple of t, s a multiple of t (for sequence parallelism)."""
    t = draw(st.sampled_from(ts))
    heads = t * draw(st.integers(1, 2))
    d = draw(st.sampled_from([1, 2, 4]))
    return LayerCase(
        seed=draw(st.integers(0, 2**16)),
        s=t * draw(st.integers(1, 3)),
        b=draw(st.integers(1, 2)),
        h=heads * d,
        heads=heads,
        t=t,
        dtype=dtype,
        p_drop=p_drop,
    )


def reference_block(case: LayerCase, block: str) -> dict:
    """The unsharded block's output and gradients (input and every weight) on the case's inputs."""
    x, dy, w = layer_inputs(case)
    x = x.clone().requires_grad_(True)
    if block == "mlp":
        y = F.gelu(x @ w.w_1 + w.b_1) @ w.w_2 + w.b_2
    elif block == "attention":
        q, k, v = split_heads(x @ w.w_qkv + w.b_qkv, case.heads)
        y = merge_heads(attention_core(q, k, v, case.p_drop)) @ w.w_o + w.b_o
    else:
        y = reference_layer(x, w, case.heads, case.p_drop)
    y.backward(dy)
    grads = LayerWeights(*(t.grad if t.grad is not None else torch.zeros_like(t) for t in w.tensors()))
    return {"y": y.detach(), "dx": x.grad, "grads": grads}


def expected_shard_grads(ref: dict, case: LayerCase, rank: int) -> dict[str, torch.Tensor]:
    """The reference's weight gradients cut as rank ``rank``'s shard is (replicated ones whole)."""
    shard = shard_weights(ref["grads"], case.heads, rank, case.t)
    return {n: t.detach() for n, t in zip(shard.names(), shard.tensors(), strict=True)}


REPLICATED = ("ln1_w", "ln1_b", "b_o", "ln2_w", "ln2_b", "b_2")


def check_sequence_parallel(world4, case, overlap: bool) -> list[dict]:
    """Run the layer on t ranks; the concatenated output shards, input-gradient shards, sharded weight
    gradients and the summed replicated gradients must equal the unsharded layer's."""
    results = [
        r for r in world4.run(worker.run_sequence_parallel, case, overlap, timeout=90) if r is not None
    ]
    assert len(results) == case.t
    ref = reference_block(case, "layer")
    assert_rel_close(torch.cat([r["y"] for r in results]), ref["y"], TOL64, f"output ({case})")
    assert_rel_close(torch.cat([r["dx"] for r in results]), ref["dx"], TOL64, f"input gradient ({case})")
    for name in results[0]["grads"]:
        if name in REPLICATED:  # each rank saw its own tokens: the parts add up to the whole
            got = sum(r["grads"][name] for r in results)
            assert_rel_close(got, expected_shard_grads(ref, case, 0)[name], TOL64, f"d{name} summed ({case})")
        else:
            for rank, r in enumerate(results):
                want = expected_shard_grads(ref, case, rank)[name]
                assert_rel_close(r["grads"][name], want, TOL64, f"d{name}, rank {rank} ({case})")
    return results
