"""The fused gather / combine / SwiGLU kernels (repro/megablocks/glue.py) against PyTorch ops.

They are the dMoE's permutation and un-permutation (claim megablocks/dropless: every chosen
(token, expert) pair reaches its expert and comes back with its router weight), so they are checked
over random routings, with padding (block sizes > 1) and without, k = 1 and T = 1, every float dtype
(bf16 first: the interpreter's bf16 is patched), forward and gradients.

Tolerances: expand is a copy (exact); its gradient sums k rows in fp32 and rounds once, the
reference sums in fp32 too (exact up to the final rounding: 1 ulp of the dtype). combine and its
weight gradient accumulate in fp32 against an fp32 reference: a dtype's rounding of the result
(bf16 2^-8, fp16 2^-11 relative) plus fp32 summation order, as a relative Frobenius error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.megablocks.glue import combine, expand, slot_rows, swiglu
from repro.megablocks.kernels import kernel_config
from repro.megablocks.topology import permute

CLAIM = "megablocks/dropless"
SECTION = "§4 (arXiv v1)"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@st.composite
def routings(draw):
    T = draw(st.integers(1, 9))
    E = draw(st.integers(1, 5))
    k = draw(st.integers(1, E))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    skew = draw(st.booleans())  # everything to the same few experts
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if skew:
        idx = torch.stack([torch.arange(k) for _ in range(T)])
    return idx, E, draw(st.sampled_from([1, 4])), draw(st.integers(1, 40)), seed


def _rows(idx, E, bs):
    perm = permute(idx, E, bs)
    return perm, slot_rows(perm.order, perm.dest, *idx.shape)


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@settings(max_examples=6, deadline=None)
@given(case=routings())
def test_expand_and_combine_equal_indexing(dtype, case):
    idx, E, bs, d, seed = case
    T, k = idx.shape
    perm, rows = _rows(idx, E, bs)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen).to(dtype).requires_grad_(True)
    xs = expand(x, rows, perm.padded_rows)
    want = x.new_zeros(perm.padded_rows, d).index_put((perm.dest,), x[perm.token])
    assert torch.equal(xs, want), "expand: rows differ from the indexing gather (padding rows must be zero)"
    g = torch.randn(xs.shape, generator=gen).to(dtype)
    (dx,) = torch.autograd.grad(xs, x, g)
    assert_rel_close(dx, g.float()[rows].sum(1), TOL[dtype], "expand: dx")

    y = torch.randn(perm.padded_rows, d, generator=gen).to(dtype).requires_grad_(True)
    w = torch.rand(T, k, generator=gen).to(dtype).requires_grad_(True)
    out = combine(y, rows, w)
    yf, wf = (t.detach().float().requires_grad_(True) for t in (y, w))
    ref = (wf[..., None] * yf[rows]).sum(1)
    assert_rel_close(out, ref, TOL[dtype], "combine: output")
    go = torch.randn(out.shape, generator=gen).to(dtype)
    dy, dw = torch.autograd.grad(out, (y, w), go)
    dy_ref, dw_ref = torch.autograd.grad(ref, (yf, wf), go.float())
    assert_rel_close(dy, dy_ref, TOL[dtype], "combine: dy")
    pad = torch.ones(perm.padded_rows, dtype=torch.bool)
    pad[perm.dest] = False
    assert not dy[pad].any(), "combine: padding rows got a gradient"
    assert_rel_close(dw, dw_ref, TOL[dtype] * 2, "combine: d weights")


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_swiglu_equals_silu_times_up(dtype):
    gen = torch.Generator().manual_seed(3)
    h1 = (3 * torch.randn(5, 7, 9, generator=gen)).to(dtype).requires_grad_(True)  # off the block size
    h3 = torch.randn(5, 7, 9, generator=gen).to(dtype).requires_grad_(True)
    a = swiglu(h1, h3)
    h1f, h3f = (t.detach().float().requires_grad_(True) for t in (h1, h3))
    ref = F.silu(h1f) * h3f
    assert_rel_close(a, ref, TOL[dtype], "swiglu")
    g = torch.randn(a.shape, generator=gen).to(dtype)
    d1, d3 = torch.autograd.grad(a, (h1, h3), g)
    r1, r3 = torch.autograd.grad(ref, (h1f, h3f), g.float())
    assert_rel_close(d1, r1, TOL[dtype], "swiglu: dh1")
    assert_rel_close(d3, r3, TOL[dtype], "swiglu: dh3")


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
def test_fused_glue_equals_indexing_path(impl):
    """The layer with the fused kernels equals the layer with PyTorch's indexing ops (fp32)."""
    from repro.megablocks.moe import dmoe_grouped, dmoe_sparse

    gen = torch.Generator().manual_seed(5)
    T, E, k, d, f = 11, 4, 2, 24, 32
    x = torch.randn(T, d, generator=gen, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=gen), -1).requires_grad_(True)
    ws = [(torch.randn(E * f, d, generator=gen) / d**0.5).requires_grad_(True) for _ in range(3)]
    run = (lambda: dmoe_sparse(x, w, idx, *ws, E, "glu", 16)) if impl == "sparse" else (
        lambda: dmoe_grouped(x, w, idx, *ws, E, "glu"))  # fmt: skip
    outs = []
    for fused in (True, False):
        with kernel_config(fused_glue=fused):
            y = run()
            outs.append((y, torch.autograd.grad(y.square().sum(), [x, w, *ws])))
    assert_rel_close(outs[0][0], outs[1][0], 1e-5, f"{impl}: output, fused against indexing")
    for name, a, b in zip(["x", "weights", "w1", "w2", "w3"], outs[0][1], outs[1][1], strict=True):
        assert_rel_close(a, b, 1e-5, f"{impl}: d{name}, fused against indexing")


