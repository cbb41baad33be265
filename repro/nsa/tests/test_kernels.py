"""The Triton kernels against the float64 reference (CPU interpreter here, the GPU in test_gpu.py).

Tolerance: fp32 kernels against the fp64 reference, FP32_TOL (see helpers.py). Shapes are small
because the interpreter runs each program in Python: one program per (query, KV head) in the
selected branch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.nsa import (
    NSA,
    Switches,
    compressed_attention,
    nsa_attention,
    selected_attention,
    selection_scores,
    sliding_window_attention,
)
from repro.nsa import reference as ref
from repro.nsa.common import head_constexprs, kernel_dims
from repro.nsa.compression import forward_tile, row_dot, strided_backward, strided_forward
from repro.nsa.gate import gate_grads, gated_sum_backward, gated_sum_backward_torch, gated_sum_fused
from repro.nsa.tests.helpers import DEVICE, FP32_TOL, grads, leaf, randn, random_block_indices
from repro.nsa.window import window_tile

seeds = st.integers(0, 2**31 - 1)
head_dims = st.sampled_from([16, 32])
groups = st.sampled_from([1, 2, 3, 16])


def _leaves(*xs):
    """Each float64 input as a kernel leaf (float32 on DEVICE) and as a reference leaf (a float64 copy)."""
    return [leaf(x) for x in xs], [x.clone().requires_grad_() for x in xs]


def _check_grads(name, out, out_ref, ins, ins_ref, gen):
    do = randn(gen, *out_ref.shape)
    assert_rel_close(out.cpu(), out_ref, FP32_TOL, f"{name} output")
    g = grads(out, do.to(out.device, out.dtype), *ins)
    g_ref = grads(out_ref, do, *ins_ref)
    for label, a, r in zip("qkv", g, g_ref, strict=True):
        assert_rel_close(a.cpu(), r, FP32_TOL, f"{name} d{label}")


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=3, deadline=None)
@given(seed=seeds, t=st.integers(1, 40), g=groups, d=head_dims, dv=head_dims, s=st.integers(1, 3))
def test_selected_kernel_equals_reference(seed, t, g, d, dv, s):
    """Group-centric selected attention, forward and gradients, random valid indices in random order
    with -1 gaps; value head sizes equal to the key's or not."""
    gen = torch.Generator().manual_seed(seed)
    h, block = 1 + seed % 2, 16
    q, k, v = randn(gen, 1, t, h * g, d), randn(gen, 1, t, h, d), randn(gen, 1, t, h, dv)
    idx = random_block_indices(gen, 1, t, h, s, block)
    ins, ins_ref = _leaves(q, k, v)
    out = selected_attention(*ins, idx.to(DEVICE), block)
    out_ref = ref.selected_attention(*ins_ref, idx, block)
    _check_grads("selected", out, out_ref, ins, ins_ref, gen)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=3, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 48),
    g=groups,
    d=head_dims,
    dv=head_dims,
    ld=st.sampled_from([(16, 8), (32, 16), (8, 4), (4, 1)]),
    bwd_split=st.booleans(),
)
def test_compressed_kernel_equals_reference(seed, t, g, d, dv, ld, bwd_split):
    """Forward, lse and gradients; the backward in one masked loop or split (Switches.strided_bwd_split)."""
    l, stride = ld
    gen = torch.Generator().manual_seed(seed)
    nc = max(1, ref.num_compressed(t, l, stride))
    q, k, v = randn(gen, 1, t, g, d), randn(gen, 1, nc, 1, d), randn(gen, 1, nc, 1, dv)
    ins, ins_ref = _leaves(q, k, v)
    out, lse = compressed_attention(*ins, l, stride, switches=Switches(strided_bwd_split=bwd_split))
    out_ref, lse_ref = ref.compressed_attention(*ins_ref, l, stride)
    seen = ~torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse.cpu()), ~seen)
    if seen.any():
        assert_rel_close(lse.cpu()[seen], lse_ref[seen], FP32_TOL, "compressed lse")
    _check_grads("compressed", out, out_ref, ins, ins_ref, gen)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=3, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 48),
    g=st.sampled_from([1, 2, 4]),
    d=head_dims,
    dv=head_dims,
    w=st.integers(1, 40),
    bwd_split=st.booleans(),
)
def test_window_kernel_equals_reference(seed, t, g, d, dv, w, bwd_split):
    """Forward and gradients; the backward in one masked loop or split (Switches.strided_bwd_split)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(gen, 1, t, 2 * g, d), randn(gen, 1, t, 2, d), randn(gen, 1, t, 2, dv)
    ins, ins_ref = _leaves(q, k, v)
    out = sliding_window_attention(*ins, w, switches=Switches(strided_bwd_split=bwd_split))
    out_ref = ref.sliding_window_attention(*ins_ref, w)
    _check_grads("window", out, out_ref, ins, ins_ref, gen)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=3, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 80),
    g=st.sampled_from([1, 3]),
    cfg=st.sampled_from([(32, 16, 64), (16, 8, 16), (8, 4, 32), (16, 16, 16)]),
)
def test_scores_kernel_equals_reference(seed, t, g, cfg):
    """Eqs. 8-10 in the kernel: p_cmp recomputed from the stored lse, mapped by the overlap matmul."""
    l, stride, lp = cfg
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, 1, t, 2 * g, 16), randn(gen, 1, t, 2, 16)
    k_cmp = ref.compress(k, ref.mean_pool, l, stride)
    if k_cmp.shape[1] == 0:
        k_cmp = randn(gen, 1, 1, 2, 16)
    _, lse = ref.compressed_attention(q, k_cmp, k_cmp, l, stride)
    ns = -(-t // lp)
    sc = selection_scores(q.float().to(DEVICE), k_cmp.float().to(DEVICE), lse.to(DEVICE), ns, l, stride, lp)
    sc_ref = ref.selection_scores(q, k_cmp, lse, ns, l, stride, lp)
    assert_rel_close(sc.cpu(), sc_ref, FP32_TOL, "block scores")


SMALL = ref.NSAConfig(block_len=16, stride=8, select_len=16, n_select=3, n_initial=1, n_local=1, window=20)


def _layer_args(gen, t, hq, h, d, cfg, dv=None):
    q = randn(gen, 1, t, hq, d)
    k_c, v_c, k_s, v_s, k_w, v_w = (randn(gen, 1, t, h, d if i % 2 == 0 else (dv or d)) for i in range(6))
    k_cmp = ref.compress(k_c, ref.mean_pool, cfg.block_len, cfg.stride)
    v_cmp = ref.compress(v_c, ref.mean_pool, cfg.block_len, cfg.stride)
    gates = torch.rand(1, t, hq, 3, generator=gen, dtype=torch.float64)
    return [q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates]


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=2, deadline=None)
@given(seed=seeds, t=st.integers(17, 36), g=st.sampled_from([1, 2]))
def test_nsa_attention_kernels_equal_reference(seed, t, g):
    """The whole gated layer (Eq. 5): the kernel path's selection equals the reference's, and its
    output and the gradients of all seven inputs and the gates match."""
    gen = torch.Generator().manual_seed(seed)
    args = _layer_args(gen, t, 2 * g, 2, 16, SMALL)
    ins = [leaf(x) for x in args]
    ins_ref = [x.clone().requires_grad_() for x in args]
    out, idx = nsa_attention(*ins, SMALL)
    out_ref, idx_ref = ref.nsa_attention(*ins_ref, SMALL)
    assert torch.equal(idx.cpu(), idx_ref)
    assert_rel_close(out.cpu(), out_ref, FP32_TOL, "nsa output")
    do = randn(gen, *out_ref.shape)
    g_k = torch.autograd.grad(out, ins, do.to(out.device, out.dtype))
    g_r = torch.autograd.grad(out_ref, ins_ref, do)
    names = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]
    for name, a, r in zip(names, g_k, g_r, strict=True):
        assert_rel_close(a.cpu(), r, FP32_TOL, f"d{name}")


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize(
    "heads, value_heads, t",
    [
        ((192, 128), None, 20),  # the paper's (§4.1): keys in two pieces, values their own size
        ((60, 100), None, 20),  # flash-linear-attention's test sizes: zero-padded to 64 and 128
    ],
    ids=["paper-192-128", "padded-60-100"],
)
def test_layer_at_the_papers_and_padded_head_sizes(heads, value_heads, t):
    """The whole gated layer (Eq. 5) at the paper's Dk = 192, Dv = 128 and at sizes the kernels take
    padded: selection, output and the gradients of all seven inputs and the gates equal the
    reference's. At t = 20 block 0 is read by 20 queries, more than the interpreter's work item of 16
    in the block-major backward: its partial sums meet in atomics, the second key piece's too."""
    gen = torch.Generator().manual_seed(sum(heads))
    dk, dv = heads
    args = _layer_args(gen, t, 2, 1, dk, SMALL, dv)
    ins = [leaf(x) for x in args]
    ins_ref = [x.clone().requires_grad_() for x in args]
    out, idx = nsa_attention(*ins, SMALL)
    out_ref, idx_ref = ref.nsa_attention(*ins_ref, SMALL)
    assert out.shape == (1, t, 2, dv)
    assert torch.equal(idx.cpu(), idx_ref)
    assert_rel_close(out.cpu(), out_ref, FP32_TOL, "nsa output")
    do = randn(gen, *out_ref.shape)
    g_k = torch.autograd.grad(out, ins, do.to(out.device, out.dtype))
    g_r = torch.autograd.grad(out_ref, ins_ref, do)
    names = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]
    for name, a, r in zip(names, g_k, g_r, strict=True):
        assert a.shape == r.shape
        assert_rel_close(a.cpu(), r, FP32_TOL, f"d{name}")


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("head_dim, value_head_dim", [(16, None), (24, 16)])
def test_nsa_module_kernels_equal_reference(head_dim, value_head_dim):
    """The layer with learned compression MLPs and gates: the same parameters through the Triton path
    and the reference give the same output and parameter gradients; with one head size, and with
    keys of 24 (padded to 32) and values of 16."""
    torch.manual_seed(0)
    layer = NSA(dim=32, n_heads=4, n_kv_heads=2, head_dim=head_dim, value_head_dim=value_head_dim,
                config=SMALL).to(DEVICE)  # fmt: skip
    x = torch.randn(1, 33, 32, device=DEVICE)
    y = layer(x)
    gy = torch.randn_like(y)
    g_k = torch.autograd.grad(y, list(layer.parameters()), gy)
    layer.use_kernels = False
    y_ref = layer(x)
    g_r = torch.autograd.grad(y_ref, list(layer.parameters()), gy)
    assert_rel_close(y, y_ref, 1e-5, "layer output")
    # Some gradients are zero in exact arithmetic (a bias added to every compressed key shifts all
    # logits alike, and softmax ignores that): their error is measured against the largest gradient.
    floor = max(r.norm().item() for r in g_r)
    for (name, _), a, r in zip(layer.named_parameters(), g_k, g_r, strict=True):
        err = (a - r).norm().item()
        assert err <= 1e-4 * max(r.norm().item(), 1e-3 * floor), f"grad {name}: error {err:.2e}"


