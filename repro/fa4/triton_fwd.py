"""The Triton forward: one attention kernel with FA4's two forward ideas as compile-time switches
(zadouri2026flashattention4, contribution 2), and its launcher.

``_fwd_kernel``, per query tile of BLOCK_M rows, over key blocks of BLOCK_N:
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
              no named barriers or per-warpgroup roles; this is the closest single-program form;
              ``repro.fa4.gluon_fwd`` has the real one);
    WARP_SPEC: ``tl.range(..., warp_specialize=True)`` (Triton 3.6's automatic partitioning into
              load / MMA / softmax warps; on Hopper through its experimental pass);
    PERSISTENT: a grid of about one program per SM looping over tiles, heaviest causal tiles first;
    num_stages: the software-pipelining depth of K/V loads (launch option).
Tensor memory, 2-CTA MMA and fully asynchronous tcgen05 MMA are Blackwell hardware: not here.

Layout is [B, S, H, D] everywhere; LSE is [B, H, S_q] float32 in base 2 (m + log2 l), what every
backward of this package reads. :func:`triton_forward` launches the kernel with a resolved
``repro.fa4.api.Switches`` (``api.resolve`` fills the launch shape from FWD_DEFAULTS).

Issue #42 added, without changing the compiled code of any launch that ran before (``lab/fingerprints.py``):
``D_V``, v's head size where it differs from q's (``api.head_layout``: D = 256 with v on 128, or
``own_v_tile``), the D = 256 launch, and ``_fwd_window_kernel``, the same tile function with a
sliding window (row i sees keys i + diag - left .. i + diag + right; its blocks split into masked
edges and whole blocks in between, as the causal path's are) and an online softmax that tolerates
rows that have seen no key yet. Not yet run on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from paperclub.triton_compat import patch_interpreter
from repro.fa4.reference import EXP2_MIN_INPUT, EXP2_POLY3

# Polynomial coefficients as compile-time constants (c0 = 1 is pinned in the fit).
_C1 = tl.constexpr(EXP2_POLY3[1])
_C2 = tl.constexpr(EXP2_POLY3[2])
_C3 = tl.constexpr(EXP2_POLY3[3])
_XMIN = tl.constexpr(EXP2_MIN_INPUT)

#: Launch shape per head dim, (block_m, block_n, num_warps, num_stages): tuned on one H100
#: (repro/fa4/results/*-autotune.json, S = 8192; ``python -m repro.fa4.lab.tuning launch``).
#: D = 256 (issue #42): the widest tile that compiles for sm_90a without spills and fits shared memory
#: (offline compile, ``repro.fa4.lab.compile``: 128 x 64 with 8 warps and 2 stages, 255 registers,
#: 196 KB; 64 x 128 needs 296 KB); not yet run on a GPU.
FWD_DEFAULTS = {64: (128, 128, 8, 3), 128: (128, 128, 8, 3), 256: (128, 64, 8, 2)}
#: The window kernel's launch where it differs from FWD_DEFAULTS: nowhere (its masks compile without
#: spills at every FWD_DEFAULTS shape: D = 64 243 registers, 128 and 256 255, offline).
FWD_WINDOW_DEFAULTS: dict[int, tuple[int, int, int, int]] = {}
#: The interpreter's launch (and any other head dim's): small tiles keep the CPU tests fast.
FWD_INTERPRET = (16, 16, 4, 1)


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
    GUARD_EMPTY: tl.constexpr = False,
):
    """One online-softmax step for a tile: qk [BLOCK_M, BLOCK_N] raw scores (-inf where masked);
    the base-2 logits are qk * qk_scale, folded into one FMA with the shift below.

    GUARD_EMPTY (the sliding window's path): a row may have seen no visible key yet (its window starts
    past this block), so m stays -inf there; the row's shift is then 0 and its alpha 1 instead of the
    NaN that -inf - (-inf) gives. Without a window the first block of every row has a visible key."""
    m_cand = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if GUARD_EMPTY:
        no_key = m_cand == float("-inf")
        grow = tl.where(no_key, 0.0, m_cand - m_i)
        if LAZY_RESCALE:
            need = tl.max(grow, 0) > RESCALE_TAU
            if need:
                alpha = tl.where(no_key, 1.0, tl.math.exp2(m_i - m_cand))
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_cand
                n_resc += 1
        else:
            n_resc += (tl.max(grow, 0) > 0).to(tl.int32)
            alpha = tl.where(no_key, 1.0, tl.math.exp2(m_i - m_cand))
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_cand
        shift = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = _exp2_mixed(tl.fma(qk, qk_scale, -shift[:, None]), BLOCK_M, BLOCK_N, SOFT_EXP)
    else:
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
def _attend_block_window(
    q, k, v, cols, offs_m, S_K, diag, win_left, win_right, qk_scale, m_i, l_i, acc, n_resc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, RESCALE_TAU: tl.constexpr, SOFT_EXP: tl.constexpr,
):  # fmt: skip
    """:func:`_attend_block` for a sliding window: row i sees keys j with
    i + diag - win_left <= j <= i + diag + win_right (bottom-right aligned, diag = S_K - S_Q);
    MASKED blocks apply that and j < S_K; the softmax step guards rows that see no key yet."""
    if MASKED:
        ok = cols[None, :] < S_K
        ok = ok & (cols[None, :] >= offs_m[:, None] + (diag - win_left))
        ok = ok & (cols[None, :] <= offs_m[:, None] + (diag + win_right))
        s = tl.where(ok, tl.dot(q, tl.trans(k)), float("-inf"))
    else:
        s = tl.dot(q, tl.trans(k))
    return _softmax_step(
        s, qk_scale, m_i, l_i, acc, v, n_resc, BLOCK_M, BLOCK_N, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP, True
    )


@triton.jit
def window_key_range(start_m, rows, S_K, diag, win_left, win_right, BLOCK_N: tl.constexpr):
    """Key blocks of query rows [start_m, start_m + rows) under a window: (lo, full_lo, full_hi, hi)
    with [lo, hi) every key some row sees (lo a multiple of BLOCK_N) and [full_lo, full_hi) the whole
    blocks every row sees in full (no mask needed); lo <= full_lo <= full_hi <= hi."""
    lo = (tl.maximum(start_m + diag - win_left, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.minimum(start_m + rows + diag + win_right, S_K), lo)
    # the last row's first key, rounded up; the first row's last key + 1 (or S_K), rounded down
    full_lo = tl.cdiv(tl.maximum(start_m + rows - 1 + diag - win_left, 0), BLOCK_N) * BLOCK_N
    full_hi = (tl.minimum(start_m + diag + win_right + 1, S_K) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


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
    D_V: tl.constexpr,
    WINDOW: tl.constexpr,
    win_left,
    win_right,
):
    """Attention for query rows [m_block * TILE, +TILE) of head (off_b, off_h); TILE = BLOCK_M, or
    2 * BLOCK_M with PINGPONG (two tiles a and b sharing each K/V load). D is the head size of q and
    k, D_V that of v and o. WINDOW: a sliding window of win_left keys before and win_right after each
    row's diagonal (not with PINGPONG)."""
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
    if D_V == D:
        offs_dv = offs_d
    else:
        offs_dv = tl.arange(0, D_V)
    offs_n = tl.arange(0, BLOCK_N)
    q_a = tl.load(
        q_base + offs_ma[:, None] * stride_qs + offs_d[None, :], mask=offs_ma[:, None] < S_Q, other=0.0
    )
    m_a = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_a = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_V], tl.float32)
    n_resc_a = off_h * 0  # an int32 scalar tensor: loop-carried counters need a fixed type
    if PINGPONG:
        q_b = tl.load(
            q_base + offs_mb[:, None] * stride_qs + offs_d[None, :], mask=offs_mb[:, None] < S_Q, other=0.0
        )
        m_b = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_b = tl.zeros([BLOCK_M], tl.float32)
        acc_b = tl.zeros([BLOCK_M, D_V], tl.float32)
        n_resc_b = off_h * 0
    # Key ranges. Causal is bottom-right aligned: row i sees keys j <= i + (S_K - S_Q).
    diag = S_K - S_Q
    if WINDOW:
        tl.static_assert(not PINGPONG, "the sliding window runs one query tile per program")
        # masked blocks where the window's left edge crosses the tile, whole blocks, masked blocks
        # where its right edge (or S_K) does
        lo, full_lo, full_hi, hi = window_key_range(start_a, BLOCK_M, S_K, diag, win_left, win_right, BLOCK_N)
        for start_n in tl.range(lo, full_lo, BLOCK_N):
            cols = start_n + offs_n
            kv_ok = cols[:, None] < S_K
            if USE_TMA:
                k = K.load([kv_row0 + start_n, off_hk * D])
                v = V.load([kv_row0 + start_n, off_hk * D_V])
            else:
                k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
                v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :], mask=kv_ok, other=0.0)
            m_a, l_a, acc_a, n_resc_a = _attend_block_window(
                q_a, k, v, cols, offs_ma, S_K, diag, win_left, win_right, qk_scale, m_a, l_a, acc_a, n_resc_a,
                BLOCK_M, BLOCK_N, True, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
            )  # fmt: skip
        for start_n in tl.range(full_lo, full_hi, BLOCK_N, warp_specialize=WARP_SPEC):
            cols = start_n + offs_n
            if USE_TMA:
                k = K.load([kv_row0 + start_n, off_hk * D])
                v = V.load([kv_row0 + start_n, off_hk * D_V])
            else:
                k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :])
                v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :])
            m_a, l_a, acc_a, n_resc_a = _attend_block_window(
                q_a, k, v, cols, offs_ma, S_K, diag, win_left, win_right, qk_scale, m_a, l_a, acc_a, n_resc_a,
                BLOCK_M, BLOCK_N, False, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
            )  # fmt: skip
        for start_n in tl.range(full_hi, hi, BLOCK_N):
            cols = start_n + offs_n
            kv_ok = cols[:, None] < S_K
            if USE_TMA:
                k = K.load([kv_row0 + start_n, off_hk * D])
                v = V.load([kv_row0 + start_n, off_hk * D_V])
            else:
                k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
                v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :], mask=kv_ok, other=0.0)
            m_a, l_a, acc_a, n_resc_a = _attend_block_window(
                q_a, k, v, cols, offs_ma, S_K, diag, win_left, win_right, qk_scale, m_a, l_a, acc_a, n_resc_a,
                BLOCK_M, BLOCK_N, True, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP,
            )  # fmt: skip
    else:
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
                v = V.load([kv_row0 + start_n, off_hk * D_V])
            else:
                k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :])
                v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :])
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
                v = V.load([kv_row0 + start_n, off_hk * D_V])
            else:
                k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
                v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :], mask=kv_ok, other=0.0)
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
    _store_tile(o_base, lse_base, offs_ma, offs_dv, stride_os, acc_a, l_a, m_a, S_Q)
    n_steps = tl.cdiv(hi, BLOCK_N)
    if WINDOW:
        n_steps -= lo // BLOCK_N
    n_resc = n_resc_a
    if PINGPONG:
        _store_tile(o_base, lse_base, offs_mb, offs_dv, stride_os, acc_b, l_b, m_b, S_Q)
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
    D_V: tl.constexpr,
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
                D_V, False, 0, 0,
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
            D_V, False, 0, 0,
        )  # fmt: skip