def test_bad_inputs_are_named():
    rows = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="expand: rows"):
        expand(torch.randn(4, 8), rows, 8)
    with pytest.raises(ValueError, match="padded_rows=4"):
        expand(torch.randn(3, 8), rows, 4)
    with pytest.raises(ValueError, match="combine: weights"):
        combine(torch.randn(6, 8), rows, torch.rand(3, 3))
    with pytest.raises(ValueError, match="combine: y has 5 rows"):
        combine(torch.randn(5, 8), rows, torch.rand(3, 2))
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(torch.randn(2, 3), torch.randn(3, 2))
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "T,E,k,d,bs",
    [(4096, 64, 8, 2048, 128), (2048, 8, 2, 4096, 1), (1, 4, 4, 1000, 128), (333, 5, 1, 1408, 1)],
)
def test_glue_on_gpu(dtype, T, E, k, d, bs):
    """The bench's shapes (and T = 1, k = 1, d off the block) on the GPU, against indexing ops."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)])
    perm, rows = _rows(idx, E, bs)
    x = torch.randn(T, d, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    xs = expand(x, rows, perm.padded_rows)
    assert torch.equal(xs, x.new_zeros(perm.padded_rows, d).index_put((perm.dest,), x[perm.token]))
    g = torch.randn(xs.shape, device="cuda", generator=gen).to(dtype)
    (dx,) = torch.autograd.grad(xs, x, g)
    assert_rel_close(dx, g.float()[rows].sum(1), TOL[dtype], "expand: dx")
    y = torch.randn(perm.padded_rows, d, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    w = torch.rand(T, k, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    out = combine(y, rows, w)
    yf, wf = (t.detach().float().requires_grad_(True) for t in (y, w))
    ref = (wf[..., None] * yf[rows]).sum(1)
    assert_rel_close(out, ref, TOL[dtype], "combine")
    go = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
    dy, dw = torch.autograd.grad(out, (y, w), go)
    dy_ref, dw_ref = torch.autograd.grad(ref, (yf, wf), go.float())
    assert_rel_close(dy, dy_ref, TOL[dtype], "combine: dy")
    assert_rel_close(dw, dw_ref, TOL[dtype] * 2, "combine: d weights")
    h1 = (4 * torch.randn(T, d, device="cuda", generator=gen)).to(dtype).requires_grad_(True)
    h3 = torch.randn(T, d, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    a = swiglu(h1, h3)
    h1f, h3f = (t.detach().float().requires_grad_(True) for t in (h1, h3))
    ar = F.silu(h1f) * h3f
    assert_rel_close(a, ar, TOL[dtype], "swiglu")
    ga = g[:T]  # padded_rows >= T k >= T
    d1, d3 = torch.autograd.grad(a, (h1, h3), ga)
    r1, r3 = torch.autograd.grad(ar, (h1f, h3f), ga.float())
    assert_rel_close(d1, r1, TOL[dtype], "swiglu: dh1")
    assert_rel_close(d3, r3, TOL[dtype], "swiglu: dh3")
