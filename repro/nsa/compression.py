"""The compressed branch (yuan2025nsa §3.3.1, Eq. 7): attention over the compressed tokens, with the
strided-attention kernels that the sliding window (``window.py``) runs too.

Compression itself, Eq. 7's phi (a learned MLP with an intra-block position encoding, or the mean), is
PyTorch in both paths and defined once, in ``reference.py``: :func:`compress` of [B, T, H, D] keys or
values gives [B, Nc, H, D], one token per block of l positions, d apart.

The kernels attend over keys at positions ``i * STRIDE + OFFSET``, causally, with an optional window.
The compressed branch is STRIDE = d, OFFSET = l - 1 (a compressed token is visible once its block's
last token is, §3.3.1); the sliding window is STRIDE = 1, OFFSET = 0, WINDOW = w (§3.3.3).
FlashAttention-2 tiling: a tile of BM queries of one head per program, BN keys per step; the forward
may walk the key tiles every query of its tile sees without a mask (``SPLIT``). The backward is
FlashAttention-2's two kernels: dQ per query tile, dK/dV per key tile (the G heads of a group add into
fp32 dK/dV with atomics); with ``SPLIT`` they too walk the tiles that see each other whole unmasked (dQ
over key tiles as the forward, dK/dV over query tiles: ``_query_interior``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.nsa.common import (
    LOG2E,
    check_qkv,
    dot,
    head_constexprs,
    interpreting,
    is_fp32,
    kernel_dims,
    load_cols,
    load_pair,
    normalise,
    online_softmax_step,
    pad_heads,
    query_head,
    row_stats,
    softmax_scale,
    tile_rows,
    value_strides,
    visible_keys,
)
from repro.nsa.config import Switches
from repro.nsa.reference import CompressionMLP, compress, mean_pool

__all__ = ["CompressionMLP", "compress", "compressed_attention", "mean_pool"]


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
def _value_layout(offs_d, sqb, sqt, sqh, skb, skt, skh, D: tl.constexpr, D2: tl.constexpr, D_V: tl.constexpr):
    """Where value rows (V, dV) and output rows (O, dO) lie: on the split path (``D_V`` given, common.py)
    their own columns ``offs_dv`` and the strides of contiguous tensors scaled from k's and q's; on the
    verified path k's and q's, unchanged. Returns (offs_dv, svb, svt, svh, sob, sot, soh)."""
    offs_dv, svb, svt, svh, sob, sot, soh = offs_d, skb, skt, skh, sqb, sqt, sqh
    if D_V > 0:
        offs_dv = tl.arange(0, D_V)
        svb, svt, svh = value_strides(skb, skt, skh, D + D2, D_V)
        sob, sot, soh = value_strides(sqb, sqt, sqh, D + D2, D_V)
    return offs_dv, svb, svt, svh, sob, sot, soh


@triton.jit
def _tile_offsets(rows, offs_d, offs_dv, s_row, s_row_v, D_V: tl.constexpr):
    """32-bit offsets of a tile of ``rows`` (keys, or queries): [rows, D] of K (or Q) at row stride
    ``s_row``, and of V (or dO), its own at ``s_row_v`` on the split path, the same ones otherwise."""
    off = rows[:, None] * s_row + offs_d[None, :]
    v_off = off
    if D_V > 0:
        v_off = rows[:, None] * s_row_v + offs_dv[None, :]
    return off, v_off


@triton.jit
def _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc, scale_log2,
                      STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
                      BN: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
                      q2, svt, offs_dv, D: tl.constexpr, D2: tl.constexpr, D_V: tl.constexpr):  # fmt: skip
    """One key tile of the strided forward; MASK = False for tiles :func:`_interior` proved fully visible
    (no bounds check, no mask). Head sizes as in :func:`_strided_fwd_kernel` (q2, svt, offs_dv: the
    split path's, q, skt, offs_d again on the verified one)."""
    offs_n = i0 + tl.arange(0, BN)
    kv_off, v_off = _tile_offsets(offs_n, offs_d, offs_dv, skt, svt, D_V)
    if MASK:
        k = tl.load(Kb + kv_off, mask=offs_n[:, None] < NK, other=0.0)
        v = tl.load(Vb + v_off, mask=offs_n[:, None] < NK, other=0.0)
        k2 = k
        if D2 > 0:
            k2 = load_cols(Kb, 0, offs_n * skt, offs_n < NK, D, D2)
        vis = visible_keys(offs_m, offs_n, NK, STRIDE, OFFSET, WINDOW)
        _, m_i, l_i, acc = online_softmax_step(q, k, v, vis, m_i, l_i, acc, scale_log2, IEEE, q2, k2, D2)
    else:
        k = tl.load(Kb + kv_off)
        v = tl.load(Vb + v_off)
        s = dot(q, tl.trans(k), IEEE)
        if D2 > 0:
            k2 = tl.load(Kb + offs_n[:, None] * skt + (D + tl.arange(0, D2))[None, :])
            s += dot(q2, tl.trans(k2), IEEE)
        s = s * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _strided_fwd_kernel(
    Q, K, V, O, LSE,
    sqb, sqt, sqh, skb, skt, skh,
    T, NK, HQ, G, scale_log2,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    D2: tl.constexpr = 0, D_V: tl.constexpr = 0,
):  # fmt: skip
    # Head sizes (common.py): key rows of D (+ D2) columns, value and output rows of DVAL = D_V (the
    # split path, D_V given) or D (the verified path: every line below as before the split); v and o
    # are contiguous like k and q, so their strides follow from k's and q's.
    DVAL: tl.constexpr = D if D_V == 0 else D_V
    pid_m = tl.program_id(0)
    b, hq, h = query_head(tl.program_id(1), HQ, G)
    offs_m, offs_d, row_ok = tile_rows(pid_m, BM, T, D)
    offs_dv, svb, svt, svh, sob, sot, soh = _value_layout(offs_d, sqb, sqt, sqh, skb, skt, skh, D, D2, D_V)
    Qb = Q + b * sqb + hq * sqh  # scalar 64-bit base; the tile's offsets stay 32-bit
    Kb = K + b * skb + h * skh
    Vb = V + b * svb + h * svh
    q = tl.load(Qb + offs_m[:, None] * sqt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q2 = q
    if D2 > 0:
        q2 = load_cols(Qb, 0, offs_m * sqt, row_ok, D, D2)
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DVAL], tl.float32)
    t_last = tl.minimum(pid_m * BM + BM, T) - 1
    start, end = _key_range(pid_m * BM, t_last, NK, STRIDE, OFFSET, WINDOW, BN)
    if SPLIT:  # masked edge tiles, the unmasked interior, masked tiles at the diagonal
        a, b_ = _interior(pid_m * BM, t_last, start, end, NK, STRIDE, OFFSET, WINDOW, BN)
        for i0 in range(start, a, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, True, IEEE,
                                              q2, svt, offs_dv, D, D2, D_V)  # fmt: skip
        for i0 in range(a, b_, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, False, IEEE,
                                              q2, svt, offs_dv, D, D2, D_V)  # fmt: skip
        for i0 in range(b_, end, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, True, IEEE,
                                              q2, svt, offs_dv, D, D2, D_V)  # fmt: skip
    else:
        for i0 in range(start, end, BN):
            m_i, l_i, acc = _strided_fwd_tile(q, Kb, Vb, i0, offs_m, offs_d, NK, skt, m_i, l_i, acc,
                                              scale_log2, STRIDE, OFFSET, WINDOW, BN, True, IEEE,
                                              q2, svt, offs_dv, D, D2, D_V)  # fmt: skip
    o, lse = normalise(acc, m_i, l_i)
    tl.store(O + b * sob + hq * soh + offs_m[:, None] * sot + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip
    tl.store(LSE + (b * T + offs_m) * HQ + hq, lse, mask=row_ok)


@triton.jit
def _strided_bwd_dq_tile(q, q2, do, lse2, delta, dq, dq2, K, V, kv_base, v_base, i0, offs_m, offs_d, offs_dv,
                         NK, skt, svt, scale_log2, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
                         WINDOW: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
                         D: tl.constexpr, D2: tl.constexpr, D_V: tl.constexpr):  # fmt: skip
    """One key tile of the dQ kernel; MASK = False for tiles :func:`_interior` proved fully visible to
    every row of the query tile (no bounds check, no mask). Rows past T were loaded as zeros: their
    dS is 0 either way, and they are not stored."""
    # the offsets of _tile_offsets written out: through it the fp32 split dQ kernel compiles to other
    # SASS (registers; lab/fingerprints, 2026-11-29), as the two kernels' own K/V and Q/dO offsets do
    offs_n = i0 + tl.arange(0, BN)
    kv_off = offs_n[:, None] * skt + offs_d[None, :]
    v_off = kv_off
    if D_V > 0:
        v_off = offs_n[:, None] * svt + offs_dv[None, :]
    if MASK:
        k, v = load_pair(K, V, kv_base, kv_off, offs_n < NK, v_base, v_off)
    else:
        k = tl.load(K + kv_base + kv_off)
        v = tl.load(V + v_base + v_off)
    s = dot(q, tl.trans(k), IEEE)
    k2 = k
    if D2 > 0:
        if MASK:
            k2 = load_cols(K, kv_base, offs_n * skt, offs_n < NK, D, D2)
        else:
            k2 = tl.load(K + kv_base + offs_n[:, None] * skt + (D + tl.arange(0, D2))[None, :])
        s += dot(q2, tl.trans(k2), IEEE)
    s = s * scale_log2
    if MASK:
        vis = visible_keys(offs_m, offs_n, NK, STRIDE, OFFSET, WINDOW)
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    else:
        p = tl.exp2(s - lse2[:, None])
    # common.dq_step written out, as the dK/dV tiles' common.dkdv_step: through the helpers the fp32
    # split dQ and dK/dV launches compiled to other SASS (lab/fingerprints, 2026-11-29)
    dp = dot(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    dq += dot(ds.to(k.dtype), k, IEEE)
    if D2 > 0:
        dq2 += dot(ds.to(k.dtype), k2, IEEE)
    return dq, dq2


@triton.jit
def _strided_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    sqb, sqt, sqh, skb, skt, skh,
    T, NK, HQ, G, scale_log2, scale,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
    D2: tl.constexpr = 0, D_V: tl.constexpr = 0, SPLIT: tl.constexpr = False,
):  # fmt: skip
    # Head sizes as in _strided_fwd_kernel; SPLIT: the key tiles in three loops as the forward's
    pid_m = tl.program_id(0)
    b, hq, h = query_head(tl.program_id(1), HQ, G)
    offs_m, offs_d, row_ok = tile_rows(pid_m, BM, T, D)
    offs_dv, svb, svt, svh, sob, sot, soh = _value_layout(offs_d, sqb, sqt, sqh, skb, skt, skh, D, D2, D_V)
    row_base = b * sqb + hq * sqh  # 64-bit scalar bases, 32-bit tile offsets (fewer registers)
    row_off = offs_m[:, None] * sqt + offs_d[None, :]
    do_base, do_off = row_base, row_off
    if D_V > 0:
        do_base = b * sob + hq * soh
        do_off = offs_m[:, None] * sot + offs_dv[None, :]
    q, do = load_pair(Q, DO, row_base, row_off, row_ok, do_base, do_off)
    lse2, delta = row_stats(LSE, DELTA, b * T + offs_m, HQ, hq, row_ok)
    dq = tl.zeros([BM, D], tl.float32)
    q2, dq2 = q, dq
    if D2 > 0:
        q2 = load_cols(Q, row_base, offs_m * sqt, row_ok, D, D2)
        dq2 = tl.zeros([BM, D2], tl.float32)
    kv_base = b * skb + h * skh
    v_base = kv_base
    if D_V > 0:
        v_base = b * svb + h * svh
    t_last = tl.minimum(pid_m * BM + BM, T) - 1
    start, end = _key_range(pid_m * BM, t_last, NK, STRIDE, OFFSET, WINDOW, BN)
    a, b_ = end, end  # SPLIT off: every tile in the first, masked, loop
    if SPLIT:  # masked tiles at the window's edge, the unmasked interior, masked tiles at the diagonal
        a, b_ = _interior(pid_m * BM, t_last, start, end, NK, STRIDE, OFFSET, WINDOW, BN)
    for i0 in range(start, a, BN):
        dq, dq2 = _strided_bwd_dq_tile(q, q2, do, lse2, delta, dq, dq2, K, V, kv_base, v_base, i0, offs_m,
                                       offs_d, offs_dv, NK, skt, svt, scale_log2, STRIDE, OFFSET, WINDOW,
                                       BN, True, IEEE, D, D2, D_V)  # fmt: skip
    if SPLIT:
        for i0 in range(a, b_, BN):
            dq, dq2 = _strided_bwd_dq_tile(q, q2, do, lse2, delta, dq, dq2, K, V, kv_base, v_base, i0, offs_m,
                                           offs_d, offs_dv, NK, skt, svt, scale_log2, STRIDE, OFFSET, WINDOW,
                                           BN, False, IEEE, D, D2, D_V)  # fmt: skip
        for i0 in range(b_, end, BN):
            dq, dq2 = _strided_bwd_dq_tile(q, q2, do, lse2, delta, dq, dq2, K, V, kv_base, v_base, i0, offs_m,
                                           offs_d, offs_dv, NK, skt, svt, scale_log2, STRIDE, OFFSET, WINDOW,
                                           BN, True, IEEE, D, D2, D_V)  # fmt: skip
    tl.store(DQ + row_base + row_off, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    if D2 > 0:
        cols = D + tl.arange(0, D2)
        tl.store(DQ + row_base + offs_m[:, None] * sqt + cols[None, :], (dq2 * scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None])  # fmt: skip


@triton.jit
def _query_interior(n0, t_start, n_steps, T, NK, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
                    WINDOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The dK/dV kernel's :func:`_interior`: of the query tiles j = 0 .. n_steps - 1 (queries
    t_start + j BM ..) that a program walks for keys n0 .. n0 + BN - 1, those [a, b) that see every key
    of the tile, so that they need no mask: the key tile full (n0 + BN <= NK), every query < T, at or
    past the last key's position and, with a window, less than WINDOW past the first key's. Tiles
    before a hold the diagonal, tiles from b the window's far edge and T. 0 <= a <= b <= n_steps."""
    n = tl.maximum(n_steps, 0)
    last_pos = (n0 + BN - 1) * STRIDE + OFFSET  # >= t_start: the key tile starts in tile 0
    a = tl.minimum(tl.cdiv(last_pos - t_start, BM), n)
    lim = T  # queries below lim see the first key
    if WINDOW > 0:
        lim = tl.minimum(lim, n0 * STRIDE + OFFSET + WINDOW)
    b = tl.minimum(tl.maximum(lim - t_start, 0) // BM, n)
    b = tl.where(n0 + BN <= NK, tl.maximum(b, a), a)
    return a, b


@triton.jit
def _strided_bwd_dkdv_tiles(lo, hi, gap_lo, gap_hi, k, k2, v, dk, dv, dk2, Q, DO, LSE, DELTA, b, hq0,
                            offs_n, offs_d, offs_dv, col_ok, t_start, T, HQ, sqb, sqt, sqh, sob, sot, soh,
                            scale_log2, STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
                            BM: tl.constexpr, HEADS: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
                            D: tl.constexpr, D2: tl.constexpr, D_V: tl.constexpr,
                            GAP: tl.constexpr = False, REVERSE: tl.constexpr = False):  # fmt: skip
    """The dK/dV kernel's query tiles j = lo .. hi - 1 (queries t_start + j BM ..), less gap_lo ..
    gap_hi - 1 with ``GAP``, for each of the HEADS heads hq0 .., one head after another, added into dk,
    dv, dk2 (the kernel's order: its loop's PTX is the one before the split); MASK = False for tiles
    :func:`_query_interior` proved fully visible (no bounds check, no mask). The split walks the
    interior, then the masked tiles on both sides of it in one loop (``GAP``): ptxas spilled 72-228 bytes
    a thread with a third loop at the paper's head sizes, 0-8 with two (lab/sm90_check, 2026-11-29).
    ``REVERSE``: each head's tiles last to first (``Switches.cmp_bwd_reverse``)."""
    n = hi - lo
    if GAP:
        n = n - (gap_hi - gap_lo)
    for i in range(HEADS * n):
        hq = hq0 + i // n
        j = lo + i % n
        if REVERSE:
            j = lo + n - 1 - i % n
        if GAP:
            j += tl.where(j >= gap_lo, gap_hi - gap_lo, 0)
        t0 = t_start + j * BM
        row_base = b * sqb + hq * sqh
        do_base = row_base
        if D_V > 0:
            do_base = b * sob + hq * soh
        offs_m = t0 + tl.arange(0, BM)
        row_ok = offs_m < T
        q_off, do_off = _tile_offsets(offs_m, offs_d, offs_dv, sqt, sot, D_V)
        if MASK:
            q, do = load_pair(Q, DO, row_base, q_off, row_ok, do_base, do_off)
            lse2, delta = row_stats(LSE, DELTA, b * T + offs_m, HQ, hq, row_ok)
        else:  # every row saw a key: its lse is finite
            q = tl.load(Q + row_base + q_off)
            do = tl.load(DO + do_base + do_off)
            lse2 = tl.load(LSE + (b * T + offs_m) * HQ + hq) * 1.4426950408889634
            delta = tl.load(DELTA + (b * T + offs_m) * HQ + hq)
        s_t = dot(k, tl.trans(q), IEEE)  # [BN, BM]
        q2 = q
        if D2 > 0:
            if MASK:
                q2 = load_cols(Q, row_base, offs_m * sqt, row_ok, D, D2)
            else:
                q2 = tl.load(Q + row_base + (offs_m * sqt)[:, None] + (D + tl.arange(0, D2))[None, :])
            s_t += dot(k2, tl.trans(q2), IEEE)
        s_t = s_t * scale_log2
        if MASK:
            kpos = offs_n * STRIDE + OFFSET
            vis_t = (kpos[:, None] <= offs_m[None, :]) & col_ok[:, None] & row_ok[None, :]
            if WINDOW > 0:
                vis_t = vis_t & (offs_m[None, :] - kpos[:, None] < WINDOW)
            p_t = tl.where(vis_t, tl.exp2(s_t - lse2[None, :]), 0.0)
        else:
            p_t = tl.exp2(s_t - lse2[None, :])
        dv += dot(p_t.to(do.dtype), do, IEEE)
        dp_t = dot(v, tl.trans(do), IEEE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += dot(ds_t.to(q.dtype), q, IEEE)
        if D2 > 0:
            dk2 += dot(ds_t.to(q.dtype), q2, IEEE)
    return dk, dv, dk2


@triton.jit
def _strided_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sqb, sqt, sqh, skb, skt, skh, sdb, sdt, sdh,
    T, NK, HQ, G, scale_log2, scale,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
    D2: tl.constexpr = 0, D_V: tl.constexpr = 0, HEADS: tl.constexpr = 1, SPLIT: tl.constexpr = False,
    REVERSE: tl.constexpr = False,
):  # fmt: skip
    # One program per (key tile, HEADS query heads of one group): K and V loaded once, dK and dV summed
    # over the HEADS heads in registers, then added into fp32 dK/dV with atomics (G / HEADS programs
    # add into each tile). Head sizes as in _strided_fwd_kernel; dV contiguous like dK. SPLIT: the query
    # tiles that see the whole key tile (_query_interior) in a loop of their own, unmasked. REVERSE: the
    # query tiles from the last (Switches.cmp_bwd_reverse): the programs of one head then read the
    # same Q / dO rows at the same time, which stay in L2 for the others.
    DVAL: tl.constexpr = D if D_V == 0 else D_V
    pid_n = tl.program_id(0)
    b, hq0, h = query_head(tl.program_id(1) * HEADS, HQ, G)
    offs_n, offs_d, col_ok = tile_rows(pid_n, BN, NK, D)
    offs_dv, svb, svt, svh, sob, sot, soh = _value_layout(offs_d, sqb, sqt, sqh, skb, skt, skh, D, D2, D_V)
    kv_base = b * skb + h * skh
    kv_off = offs_n[:, None] * skt + offs_d[None, :]
    v_base, v_off = kv_base, kv_off
    if D_V > 0:
        v_base = b * svb + h * svh
        v_off = offs_n[:, None] * svt + offs_dv[None, :]
    k, v = load_pair(K, V, kv_base, kv_off, col_ok, v_base, v_off)
    k2 = k
    if D2 > 0:
        k2 = load_cols(K, kv_base, offs_n * skt, col_ok, D, D2)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, DVAL], tl.float32)
    dk2 = dk
    if D2 > 0:
        dk2 = tl.zeros([BN, D2], tl.float32)
    t_start = ((pid_n * BN * STRIDE + OFFSET) // BM) * BM  # first query that can see the tile's first key
    t_end = T
    if WINDOW > 0:
        last = tl.minimum(pid_n * BN + BN, NK) - 1
        t_end = tl.minimum(T, last * STRIDE + OFFSET + WINDOW)
    n_steps = tl.cdiv(t_end - t_start, BM)
    a, b_ = n_steps, n_steps  # SPLIT off: every tile in one masked loop
    if SPLIT:  # the unmasked interior [a, b_), then the diagonal [0, a) and far edge [b_, n_steps), masked
        a, b_ = _query_interior(pid_n * BN, t_start, n_steps, T, NK, STRIDE, OFFSET, WINDOW, BM, BN)
        dk, dv, dk2 = _strided_bwd_dkdv_tiles(a, b_, 0, 0, k, k2, v, dk, dv, dk2, Q, DO, LSE, DELTA, b,
                                              hq0, offs_n, offs_d, offs_dv, col_ok, t_start, T, HQ, sqb, sqt,
                                              sqh, sob, sot, soh, scale_log2, STRIDE, OFFSET, WINDOW, BM,
                                              HEADS, False, IEEE, D, D2, D_V, False, REVERSE)  # fmt: skip
    dk, dv, dk2 = _strided_bwd_dkdv_tiles(0, n_steps, a, b_, k, k2, v, dk, dv, dk2, Q, DO, LSE, DELTA, b, hq0,
                                          offs_n, offs_d, offs_dv, col_ok, t_start, T, HQ, sqb, sqt, sqh, sob,
                                          sot, soh, scale_log2, STRIDE, OFFSET, WINDOW, BM, HEADS, True, IEEE,
                                          D, D2, D_V, SPLIT, REVERSE)  # fmt: skip
    d_off = offs_n[:, None] * sdt + offs_d[None, :]
    tl.atomic_add(DK + (b * sdb + h * sdh) + d_off, dk * scale, mask=col_ok[:, None])
    if D_V > 0:
        sevb, sevt, sevh = value_strides(sdb, sdt, sdh, D + D2, DVAL)
        dv_off = offs_n[:, None] * sevt + offs_dv[None, :]
        tl.atomic_add(DV + (b * sevb + h * sevh) + dv_off, dv, mask=col_ok[:, None])
    else:
        tl.atomic_add(DV + (b * sdb + h * sdh) + d_off, dv, mask=col_ok[:, None])
    if D2 > 0:
        cols = D + tl.arange(0, D2)
        tl.atomic_add(DK + (b * sdb + h * sdh) + offs_n[:, None] * sdt + cols[None, :], dk2 * scale,
                      mask=col_ok[:, None])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launch shapes, launchers and autograd


def row_dot(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * O) in fp32, [B, T, HQ]. ``do.float() * o`` promotes o to fp32 inside the
    product (exactly, as ``o.float()`` would) without writing an fp32 copy of o: one launch and one
    [B, T, HQ, Dv] temporary fewer than before, the same bits (``test_row_dot_is_the_fp32_formula``)."""
    return (do.float() * o).sum(-1)


def backward_tile(d: int, itemsize: int = 2) -> dict:
    """The strided backward's tile (both branches): 64 queries x 64 keys, 2 stages, 8 warps at D >= 64.
    With 4 warps ptxas (sm_90a, offline) spills 0.4-1 KB per thread at D = 128 (two fp32 64 x 128
    accumulators beside K and V); with 8 at most 124 bytes. Under the interpreter 16 x 16 (the tests'
    small shapes)."""
    if interpreting():
        return {"BM": 16, "BN": 16, "num_warps": 4, "num_stages": 1}
    if d > 128 and itemsize > 2:
        # fp32 at the paper's head sizes (keys 128 + 64, values 128): 64 x 64 tiles spill 10-33 KB a
        # thread in every strided kernel (lab/sm90_check fp32); fp32 is the tests' exact path
        return {"BM": 32, "BN": 32, "num_warps": 4, "num_stages": 1}
    return {"BM": 64, "BN": 64, "num_warps": 8 if d >= 64 else 4, "num_stages": 2}


def forward_tile(d: int, itemsize: int) -> dict:
    """The compressed branch's forward tile: FlashAttention-2's Hopper shape, 128 queries x 64 keys with
    8 warps and 3 stages (two K/V tiles of 64 x 128 bf16 per stage fit shared memory). On an H100 at
    T = 64k, bf16 (2026-11-27, 5 interleaved rounds, results/*-strided-sweep.json) it took 10.1 ms
    split against 11.1 ms at 64 x 64; 128 x 128 and 64 x 128 were slower. fp32 tiles are twice the
    bytes: the backward's 64 x 64 shape fits at D = 128. Under the interpreter 16 x 16."""
    if interpreting() or itemsize > 2:
        return backward_tile(d, itemsize)
    return {"BM": 128 if d >= 64 else 64, "BN": 64, "num_warps": 8 if d >= 64 else 4, "num_stages": 3}


def strided_forward(q, k, v, scale: float, stride: int, offset: int, window: int, tile: dict,
                    switches: Switches, split: bool | None = None):  # fmt: skip
    """The strided forward at launch shape ``tile`` (``switches.strided_fwd_tile`` overrides it on a
    GPU). ``split`` None takes ``switches.strided_split``'s rule (the compressed branch in fp16 / bf16,
    or any dtype under the interpreter); True / False forces it (tests, sweeps). q [B, T, HQ, Dk],
    k [B, Nk, H, Dk], v [B, Nk, H, Dv], all contiguous, at kernel sizes (``common.kernel_dims``).
    Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32)."""
    b, t, hq, d = q.shape
    nk, h, dv = k.shape[1], k.shape[2], v.shape[3]
    o = torch.empty_like(q) if dv == d else q.new_empty(b, t, hq, dv)
    lse = torch.empty(b, t, hq, device=q.device, dtype=torch.float32)
    cfg = dict(tile)
    if switches.strided_fwd_tile is not None and not interpreting():
        bm, bn, warps, stages = switches.strided_fwd_tile
        cfg = {"BM": bm, "BN": bn, "num_warps": warps, "num_stages": stages}
    if split is None:
        split = switches.strided_split and window == 0 and (q.element_size() == 2 or interpreting())
    _strided_fwd_kernel[(triton.cdiv(t, cfg["BM"]), b * hq)](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, nk, hq, hq // h, scale * LOG2E,
        STRIDE=stride, OFFSET=offset, WINDOW=window, IEEE=is_fp32(q), SPLIT=bool(split),
        **head_constexprs(d, dv), **cfg,
    )  # fmt: skip
    return o, lse


def strided_backward(do, q, k, v, o, lse, scale: float, stride: int, offset: int, window: int,
                     heads_per_program: int = 1, split: bool = False, reverse: bool = False):  # fmt: skip
    """dQ, dK, dV of :func:`strided_forward` (same layouts; dK, dV summed over each group's heads).
    ``heads_per_program``: query heads of a group one dK/dV program walks (a divisor of the group;
    larger values are clamped to the group). ``split``: both kernels walk the tiles that see each other
    whole without a mask (``Switches.strided_bwd_split``). ``reverse``: the dK/dV kernel walks its
    query tiles last to first (``Switches.cmp_bwd_reverse`` for the compressed branch)."""
    b, t, hq, d = q.shape
    nk, h, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = hq // h
    heads = min(int(heads_per_program), g)
    if heads < 1 or g % heads:
        raise ValueError(
            f"strided_backward: heads_per_program = {heads_per_program} must divide the group of {g} query heads"
        )
    do = do.contiguous()
    delta = row_dot(do, o)  # [B, T, HQ]: rowsum(dO * O) = rowsum(P * dP)
    dq = torch.empty_like(q)
    dk = torch.zeros(b, nk, h, d, device=q.device, dtype=torch.float32)
    dv = (
        torch.zeros_like(dk) if d_v == d else torch.zeros(b, nk, h, d_v, device=q.device, dtype=torch.float32)
    )
    cfg = backward_tile(max(d, d_v), q.element_size())
    common = dict(
        STRIDE=stride, OFFSET=offset, WINDOW=window, IEEE=is_fp32(q), **head_constexprs(d, d_v), **cfg
    )
    if split:  # given only when on: off, the launches are the ones before the switch (lab/fingerprints)
        common["SPLIT"] = True
    _strided_bwd_dq_kernel[(triton.cdiv(t, cfg["BM"]), b * hq)](
        q, k, v, do, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, nk, hq, hq // h, scale * LOG2E, scale, **common,
    )  # fmt: skip
    if nk > 0:
        dkdv = dict(REVERSE=True) if reverse else {}  # off: the launches before the switch (fingerprints)
        _strided_bwd_dkdv_kernel[(triton.cdiv(nk, cfg["BN"]), b * hq // heads)](
            q, k, v, do, lse, delta, dk, dv,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            t, nk, hq, hq // h, scale * LOG2E, scale, HEADS=heads, **common, **dkdv,
        )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class StridedAttention(torch.autograd.Function):
    """Strided attention with its backward: ``apply(q, k, v, scale, stride, offset, window, tile,
    switches)`` -> (o, lse); lse carries no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, scale, stride, offset, window, tile, switches):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = strided_forward(q, k, v, scale, stride, offset, window, tile, switches)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, stride, offset, window)
        sw = switches or Switches()
        ctx.heads = sw.window_bwd_heads if window > 0 else sw.cmp_bwd_heads
        ctx.split = sw.strided_bwd_split
        ctx.reverse = sw.cmp_bwd_reverse and window == 0
        ctx.mark_non_differentiable(lse)
        # lse's gradient is never read: no [B, T, HQ] zeros allocated and filled for it (a launch)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:  # only lse was used downstream: nothing reaches q, k, v
            return (None,) * 9
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = strided_backward(do, q, k, v, o, lse, *ctx.args, heads_per_program=ctx.heads,
                                      split=ctx.split, reverse=ctx.reverse)  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    block_len: int = 32,
    stride: int = 16,
    scale: float | None = None,
    switches: Switches | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed branch (§3.3.1) with Triton kernels, forward and backward.

    q [B, T, HQ, Dk]; k_cmp [B, Nc, H, Dk], v_cmp [B, Nc, H, Dv] (compressed token i covers positions
    i d .. i d + l - 1 and is visible from position i d + l - 1 on). Returns (o [B, T, HQ, Dv], lse
    [B, T, HQ] float32, natural log, -inf where no compressed token is visible yet; lse carries no
    gradient). Head sizes the kernels do not take are zero-padded (``common.kernel_dims``).
    """
    b, t, hq, h, dk, dv = check_qkv("compressed_attention", q, k_cmp, v_cmp)
    if block_len < 1 or stride < 1:
        raise ValueError(
            f"compressed_attention: block_len and stride must be >= 1, got {block_len}, {stride}"
        )
    scale = softmax_scale(scale, dk)
    dk_k, dv_k = kernel_dims(dk, dv)
    q, k_cmp, v_cmp = pad_heads(q, dk_k), pad_heads(k_cmp, dk_k), pad_heads(v_cmp, dv_k)
    tile = forward_tile(max(dk_k, dv_k), q.element_size())
    o, lse = StridedAttention.apply(
        q, k_cmp, v_cmp, scale, stride, block_len - 1, 0, tile, switches or Switches()
    )
    return (o if dv_k == dv else o[..., :dv]), lse
