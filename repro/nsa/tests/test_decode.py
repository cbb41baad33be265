"""The decode step: one token against the three branches, the tokens its kernels count (§5.2), and
what one step asks of the host (two Triton launches and one torch.topk, nothing read back)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close, dispatched
from repro.nsa import decode, nsa_decode
from repro.nsa import reference as ref
from repro.nsa.tests.helpers import DEVICE, FP32_TOL, FREE_OPS, randn

seeds = st.integers(0, 2**31 - 1)
SMALL = ref.NSAConfig(block_len=16, stride=8, select_len=16, n_select=3, n_initial=1, n_local=1, window=24)


def _caches(gen, b, t, hq, h, d, cfg, dv=None):
    dv = dv or d
    q = randn(gen, b, 1, hq, d)
    k_c, v_c, k_s, v_s, k_w, v_w = (randn(gen, b, t, h, d if i % 2 == 0 else dv) for i in range(6))
    k_cmp = ref.compress(k_c, ref.mean_pool, cfg.block_len, cfg.stride)
    v_cmp = ref.compress(v_c, ref.mean_pool, cfg.block_len, cfg.stride)
    if k_cmp.shape[1] == 0:  # nothing compressed yet: the kernels still need a (never read) buffer
        k_cmp, v_cmp = randn(gen, b, 1, h, d), randn(gen, b, 1, h, dv)
    gates = torch.rand(b, 1, hq, 3, generator=gen, dtype=torch.float64)
    return [q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates]


def _check_decode(seed: int, t: int, g: int, b: int, cfg: ref.NSAConfig, heads=(16, 16)) -> None:
    """The decode kernels' output, selection and counts against the reference layer at position t - 1;
    ``heads`` = (Dk, Dv)."""
    gen = torch.Generator().manual_seed(seed)
    args = _caches(gen, b, t, 2 * g, 2, heads[0], cfg, heads[1])
    o, idx, counts = nsa_decode(*[x.float().to(DEVICE) for x in args], cfg)
    q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates = args
    pos = torch.tensor([t - 1])
    o_c, lse = ref.compressed_attention(q, k_cmp, v_cmp, cfg.block_len, cfg.stride, q_pos=pos)
    ns = -(-t // cfg.select_len)
    sc = ref.selection_scores(q, k_cmp, lse, ns, cfg.block_len, cfg.stride, cfg.select_len, q_pos=pos)
    idx_ref = ref.select_blocks(sc, cfg.n_select, cfg.select_len, cfg.n_initial, cfg.n_local, q_pos=pos)
    o_s = ref.selected_attention(q, k_s, v_s, idx_ref, cfg.select_len, q_pos=pos)
    o_w = ref.sliding_window_attention(q, k_w, v_w, cfg.window, q_pos=pos)
    o_ref = gates[..., 0:1] * o_c + gates[..., 1:2] * o_s + gates[..., 2:3] * o_w
    assert torch.equal(idx.cpu(), idx_ref)
    assert_rel_close(o.cpu(), o_ref, FP32_TOL, "decode output")
    want = ref.tokens_read(t - 1, cfg)
    blocks = idx_ref.long()[:, 0]  # [B, H, n]: the visible tokens of each selected block
    slc = torch.where(blocks >= 0, (t - blocks * cfg.select_len).clamp(max=cfg.select_len), 0).sum(-1)
    assert counts[..., 0].eq(want["cmp"]).all() and torch.equal(counts[..., 1].cpu().long(), slc)
    if cfg.n_local >= 1:  # tokens_read assumes the token's own block is selected
        assert counts[..., 1].eq(want["slc"]).all()
    assert counts[..., 2].eq(want["win"]).all()


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@settings(max_examples=4, deadline=None)
@given(
    seed=seeds,
    t=st.integers(1, 120),
    g=st.sampled_from([1, 2, 16]),
    b=st.integers(1, 2),
    heads=st.sampled_from([(16, 16), (16, 32), (32, 16)]),
)
def test_decode_equals_the_reference_at_the_last_position(seed, t, g, b, heads):
    """The decode kernels' output and selection equal the reference layer's at position t - 1, with
    value head sizes equal to the key's or not."""
    _check_decode(seed, t, g, b, SMALL, heads)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize("heads", [(192, 128), (60, 100)], ids=["paper-192-128", "padded-60-100"])
def test_decode_at_the_papers_and_padded_head_sizes(heads):
    """Decode at the paper's Dk = 192 (two key pieces), Dv = 128 (§4.1), and at sizes the kernels take
    padded (flash-linear-attention's 60 and 100)."""
    _check_decode(3, 70, 2, 1, SMALL, heads)


# l/d = 3 (compression blocks straddle two selection blocks), no forced blocks, n > blocks so far
OVERLAP = ref.NSAConfig(block_len=24, stride=8, select_len=16, n_select=5, n_initial=0, n_local=0, window=20)


