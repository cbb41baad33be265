"""The grouped ("swizzled") launch order of the kernels (GPU_CONFIG["group_m"]): a permutation of
the programs, so the values must not change with it. On CPU (Triton's interpreter, 16 x 16 tiles),
on shapes with several row tiles and column tiles that group_m = 3 does not divide: the order
helper itself is a bijection, and SDD, DSD (and its transpose), DDS and the grouped GEMM (forward
and both weight-gradient orientations) equal the fp64 dense products under group_m = 1 and 3, with
bitwise equal results between the two orders (each program computes the same tile either way)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from paperclub.testing import assert_rel_close
from repro.megablocks import dds, dsd, gmm, sdd, topology_from_mask
from repro.megablocks.kernels import _grouped_order, kernel_config
from repro.megablocks.topology import moe_topology

ORDERS = (1, 3)


@triton.jit
def _order_probe(out, num_m, num_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    m, n = _grouped_order(pid, num_m, num_n, GROUP_M)
    tl.store(out + m * num_n + n, pid)


@pytest.mark.parametrize("num_m, num_n", [(7, 5), (1, 4), (4, 1), (6, 3)])
@pytest.mark.parametrize("group_m", [1, 2, 3, 8])
def test_grouped_order_is_a_bijection(num_m, num_n, group_m):
    out = torch.full((num_m * num_n,), -1, dtype=torch.int64)
    _order_probe[(num_m * num_n,)](out, num_m, num_n, GROUP_M=group_m)
    # every tile written exactly once: the programs that wrote are all of them
    assert sorted(out.tolist()) == list(range(num_m * num_n))
    pid = out.view(num_m, num_n)
    if group_m == 1:  # the plain order: column tiles fastest
        assert torch.equal(pid, torch.arange(num_m * num_n).view(num_m, num_n))
    else:  # the first programs walk down the first group's rows in column 0
        first = min(group_m, num_m)
        assert pid[:first, 0].tolist() == list(range(first))


def _topologies():
    # the dMoE's: 7 block-rows (experts of 3, 2 and 2 block-rows), 3 blocks each, block-diagonal;
    # and a random pattern (empty rows and columns possible) of 5 x 6 blocks
    uniform = moe_topology(torch.tensor([48, 32, 32]), 48, 16)
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) < 0.5
    mask[0, 0] = mask[4, 5] = True
    return {"moe": uniform, "random": topology_from_mask(mask, 16)}


@pytest.mark.parametrize("kind", ["moe", "random"])
def test_sparse_products_independent_of_launch_order(kind):
    topo = _topologies()[kind]
    M, N = topo.shape
    gen = torch.Generator().manual_seed(0)
    r64 = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    a, b = r64(M, 24), r64(24, N)
    data = r64(topo.nnz, 16, 16)
    S = topo.to_dense(data)
    c, e = r64(N, 40), r64(M, 36)  # 40 and 36 columns: 3 tiles of 16 each, the last one partial
    refs = {
        "sdd": topo.blocks_of(a @ b),
        "dsd": S @ c,
        "dsd^T": S.t() @ e,
        "dds": e.t() @ S,
        "dds^T": c.t() @ S.t(),
    }
    got = {}
    for group_m in ORDERS:
        with kernel_config(group_m=group_m):
            d32 = data.float()
            got[group_m] = {
                "sdd": sdd(a.float(), b.float(), topo),
                "dsd": dsd(d32, c.float(), topo),
                "dsd^T": dsd(d32, e.float(), topo, transpose=True),
                "dds": dds(e.t().float(), d32, topo),
                "dds^T": dds(c.t().float(), d32, topo, transpose=True),
            }
        for name, ref in refs.items():
            assert_rel_close(got[group_m][name], ref, 1e-5, f"{kind} {name} group_m={group_m}")
    for name in refs:
        assert torch.equal(got[1][name], got[3][name]), f"{kind} {name}: group_m=1 and 3 differ"


def test_grouped_gemm_independent_of_launch_order():
    """7 row tiles (an empty group among them) x 4 n-tiles forward; the weight gradients over
    3 k-tiles x 4 n-tiles (w contiguous) and 4 x 3 (w a transposed view, as the dMoE's W1)."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([40, 0, 37, 9])
    group = torch.repeat_interleave(torch.arange(4), counts)
    K, N = 40, 56
    x = torch.randn(int(counts.sum()), K, generator=gen, dtype=torch.float64)
    g = torch.randn(x.shape[0], N, generator=gen, dtype=torch.float64)
    ws = {
        "w": torch.randn(4, K, N, generator=gen, dtype=torch.float64),
        "w^T view": torch.randn(4, N, K, generator=gen, dtype=torch.float64).transpose(1, 2),
    }
    for name, w in ws.items():
        x64, w64 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref = torch.einsum("mk,mkn->mn", x64, w64[group])
        ref_dx, ref_dw = torch.autograd.grad(ref, [x64, w64], g)
        got = {}
        for group_m in ORDERS:
            x32 = x.float().requires_grad_(True)
            w32 = w.float().detach().requires_grad_(True)
            with kernel_config(group_m=group_m):
                y = gmm(x32, w32, counts)
                dx, dw = torch.autograd.grad(y, [x32, w32], g.float())
            got[group_m] = (y, dx, dw)
            for out, want, what in zip(got[group_m], (ref, ref_dx, ref_dw), ("y", "dx", "dw"), strict=True):
                assert_rel_close(out, want, 1e-5, f"gmm {name} {what} group_m={group_m}")
        for u, v, what in zip(got[1], got[3], ("y", "dx", "dw"), strict=True):
            assert torch.equal(u, v), f"gmm {name} {what}: group_m=1 and 3 differ"


def test_group_m_must_be_positive():
    x, w = torch.randn(20, 16), torch.randn(1, 16, 16)
    with kernel_config(group_m=0), pytest.raises(ValueError, match="group_m"):
        gmm(x, w, torch.tensor([20]))
