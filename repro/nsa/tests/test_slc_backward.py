"""The selected branch's block-major backward (``Switches.slc_backward``'s default): the inverted
selection (``selected.invert_block_indices``) and the gradients of ``selected.backward_block_major``
against the query-major backward (``selected.backward_query_major``) and the float64 reference, on the
CPU interpreter.

Tolerances: fp32 kernels against fp64, FP32_TOL (helpers.py); against the other fp32 backward 1e-5
(both sum the same products in another order). bf16: 2e-2 against the reference (a few bf16 roundings
of 2^-8; P and dS are rounded to bf16 before each matmul, in both backwards alike).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close, dispatched
from repro.nsa import Switches, selected
from repro.nsa import reference as ref
from repro.nsa.tests.helpers import DEVICE, FP32_TOL, FREE_OPS, randn, random_block_indices

seeds = st.integers(0, 2**31 - 1)


def _pairs(bi: torch.Tensor, nb: int) -> dict[int, list[int]]:
    """segment -> ascending query positions that selected it, by a plain loop over ``bi``."""
    b, t, h, s = bi.shape
    out: dict[int, list[int]] = {}
    for bb in range(b):
        for tt in range(t):
            for hh in range(h):
                for j in bi[bb, tt, hh].tolist():
                    if j >= 0:
                        out.setdefault((bb * h + hh) * nb + j, []).append(tt)
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=25, deadline=None)
@given(
    seed=seeds,
    b=st.integers(1, 2),
    t=st.integers(1, 60),
    h=st.integers(1, 3),
    s=st.integers(1, 4),
    block=st.sampled_from([4, 16]),
    chunk=st.integers(1, 9),
    hot=st.booleans(),
)
def test_inversion_lists_every_pair_once(seed, b, t, h, s, block, chunk, hot):
    """Every (query, block) pair of the selection appears exactly once in its block's list, and no
    other does; the work items cover each list in ceil(c / chunk) pieces. Random valid indices with -1
    gaps in random places; ``hot``: every query also picks block 0 (one long list over many items).
    Fails if the inversion drops a pair (a missing query), double-counts one (a list too long), puts it
    under another block or batch/head, or the item map skips or repeats a piece of a list."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-t // block)
    bi = random_block_indices(gen, b, t, h, s, block)
    if hot:
        bi[..., 0] = torch.where((bi == 0).any(-1), bi[..., 0], 0)  # block 0 in every row, once
    qidx, offsets, item_seg, first_item, grid = selected.invert_block_indices(bi.to(DEVICE), nb, chunk)
    qidx, offsets, item_seg, first_item = (x.cpu() for x in (qidx, offsets, item_seg, first_item))
    want = _pairs(bi, nb)
    nseg = b * h * nb
    assert offsets.shape == (nseg + 1,) and offsets[0] == 0
    assert offsets[-1] == int((bi >= 0).sum())
    for seg in range(nseg):
        got = qidx[offsets[seg] : offsets[seg + 1]].tolist()
        assert got == want.get(seg, []), f"segment {seg}: {got} against {want.get(seg, [])}"
    # the items: segment seg owns items first_item[seg] .. first_item[seg] + ceil(c / chunk) - 1
    counts = offsets.long().diff()
    n_items = (counts + chunk - 1) // chunk
    assert int(n_items.sum()) <= grid
    expect = torch.repeat_interleave(torch.arange(nseg), n_items)
    assert torch.equal(item_seg[: len(expect)].long(), expect)
    assert (item_seg[len(expect) :] == nseg).all()
    assert torch.equal(first_item.long(), n_items.cumsum(0) - n_items)


def _inputs(gen, b, t, h, g, d, s, block):
    q, k, v = randn(gen, b, t, h * g, d), randn(gen, b, t, h, d), randn(gen, b, t, h, d)
    return q, k, v, random_block_indices(gen, b, t, h, s, block), randn(gen, b, t, h * g, d)


