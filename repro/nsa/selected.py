"""The selected branch (yuan2025nsa §3.3.2, Eq. 12; kernel design §3.4, Figure 3): attention over the
tokens of the n blocks each query's group selected, forward and backward.

Forward, the paper's group-centric loading: one program per (query position, KV head) loads the G
query heads of that group as a [BG, D] tile (they share the selection, Eq. 10) and streams only the
n selected KV blocks of l' contiguous keys in its inner loop, so each block is read once for G heads
and feeds a [G, l'] matmul.

Backward: dQ on the forward's grid (a query's blocks are its own). dK, dV either block-major
(:func:`backward_block_major`): the selection inverted on the device
(:func:`invert_block_indices`), then per KV block its queries BQ at a time, so the dK, dV matmuls have
an inner dimension of BQ x G; or query-major (:func:`backward_query_major`, the cross-check): the
(block, query) pairs sorted by block, in fixed-size chunks so that the always-selected first block
does not serialise on one program, a chunk adding its partial sums with atomics when it moves to the
next block. ``Switches.slc_backward`` chooses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.nsa.common import (
    LOG2E,
    check_block_size,
    check_qkv,
    check_tensor,
    dkdv_step,
    dot,
    dq_step,
    group_rows,
    head_constexprs,
    interpreting,
    is_fp32,
    kernel_dims,
    load_cols,
    load_pair,
    lse_base2,
    normalise,
    online_softmax_step,
    pad_heads,
    row_stats,
    softmax_scale,
    value_strides,
)
from repro.nsa.config import Switches

#: queries per work item of the block-major dK/dV kernel on a GPU: a block read by more queries (the
#: first block, by all T of them) is split over several programs whose partial sums meet in fp32
#: atomics; 1024 = n l' (16 x 64), the average number of queries per block at the paper's setting
#: (not varied on a GPU)
BLOCK_MAJOR_CHUNK = 1024
#: rows of that kernel's query tile on a GPU, BQ x next_pow2(G): the inner dimension of its dV and dK
#: matmuls. 64 = one [64, 128] bf16 tile of q and of dO beside K, V and two fp32 [l', D] accumulators
#: (lab/sm90_check for registers). H100, 2026-11-27 (results/*-slc-bwd.json): 64 rows with 2 stages
#: the fastest of the three shapes timed; 32 rows 22% (8k) and 21% (64k) slower on the backward
BLOCK_MAJOR_ROWS = 64
#: software-pipelining stages of its query loop: 2 keeps the next tile's gathers in flight (1 spills
#: less, and cost 3.5% at 8k and 4.3% at 64k on the backward, same run)
BLOCK_MAJOR_STAGES = 2
#: (block, query) pairs per program of the query-major dK/dV kernel: 256 keeps the always-selected
#: first block (read by every query) spread over T S / 256 programs instead of serialised on one
QUERY_MAJOR_CHUNK = 256


@triton.jit
def _slc_prologue(t, pid_bh, H, G, sqb, sqt, sqh, skb, skh, BG: tl.constexpr, D: tl.constexpr):
    """The group-centric rows of query position ``t`` (``group_rows``) and where they lie: the 64-bit
    scalar bases ``row_base`` (q, dO, O, dQ) and ``kv_base`` (K, V), and the 32-bit tile offsets
    ``row_off`` of the [BG, D] rows."""
    b, h, HQ, offs_d, g_ok, hq = group_rows(pid_bh, H, G, BG, D)
    row_base = b * sqb + t.to(tl.int64) * sqt  # 64-bit scalar bases, 32-bit tile offsets
    row_off = hq[:, None] * sqh + offs_d[None, :]
    kv_base = b * skb + h * skh
    return b, h, HQ, offs_d, g_ok, hq, row_base, row_off, kv_base


@triton.jit
def _selected_block(BI_row, si, t, K, V, kv_base, skt, offs_d, BS: tl.constexpr,
                    v_base, svt, offs_dv, D: tl.constexpr, D2: tl.constexpr, D_V: tl.constexpr):  # fmt: skip
    """The ``si``-th selected block of a query at ``t``: which of its BS keys are visible (a real block,
    causal), and its K and V rows (0 where not visible); on the split path (common.py) V at its own
    ``v_base``, ``svt``, ``offs_dv``, and ``k2`` the keys' second piece (k again when D2 = 0)."""
    idx = tl.load(BI_row + si)
    kpos = idx * BS + tl.arange(0, BS)
    valid = (idx >= 0) & (kpos <= t)
    kv_off = kpos[:, None] * skt + offs_d[None, :]
    v_off = kv_off
    if D_V > 0:
        v_off = kpos[:, None] * svt + offs_dv[None, :]
    k, v = load_pair(K, V, kv_base, kv_off, valid, v_base, v_off)
    k2 = k
    if D2 > 0:
        k2 = load_cols(K, kv_base, kpos * skt, valid, D, D2)
    return valid, k, v, k2


