"""The training forward's block selection (Eq. 11): the scores kernel writes Eq. 11's masks itself and
one torch.topk plus one small sort kernel pick the blocks, which must be the blocks that
``reference.select_blocks`` picks from the unmasked scores (same tensor up to the masks, so the same
top-k, ties included)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import dispatched
from repro.nsa import Switches, selection
from repro.nsa import reference as ref
from repro.nsa.tests.helpers import DEVICE, FREE_OPS, randn

seeds = st.integers(0, 2**31 - 1)


def _masks(t: int, ns: int, lp: int, n_initial: int, n_local: int):
    """[T, Ns] bool masks of reference.select_blocks: forced blocks (kept; a future one is not) and future
    blocks (never picked)."""
    own = (torch.arange(t) // lp)[:, None]
    j = torch.arange(ns)[None, :]
    forced = (j < n_initial) | ((j <= own) & (j > own - n_local))
    return forced & ~(j > own), j > own


def _scores(gen, b, t, hq, h, cfg):
    q, k = randn(gen, b, t, hq, 16), randn(gen, b, t, h, 16)
    k_cmp = ref.compress(k, ref.mean_pool, cfg.block_len, cfg.stride)
    if k_cmp.shape[1] == 0:
        k_cmp = randn(gen, b, 1, h, 16)
    _, lse = ref.compressed_attention(q, k_cmp, k_cmp, cfg.block_len, cfg.stride)
    q, k_cmp, lse = q.float().to(DEVICE), k_cmp.float().to(DEVICE), lse.float().to(DEVICE)
    return q, k_cmp, lse


def _check(seed: int, t: int, b: int, h: int, g: int, cfg: ref.NSAConfig) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k_cmp, lse = _scores(gen, b, t, h * g, h, cfg)
    ns = -(-t // cfg.select_len)
    plain = selection.selection_scores(q, k_cmp, lse, ns, cfg.block_len, cfg.stride, cfg.select_len).cpu()
    masked = selection.masked_selection_scores(q, k_cmp, lse, cfg).cpu()
    forced, future = _masks(t, ns, cfg.select_len, cfg.n_initial, cfg.n_local)
    forced, future = forced[None, :, None, :].expand_as(masked), future[None, :, None, :].expand_as(masked)
    rest = ~forced & ~future
    assert torch.isposinf(masked[forced]).all() and torch.isneginf(masked[future]).all()
    assert torch.equal(masked[rest], plain[rest])  # bit for bit the unmasked kernel's scores
    idx = selection.topk_blocks(masked.to(DEVICE), cfg.n_select).cpu()
    want = ref.select_blocks(plain, cfg.n_select, cfg.select_len, cfg.n_initial, cfg.n_local)
    assert idx.dtype == torch.int32 and torch.equal(idx, want)


PAPERLIKE = ref.NSAConfig(block_len=32, stride=16, select_len=64, n_select=4, n_initial=1, n_local=2)
SMALL = ref.NSAConfig(block_len=16, stride=8, select_len=16, n_select=3, n_initial=1, n_local=1)
# l' = 4 with the interpreter's 16-query tiles: 20+ blocks, more than one 16-block score tile, so
# the blocks after a tile's last query are written by the kernel's -inf loop
TINY = ref.NSAConfig(block_len=8, stride=4, select_len=4, n_select=5, n_initial=2, n_local=2)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize(
    ("cfg", "t"),
    [
        (SMALL, 1),  # one block, no compressed token visible
        (SMALL, 15),
        (SMALL, 16),  # at a selection block's edge
        (SMALL, 17),
        (SMALL, 48),  # n = 3 blocks exactly
        (SMALL, 49),
        (PAPERLIKE, 64),
        (PAPERLIKE, 65),
        (PAPERLIKE, 129),
        (TINY, 80),  # 20 blocks: more than one score tile
        (TINY, 81),
    ],
)
def test_masked_scores_and_topk_equal_reference_at_edges(cfg, t):
    _check(t, t, 1, 2, 2, cfg)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=4, deadline=None)
@given(seed=seeds, t=st.integers(1, 100), b=st.integers(1, 2), h=st.integers(1, 2), g=st.sampled_from([1, 3]))
def test_masked_scores_and_topk_equal_reference(seed, t, b, h, g):
    _check(seed, t, b, h, g, [SMALL, TINY, PAPERLIKE][seed % 3])


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=6, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 70),
    lp=st.sampled_from([4, 16]),
    n=st.integers(1, 8),
    n_init=st.integers(0, 2),
    n_local=st.integers(0, 3),
    levels=st.sampled_from([2, 5, 1000]),
)
def test_topk_blocks_equals_reference_with_ties(seed, t, lp, n, n_init, n_local, levels):
    """The torch path (torch.topk + the sort kernel, Switches.fused_topk off) on any scores (few distinct
    levels: many ties; -inf picks when fewer blocks than n exist; n larger than Ns): the same
    [B, T, H, n] as reference.select_blocks. (The fused path breaks ties leftmost: a top-n, maybe
    not torch.topk's; test_fused_topk_is_a_top_n checks it on the same kind of scores.)"""
    gen = torch.Generator().manual_seed(seed)
    b, h, ns = 2, 3, -(-t // lp)
    scores = torch.randint(0, levels, (b, t, h, ns), generator=gen).float()
    forced, future = _masks(t, ns, lp, n_init, n_local)
    masked = scores.masked_fill(forced[None, :, None, :], float("inf"))
    masked = masked.masked_fill(future[None, :, None, :], float("-inf"))
    idx = _torch_path(masked.to(DEVICE), n).cpu()
    assert torch.equal(idx, ref.select_blocks(scores, n, lp, n_init, n_local))


def test_selection_is_two_kernels_and_one_topk():
    """With Switches.fused_topk off, nsa_attention's selection dispatches, besides its two Triton launches (masked scores, sort), one
    torch.topk and allocations: no PyTorch pass over the [B, T, H, Ns] scores for masks or sorting
    (selection_scores + reference.select_blocks, the path before, dispatches 21 aten ops: two
    masked_fill passes over the scores, topk, sort and 17 small ones)."""
    gen = torch.Generator().manual_seed(1)
    q, k_cmp, lse = _scores(gen, 1, 40, 4, 2, SMALL)
    off = Switches(fused_topk=False)
    with dispatched(selection, ("_scores_kernel", "_sort_picks_kernel")) as (recorded, launches):
        idx = selection.topk_blocks(
            selection.masked_selection_scores(q, k_cmp, lse, SMALL), SMALL.n_select, off
        )
    assert launches == ["_scores_kernel", "_sort_picks_kernel"]
    work = [op for op in recorded if op not in FREE_OPS]
    assert work == ["topk.default"], f"selection dispatched {work} besides its two kernels"
    assert idx.shape == (1, 40, 2, SMALL.n_select)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("t", [150, 157])
def test_scores_equal_at_every_tile_width(t):
    """The GPU picks the score kernel's tile by timing (selection.SCORES_CONFIGS: 16 or 32 selection blocks
    per tile); both widths give the reference's scores. l/d = 2: each tile's last compression block
    also scores the next tile's first selection block (the kernel carries that share across tiles),
    and 38-40 blocks span three 16-block tiles or two 32-block ones."""
    assert {c.kwargs["BJ"] for c in selection.SCORES_CONFIGS} == {16, 32}
    gen = torch.Generator().manual_seed(t)
    q, k_cmp, lse = _scores(gen, 1, t, 4, 2, TINY)
    ns = -(-t // TINY.select_len)
    want = ref.selection_scores(
        q.cpu(), k_cmp.cpu(), lse.cpu(), ns, TINY.block_len, TINY.stride, TINY.select_len
    )
    for bj in (16, 32):
        tile = Switches(scores_tile=(16, bj, 4, 1))
        got = selection.selection_scores(
            q, k_cmp, lse, ns, TINY.block_len, TINY.stride, TINY.select_len, switches=tile
        ).cpu()
        # up to each query's own block: the entries after a tile's last query are left unwritten
        upto_own = (torch.arange(ns)[None, :] <= (torch.arange(t) // TINY.select_len)[:, None])[
            None, :, None, :
        ]
        upto_own = upto_own.expand_as(want)
        torch.testing.assert_close(got[upto_own], want[upto_own], rtol=1e-5, atol=1e-6, msg=f"BJ={bj}")


# The fused top-n (selection.topk_blocks_fused, selection._topn_rows_kernel): against topk_blocks' torch path, and a
# valid Eq. 11 selection by reference.selection_shortfall. Interpreter tiles: BR = 64 rows for Ns <= 128
# (n <= 8), 16 rows at Ns = 300 (512 columns): rows not a multiple of BR, several programs.


def _torch_path(masked: torch.Tensor, n: int) -> torch.Tensor:
    return selection.topk_blocks(masked, n, Switches(fused_topk=False))


def _check_fused(masked, plain, n, lp, n_init, n_local, exact=True):
    got = selection.topk_blocks_fused(masked.to(DEVICE), n).cpu()
    assert got.dtype == torch.int32 and got.shape == (*masked.shape[:3], n)
    short = ref.selection_shortfall(got, plain, n, lp, n_init, n_local)
    assert (short == 0).all(), f"{int((short != 0).sum())} rows are not a top-n"
    # the picks ascending, none last as -1
    real = got >= 0
    assert not (~real[..., :-1] & real[..., 1:]).any()
    assert (torch.where(real[..., 1:], got[..., 1:] > got[..., :-1], True)).all()
    if exact:
        assert torch.equal(got, _torch_path(masked.to(DEVICE), n).cpu())


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize(
    ("cfg", "t", "b", "h", "g", "n"),
    [
        (SMALL, 1, 1, 1, 1, 3),  # one block: n > Ns, every row short of n
        (SMALL, 17, 1, 1, 1, 3),  # Ns = 2 < n
        (SMALL, 49, 2, 2, 1, 3),  # Ns = 4, early rows with fewer than n visible blocks
        (TINY, 81, 1, 2, 2, 5),  # Ns = 21 (not a power of two), 162 rows: three 64-row programs
        (TINY, 81, 2, 1, 1, 8),
        (PAPERLIKE, 129, 2, 1, 3, 4),
    ],
)
def test_fused_topk_equals_torch_path_on_masked_scores(cfg, t, b, h, g, n):
    gen = torch.Generator().manual_seed(t + n)
    q, k_cmp, lse = _scores(gen, b, t, h * g, h, cfg)
    ns = -(-t // cfg.select_len)
    plain = selection.selection_scores(q, k_cmp, lse, ns, cfg.block_len, cfg.stride, cfg.select_len).cpu()
    masked = selection.masked_selection_scores(q, k_cmp, lse, cfg)
    _check_fused(masked.cpu(), plain, n, cfg.select_len, cfg.n_initial, cfg.n_local)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize(("b", "t", "h", "lp", "n"), [(1, 1199, 1, 4, 16), (2, 37, 3, 1, 16)])
def test_fused_topk_many_blocks(b, t, h, lp, n):
    """Ns = 300 (512 columns, 16-row programs) and Ns = 37 at l' = 1: random float scores, no ties."""
    gen = torch.Generator().manual_seed(t)
    ns = -(-t // lp)
    plain = torch.randn(b, t, h, ns, generator=gen)
    forced, future = _masks(t, ns, lp, 1, 2)
    masked = plain.masked_fill(forced[None, :, None, :], float("inf"))
    masked = masked.masked_fill(future[None, :, None, :], float("-inf"))
    _check_fused(masked, plain, n, lp, 1, 2)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=6, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 70),
    lp=st.sampled_from([1, 4, 16]),
    n=st.integers(1, 9),
    n_init=st.integers(0, 2),
    n_local=st.integers(0, 3),
    levels=st.sampled_from([2, 5, None]),
)
def test_fused_topk_is_a_top_n(seed, t, lp, n, n_init, n_local, levels):
    """Any scores: with many ties (few levels) a top-n, maybe not torch.topk's; with random floats
    (levels None) the torch path's picks exactly, unless more blocks are forced than n (their +inf
    scores tie, and either pick is a top-n: NSAConfig refuses that configuration)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, ns = 2, 3, -(-t // lp)
    if levels is None:
        plain = torch.randn(b, t, h, ns, generator=gen)
    else:
        plain = torch.randint(0, levels, (b, t, h, ns), generator=gen).float()
    forced, future = _masks(t, ns, lp, n_init, n_local)
    masked = plain.masked_fill(forced[None, :, None, :], float("inf"))
    masked = masked.masked_fill(future[None, :, None, :], float("-inf"))
    _check_fused(masked, plain, n, lp, n_init, n_local, exact=levels is None and n_init + n_local <= n)


def test_topk_blocks_dispatches_the_fused_kernel_behind_its_flag():
    """Switches.fused_topk: one launch and no torch op over the scores; Ns above FUSED_TOPK_MAX_NS keeps
    torch.topk and the sort kernel (and still picks Eq. 11's blocks). On by default since its GPU test
    passed on an H100."""
    gen = torch.Generator().manual_seed(2)
    q, k_cmp, lse = _scores(gen, 1, 40, 4, 2, SMALL)
    masked = selection.masked_selection_scores(q, k_cmp, lse, SMALL)
    want = _torch_path(masked, SMALL.n_select)
    assert Switches().fused_topk  # the default
    names = ("_topn_rows_kernel", "_sort_picks_kernel")
    with dispatched(selection, names) as (recorded, launches):
        got = selection.topk_blocks(masked, SMALL.n_select)
    assert launches == ["_topn_rows_kernel"] and torch.equal(got, want)
    assert [op for op in recorded if op not in FREE_OPS] == []
    # one query at position Ns - 1 with l' = 1: all Ns = FUSED_TOPK_MAX_NS + 1 blocks visible, the first
    # and the last two forced (+inf)
    ns = selection.FUSED_TOPK_MAX_NS + 1
    plain = torch.randn(1, 1, 1, ns, generator=gen)
    forced = (torch.arange(ns) < 1) | (torch.arange(ns) > ns - 3)
    wide = plain.masked_fill(forced, float("inf"))
    with dispatched(selection, names) as (recorded, launches):
        got = selection.topk_blocks(wide.to(DEVICE), 5)
    assert launches == ["_sort_picks_kernel"]
    assert torch.equal(got.cpu(), ref.select_blocks(plain, 5, 1, 1, 2, q_pos=torch.tensor([ns - 1])))
    with pytest.raises(ValueError, match="Ns <="):
        selection.topk_blocks_fused(wide.to(DEVICE), 5)
