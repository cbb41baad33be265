"""A one-pass attention backward for Hopper: FlashAttention-3's schedule in Triton (``bwd="fused"``).

The FA2-style backward beside it (``repro.fa4.triton_bwd``)
recomputes S = Q K^T and dP = dO V^T twice, once per kernel: 7 matmuls per (query tile, key block).
FlashAttention-3 (shah2024flashattention3, the backward section) does it in one pass with 5:

    preprocess (one small kernel):   delta_i = sum_d dO_id O_id,  dQacc = 0   (fp32)
    main kernel, one program per key block of BLOCK_N keys and KV head, looping over query tiles:
        S^T  = K Q^T                       [BLOCK_N, BLOCK_M]  (keys as rows: no transposes of K)
        P^T  = 2^(S^T * scale * log2 e - lse)   (lse is the forward's base-2 log-sum-exp)
        dV  += P^T dO                      kept in registers for the whole loop
        dP^T = V dO^T
        dS^T = P^T * (dP^T - delta)
        dK  += dS^T Q                      kept in registers for the whole loop
        dQacc[tile] += scale * dS K        fp32 atomic adds (``red.global.add``), each query tile
                                           receives one contribution per key block
    dQ = dQacc cast to the input type (one elementwise pass).

Why atomics for dQ (FA3's choice) and not per-key-block partials: partials would need S_k / BLOCK_N
copies of dQ in fp32 (64 at S = 8k, 8.6 GB for B = 2, H = 16), and their sum is the same traffic again;
the atomic adds are fire-and-forget ``red`` instructions whose traffic (one fp32 dQ tile per (key
block, query tile), 2.1e9 adds at S = 8k, B = 2, H = 16, D = 128, BLOCK_N = 128) the L2 absorbs while
the tensor cores run. Larger BLOCK_N means fewer adds, which is why the launch configurations favour
128 keys per program. FA4 on Blackwell cuts these adds further with the 2-CTA MMA (M = 256 keys per
pair of SMs, half the dQ adds); Hopper has no 2-CTA MMA.

GQA: a program owns one KV head and loops over the query heads of its group, so dK and dV sum over
the group in registers (no atomics, no fp32 dK/dV buffer; FA3 uses atomics there too).

Causal (bottom-right aligned, diag = S_k - S_q): a key block [n0, n0 + BLOCK_N) is seen only by
query rows i >= n0 - diag; query tiles before that are skipped, the diagonal band is masked, the
tiles after it run with the same (cheap) masks. Query rows past S_q read lse = +inf, so P = 0 there.

With USE_TMA the Q and dO tiles of each step come through the tensor-memory accelerator (host
tensor descriptors over [B * S_q, H * D], as the forward's ``tma=True`` path); K and V are loaded
once per program with ordinary loads.

``_bwd_fused_window_kernel`` (issue #42, not yet run on a GPU) is the same schedule with a sliding
window (each key block visits only the query tiles whose rows see it) and v's own head size; the
kernel without a window is kept as it was, so its compiled code is unchanged.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from paperclub.triton_compat import interpreting, patch_interpreter

patch_interpreter()  # loops over run-time bounds and bf16 under the CPU interpreter

#: Launch configurations of the fused backward:
#: name -> (block_m, block_n, num_warps, num_stages, tma, dq_tma).
#: FA3 on sm_90 uses 64 x 128 (causal) / 80 x 128 (not) at D = 128 and 128 x 128 at D = 64, with two
#: MMA warpgroups (8 warps) and 2-stage Q/dO pipelining; 80 is not a power of two (Triton needs one).
#: Offline sm_90a compiles (``repro.fa4.lab.compile``, kernel "fused") all hit ptxas's 255 registers at D = 128
#: and spill: 64 x 128, 8 warps, 2 stages about 630-780 bytes; 32 x 128 about 320; 64 x 64 with 4 warps
#: 1300-1600; 128 x 128 needs 263 KB of shared memory (more than the 227 KB an H100 gives a block) and is
#: left out. At D = 64 64 x 128 spills 60-150 bytes, 32 x 128 none. Which costs least is for the GPU
#: sweep (``python -m repro.fa4.lab.tuning bwd-fused``) to say; FUSED_DEFAULTS holds the pick.
FUSED_CONFIGS: dict[str, tuple[int, int, int, int, bool, bool]] = {
    "m64-n128-w8-s2-tma": (64, 128, 8, 2, True, False),
    "m64-n128-w8-s2-tma-dqtma": (64, 128, 8, 2, True, True),
    "m64-n128-w8-s1-tma": (64, 128, 8, 1, True, False),
    "m64-n128-w8-s3-tma": (64, 128, 8, 3, True, False),
    "m64-n128-w8-s2": (64, 128, 8, 2, False, False),
    "m64-n128-w8-s2-dqtma": (64, 128, 8, 2, False, True),
    "m64-n128-w8-s3": (64, 128, 8, 3, False, False),
    "m32-n128-w8-s2-tma": (32, 128, 8, 2, True, False),
    "m32-n128-w8-s2-tma-dqtma": (32, 128, 8, 2, True, True),
    "m32-n128-w8-s3-tma": (32, 128, 8, 3, True, False),
    "m64-n64-w4-s2-tma": (64, 64, 4, 2, True, False),
    "m32-n64-w4-s2-tma": (32, 64, 4, 2, True, False),
    "m128-n64-w8-s2-tma": (128, 64, 8, 2, True, False),
}
#: Default launch per head dim. Measured on an H100 (B=2, S=8192, H=16, D=128, bf16, 2026-11-25,
#: results/nvidia-h100-80gb-hbm3-bwd-smoke.json, backward alone): FA3's tile without TMA loads,
#: m64-n128-w8-s2, was the fastest fused config, 7.93 ms non-causal / 4.15 ms causal (fa2: 7.56 /
#: 4.62; cuDNN 5.09 / 2.71); the same tile with TMA loads of Q and dO 9.62 / 4.86 (every D=128
#: config spills registers; TMA adds to it), the dQ TMA reduction bought 10% over per-element atomics
#: on the TMA tile (8.66 / 4.38). m64-n128-w8-s2-dqtma and -s3 were added after that run.
FUSED_DEFAULTS = {
    64: FUSED_CONFIGS["m64-n128-w8-s2"],
    128: FUSED_CONFIGS["m64-n128-w8-s2"],
    # D = 256 (issue #42): the fastest of the 13 launches of ``lab/tuning.py bwd-d256`` on an H200
    # (results/nvidia-h200-bwd-d256.json, 2026-11-29, S = 8k, 3 interleaved rounds, each checked against
    # cuDNN first): 32 x 64, 8 warps, 2 stages, 0.37x cuDNN's backward causal and not, where the first
    # default (32 x 32, 1 stage: the largest tile without spills offline) ran 0.21-0.24x.
    256: (32, 64, 8, 2, False, False),
}
#: The general (window, D_V != D) kernel's launch where it differs: at D = 128 FA3's 64 x 128 spills 256
#: bytes with the window's masks, 32 x 128 none (offline compile); at D = 256 the first default (222
#: registers, no spills offline): the launch above was timed and GPU-tested on the plain kernel only.
FUSED_WINDOW_DEFAULTS = {128: (32, 128, 8, 2, False, False), 256: (32, 32, 8, 1, False, False)}
#: The interpreter's launch: small tiles keep the CPU tests fast and exercise every masked path.
FUSED_INTERPRET = (16, 16, 4, 1, False, False)


def config_switches(name: str) -> dict:
    """The ``attention(...)`` switches that run the fused backward with FUSED_CONFIGS[name]."""
    if name not in FUSED_CONFIGS:
        raise ValueError(
            f"fused backward: unknown configuration {name!r}, expected one of {list(FUSED_CONFIGS)}"
        )
    bm, bn, nw, ns, tma, dq_tma = FUSED_CONFIGS[name]
    return dict(bwd="fused", bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=nw, bwd_num_stages=ns,
                bwd_tma=tma, bwd_dq_tma=dq_tma)  # fmt: skip


#: Query rows per program of the preprocess kernel.
PRE_BLOCK_M = 64


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA, DQACC,
    stride_ob, stride_os, stride_oh,
    H, S_Q,
    D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32, and dQacc[b, i, h, :] = 0.
    O, DO and DQACC share the [B, S_q, H, D] contiguous strides; DELTA is [B, H, S_q]."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = bh // H
    off_h = bh % H
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    ok = offs_m[:, None] < S_Q
    off = off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    o = tl.load(O + off, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + (off_b * H + off_h) * S_Q + offs_m, tl.sum(o * do, 1), mask=offs_m < S_Q)
    tl.store(DQACC + off, tl.zeros([BLOCK_M, D], tl.float32), mask=ok)


def preprocess(o: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """delta = rowsum(dO * O) [B, H, S_q] fp32 and a zeroed fp32 dQ buffer [B, S_q, H, D], by
    ``_bwd_preprocess_kernel``; shared by this backward and the Gluon one (``repro.fa4.gluon_bwd``).
    o, do: contiguous [B, S_q, H, D]."""
    b, s_q, h, d = o.shape
    delta = torch.empty(b, h, s_q, device=o.device, dtype=torch.float32)
    dq_acc = torch.empty(o.shape, device=o.device, dtype=torch.float32)
    pre_m = max(16, min(PRE_BLOCK_M, triton.next_power_of_2(s_q))) if o.device.type == "cuda" else 16
    _bwd_preprocess_kernel[(triton.cdiv(s_q, pre_m), b * h)](
        o, do, delta, dq_acc, o.stride(0), o.stride(1), o.stride(2), h, s_q, D=d, BLOCK_M=pre_m,
        num_warps=4,
    )  # fmt: skip
    return delta, dq_acc


@triton.jit
def _bwd_fused_kernel(
    Q, K, V, DO, LSE, DELTA, DQACC, DK, DV,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    H, H_KV, GROUP, S_Q, S_K, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, DQ_TMA: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block (summed over the KV head's group of query heads) and its atomic part
    of dQ. Q, DO and DQACC share strides (stride_q*); K, V, DK and DV share theirs (stride_k*).
    With USE_TMA, Q and DO are tensor descriptors over [B * S_q, H * D] with block [BLOCK_M, D]; with
    DQ_TMA, DQACC is one too (fp32), and each dQ tile is added by a TMA bulk reduction from shared
    memory (``cp.reduce.async.bulk.tensor``, FA3's way) instead of one atomic per element.

    One loop body for every query tile, masks included: a second, unmasked copy of the body (as the
    forward has) doubled ptxas's register spills at 64 x 128 on sm_90 (offline compile, 1428 against
    628 spilled bytes), while the masks here cost one compare and select per score."""
    n_block = tl.program_id(0)  # causal: low key blocks see the most queries and start first
    bhk = tl.program_id(1)
    off_b = bhk // H_KV
    off_hk = bhk % H_KV
    n0 = n_block * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    n_ok = offs_n[:, None] < S_K
    kv_off = off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    k = tl.load(K + kv_off, mask=n_ok, other=0.0)
    v = tl.load(V + kv_off, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    diag = S_K - S_Q
    # Causal: query rows i < n0 - diag see none of this block's keys; their tiles are skipped.
    m_lo = (tl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M if CAUSAL else 0
    qrow0 = off_b * S_Q
    offs_m0 = tl.arange(0, BLOCK_M)
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        q_head = off_b * stride_qb + off_h * stride_qh
        stat_base = (off_b * H + off_h) * S_Q
        for start_m in range(m_lo, S_Q, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < S_Q
            if USE_TMA:
                # rows past S_q belong to the next batch (or read as zero past the end); their lse is
                # +inf below, so P = 0 there and they add nothing to dK, dV; no dQ is added for them.
                q = Q.load([qrow0 + start_m, off_h * D])
                do = DO.load([qrow0 + start_m, off_h * D])
            else:
                q_off = q_head + offs_m[:, None] * stride_qs + offs_d[None, :]
                q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
                do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + stat_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + stat_base + offs_m, mask=row_ok, other=0.0)
            sT = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
            # keys past S_K (zero rows of K) would give 2^-lse, not 0: mask them, and the causal band
            if CAUSAL:
                pT = tl.where(n_ok & (offs_n[:, None] <= offs_m[None, :] + diag), pT, 0.0)
            else:
                pT = tl.where(n_ok, pT, 0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
            dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
            dk = tl.dot(dsT, q, dk)
            dq = tl.dot(tl.trans(dsT), k) * sm_scale  # [BLOCK_M, D]: this key block's part of dQ
            if DQ_TMA:
                # rows past S_q are exact zeros here (P = 0): adding them to the next batch's rows
                # changes nothing; past the tensor's end the TMA unit drops them
                DQACC.atomic_add([qrow0 + start_m, off_h * D], dq)
            else:
                dq_ptr = DQACC + q_head + offs_m[:, None] * stride_qs + offs_d[None, :]
                tl.atomic_add(dq_ptr, dq, mask=row_ok[:, None], sem="relaxed")
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=n_ok)


# The general kernel: a sliding window and v's own head size (issue #42). The kernel above is main's,
# untouched, so that every path that ran on a GPU before keeps its compiled code (a body shared by
# inlining changed the PTX's debug labels and, for the TMA launch, ptxas's schedule:
# lab/fingerprints.py). Causal is the window (S_q + S_k, 0) here, full attention (S_q + S_k, S_q + S_k).


@triton.jit
def _bwd_fused_window_kernel(
    Q, K, V, DO, LSE, DELTA, DQACC, DK, DV,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    H, H_KV, GROUP, S_Q, S_K, qk_scale, sm_scale, win_left, win_right,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr, DQ_TMA: tl.constexpr, D_V: tl.constexpr,
):  # fmt: skip
    """:func:`_bwd_fused_kernel` with a sliding window, query row i seeing keys
    i + diag - win_left .. i + diag + win_right (diag = S_K - S_Q), and v's own head size D_V: V, DV
    and DO are contiguous with D_V columns (their strides follow from the sizes; DO's descriptor, with
    USE_TMA, has D_V columns). Only the query tiles some row of which sees this key block run."""
    n_block = tl.program_id(0)
    bhk = tl.program_id(1)
    off_b = bhk // H_KV
    off_hk = bhk % H_KV
    n0 = n_block * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, D_V)
    n_ok = offs_n[:, None] < S_K
    kv_off = off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_off = ((off_b * S_K + offs_n[:, None]) * H_KV + off_hk) * D_V + offs_dv[None, :]
    k = tl.load(K + kv_off, mask=n_ok, other=0.0)
    v = tl.load(V + v_off, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D_V], tl.float32)
    diag = S_K - S_Q
    # query rows i with i + diag - win_left <= key <= i + diag + win_right for some key here
    m_lo = (tl.maximum(n0 - win_right - diag, 0) // BLOCK_M) * BLOCK_M
    m_hi = tl.maximum(tl.minimum(n0 + BLOCK_N + win_left - diag, S_Q), m_lo)
    qrow0 = off_b * S_Q
    offs_m0 = tl.arange(0, BLOCK_M)
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        q_head = off_b * stride_qb + off_h * stride_qh
        stat_base = (off_b * H + off_h) * S_Q
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < S_Q
            if USE_TMA:
                # rows past S_q belong to the next batch (or read as zero past the end); their lse is
                # +inf below, so P = 0 there and they add nothing to dK, dV; no dQ is added for them.
                q = Q.load([qrow0 + start_m, off_h * D])
                do = DO.load([qrow0 + start_m, off_h * D_V])
            else:
                q_off = q_head + offs_m[:, None] * stride_qs + offs_d[None, :]
                q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
                do_off = ((off_b * S_Q + offs_m[:, None]) * H + off_h) * D_V + offs_dv[None, :]
                do = tl.load(DO + do_off, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + stat_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + stat_base + offs_m, mask=row_ok, other=0.0)
            sT = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
            # keys past S_K (zero rows of K) would give 2^-lse, not 0: mask them, and the window
            ok = n_ok & (offs_n[:, None] >= offs_m[None, :] + (diag - win_left))
            ok = ok & (offs_n[:, None] <= offs_m[None, :] + (diag + win_right))
            pT = tl.where(ok, pT, 0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
            dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
            dk = tl.dot(dsT, q, dk)
            dq = tl.dot(tl.trans(dsT), k) * sm_scale  # [BLOCK_M, D]: this key block's part of dQ
            if DQ_TMA:
                # rows past S_q are exact zeros here (P = 0): adding them to the next batch's rows
                # changes nothing; past the tensor's end the TMA unit drops them
                DQACC.atomic_add([qrow0 + start_m, off_h * D], dq)
            else:
                dq_ptr = DQACC + q_head + offs_m[:, None] * stride_qs + offs_d[None, :]
                tl.atomic_add(dq_ptr, dq, mask=row_ok[:, None], sem="relaxed")
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + v_off, dv.to(DV.dtype.element_ty), mask=n_ok)


def backward_fused(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    tma: bool,
    dq_tma: bool = False,
    window: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attention from the forward's output ``o`` and base-2 log-sum-exp ``lse``.

    q: [B, S_q, H, D]; o, do: [B, S_q, H, D_v]; k: [B, S_k, H_kv, D], v: [B, S_k, H_kv, D_v]
    (contiguous); lse: [B, H, S_q] float32. Causal needs S_q <= S_k (the caller splits off queries
    that see no key). ``tma``: Q and dO tiles through TMA; ``dq_tma``: dQ tiles added by TMA bulk
    reductions (not in the CPU interpreter, which has no such operation). ``window``: None or
    (left, right) >= 0 keys around each row's diagonal (``causal`` is then ignored), every query row
    seeing at least one key. Returns gradients in the inputs' dtypes and shapes.
    """
    if dq_tma and interpreting():
        raise ValueError("backward_fused: dq_tma (TMA bulk reductions) does not run in the CPU interpreter")
    b, s_q, h, d = q.shape
    s_k, h_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    do = do.contiguous()
    if d_v == d:
        delta, dq_acc = preprocess(o, do)
    else:  # the preprocess kernel's O and dQ share one width; here they do not
        delta = (do.float() * o.float()).sum(-1).permute(0, 2, 1).contiguous()
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    from triton.tools.tensor_descriptor import TensorDescriptor

    qq, dd, acc = q, do, dq_acc
    if tma:
        qq = TensorDescriptor.from_tensor(q.view(b * s_q, h * d), [block_m, d])
        dd = TensorDescriptor.from_tensor(do.view(b * s_q, h * d_v), [block_m, d_v])
    if dq_tma:
        acc = TensorDescriptor.from_tensor(dq_acc.view(b * s_q, h * d), [block_m, d])
    args = (
        qq, k, v, dd, lse, delta, acc, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        h, h_kv, h // h_kv, s_q, s_k, scale / math.log(2.0), scale,
    )  # fmt: skip
    launch = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, USE_TMA=tma, DQ_TMA=dq_tma,
                  num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    grid = (triton.cdiv(s_k, block_n), b * h_kv)
    if window is None and d_v == d:
        _bwd_fused_kernel[grid](*args, CAUSAL=causal, **launch)
    else:  # the general kernel: a window (causal and full attention are windows too) or D_V != D
        from repro.fa4.triton_bwd import full_window

        left, right = window if window is not None else full_window(s_q, s_k, causal)
        _bwd_fused_window_kernel[grid](*args, int(left), int(right), D_V=d_v, **launch)
    return dq_acc.to(q.dtype), dk, dv