def _both_backwards(q, k, v, bi, do, block, dtype, chunk, rows):
    """(dq, dk, dv) of the tiled backward and of the query-major one, on the same forward."""
    scale = q.shape[-1] ** -0.5
    q, k, v, do = (x.to(DEVICE, dtype).contiguous() for x in (q, k, v, do))
    bi = bi.to(DEVICE, torch.int32).contiguous()
    o, lse = selected.selected_forward(q, k, v, bi, block, scale)
    shape = Switches(slc_bwd_chunk=chunk, slc_bwd_rows=rows)
    tiled = selected.backward_block_major(do, q, k, v, o, lse, bi, block, scale, shape)
    old = selected.backward_query_major(do, q, k, v, o, lse, bi, block, scale)
    return tiled, old


def _assert_same_backward(tiled, old, want, tol, what):
    """Tiled against query-major gradients: error relative to the largest of the three reference
    gradients' norms (each gradient is also checked against its own reference), so that rounding
    noise of a gradient that is zero in exact arithmetic (dQ at T = 1: one visible key, dS = 0) does
    not count as an error."""
    floor = max(r.norm().item() for r in want)
    for name, a, o in zip("qkv", tiled, old, strict=True):
        err = (a.double().cpu() - o.double().cpu()).norm().item() / floor
        assert err <= tol, f"{what} d{name}: {err:.2e} from the query-major backward (tolerance {tol:.0e})"


def _reference_grads(q, k, v, bi, do, block):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(ref.selected_attention(*leaves, bi, block), leaves, do)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize(
    "b, t, h, g, s, chunk, rows",
    [
        (1, 37, 1, 1, 2, 5, 16),  # B = H = 1, G = 1: 16 queries per tile; T off the block
        (1, 24, 2, 2, 2, 3, 16),  # G = 2: 8 queries x 2 heads; items of 3 queries
        (1, 33, 2, 4, 2, 16, 32),  # G = 4, 8 queries per tile, one item per block
    ],
)
def test_tiled_backward_bf16_equals_reference(b, t, h, g, s, chunk, rows):
    """bf16 inputs: the tiled backward's dQ, dK, dV against the fp64 reference on the bf16-rounded
    inputs (2e-2) and against the query-major backward (2e-2). Fails with a wrong causal mask, a
    wrong row -> (query, head) mapping, a lost or extra pair, or a dropped atomic partial sum."""
    gen = torch.Generator().manual_seed(t + g)
    q, k, v, bi, do = _inputs(gen, b, t, h, g, 16, s, 16)
    q, k, v, do = (x.to(torch.bfloat16).double() for x in (q, k, v, do))
    tiled, old = _both_backwards(q, k, v, bi, do, 16, torch.bfloat16, chunk, rows)
    want = _reference_grads(q, k, v, bi, do, 16)
    for name, a, r in zip("qkv", tiled, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert_rel_close(a.double().cpu(), r, 2e-2, f"tiled d{name} vs reference")
    _assert_same_backward(tiled, old, want, 2e-2, "bf16")


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=3, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 36),
    g=st.sampled_from([1, 2, 3, 4, 16]),
    bh=st.sampled_from([(1, 1), (2, 1), (1, 2)]),
    s=st.integers(1, 3),
    chunk=st.sampled_from([1, 4, 64]),
)
def test_tiled_backward_fp32_equals_reference(seed, t, g, bh, s, chunk):
    """fp32: dQ, dK, dV of the tiled backward equal the reference (FP32_TOL) and the query-major
    backward (1e-5) for random lengths (T off the block of 16), group sizes (G = 3: padded heads),
    batches and heads, random indices with -1 gaps, and items of 1, 4 or 64 queries (1 and 4: most
    blocks split over several programs whose partial sums meet in atomics; 64: none split)."""
    b, h = bh
    gen = torch.Generator().manual_seed(seed)
    q, k, v, bi, do = _inputs(gen, b, t, h, g, 16, s, 16)
    tiled, old = _both_backwards(q, k, v, bi, do, 16, torch.float32, chunk, 16)
    want = _reference_grads(q, k, v, bi, do, 16)
    for name, a, r in zip("qkv", tiled, want, strict=True):
        assert_rel_close(a.cpu().double(), r, FP32_TOL, f"tiled d{name} vs reference")
    _assert_same_backward(tiled, old, want, 1e-5, "fp32")


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
def test_tiled_backward_hot_and_unselected_blocks():
    """Every query selects block 0 (a list of T queries over many items, summed with atomics) and only
    its own block besides, so most blocks are read by 16 queries and a block no query selects must
    get dK = dV = 0 exactly (the output is zeroed, no item writes it). fp32 against the reference.
    Fails if the split items' partial sums are lost or stored over each other, or if unselected
    blocks get garbage."""
    gen = torch.Generator().manual_seed(3)
    t, block, g = 48, 16, 2
    q, k, v, _, do = _inputs(gen, 1, t, 1, g, 16, 3, block)
    own = torch.arange(t) // block
    bi = torch.full((1, t, 1, 3), -1, dtype=torch.int32)
    bi[0, :, 0, 0] = 0
    bi[0, :, 0, 2] = torch.where(own == 1, -1, own)  # block 1: only queries that pick block 0 read it
    bi[0, :, 0, 2] = torch.where(own == 0, -1, bi[0, :, 0, 2])  # no repeat of block 0
    bi[0, 16:32, 0, :] = torch.tensor([0, -1, -1], dtype=torch.int32)  # block 1 selected by no query
    (dq, dk, dv), _ = _both_backwards(q, k, v, bi, do, block, torch.float32, 4, 16)
    want = _reference_grads(q, k, v, bi, do, block)
    assert (dk[0, 16:32] == 0).all() and (dv[0, 16:32] == 0).all()
    for name, a, r in zip("qkv", (dq, dk, dv), want, strict=True):
        assert_rel_close(a.cpu().double(), r, FP32_TOL, f"d{name}")


