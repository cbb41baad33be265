"""Triton kernels of Native Sparse Attention (yuan2025nsa §3.4). Launchers and autograd live in ``ops.py``.

Three families:

* ``_strided_*``: attention over keys that sit at positions ``i * STRIDE + OFFSET``, causal, with an
  optional window. The compressed branch is STRIDE = d, OFFSET = l - 1 (a compressed token is
  visible once its block's last token is, §3.3.1); the sliding window is STRIDE = 1, OFFSET = 0,
  WINDOW = w (§3.3.3). FlashAttention-2 tiling: a tile of BM queries of one head per program; the
  forward may walk the key tiles every query of its tile sees without a mask (``SPLIT``).
* ``_scores_kernel``: the block importance of Eqs. 8-10, recomputing p_cmp from the stored
  log-sum-exp, summing it over the query heads of a group, and into selection blocks with two small
  matmuls per tile (Eq. 9 as [BC, BJ] overlap matrices: this tile's blocks and the next's).
* ``_slc_*``: the selected branch with the paper's group-centric loading (§3.4, Figure 3): one
  program per (query position, KV head) loads the G query heads of that group as a [BG, D] tile and
  streams only the n selected KV blocks; the backward's dK/dV walks the (block, query) pairs sorted
  by block (a CSR list, as flash-linear-attention's kernel does), in fixed-size chunks so that the
  always-selected first block does not serialise on one program; a chunk adds its partial sums
  with atomics when it moves to the next block. ``_slc_bwd_dkdv_tiled_kernel`` (``ops.TILED_SLC_BWD``,
  the default since 2026-11-27) is the block-major alternative: per KV block its list of queries, BQ
  queries x G heads per matmul, atomics only for blocks split over several programs.

Numerics: logits in base 2 (``scale * log2(e)`` folded in), log-sum-exp stored in natural log,
fp32 accumulation. A row that sees no key gets o = 0 and lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _key_range(t_first, t_last, NK, STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
               BN: tl.constexpr):  # fmt: skip
    """Key indices [start, end) that queries t_first..t_last may see; start rounded down to BN."""
    end = tl.where(t_last >= OFFSET, (t_last - OFFSET) // STRIDE + 1, 0)
    end = tl.minimum(end, NK)
    start = end * 0
    if WINDOW > 0:
        lo = t_first - WINDOW + 1 - OFFSET  # first visible key position is t_first - WINDOW + 1
        start = tl.where(lo > 0, (lo + STRIDE - 1) // STRIDE, 0)
        start = (start // BN) * BN
    return start, end


@triton.jit
def _visible(offs_m, offs_n, NK, STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr):
    kpos = offs_n * STRIDE + OFFSET
    vis = (kpos[None, :] <= offs_m[:, None]) & (offs_n[None, :] < NK) & (offs_n[None, :] >= 0)
    if WINDOW > 0:
        vis = vis & (offs_m[:, None] - kpos[None, :] < WINDOW)
    return vis


@triton.jit
def _tile(pid, B: tl.constexpr, LIMIT, D: tl.constexpr):
    """The program's tile of B rows: their indices, the head dimension's and which rows are < LIMIT."""
    offs = pid * B + tl.arange(0, B)
    return offs, tl.arange(0, D), offs < LIMIT


@triton.jit
def _query_head(pid_bh, HQ, G):
    """For the program axis ``pid_bh = b HQ + hq``: ``b`` (64-bit, for the scalar bases), ``hq`` and
    its KV head ``h``."""
    b = (pid_bh // HQ).to(tl.int64)
    hq = pid_bh % HQ
    return b, hq, hq // G


@triton.jit
def _group_rows(pid_bh, H, G, BG: tl.constexpr, D: tl.constexpr):
    """Group-centric rows (§3.4) for the program axis ``pid_bh = b H + h``: ``b`` (64-bit), ``h``,
    HQ = H G, the head dimension's indices and the group's query heads ``hq`` (rows past G masked
    by ``g_ok``)."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    HQ = H * G
    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    hq = h * G + offs_g
    return b, h, HQ, offs_d, g_ok, hq


@triton.jit
def _load_pair(X, Y, base, off, ok):
    """Two tensors of one layout at 64-bit scalar ``base`` + 32-bit tile offsets ``off``; rows not
    ``ok`` read as 0."""
    x = tl.load(X + base + off, mask=ok[:, None], other=0.0)
    y = tl.load(Y + base + off, mask=ok[:, None], other=0.0)
    return x, y


@triton.jit
def _lse2(LSE, pos, HQ, hq, ok):
    """The log-sum-exp of [B T, HQ] rows at (``pos`` = b T + t, ``hq``) in base 2, 0 where the row
    saw no key."""
    lse = tl.load(LSE + pos * HQ + hq, mask=ok, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)