@pytest.mark.claim("nsa/kernels-equal-reference", section="§3.4 (arXiv v2)")
@pytest.mark.parametrize(
    "cfg, t",
    [
        (SMALL, 1),  # nothing compressed yet, one (forced) block
        (SMALL, 16),  # the first compressed token, a full first block
        (SMALL, 300),  # 19 selection blocks: two score tiles of 16 in the first kernel
        (OVERLAP, 23),  # before the first compressed token: no block scores above 0, n > 2 blocks
        (OVERLAP, 33),  # 3 blocks for n = 5: top-k takes all of them, the rest padded with -1
        (OVERLAP, 270),  # 17 blocks, none forced: the selection is top-5 of the scores alone
    ],
)
def test_decode_edges(cfg, t):
    """Lengths at the edges of the decode kernels' loops: no compressed token, fewer blocks than n,
    more selection blocks than one score tile, overlapping compression blocks."""
    _check_decode(t, t, 2, 2, cfg)


def test_decode_step_does_not_wait_for_the_host():
    """One decode step is two Triton launches and one torch.topk: every other aten op it dispatches
    outside the kernels is an allocation or a view. A tensor built from host values (torch.tensor,
    a host-to-device copy), a value read back (.item(), .tolist(), int(t)) or a data-dependent shape
    (nonzero) would each show up here as an aten op (lift_fresh, _to_copy, _local_scalar_dense,
    nonzero) and fail the test; so would any elementwise op added between the kernels."""
    gen = torch.Generator().manual_seed(0)
    args = [x.float().to(DEVICE) for x in _caches(gen, 2, 100, 4, 2, 16, SMALL)]
    want = nsa_decode(*args, SMALL)
    with dispatched(decode, ("_decode_cmp_kernel", "_decode_sparse_kernel")) as (ops, launches):
        got = nsa_decode(*args, SMALL)
    assert launches == ["_decode_cmp_kernel", "_decode_sparse_kernel"]
    work = [op for op in ops if op not in FREE_OPS]
    assert work == ["topk.default"], f"decode step dispatched {work} besides its two kernels"
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def _count(t: int, cfg: ref.NSAConfig) -> torch.Tensor:
    """Tokens read per group for a cache of t tokens (one KV head, one query head, D = 16)."""
    gen = torch.Generator().manual_seed(t)
    args = _caches(gen, 1, t, 1, 1, 16, cfg)
    _, _, counts = nsa_decode(*[x.float().to(DEVICE) for x in args], cfg)
    return counts[0, 0].cpu()


@pytest.mark.claim("nsa/decode-tokens-read", section="§5.2, Table 4 (arXiv v2)")
@settings(max_examples=6, deadline=None)
@given(t=st.integers(1, 3000))
def test_counted_tokens_follow_the_bound(t):
    """Paper configuration, any cache length t (1-based position of the decoded token): the kernels
    read floor((t - l) / d) + 1 compressed tokens, min(n, blocks so far) - 1 full selected blocks plus
    the filled part of the token's own block, min(w, t) window tokens: at most floor((t - l) / d) + 1 + n l' + w."""
    cfg = ref.NSAConfig()
    c = _count(t, cfg)
    n_cmp = (t - cfg.block_len) // cfg.stride + 1 if t >= cfg.block_len else 0
    assert c[0] == n_cmp
    own = (t - 1) // cfg.select_len  # the decoded token's block, always selected (local), partly filled
    assert c[1] == (min(cfg.n_select, own + 1) - 1) * cfg.select_len + (t - own * cfg.select_len)
    assert c[1] <= cfg.n_select * cfg.select_len
    assert c[2] == min(t, cfg.window)
    assert c.sum() <= n_cmp + cfg.n_select * cfg.select_len + cfg.window


# Table 4 of the paper: tokens read per decoded token and the expected speedup over full attention.
TABLE4 = {8192: (2048, 4.0), 16384: (2560, 6.4), 32768: (3584, 9.1), 65536: (5632, 11.6)}


@pytest.mark.claim("nsa/decode-tokens-read", section="§5.2, Table 4 (arXiv v2)")
@pytest.mark.parametrize("t", sorted(TABLE4))
def test_table4_by_counting(t):
    """The decode kernels' counters at the paper's lengths: within 1 token of Table 4 (the table
    rounds floor((t - l) / d) + 1 = t/d - 1 up to t/d), and the same speedup t / tokens to 0.1."""
    c = _count(t, ref.NSAConfig())
    total = int(c.sum())
    paper_tokens, paper_speedup = TABLE4[t]
    assert total == t // 16 - 1 + 16 * 64 + 512
    assert abs(total - paper_tokens) <= 1
    assert round(t / total, 1) == paper_speedup
