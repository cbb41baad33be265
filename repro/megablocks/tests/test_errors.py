"""Bad input raises ValueError naming the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

from repro.megablocks import dMoE, dmoe_sparse, dsd, gmm, moe_topology, sdd, topology_from_mask


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=24), r"block_size=24 is not supported: expected one of \(16, 32, 64, 128\)"),
        (dict(block_size=256), r"block_size=256 is not supported"),
        (dict(top_k=5), r"top_k=5: expected 1 <= top_k <= num_experts=4"),
        (dict(top_k=0), r"top_k=0"),
        (dict(ffn_hidden_size=40), r"ffn_hidden_size=40 must be a multiple of block_size=16"),
        (dict(mlp="swiglu"), r"mlp='swiglu': expected one of \('mlp', 'glu'\)"),
        (dict(impl="dense"), r"impl='dense': expected one of \('sparse', 'grouped'\)"),
        (dict(num_experts=0, top_k=1), r"num_experts=0"),
    ],
)
def test_module_arguments(kwargs, match):
    args = dict(hidden_size=32, ffn_hidden_size=32, num_experts=4, top_k=2, block_size=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dMoE(**args)


def test_grouped_accepts_any_ffn():
    dMoE(32, 40, 4, 2, impl="grouped")  # no block constraint on the grouped path


def test_forward_shapes():
    layer = dMoE(32, 32, 4, 2, block_size=16)
    with pytest.raises(ValueError, match=r"x must be \[T, 32\] or \[B, S, 32\], got \(3, 16\)"):
        layer(torch.randn(3, 16))


def test_functional_mismatches():
    x = torch.randn(5, 32)
    w = torch.randn(4 * 32, 32)
    idx = torch.zeros(5, 1, dtype=torch.long)
    wt = torch.ones(5, 1)
    with pytest.raises(ValueError, match=r"w1 must be \[num_experts \* ffn_hidden_size, hidden\]"):
        dmoe_sparse(x, wt, idx, torch.randn(4 * 32, 16), w, None, 4, block_size=16)
    with pytest.raises(ValueError, match=r"weights and indices must both be \[T, k\] with T=5"):
        dmoe_sparse(x, wt[:3], idx, w, w, None, 4, block_size=16)
    with pytest.raises(ValueError, match=r"mlp='glu' needs w3"):
        dmoe_sparse(x, wt, idx, w, w, None, 4, mlp="glu", block_size=16)


def test_kernel_argument_checks():
    topo = topology_from_mask(torch.tensor([[True, False], [False, True]]), 16)
    with pytest.raises(ValueError, match=r"does not give the topology's shape \(32, 32\)"):
        sdd(torch.randn(32, 8), torch.randn(8, 48), topo)
    with pytest.raises(
        ValueError, match=r"sparse data must be contiguous of shape \(nnz, b, b\) = \(2, 16, 16\)"
    ):
        dsd(torch.randn(3, 16, 16), torch.randn(32, 4), topo)
    with pytest.raises(ValueError, match=r"has dtype torch.int64"):
        sdd(torch.ones(32, 8, dtype=torch.long), torch.ones(8, 32, dtype=torch.long), topo)
    with pytest.raises(ValueError, match=r"ffn_hidden_size=20 must be a multiple of block_size=16"):
        moe_topology(torch.tensor([16]), 20, 16)
    with pytest.raises(ValueError, match=r"gmm: counts has 2 groups but w has 3"):
        gmm(torch.randn(4, 8), torch.randn(3, 8, 8), torch.tensor([2, 2]))
