"""The Triton backward in FlashAttention-2's two-kernel form (``bwd="fa2"``), and its launcher.

P is recomputed from the forward's saved base-2 log-sum-exp; delta_i = rowsum(dO_i * O_i) is the
softmax Jacobian's term. One kernel per key block accumulates dK and dV over every query head of its
KV group (GQA without atomics), one per query block accumulates dQ: S = Q K^T and dP = dO V^T are
computed twice, once per kernel, 7 matmuls per (query tile, key block) against the one-pass
schedule's 5 (``repro.fa4.triton_bwd_fused``). No atomics: the independent cross-check of the
one-pass backwards, and ``bwd="auto"``'s pick off Hopper when not causal (``api.auto_backward``).
Layout is [B, S, H, D] everywhere; LSE and delta are [B, H, S_q] float32.

No gradient element is written by two programs and every sum runs in a fixed order: this backward
is deterministic (claim fa4/deterministic-backward). ``_bwd_dkdv_window_kernel`` and
``_bwd_dq_window_kernel`` (issue #42, not yet run on a GPU) are the same two kernels with a sliding
window and v's own head size; main's two kernels are kept as they were, so their compiled code is
unchanged.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from paperclub.triton_compat import patch_interpreter

#: Launch shape per head dim, (block_m, block_n, num_warps, num_stages): tuned on one H100
#: (repro/fa4/results/*-autotune.json, S = 8192).
#: D = 256 (issue #42, not yet run on a GPU): 64 query rows x 32 keys with 8 warps, the launch at which
#: both kernels compile for sm_90a without spills (offline: 244 and 168 registers; 64 x 64 spills
#: 550 bytes in the dK/dV kernel).
#: D = 256 (issue #42): 32 x 64, 8 warps, 2 stages, the fastest FA2 launch of ``lab/tuning.py bwd-d256``
#: on an H200 (results/nvidia-h200-bwd-d256.json, 2026-11-29, S = 8k): 0.37x cuDNN's backward non-causal
#: (where bwd="auto" runs this one) against 0.29x for the first default, 64 x 32.
BWD_DEFAULTS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (32, 64, 8, 2)}
#: The general (window, D_V != D) kernels' launch where it differs: at D = 128 their masks push the
#: dK/dV kernel at 4 warps to 436 bytes of spills; with 8 warps none (offline compile). D = 256 keeps the
#: first default there (the launch above was timed and GPU-tested on the plain kernels only).
BWD_WINDOW_DEFAULTS = {128: (64, 64, 8, 2), 256: (64, 32, 8, 2)}
#: The interpreter's launch (and any other head dim's).
BWD_INTERPRET = (16, 16, 4, 1)

patch_interpreter()  # loops over run-time bounds and bf16 under the CPU interpreter


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


# ---------------------------------------------------------------------------------------------
# The general kernels: a sliding window and v's own head size (issue #42). The two kernels above are
# main's, untouched, so that every path that ran on a GPU before keeps its compiled code (a shared
# body inlined into both changed the PTX's debug labels and, for one launch, ptxas's schedule:
# lab/fingerprints.py). Causal is the window (S_q + S_k, 0) here, full attention (S_q + S_k, S_q + S_k).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_window_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_dkb, stride_dks, stride_dkh,
    H, H_KV, GROUP, S_Q, S_K, qk_scale, sm_scale, win_left, win_right,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr,
):  # fmt: skip
    """:func:`_bwd_dkdv_kernel` with a sliding window, query row i seeing keys
    i + diag - win_left .. i + diag + win_right (diag = S_K - S_Q), and v's own head size D_V: V, DV
    and DO are contiguous with D_V columns (their strides follow from the sizes); Q shares its strides
    with nothing else here, K with DK. Only the query tiles some row of which sees the key block run."""
    n_block = tl.program_id(0)
    bhk = tl.program_id(1)
    off_b = bhk // H_KV
    off_hk = bhk % H_KV
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, D_V)
    offs_m0 = tl.arange(0, BLOCK_M)
    n_ok = offs_n[:, None] < S_K
    kv_off = off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_off = ((off_b * S_K + offs_n[:, None]) * H_KV + off_hk) * D_V + offs_dv[None, :]
    k = tl.load(K + kv_off, mask=n_ok, other=0.0)
    v = tl.load(V + v_off, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D_V], tl.float32)
    diag = S_K - S_Q
    # query rows with i + diag - win_left <= key <= i + diag + win_right for some key of this block
    m_lo = (tl.maximum(n_block * BLOCK_N - win_right - diag, 0) // BLOCK_M) * BLOCK_M
    m_hi = tl.maximum(tl.minimum(n_block * BLOCK_N + BLOCK_N + win_left - diag, S_Q), m_lo)
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        q_head = off_b * stride_qb + off_h * stride_qh
        stat_base = (off_b * H + off_h) * S_Q
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m[None, :] < S_Q
            qT = tl.load(Q + q_head + offs_m[None, :] * stride_qs + offs_d[:, None], mask=m_ok, other=0.0)
            do_off = ((off_b * S_Q + offs_m[None, :]) * H + off_h) * D_V + offs_dv[:, None]
            doT = tl.load(DO + do_off, mask=m_ok, other=0.0)
            lse = tl.load(LSE + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
            delta = tl.load(DELTA + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
            sT = tl.dot(k, qT) * qk_scale  # [BLOCK_N, BLOCK_M]
            pT = tl.math.exp2(sT - lse[None, :])
            ok = m_ok & n_ok
            ok = ok & (offs_n[:, None] >= offs_m[None, :] + (diag - win_left))
            ok = ok & (offs_n[:, None] <= offs_m[None, :] + (diag + win_right))
            pT = tl.where(ok, pT, 0.0)
            dv = tl.dot(pT.to(doT.dtype), tl.trans(doT), dv)
            dpT = tl.dot(v, doT)
            dsT = pT * (dpT - delta[None, :])
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
    dk_off = off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    tl.store(DK + dk_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + v_off, dv.to(DV.dtype.element_ty), mask=n_ok)


@triton.jit
def _bwd_dq_window_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    H, GROUP, S_Q, S_K, qk_scale, sm_scale, win_left, win_right,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr,
):  # fmt: skip
    """:func:`_bwd_dq_kernel` with a sliding window and v's own head size, as
    :func:`_bwd_dkdv_window_kernel`: only the key blocks some row of this query block sees are read."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = bh // H
    off_h = bh % H
    off_hk = off_h // GROUP
    h_kv = H // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, D_V)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_ok = offs_m[:, None] < S_Q
    q_off = off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(Q + q_off, mask=m_ok, other=0.0)
    do_off = ((off_b * S_Q + offs_m[:, None]) * H + off_h) * D_V + offs_dv[None, :]
    do = tl.load(DO + do_off, mask=m_ok, other=0.0)
    stat_base = (off_b * H + off_h) * S_Q
    lse = tl.load(LSE + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
    delta = tl.load(DELTA + stat_base + offs_m, mask=offs_m < S_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    diag = S_K - S_Q
    lo = (tl.maximum(m_block * BLOCK_M + diag - win_left, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum((m_block + 1) * BLOCK_M + diag + win_right, S_K)
    kv_head = off_b * stride_kb + off_hk * stride_kh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n[None, :] < S_K
        kT = tl.load(K + kv_head + offs_n[None, :] * stride_ks + offs_d[:, None], mask=n_ok, other=0.0)
        v_off = ((off_b * S_K + offs_n[None, :]) * h_kv + off_hk) * D_V + offs_dv[:, None]
        vT = tl.load(V + v_off, mask=n_ok, other=0.0)
        s = tl.dot(q, kT) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        ok = m_ok & n_ok
        ok = ok & (offs_n[None, :] >= offs_m[:, None] + (diag - win_left))
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + (diag + win_right))
        p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok)


def full_window(s_q: int, s_k: int, causal: bool) -> tuple[int, int]:
    """The window that is causal attention ((S_q + S_k, 0): unbounded to the left) or, not causal, full
    attention (unbounded both ways) for the general kernels."""
    wide = s_q + s_k
    return (wide, 0) if causal else (wide, wide)


def triton_backward(do, q, k, v, o, lse, causal: bool, scale: float, sw, window=None):
    """dq, dk, dv by the two kernels. q: [B, S_q, H, D] (contiguous); o, do: [B, S_q, H, D_v];
    k: [B, S_k, H_kv, D], v: [B, S_k, H_kv, D_v] contiguous; lse: [B, H, S_q] fp32 base 2; ``sw`` a
    resolved Switches (bwd_block_* filled in). Causal needs S_q <= S_k (``api`` splits off the rows
    that see no key). ``window``: None or (left, right) >= 0 (then ``causal`` is ignored), every query
    row seeing at least one key. A window or D_v != D runs the general kernels (``*_window_kernel``),
    anything else main's two kernels."""
    b, s_q, h, d = q.shape
    s_k, h_kv, dv_ = k.shape[1], k.shape[2], v.shape[3]
    do = do.contiguous()
    # delta_i = sum_d dO_id O_id = rowsum(P * dP): the softmax-Jacobian term, one pass in PyTorch.
    delta = (do.float() * o.float()).sum(-1).permute(0, 2, 1).contiguous()  # [B, H, S_Q]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    qk_scale = scale / math.log(2.0)
    bm, bn = sw.bwd_block_m, sw.bwd_block_n
    dkdv_args = (
        q, k, v, do, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        h, h_kv, h // h_kv, s_q, s_k, qk_scale, scale,
    )  # fmt: skip
    dq_args = (
        q, k, v, do, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        h, h // h_kv, s_q, s_k, qk_scale, scale,
    )  # fmt: skip
    launch = dict(D=d, num_warps=sw.bwd_num_warps, num_stages=sw.bwd_num_stages)
    dkdv_grid, dq_grid = (triton.cdiv(s_k, bn), b * h_kv), (triton.cdiv(s_q, bn), b * h)
    # dQ tiles are the transpose of dK/dV's: many query rows, fewer keys per step.
    if window is None and dv_ == d:
        _bwd_dkdv_kernel[dkdv_grid](*dkdv_args, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, **launch)
        _bwd_dq_kernel[dq_grid](*dq_args, BLOCK_M=bn, BLOCK_N=bm, CAUSAL=causal, **launch)
    else:  # the general kernels: a window (causal and full attention are windows too) or D_V != D
        left, right = window if window is not None else full_window(s_q, s_k, causal)
        args = (int(left), int(right))
        _bwd_dkdv_window_kernel[dkdv_grid](*dkdv_args, *args, BLOCK_M=bm, BLOCK_N=bn, D_V=dv_, **launch)
        _bwd_dq_window_kernel[dq_grid](*dq_args, *args, BLOCK_M=bn, BLOCK_N=bm, D_V=dv_, **launch)
    return dq, dk, dv