@triton.jit
def _row_stats(LSE, DELTA, pos, HQ, hq, ok):
    """A backward tile's per-row statistics: :func:`_lse2` and delta = rowsum(dO * O)."""
    delta = tl.load(DELTA + pos * HQ + hq, mask=ok, other=0.0)
    return _lse2(LSE, pos, HQ, hq, ok), delta


@triton.jit
def _online_update(q, k, v, visible, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr):
    """One key tile of the online softmax (``visible`` broadcasts to [rows, keys]); returns the tile's
    masked base-2 logits and the new running max, sum and accumulator."""
    s = _dot(q, tl.trans(k), IEEE) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return s, m_new, l_i, acc


@triton.jit
def _normalise(acc, m_i, l_i):
    """The output and natural-log log-sum-exp of an online softmax; o = 0, lse = -inf where no key was seen."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


@triton.jit
def _interior(t_first, t_last, start, end, NK, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
              WINDOW: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The key tiles [a, b) within [start, end) (BN-aligned from ``start``) that every query
    t_first..t_last sees, so that they need no mask: key position <= t_first and, with a window,
    > t_last - WINDOW. start <= a <= b <= end; empty (a = b) when no tile qualifies."""
    hi = tl.where(t_first >= OFFSET, (t_first - OFFSET) // STRIDE + 1, 0)  # keys seen by the first row
    hi = tl.minimum(hi, NK)
    lo = start
    if WINDOW > 0:
        first = t_last - WINDOW + 1 - OFFSET  # the last row's first visible key position
        lo = tl.maximum(tl.where(first > 0, (first + STRIDE - 1) // STRIDE, 0), start)
    a = tl.minimum(start + ((lo - start + BN - 1) // BN) * BN, end)
    b = start + ((tl.maximum(hi, start) - start) // BN) * BN
    b = tl.maximum(tl.minimum(b, end), a)
    return a, b


@triton.jit
def _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc, scale_log2,
                      STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
                      BN: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One key tile of the strided forward; MASK = False for tiles :func:`_interior` proved fully visible
    (no bounds check, no mask)."""
    offs_n = i0 + tl.arange(0, BN)
    kv_off = offs_n[:, None] * skt + offs_d[None, :]
    if MASK:
        k = tl.load(Kb + kv_off, mask=offs_n[:, None] < NK, other=0.0)
        v = tl.load(Vb + kv_off, mask=offs_n[:, None] < NK, other=0.0)
        vis = _visible(offs_m, offs_n, NK, STRIDE, OFFSET, WINDOW)
        _, m_i, l_i, acc = _online_update(q, k, v, vis, m_i, l_i, acc, scale_log2, IEEE)
    else:
        k = tl.load(Kb + kv_off)
        v = tl.load(Vb + kv_off)
        s = _dot(q, tl.trans(k), IEEE) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _strided_fwd_kernel(
    Q, K, V, O, LSE,
    sqb, sqt, sqh, skb, skt, skh,
    T, NK, HQ, G, scale_log2,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    b, hq, h = _query_head(tl.program_id(1), HQ, G)
    offs_m, offs_d, row_ok = _tile(pid_m, BM, T, D)
    Qb = Q + b * sqb + hq * sqh  # scalar 64-bit base; the tile's offsets stay 32-bit
    Kb = K + b * skb + h * skh
    Vb = V + b * skb + h * skh
    q = tl.load(Qb + offs_m[:, None] * sqt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    t_last = tl.minimum(pid_m * BM + BM, T) - 1
    start, end = _key_range(pid_m * BM, t_last, NK, STRIDE, OFFSET, WINDOW, BN)
    if SPLIT:  # masked edge tiles, the unmasked interior, masked tiles at the diagonal
        a, b_ = _interior(pid_m * BM, t_last, start, end, NK, STRIDE, OFFSET, WINDOW, BN)
        for i0 in range(start, a, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, True, IEEE)  # fmt: skip
        for i0 in range(a, b_, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, False, IEEE)  # fmt: skip
        for i0 in range(b_, end, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, True, IEEE)  # fmt: skip
    else:
        for i0 in range(start, end, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, True, IEEE)  # fmt: skip
    o, lse = _normalise(acc, m_i, l_i)
    tl.store(O + b * sqb + hq * sqh + offs_m[:, None] * sqt + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip
    tl.store(LSE + (b * T + offs_m) * HQ + hq, lse, mask=row_ok)


@triton.jit
def _strided_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    sqb, sqt, sqh, skb, skt, skh,
    T, NK, HQ, G, scale_log2, scale,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    b, hq, h = _query_head(tl.program_id(1), HQ, G)
    offs_m, offs_d, row_ok = _tile(pid_m, BM, T, D)
    row_base = b * sqb + hq * sqh  # 64-bit scalar bases, 32-bit tile offsets (fewer registers)
    row_off = offs_m[:, None] * sqt + offs_d[None, :]
    q, do = _load_pair(Q, DO, row_base, row_off, row_ok)
    lse2, delta = _row_stats(LSE, DELTA, b * T + offs_m, HQ, hq, row_ok)
    dq = tl.zeros([BM, D], tl.float32)
    kv_base = b * skb + h * skh
    t_last = tl.minimum(pid_m * BM + BM, T) - 1
    start, end = _key_range(pid_m * BM, t_last, NK, STRIDE, OFFSET, WINDOW, BN)
    for i0 in range(start, end, BN):
        offs_n = i0 + tl.arange(0, BN)
        k, v = _load_pair(K, V, kv_base, offs_n[:, None] * skt + offs_d[None, :], offs_n < NK)
        s = _dot(q, tl.trans(k), IEEE) * scale_log2
        vis = _visible(offs_m, offs_n, NK, STRIDE, OFFSET, WINDOW)
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + row_base + row_off, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _strided_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sqb, sqt, sqh, skb, skt, skh, sdb, sdt, sdh,
    T, NK, HQ, G, scale_log2, scale,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # One program per (key tile, query head); the G heads of a group add into fp32 dK/dV with atomics.
    pid_n = tl.program_id(0)
    b, hq, h = _query_head(tl.program_id(1), HQ, G)
    offs_n, offs_d, col_ok = _tile(pid_n, BN, NK, D)
    k, v = _load_pair(K, V, b * skb + h * skh, offs_n[:, None] * skt + offs_d[None, :], col_ok)
    row_base = b * sqb + hq * sqh
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    t_start = ((pid_n * BN * STRIDE + OFFSET) // BM) * BM  # first query that can see the tile's first key
    t_end = T
    if WINDOW > 0:
        last = tl.minimum(pid_n * BN + BN, NK) - 1
        t_end = tl.minimum(T, last * STRIDE + OFFSET + WINDOW)
    for t0 in range(t_start, t_end, BM):
        offs_m = t0 + tl.arange(0, BM)
        row_ok = offs_m < T
        q, do = _load_pair(Q, DO, row_base, offs_m[:, None] * sqt + offs_d[None, :], row_ok)
        lse2, delta = _row_stats(LSE, DELTA, b * T + offs_m, HQ, hq, row_ok)
        s_t = _dot(k, tl.trans(q), IEEE) * scale_log2  # [BN, BM]
        kpos = offs_n * STRIDE + OFFSET
        vis_t = (kpos[:, None] <= offs_m[None, :]) & col_ok[:, None] & row_ok[None, :]
        if WINDOW > 0:
            vis_t = vis_t & (offs_m[None, :] - kpos[:, None] < WINDOW)
        p_t = tl.where(vis_t, tl.exp2(s_t - lse2[None, :]), 0.0)
        dv += _dot(p_t.to(do.dtype), do, IEEE)
        dp_t = _dot(v, tl.trans(do), IEEE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, IEEE)
    d_off = offs_n[:, None] * sdt + offs_d[None, :]
    tl.atomic_add(DK + (b * sdb + h * sdh) + d_off, dk * scale, mask=col_ok[:, None])
    tl.atomic_add(DV + (b * sdb + h * sdh) + d_off, dv, mask=col_ok[:, None])


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
        vis_c = _visible(offs_m, ic, NC, STRIDE, BLOCK_LEN - 1, 0)
        p_sum = tl.zeros([BM, BC], tl.float32)
        for g in range(G):
            hq = h * G + g
            q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)  # fmt: skip
            lse = tl.load(LSE + (b * T + offs_m) * HQ + hq, mask=row_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
            p_sum += tl.where(vis_c, tl.exp2(_dot(q, tl.trans(kc), IEEE) * scale_log2 - lse2[:, None]), 0.0)
        acc = carry + _dot(p_sum, _overlap(ic, offs_j, R, C), IEEE)
        if C > 1:  # blocks straddling the next tile's start exist only when compression blocks overlap
            carry = _dot(p_sum, _overlap(ic, offs_j + BJ, R, C), IEEE)
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
# program, selection blocks per tile, warps, and software-pipelining stages of the head loop
SCORES_CONFIGS = [
    triton.Config({"BM": bm, "BJ": bj}, num_warps=w, num_stages=st)
    for bm, bj, w, st in (
        (64, 16, 8, 1), (64, 16, 8, 2), (64, 16, 8, 3), (64, 32, 8, 1), (64, 32, 8, 2), (64, 32, 8, 3),
    )  # no spills at D = 128 offline; 4 warps, BM = 128 or BM = 32 spill (sm90_check)
]  # fmt: skip
_scores_tuned = triton.autotune(
    SCORES_CONFIGS, key=["T_BUCKET", "G", "D", "STRIDE", "BLOCK_LEN", "SELECT_LEN", "MASKED", "IEEE"]
)(_scores_kernel)


@triton.jit
def _gate_sum_kernel(G, A, B, C, O, ROWS, D: tl.constexpr, BR: tl.constexpr):
    # Eq. 5 for BR rows (a row: one query head at one position): o = g0 a + g1 b + g2 c with the
    # row's three gates G [ROWS, 3], summed in fp32 and rounded once (one read of each branch's
    # output and one write, where the five PyTorch ops read and write four intermediates as well)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < ROWS
    r64 = rows.to(tl.int64)
    off = r64[:, None] * D + tl.arange(0, D)[None, :]
    g0 = tl.load(G + r64 * 3, mask=ok, other=0.0).to(tl.float32)[:, None]
    g1 = tl.load(G + r64 * 3 + 1, mask=ok, other=0.0).to(tl.float32)[:, None]
    g2 = tl.load(G + r64 * 3 + 2, mask=ok, other=0.0).to(tl.float32)[:, None]
    a = tl.load(A + off, mask=ok[:, None], other=0.0).to(tl.float32)
    b = tl.load(B + off, mask=ok[:, None], other=0.0).to(tl.float32)
    c = tl.load(C + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(O + off, (g0 * a + g1 * b + g2 * c).to(O.dtype.element_ty), mask=ok[:, None])


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
def _slc_prologue(t, pid_bh, H, G, sqb, sqt, sqh, skb, skh, BG: tl.constexpr, D: tl.constexpr):
    """The group-centric rows of query position ``t`` (``_group_rows``) and where they lie: the 64-bit
    scalar bases ``row_base`` (q, dO, O, dQ) and ``kv_base`` (K, V), and the 32-bit tile offsets
    ``row_off`` of the [BG, D] rows."""
    b, h, HQ, offs_d, g_ok, hq = _group_rows(pid_bh, H, G, BG, D)
    row_base = b * sqb + t.to(tl.int64) * sqt  # 64-bit scalar bases, 32-bit tile offsets
    row_off = hq[:, None] * sqh + offs_d[None, :]
    kv_base = b * skb + h * skh
    return b, h, HQ, offs_d, g_ok, hq, row_base, row_off, kv_base


@triton.jit
def _selected_block(BI_row, si, t, K, V, kv_base, skt, offs_d, BS: tl.constexpr):
    """The ``si``-th selected block of a query at ``t``: which of its BS keys are visible (a real block,
    causal), and its K, V rows (0 where not visible)."""
    idx = tl.load(BI_row + si)
    kpos = idx * BS + tl.arange(0, BS)
    valid = (idx >= 0) & (kpos <= t)
    k, v = _load_pair(K, V, kv_base, kpos[:, None] * skt + offs_d[None, :], valid)
    return valid, k, v


@triton.jit
def _slc_fwd_kernel(
    Q, K, V, BI, O, LSE,
    sqb, sqt, sqh, skb, skt, skh,
    T, H, G, S, scale_log2,
    D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Group-centric (§3.4): rows are the G query heads of one (position t, KV head h); the inner loop
    # streams the S selected blocks of l' = BS contiguous keys.
    t = tl.program_id(0)
    b, h, HQ, offs_d, g_ok, hq, row_base, row_off, kv_base = _slc_prologue(
        t, tl.program_id(1), H, G, sqb, sqt, sqh, skb, skh, BG, D
    )
    q = tl.load(Q + row_base + row_off, mask=g_ok[:, None], other=0.0)
    m_i = tl.full([BG], -1e30, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, D], tl.float32)
    bi_base = BI + ((b * T + t) * H + h) * S
    for si in range(S):
        valid, k, v = _selected_block(bi_base, si, t, K, V, kv_base, skt, offs_d, BS)
        _, m_i, l_i, acc = _online_update(q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, IEEE)
    o, lse = _normalise(acc, m_i, l_i)
    tl.store(O + row_base + row_off, o.to(O.dtype.element_ty), mask=g_ok[:, None])
    tl.store(LSE + (b * T + t) * HQ + hq, lse, mask=g_ok)


@triton.jit
def _slc_bwd_dq_kernel(
    Q, K, V, DO, O, LSE, DELTA, BI, DQ,
    sqb, sqt, sqh, skb, skt, skh,
    T, H, G, S, scale_log2, scale,
    D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, IEEE: tl.constexpr,
    FUSE_DELTA: tl.constexpr = False,
):  # fmt: skip
    # FUSE_DELTA: delta = rowsum(dO * O) computed here from the [BG, D] rows this program loads anyway
    # and stored to DELTA for the dK/dV kernel that runs after it (else DELTA is an input and O unused)
    t = tl.program_id(0)
    b, h, HQ, offs_d, g_ok, hq, row_base, row_off, kv_base = _slc_prologue(
        t, tl.program_id(1), H, G, sqb, sqt, sqh, skb, skh, BG, D
    )
    q, do = _load_pair(Q, DO, row_base, row_off, g_ok)
    if FUSE_DELTA:
        # kept in registers: re-reading DELTA here would read what other threads of this program
        # stored with no barrier between (torch.empty's garbage on the GPU; the CPU interpreter,
        # sequential, cannot show it)
        o = tl.load(O + row_base + row_off, mask=g_ok[:, None], other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DELTA + (b * T + t) * HQ + hq, delta, mask=g_ok)
        lse2 = _lse2(LSE, b * T + t, HQ, hq, g_ok)
    else:
        lse2, delta = _row_stats(LSE, DELTA, b * T + t, HQ, hq, g_ok)
    dq = tl.zeros([BG, D], tl.float32)
    bi_base = BI + ((b * T + t) * H + h) * S
    for si in range(S):
        valid, k, v = _selected_block(bi_base, si, t, K, V, kv_base, skt, offs_d, BS)
        s = _dot(q, tl.trans(k), IEEE) * scale_log2
        p = tl.where(valid[None, :] & g_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + row_base + row_off, (dq * scale).to(DQ.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _slc_flush(DK, DV, acc_dk, acc_dv, cur, NB, H, T, sdb, sdt, sdh, scale,
               D: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    bh = cur // NB
    idx = cur % NB
    b = bh // H
    h = bh % H
    rows = tl.arange(0, BS)
    base = b * sdb + h * sdh + idx * BS * sdt  # 64-bit scalar; the tile's offsets stay 32-bit
    off = rows[:, None] * sdt + tl.arange(0, D)[None, :]
    ok = (idx * BS + rows < T)[:, None]
    tl.atomic_add(DK + base + off, acc_dk * scale, mask=ok)
    tl.atomic_add(DV + base + off, acc_dv, mask=ok)


@triton.jit
def _slc_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, KEYS, DK, DV,
    sqb, sqt, sqh, skb, skt, skh, sdb, sdt, sdh,
    T, H, G, NB, N, INVALID, scale_log2, scale,
    D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # KEYS: the (block, query) pairs sorted by block, key = ((b H + h) NB + block) T + t, invalid
    # pairs (no block) sorted last as INVALID = B H NB T. Each program takes CHUNK consecutive pairs,
    # keeps the current block's K, V and partial dK, dV, and flushes them when the block changes.
    pid = tl.program_id(0)
    HQ = H * G
    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    cur = pid.to(tl.int64) * 0 - 1
    acc_dk = tl.zeros([BS, D], tl.float32)
    acc_dv = tl.zeros([BS, D], tl.float32)
    k = tl.zeros([BS, D], K.dtype.element_ty)
    v = tl.zeros([BS, D], V.dtype.element_ty)
    e_end = tl.minimum(pid * CHUNK + CHUNK, N)
    for e in range(pid * CHUNK, e_end):
        key = tl.load(KEYS + e)
        if key < INVALID:
            r = key // T
            t = key % T
            if r != cur:
                if cur >= 0:
                    _slc_flush(DK, DV, acc_dk, acc_dv, cur, NB, H, T, sdb, sdt, sdh, scale, D, BS)
                acc_dk = tl.zeros([BS, D], tl.float32)
                acc_dv = tl.zeros([BS, D], tl.float32)
                bh = r // NB
                start = (r % NB) * BS
                kv_base = (bh // H) * skb + (bh % H) * skh + start * skt
                kv_off = tl.arange(0, BS)[:, None] * skt + offs_d[None, :]
                k, v = _load_pair(K, V, kv_base, kv_off, start + tl.arange(0, BS) < T)
                cur = r
            bh = r // NB
            b = bh // H
            h = bh % H
            kpos = (r % NB) * BS + tl.arange(0, BS)
            hq = h * G + offs_g
            row_base = b * sqb + t * sqt
            q, do = _load_pair(Q, DO, row_base, hq[:, None] * sqh + offs_d[None, :], g_ok)
            lse2, delta = _row_stats(LSE, DELTA, b * T + t, HQ, hq, g_ok)
            # transposed orientation, [BS, BG]: dV = P^T dO and dK = dS^T Q without transposing P
            s_t = _dot(k, tl.trans(q), IEEE) * scale_log2
            valid_t = (kpos <= t)[:, None] & g_ok[None, :]
            p_t = tl.where(valid_t, tl.exp2(s_t - lse2[None, :]), 0.0)
            acc_dv += _dot(p_t.to(do.dtype), do, IEEE)
            dp_t = _dot(v, tl.trans(do), IEEE)
            ds_t = p_t * (dp_t - delta[None, :])
            acc_dk += _dot(ds_t.to(q.dtype), q, IEEE)
    if cur >= 0:
        _slc_flush(DK, DV, acc_dk, acc_dv, cur, NB, H, T, sdb, sdt, sdh, scale, D, BS)


@triton.jit
def _slc_bwd_dkdv_tiled_kernel(
    Q, K, V, DO, LSE, DELTA, QIDX, OFFS, ITEM_SEG, FIRST_ITEM, DK, DV,
    sqb, sqt, sqh, skb, skt, skh, sdb, sdt, sdh,
    T, H, G, NB, NSEG, scale_log2, scale,
    D: tl.constexpr, BS: tl.constexpr, BGP: tl.constexpr, BQ: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """dK, dV of the selected branch, block-major: one program per work item = up to CHUNK queries of
    one segment (KV block ``blk`` of KV head ``h`` in batch ``b``; segment = (b H + h) NB + blk).

    The inverted selection (``ops.invert_block_indices``): QIDX holds, segment after segment, the
    positions t of the queries that selected the segment's block, ascending, and OFFS [NSEG + 1] where
    each segment's list starts. A segment of c queries is ceil(c / CHUNK) work items; ITEM_SEG maps a
    program to its segment (NSEG: no work, the grid is an upper bound known without reading the
    counts back), FIRST_ITEM [NSEG] to the segment's first item.

    The program keeps the block's K, V ([BS, D]) and fp32 dK, dV in registers and walks its queries
    BQ at a time: the tile's rows are BQ queries x BGP (G padded to a power of two) heads, gathered
    from q and dO by position, so dV += P^T dO and dK += dS^T Q are matmuls with inner dimension
    BQ BGP (64 on the GPU) instead of G. A segment that fits one item stores dK, dV (no other program
    writes those rows); a longer one (the first block, read by every query, and early blocks that
    random inputs favour) adds its items' partial sums with fp32 atomics into the zeroed output.
    """
    pid = tl.program_id(0)
    seg = tl.load(ITEM_SEG + pid)
    if seg < NSEG:
        lo = tl.load(OFFS + seg)
        hi = tl.load(OFFS + seg + 1)
        start = lo + (pid - tl.load(FIRST_ITEM + seg)) * CHUNK
        end = tl.minimum(start + CHUNK, hi)
        bh = seg // NB
        blk = seg % NB
        b = (bh // H).to(tl.int64)
        h = bh % H
        HQ = H * G
        offs_d = tl.arange(0, D)
        kpos = blk * BS + tl.arange(0, BS)
        k, v = _load_pair(K, V, b * skb + h * skh, kpos[:, None] * skt + offs_d[None, :], kpos < T)
        rows = tl.arange(0, BQ * BGP)
        slot = rows // BGP  # which of the tile's BQ queries a row belongs to
        hq = h * G + rows % BGP
        g_ok = rows % BGP < G
        dk = tl.zeros([BS, D], tl.float32)
        dv = tl.zeros([BS, D], tl.float32)
        for e0 in range(start, end, BQ):
            e = e0 + slot
            ok = (e < end) & g_ok
            t = tl.load(QIDX + e, mask=e < end, other=0)
            row_off = t[:, None] * sqt + hq[:, None] * sqh + offs_d[None, :]
            q, do = _load_pair(Q, DO, b * sqb, row_off, ok)
            lse2, delta = _row_stats(LSE, DELTA, b * T + t, HQ, hq, ok)
            s_t = _dot(k, tl.trans(q), IEEE) * scale_log2  # [BS, BQ BGP]
            valid_t = (kpos[:, None] <= t[None, :]) & ok[None, :]  # causal inside the query's own block
            p_t = tl.where(valid_t, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv += _dot(p_t.to(do.dtype), do, IEEE)
            dp_t = _dot(v, tl.trans(do), IEEE)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, IEEE)
        d_off = kpos[:, None] * sdt + offs_d[None, :]
        d_base = b * sdb + h * sdh
        d_ok = (kpos < T)[:, None]
        if hi - lo > CHUNK:
            tl.atomic_add(DK + d_base + d_off, dk * scale, mask=d_ok)
            tl.atomic_add(DV + d_base + d_off, dv, mask=d_ok)
        else:
            tl.store(DK + d_base + d_off, dk * scale, mask=d_ok)
            tl.store(DV + d_base + d_off, dv, mask=d_ok)


# ----------------------------------------------------------------------------------------------
# Decoding: one query token at position t (the last of the cache), one program per (batch, KV
# head) with the group's G query heads as the rows. Each kernel counts the KV tokens it loads. The
# step is two launches around one ``torch.topk``, with no host synchronisation: the first kernel
# also turns its logits into the masked block scores that top-k ranks (Eqs. 8-11), the second sorts
# top-k's picks itself before reading them.


@triton.jit(do_not_specialize=["t"])
def _decode_cmp_kernel(
    Q, KC, VC, OC, LOGITS, SCORES, COUNTS,
    sqb, sqh, skb, skt, skh,
    t, NC, H, G, NCP, NS, scale_log2,
    STRIDE: tl.constexpr, BLOCK_LEN: tl.constexpr, SELECT_LEN: tl.constexpr,
    N_INITIAL: tl.constexpr, N_LOCAL: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    # Compressed branch for the decoded token, then the block scores of Eqs. 8-10 from its own logits
    # (stored to the program's scratch row LOGITS [B, HQ, NCP] during the pass, read back once the
    # log-sum-exp is known: no second pass over the compressed keys), with Eq. 11's forced and future
    # blocks set to +inf and -inf so that top-k needs nothing else.
    b, h, HQ, offs_d, g_ok, hq = _group_rows(tl.program_id(0), H, G, BG, D)
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    n_vis = tl.where(t >= BLOCK_LEN - 1, (t - BLOCK_LEN + 1) // STRIDE + 1, 0)
    n_vis = tl.minimum(n_vis, NC)
    m_i = tl.full([BG], -1e30, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, D], tl.float32)
    count = n_vis * 0
    logit_row = LOGITS + (b * HQ + hq[:, None]) * NCP
    for i0 in range(0, n_vis, BN):
        offs_n = i0 + tl.arange(0, BN)
        ok = offs_n < n_vis
        kv_off = b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :]
        k = tl.load(KC + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(VC + kv_off, mask=ok[:, None], other=0.0)
        s, m_i, l_i, acc = _online_update(q, k, v, ok[None, :], m_i, l_i, acc, scale_log2, IEEE)
        tl.store(logit_row + offs_n[None, :], s, mask=g_ok[:, None] & ok[None, :])
        count += tl.sum(ok.to(tl.int32))
    o, _ = _normalise(acc, m_i, l_i)
    tl.store(OC + (b * HQ + hq[:, None]) * D + offs_d[None, :], o, mask=g_ok[:, None])
    tl.store(COUNTS + (b * H + h) * 3, count)
    # Eqs. 8-10 on the stride pieces of d tokens: compression block i is pieces i .. i + C - 1 (C = l/d),
    # selection block j is pieces j R .. j R + R - 1 (R = l'/d). Piece sums P[pi] = sum_c p[pi - c] of
    # p_cmp = exp2(s - lse2) summed over the group's heads (Eq. 10), then R pieces per block: Eq. 9's
    # double sum over m < R, n < C as it is written, BC = BJ R pieces per tile.
    R: tl.constexpr = SELECT_LEN // STRIDE
    C: tl.constexpr = BLOCK_LEN // STRIDE
    tl.debug_barrier()  # the logits stored above are read back by other threads of this program
    lse2 = tl.where(l_i == 0.0, 0.0, m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    own = t // SELECT_LEN  # the decoded token's selection block: blocks after it do not exist yet
    for j0 in range(0, NS, BJ):
        offs_j = j0 + tl.arange(0, BJ)
        piece = j0 * R + tl.arange(0, BC)
        p = tl.zeros([BC], tl.float32)
        for c in tl.static_range(C):
            ic = piece - c
            ok = (ic >= 0) & (ic < n_vis)
            s = tl.load(logit_row + ic[None, :], mask=g_ok[:, None] & ok[None, :], other=float("-inf"))
            p += tl.sum(tl.exp2(s - lse2[:, None]), 0)  # masked logits give 0
        score = tl.sum(tl.reshape(p, [BJ, R]), 1)
        forced = (offs_j < N_INITIAL) | ((offs_j <= own) & (offs_j > own - N_LOCAL))
        score = tl.where(forced, float("inf"), score)
        score = tl.where(offs_j > own, float("-inf"), score)
        tl.store(SCORES + (b * H + h) * NS + offs_j, score, mask=offs_j < NS)


@triton.jit(do_not_specialize=["t"])
def _decode_sparse_kernel(
    Q, K, V, KW, VW, TOP_VAL, TOP_IDX, OC, GATES, O, BI, COUNTS,
    sqb, sqh, skb, skt, skh, swb, swt, swh,
    t, H, G, S, K_TOP, NS, WINDOW, scale_log2,
    D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, BSEL: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    # Eq. 11's block indices from top-k's K_TOP picks (TOP_VAL, TOP_IDX [B, H, K_TOP]): a pick of
    # -inf (a block that does not exist yet) is none; the rest sorted ascending, none last as -1, padded
    # to S, and written to BI [B, H, S]. Then the selected branch (those blocks of BS tokens) and the
    # sliding window (the last WINDOW tokens), and the gated sum of Eq. 5 with the compressed output OC.
    pid = tl.program_id(0)
    b, h, HQ, offs_d, g_ok, hq = _group_rows(pid, H, G, BG, D)
    slot = tl.arange(0, BSEL)
    picked = slot < K_TOP
    val = tl.load(TOP_VAL + (b * H + h) * K_TOP + slot, mask=picked, other=float("-inf"))
    key = tl.load(TOP_IDX + (b * H + h) * K_TOP + slot, mask=picked, other=0).to(tl.int32)
    key = tl.where(val == float("-inf"), NS, key)  # none sorts after every real block
    # the picks are distinct blocks: a pick's place in ascending order is how many picks are smaller
    rank = tl.sum((key[None, :] < key[:, None]).to(tl.int32), 1)
    blocks = tl.min(tl.where(rank[None, :] == slot[:, None], key[None, :], NS), 1)
    blocks = tl.where(blocks == NS, -1, blocks)
    tl.store(BI + (b * H + h) * S + slot, blocks, mask=slot < S)
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    m_s = tl.full([BG], -1e30, tl.float32)
    kv_base = b * skb + h * skh
    l_s = tl.zeros([BG], tl.float32)
    acc_s = tl.zeros([BG, D], tl.float32)
    n_slc = pid * 0  # a tensor even when t is specialised to the constant 1
    for si in range(S):
        idx = tl.sum(tl.where(slot == si, blocks, 0))
        kpos = idx * BS + tl.arange(0, BS)
        valid = (idx >= 0) & (kpos <= t)
        k, v = _load_pair(K, V, kv_base, kpos[:, None] * skt + offs_d[None, :], valid)
        _, m_s, l_s, acc_s = _online_update(q, k, v, valid[None, :], m_s, l_s, acc_s, scale_log2, IEEE)
        n_slc += tl.sum(valid.to(tl.int32))
    m_w = tl.full([BG], -1e30, tl.float32)
    l_w = tl.zeros([BG], tl.float32)
    acc_w = tl.zeros([BG, D], tl.float32)
    n_win = pid * 0
    for i0 in range(tl.maximum(t - WINDOW + 1, 0), t + 1, BN):
        offs_n = i0 + tl.arange(0, BN)
        ok = offs_n <= t
        kv_off = b * swb + offs_n[:, None].to(tl.int64) * swt + h * swh + offs_d[None, :]
        k = tl.load(KW + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(VW + kv_off, mask=ok[:, None], other=0.0)
        _, m_w, l_w, acc_w = _online_update(q, k, v, ok[None, :], m_w, l_w, acc_w, scale_log2, IEEE)
        n_win += tl.sum(ok.to(tl.int32))
    o_s = acc_s / tl.where(l_s == 0.0, 1.0, l_s)[:, None]
    o_w = acc_w / tl.where(l_w == 0.0, 1.0, l_w)[:, None]
    o_c = tl.load(OC + (b * HQ + hq[:, None]) * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    g_c = tl.load(GATES + (b * HQ + hq) * 3 + 0, mask=g_ok, other=0.0).to(tl.float32)
    g_s = tl.load(GATES + (b * HQ + hq) * 3 + 1, mask=g_ok, other=0.0).to(tl.float32)
    g_w = tl.load(GATES + (b * HQ + hq) * 3 + 2, mask=g_ok, other=0.0).to(tl.float32)
    o = g_c[:, None] * o_c + g_s[:, None] * o_s + g_w[:, None] * o_w
    tl.store(O + (b * HQ + hq[:, None]) * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=g_ok[:, None])
    tl.store(COUNTS + (b * H + h) * 3 + 1, n_slc)
    tl.store(COUNTS + (b * H + h) * 3 + 2, n_win)