@triton.jit
def _fwd_window_kernel(
    Q, K, V, O, LSE, COUNTS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    B, H, GROUP, S_Q, S_K, qk_scale, NUM_M_BLOCKS, win_left, win_right,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, RESCALE_TAU: tl.constexpr, SOFT_EXP: tl.constexpr,
    WARP_SPEC: tl.constexpr, COUNT: tl.constexpr, USE_TMA: tl.constexpr, D_V: tl.constexpr,
):  # fmt: skip
    """``_fwd_kernel`` with a sliding window (its own entry point: the window's two bounds are run-time
    arguments, which the kernels without a window do not take): query row i sees keys j with
    i + diag - win_left <= j <= i + diag + win_right, diag = S_K - S_Q (causal is win_right = 0). One
    query tile per program (no ping-pong), one program per tile (not persistent); heaviest first."""
    m_block = NUM_M_BLOCKS - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    _fwd_tile(
        Q, K, V, O, LSE, COUNTS, m_block * B * H + bh, bh // H, bh % H, m_block,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
        H, GROUP, S_Q, S_K, qk_scale,
        D, BLOCK_M, BLOCK_N, False, LAZY_RESCALE, RESCALE_TAU, SOFT_EXP, False, WARP_SPEC, COUNT, USE_TMA,
        D_V, True, win_left, win_right,
    )  # fmt: skip


