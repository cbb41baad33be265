"""Token selection (yuan2025nsa §3.3.2): block importance scores (Eqs. 8-10) and the top-n blocks
(Eq. 11), on the compressed branch's log-sum-exp, without storing its probabilities.

* :func:`selection_scores` (``_scores_kernel``): p_cmp recomputed from the stored log-sum-exp, summed
  over the query heads of a group (Eq. 10) and into selection blocks with two small matmuls per tile
  (Eq. 9 as [BC, BJ] overlap matrices: this tile's blocks and the next's). With Eq. 11's masks
  (:func:`masked_selection_scores`, what the training forward runs) it writes every entry, forced
  blocks +inf and future ones -inf, so that top-n needs no other mask.
* :func:`topk_blocks`: Eq. 11's top-n as one pass over the masked scores (``_topn_rows_kernel``,
  ``Switches.fused_topk``), else ``torch.topk`` and ``_sort_picks_kernel``; the picks sorted
  ascending, -1 for none, as ``reference.select_blocks`` returns them.

The decode step (``decode.py``) computes the same scores for its one token inside its first kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.nsa import reference as ref
from repro.nsa.common import (
    LOG2E,
    check_qkv,
    check_tensor,
    dot,
    interpreting,
    is_fp32,
    kernel_dims,
    key_pieces,
    load_cols,
    pad_heads,
    softmax_scale,
    visible_keys,
)
from repro.nsa.config import Switches


@triton.jit
def _overlap(ic, offs_j, R: tl.constexpr, C: tl.constexpr):
    """Eq. 9's multiplicities: stride pieces of compression block i inside selection block j."""
    lo = tl.maximum(ic[:, None], offs_j[None, :] * R)
    hi = tl.minimum(ic[:, None] + C, offs_j[None, :] * R + R)
    return tl.maximum(hi - lo, 0).to(tl.float32)


