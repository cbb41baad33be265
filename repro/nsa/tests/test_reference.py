"""Claims checked on the PyTorch reference alone (no kernels): Eq. 9's mapping, top-n selection, the
branches' limits, causality of the whole gated layer. All float64, so equalities hold to ~1e-12."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.nsa import reference as ref
from repro.nsa.tests.helpers import randn

seeds = st.integers(0, 2**31 - 1)


@pytest.mark.claim("nsa/block-scores-eq9", section="§3.3.2, Eqs. 8-10 (arXiv v2)")
@settings(max_examples=30, deadline=None)
@given(
    seed=seeds,
    d=st.sampled_from([1, 2, 4, 8]),
    c=st.integers(1, 4),
    r=st.integers(1, 8),
    nc=st.integers(1, 40),
)
def test_eq9_double_sum_is_the_token_overlap(seed, d, c, r, nc):
    """Eq. 9's double sum weights compression block i in selection block j by the overlap of their
    token ranges [i d, i d + l) and [j l', (j + 1) l'), in units of d."""
    gen = torch.Generator().manual_seed(seed)
    l, lp = c * d, r * d
    ns = -(-((nc - 1) * d + l) // lp)
    w = ref.block_overlap(nc, ns, l, d, lp)
    tok = torch.zeros(nc, ns, dtype=torch.long)
    for i in range(nc):
        for j in range(ns):
            tok[i, j] = max(0, min(i * d + l, (j + 1) * lp) - max(i * d, j * lp))
    assert torch.equal(w * d, tok)
    p = torch.rand(3, nc, generator=gen, dtype=torch.float64)
    assert_rel_close(ref.selection_scores_eq9(p, ns, l, d, lp), p @ w.double(), 1e-12, "Eq. 9")


@pytest.mark.claim("nsa/block-scores-eq9", section="§3.3.2, Eqs. 8-10 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 70),
    h=st.integers(1, 2),
    g=st.integers(1, 3),
    cfg=st.sampled_from([(8, 4, 16), (16, 8, 16), (8, 8, 8)]),
)
def test_block_scores_sum_over_the_group(seed, t, h, g, cfg):
    """Eq. 10: the group's scores add up to G l/d for every query with a visible compressed block
    (each head's probabilities sum to 1 and every compression block has l/d stride pieces), and equal
    the per-head scores summed."""
    l, d, lp = cfg
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, 1, t, h * g, 16), randn(gen, 1, t, h, 16)
    k_cmp = ref.compress(k, ref.mean_pool, l, d)
    ns = -(-t // lp)
    _, lse = ref.compressed_attention(q, k_cmp, k_cmp, l, d)
    scores = ref.selection_scores(q, k_cmp, lse, ns, l, d, lp)
    has = torch.arange(t) >= l - 1
    total = scores.sum(-1)
    assert torch.allclose(total[:, has], torch.full_like(total[:, has], g * l / d))
    assert (total[:, ~has] == 0).all()
    per_head = [
        ref.selection_scores(q[:, :, [hq]], k_cmp[:, :, [hq // g]], lse[:, :, [hq]], ns, l, d, lp)
        for hq in range(h * g)
    ]
    summed = torch.cat([sum(per_head[hh * g : hh * g + g]) for hh in range(h)], dim=2)
    assert_rel_close(scores, summed, 1e-12, "group scores")


@pytest.mark.claim("nsa/top-n-selection", section="§3.3.2, Eq. 11; §4.1 (arXiv v2)")
@settings(max_examples=25, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 200),
    lp=st.sampled_from([4, 16]),
    n=st.integers(1, 8),
    n_init=st.integers(0, 2),
    n_local=st.integers(0, 2),
)
def test_top_n_keeps_forced_blocks_and_the_best(seed, t, lp, n, n_init, n_local):
    n_init = min(n_init, n)
    n_local = min(n_local, n - n_init)
    gen = torch.Generator().manual_seed(seed)
    ns = -(-t // lp)
    scores = torch.rand(1, t, 2, ns, generator=gen, dtype=torch.float64)
    idx = ref.select_blocks(scores, n, lp, n_init, n_local)
    for ti in range(t):
        own = ti // lp
        for h in range(2):
            row = idx[0, ti, h]
            chosen = set(row[row >= 0].tolist())
            assert len(chosen) == (row >= 0).sum() == min(n, own + 1), "distinct blocks, as many as exist"
            assert all(j <= own for j in chosen), "never a future block"
            forced = {j for j in range(own + 1) if j < n_init or j > own - n_local}
            assert forced <= chosen
            rest = chosen - forced
            others = set(range(own + 1)) - chosen
            if rest and others:
                assert min(scores[0, ti, h, list(rest)]) >= max(scores[0, ti, h, list(others)])


def _layer_inputs(gen, b, t, hq, h, d, cfg, dv=None):
    """q [B, T, HQ, d]; the raw keys (d) and values (dv, default d) of the three branches in the order
    k_cmp, v_cmp, k_slc, v_slc, k_win, v_win; gates."""
    q = randn(gen, b, t, hq, d)
    raw = [randn(gen, b, t, h, d if i % 2 == 0 else (dv or d)) for i in range(6)]
    gates = torch.rand(b, t, hq, 3, generator=gen, dtype=torch.float64)
    return q, raw, gates


def _layer(q, raw, gates, cfg, fn=ref.nsa_attention):
    k_c, v_c, k_s, v_s, k_w, v_w = raw
    k_cmp = ref.compress(k_c, ref.mean_pool, cfg.block_len, cfg.stride)
    v_cmp = ref.compress(v_c, ref.mean_pool, cfg.block_len, cfg.stride)
    return fn(q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates, cfg)


SMALL = ref.NSAConfig(block_len=8, stride=4, select_len=8, n_select=3, n_initial=1, n_local=1, window=12)


@pytest.mark.claim("nsa/causal", section="§3.2, Eq. 5 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(
    seed=seeds, t=st.integers(8, 60), cut=st.floats(0, 1), g=st.integers(1, 3), dv=st.sampled_from([4, 8, 12])
)
def test_reference_layer_is_causal(seed, t, cut, g, dv):
    """Change every input after position c (queries, raw keys and values of all branches, gates):
    outputs 0..c are unchanged. Value head sizes drawn apart from the key's (8), as the paper's 192
    and 128 (§4.1)."""
    gen = torch.Generator().manual_seed(seed)
    c = min(t - 2, int(cut * t))
    q, raw, gates = _layer_inputs(gen, 1, t, 2 * g, 2, 8, SMALL, dv)
    o1, i1 = _layer(q, raw, gates, SMALL)
    q2, gates2 = q.clone(), gates.clone()
    q2[:, c + 1 :] = randn(gen, *q2[:, c + 1 :].shape)
    gates2[:, c + 1 :] = torch.rand(*gates2[:, c + 1 :].shape, generator=gen, dtype=torch.float64)
    raw2 = [x.clone() for x in raw]
    for x in raw2:
        x[:, c + 1 :] = randn(gen, *x[:, c + 1 :].shape) * 3
    o2, i2 = _layer(q2, raw2, gates2, SMALL)
    assert torch.equal(i1[:, : c + 1], i2[:, : c + 1])
    assert_rel_close(o2[:, : c + 1], o1[:, : c + 1], 1e-12, "outputs before the change")


@pytest.mark.claim("nsa/compressed-branch", section="§3.3.1, Eq. 7 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 50),
    cd=st.sampled_from([(8, 4), (8, 8), (12, 4), (4, 1)]),
    g=st.integers(1, 2),
)
def test_compressed_branch_attends_the_compressed_blocks(seed, t, cd, g):
    """Query t (1-based) attends phi(k[i d + 1 : i d + l]) for i = 0 .. floor((t - l) / d): built here
    one query at a time with a learned phi, against the masked reference."""
    l, d = cd
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    phi = ref.CompressionMLP(l, 8).double()
    q, k, v = randn(gen, 1, t, 2 * g, 8), randn(gen, 1, t, 2, 8), randn(gen, 1, t, 2, 8)
    with torch.no_grad():
        o, lse = ref.compressed_attention(q, ref.compress(k, phi, l, d), ref.compress(v, phi, l, d), l, d)
        for ti in range(1, t + 1):  # 1-based position, as Eq. 7
            n_blocks = (ti - l) // d + 1 if ti >= l else 0
            assert n_blocks == ref.num_compressed(ti, l, d)
            for hq in range(2 * g):
                if n_blocks == 0:
                    assert (o[0, ti - 1, hq] == 0).all() and math.isinf(lse[0, ti - 1, hq])
                    continue
                kc = torch.stack([phi(k[0, i * d : i * d + l, hq // g]) for i in range(n_blocks)])
                vc = torch.stack([phi(v[0, i * d : i * d + l, hq // g]) for i in range(n_blocks)])
                p = torch.softmax(kc @ q[0, ti - 1, hq] / math.sqrt(8), 0)
                assert_rel_close(o[0, ti - 1, hq], p @ vc, 1e-10, f"query {ti}, head {hq}")


@pytest.mark.claim("nsa/selection-all-blocks-is-full", section="§3.3.2, Eq. 12 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(seed=seeds, t=st.integers(1, 70), lp=st.sampled_from([4, 16]), g=st.integers(1, 3))
def test_reference_selecting_every_block_is_full_attention(seed, t, lp, g):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(gen, 2, t, 2 * g, 8), randn(gen, 2, t, 2, 8), randn(gen, 2, t, 2, 4 + 4 * (seed % 3))
    ns = -(-t // lp)
    idx = ref.select_blocks(torch.rand(2, t, 2, ns, generator=gen), ns, lp, 1, 1)
    assert_rel_close(ref.selected_attention(q, k, v, idx, lp), ref.full_causal_attention(q, k, v), 1e-12)


@pytest.mark.claim("nsa/window-covers-is-full", section="§3.3.3 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(seed=seeds, t=st.integers(1, 70), extra=st.integers(0, 10))
def test_reference_window_covering_everything_is_full_attention(seed, t, extra):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(gen, 1, t, 4, 8), randn(gen, 1, t, 2, 8), randn(gen, 1, t, 2, 4 + 4 * (seed % 3))
    full = ref.full_causal_attention(q, k, v)
    assert_rel_close(ref.sliding_window_attention(q, k, v, t + extra), full, 1e-12)


@pytest.mark.claim("nsa/group-shared-selection", section="§3.3.2, Eq. 10 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(seed=seeds, t=st.integers(8, 60), g=st.integers(2, 4), dv=st.sampled_from([4, 8, 12]))
def test_selection_ignores_the_order_of_a_groups_heads(seed, t, g, dv):
    """Eq. 10 sums over the group's heads, so permuting the query heads inside each group leaves the
    selected blocks unchanged: the selection belongs to the group, not to a head."""
    gen = torch.Generator().manual_seed(seed)
    q, raw, gates = _layer_inputs(gen, 1, t, 2 * g, 2, 8, SMALL, dv)
    _, idx = _layer(q, raw, gates, SMALL)
    perm = torch.cat([hh * g + torch.randperm(g, generator=gen) for hh in range(2)])
    _, idx_perm = _layer(q[:, :, perm], raw, gates[:, :, perm], SMALL)
    assert idx.shape[2] == 2  # one index set per KV head
    assert torch.equal(idx, idx_perm)


def test_tokens_read_formula_matches_the_paper_bound():
    cfg = ref.NSAConfig()
    for t1 in (8192, 16384, 32768, 65536):  # 1-based position of the decoded token
        r = ref.tokens_read(t1 - 1, cfg)
        assert (
            r["total"] == (t1 - cfg.block_len) // cfg.stride + 1 + cfg.n_select * cfg.select_len + cfg.window
        )


def test_config_validation():
    with pytest.raises(ValueError, match=r"stride d = 5 must divide block_len l = 32"):
        ref.NSAConfig(stride=5).validate()
    with pytest.raises(ValueError, match=r"must divide select_len"):
        ref.NSAConfig(block_len=32, stride=16, select_len=40).validate()
    with pytest.raises(ValueError, match=r"forced blocks must be at most n_select = 2"):
        ref.NSAConfig(n_select=2, n_initial=1, n_local=2).validate()


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(70, 400))
def test_selection_shortfall_zero_for_top_n_and_flags_every_error(seed, t):
    """The benchmark's selection check (reference.selection_shortfall): 0 for Eq. 11's own picks in
    any order; the relative score gap when one free pick is swapped for the worst free block; inf
    for a missing forced block, a future block or a duplicate."""
    gen = torch.Generator().manual_seed(seed)
    n, lp = 4, 16
    ns = -(-t // lp)
    scores = torch.rand(1, t, 2, ns, generator=gen, dtype=torch.float64) + 0.5
    picks = ref.select_blocks(scores, n, lp, 1, 1)
    short = ref.selection_shortfall(picks.flip(-1), scores, n, lp, 1, 1)
    assert short.shape == (1, t, 2) and not short.any()

    row, own = t - 1, (t - 1) // lp  # the last query: blocks 0 (initial) and own (local) are forced
    chosen = picks[0, row, 0].tolist()
    free_picks = [j for j in chosen if j not in (0, own)]
    others = [j for j in range(1, own) if j not in chosen]
    s = scores[0, row, 0]
    worst, victim = min(others, key=lambda j: s[j].item()), min(free_picks, key=lambda j: s[j].item())

    def with_pick(old, new):
        p = picks.clone()
        p[0, row, 0, chosen.index(old)] = new
        return ref.selection_shortfall(p, scores, n, lp, 1, 1)

    got = with_pick(victim, worst)
    assert got[0, :row].eq(0).all() and got[0, row, 1] == 0
    assert torch.isclose(got[0, row, 0], (s[victim] - s[worst]) / s[victim])
    assert with_pick(0, worst)[0, row, 0] == float("inf")  # the initial block dropped
    assert with_pick(own, worst)[0, row, 0] == float("inf")  # the local block dropped
    assert with_pick(victim, free_picks[-1] if free_picks[-1] != victim else 0)[0, row, 0] == float("inf")
    early = picks.clone()
    early[0, 0, 0, 1] = 1  # query 0 sees only block 0: a future block
    assert ref.selection_shortfall(early, scores, n, lp, 1, 1)[0, 0, 0] == float("inf")