_SM_COUNT: dict[int, int] = {}


def triton_forward(q, k, v, causal: bool, scale: float, sw, count: bool = False, window=None):
    """Run ``_fwd_kernel`` (or, with ``window``, ``_fwd_window_kernel``): returns (o [B, S_q, H, D_v],
    lse [B, H, S_q] fp32 base 2, counts int32).

    q: [B, S_q, H, D], k: [B, S_k, H_kv, D], v: [B, S_k, H_kv, D_v], D and D_v powers of two (the
    kernel's tiles; ``repro.fa4.api`` pads other head sizes); ``sw`` a resolved Switches (launch shape
    filled in); ``count``: the kernel also counts, per query tile, its key-block steps and rescales
    (counts has 2 entries per tile then, else 2 unused). ``window``: None, or (left, right) keys
    before and after each row's diagonal, both >= 0 (``causal`` is then ignored: it is right = 0);
    not with ``sw.pingpong`` or ``sw.persistent``."""
    b, s_q, h, d = q.shape
    s_k, h_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = q.new_empty(b, s_q, h, dv)
    lse = torch.empty(b, h, s_q, device=q.device, dtype=torch.float32)
    tile = sw.block_m * (2 if sw.pingpong else 1)
    n_m = triton.cdiv(s_q, tile)
    counts = torch.zeros(2 * n_m * b * h if count else 2, device=q.device, dtype=torch.int32)
    if sw.persistent:
        if q.device.type == "cuda":
            idx = q.device.index or 0
            if idx not in _SM_COUNT:
                _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
            n_prog = _SM_COUNT[idx]
        else:
            n_prog = 4
        grid = (min(n_prog, n_m * b * h),)
    else:
        grid = (n_m, b * h)
    kk, vv = k, v
    if sw.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kk = TensorDescriptor.from_tensor(k.view(b * s_k, h_kv * d), [sw.block_n, d])
        vv = TensorDescriptor.from_tensor(v.view(b * s_k, h_kv * dv), [sw.block_n, dv])
    args = (
        q, kk, vv, o, lse, counts,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        b, h, h // h_kv, s_q, s_k, scale / math.log(2.0), n_m,
    )  # fmt: skip
    common = dict(
        D=d, BLOCK_M=sw.block_m, BLOCK_N=sw.block_n,
        LAZY_RESCALE=sw.lazy_rescale, RESCALE_TAU=float(sw.rescale_threshold), SOFT_EXP=sw.soft_exp,
        WARP_SPEC=sw.warp_specialize, COUNT=count, USE_TMA=sw.tma, D_V=dv,
        num_warps=sw.num_warps, num_stages=sw.num_stages,
    )  # fmt: skip
    if window is not None:
        if sw.pingpong or sw.persistent:
            raise ValueError("triton forward: a window runs without pingpong and persistent")
        left, right = (int(x) for x in window)
        _fwd_window_kernel[grid](*args, left, right, **common)
    else:
        _fwd_kernel[grid](
            *args, CAUSAL=causal, PINGPONG=sw.pingpong, PERSISTENT=sw.persistent, **common
        )  # fmt: skip
    return o, lse, counts