@triton.jit
def _scores_kernel(
    Q, KC, LSE, SCORES,
    sqb, sqt, sqh, skb, skt, skh,
    T, NC, NS, H, G, scale_log2, T_BUCKET,
    STRIDE: tl.constexpr, BLOCK_LEN: tl.constexpr, SELECT_LEN: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BJ: tl.constexpr, IEEE: tl.constexpr,
    MASKED: tl.constexpr = False, N_INITIAL: tl.constexpr = 1, N_LOCAL: tl.constexpr = 2,
    D2: tl.constexpr = 0,
):  # fmt: skip
    # Eqs. 8-10 for BM queries of one group: p_cmp = exp(q k_cmp^T - lse), summed over the group's
    # heads and mapped to selection blocks [j0, j0 + BJ). Selection block j is stride pieces
    # j R .. j R + R - 1 (R = l'/d); the compression blocks overlapping it are i = j R - (C - 1) ..
    # j R + R - 1 (C = l/d). Tile j0 computes p for its own blocks i in [j0 R, j0 R + BJ R) once,
    # summed over the group's heads first (Eq. 9 is linear), and maps that sum both onto its own
    # selection blocks and onto the next tile's (the last C - 1 blocks overlap those, C - 1 <= BJ R),
    # which the next iteration adds: no block's logits are computed twice. T_BUCKET: only a key for
    # the launcher's autotuning. MASKED: Eq. 11's masks as well, as the decode kernel does: every
    # row's forced blocks (the N_INITIAL first, the N_LOCAL ending at the query) +inf, its future
    # blocks -inf, and all NS columns written, so that one torch.topk does the selection.
    R: tl.constexpr = SELECT_LEN // STRIDE
    C: tl.constexpr = BLOCK_LEN // STRIDE
    BC: tl.constexpr = BJ * R
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    HQ = H * G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < T
    t_last = tl.minimum(pid_m * BM + BM, T) - 1
    j_end = tl.minimum(t_last // SELECT_LEN + 1, NS)
    kc_base = KC + b * skb + h * skh
    carry = tl.zeros([BM, BJ], tl.float32)  # the previous tile's blocks' share of this tile's j
    for j0 in range(0, j_end, BJ):
        offs_j = j0 + tl.arange(0, BJ)
        ic = j0 * R + tl.arange(0, BC)
        kc = tl.load(kc_base + ic[:, None] * skt + offs_d[None, :], mask=(ic < NC)[:, None], other=0.0)
        kc2 = kc
        if D2 > 0:  # a key row's second piece (common.py)
            kc2 = load_cols(kc_base, 0, ic * skt, ic < NC, D, D2)
        vis_c = visible_keys(offs_m, ic, NC, STRIDE, BLOCK_LEN - 1, 0)
        p_sum = tl.zeros([BM, BC], tl.float32)
        for g in range(G):
            hq = h * G + g
            q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)  # fmt: skip
            lse = tl.load(LSE + (b * T + offs_m) * HQ + hq, mask=row_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
            qk = dot(q, tl.trans(kc), IEEE)
            if D2 > 0:
                q2 = load_cols(Q + b * sqb + hq * sqh, 0, offs_m * sqt, row_ok, D, D2)
                qk += dot(q2, tl.trans(kc2), IEEE)
            p_sum += tl.where(vis_c, tl.exp2(qk * scale_log2 - lse2[:, None]), 0.0)
        acc = carry + dot(p_sum, _overlap(ic, offs_j, R, C), IEEE)
        if C > 1:  # blocks straddling the next tile's start exist only when compression blocks overlap
            carry = dot(p_sum, _overlap(ic, offs_j + BJ, R, C), IEEE)
        if MASKED:
            own = (offs_m // SELECT_LEN)[:, None]  # the query's own selection block
            jj = offs_j[None, :]
            forced = (jj < N_INITIAL) | ((jj <= own) & (jj > own - N_LOCAL))
            acc = tl.where(forced, float("inf"), acc)
            acc = tl.where(jj > own, float("-inf"), acc)
        out = SCORES + (b * T * H + h) * NS + offs_m[:, None] * (H * NS) + offs_j[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & (offs_j[None, :] < NS))
    if MASKED:  # the blocks after this tile's last query: in every row's future
        for j0 in range(tl.cdiv(j_end, BJ) * BJ, NS, BJ):
            offs_j = j0 + tl.arange(0, BJ)
            out = SCORES + (b * T * H + h) * NS + offs_m[:, None] * (H * NS) + offs_j[None, :]
            tl.store(out, tl.full([BM, BJ], float("-inf"), tl.float32),
                     mask=row_ok[:, None] & (offs_j[None, :] < NS))  # fmt: skip


# the score kernel's launch shapes on a GPU, chosen by timing at the first call of each
# (T rounded up to a power of two, G, D, l, d, l', masked) and kept for the process: queries per
# program, selection blocks per tile, warps, and software-pipelining stages of the head loop. Before
# its change of 2026-11-25 the kernel ran one shape with no pipelining and spilled 104-120 bytes per thread; with
# the heads summed before the overlap matmul and these six shapes the stage went from 40.35 to
# 8.2 ms at T = 64k on an H100 (results/*-breakdown-before-scores-change.json, *-breakdown.json)
SCORES_CONFIGS = [
    triton.Config({"BM": bm, "BJ": bj}, num_warps=w, num_stages=st)
    for bm, bj, w, st in (
        (64, 16, 8, 1), (64, 16, 8, 2), (64, 16, 8, 3), (64, 32, 8, 1), (64, 32, 8, 2), (64, 32, 8, 3),
    )  # no spills at D = 128 offline; 4 warps, BM = 128 or BM = 32 spill (sm90_check)
]  # fmt: skip


_scores_tuned = triton.autotune(
    SCORES_CONFIGS, key=["T_BUCKET", "G", "D", "STRIDE", "BLOCK_LEN", "SELECT_LEN", "MASKED", "IEEE"]
)(_scores_kernel)

#: the configs of keys in two pieces (the paper's Dk = 192 = 128 + 64, common.py): all but 32 blocks a
#: tile with 3 stages, which spills 8 bytes there (255 registers; the others 178-253, lab/sm90_check)
SCORES_CONFIGS_WIDE = [c for c in SCORES_CONFIGS if not (c.kwargs["BJ"] == 32 and c.num_stages == 3)]
_scores_wide_tuned = triton.autotune(
    SCORES_CONFIGS_WIDE,
    key=["T_BUCKET", "G", "D", "D2", "STRIDE", "BLOCK_LEN", "SELECT_LEN", "MASKED", "IEEE"],
)(_scores_kernel)


def selection_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    num_blocks: int,
    block_len: int = 32,
    stride: int = 16,
    select_len: int = 64,
    scale: float | None = None,
    mask: tuple[int, int] | None = None,
    switches: Switches | None = None,
) -> torch.Tensor:
    """Block importance p_slc' (Eqs. 8-10) with a Triton kernel. Returns [B, T, H, Ns] float32.

    q [B, T, HQ, Dk]; k_cmp [B, Nc, H, Dk]; lse_cmp [B, T, HQ] from :func:`compressed_attention`. Needs
    l'/d a power of two and l/d <= 17 (the kernel's tiles: at least 16 selection blocks of l'/d
    compression blocks each; a block's last l/d - 1 pieces overlap the next tile). On a GPU the small matmuls run in tf32 for 16-bit inputs:
    scores within about 1e-3 relative, enough to rank blocks.

    ``mask = (n_initial, n_local)``: the kernel also applies Eq. 11's masks (see
    :func:`masked_selection_scores`); without it, entries of blocks after a query's own are not written.
    """
    b, t, hq, h, dk, _ = check_qkv("selection_scores", q, k_cmp, None)
    r, c = select_len // stride, block_len // stride
    if select_len % stride or block_len % stride:
        raise ValueError(
            f"selection_scores: stride d = {stride} must divide block_len {block_len} and select_len {select_len}"
        )
    if r & (r - 1) or c - 1 > 16:
        raise ValueError(
            f"selection_scores: needs select_len / stride a power of two and block_len / stride <= 17, got "
            f"{r} and {c}"
        )
    if t * h * num_blocks >= 2**31:
        raise ValueError(
            f"selection_scores: T * H * num_blocks = {t * h * num_blocks} is too large (at most 2^31 - 1)"
        )
    if lse_cmp.shape != (b, t, hq):
        raise ValueError(
            f"selection_scores: lse_cmp must be [B, T, HQ] = {(b, t, hq)}, got {tuple(lse_cmp.shape)}"
        )
    scale = softmax_scale(scale, dk)
    dk_k = kernel_dims(dk, 1)[0]  # zero-padded key columns add nothing to q k^T
    q, k_cmp = pad_heads(q, dk_k).contiguous(), pad_heads(k_cmp, dk_k).contiguous()
    lse_cmp = lse_cmp.float().contiguous()
    d, d2 = key_pieces(dk_k)
    scores = torch.empty(b, t, h, num_blocks, device=q.device, dtype=torch.float32)
    n_initial, n_local = mask if mask is not None else (0, 0)
    args = (
        q, k_cmp, lse_cmp, scores,
        q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        t, k_cmp.shape[1], num_blocks, h, hq // h, scale * LOG2E, triton.next_power_of_2(t),
    )  # fmt: skip
    consts = dict(
        STRIDE=stride, BLOCK_LEN=block_len, SELECT_LEN=select_len, D=d, IEEE=is_fp32(q),
        MASKED=mask is not None, N_INITIAL=n_initial, N_LOCAL=n_local, **({"D2": d2} if d2 else {}),
    )  # fmt: skip
    tile = (switches or Switches()).scores_tile
    if interpreting():  # one small shape (16 x 16 unless the switches name one)
        bm, bj = tile[:2] if tile is not None else (16, 16)
        _scores_kernel[(triton.cdiv(t, bm), b * h)](*args, **consts, BM=bm, BJ=bj, num_warps=4)
    elif tile is not None or (d2 and is_fp32(q)):
        # fp32 at two key pieces: one shape, 64 x 16 with one stage; the others spill 1-17 KB a thread
        # there (lab/sm90_check fp32); fp32 is the tests' exact path
        bm, bj, warps, stages = tile if tile is not None else (64, 16, 8, 1)
        _scores_kernel[(triton.cdiv(t, bm), b * h)](*args, **consts, BM=bm, BJ=bj, num_warps=warps,
                                                     num_stages=stages)  # fmt: skip
    else:  # the GPU times SCORES_CONFIGS at the first call of each shape
        grid = lambda meta: (triton.cdiv(t, meta["BM"]), b * h)  # noqa: E731
        (_scores_wide_tuned if d2 else _scores_tuned)[grid](*args, **consts)
    return scores


def masked_selection_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    config: ref.NSAConfig,
    scale: float | None = None,
    switches: Switches | None = None,
) -> torch.Tensor:
    """:func:`selection_scores` with Eq. 11's masks applied in the same kernel, as the decode step does:
    the forced blocks (the ``n_initial`` first and the ``n_local`` ending at the query) are +inf, the
    blocks after the query's own -inf, every entry written. The other entries are bit for bit those
    of :func:`selection_scores`, so ``reference.select_blocks`` on the unmasked scores and
    :func:`topk_blocks` on these pick the same blocks. q [B, T, HQ, D]; k_cmp [B, Nc, H, D];
    lse_cmp [B, T, HQ]. Returns [B, T, H, Ns] float32, Ns = ceil(T / l')."""
    ns = triton.cdiv(q.shape[1], config.select_len)
    mask = (config.n_initial, config.n_local)
    return selection_scores(
        q, k_cmp, lse_cmp, ns, config.block_len, config.stride, config.select_len, scale, mask, switches
    )