@pytest.mark.claim("nsa/causal", section="§3.2, Eq. 5 (arXiv v2)")
@settings(max_examples=2, deadline=None)
@given(seed=seeds, t=st.integers(17, 48), cut=st.floats(0, 1))
def test_kernel_layer_is_causal(seed, t, cut):
    """Through the kernels: changing every raw input after position c (then compressing) leaves the
    outputs and selections at 0..c unchanged, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    c = min(t - 2, int(cut * t))
    cfg = SMALL
    q = randn(gen, 1, t, 4, 16)
    raw = [randn(gen, 1, t, 2, 16) for _ in range(6)]
    gates = torch.rand(1, t, 4, 3, generator=gen, dtype=torch.float64)

    def run(q, raw, gates):
        k_cmp = ref.compress(raw[0], ref.mean_pool, cfg.block_len, cfg.stride)
        v_cmp = ref.compress(raw[1], ref.mean_pool, cfg.block_len, cfg.stride)
        args = [q, k_cmp, v_cmp, *raw[2:], gates]
        return nsa_attention(*[x.float().to(DEVICE) for x in args], cfg)

    o1, i1 = run(q, raw, gates)
    q2, gates2, raw2 = q.clone(), gates.clone(), [x.clone() for x in raw]
    for x in (q2, *raw2):
        x[:, c + 1 :] = randn(gen, *x[:, c + 1 :].shape) * 3
    gates2[:, c + 1 :] = torch.rand(*gates2[:, c + 1 :].shape, generator=gen, dtype=torch.float64)
    o2, i2 = run(q2, raw2, gates2)
    assert torch.equal(i1[:, : c + 1], i2[:, : c + 1])
    assert torch.equal(o1[:, : c + 1], o2[:, : c + 1])


@pytest.mark.claim("nsa/group-shared-selection", section="§3.3.2, Eq. 10 (arXiv v2)")
@settings(max_examples=2, deadline=None)
@given(seed=seeds, t=st.integers(17, 40), g=st.sampled_from([2, 4]), head=st.integers(0, 3))
def test_kernel_heads_read_only_their_groups_blocks(seed, t, g, head):
    """The backward of the selected kernel for one query and one head of a group: dK and dV are zero
    on every key outside that group's selected blocks (and after the query), nonzero inside."""
    gen = torch.Generator().manual_seed(seed)
    block, h = 16, 2
    q, k, v = randn(gen, 1, t, h * g, 16), randn(gen, 1, t, h, 16), randn(gen, 1, t, h, 16)
    idx = random_block_indices(gen, 1, t, h, 2, block)
    ins = [leaf(x) for x in (q, k, v)]
    out = selected_attention(*ins, idx.to(DEVICE), block)
    ti, hq = int(torch.randint(0, t, (1,), generator=gen)), head % (h * g)
    do = torch.zeros_like(out)
    do[0, ti, hq] = torch.randn(16, generator=gen).to(do)
    _, dk, dv = torch.autograd.grad(out, ins, do)
    mask = ref.selected_mask(idx[:, ti : ti + 1], block, t, torch.tensor([ti]))[0, 0, hq // g]
    read_k = dk[0, :, hq // g].abs().sum(-1).cpu() > 0
    read_v = dv[0, :, hq // g].abs().sum(-1).cpu() > 0
    assert not (read_k & ~mask).any() and not (read_v & ~mask).any(), "a key outside the group's blocks"
    assert torch.equal(read_v, mask), "every selected key gets a dV"
    other = [hh for hh in range(h) if hh != hq // g]
    for hh in other:
        assert (dk[0, :, hh] == 0).all() and (dv[0, :, hh] == 0).all()


@pytest.mark.claim("nsa/selection-all-blocks-is-full", section="§3.3.2, Eq. 12 (arXiv v2)")
@settings(max_examples=2, deadline=None)
@given(seed=seeds, t=st.integers(1, 48), g=st.sampled_from([1, 4]))
def test_selected_kernel_with_every_block_is_full_attention(seed, t, g):
    gen = torch.Generator().manual_seed(seed)
    block = 16
    q, k, v = randn(gen, 1, t, g, 16), randn(gen, 1, t, 1, 16), randn(gen, 1, t, 1, 16)
    ns = -(-t // block)
    idx = ref.select_blocks(torch.rand(1, t, 1, ns, generator=gen), ns, block, 1, 1)
    out = selected_attention(*[x.float().to(DEVICE) for x in (q, k, v)], idx.to(DEVICE), block)
    assert_rel_close(out.cpu(), ref.full_causal_attention(q, k, v), FP32_TOL, "all blocks vs full")


@pytest.mark.claim("nsa/window-covers-is-full", section="§3.3.3 (arXiv v2)")
@settings(max_examples=2, deadline=None)
@given(seed=seeds, t=st.integers(1, 48), extra=st.integers(0, 20))
def test_window_kernel_covering_everything_is_full_attention(seed, t, extra):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(gen, 1, t, 2, 16), randn(gen, 1, t, 1, 16), randn(gen, 1, t, 1, 16)
    out = sliding_window_attention(*[x.float().to(DEVICE) for x in (q, k, v)], t + extra)
    assert_rel_close(out.cpu(), ref.full_causal_attention(q, k, v), FP32_TOL, "window >= T vs full")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selected_kernel_half_precision(dtype):
    """fp16 / bf16 inputs, fp32 accumulation: relative error of a 16-bit rounding (about 1e-2). bf16
    on the CPU runs through paperclub.triton_compat.patch_interpreter (the interpreter alone gets bf16
    dots wrong)."""
    gen = torch.Generator().manual_seed(1)
    t, block = 32, 16
    q, k, v = randn(gen, 1, t, 2, 16), randn(gen, 1, t, 1, 16), randn(gen, 1, t, 1, 16)
    idx = random_block_indices(gen, 1, t, 1, 2, block)
    out = selected_attention(*[x.to(DEVICE, dtype) for x in (q, k, v)], idx.to(DEVICE), block)
    assert out.dtype == dtype
    assert_rel_close(out.float().cpu(), ref.selected_attention(q, k, v, idx, block), 2e-2, "16-bit output")


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("t", [1, 37])
def test_fused_gated_sum_equals_eq5(dtype, t):
    """Eq. 5's gated sum as one kernel (gate.gated_sum_fused, behind Switches.fused_gate): output and the
    gradients of the gates and the three branch outputs equal the PyTorch formula's in fp64, for row
    counts on and off the kernel's row tile; mismatched shapes are refused by name."""
    gen = torch.Generator().manual_seed(t)
    xs = [randn(gen, 2, t, 3, 16) for _ in range(3)]
    gates = torch.rand(2, t, 3, 3, generator=gen, dtype=torch.float64)
    do = randn(gen, 2, t, 3, 16)
    ours = [x.to(dtype).to(DEVICE).requires_grad_() for x in (gates, *xs)]
    o = gated_sum_fused(*ours)
    got = torch.autograd.grad(o, ours, do.to(dtype).to(DEVICE))
    want_leaves = [x.to(dtype).double().requires_grad_() for x in (gates, *xs)]
    g, a, b, c = want_leaves
    want_o = g[..., 0:1] * a + g[..., 1:2] * b + g[..., 2:3] * c
    want = torch.autograd.grad(want_o, want_leaves, do.to(dtype).double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert o.dtype == dtype
    assert_rel_close(o.double().cpu(), want_o.detach(), tol, "gated sum")
    for name, x, y in zip(("d gates", "d o_cmp", "d o_slc", "d o_win"), got, want, strict=True):
        assert_rel_close(x.double().cpu(), y, tol, name)
    with pytest.raises(ValueError, match="o_win must match o_cmp"):
        gated_sum_fused(ours[0], ours[1], ours[2], ours[3][..., :8])


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(
    "t, stride, block_len, window",
    [
        (1, 16, 32, 0),  # no query sees a compressed token
        (47, 16, 32, 0),  # one interior tile at most (interpreter tiles are 16 x 16)
        (100, 4, 8, 0),  # many compressed tokens per query tile: interior and diagonal tiles
        (100, 1, 1, 16),  # window = the tile width
        (100, 1, 1, 17),  # window one past it: an edge tile on both sides
        (100, 1, 1, 40),
        (64, 1, 1, 1),  # a window of one key: no interior tile
    ],
)
def test_strided_forward_split_loops_equal_reference(split, t, stride, block_len, window):
    """The strided forward with its key tiles in one masked loop, or split into edge, interior (no
    mask) and diagonal loops (Switches.strided_split: the compressed branch's default; the window's split
    is kept general and checked here): output and lse equal the reference at lengths around the tile."""
    gen = torch.Generator().manual_seed(t + 7 * window + stride)
    d, nk = 16, (t if window else max(1, ref.num_compressed(t, block_len, stride)))
    q, k, v = randn(gen, 1, t, 4, d), randn(gen, 1, nk, 2, d), randn(gen, 1, nk, 2, d)
    offset = 0 if window else block_len - 1
    kq, kk, kv = (x.to(DEVICE, torch.float32) for x in (q, k, v))
    tile = window_tile(d, 4) if window else forward_tile(d, 4)
    out, lse = strided_forward(kq, kk, kv, d**-0.5, stride, offset, window, tile, Switches(), split=split)
    if window:
        s = torch.arange(t)
        mask = ((s[None, :] <= s[:, None]) & (s[None, :] > s[:, None] - window))[None, :, None, :]
        out_ref, lse_ref = ref.masked_attention(q, k, v, mask)
    else:
        out_ref, lse_ref = ref.compressed_attention(q, k, v, block_len, stride)
    seen = ~torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse.cpu()), ~seen)
    if seen.any():
        assert_rel_close(lse.cpu()[seen], lse_ref[seen], FP32_TOL, "strided lse")
    assert_rel_close(out.cpu(), out_ref, FP32_TOL, f"strided output (split={split})")


def test_kernel_head_sizes():
    """What the kernels run a head size at (``common.kernel_dims``) and which constexprs a launch gets:
    Dk = Dv in {16, 32, 64, 128} (after padding) pass only D, the verified launches; the paper's 192
    / 128 passes the key's two pieces and the value size."""
    assert kernel_dims(60, 60) == (64, 64) and kernel_dims(100, 100) == (128, 128)
    assert kernel_dims(192, 128) == (192, 128) and kernel_dims(150, 1) == (192, 16)
    assert head_constexprs(64, 64) == {"D": 64} and head_constexprs(128, 128) == {"D": 128}
    assert head_constexprs(192, 128) == {"D": 128, "D2": 64, "D_V": 128}
    assert head_constexprs(128, 64) == {"D": 128, "D2": 0, "D_V": 64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_dot_is_the_fp32_formula(dtype):
    """The strided backward's delta, ``(do.float() * o).sum(-1)``, is bit for bit the formula it
    replaced, ``(do.float() * o.float()).sum(-1)``: o is promoted to fp32 exactly inside the product."""
    gen = torch.Generator().manual_seed(0)
    do, o = (torch.randn(2, 33, 4, 64, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(row_dot(do, o), (do.float() * o.float()).sum(-1))


@pytest.mark.parametrize("stride, window", [(1, 9), (4, 0)], ids=["window", "compressed"])
def test_strided_backward_heads_per_program(stride, window):
    """The strided dK/dV kernel walking several query heads of a group per program
    (Switches.window_bwd_heads / cmp_bwd_heads) gives the gradients of one program per head: dQ
    bit for bit (its kernel is the same), dK and dV the same fp32 sums in another order; a count
    that does not divide the group is refused by name."""
    gen = torch.Generator().manual_seed(3)
    t, g, d, dv = 37, 4, 16, 32
    nk = t if window else 9
    q, do = randn(gen, 1, t, 2 * g, d).to(DEVICE), randn(gen, 1, t, 2 * g, dv).to(DEVICE)
    k, v = randn(gen, 1, nk, 2, d).to(DEVICE), randn(gen, 1, nk, 2, dv).to(DEVICE)
    args = (0.25, stride, 3 * (stride > 1), window)
    o, lse = strided_forward(q, k, v, *args, forward_tile(max(d, dv), 4), Switches())
    one = strided_backward(do, q, k, v, o, lse, *args)
    for heads in (2, 4, 64):  # 64: clamped to the group
        got = strided_backward(do, q, k, v, o, lse, *args, heads_per_program=heads)
        assert torch.equal(got[0], one[0])
        for name, x, y in zip(("dk", "dv"), got[1:], one[1:], strict=True):
            assert_rel_close(x.cpu(), y.cpu(), 1e-5, f"{name} heads={heads}")
    with pytest.raises(ValueError, match="heads_per_program = 3 must divide the group of 4"):
        strided_backward(do, q, k, v, o, lse, *args, heads_per_program=3)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize(
    "t, stride, offset, window, nk",
    [
        (9, 1, 0, 4, 9),  # T below the 16 x 16 tile: no interior
        (9, 16, 31, 0, 1),  # no query sees the one compressed token
        # the window cases at the fewest 16-row tiles that still hold their paths (the interpreter runs
        # every tile's program in Python): 40 = 3 tiles, the last partial, each query tile with an edge
        # tile before its diagonal; 72 = 5 tiles, the last partial, query tiles 3 and 4 with whole
        # (interior) key tiles between the far edge and the diagonal
        (40, 1, 0, 9, 40),  # window below the tile: no tile is seen whole
        (72, 1, 0, 40, 72),  # interiors between the diagonal and the window's far edge
        (40, 1, 0, 64, 40),  # window past T: causal, interiors below the diagonal, T off the tile
        (100, 4, 7, 0, 24),  # compressed (l = 8, d = 4): key tiles of 16 cover 64 positions
        (300, 16, 31, 0, 17),  # the paper's l = 32, d = 16: one interior tile each way, a partial key tile
    ],
)
def test_strided_backward_split_loops_equal_one_loop(t, stride, offset, window, nk, heads):
    """The strided backward with its tiles split into masked and unmasked loops
    (Switches.strided_bwd_split) gives the gradients of the one masked loop: shapes where the
    interiors are empty and where they exist, one and several query heads per dK/dV program; so does
    the dK/dV kernel walking its query tiles last to first as well (Switches.cmp_bwd_reverse; in one
    masked loop, the compressed branch's default with strided_bwd_split off, it is checked against
    the reference by test_compressed_kernel_equals_reference)."""
    gen = torch.Generator().manual_seed(t + 7 * window + stride)
    d, dv, h, g = 16, 32, 2, 2
    q, do = (randn(gen, 1, t, h * g, x).to(DEVICE, torch.float32) for x in (d, dv))
    k, v = (randn(gen, 1, nk, h, x).to(DEVICE, torch.float32) for x in (d, dv))
    args = (d**-0.5, stride, offset, window)
    o, lse = strided_forward(q, k, v, *args, forward_tile(max(d, dv), 4), Switches())
    one = strided_backward(do, q, k, v, o, lse, *args, heads_per_program=heads)
    for split, reverse in ((True, False), (True, True)):  # one loop reversed: the reference tests
        got = strided_backward(do, q, k, v, o, lse, *args, heads_per_program=heads, split=split,
                               reverse=reverse)  # fmt: skip
        for name, x, y in zip(("dq", "dk", "dv"), got, one, strict=True):
            assert_rel_close(x.cpu(), y.cpu(), FP32_TOL, f"{name} split={split} reverse={reverse} (heads={heads})")


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_backward_kernel_equals_the_torch_formula(dtype, gate_dtype):
    """The fused gate's backward kernel against the PyTorch formula it replaced, rows on and off its
    row tile: the branch gradients bit for bit, the gates' as the same fp32 sums in another order."""
    gen = torch.Generator().manual_seed(2)
    do, a, b, c = (torch.randn(2, 19, 3, 32, generator=gen).to(dtype).to(DEVICE) for _ in range(4))
    gates = torch.rand(2, 19, 3, 3, generator=gen).to(gate_dtype).to(DEVICE)
    got = gated_sum_backward(do, gates, a, b, c)
    want = gated_sum_backward_torch(do, gates, a, b, c)
    assert got[0].dtype == gate_dtype and all(x.dtype == dtype for x in got[1:])
    for name, x, y in zip(("d o_cmp", "d o_slc", "d o_win"), got[1:], want[1:], strict=True):
        assert torch.equal(x, y), name
    tol = 1e-2 if gate_dtype == torch.bfloat16 else 1e-5
    assert_rel_close(got[0].double().cpu(), want[0].double().cpu(), tol, "d gates")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_grads_are_the_fp32_formula(dtype):
    """The fused gate's backward computes dL/dg with dO converted once and each branch output promoted
    inside its product: bit for bit the formula it replaced, ``(do.float() * x.float()).sum(-1)``."""
    gen = torch.Generator().manual_seed(1)
    do, *xs = (torch.randn(2, 17, 3, 32, generator=gen).to(dtype) for _ in range(4))
    for got, x in zip(gate_grads(do, xs), xs, strict=True):
        assert torch.equal(got, (do.float() * x.float()).sum(-1))


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("dk, dv, t, w", [(16, 16, 40, 9), (24, 40, 33, 1), (32, 16, 37, 40)])
def test_fa4_window_equals_reference(dk, dv, t, w):
    """The window branch through repro.fa4's sliding window (Switches.window_kernel = "fa4", off by
    default): output and gradients equal the reference's, with key and value sizes equal or not
    (repro.fa4 pads them itself), a window of one key, and one wider than the sequence."""
    gen = torch.Generator().manual_seed(t + w)
    q, k, v = randn(gen, 1, t, 4, dk), randn(gen, 1, t, 2, dk), randn(gen, 1, t, 2, dv)
    ins, ins_ref = _leaves(q, k, v)
    out = sliding_window_attention(*ins, w, switches=Switches(window_kernel="fa4"))
    out_ref = ref.sliding_window_attention(*ins_ref, w)
    _check_grads("fa4 window", out, out_ref, ins, ins_ref, gen)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
def test_layer_with_the_fa4_window_equals_reference():
    """The gated layer with its window through repro.fa4: the same selection, output and gradients
    as the reference."""
    gen = torch.Generator().manual_seed(5)
    args = _layer_args(gen, 24, 2, 1, 16, SMALL)
    ins = [leaf(x) for x in args]
    ins_ref = [x.clone().requires_grad_() for x in args]
    out, idx = nsa_attention(*ins, SMALL, switches=Switches(window_kernel="fa4"))
    out_ref, idx_ref = ref.nsa_attention(*ins_ref, SMALL)
    assert torch.equal(idx.cpu(), idx_ref)
    assert_rel_close(out.cpu(), out_ref, FP32_TOL, "nsa output")
    do = randn(gen, *out_ref.shape)
    for a, r in zip(
        torch.autograd.grad(out, ins, do.float()), torch.autograd.grad(out_ref, ins_ref, do), strict=True
    ):
        assert_rel_close(a.cpu(), r, FP32_TOL, "gradient")
