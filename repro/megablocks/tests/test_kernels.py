"""megablocks/kernels-equal-dense: SDD, DSD, DDS (and the transposed forms) against dense products.

Random block masks (any pattern, empty rows and columns included) on drawn shapes; the dense
side multiplies the zero-filled sparse matrix in fp64. fp32 kernels (IEEE products, fp32
accumulation over at most a few hundred terms): 1e-5 relative, outputs and gradients. fp16:
5e-3 (inputs rounded to 11 bits; fp32 accumulation).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.megablocks import dds, dsd, gmm, sdd, topology_from_mask

CLAIM = "megablocks/kernels-equal-dense"
SECTION = "§5.1 (arXiv v1)"


@st.composite
def sparse_problems(draw):
    b = draw(st.sampled_from([16, 32]))
    R, C = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(R, C, generator=gen) < draw(st.sampled_from([0.3, 0.6, 1.0]))
    topo = topology_from_mask(mask, b)
    n = draw(st.integers(1, 40))  # the dense side's free dimension, any size
    return topo, n, gen


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=10, deadline=None)
@given(problem=sparse_problems(), trans=st.booleans())
def test_sparse_products_equal_dense(problem, trans):
    topo, n, gen = problem
    M, N = topo.shape
    r64 = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    leaf = lambda t: t.float().detach().requires_grad_(True)
    leaf64 = lambda t: t.detach().requires_grad_(True)

    # SDD: mask(A @ B) with A [M, n], B [n, N]
    a, b = r64(M, n), r64(n, N)
    out = sdd(leaf(a), leaf(b), topo)
    a64, b64 = leaf64(a), leaf64(b)
    ref = topo.blocks_of(a64 @ b64)
    assert_rel_close(out, ref, 1e-5, "sdd")
    g = r64(*ref.shape)
    ins = [leaf(a), leaf(b)]
    for got, want, name in zip(
        _grads(sdd(*ins, topo), ins, g.float()), _grads(ref, [a64, b64], g), "ab", strict=True
    ):
        assert_rel_close(got, want, 1e-5, f"sdd d{name}")

    # DSD: op(S) @ B and DDS: A @ op(S), op the identity or the transpose
    data = r64(topo.nnz, topo.block_size, topo.block_size)
    rows, cols = (N, M) if trans else (M, N)
    for kind in ("dsd", "dds"):
        other = r64(cols, n) if kind == "dsd" else r64(n, rows)
        d32, o32 = leaf(data), leaf(other)
        d64, o64 = leaf64(data), leaf64(other)
        S = topo.to_dense(d64)
        S = S.t() if trans else S
        if kind == "dsd":
            out, ref = dsd(d32, o32, topo, transpose=trans), S @ o64
        else:
            out, ref = dds(o32, d32, topo, transpose=trans), o64 @ S
        assert_rel_close(out, ref, 1e-5, f"{kind} transpose={trans}")
        g = r64(*ref.shape)
        for got, want, name in zip(
            _grads(out, [d32, o32], g.float()), _grads(ref, [d64, o64], g), ["data", "dense"], strict=True
        ):
            assert_rel_close(got, want, 1e-5, f"{kind} transpose={trans} d{name}")


@pytest.mark.claim(CLAIM, section=SECTION)
def test_fp16_products():
    gen = torch.Generator().manual_seed(0)
    topo = topology_from_mask(torch.tensor([[True, False], [True, True]]), 16)
    a, b = torch.randn(32, 24, generator=gen), torch.randn(24, 32, generator=gen)
    assert_rel_close(sdd(a.half(), b.half(), topo), topo.blocks_of(a.double() @ b.double()), 5e-3, "fp16 sdd")
    data = torch.randn(topo.nnz, 16, 16, generator=gen)
    c = torch.randn(32, 20, generator=gen)
    S = topo.to_dense(data.double())
    assert_rel_close(dsd(data.half(), c.half(), topo), S @ c.double(), 5e-3, "fp16 dsd")
    assert_rel_close(dds(c.t().half(), data.half(), topo), c.t().double() @ S, 5e-3, "fp16 dds")


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=6, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_gemm_equals_per_group_matmul(counts, n, seed):
    """The grouped path's kernel: rows of group g times W[g], empty groups included; W given
    transposed (strided) as the dMoE passes it."""
    gen = torch.Generator().manual_seed(seed)
    counts_t = torch.tensor(counts)
    K = 24
    x = torch.randn(int(counts_t.sum()), K, generator=gen, dtype=torch.float64)
    w = torch.randn(len(counts), n, K, generator=gen, dtype=torch.float64).transpose(1, 2)
    group = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    x32, w32 = x.float().requires_grad_(True), w.float().detach().requires_grad_(True)
    x64, w64 = x.clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = gmm(x32, w32, counts_t)
    ref = torch.einsum("mk,mkn->mn", x64, w64[group])
    assert_rel_close(y, ref, 1e-5, "gmm")
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    for got, want, name in zip(
        _grads(y, [x32, w32], g.float()), _grads(ref, [x64, w64], g), "xw", strict=True
    ):
        assert_rel_close(got, want, 1e-5, f"gmm d{name}")


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("b", [64, 128])
def test_sparse_products_bf16_on_gpu(b):
    """bf16 kernels at block 64 and 128 on a random pattern (4 x 5 blocks), free dim 200 (off the
    tile): 1e-2 relative against fp32 dense (8 mantissa bits, fp32 accumulation)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = torch.rand(4, 5, generator=gen, device="cuda") < 0.5
    mask[0, 0] = True
    topo = topology_from_mask(mask, b)
    M, N = topo.shape
    a = torch.randn(M, 200, device="cuda", generator=gen)
    w = torch.randn(200, N, device="cuda", generator=gen)
    bf = torch.bfloat16
    assert_rel_close(sdd(a.to(bf), w.to(bf), topo), topo.blocks_of(a @ w), 1e-2, "sdd")
    data = torch.randn(topo.nnz, b, b, device="cuda", generator=gen)
    S = topo.to_dense(data)
    c = torch.randn(N, 200, device="cuda", generator=gen)
    assert_rel_close(dsd(data.to(bf), c.to(bf), topo), S @ c, 1e-2, "dsd")
    assert_rel_close(dsd(data.to(bf), a.to(bf), topo, transpose=True), S.t() @ a, 1e-2, "dsd^T")
    assert_rel_close(dds(a.t().to(bf), data.to(bf), topo), a.t() @ S, 1e-2, "dds")
    assert_rel_close(dds(c.t().to(bf), data.to(bf), topo, transpose=True), c.t() @ S.t(), 1e-2, "dds^T")