# ----------------------------------------------------------------------------------------------
# Top-n (Eq. 11)


#: the one-pass top-n's limits: a program holds its rows' Ns scores in registers (BR * Ns <= 8192) and
#: sorts BR x n x n ranks; beyond them :func:`topk_blocks` takes torch.topk and the sort kernel
FUSED_TOPK_MAX_NS = 4096
FUSED_TOPK_MAX_N = 64


@triton.jit
def _ascending_blocks(key, slot, NS):
    """Picks ``key [BR, BSEL]`` (distinct blocks, ``NS`` for none) sorted ascending per row, none last
    as -1."""
    # the real picks are distinct blocks: a pick's place in ascending order is how many picks are smaller
    rank = tl.sum((key[:, None, :] < key[:, :, None]).to(tl.int32), 2)  # [BR, BSEL]
    blocks = tl.min(tl.where(rank[:, None, :] == slot[None, :, None], key[:, None, :], NS), 2)
    return tl.where(blocks == NS, -1, blocks)


@triton.jit
def _topn_rows_kernel(
    SCORES, BI, ROWS, NS, K_TOP, S,
    BR: tl.constexpr, NS_POW2: tl.constexpr, BSEL: tl.constexpr,
):  # fmt: skip
    # Eq. 11's top-n and its sort in one pass over BR rows of masked scores SCORES [ROWS, NS] float32
    # (forced blocks +inf, future blocks -inf; NaN-free: a NaN would be neither picked nor skipped
    # reliably): K_TOP = min(n, NS) rounds of a row-wise max (leftmost on ties), each pick's column
    # then set to -inf; a pick of -inf is none. The picks sorted ascending, none last as -1, padded
    # to S, written to BI [ROWS, S] int32, as torch.topk + _sort_picks_kernel give them.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < ROWS
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, NS_POW2)
    x = tl.load(
        SCORES + rows64[:, None] * NS + cols[None, :],
        mask=row_ok[:, None] & (cols[None, :] < NS),
        other=float("-inf"),
    )
    slot = tl.arange(0, BSEL)
    key = tl.full([BR, BSEL], NS, tl.int32)
    for i in range(K_TOP):
        best, at = tl.max(x, 1, return_indices=True, return_indices_tie_break_left=True)
        at = at.to(tl.int32)
        key = tl.where(slot[None, :] == i, tl.where(best == float("-inf"), NS, at)[:, None], key)
        x = tl.where(cols[None, :] == at[:, None], float("-inf"), x)  # not picked again
    blocks = _ascending_blocks(key, slot, NS)
    tl.store(BI + rows64[:, None] * S + slot[None, :], blocks, mask=row_ok[:, None] & (slot[None, :] < S))


