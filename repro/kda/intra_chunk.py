"""The intra-chunk stage of the forward (kimiteam2025kimilinear §3.1; chunk_torch.py, steps 1-3):
every chunk in parallel, from its own tokens only.

:func:`kda_intra_fwd_kernel`, one program per (chunk, batch x value head), computes the cumulative
log-decay ``G = cumsum(g)`` inside the chunk, the decay factors the state recurrence reads
(``gamma = exp(G_C)``, ``KD = K * exp(G_C - G)``), the two decayed key products

    A_kk[r, i] = beta_r sum_c k_rc k_ic exp(G_rc - G_ic)   (i < r)
    A_qk[r, i] = scale sum_c q_rc k_ic exp(G_rc - G_ic)    (i <= r)

by column strips (:func:`_column_strip`), the UT transform ``T = (I + A_kk)^{-1}`` (wy_ut.py), and
the factors the WY and output kernels multiply by, ``KB = Diag(beta) (K * exp(G))`` and ``QG =
scale Q * exp(G)``. It also counts the log-decays out of range for chunk_kda's check (gate.py).

Numerics: ``exp(G_r - G_i)`` is factored around a reference row in the middle of each 16-column
strip, so that neither factor overflows in fp32 for per-token log-decays ``g >= G_MIN = -10``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.gate import G_MIN
from repro.kda.tiles import BT, LOG_NB, LOG_SUB, SUB, _exp, _head_bases, _tile
from repro.kda.wy_ut import _unit_lower_inverse

# Launch settings, tuned on an H100 (bf16, B=8, T=2048, K=V=128, 2026-11-23; bench.py --tune,
# results/nvidia-h100-80gb-hbm3-tuning.json). 4 warps: the kernel took 0.91 ms against 1.72 ms at 8
# warps; at 8 warps the build used all 255 registers per thread, one program per SM, and the
# kernel is latency-bound (long dependency chains of one chunk, nothing to overlap them with).
INTRA_WARPS = 4
# key channels per step of the channel loop: 16 took the forward from 0.98 to 1.29 ms
INTRA_BK = 32
# software-pipelining depth of the key-block loop (Triton's default; 1 and 2 measured the same)
INTRA_STAGES = 3
# Why column strips: A_kk and A_qk by masked 16-row blocks (full-height products, 4x the tensor-core
# work, one exponential per row block and key) took the forward 1.297 ms against 1.135 ms by
# strips at 4 warps (8 warps: 2.07 against 1.68). Why QG and KB are stored here, where q, k and G
# are in registers: the output and WY kernels then read one 16-bit tile instead of Q or K plus the
# fp32 G, forward 1.002 -> 0.984 ms. Why the ftz exponentials: tiles._exp.
# Compiled offline for sm_90a as the code is now (lab/ptx_snapshot.py --ptxas, 2026-11-27, K = V =
# 128, 4 warps): bf16 254 registers, no spills, 32 KiB shared; fp16 (tf32x3 products) 255 registers,
# 160 bytes of spill stores, 64 KiB.


@triton.jit
def _strip_factors(
    b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc, c: tl.constexpr, SUB: tl.constexpr,
    FAST_EXP: tl.constexpr = False,
):  # fmt: skip
    """The two factors of ``exp(G_r - G_i)`` for the keys ``i`` of column block c.

    ``exp(G_r - G_i)`` is factored around the middle row of column block c: rows from the block on
    get ``exp(G - G_ref)`` (at most ``e^{8|g|}``: the rows above the reference), the block's 16
    keys ``exp(G_ref - G)`` (at most ``e^{7|g|}``); rows above the block get 1 and are masked by
    the caller (``after``), and what the two factors give above the diagonal is masked away after
    the matmul. The block's rows of G and k are read from memory; rows past T read row T-1, which
    is what the padded rows' G equals. Returns ``after [BT]``, ``e_row [BT, BK]``, the block's keys
    ``k_c [SUB, BK]`` (fp32, zero past T) and ``e_col [SUB, BK]``."""
    rows_c = r0 + c * SUB + tl.arange(0, SUB)
    G_c = tl.load(G_ptr + tl.minimum(rows_c, T - 1)[:, None] * g_stride + offk[None, :])
    k_c = tl.load(k_ptr + rows_c[:, None] * k_stride + offk[None, :], mask=(rows_c < T)[:, None], other=0.0)
    G_ref = tl.load(G_ptr + tl.minimum(r0 + c * SUB + SUB // 2, T - 1) * g_stride + offk)
    after = loc >= c * SUB
    e_row = _exp(tl.where(after[:, None], b_G - G_ref[None, :], 0.0), FAST_EXP)
    return after, e_row, k_c.to(tl.float32), _exp(G_ref[None, :] - G_c, FAST_EXP)


@triton.jit
def _strip_operands(
    b_k, b_q, b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc, c: tl.constexpr, SUB: tl.constexpr,
    FAST_EXP: tl.constexpr = False,
):  # fmt: skip
    """The operands of column strip c of ``A_kk`` and ``A_qk``, from the factors of
    :func:`_strip_factors`: ``e_row``, the block's keys ``k_c`` and ``e_col``, then
    ``y = k_c e_col`` ``[SUB, BK]`` and the rows ``x_k = k e_row``, ``x_q = q e_row`` ``[BT, BK]``
    (zero above the block). ``FAST_EXP``: exponentials by :func:`_exp`'s ftz path. The backward's
    per-channel kernel (backward_intra_chunk.py) forms the same operands."""
    after, e_row, k_c, e_col = _strip_factors(
        b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc, c, SUB, FAST_EXP
    )
    y = k_c * e_col
    x_k = tl.where(after[:, None], b_k * e_row, 0.0)
    x_q = tl.where(after[:, None], b_q * e_row, 0.0)
    return e_row, k_c, e_col, y, x_k, x_q


@triton.jit
def _column_strip(
    S_k, S_q, b_k, b_q, b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc,
    c: tl.constexpr, SUB: tl.constexpr, DOT_PREC: tl.constexpr, FAST_EXP: tl.constexpr,
):  # fmt: skip
    """Adds this channel block's part of columns ``c*SUB .. c*SUB+SUB`` of ``A_kk`` and ``A_qk``
    (before masks and scales) to the strips ``S_k``, ``S_q`` (``[BT, SUB]``) and returns them: two
    ``[BT, SUB]`` matmuls for the block in ``b_k, b_q, b_G`` (``[BT, BK]``) with the operands of
    :func:`_strip_operands` (in the forward, G was stored by this program: the caller puts a
    barrier first). Rows from the block down against the block's 16 keys, each key scaled once:
    a quarter of the tensor-core work of masked row blocks."""
    _e_row, _k_c, _e_col, y, x_k, x_q = _strip_operands(
        b_k, b_q, b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc, c, SUB, FAST_EXP
    )
    return (
        S_k + tl.dot(x_k, tl.trans(y), input_precision=DOT_PREC),
        S_q + tl.dot(x_q, tl.trans(y), input_precision=DOT_PREC),
    )


@triton.jit
def _cat4(s0, s1, s2, s3, BT: tl.constexpr, SUB: tl.constexpr):
    """Four ``[BT, SUB]`` column strips side by side: ``[BT, 4 SUB]``, strip c in columns
    ``c*SUB .. c*SUB+SUB`` (join them into ``[BT, SUB, 2, 2]``, index ``[r, j, p, q]`` = strip
    ``2q + p``, then reorder to ``[r, q, p, j]`` and flatten)."""
    x = tl.join(tl.join(s0, s1), tl.join(s2, s3))
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (BT, 4 * SUB))


@triton.jit(do_not_specialize=["T", "NT"])
def kda_intra_fwd_kernel(
    q,
    k,
    g,
    beta,
    G_out,
    Aqk_out,
    KD_out,
    gamma_out,
    T_out,
    QG_out,
    KB_out,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    LOG_SUB: tl.constexpr,
    LOG_NB: tl.constexpr,
    BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FAST_EXP: tl.constexpr = False,
    g_bad=None,
    G_MIN: tl.constexpr = -10.0,
):
    """One program per (chunk, batch x value head), all chunks in parallel.

    One pass over key-channel blocks of BK: cumulative log-decay ``G`` (stored), ``gamma =
    exp(G_C)``, ``KD = k exp(G_C - G)``, ``QG = scale Q*exp(G)`` and ``KB = Diag(beta)(K*exp(G))``
    (``[B, T, HV, K]``, the inputs' dtype) and each block's part of the four column strips of
    ``A_kk`` and ``A_qk`` (the ``[BT, BK]`` tiles stay small, so little spills). Then the UT
    transform ``T = (I + A_kk)^{-1}`` (stored in fp32 for the WY kernel and the backward) and
    ``A_qk`` (the inputs' dtype). ``FAST_EXP`` (GPU only): the exponentials of KD, QG, KB and the
    strips by :func:`_exp`'s ftz path. ``g_bad`` (an int32 ``[1]``, or None): adds the number of
    log-decays outside ``[G_MIN, 0]`` (or NaN) this program read, so that chunk_kda's range check
    costs no pass of its own over g (gate.DecayCheck)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    b, hv, qk_base, gk_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)

    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    mrow = rows < T
    # padded rows get g = 0 (no decay) and beta = 0, k = 0 (no write): they leave the state alone
    b_beta = tl.load(beta + (b * T + rows) * HV + hv, mask=mrow, other=0.0).to(tl.float32)
    r0 = i_t * BT

    # BT = 4 SUB (tiles.py): four column strips of each matrix
    S0k = tl.zeros([BT, SUB], dtype=tl.float32)
    S1k = tl.zeros([BT, SUB], dtype=tl.float32)
    S2k = tl.zeros([BT, SUB], dtype=tl.float32)
    S3k = tl.zeros([BT, SUB], dtype=tl.float32)
    S0q = tl.zeros([BT, SUB], dtype=tl.float32)
    S1q = tl.zeros([BT, SUB], dtype=tl.float32)
    S2q = tl.zeros([BT, SUB], dtype=tl.float32)
    S3q = tl.zeros([BT, SUB], dtype=tl.float32)
    for kb in range(K // BK):
        p_k = tl.make_block_ptr(k + qk_base, (T, K), (H * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        p_q = tl.make_block_ptr(q + qk_base, (T, K), (H * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        p_g = tl.make_block_ptr(g + gk_base, (T, K), (HV * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        p_G = tl.make_block_ptr(G_out + gk_base, (T, K), (HV * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        p_kd = tl.make_block_ptr(KD_out + gk_base, (T, K), (HV * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0,), padding_option="zero").to(tl.float32)
        b_q = tl.load(p_q, boundary_check=(0,), padding_option="zero").to(tl.float32)
        b_g = tl.load(p_g, boundary_check=(0,), padding_option="zero").to(tl.float32)
        if g_bad is not None:  # chunk_kda's range check of g: count entries outside [G_MIN, 0] or NaN
            n_bad = tl.sum(((b_g < G_MIN) | (b_g > 0.0) | (b_g != b_g)).to(tl.int32))
            tl.atomic_add(g_bad, n_bad, mask=n_bad > 0)
        b_G = tl.cumsum(b_g, axis=0)  # G_r = g_1 + ... + g_r inside the chunk
        tl.store(p_G, b_G, boundary_check=(0,))
        # padded rows have g = 0, so the last row of the cumsum is G at the chunk's last real token
        G_last = tl.sum(tl.where(loc[:, None] == BT - 1, b_G, 0.0), axis=0)
        tl.store(gamma_out + (i_bh * NT + i_t) * K + kb * BK + tl.arange(0, BK), tl.exp(G_last))
        b_kd = b_k * _exp(G_last[None, :] - b_G, FAST_EXP)  # decay from token i to the end of the chunk
        tl.store(p_kd, b_kd.to(KD_out.dtype.element_ty), boundary_check=(0,))
        e_G = _exp(b_G, FAST_EXP)
        p_qg = _tile(QG_out + gk_base, T, HV * K, K, r0, kb * BK, BT, BK)
        tl.store(p_qg, (b_q * e_G * scale).to(QG_out.dtype.element_ty), boundary_check=(0,))
        p_kb = _tile(KB_out + gk_base, T, HV * K, K, r0, kb * BK, BT, BK)
        tl.store(p_kb, (b_k * e_G * b_beta[:, None]).to(KB_out.dtype.element_ty), boundary_check=(0,))
        tl.debug_barrier()  # the G rows stored above are read back by other threads
        offk = kb * BK + tl.arange(0, BK)
        k_ptr, G_ptr = k + qk_base, G_out + gk_base
        args = (b_k, b_q, b_G, k_ptr, G_ptr, H * K, HV * K, r0, T, offk, loc)
        S0k, S0q = _column_strip(S0k, S0q, *args, 0, SUB, DOT_PREC, FAST_EXP)
        S1k, S1q = _column_strip(S1k, S1q, *args, 1, SUB, DOT_PREC, FAST_EXP)
        S2k, S2q = _column_strip(S2k, S2q, *args, 2, SUB, DOT_PREC, FAST_EXP)
        S3k, S3q = _column_strip(S3k, S3q, *args, 3, SUB, DOT_PREC, FAST_EXP)
    A_kk = _cat4(S0k, S1k, S2k, S3k, BT, SUB)
    A_qk = _cat4(S0q, S1q, S2q, S3q, BT, SUB)
    A_kk = tl.where(loc[:, None] > loc[None, :], A_kk, 0.0) * b_beta[:, None]
    A_qk = tl.where(loc[:, None] >= loc[None, :], A_qk, 0.0) * scale
    p_A = tl.make_block_ptr(Aqk_out + c_base, (T, BT), (HV * BT, 1), (r0, 0), (BT, BT), (1, 0))
    tl.store(p_A, A_qk.to(Aqk_out.dtype.element_ty), boundary_check=(0,))

    T_ut = _unit_lower_inverse(A_kk, loc, BT, SUB, LOG_SUB, LOG_NB, DOT_PREC)
    p_T = tl.make_block_ptr(T_out + c_base, (T, BT), (HV * BT, 1), (r0, 0), (BT, BT), (1, 0))
    tl.store(p_T, T_ut, boundary_check=(0,))


def intra_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    HV: int,
    V: int,
    scale: float,
    prec: str,
    fast_exp: bool,
    decay_count: torch.Tensor | None = None,
    *,
    block_k: int = INTRA_BK,
    warps: int = INTRA_WARPS,
    stages: int = INTRA_STAGES,
) -> dict[str, torch.Tensor]:
    """The intra-chunk launch. q, k ``[B, T, H, K]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]``
    (contiguous); HV value heads of V channels. ``decay_count``: an int32 ``[1]`` the kernel adds the
    out-of-range log-decays to (gate.DecayCheck), or None. ``fast_exp``: the ftz exponentials
    (GPU only). Returns G (fp32), KD, QG, KB ``[B, T, HV, K]``; A_qk ``[B, T, HV, BT]`` (the inputs'
    dtype); T ``[B, T, HV, BT]`` (fp32); gamma ``[B, HV, NT, K]`` (fp32)."""
    B, T, H, K = q.shape
    NT = triton.cdiv(T, BT)
    dev, dt = q.device, q.dtype
    G = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
    KD = torch.empty(B, T, HV, K, device=dev, dtype=dt)
    Aqk = torch.empty(B, T, HV, BT, device=dev, dtype=dt)
    gamma = torch.empty(B, HV, NT, K, device=dev, dtype=torch.float32)
    T_ut = torch.empty(B, T, HV, BT, device=dev, dtype=torch.float32)
    QG = torch.empty(B, T, HV, K, device=dev, dtype=dt)
    KB = torch.empty(B, T, HV, K, device=dev, dtype=dt)
    kda_intra_fwd_kernel[(NT, B * HV)](
        q, k, g, beta, G, Aqk, KD, gamma, T_ut, QG, KB, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, SUB=SUB, LOG_SUB=LOG_SUB, LOG_NB=LOG_NB, BK=min(K, block_k),
        DOT_PREC=prec, FAST_EXP=fast_exp, g_bad=decay_count, G_MIN=G_MIN,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dict(G=G, KD=KD, QG=QG, KB=KB, Aqk=Aqk, T_ut=T_ut, gamma=gamma)
