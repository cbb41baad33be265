"""Native Sparse Attention (yuan2025nsa) in plain PyTorch: the ground truth for the Triton kernels.

Every function here is written from the paper's equations and builds explicit masks, so it is slow
(memory O(T^2)) and meant for small shapes. Layout as in flash-linear-attention: queries
``q [B, T, HQ, D]``, keys and values ``k, v [B, T, H, D]`` with ``H`` dividing ``HQ`` (GQA: query
head ``hq`` reads KV head ``hq // (HQ // H)``). Positions are 0-based here (the paper counts from 1),
so query ``t`` sees keys ``0..t``.

The three branches (§3.2, Eq. 5): compressed (§3.3.1), selected (§3.3.2) and sliding window (§3.3.3),
mixed by sigmoid gates. Every attention function also takes ``q_pos``, the positions of the given
queries (default ``0..Tq-1``), so that a slice of queries (or one decoded token) can be checked alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class NSAConfig:
    """The paper's hyper-parameters (§4.1): l = 32, d = 16, l' = 64, n = 16 (1 initial + 2 local
    among them), w = 512."""

    block_len: int = 32  # l: tokens per compression block
    stride: int = 16  # d: stride between compression blocks (d | l)
    select_len: int = 64  # l': tokens per selection block (d | l')
    n_select: int = 16  # n: selected blocks per query, forced ones included
    n_initial: int = 1  # always-selected blocks at the start of the sequence
    n_local: int = 2  # always-selected blocks ending at the query (its own block and the one before)
    window: int = 512  # w: sliding-window length

    def validate(self) -> None:
        for name in ("block_len", "stride", "select_len", "n_select", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"NSAConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_len % self.stride:
            raise ValueError(
                f"NSAConfig: stride d = {self.stride} must divide block_len l = {self.block_len} (§3.3.2)"
            )
        if self.select_len % self.stride:
            raise ValueError(
                f"NSAConfig: stride d = {self.stride} must divide select_len l' = {self.select_len} (§3.3.2)"
            )
        if self.n_initial < 0 or self.n_local < 0 or self.n_initial + self.n_local > self.n_select:
            raise ValueError(
                f"NSAConfig: n_initial + n_local = {self.n_initial + self.n_local} forced blocks must be "
                f"at most n_select = {self.n_select}"
            )


def _default_pos(t: int, device) -> torch.Tensor:
    return torch.arange(t, device=device)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v over the keys where ``mask`` is True.

    q [B, Tq, HQ, D]; k, v [B, Tk, H, D]; mask broadcastable to [B, Tq, H, Tk] (one mask per KV head,
    shared by its query heads) or [B, Tq, HQ, Tk]. Returns o [B, Tq, HQ, D] (zero where a row sees no
    key) and the log-sum-exp lse [B, Tq, HQ] (natural log, -inf for such rows), in q's dtype promoted
    to float32 at least.
    """
    dt = _compute_dtype(q)
    b, tq, hq, d = q.shape
    h = k.shape[2]
    group = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = k.to(dt).repeat_interleave(group, dim=2)
    vv = v.to(dt).repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bqhk", q.to(dt), kk) * scale
    if mask.shape[2] == h and h != hq:
        mask = mask.repeat_interleave(group, dim=2)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.einsum("bqhk,bkhd->bqhd", p, vv)
    return o, lse


# ----------------------------------------------------------------------------------------------
# Compression (§3.3.1, Eq. 7)


def num_compressed(t: int, block_len: int, stride: int) -> int:
    """Number of compression blocks in a sequence of ``t`` tokens: floor((t - l) / d) + 1 (0 if t < l)."""
    return 0 if t < block_len else (t - block_len) // stride + 1


def compressed_positions(nc: int, block_len: int, stride: int, device=None) -> torch.Tensor:
    """Position of the last token of each compression block, i d + l - 1: block i is visible to
    query t once that token is, i.e. when i d + l - 1 <= t (Eq. 7's range of i, 0-based)."""
    return torch.arange(nc, device=device) * stride + block_len - 1


def compression_blocks(x: torch.Tensor, block_len: int, stride: int) -> torch.Tensor:
    """The overlapping blocks x[i d : i d + l] of Eq. 7. x [B, T, H, D] -> [B, Nc, H, l, D]."""
    b, t, h, d = x.shape
    nc = num_compressed(t, block_len, stride)
    if nc == 0:
        return x.new_zeros(b, 0, h, block_len, d)
    # unfold gives [B, Nc, H, D, l]
    return x.unfold(1, block_len, stride).transpose(-1, -2)