@triton.jit
def _sort_picks_kernel(
    TOP_VAL, TOP_IDX, BI, ROWS, K_TOP, S, NS,
    BR: tl.constexpr, BSEL: tl.constexpr,
):  # fmt: skip
    # Eq. 11's block indices of BR rows from top-k's K_TOP picks per row (TOP_VAL, TOP_IDX [ROWS, K_TOP]),
    # as the decode kernel does for its one row: a pick of -inf (a future block) is none; the rest
    # sorted ascending, none last as -1, padded to S, written to BI [ROWS, S] int32.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < ROWS
    rows64 = rows.to(tl.int64)
    slot = tl.arange(0, BSEL)
    picked = row_ok[:, None] & (slot[None, :] < K_TOP)
    at = rows64[:, None] * K_TOP + slot[None, :]
    val = tl.load(TOP_VAL + at, mask=picked, other=float("-inf"))
    key = tl.load(TOP_IDX + at, mask=picked, other=0).to(tl.int32)
    key = tl.where(val == float("-inf"), NS, key)  # none sorts after every real block
    blocks = _ascending_blocks(key, slot, NS)
    tl.store(BI + rows64[:, None] * S + slot[None, :], blocks, mask=row_ok[:, None] & (slot[None, :] < S))


def check_scores(fn: str, masked_scores, n_select: int) -> None:
    """The masked scores [B, T, H, Ns] and n of a top-n call, on a device the kernels run on."""
    check_tensor(fn, "masked_scores", masked_scores, 4, "[B, T, H, Ns]")
    if n_select < 1:
        raise ValueError(f"{fn}: n_select must be >= 1, got {n_select}")
    if masked_scores.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{fn}: needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter")


