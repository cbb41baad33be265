"""Triton kernels: one attention forward with FA4's ideas as compile-time switches, and a backward.

Forward (``_fwd_kernel``), per query tile of BLOCK_M rows, over key blocks of BLOCK_N:
    S = Q K^T * scale * log2(e)                      (base-2 logits, as FA2-4 do)
    m_cand = max(m, rowmax S)
    LAZY_RESCALE: move m (and multiply O, l by 2^(m - m_cand)) only if some row of the tile
                  has m_cand - m > RESCALE_TAU (FA4: 8); else keep the stale m. Exact after O / l.
    P = 2^(S - m) where SOFT_EXP quarters of the columns use a degree-3 polynomial on the FMA
                  units (range reduction + exponent-bit add) and the rest use the hardware ex2.
    l += rowsum P;  O += P V
Schedule switches (what Triton on Hopper can express):
    USE_TMA:  K/V tiles through the tensor-memory-accelerator copy engine (host tensor descriptors);
    PINGPONG: each program owns two query tiles and interleaves their softmax / matmuls over one
              load of K and V (FA3/FA4 ping-pong between warpgroups is not expressible: Triton gives
              no named barriers or per-warpgroup roles; this is the closest single-program form);
    WARP_SPEC: ``tl.range(..., warp_specialize=True)`` (Triton 3.6's automatic partitioning into
              load / MMA / softmax warps; on Hopper through its experimental pass);
    PERSISTENT: a grid of about one program per SM looping over tiles, heaviest causal tiles first;
    num_stages: the software-pipelining depth of K/V loads (launch option).
Tensor memory, 2-CTA MMA and fully asynchronous tcgen05 MMA are Blackwell hardware: not here.

Backward: FA2's two-kernel form recomputing P from the saved log-sum-exp (base 2): one kernel per
key block accumulating dK, dV over all query heads of its KV group (no atomics for GQA), one per
query block accumulating dQ. Layout is [B, S, H, D] everywhere; LSE is [B, H, S_q] float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paperclub.triton_compat import patch_interpreter
from repro.fa4.reference import EXP2_MIN_INPUT, EXP2_POLY3

# Polynomial coefficients as compile-time constants (c0 = 1 is pinned in the fit).
_C1 = tl.constexpr(EXP2_POLY3[1])
_C2 = tl.constexpr(EXP2_POLY3[2])
_C3 = tl.constexpr(EXP2_POLY3[3])
_XMIN = tl.constexpr(EXP2_MIN_INPUT)


patch_interpreter()  # loops over run-time bounds and bf16 under the CPU interpreter


@triton.jit
def exp2_soft(x):
    """2^x on the FMA pipe: x = j + f, 2^f ~ ((c3 f + c2) f + c1) f + 1, 2^j added to the exponent."""
    xc = tl.maximum(x, _XMIN)
    j = tl.floor(xc)
    f = xc - j
    p = tl.fma(f, _C3, _C2)
    p = tl.fma(p, f, _C1)
    p = tl.fma(p, f, 1.0)
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)
    # Below 2^-126 the exponent field would wrap; those terms are 0 to fp32 softmax anyway.
    return tl.where(x < _XMIN, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _exp2_mixed(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_EXP: tl.constexpr):
    """2^x with SOFT_EXP/4 of the columns in software. Columns are split by reshape + split, which
    keeps each thread's registers in place (adjacent accumulator columns live in one thread)."""
    if SOFT_EXP == 0:
        p = tl.math.exp2(x)
    elif SOFT_EXP == 4:
        p = exp2_soft(x)
    elif SOFT_EXP == 2:
        xa, xb = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
        p = tl.reshape(tl.join(tl.math.exp2(xa), exp2_soft(xb)), (BLOCK_M, BLOCK_N))
    else:  # SOFT_EXP == 1: one column in four
        xa, xb = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
        xa0, xa1 = tl.split(tl.reshape(xa, (BLOCK_M, BLOCK_N // 4, 2)))
        pa = tl.reshape(tl.join(tl.math.exp2(xa0), exp2_soft(xa1)), (BLOCK_M, BLOCK_N // 2))
        p = tl.reshape(tl.join(pa, tl.math.exp2(xb)), (BLOCK_M, BLOCK_N))
    return p


@triton.jit
def _softmax_step(
    qk,
    qk_scale,
    m_i,
    l_i,
    acc,
    v,
    n_resc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    RESCALE_TAU: tl.constexpr,
    SOFT_EXP: tl.constexpr,
):
    """One online-softmax step for a tile: qk [BLOCK_M, BLOCK_N] raw scores (-inf where masked);
    the base-2 logits are qk * qk_scale, folded into one FMA with the shift below."""
    m_cand = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if LAZY_RESCALE:
        # Warp-uniform decision for the whole tile: the branch is skipped entirely most of the time.
        # (grow is +inf on the first block, NaN never: the first block of every row has a visible key.)
        need = tl.max(m_cand - m_i, 0) > RESCALE_TAU
        if need:
            alpha = tl.math.exp2(m_i - m_cand)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_cand
            n_resc += 1
    else:
        n_resc += (tl.max(m_cand - m_i, 0) > 0).to(tl.int32)
        alpha = tl.math.exp2(m_i - m_cand)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_cand
    p = _exp2_mixed(tl.fma(qk, qk_scale, -m_i[:, None]), BLOCK_M, BLOCK_N, SOFT_EXP)
    l_i += tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_i, l_i, acc, n_resc


@triton.jit
def _attend_block(
    q, k, v, cols, offs_m, S_K, diag, qk_scale, m_i, l_i, acc, n_resc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, RESCALE_TAU: tl.constexpr, SOFT_EXP: tl.constexpr,
):  # fmt: skip
    """One query tile against one key block: S = Q K^T (MASKED: keys past S_K and, causal, past the
    diagonal to -inf), then the online-softmax step."""
    if MASKED:
        ok = cols[None, :] < S_K
        if CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + diag)
        s = tl.where(ok, tl.dot(q, tl.trans(k)), float("-inf"))
    else:
        s = tl.dot(q, tl.trans(k))
    return _softmax_step(
        s, qk_scale, m_i, l_i, acc, v, n_resc, BLOCK_M, BLOCK_N, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP
    )


@triton.jit
def _store_tile(o_base, lse_base, offs_m, offs_d, stride_os, acc, l_i, m_i, S_Q):
    """O / l and the base-2 log-sum-exp of one query tile, rows past S_Q left alone."""
    tl.store(
        o_base + offs_m[:, None] * stride_os + offs_d[None, :],
        (acc / l_i[:, None]).to(o_base.dtype.element_ty),
        mask=offs_m[:, None] < S_Q,
    )
    tl.store(lse_base + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < S_Q)


@triton.jit
def _fwd_tile(
    Q,
    K,
    V,
    O,
    LSE,
    COUNTS,
    count_slot,
    off_b,
    off_h,
    m_block,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    H,
    GROUP,
    S_Q,
    S_K,
    qk_scale,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    RESCALE_TAU: tl.constexpr,
    SOFT_EXP: tl.constexpr,
    PINGPONG: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    COUNT: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Attention for query rows [m_block * TILE, +TILE) of head (off_b, off_h); TILE = BLOCK_M, or
    2 * BLOCK_M with PINGPONG (two tiles a and b sharing each K/V load)."""
    off_hk = off_h // GROUP
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    # With USE_TMA, K and V are tensor descriptors over [B * S_K, H_KV * D] (bulk copies by the TMA
    # engine); otherwise pointers.
    kv_row0 = off_b * S_K
    if not USE_TMA:
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_base = O + off_b * stride_ob + off_h * stride_oh
    TILES: tl.constexpr = 2 if PINGPONG else 1
    start_a = m_block * (TILES * BLOCK_M)
    offs_ma = start_a + tl.arange(0, BLOCK_M)
    offs_mb = offs_ma + BLOCK_M
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_a = tl.load(
        q_base + offs_ma[:, None] * stride_qs + offs_d[None, :], mask=offs_ma[:, None] < S_Q, other=0.0
    )
    m_a = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_a = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, D], tl.float32)
    n_resc_a = off_h * 0  # an int32 scalar tensor: loop-carried counters need a fixed type
    if PINGPONG:
        q_b = tl.load(
            q_base + offs_mb[:, None] * stride_qs + offs_d[None, :], mask=offs_mb[:, None] < S_Q, other=0.0
        )
        m_b = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_b = tl.zeros([BLOCK_M], tl.float32)
        acc_b = tl.zeros([BLOCK_M, D], tl.float32)
        n_resc_b = off_h * 0
    # Key ranges. Causal is bottom-right aligned: row i sees keys j <= i + (S_K - S_Q).
    diag = S_K - S_Q
    if CAUSAL:
        full_end = tl.minimum(((start_a + diag + 1) // BLOCK_N) * BLOCK_N, (S_K // BLOCK_N) * BLOCK_N)
        full_end = tl.maximum(full_end, 0)
        hi = tl.minimum(start_a + TILES * BLOCK_M + diag, S_K)
    else:
        full_end = (S_K // BLOCK_N) * BLOCK_N
        hi = S_K
    # Phase 1: key blocks every row sees in full: no masks at all.
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
        cols = start_n + offs_n
        if USE_TMA:
            k = K.load([kv_row0 + start_n, off_hk * D])
            v = V.load([kv_row0 + start_n, off_hk * D])
        else:
            k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :])
        m_a, l_a, acc_a, n_resc_a = _attend_block(
            q_a, k, v, cols, offs_ma, S_K, diag, qk_scale, m_a, l_a, acc_a, n_resc_a,
            BLOCK_M, BLOCK_N, False, CAUSAL, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
        )  # fmt: skip
        if PINGPONG:
            m_b, l_b, acc_b, n_resc_b = _attend_block(
                q_b, k, v, cols, offs_mb, S_K, diag, qk_scale, m_b, l_b, acc_b, n_resc_b,
                BLOCK_M, BLOCK_N, False, CAUSAL, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
            )  # fmt: skip
    # Phase 2: the diagonal band (causal) and the ragged last block: masked.
    for start_n in tl.range(full_end, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = cols[:, None] < S_K
        if USE_TMA:
            # Rows past S_K belong to the next batch (or lie out of bounds and read as zero); their
            # scores are masked to -inf below, so P is 0 there and they add nothing.
            k = K.load([kv_row0 + start_n, off_hk * D])
            v = V.load([kv_row0 + start_n, off_hk * D])
        else:
            k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_ok, other=0.0)
        m_a, l_a, acc_a, n_resc_a = _attend_block(
            q_a, k, v, cols, offs_ma, S_K, diag, qk_scale, m_a, l_a, acc_a, n_resc_a,
            BLOCK_M, BLOCK_N, True, CAUSAL, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
        )  # fmt: skip
        if PINGPONG:
            m_b, l_b, acc_b, n_resc_b = _attend_block(
                q_b, k, v, cols, offs_mb, S_K, diag, qk_scale, m_b, l_b, acc_b, n_resc_b,
                BLOCK_M, BLOCK_N, True, CAUSAL, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
            )  # fmt: skip
    # Epilogue: one shared shift for O and l, so the stale max cancels exactly.
    lse_base = LSE + (off_b * H + off_h) * S_Q
    _store_tile(o_base, lse_base, offs_ma, offs_d, stride_os, acc_a, l_a, m_a, S_Q)
    n_steps = tl.cdiv(hi, BLOCK_N)
    n_resc = n_resc_a
    if PINGPONG:
        _store_tile(o_base, lse_base, offs_mb, offs_d, stride_os, acc_b, l_b, m_b, S_Q)
        n_resc += n_resc_b
        n_steps = 2 * n_steps
    if COUNT:
        # (key-block steps, rescales) of this tile; the host subtracts the first step of each tile.
        tl.store(COUNTS + 2 * count_slot, n_steps)
        tl.store(COUNTS + 2 * count_slot + 1, n_resc)


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    COUNTS,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    B,
    H,
    GROUP,
    S_Q,
    S_K,
    qk_scale,
    NUM_M_BLOCKS,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    RESCALE_TAU: tl.constexpr,
    SOFT_EXP: tl.constexpr,
    PINGPONG: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    PERSISTENT: tl.constexpr,
    COUNT: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    if PERSISTENT:
        # Tile t -> (m block, head): all heads' last (heaviest causal) query block first, so the
        # long tiles start early and short ones fill the tail (longest-processing-time first).
        total = NUM_M_BLOCKS * B * H
        for t in range(tl.program_id(0), total, tl.num_programs(0)):
            bh = t % (B * H)
            m_block = NUM_M_BLOCKS - 1 - t // (B * H)
            _fwd_tile(
                Q, K, V, O, LSE, COUNTS, m_block * B * H + bh, bh // H, bh % H, m_block,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                H, GROUP, S_Q, S_K, qk_scale,
                D, BLOCK_M, BLOCK_N, CAUSAL, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP, PINGPONG, WARP_SPEC, COUNT, USE_TMA,
            )  # fmt: skip
    else:
        m_block = NUM_M_BLOCKS - 1 - tl.program_id(0)  # heaviest causal blocks launch first
        bh = tl.program_id(1)
        _fwd_tile(
            Q, K, V, O, LSE, COUNTS, m_block * B * H + bh, bh // H, bh % H, m_block,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
            H, GROUP, S_Q, S_K, qk_scale,
            D, BLOCK_M, BLOCK_N, CAUSAL, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP, PINGPONG, WARP_SPEC, COUNT, USE_TMA,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    H,
    H_KV,
    GROUP,
    S_Q,
    S_K,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """dV = sum_i P^T dO, dK = scale * sum_i dS^T Q for one key block, over every query head of the
    KV group (GQA without atomics). Works on transposed tiles (keys as rows) to avoid transposes.
    Q and DO share strides (both [B, S_q, H, D] contiguous); K, V, DK, DV share theirs."""
    n_block = tl.program_id(0)
    bhk = tl.program_id(1)
    off_b = bhk // H_KV
    off_hk = bhk % H_KV
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_m0 = tl.arange(0, BLOCK_M)
    n_ok = offs_n[:, None] < S_K
    kv_off = off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    k = tl.load(K + kv_off, mask=n_ok, other=0.0)
    v = tl.load(V + kv_off, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    diag = S_K - S_Q
    # First query row that can see this key block (causal): i + diag >= n_block * BLOCK_N.
    if CAUSAL:
        m_lo = tl.maximum(n_block * BLOCK_N - diag, 0)
        m_lo = (m_lo // BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        q_head = off_b * stride_qb + off_h * stride_qh
        stat_base = (off_b * H + off_h) * S_Q
        for start_m in range(m_lo, S_Q, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m[None, :] < S_Q
            qT = tl.load(Q + q_head + offs_m[None, :] * stride_qs + offs_d[:, None], mask=m_ok, other=0.0)
            doT = tl.load(DO + q_head + offs_m[None, :] * stride_qs + offs_d[:, None], mask=m_ok, other=0.0)
            lse = tl.load(LSE + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
            delta = tl.load(DELTA + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
            sT = tl.dot(k, qT) * qk_scale  # [BLOCK_N, BLOCK_M]
            pT = tl.math.exp2(sT - lse[None, :])
            ok = m_ok & n_ok
            if CAUSAL:
                ok = ok & (offs_n[:, None] <= offs_m[None, :] + diag)
            pT = tl.where(ok, pT, 0.0)
            dv = tl.dot(pT.to(doT.dtype), tl.trans(doT), dv)
            dpT = tl.dot(v, doT)
            dsT = pT * (dpT - delta[None, :])
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
    dk_off = off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    tl.store(DK + dk_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + dk_off, dv.to(DV.dtype.element_ty), mask=n_ok)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    H,
    GROUP,
    S_Q,
    S_K,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """dQ = scale * sum_j dS K for one query block; dS = P * (dP - delta), dP = dO V^T.
    Q, DO and DQ share strides; K and V share theirs."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = bh // H
    off_h = bh % H
    off_hk = off_h // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_ok = offs_m[:, None] < S_Q
    q_off = off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(Q + q_off, mask=m_ok, other=0.0)
    do = tl.load(DO + q_off, mask=m_ok, other=0.0)
    stat_base = (off_b * H + off_h) * S_Q
    lse = tl.load(LSE + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
    delta = tl.load(DELTA + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    diag = S_K - S_Q
    if CAUSAL:
        hi = tl.minimum((m_block + 1) * BLOCK_M + diag, S_K)
    else:
        hi = S_K
    kv_head = off_b * stride_kb + off_hk * stride_kh
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n[None, :] < S_K
        kT = tl.load(K + kv_head + offs_n[None, :] * stride_ks + offs_d[:, None], mask=n_ok, other=0.0)
        vT = tl.load(V + kv_head + offs_n[None, :] * stride_ks + offs_d[:, None], mask=n_ok, other=0.0)
        s = tl.dot(q, kT) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        ok = m_ok & n_ok
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag)
        p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok)