class CompressionMLP(nn.Module):
    """phi of Eq. 7: a learnable MLP with an intra-block position encoding, mapping a block of l keys
    (or values) to one. [..., l, D] -> [..., D]."""

    def __init__(self, block_len: int, head_dim: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or head_dim
        self.pos = nn.Parameter(torch.randn(block_len, head_dim) * 0.02)  # intra-block position encoding
        self.fc1 = nn.Linear(block_len * head_dim, hidden)
        self.fc2 = nn.Linear(hidden, head_dim)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        x = (blocks + self.pos.to(blocks.dtype)).flatten(-2)
        return self.fc2(nn.functional.silu(self.fc1(x)))


def mean_pool(blocks: torch.Tensor) -> torch.Tensor:
    """The simplest phi (the one flash-linear-attention uses): the mean of the block. [..., l, D] -> [..., D]."""
    return blocks.mean(-2)


def compress(x: torch.Tensor, phi, block_len: int = 32, stride: int = 16) -> torch.Tensor:
    """Eq. 7: K~cmp = {phi(k[i d : i d + l]) | 0 <= i <= floor((T - l) / d)}.

    x [B, T, H, D] (keys or values); phi maps [..., l, D] -> [..., D]. Returns [B, Nc, H, D].
    """
    return phi(compression_blocks(x, block_len, stride))


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    block_len: int = 32,
    stride: int = 16,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the compressed tokens whose block lies in its past (§3.3.1).

    q [B, Tq, HQ, D]; k_cmp, v_cmp [B, Nc, H, D]. Returns (o [B, Tq, HQ, D], lse [B, Tq, HQ]).
    """
    q_pos = _default_pos(q.shape[1], q.device) if q_pos is None else q_pos
    kpos = compressed_positions(k_cmp.shape[1], block_len, stride, q.device)
    mask = (kpos[None, :] <= q_pos[:, None])[None, :, None, :]
    return masked_attention(q, k_cmp, v_cmp, mask, scale)


# ----------------------------------------------------------------------------------------------
# Selection (§3.3.2, Eqs. 8-12)


def block_overlap(
    nc: int, ns: int, block_len: int, stride: int, select_len: int, device=None
) -> torch.Tensor:
    """W [Nc, Ns]: how many of compression block i's l/d stride pieces lie in selection block j.

    Cut the sequence into pieces of d tokens: compression block i is pieces i .. i + l/d - 1, selection
    block j is pieces j l'/d .. (j + 1) l'/d - 1. Eq. 9 sums p_cmp over the blocks overlapping j with
    exactly these multiplicities (see :func:`selection_scores_eq9`).
    """
    r, c = select_len // stride, block_len // stride
    i = torch.arange(nc, device=device)[:, None]
    j = torch.arange(ns, device=device)[None, :]
    lo = torch.maximum(i, j * r)
    hi = torch.minimum(i + c, (j + 1) * r)
    return (hi - lo).clamp(min=0)


def selection_scores_eq9(p_cmp: torch.Tensor, ns: int, block_len: int, stride: int, select_len: int):
    """Eq. 9 term by term: p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[l'/d (j + 1) - 1 - m - n].

    The paper writes the index as l'/d * j - m - n, counting selection blocks and compressed tokens
    from 1; counted from 0 (as here) it becomes l'/d (j + 1) - 1 - m - n, and it then sums exactly the
    compression blocks overlapping selection block j (checked against :func:`block_overlap`).
    p_cmp [..., Nc] -> [..., Ns]. Out-of-range indices contribute nothing.
    """
    r, c = select_len // stride, block_len // stride
    nc = p_cmp.shape[-1]
    out = p_cmp.new_zeros(*p_cmp.shape[:-1], ns)
    for j in range(ns):
        for m in range(r):
            for n in range(c):
                idx = r * (j + 1) - 1 - m - n
                if 0 <= idx < nc:
                    out[..., j] += p_cmp[..., idx]
    return out


def selection_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    num_blocks: int,
    block_len: int = 32,
    stride: int = 16,
    select_len: int = 64,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block importance p_slc' (Eqs. 8-10): the compressed branch's attention probabilities
    p_cmp = softmax(q K~cmp^T) (Eq. 8), mapped to selection blocks (Eq. 9), summed over the query heads
    of each GQA group (Eq. 10).

    q [B, Tq, HQ, D]; k_cmp [B, Nc, H, D]; lse_cmp [B, Tq, HQ] from :func:`compressed_attention`.
    Returns [B, Tq, H, Ns] with Ns = ``num_blocks``.
    """
    dt = _compute_dtype(q)
    b, tq, hq, d = q.shape
    nc, h = k_cmp.shape[1], k_cmp.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q_pos = _default_pos(tq, q.device) if q_pos is None else q_pos
    kk = k_cmp.to(dt).repeat_interleave(hq // h, dim=2)
    s = torch.einsum("bqhd,bkhd->bqhk", q.to(dt), kk) * scale
    kpos = compressed_positions(nc, block_len, stride, q.device)
    visible = (kpos[None, :] <= q_pos[:, None])[None, :, None, :]
    lse = lse_cmp.to(dt)
    p = torch.where(visible, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    p = p.view(b, tq, h, hq // h, nc).sum(3)  # Eq. 10: shared by the group
    w = block_overlap(nc, num_blocks, block_len, stride, select_len, q.device).to(dt)
    return p @ w  # Eq. 9


def _eq11_masked(scores: torch.Tensor, select_len: int, n_initial: int, n_local: int, q_pos) -> torch.Tensor:
    """``scores [B, Tq, H, Ns]`` with Eq. 11's masks: the ``n_initial`` first blocks and the ``n_local``
    blocks ending at the query's own +inf (kept), the blocks after the query's -inf (never picked)."""
    tq, ns = scores.shape[1], scores.shape[-1]
    q_pos = _default_pos(tq, scores.device) if q_pos is None else q_pos
    own = (q_pos // select_len)[:, None]  # the block that holds the query
    j = torch.arange(ns, device=scores.device)[None, :]
    forced = (j < n_initial) | ((j <= own) & (j > own - n_local))
    s = scores.masked_fill(forced[None, :, None, :], float("inf"))
    return s.masked_fill((j > own)[None, :, None, :], float("-inf"))


def select_blocks(
    scores: torch.Tensor,
    n_select: int = 16,
    select_len: int = 64,
    n_initial: int = 1,
    n_local: int = 2,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-n selection (Eq. 11) among the blocks that start at or before the query, with the
    ``n_initial`` first blocks and the ``n_local`` blocks ending at the query always kept.

    scores [B, Tq, H, Ns]. Returns block indices [B, Tq, H, n] (int32), sorted ascending with -1
    (no block) last when fewer than n blocks exist yet.
    """
    b, tq, h, ns = scores.shape
    s = _eq11_masked(scores.float(), select_len, n_initial, n_local, q_pos)
    k = min(n_select, ns)
    vals, idx = s.topk(k, dim=-1)
    idx = torch.where(torch.isneginf(vals), ns, idx)  # no block: sort after the real ones
    idx = idx.sort(dim=-1).values
    idx = torch.where(idx == ns, -1, idx).to(torch.int32)
    if k < n_select:
        idx = torch.cat([idx, idx.new_full((b, tq, h, n_select - k), -1)], dim=-1)
    return idx


def selection_shortfall(
    picks: torch.Tensor,
    scores: torch.Tensor,
    n_select: int = 16,
    select_len: int = 64,
    n_initial: int = 1,
    n_local: int = 2,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """How far a selection ``picks [B, Tq, H, n]`` (block indices, -1 for none, any order) falls short
    of Eq. 11's top-n under ``scores [B, Tq, H, Ns]`` (the reference's), per row [B, Tq, H]: the
    largest relative gap between the k-th best score among the picks and the k-th best of the
    true top-n. 0 where the picks are a top-n (ties in any order); inf where a forced block is
    missing, a future block is picked or the count is wrong. Two correct kernels that round the
    scores differently pick differently only among near-ties, so their shortfall stays at the
    scores' rounding level (about 1e-3 relative for tf32 or bf16 scores)."""
    ns = scores.shape[-1]
    s = _eq11_masked(scores.double(), select_len, n_initial, n_local, q_pos)
    k = min(n_select, ns)
    best = s.topk(k, dim=-1).values  # descending; -inf where fewer than k blocks exist
    idx = picks.long()
    valid = (idx >= 0) & (idx < ns)
    got = torch.where(valid, s.gather(-1, idx.clamp(0, ns - 1)), float("-inf"))
    if got.shape[-1] < k:
        got = torch.cat([got, got.new_full((*got.shape[:-1], k - got.shape[-1]), float("-inf"))], -1)
    got = got.sort(dim=-1, descending=True).values[..., :k]
    extra = (valid.sum(-1) > k) | (
        valid.sum(-1) != torch.isfinite(best).sum(-1) + torch.isposinf(best).sum(-1)
    )
    srt = idx.sort(-1).values
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    same_inf = (torch.isinf(best) | torch.isinf(got)) & (got == best)
    finite = torch.isfinite(best) & torch.isfinite(got)
    gap = torch.where(finite, (best - got).clamp_min(0) / best.abs().clamp_min(1e-30), 0.0)
    gap = torch.where(finite | same_inf, gap, float("inf")).amax(-1)
    return torch.where(extra | dup.any(-1), float("inf"), gap)


def selected_mask(block_indices: torch.Tensor, block_size: int, tk: int, q_pos: torch.Tensor) -> torch.Tensor:
    """[B, Tq, H, Tk] bool: key s is read by the query when its block is selected and s <= t."""
    b, tq, h, _ = block_indices.shape
    ns = -(-tk // block_size)
    idx = block_indices.long()
    idx = torch.where(idx < 0, ns, idx)
    blocks = torch.zeros(b, tq, h, ns + 1, dtype=torch.bool, device=idx.device)
    blocks.scatter_(-1, idx, True)
    mask = blocks[..., :ns].repeat_interleave(block_size, dim=-1)[..., :tk]
    causal = torch.arange(tk, device=idx.device)[None, :] <= q_pos[:, None]
    return mask & causal[None, :, None, :]


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    block_size: int = 64,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 12: attention over the tokens of the selected blocks (causal inside the query's own block).

    q [B, Tq, HQ, D]; k, v [B, T, H, D]; block_indices [B, Tq, H, S] (negative = no block), shared by
    the query heads of a group. Returns [B, Tq, HQ, D].
    """
    q_pos = _default_pos(q.shape[1], q.device) if q_pos is None else q_pos
    mask = selected_mask(block_indices, block_size, k.shape[1], q_pos)
    return masked_attention(q, k, v, mask, scale)[0]


# ----------------------------------------------------------------------------------------------
# Sliding window (§3.3.3) and the gated sum (Eq. 5)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int = 512,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the last ``window`` tokens, t - w < s <= t. q [B, Tq, HQ, D], k, v [B, T, H, D]."""
    q_pos = _default_pos(q.shape[1], q.device) if q_pos is None else q_pos
    s = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = ((s <= q_pos[:, None]) & (s > q_pos[:, None] - window))[None, :, None, :]
    return masked_attention(q, k, v, mask, scale)[0]


def full_causal_attention(q, k, v, scale=None, q_pos=None) -> torch.Tensor:
    """Dense causal attention, the baseline every branch reduces to in its limit."""
    q_pos = _default_pos(q.shape[1], q.device) if q_pos is None else q_pos
    s = torch.arange(k.shape[1], device=q.device)[None, :]
    return masked_attention(q, k, v, (s <= q_pos[:, None])[None, :, None, :], scale)[0]


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    config: NSAConfig | None = None,
    scale: float | None = None,
    block_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5: o_t = sum_c g_t^c Attn(q_t, K~c, V~c) over c in (cmp, slc, win), each branch with its
    own keys and values (§3.2).

    q [B, T, HQ, D]; k_cmp, v_cmp [B, Nc, H, D] (already compressed, see :func:`compress`);
    k_slc, v_slc, k_win, v_win [B, T, H, D]; gates [B, T, HQ, 3] in (0, 1), order (cmp, slc, win).
    ``block_indices`` overrides the top-n selection. Returns (o [B, T, HQ, D], block_indices
    [B, T, H, n]).
    """
    cfg = config or NSAConfig()
    t = q.shape[1]
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, cfg.block_len, cfg.stride, scale)
    if block_indices is None:
        ns = -(-t // cfg.select_len)
        scores = selection_scores(q, k_cmp, lse, ns, cfg.block_len, cfg.stride, cfg.select_len, scale)
        block_indices = select_blocks(scores, cfg.n_select, cfg.select_len, cfg.n_initial, cfg.n_local)
    o_slc = selected_attention(q, k_slc, v_slc, block_indices, cfg.select_len, scale)
    o_win = sliding_window_attention(q, k_win, v_win, cfg.window, scale)
    g = gates.to(o_cmp.dtype)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
    return o, block_indices


def tokens_read(t: int, config: NSAConfig | None = None) -> dict[str, int]:
    """KV tokens one query at 0-based position t reads per GQA group, branch by branch (§5.2): the
    visible compressed tokens, the tokens of its selected blocks (up to n l'), the window (up to w)."""
    cfg = config or NSAConfig()
    n_cmp = num_compressed(t + 1, cfg.block_len, cfg.stride)
    own = t // cfg.select_len
    n_blocks = min(cfg.n_select, own + 1)
    # every selected block is full except the query's own, which holds t % l' + 1 visible tokens
    n_slc = (n_blocks - 1) * cfg.select_len + (t % cfg.select_len + 1)
    n_win = min(cfg.window, t + 1)
    return {"cmp": n_cmp, "slc": n_slc, "win": n_win, "total": n_cmp + n_slc + n_win}