def topk_blocks_fused(masked_scores: torch.Tensor, n_select: int) -> torch.Tensor:
    """:func:`topk_blocks` as one Triton kernel (``_topn_rows_kernel``): each program reads BR rows
    of the scores once and picks n times the row's largest (leftmost on ties), then sorts the picks
    ascending with -1 for none (a pick of -inf), padded to n. The same contract as :func:`topk_blocks`:
    with no ties the same tensor; with ties a top-n too, maybe another one. Scores must be NaN-free
    (the masked scores kernel writes none). Ns <= FUSED_TOPK_MAX_NS, n <= FUSED_TOPK_MAX_N."""
    check_scores("topk_blocks_fused", masked_scores, n_select)
    b, t, h, ns = masked_scores.shape
    if ns > FUSED_TOPK_MAX_NS or n_select > FUSED_TOPK_MAX_N:
        raise ValueError(
            f"topk_blocks_fused: needs Ns <= {FUSED_TOPK_MAX_NS} and n <= {FUSED_TOPK_MAX_N}, got Ns = {ns}, "
            f"n = {n_select}"
        )
    scores = masked_scores.float().contiguous()
    bi = torch.empty(b, t, h, n_select, device=masked_scores.device, dtype=torch.int32)
    rows = b * t * h
    if rows == 0:
        return bi
    ns_pow2 = triton.next_power_of_2(max(ns, 1))
    bsel = triton.next_power_of_2(n_select)
    br = max(1, min(64, 8192 // ns_pow2, 8192 // (bsel * bsel)))
    _topn_rows_kernel[(triton.cdiv(rows, br),)](
        scores, bi, rows, ns, min(n_select, ns), n_select,
        BR=br, NS_POW2=ns_pow2, BSEL=bsel, num_warps=4,
    )  # fmt: skip
    return bi


def topk_blocks(masked_scores: torch.Tensor, n_select: int, switches: Switches | None = None) -> torch.Tensor:
    """Eq. 11's top-n on scores from :func:`masked_selection_scores`: one ``torch.topk`` and one small
    Triton kernel that drops the picks of -inf (future blocks), sorts the rest ascending and pads with
    -1, as ``reference.select_blocks`` returns them (or :func:`topk_blocks_fused` where ``Switches.fused_topk``
    and the shape allow). masked_scores [B, T, H, Ns] float32. Returns [B, T, H, n] int32."""
    check_scores("topk_blocks", masked_scores, n_select)
    b, t, h, ns = masked_scores.shape
    if (switches or Switches()).fused_topk and 0 < ns <= FUSED_TOPK_MAX_NS and n_select <= FUSED_TOPK_MAX_N:
        return topk_blocks_fused(masked_scores, n_select)
    top_val, top_idx = masked_scores.topk(min(n_select, ns), dim=-1)
    bi = torch.empty(b, t, h, n_select, device=masked_scores.device, dtype=torch.int32)
    rows = b * t * h
    br = 32
    _sort_picks_kernel[(triton.cdiv(rows, br),)](
        top_val, top_idx, bi, rows, top_idx.shape[-1], n_select, ns,
        BR=br, BSEL=triton.next_power_of_2(n_select), num_warps=4,
    )  # fmt: skip
    return bi