def test_tiled_flag_dispatches_its_kernels_without_host_reads():
    """With Switches.slc_backward = "block-major", the autograd backward launches the dQ kernel and the tiled dK/dV
    kernel (not the pair-at-a-time one), and no aten op that reads a value back to the host
    (``.item()`` is ``_local_scalar_dense``; ``nonzero``, ``bincount`` and ``unique`` size their
    outputs from the data). Fails if the flag is ignored or the inversion grows a host sync."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, bi, do = _inputs(gen, 1, 40, 2, 2, 16, 2, 16)
    leaves = [x.float().to(DEVICE).requires_grad_() for x in (q, k, v)]
    out = selected.selected_attention(
        *leaves, bi.to(DEVICE), 16, switches=Switches(slc_backward="block-major")
    )
    names = ("_slc_bwd_dq_kernel", "_slc_bwd_dkdv_kernel", "_slc_bwd_dkdv_tiled_kernel")
    with dispatched(selected, names) as (recorded, launches):
        torch.autograd.grad(out, leaves, do.float().to(DEVICE))
    assert launches == ["_slc_bwd_dq_kernel", "_slc_bwd_dkdv_tiled_kernel"]
    syncing = {"_local_scalar_dense.default", "nonzero.default", "bincount.default", "item.default"}
    bad = [op for op in recorded if op in syncing or op.startswith(("unique", "_unique"))]
    assert not bad, f"the tiled backward dispatched host-reading ops {bad}"
    assert "sort.default" in recorded or "sort.stable" in recorded, [o for o in recorded if o not in FREE_OPS]


def test_inversion_refuses_bad_arguments():
    bi = torch.zeros(1, 4, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk and num_blocks must be >= 1"):
        selected.invert_block_indices(bi, 1, 0)
    with pytest.raises(TypeError, match="bi must be int32 or int64"):
        selected.invert_block_indices(bi.float(), 1, 4)
    with pytest.raises(ValueError, match=r"bi must be \[B, T, H, S\]"):
        selected.invert_block_indices(bi[0], 1, 4)