@triton.jit
def _slc_split_rows(t, b, h, hq, offs_d, row_base, row_off, kv_base, sqb, sqt, sqh, skb, skt, skh,
                    D: tl.constexpr, D2: tl.constexpr, D_V: tl.constexpr):  # fmt: skip
    """Where a program's V, O and dO rows lie: on the split path (``D_V`` given) their own bases and
    offsets (contiguous tensors, strides scaled from k's and q's); else k's and q's, unchanged."""
    offs_dv, v_base, svt, o_base, o_off = offs_d, kv_base, skt, row_base, row_off
    if D_V > 0:
        offs_dv = tl.arange(0, D_V)
        svb, svt, svh = value_strides(skb, skt, skh, D + D2, D_V)
        sob, sot, soh = value_strides(sqb, sqt, sqh, D + D2, D_V)
        v_base = b * svb + h * svh
        o_base = b * sob + t.to(tl.int64) * sot
        o_off = hq[:, None] * soh + offs_dv[None, :]
    return offs_dv, v_base, svt, o_base, o_off


@triton.jit
def _slc_fwd_kernel(
    Q, K, V, BI, O, LSE,
    sqb, sqt, sqh, skb, skt, skh,
    T, H, G, S, scale_log2,
    D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, IEEE: tl.constexpr,
    D2: tl.constexpr = 0, D_V: tl.constexpr = 0,
):  # fmt: skip
    # Group-centric (§3.4): rows are the G query heads of one (position t, KV head h); the inner loop
    # streams the S selected blocks of l' = BS contiguous keys. Head sizes (common.py): key rows of D
    # (+ D2) columns, value and output rows of DVAL = D_V (split path) or D (verified path).
    DVAL: tl.constexpr = D if D_V == 0 else D_V
    t = tl.program_id(0)
    b, h, HQ, offs_d, g_ok, hq, row_base, row_off, kv_base = _slc_prologue(
        t, tl.program_id(1), H, G, sqb, sqt, sqh, skb, skh, BG, D
    )
    offs_dv, v_base, svt, o_base, o_off = _slc_split_rows(
        t, b, h, hq, offs_d, row_base, row_off, kv_base, sqb, sqt, sqh, skb, skt, skh, D, D2, D_V
    )
    q = tl.load(Q + row_base + row_off, mask=g_ok[:, None], other=0.0)
    q2 = q
    if D2 > 0:
        q2 = load_cols(Q, row_base, hq * sqh, g_ok, D, D2)
    m_i = tl.full([BG], -1e30, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, DVAL], tl.float32)
    bi_base = BI + ((b * T + t) * H + h) * S
    for si in range(S):
        valid, k, v, k2 = _selected_block(bi_base, si, t, K, V, kv_base, skt, offs_d, BS,
                                          v_base, svt, offs_dv, D, D2, D_V)  # fmt: skip
        _, m_i, l_i, acc = online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, IEEE,
                                               q2, k2, D2)  # fmt: skip
    o, lse = normalise(acc, m_i, l_i)
    tl.store(O + o_base + o_off, o.to(O.dtype.element_ty), mask=g_ok[:, None])
    tl.store(LSE + (b * T + t) * HQ + hq, lse, mask=g_ok)


