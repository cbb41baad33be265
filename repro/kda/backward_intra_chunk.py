"""The backward of everything that is parallel over chunks: the intra-chunk stage, the WY factors
and UT transform, the output's intra-chunk part and the decay factors the state recurrence reads.
Two launches after the state backward (backward_inter_chunk.py), with many small programs:

* :func:`kda_intra_bwd_split_mat_kernel`, one program per (chunk, head): the chunk's ``[BT, BT]``
  gradients, ``M_q`` for A_qk and ``dA = -T^T dT T^T`` through the UT transform (from ``T (I + A)
  = I``: no second inverse), plus dv and the value part of dbeta; ``M_q`` and ``dA`` go to memory.
* :func:`kda_intra_bwd_split_dqk_kernel`, one program per (key block, chunk, head): dq, dk, dg for
  its key channels, reading ``M_q`` and ``dA`` back by 16-column strips, and its share of dbeta.

Why two kernels and not one: a kernel with one program per chunk and head that walks long chains
of small fp32/tf32 products is latency-bound, and what sets its time is how many programs fit on an
SM (registers, shared memory), not FLOPs or bytes. One such kernel for all intra-chunk gradients
took 5.71 ms of 7.69 forward + backward; split, the backward's three launches and the forward took
5.49 ms (H100, bf16, B=8, T=2048, 2026-11-23). "split" in the kernels' names is that split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.intra_chunk import _strip_operands
from repro.kda.tiles import BT, SUB, _exp, _head_bases, _load_rows, _tile, _tile_t

# Launch settings, compiled offline for sm_90a (Triton 3.6, bf16 inputs, K = V = 128; shared memory
# from the compiled metadata, registers and spills from the bundled ptxas -v):
#   mat kernel, BK 16, BV 16, 4 warps: 48 KiB, 255 registers, no spills (BK 16, BV 32: 60 KiB, 344
#     bytes of spill stores at 4 warps, none at 8; BK 32, BV 32, 4 warps: 532 bytes)
#   dqk kernel, BKB 16, BV 32, 8 warps: 24 KiB, 255 registers, 160 bytes of spill stores (4 warps:
#     1256; BKB 32: 32 KiB, 560 bytes at 8 warps, 3204 at 4). Most of it is stacking the four
#     strips' [16, BKB] key parts into rows (_rows4): without that step it spills nothing at BKB 16,
#     8 warps.
# Shared memory leaves room for 2+ programs per SM for both; registers (65536 per SM) allow two
# 4-warp programs of 255 registers, one 8-warp program.
# The mat kernel measured on an H100 (B=8, T=2048, forward + backward, median of 3 interleaved
# rounds, 2026-11-23): BK 32, BV 32, 8 warps 5.49 ms; BK 16, BV 16, 4 warps 5.64; BK 16, BV 32, 8
# warps 5.68. One stage: pipelined value loops asked for more shared memory than an H100 has in an
# earlier one-kernel backward, and 2 stages here took 5.61 against 5.25 ms.
MAT_BK = 32
MAT_BV = 32
MAT_WARPS = 8
MAT_STAGES = 1
# The dqk kernel measured the same way (bench.py --tune): BKB 32 / 4 warps 5.57 ms; 32 / 8: 6.55;
# 16 / 4: 6.71; 16 / 8: 9.01; 64 / 8: 6.44. Two programs of 4 warps fit per SM (registers), one of
# 8; at BKB 32 and 4 warps it spills more (offline) yet is the fastest. Its value loop pipelined
# over 3 stages: forward + backward 5.25 -> 5.03 ms (4 stages the same); value blocks of 64: 4.98
# against 4.91, 16: 5.37 (results/nvidia-h100-80gb-hbm3-tuning.json).
DQK_BK = 32
DQK_BV = 32
DQK_WARPS = 4
DQK_STAGES = 3
# Both as the code is now, at these defaults (lab/ptx_snapshot.py --ptxas, 2026-11-27, K = V = 128):
# the mat kernel bf16 128 registers, no spills, 60 KiB shared (fp16, tf32x3: 255, 44 bytes of spill
# stores, 32 KiB); the dqk kernel 255 registers, 1252 bytes of spill stores, 56 KiB (fp16: 2240).
# Tried and removed (issue #40): bf16 operands for the products of 16-bit data in both kernels
# (5.72 against 5.57 ms: the kernels wait on latency, not on the tensor cores; commit d749c74); a
# 0/1 product instead of _rows4 (spilled less, 6.57 against 5.57 ms and wrong in bf16 on an H100).


@triton.jit
def _decay_tail_grads(b_k, b_G, G_last, b_dkd, b_dgamma, FAST_EXP: tl.constexpr = False):
    """Gradients through ``KD = k exp(G_last - G)`` and ``gamma = exp(G_last)`` (what the state
    recurrence reads): the parts of dk and dG for each row, and the gradient reaching G_last."""
    e_tail = _exp(G_last[None, :] - b_G, FAST_EXP)
    kd_term = b_dkd * b_k * e_tail
    return b_dkd * e_tail, -kd_term, tl.sum(kd_term, axis=0) + b_dgamma * tl.exp(G_last)


@triton.jit
def _g_grad(b_dG, dG_last, loc, BT: tl.constexpr):
    """``G = cumsum(g)``: ``dg_r = sum_{r' >= r} dG_r'``, with G_last's gradient put on the last
    row (padded rows have g = 0, so their G is G_last and the last row stands for them all)."""
    b_dG += tl.where(loc[:, None] == BT - 1, dG_last[None, :], 0.0)
    return tl.sum(b_dG, axis=0)[None, :] - tl.cumsum(b_dG, axis=0) + b_dG


@triton.jit
def _rows4(a0, a1, a2, a3, SUB: tl.constexpr, BK: tl.constexpr):
    """Four ``[SUB, BK]`` row blocks stacked: ``[4 SUB, BK]``, block c in rows ``c*SUB ..``."""
    x = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [j, col, p, q] = block 2q + p
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (4 * SUB, BK))


@triton.jit(do_not_specialize=["T", "NT"])
def kda_intra_bwd_split_mat_kernel(
    k,
    v,
    beta,
    G,
    T_ut,
    U_new,
    h_all,
    do,
    dU,
    dv,
    M_q,
    dA,
    dbeta_parts,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """The chunk's ``[BT, BT]`` gradients, one program per (chunk, b*HV), in two passes over small
    tiles.

    * value blocks: ``M_q = tril(dO U^T) scale`` (stored at once, so it is not held during the
      second pass), the value part of ``dT``, ``dv`` and the value part of dbeta;
    * key blocks: ``dW = -dU S_n^T`` and the rest of ``dT = dW (beta k e^G)^T``; then
      ``dA = -T^T dT T^T`` (strictly lower), stored.

    ``M_q`` and ``dA`` are ``[B, HV, NT, BT, BT]`` fp32 (one contiguous 16 KiB block per program);
    the dbeta part goes to ``dbeta_parts[0]`` (``[1 + K/BKB, B, T, HV]``, the key blocks of
    :func:`kda_intra_bwd_split_dqk_kernel` fill the rest). ``A_kk`` is not formed here: its part of
    dbeta, ``sum_i dA_ri A_ri``, is a sum over key channels too, so each key block of the second
    kernel adds its share from the strips it computes anyway; this kernel then holds only
    ``T`` and ``dT`` (and ``M_q`` in the first pass).
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    b, hv, q_base, k_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    mrow = rows < T
    r0 = i_t * BT
    s_base = (i_bh * NT + i_t) * K * V  # [B, HV, NT, K, V]
    m_base = (i_bh * NT + i_t) * BT * BT  # [B, HV, NT, BT, BT]
    QS, KS, VS = H * K, HV * K, HV * V  # row strides

    b_beta = tl.load(beta + (b * T + rows) * HV + hv, mask=mrow, other=0.0).to(tl.float32)
    p_T = _tile(T_ut + c_base, T, HV * BT, BT, r0, 0, BT, BT)
    b_T = tl.load(p_T, boundary_check=(0,), padding_option="zero")

    # pass 1, value blocks
    b_Mq = tl.zeros([BT, BT], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for vb in range(V // BV):
        c0 = vb * BV
        b_do = _load_rows(do + v_base, T, VS, V, r0, c0, BT, BV)
        b_u = _load_rows(U_new + v_base, T, VS, V, r0, c0, BT, BV)
        b_du = _load_rows(dU + v_base, T, VS, V, r0, c0, BT, BV)
        b_v = _load_rows(v + v_base, T, VS, V, r0, c0, BT, BV)
        b_do, b_u, b_v = b_do.to(tl.float32), b_u.to(tl.float32), b_v.to(tl.float32)
        b_Mq += tl.dot(b_do, tl.trans(b_u), input_precision=DOT_PREC)
        dT += tl.dot(b_du, tl.trans(b_v * b_beta[:, None]), input_precision=DOT_PREC)
        b_dvb = tl.dot(tl.trans(b_T), b_du, input_precision=DOT_PREC)  # d(Diag(beta) V)
        p_dv = _tile(dv + v_base, T, VS, V, r0, c0, BT, BV)
        tl.store(p_dv, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), boundary_check=(0,))
        b_dbeta += tl.sum(b_dvb * b_v, axis=1)
    b_Mq = tl.where(loc[:, None] >= loc[None, :], b_Mq, 0.0) * scale
    tl.store(_tile(M_q + m_base, BT, BT, BT, 0, 0, BT, BT), b_Mq)

    # pass 2, key blocks: the rest of dT. Padded rows have k = 0 and beta = 0, so their G (loaded
    # as 0 here, not G_last) never reaches dT
    for kb in range(K // BK):
        c0 = kb * BK
        b_k = _load_rows(k + q_base, T, QS, K, r0, c0, BT, BK)
        b_G = _load_rows(G + k_base, T, KS, K, r0, c0, BT, BK)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in range(V // BV):
            p_du = _tile(dU + v_base, T, VS, V, r0, vb * BV, BT, BV)
            p_h = _tile(h_all + s_base, K, V, V, c0, vb * BV, BK, BV)
            b_du = tl.load(p_du, boundary_check=(0,), padding_option="zero")
            b_dw -= tl.dot(b_du, tl.trans(tl.load(p_h).to(tl.float32)), input_precision=DOT_PREC)
        b_kb = b_k.to(tl.float32) * tl.exp(b_G) * b_beta[:, None]
        dT += tl.dot(b_dw, tl.trans(b_kb), input_precision=DOT_PREC)
    # T = (I + A_kk)^{-1}: dA = -T^T dT T^T, strictly lower
    b_Tt = tl.trans(b_T)
    b_dA = -tl.dot(tl.dot(b_Tt, dT, input_precision=DOT_PREC), b_Tt, input_precision=DOT_PREC)
    b_dA = tl.where(loc[:, None] > loc[None, :], b_dA, 0.0)
    tl.store(_tile(dA + m_base, BT, BT, BT, 0, 0, BT, BT), b_dA)
    tl.store(dbeta_parts + (b * T + rows) * HV + hv, b_dbeta, mask=mrow)


@triton.jit
def _add_strip_grads(
    b_dk, b_dq, b_dG, b_dbeta, b_k, b_q, b_G, b_beta, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc,
    dA_ptr, Mq_ptr, c: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr, DOT_PREC: tl.constexpr,
    FAST_EXP: tl.constexpr,
):  # fmt: skip
    """Backward of intra_chunk._column_strip for column strip c, given the chunk's ``[BT, BT]``
    blocks of dA and of the gradient M_q of ``A_qk`` (``dA_ptr``, ``Mq_ptr``; ``M_k = Diag(beta)
    dA``), of which it reads strip c ``[BT, SUB]``: ``(x = k e_row, y = k_c e_col)`` so ``dk_r +=
    (M y) e_row``, ``dG_r += (M y) e_row k_r`` for the rows, and ``dk_i += (M^T x) e_col``, ``dG_i
    -= (M^T x) e_col k_i`` for the block's keys (``G_ref`` cancels in the product, so it gets no
    gradient). Adds the rows' parts to ``b_dk, b_dq, b_dG`` (``[BT, BK]``) and this channel block's
    part of ``dbeta_r += sum_i dA_ri A_raw,ri`` over the strip's columns to ``b_dbeta``, with
    ``A_raw``'s strip formed from the same factors (one more ``[BT, BK] x [BK, SUB]`` product; its
    upper triangle can overflow and is masked out of the sum). Returns the four sums, then the
    block's keys' parts for dk and dG (``[SUB, BK]``, for :func:`_rows4`)."""
    dA_c = tl.load(_tile(dA_ptr, BT, BT, BT, 0, c * SUB, BT, SUB))
    Mq_c = tl.load(_tile(Mq_ptr, BT, BT, BT, 0, c * SUB, BT, SUB))
    e_row, k_c, e_col, y, x_k, x_q = _strip_operands(
        b_k, b_q, b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc, c, SUB, FAST_EXP
    )
    Mk_c = dA_c * b_beta[:, None]
    gx_k = tl.dot(Mk_c, y, input_precision=DOT_PREC) * e_row
    gx_q = tl.dot(Mq_c, y, input_precision=DOT_PREC) * e_row
    g_y = tl.dot(tl.trans(Mk_c), x_k, input_precision=DOT_PREC) + tl.dot(
        tl.trans(Mq_c), x_q, input_precision=DOT_PREC
    )
    dk_c = g_y * e_col
    a_c = tl.dot(x_k, tl.trans(y), input_precision=DOT_PREC)
    strict = loc[:, None] > (c * SUB + tl.arange(0, SUB))[None, :]
    b_dbeta += tl.sum(tl.where(strict, dA_c * a_c, 0.0), axis=1)
    return b_dk + gx_k, b_dq + gx_q, b_dG + (gx_k * b_k + gx_q * b_q), b_dbeta, dk_c, -dk_c * k_c


@triton.jit(do_not_specialize=["T", "NT"])
def kda_intra_bwd_split_dqk_kernel(
    q,
    k,
    beta,
    G,
    T_ut,
    U_new,
    h_all,
    dh_all,
    do,
    dU,
    M_q,
    dA,
    dq,
    dk,
    dg,
    dbeta_parts,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FAST_EXP: tl.constexpr = False,
):
    """dq, dk, dg for one block of BK key channels, one program per (key block, chunk, b*HV), from
    the output, the WY factors, ``KD`` and ``gamma``, and the decayed key products (by column
    strips); ``dg`` is the reverse cumulative sum of dG. ``dW = -dU S_n^T`` is recomputed here
    rather than stored (a small matmul).

    Reads ``M_q`` and ``dA`` from :func:`kda_intra_bwd_split_mat_kernel` by 16-column strips
    (never a whole ``[BT, BT]`` matrix in registers) and ``T`` transposed; computes dq, dk, dg for
    its channels (all of them depend on the chunk only through those matrices: the cumulative sum
    of g runs over rows, not channels) and its part of dbeta (``sum_c dKB kg`` and the strips'
    ``dA * A_raw``), stored in ``dbeta_parts[1 + key block]``. Program 0 is the key block, so the
    programs of one chunk run together and share its tiles of dU, U, dO, T, M_q, dA in L2.
    ``FAST_EXP`` (GPU only): the exponentials by tiles._exp's ftz path.
    """
    i_kb = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2)
    b, hv, q_base, k_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    mrow = rows < T
    r0 = i_t * BT
    c0 = i_kb * BK
    last = tl.minimum(T - r0, BT) - 1  # the chunk's last real token
    s_base = (i_bh * NT + i_t) * K * V  # [B, HV, NT, K, V]
    m_base = (i_bh * NT + i_t) * BT * BT  # [B, HV, NT, BT, BT]
    QS, KS, VS = H * K, HV * K, HV * V  # row strides

    b_beta = tl.load(beta + (b * T + rows) * HV + hv, mask=mrow, other=0.0).to(tl.float32)
    b_q = _load_rows(q + q_base, T, QS, K, r0, c0, BT, BK)
    b_k = _load_rows(k + q_base, T, QS, K, r0, c0, BT, BK)
    b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    b_G = _load_rows(G + k_base, T, KS, K, r0, c0, BT, BK)
    G_last = tl.sum(tl.where(loc[:, None] == last, b_G, 0.0), axis=0)
    # padded rows were never stored: in the forward their G equals G_last (g = 0 there)
    b_G = tl.where(mrow[:, None], b_G, G_last[None, :])
    b_eG = _exp(b_G, FAST_EXP)

    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgamma = tl.zeros([BK], dtype=tl.float32)
    for vb in range(V // BV):
        v0 = vb * BV
        b_du = _load_rows(dU + v_base, T, VS, V, r0, v0, BT, BV)
        b_u = _load_rows(U_new + v_base, T, VS, V, r0, v0, BT, BV)
        b_do = _load_rows(do + v_base, T, VS, V, r0, v0, BT, BV)
        b_h = tl.load(_tile(h_all + s_base, K, V, V, c0, v0, BK, BV))
        b_ds = tl.load(_tile(dh_all + s_base, K, V, V, c0, v0, BK, BV))
        b_h, b_ds = b_h.to(tl.float32), b_ds.to(tl.float32)
        b_u, b_do = b_u.to(tl.float32), b_do.to(tl.float32)
        b_dw -= tl.dot(b_du, tl.trans(b_h), input_precision=DOT_PREC)  # U = U' - W S_n
        b_dkd += tl.dot(b_u, tl.trans(b_ds), input_precision=DOT_PREC)  # S_{n+1} += KD^T U
        b_dqg += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)  # O += (Q e^G) S_n
        b_dgamma += tl.sum(b_ds * b_h, axis=1)  # S_{n+1} += Diag(gamma) S_n

    # output O = scale (Q*e^G) S_n + A_qk U
    b_dq = b_dqg * scale * b_eG
    b_dG = b_dq * b_q
    # WY factor W = T KB with KB = beta k e^G; T^T loaded transposed rather than transposed here
    p_Tt = _tile_t(T_ut + c_base, T, HV * BT, BT, r0, 0, BT, BT)
    b_Tt = tl.load(p_Tt, boundary_check=(1,), padding_option="zero")
    b_kg = b_k * b_eG
    b_dkb = tl.dot(b_Tt, b_dw, input_precision=DOT_PREC)
    b_dk = b_dkb * b_eG * b_beta[:, None]
    b_dG += b_dkb * b_kg * b_beta[:, None]
    b_dbeta = tl.sum(b_dkb * b_kg, axis=1)
    # KD = k e^(G_last - G) and gamma = e^G_last feed the state recurrence
    dk_tail, dG_tail, dG_last = _decay_tail_grads(b_k, b_G, G_last, b_dkd, b_dgamma, FAST_EXP)
    b_dk += dk_tail
    b_dG += dG_tail

    # A[r, i] = sum_c x_rc k_ic e^(G_rc - G_ic) by column strips; the strips of dA and M_q are read
    # from memory where they are used (never a whole [BT, BT] matrix in registers)
    offk = c0 + tl.arange(0, BK)
    kp, Gp = k + q_base, G + k_base
    dAp, Mqp = dA + m_base, M_q + m_base
    b_dk, b_dq, b_dG, b_dbeta, dkc0, dGc0 = _add_strip_grads(
        b_dk, b_dq, b_dG, b_dbeta, b_k, b_q, b_G, b_beta, kp, Gp, QS, KS, r0, T, offk, loc, dAp, Mqp,
        0, BT, SUB, DOT_PREC, FAST_EXP,
    )  # fmt: skip
    b_dk, b_dq, b_dG, b_dbeta, dkc1, dGc1 = _add_strip_grads(
        b_dk, b_dq, b_dG, b_dbeta, b_k, b_q, b_G, b_beta, kp, Gp, QS, KS, r0, T, offk, loc, dAp, Mqp,
        1, BT, SUB, DOT_PREC, FAST_EXP,
    )  # fmt: skip
    b_dk, b_dq, b_dG, b_dbeta, dkc2, dGc2 = _add_strip_grads(
        b_dk, b_dq, b_dG, b_dbeta, b_k, b_q, b_G, b_beta, kp, Gp, QS, KS, r0, T, offk, loc, dAp, Mqp,
        2, BT, SUB, DOT_PREC, FAST_EXP,
    )  # fmt: skip
    b_dk, b_dq, b_dG, b_dbeta, dkc3, dGc3 = _add_strip_grads(
        b_dk, b_dq, b_dG, b_dbeta, b_k, b_q, b_G, b_beta, kp, Gp, QS, KS, r0, T, offk, loc, dAp, Mqp,
        3, BT, SUB, DOT_PREC, FAST_EXP,
    )  # fmt: skip
    # the block's keys' parts, stacked into their rows
    b_dk += _rows4(dkc0, dkc1, dkc2, dkc3, SUB, BK)
    b_dG += _rows4(dGc0, dGc1, dGc2, dGc3, SUB, BK)
    # G = cumsum(g): dg_r = sum_{r' >= r} dG_r'
    b_dg = _g_grad(b_dG, dG_last, loc, BT)
    tl.store(_tile(dq + k_base, T, KS, K, r0, c0, BT, BK), b_dq.to(dq.dtype.element_ty), boundary_check=(0,))
    tl.store(_tile(dk + k_base, T, KS, K, r0, c0, BT, BK), b_dk.to(dk.dtype.element_ty), boundary_check=(0,))
    tl.store(_tile(dg + k_base, T, KS, K, r0, c0, BT, BK), b_dg.to(dg.dtype.element_ty), boundary_check=(0,))
    # dbeta_parts is [1 + K/BK, B, T, HV]: a slot holds B*T*HV = num_programs(2) * T values
    slot = (1 + i_kb) * tl.num_programs(2) * T
    tl.store(dbeta_parts + slot + (b * T + rows) * HV + hv, b_dbeta, mask=mrow)


def intra_chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    dU: torch.Tensor,
    dh_all: torch.Tensor,
    prec: str,
    fast_exp: bool,
    *,
    mat_bk: int = MAT_BK,
    mat_bv: int = MAT_BV,
    mat_warps: int = MAT_WARPS,
    mat_stages: int = MAT_STAGES,
    dqk_bk: int = DQK_BK,
    dqk_bv: int = DQK_BV,
    dqk_warps: int = DQK_WARPS,
    dqk_stages: int = DQK_STAGES,
) -> tuple[torch.Tensor, ...]:
    """dq, dk ``[B, T, H, K]``, dv ``[B, T, HV, V]``, dg ``[B, T, HV, K]`` and dbeta ``[B, T, HV]``
    (each in its input's dtype) from the forward's saved tensors, dO (contiguous) and the state
    backward's dU and dh_all; ``fast_exp``: the ftz exponentials (GPU only)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = triton.cdiv(T, BT)
    f32 = dict(device=q.device, dtype=torch.float32)
    BKB = min(K, dqk_bk)
    NKB = K // BKB  # K and the key block are powers of two (check_kda_inputs, KDAConfig): no remainder
    # fp32, one contiguous [BT, BT] block per (b, hv, chunk): written by the mat kernel, read by dqk
    M_q = torch.empty(B, HV, NT, BT, BT, **f32)
    dA = torch.empty(B, HV, NT, BT, BT, **f32)
    # dbeta is a sum over value channels (mat kernel) and over key channels (each program of the dqk
    # kernel): each writes its own slot and they are summed below, rather than added atomically, so
    # the result does not depend on the order the programs run in (deterministic), and the extra
    # buffer is small ((1 + K/BKB) x B x T x HV fp32: 5 MiB at B=8, T=2048, HV=16, K=128, BKB=32)
    dbeta_parts = torch.empty(1 + NKB, B, T, HV, **f32)
    group = HV // H
    qk_dtype = q.dtype if group == 1 else torch.float32
    dq = torch.empty(B, T, HV, K, device=q.device, dtype=qk_dtype)
    dk = torch.empty(B, T, HV, K, device=q.device, dtype=qk_dtype)
    dg = torch.empty(B, T, HV, K, device=q.device, dtype=g.dtype)
    dv = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    kda_intra_bwd_split_mat_kernel[(NT, B * HV)](
        k, v, beta, saved["G"], saved["T_ut"], saved["U_new"], saved["h_all"], do, dU,
        dv, M_q, dA, dbeta_parts, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=min(K, mat_bk), BV=min(V, mat_bv), DOT_PREC=prec,
        num_warps=mat_warps, num_stages=mat_stages,
    )  # fmt: skip
    # the key block is the fastest grid axis: a chunk's NKB programs run side by side and read its
    # tiles of dU, U, dO, T, M_q, dA from L2 rather than memory
    kda_intra_bwd_split_dqk_kernel[(NKB, NT, B * HV)](
        q, k, beta, saved["G"], saved["T_ut"], saved["U_new"], saved["h_all"], dh_all, do, dU,
        M_q, dA, dq, dk, dg, dbeta_parts, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, SUB=SUB, BK=BKB, BV=min(V, dqk_bv), DOT_PREC=prec,
        FAST_EXP=fast_exp, num_warps=dqk_warps, num_stages=dqk_stages,
    )  # fmt: skip
    dbeta = dbeta_parts.sum(0).to(beta.dtype)
    if group > 1:  # value heads that share a key head add their gradients into it
        dq = dq.view(B, T, H, group, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, group, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg, dbeta