@triton.jit
def _slc_bwd_dq_kernel(
    Q, K, V, DO, O, LSE, DELTA, BI, DQ,
    sqb, sqt, sqh, skb, skt, skh,
    T, H, G, S, scale_log2, scale,
    D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, IEEE: tl.constexpr,
    FUSE_DELTA: tl.constexpr = False, D2: tl.constexpr = 0, D_V: tl.constexpr = 0,
):  # fmt: skip
    # FUSE_DELTA: delta = rowsum(dO * O) computed here from the [BG, D] rows this program loads anyway
    # and stored to DELTA for the dK/dV kernel that runs after it (else DELTA is an input and O unused).
    # Head sizes as in _slc_fwd_kernel (dO and O rows of DVAL columns).
    t = tl.program_id(0)
    b, h, HQ, offs_d, g_ok, hq, row_base, row_off, kv_base = _slc_prologue(
        t, tl.program_id(1), H, G, sqb, sqt, sqh, skb, skh, BG, D
    )
    offs_dv, v_base, svt, o_base, o_off = _slc_split_rows(
        t, b, h, hq, offs_d, row_base, row_off, kv_base, sqb, sqt, sqh, skb, skt, skh, D, D2, D_V
    )
    q, do = load_pair(Q, DO, row_base, row_off, g_ok, o_base, o_off)
    if FUSE_DELTA:
        # kept in registers: re-reading DELTA here would read what other threads of this program
        # stored with no barrier between (torch.empty's garbage on the GPU; the CPU interpreter,
        # sequential, cannot show it)
        o = tl.load(O + o_base + o_off, mask=g_ok[:, None], other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DELTA + (b * T + t) * HQ + hq, delta, mask=g_ok)
        lse2 = lse_base2(LSE, b * T + t, HQ, hq, g_ok)
    else:
        lse2, delta = row_stats(LSE, DELTA, b * T + t, HQ, hq, g_ok)
    dq = tl.zeros([BG, D], tl.float32)
    q2, dq2 = q, dq
    if D2 > 0:
        q2 = load_cols(Q, row_base, hq * sqh, g_ok, D, D2)
        dq2 = tl.zeros([BG, D2], tl.float32)
    bi_base = BI + ((b * T + t) * H + h) * S
    for si in range(S):
        valid, k, v, k2 = _selected_block(bi_base, si, t, K, V, kv_base, skt, offs_d, BS,
                                          v_base, svt, offs_dv, D, D2, D_V)  # fmt: skip
        s = dot(q, tl.trans(k), IEEE)
        if D2 > 0:
            s += dot(q2, tl.trans(k2), IEEE)
        s = s * scale_log2
        p = tl.where(valid[None, :] & g_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        dq, dq2 = dq_step(p, k, k2, v, do, delta, dq, dq2, IEEE, D2)
    tl.store(DQ + row_base + row_off, (dq * scale).to(DQ.dtype.element_ty), mask=g_ok[:, None])
    if D2 > 0:
        cols = D + tl.arange(0, D2)
        tl.store(DQ + row_base + hq[:, None] * sqh + cols[None, :], (dq2 * scale).to(DQ.dtype.element_ty),
                 mask=g_ok[:, None])  # fmt: skip


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
                k, v = load_pair(K, V, kv_base, kv_off, start + tl.arange(0, BS) < T, kv_base, kv_off)
                cur = r
            bh = r // NB
            b = bh // H
            h = bh % H
            kpos = (r % NB) * BS + tl.arange(0, BS)
            hq = h * G + offs_g
            row_base = b * sqb + t * sqt
            row_off = hq[:, None] * sqh + offs_d[None, :]
            q, do = load_pair(Q, DO, row_base, row_off, g_ok, row_base, row_off)
            lse2, delta = row_stats(LSE, DELTA, b * T + t, HQ, hq, g_ok)
            # transposed orientation, [BS, BG]: dV = P^T dO and dK = dS^T Q without transposing P
            s_t = dot(k, tl.trans(q), IEEE) * scale_log2
            valid_t = (kpos <= t)[:, None] & g_ok[None, :]
            p_t = tl.where(valid_t, tl.exp2(s_t - lse2[None, :]), 0.0)
            acc_dk, acc_dv, _ = dkdv_step(p_t, q, q, do, v, delta, acc_dk, acc_dv, acc_dk, IEEE, 0)
    if cur >= 0:
        _slc_flush(DK, DV, acc_dk, acc_dv, cur, NB, H, T, sdb, sdt, sdh, scale, D, BS)


@triton.jit
def _slc_bwd_dkdv_tiled_kernel(
    Q, K, V, DO, LSE, DELTA, QIDX, OFFS, ITEM_SEG, FIRST_ITEM, DK, DV,
    sqb, sqt, sqh, skb, skt, skh, sdb, sdt, sdh,
    T, H, G, NB, NSEG, scale_log2, scale,
    D: tl.constexpr, BS: tl.constexpr, BGP: tl.constexpr, BQ: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr, D2: tl.constexpr = 0, D_V: tl.constexpr = 0,
):  # fmt: skip
    """dK, dV of the selected branch, block-major: one program per work item = up to CHUNK queries of
    one segment (KV block ``blk`` of KV head ``h`` in batch ``b``; segment = (b H + h) NB + blk).

    The inverted selection (:func:`invert_block_indices`): QIDX holds, segment after segment, the
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

    Head sizes as in :func:`_slc_fwd_kernel`: K, q, dK rows of D (+ D2) columns, V, dO, dV rows of
    DVAL; each tensor contiguous (dO like q, dV like dK).
    """
    DVAL: tl.constexpr = D if D_V == 0 else D_V
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
        kv_base = b * skb + h * skh
        kv_off = kpos[:, None] * skt + offs_d[None, :]
        k_ok = kpos < T
        offs_dv, v_base, v_off, sob, sot, soh = offs_d, kv_base, kv_off, sqb, sqt, sqh
        if D_V > 0:  # the split path's V, dO rows (common.py): contiguous, strides scaled
            offs_dv = tl.arange(0, DVAL)
            svb, svt, svh = value_strides(skb, skt, skh, D + D2, DVAL)
            sob, sot, soh = value_strides(sqb, sqt, sqh, D + D2, DVAL)
            v_base = b * svb + h * svh
            v_off = kpos[:, None] * svt + offs_dv[None, :]
        k, v = load_pair(K, V, kv_base, kv_off, k_ok, v_base, v_off)
        k2 = k
        if D2 > 0:
            k2 = load_cols(K, kv_base, kpos * skt, k_ok, D, D2)
        rows = tl.arange(0, BQ * BGP)
        slot = rows // BGP  # which of the tile's BQ queries a row belongs to
        hq = h * G + rows % BGP
        g_ok = rows % BGP < G
        dk = tl.zeros([BS, D], tl.float32)
        dv = tl.zeros([BS, DVAL], tl.float32)
        dk2 = dk
        if D2 > 0:
            dk2 = tl.zeros([BS, D2], tl.float32)
        for e0 in range(start, end, BQ):
            e = e0 + slot
            ok = (e < end) & g_ok
            t = tl.load(QIDX + e, mask=e < end, other=0)
            row_off = t[:, None] * sqt + hq[:, None] * sqh + offs_d[None, :]
            q_base = b * sqb
            do_base, do_off = q_base, row_off
            if D_V > 0:
                do_base = b * sob
                do_off = t[:, None] * sot + hq[:, None] * soh + offs_dv[None, :]
            q, do = load_pair(Q, DO, q_base, row_off, ok, do_base, do_off)
            lse2, delta = row_stats(LSE, DELTA, b * T + t, HQ, hq, ok)
            s_t = dot(k, tl.trans(q), IEEE)  # [BS, BQ BGP]
            q2 = q
            if D2 > 0:
                q2 = load_cols(Q, q_base, t * sqt + hq * sqh, ok, D, D2)
                s_t += dot(k2, tl.trans(q2), IEEE)
            s_t = s_t * scale_log2
            valid_t = (kpos[:, None] <= t[None, :]) & ok[None, :]  # causal inside the query's own block
            p_t = tl.where(valid_t, tl.exp2(s_t - lse2[None, :]), 0.0)
            dk, dv, dk2 = dkdv_step(p_t, q, q2, do, v, delta, dk, dv, dk2, IEEE, D2)
        d_off = kpos[:, None] * sdt + offs_d[None, :]
        d_base = b * sdb + h * sdh
        d_ok = (kpos < T)[:, None]
        dv_base, dv_off = d_base, d_off
        if D_V > 0:
            sevb, sevt, sevh = value_strides(sdb, sdt, sdh, D + D2, DVAL)
            dv_base = b * sevb + h * sevh
            dv_off = kpos[:, None] * sevt + offs_dv[None, :]
        if hi - lo > CHUNK:
            tl.atomic_add(DK + d_base + d_off, dk * scale, mask=d_ok)
            tl.atomic_add(DV + dv_base + dv_off, dv, mask=d_ok)
        else:
            tl.store(DK + d_base + d_off, dk * scale, mask=d_ok)
            tl.store(DV + dv_base + dv_off, dv, mask=d_ok)
        if D2 > 0:
            d2_off = kpos[:, None] * sdt + (D + tl.arange(0, D2))[None, :]
            if hi - lo > CHUNK:
                tl.atomic_add(DK + d_base + d2_off, dk2 * scale, mask=d_ok)
            else:
                tl.store(DK + d_base + d2_off, dk2 * scale, mask=d_ok)


# ----------------------------------------------------------------------------------------------
# Launchers and autograd


def check_block_indices(
    block_indices: torch.Tensor, b: int, t: int, h: int, block_size: int, tk: int
) -> None:
    """Indices must be [B, T, H, S] integers, each -1 (none) or a block that starts at or before the
    query, not repeated within a row."""
    fn = "selected_attention"
    check_tensor(fn, "block_indices", block_indices, 4, "[B, T, H, S]")
    if block_indices.shape[:3] != (b, t, h):
        raise ValueError(
            f"{fn}: block_indices must be [B, T, H, S] = [{b}, {t}, {h}, S], got {tuple(block_indices.shape)}"
        )
    if block_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: block_indices must be int32 or int64, got {block_indices.dtype}")
    bi = block_indices.long()
    nb = -(-tk // block_size)
    if (bi >= nb).any():
        raise ValueError(
            f"{fn}: block_indices out of range: the largest is {bi.max().item()}, blocks are 0..{nb - 1}"
        )
    pos = torch.arange(t, device=bi.device)[None, :, None, None]
    future = (bi >= 0) & (bi * block_size > pos)
    if future.any():
        where = future.nonzero()[0].tolist()
        raise ValueError(
            f"{fn}: block_indices selects a future block: query t = {where[1]} (batch {where[0]}, head "
            f"{where[2]}) picks block {bi[tuple(where)].item()}, which starts at {bi[tuple(where)].item() * block_size} > t"
        )
    srt = bi.sort(-1).values
    if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
        raise ValueError(f"{fn}: block_indices repeats a block within one query's row")


def selected_forward(q, k, v, bi, block_size: int, scale: float):
    """The group-centric forward: one program per (position, KV head), 4 warps for its [G, D] x [D, l']
    tiles, 2 stages so that the next selected block's load overlaps this one's matmuls. q [B, T, HQ, Dk],
    k [B, T, H, Dk], v [B, T, H, Dv] contiguous at kernel sizes (``common.kernel_dims``), bi [B, T, H, S]
    int32. Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32)."""
    b, t, hq, d = q.shape
    h, dv = k.shape[2], v.shape[3]
    g = hq // h
    o = torch.empty_like(q) if dv == d else q.new_empty(b, t, hq, dv)
    lse = torch.empty(b, t, hq, device=q.device, dtype=torch.float32)
    _slc_fwd_kernel[(t, b * h)](
        q, k, v, bi, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, h, g, bi.shape[-1], scale * LOG2E,
        BS=block_size, BG=max(16, triton.next_power_of_2(g)), IEEE=is_fp32(q), **head_constexprs(d, dv),
        num_warps=4, num_stages=2 if not interpreting() else 1,
    )  # fmt: skip
    return o, lse


def backward_query_major(do, q, k, v, o, lse, bi, block_size: int, scale: float):
    """The selected branch's query-major backward (``Switches.slc_backward = "query-major"``), the
    block-major one's independent cross-check: dQ on the forward's grid, delta = rowsum(dO * O) from
    PyTorch, then dK/dV over the (block, query) pairs sorted by block (the CSR list of which queries
    read each block, as flash-linear-attention's kernel walks it), QUERY_MAJOR_CHUNK pairs a program,
    partial sums added with atomics at every change of block. Returns (dq, dk, dv) in the inputs'
    dtypes."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    g = hq // h
    s = bi.shape[-1]
    bg = max(16, triton.next_power_of_2(g))
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    nw = 4  # a [G, l'] = [16, 64] tile per step: more warps would idle
    ns = 2 if not interpreting() else 1
    _slc_bwd_dq_kernel[(t, b * h)](
        q, k, v, do, o, lse, delta, bi, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, h, g, s, scale * LOG2E, scale,
        D=d, BS=block_size, BG=bg, IEEE=is_fp32(q), num_warps=nw, num_stages=ns,
    )  # fmt: skip
    # The (block, query) pairs sorted by block: the CSR list of which queries read each block.
    nb = triton.cdiv(t, block_size)
    invalid = b * h * nb * t
    bil = bi.long()
    bh = (
        torch.arange(b, device=q.device)[:, None, None, None] * h
        + torch.arange(h, device=q.device)[None, None, :, None]
    )
    pos = torch.arange(t, device=q.device)[None, :, None, None]
    keys = torch.where(bil >= 0, ((bh * nb + bil) * t + pos), invalid).flatten().sort().values
    dk = torch.zeros(b, t, h, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    n = keys.numel()
    chunk = QUERY_MAJOR_CHUNK if not interpreting() else 64
    _slc_bwd_dkdv_kernel[(triton.cdiv(n, chunk),)](
        q, k, v, do, lse, delta, keys, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        t, h, g, nb, n, invalid, scale * LOG2E, scale,
        D=d, BS=block_size, BG=bg, CHUNK=chunk, IEEE=is_fp32(q), num_stages=1,
        num_warps=8 if d >= 64 else 4,  # two fp32 [l', D] accumulators: 4 warps spill 3.9 KB at D = 128
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def invert_block_indices(
    bi: torch.Tensor, num_blocks: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The selection turned around, on the device with no host synchronisation: for each segment
    (b, h, block), segment = (b H + h) num_blocks + block, the positions t of the queries whose row of
    ``bi`` [B, T, H, S] (int, -1 = none) holds that block. Returns ``(qidx, offsets, item_seg,
    first_item, grid)``: qidx int32 lists the queries segment after segment, ascending within one
    (one sort of B T H S keys); offsets [NSEG + 1], where each segment's list starts (offsets[NSEG]:
    the number of valid pairs); the work items of the tiled dK/dV kernel, ``chunk`` queries at most,
    as item_seg [grid] int32 (the item's segment, NSEG past the last real item) and first_item [NSEG]
    (a segment's first item); offsets and first_item are int32 unless B T H S needs 64 bits.
    ``grid`` = NSEG + B T H S // chunk bounds the number of items (a segment of c queries has
    ceil(c / chunk) <= c / chunk + 1 of them) without reading c back."""
    fn = "invert_block_indices"
    check_tensor(fn, "bi", bi, 4, "[B, T, H, S]")
    if bi.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: bi must be int32 or int64, got {bi.dtype}")
    if chunk < 1 or num_blocks < 1:
        raise ValueError(
            f"{fn}: chunk and num_blocks must be >= 1, got chunk = {chunk}, num_blocks = {num_blocks}"
        )
    b, t, h, s = bi.shape
    nseg = b * h * num_blocks
    dev = bi.device
    wide = nseg * t >= 2**31 - 1  # int32 keys sort faster; 64-bit only when the keys need it
    kdt = torch.int64 if wide else torch.int32
    seg = (torch.arange(b, device=dev, dtype=kdt)[:, None, None, None] * h
           + torch.arange(h, device=dev, dtype=kdt)[None, None, :, None]) * num_blocks + bi.to(kdt)  # fmt: skip
    pos = torch.arange(t, device=dev, dtype=kdt)[None, :, None, None]
    keys = torch.where(bi >= 0, seg * t + pos, nseg * t).flatten().sort().values
    bounds = torch.arange(nseg + 1, device=dev, dtype=kdt) * t
    small = b * t * h * s < 2**31 - 1  # 32-bit offsets (fewer registers in the kernel's loop) when they fit
    offsets = torch.searchsorted(keys, bounds, out_int32=small)  # offsets[NSEG] = number of valid pairs
    qidx = (keys % t).to(torch.int32)
    items = (offsets.diff() + (chunk - 1)) // chunk
    last = items.cumsum(0).to(offsets.dtype)
    grid = nseg + b * t * h * s // chunk
    item_seg = torch.searchsorted(
        last, torch.arange(grid, device=dev, dtype=last.dtype), right=True, out_int32=True
    )
    return qidx, offsets, item_seg, last - items, grid


def backward_block_major(do, q, k, v, o, lse, bi, block_size: int, scale: float, switches: Switches):
    """The selected branch's backward, block-major (``Switches.slc_backward = "block-major"``).

    Why this split. dQ stays query-major (``_slc_bwd_dq_kernel``, one program per (t, KV head)):
    its accumulator is the query's own [G, D] rows, its matmuls have inner dimensions D and l', and
    a query's blocks are its own (neighbouring queries select different ones), so taking several
    queries per program would only add masked blocks; moving dQ into the block-major pass would add
    a [G, D] atomic per (query, block) pair (8.6e9 fp32 atomics at 64k). What dQ's kernel does
    differently here: it also computes delta = rowsum(dO * O) from the rows it loads
    (``FUSE_DELTA``), where :func:`backward_query_major` builds it with PyTorch from three [B, T, HQ, D] fp32
    temporaries (2 GB each at 64k). dK, dV go block-major (``_slc_bwd_dkdv_tiled_kernel``): the
    selection inverted once (:func:`invert_block_indices`, a sort of B T H S int keys and two
    searchsorted), then per KV block its queries BQ at a time, so the two accumulating matmuls have an
    inner dimension of BQ x G = ``BLOCK_MAJOR_ROWS`` rather than G, and K, V are loaded once per work
    item rather than at each change of block in a chunk of pairs.

    Costs: memory for a few [B, T, H, S] int temporaries (the keys, their sort, qidx: 17 MB each at
    64k, H = 4, S = 16, int32 keys), offsets and the item map (NSEG + grid ints, under 0.1 MB);
    launches: the sort, two searchsorted and a few elementwise ops (all on the stream, no host
    synchronisation), dQ, dK/dV, and the fp32 -> input dtype casts of dK, dV. Atomics only where a
    block is read by more than ``chunk`` queries, one [l', D] add per work item, so the summation
    order (and the last bits of dK, dV) of those blocks may change between runs; the rest is
    deterministic.
    """
    b, t, hq, d = q.shape
    h, d_v = k.shape[2], v.shape[3]
    heads = head_constexprs(d, d_v)
    g = hq // h
    bg = max(16, triton.next_power_of_2(g))
    interp = interpreting()
    ns = 2 if not interp else 1
    do = do.contiguous()
    delta = torch.empty(b, t, hq, device=q.device, dtype=torch.float32)  # written by the dQ kernel
    dq = torch.empty_like(q)
    _slc_bwd_dq_kernel[(t, b * h)](
        q, k, v, do, o, lse, delta, bi, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, h, g, bi.shape[-1], scale * LOG2E, scale,
        BS=block_size, BG=bg, IEEE=is_fp32(q), FUSE_DELTA=True, **heads, num_warps=4, num_stages=ns,
    )  # fmt: skip
    nb = triton.cdiv(t, block_size)
    chunk = switches.slc_bwd_chunk or (BLOCK_MAJOR_CHUNK if not interp else 16)
    # fp32 (twice the bytes per tile): 16 rows, one stage; 64 rows spill 29 KB per thread (sm90_check)
    wide = q.element_size() > 2
    # at the paper's head sizes (Dk = 192, Dv = 128) 64 rows compile without spills too (255 registers,
    # 32 rows 207: lab/sm90_check), one program per SM either way; not timed there on a GPU yet
    rows = switches.slc_bwd_rows or (BLOCK_MAJOR_ROWS if not (interp or wide) else 16)
    stages = switches.slc_bwd_stages or (BLOCK_MAJOR_STAGES if not (interp or wide) else 1)
    bgp = triton.next_power_of_2(g)
    bq = max(1, rows // bgp)
    qidx, offsets, item_seg, first_item, grid = invert_block_indices(bi, nb, chunk)
    dk = torch.zeros(b, t, h, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk) if d_v == d else torch.zeros(b, t, h, d_v, device=q.device, dtype=torch.float32)
    _slc_bwd_dkdv_tiled_kernel[(grid,)](
        q, k, v, do, lse, delta, qidx, offsets, item_seg, first_item, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        t, h, g, nb, b * h * nb, scale * LOG2E, scale,
        BS=block_size, BGP=bgp, BQ=bq, CHUNK=chunk, IEEE=is_fp32(q), **heads,
        num_warps=8 if d >= 64 and not interp else 4,
        num_stages=stages,
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class SelectedAttention(torch.autograd.Function):
    """The selected branch with its backward: ``apply(q, k, v, bi, block_size, scale, switches)``; the
    switches are kept for the backward (``slc_backward`` and its launch shape)."""

    @staticmethod
    def forward(ctx, q, k, v, bi, block_size, scale, switches):
        q, k, v, bi = q.contiguous(), k.contiguous(), v.contiguous(), bi.to(torch.int32).contiguous()
        o, lse = selected_forward(q, k, v, bi, block_size, scale)
        ctx.save_for_backward(q, k, v, o, lse, bi)
        ctx.args = (block_size, scale)
        ctx.switches = switches
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, bi = ctx.saved_tensors
        if ctx.switches.slc_backward == "block-major":
            dq, dk, dv = backward_block_major(do, q, k, v, o, lse, bi, *ctx.args, ctx.switches)
        else:
            dq, dk, dv = backward_query_major(do, q, k, v, o, lse, bi, *ctx.args)
        return dq, dk, dv, None, None, None, None


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    block_size: int = 64,
    scale: float | None = None,
    check_indices: bool = True,
    switches: Switches | None = None,
) -> torch.Tensor:
    """Selected branch (§3.3.2, Eq. 12) with the group-centric Triton kernel, forward and backward.

    q [B, T, HQ, Dk]; k [B, T, H, Dk]; v [B, T, H, Dv]; block_indices [B, T, H, S] int: block j covers
    keys j l' .. j l' + l' - 1 (l' = ``block_size``); a negative entry means no block; a block must
    start at or before its query (keys after the query inside its own block are masked) and appear
    once per row. ``check_indices=False`` skips that validation (it synchronises with the GPU).
    Returns [B, T, HQ, Dv]. Head sizes the kernels do not take are zero-padded
    (``common.kernel_dims``); the query-major backward takes Dk = Dv in {16, 32, 64, 128} only.
    """
    b, t, hq, h, dk, dv = check_qkv("selected_attention", q, k, v, k_len=q.shape[1])
    check_block_size("selected_attention", "block_size", block_size)
    sw = switches or Switches()
    dk_k, dv_k = kernel_dims(dk, dv)
    if sw.slc_backward == "query-major" and dk_k != dv_k:
        raise ValueError(
            f"selected_attention: Switches.slc_backward = 'query-major' takes Dk = Dv, got Dk = {dk} (kernel "
            f"{dk_k}) and Dv = {dv} (kernel {dv_k}); the block-major backward takes both"
        )
    if check_indices:
        check_block_indices(block_indices, b, t, h, block_size, k.shape[1])
    scale = softmax_scale(scale, dk)
    q, k, v = pad_heads(q, dk_k), pad_heads(k, dk_k), pad_heads(v, dv_k)
    o = SelectedAttention.apply(q, k, v, block_indices, block_size, scale, sw)
    return o if dv_k == dv else o[..., :dv]
