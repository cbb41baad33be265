"""Triton kernels for chunkwise KDA (kimiteam2025kimilinear §3.1); launchers are in chunk.py.

Forward, three launches (the same split as the derivation in chunk_torch.py):

* :func:`kda_intra_fwd_kernel`, one program per (chunk, batch x value head), all chunks in
  parallel: cumulative log-decay ``G``, the matrices ``A_kk`` and ``A_qk``, the UT transform
  ``T = (I + A_kk)^{-1}`` and the WY factors ``W = T Diag(beta)(K*exp(G))``,
  ``U' = T Diag(beta) V``.
  With ``chunk.INTRA_FWD_SPLIT`` the WY factors are a second launch, :func:`kda_wy_fwd_kernel`
  (one program per chunk, channel block and head); the first kernel can also store the factors
  ``scale Q*exp(G)`` and ``Diag(beta) K*exp(G)`` that the readout and WY kernels then read.
* :func:`kda_state_fwd_kernel`, one program per (value block, batch x value head), walking the
  chunks in order: ``U = U' - W S``, ``S <- Diag(exp(G_C)) S + (K*exp(G_C - G))^T U``; stores each
  chunk's incoming state and the pseudo-values U.
* :func:`kda_out_fwd_kernel`, all chunks in parallel: ``O = scale (Q*exp(G)) S + A_qk U``.

Backward (``chunk.BACKWARD = "split"``, the default), three launches:
:func:`kda_state_bwd_fused_kernel` (the state recurrence in reverse with the readout's gradient
folded in, the sequential part), then :func:`kda_intra_bwd_split_mat_kernel` (each chunk's
``[BT, BT]`` gradients) and :func:`kda_intra_bwd_split_dqk_kernel` (the per-channel gradients).
The first all-Triton backward (``"triton"``), three launches: :func:`kda_out_bwd_kernel`
(gradient of the readout towards U and the states), :func:`kda_state_bwd_kernel` (the state
recurrence in reverse) and :func:`kda_intra_bwd_kernel` (all intra-chunk gradients, parallel over
chunks). :func:`kda_decode_kernel` is the one-token step for inference.

Block sizes: ``BT`` (chunk) is 64, the largest whose ``[BT, BT]`` fp32 matrices and
``[BT, K]`` tiles fit in registers next to a ``[K, BV]`` state tile for K = 128; the
sub-blocks of 16 rows are what ``tl.dot`` needs as its smallest M.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Block pointer to rows ``r0 .. r0+BR`` and columns ``c0 .. c0+BC`` of an ``[R, C]`` matrix
    with unit column stride: one token-major head of a ``[B, T, heads, D]`` tensor, or a state.
    Loads through it with ``boundary_check=(0,)`` zero the rows past R (the padded tail chunk)."""
    return tl.make_block_ptr(base, (R, C), (row_stride, 1), (r0, c0), (BR, BC), (1, 0))


@triton.jit
def _tile_t(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """The same block as :func:`_tile`, transposed: a ``[BC, BR]`` tile (check dimension 1)."""
    return tl.make_block_ptr(base, (C, R), (1, row_stride), (c0, r0), (BC, BR), (0, 1))


@triton.jit
def _load_rows(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Load the :func:`_tile` block, rows past R as zeros."""
    return tl.load(_tile(base, R, row_stride, C, r0, c0, BR, BC), boundary_check=(0,), padding_option="zero")


@triton.jit
def _load_rows_t(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Load the :func:`_tile_t` block (``[BC, BR]``), rows of the matrix past R as zero columns."""
    return tl.load(
        _tile_t(base, R, row_stride, C, r0, c0, BR, BC), boundary_check=(1,), padding_option="zero"
    )


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """``exp(x)``; ``FAST`` (GPU only: inline PTX, which Triton's CPU interpreter cannot run) as one
    ``ex2.approx.ftz`` of ``x log2(e)``: results below 2^-126 flush to zero instead of going through
    the denormal fix-up that tl.exp adds around each ex2 (a compare and two multiplies, 14% of the
    forward intra-chunk kernel's instructions on an H100)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;",
            "=r,r",
            [x * 1.4426950408889634],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        return tl.exp(x)


@triton.jit
def _head_bases(i_bh, T, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """For the program axis ``i_bh = b * HV + hv``: ``b``, ``hv`` and where row 0 of the program's
    heads starts in each layout: ``q_base`` in q and k (``[B, T, H, K]``, key head
    ``hv // (HV / H)``: more value heads than key heads), ``k_base`` in ``[B, T, HV, K]`` (g, G, W,
    KD, QG, KB), ``v_base`` in ``[B, T, HV, V]`` and ``c_base`` in ``[B, T, HV, BT]`` (A_qk, T)."""
    b = i_bh // HV
    hv = i_bh % HV
    hk = hv // (HV // H)
    row = b * T * HV + hv
    return b, hv, (b * T * H + hk) * K, row * K, row * V, row * BT


@triton.jit
def _block_products(b_k, b_x, b_G, loc, a, SUB: tl.constexpr):
    """One 16-row block of ``A[r, i] = sum_c x_rc k_ic exp(G_rc - G_ic)`` as a matmul's operands.

    Rows ``r`` of block ``a`` against every column ``i`` up to the block's end, factored around a
    reference row in the block's middle so that neither factor overflows (chunk_torch.chunk_matrices):
    returns ``x_rows = x * exp(G - G_ref)`` (zero outside the block), ``k_cols = k * exp(G_ref - G)``
    (zero after the block) and the two exponentials, for the gradient."""
    ref_row = a * SUB + SUB // 2
    G_ref = tl.sum(tl.where(loc[:, None] == ref_row, b_G, 0.0), axis=0)
    in_block = (loc >= a * SUB) & (loc < (a + 1) * SUB)
    upto_block = loc < (a + 1) * SUB
    # the exponent is clamped to 0 where the row/column is masked out anyway: no inf * 0
    e_row = tl.exp(tl.where(in_block[:, None], b_G - G_ref[None, :], 0.0))
    e_col = tl.exp(tl.where(upto_block[:, None], G_ref[None, :] - b_G, 0.0))
    x_rows = tl.where(in_block[:, None], b_x * e_row, 0.0)
    k_cols = tl.where(upto_block[:, None], b_k * e_col, 0.0)
    return x_rows, k_cols, e_row, e_col, in_block, upto_block


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
def _row_block_grads(b_q, x_k, k_cols, e_row, e_col, in_block, upto, M_k, M_q, DOT_PREC: tl.constexpr):
    """Backward of one row block of :func:`_block_products`, given the gradients ``M_k, M_q`` of
    ``A_kk, A_qk`` (before beta and scale): the parts of dk (rows: ``d_xk``; columns: ``d_y``), of
    dq (``d_xq``) and, through ``G``, of dG = ``d_xk k + d_xq q - d_y k`` (``G_ref`` cancels in
    the product, so it gets no gradient)."""
    x_q = tl.where(in_block[:, None], b_q * e_row, 0.0)
    Mk_a = tl.where(in_block[:, None], M_k, 0.0)
    Mq_a = tl.where(in_block[:, None], M_q, 0.0)
    d_xk = tl.dot(Mk_a, k_cols, input_precision=DOT_PREC) * e_row
    d_xq = tl.dot(Mq_a, k_cols, input_precision=DOT_PREC) * e_row
    d_y = (
        tl.dot(tl.trans(Mk_a), x_k, input_precision=DOT_PREC)
        + tl.dot(tl.trans(Mq_a), x_q, input_precision=DOT_PREC)
    ) * e_col
    return d_xk, d_xq, tl.where(upto[:, None], d_y, 0.0)


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
    (zero above the block). ``FAST_EXP``: exponentials by :func:`_exp`'s ftz path."""
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
    barrier first)."""
    _e_row, _k_c, _e_col, y, x_k, x_q = _strip_operands(
        b_k, b_q, b_G, k_ptr, G_ptr, k_stride, g_stride, r0, T, offk, loc, c, SUB, FAST_EXP
    )
    return (
        S_k + tl.dot(x_k, tl.trans(y), input_precision=DOT_PREC),
        S_q + tl.dot(x_q, tl.trans(y), input_precision=DOT_PREC),
    )


@triton.jit
def _rows4(a0, a1, a2, a3, SUB: tl.constexpr, BK: tl.constexpr):
    """Four ``[SUB, BK]`` row blocks stacked: ``[4 SUB, BK]``, block c in rows ``c*SUB ..``."""
    x = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [j, col, p, q] = block 2q + p
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (4 * SUB, BK))


@triton.jit
def _cat4(s0, s1, s2, s3, BT: tl.constexpr, SUB: tl.constexpr):
    """Four ``[BT, SUB]`` column strips side by side: ``[BT, 4 SUB]``, strip c in columns
    ``c*SUB .. c*SUB+SUB`` (join them into ``[BT, SUB, 2, 2]``, index ``[r, j, p, q]`` = strip
    ``2q + p``, then reorder to ``[r, q, p, j]`` and flatten)."""
    x = tl.join(tl.join(s0, s1), tl.join(s2, s3))
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (BT, 4 * SUB))


@triton.jit
def _unit_lower_inverse(
    A_kk,
    loc,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    LOG_SUB: tl.constexpr,
    LOG_NB: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``(I + A)^{-1}`` for a strictly lower ``[BT, BT]`` A, in ten matmuls for BT = 64, SUB = 16.

    ``A = A_d + A_o`` (16x16 diagonal blocks, and the part below them). ``A_d^SUB = 0``, so
    ``(I + A_d)^{-1} = sum_m (-A_d)^m = (I - A_d)(I + A_d^2)(I + A_d^4)(I + A_d^8)`` (repeated
    squaring: log2(16) = 4 factors instead of 15 steps of forward substitution). Then
    ``I + A = (I + A_d)(I + N)`` with ``N = T_d A_o`` strictly block-lower, ``N^(BT/SUB) = 0``, and
    ``(I + N)^{-1} = (I - N)(I + N^2)`` the same way (chunk_torch.ut_transform_doubling)."""
    same_block = (loc[:, None] // SUB) == (loc[None, :] // SUB)
    eye = tl.where(loc[:, None] == loc[None, :], 1.0, 0.0)
    A_d = tl.where(same_block, A_kk, 0.0)
    A_o = tl.where(same_block, 0.0, A_kk)
    T_d = eye - A_d
    power = A_d
    for _m in tl.static_range(1, LOG_SUB):  # SUB = 2^LOG_SUB: LOG_SUB factors in all
        power = tl.dot(power, power, input_precision=DOT_PREC)
        T_d += tl.dot(T_d, power, input_precision=DOT_PREC)
    N = tl.dot(T_d, A_o, input_precision=DOT_PREC)
    series = eye - N
    power = N
    for _m in tl.static_range(1, LOG_NB):  # BT / SUB = 2^LOG_NB blocks
        power = tl.dot(power, power, input_precision=DOT_PREC)
        series += tl.dot(series, power, input_precision=DOT_PREC)
    return tl.dot(series, T_d, input_precision=DOT_PREC)


@triton.jit(do_not_specialize=["T", "NT"])
def kda_intra_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    G_out,
    W_out,
    U_out,
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
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SKIP: tl.constexpr = 0,
    STRIPS: tl.constexpr = False,
    WY: tl.constexpr = True,
    FAST_EXP: tl.constexpr = False,
    STORE_QG: tl.constexpr = False,
    STORE_KB: tl.constexpr = False,
    g_bad=None,
    G_MIN: tl.constexpr = -10.0,
):
    """One program per (chunk, batch x value head), all chunks in parallel.

    Pass 1 over key-channel blocks of BK: cumulative log-decay ``G`` (stored), ``gamma = exp(G_C)``,
    ``KD = k exp(G_C - G)``, and the sums over channels that make ``A_kk`` and ``A_qk`` (each block
    of channels adds its part: the ``[BT, BK]`` tiles stay small, so nothing spills). Then the UT
    transform ``T = (I + A_kk)^{-1}`` (:func:`_unit_lower_inverse`); pass 2 the WY factors
    ``W = T Diag(beta)(K*exp(G))`` per channel block and ``U' = T Diag(beta) V`` per value block.
    ``WY = False`` leaves pass 2 out (W_out and U_out untouched): :func:`kda_wy_fwd_kernel` computes
    W and U' from the stored G and T in a second launch (chunk.INTRA_FWD_SPLIT).
    ``FAST_EXP`` (GPU only): the exponentials of KD, QG, KB and the strips by :func:`_exp`'s ftz path.
    ``STORE_QG`` / ``STORE_KB`` also store the readout's left factor ``QG = scale Q*exp(G)`` and
    the WY kernel's right factor ``KB = Diag(beta)(K*exp(G))`` (``[B, T, HV, K]``, the inputs'
    dtype), so that those kernels read them instead of Q or K and the fp32 G.
    ``SKIP`` (bits 1, 2: the products for A, the inverse) leaves parts out, for timing
    the parts in bench.py's profile only: the results are then wrong. ``STRIPS`` computes A by
    column blocks (:func:`_column_strip`, ``[BT, 16]`` products: a quarter of the tensor-core work
    of the row-block form and one exponential per key instead of one per row block).
    ``g_bad`` (an int32 ``[1]``, or None): adds the number of log-decays outside ``[G_MIN, 0]``
    (or NaN) this program read, so that chunk_kda's range check costs no pass of its own over g."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    b, hv, qk_base, gk_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)

    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    mrow = rows < T
    # padded rows get g = 0 (no decay) and beta = 0, k = 0 (no write): they leave the state alone
    b_beta = tl.load(beta + (b * T + rows) * HV + hv, mask=mrow, other=0.0).to(tl.float32)
    r0 = i_t * BT

    A_kk = tl.zeros([BT, BT], dtype=tl.float32)
    A_qk = tl.zeros([BT, BT], dtype=tl.float32)
    if STRIPS:  # BT = 4 SUB (checked by the launcher): four column strips of each matrix
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
        if STORE_QG or STORE_KB:
            e_G = _exp(b_G, FAST_EXP)
            if STORE_QG:
                p_qg = _tile(QG_out + gk_base, T, HV * K, K, r0, kb * BK, BT, BK)
                tl.store(p_qg, (b_q * e_G * scale).to(QG_out.dtype.element_ty), boundary_check=(0,))
            if STORE_KB:
                p_kb = _tile(KB_out + gk_base, T, HV * K, K, r0, kb * BK, BT, BK)
                tl.store(p_kb, (b_k * e_G * b_beta[:, None]).to(KB_out.dtype.element_ty), boundary_check=(0,))
        if STRIPS:
            tl.debug_barrier()  # the G rows stored above are read back by other threads
            offk = kb * BK + tl.arange(0, BK)
            k_ptr, G_ptr = k + qk_base, G_out + gk_base
            args = (b_k, b_q, b_G, k_ptr, G_ptr, H * K, HV * K, r0, T, offk, loc)
            S0k, S0q = _column_strip(S0k, S0q, *args, 0, SUB, DOT_PREC, FAST_EXP)
            S1k, S1q = _column_strip(S1k, S1q, *args, 1, SUB, DOT_PREC, FAST_EXP)
            S2k, S2q = _column_strip(S2k, S2q, *args, 2, SUB, DOT_PREC, FAST_EXP)
            S3k, S3q = _column_strip(S3k, S3q, *args, 3, SUB, DOT_PREC, FAST_EXP)
        else:
            for a in tl.static_range(BT // SUB):
                if SKIP & 1 == 0:
                    x_k, k_cols, e_row, _e_col, in_block, _upto = _block_products(b_k, b_k, b_G, loc, a, SUB)
                    x_q = tl.where(in_block[:, None], b_q * e_row, 0.0)
                    A_kk += tl.dot(x_k, tl.trans(k_cols), input_precision=DOT_PREC)
                    A_qk += tl.dot(x_q, tl.trans(k_cols), input_precision=DOT_PREC)
    if STRIPS:
        A_kk = _cat4(S0k, S1k, S2k, S3k, BT, SUB)
        A_qk = _cat4(S0q, S1q, S2q, S3q, BT, SUB)
    A_kk = tl.where(loc[:, None] > loc[None, :], A_kk, 0.0) * b_beta[:, None]
    A_qk = tl.where(loc[:, None] >= loc[None, :], A_qk, 0.0) * scale
    p_A = tl.make_block_ptr(Aqk_out + c_base, (T, BT), (HV * BT, 1), (r0, 0), (BT, BT), (1, 0))
    tl.store(p_A, A_qk.to(Aqk_out.dtype.element_ty), boundary_check=(0,))

    if SKIP & 2 == 0:
        T_ut = _unit_lower_inverse(A_kk, loc, BT, SUB, LOG_SUB, LOG_NB, DOT_PREC)
    else:
        T_ut = A_kk
    p_T = tl.make_block_ptr(T_out + c_base, (T, BT), (HV * BT, 1), (r0, 0), (BT, BT), (1, 0))
    tl.store(p_T, T_ut, boundary_check=(0,))
    if not WY:
        return

    for kb in range(K // BK):
        p_k = tl.make_block_ptr(k + qk_base, (T, K), (H * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        p_g = tl.make_block_ptr(g + gk_base, (T, K), (HV * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        p_w = tl.make_block_ptr(W_out + gk_base, (T, K), (HV * K, 1), (r0, kb * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0,), padding_option="zero").to(tl.float32)
        b_g = tl.load(p_g, boundary_check=(0,), padding_option="zero").to(tl.float32)
        b_kb = b_k * tl.exp(tl.cumsum(b_g, axis=0)) * b_beta[:, None]
        b_W = tl.dot(T_ut, b_kb, input_precision=DOT_PREC)
        tl.store(p_w, b_W.to(W_out.dtype.element_ty), boundary_check=(0,))
    for vb in range(V // BV):
        p_v = tl.make_block_ptr(v + v_base, (T, V), (HV * V, 1), (r0, vb * BV), (BT, BV), (1, 0))
        p_u = tl.make_block_ptr(U_out + v_base, (T, V), (HV * V, 1), (r0, vb * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0,), padding_option="zero").to(tl.float32)
        b_U = tl.dot(T_ut, b_v * b_beta[:, None], input_precision=DOT_PREC)
        tl.store(p_u, b_U.to(U_out.dtype.element_ty), boundary_check=(0,))


@triton.jit(do_not_specialize=["T"])
def kda_wy_fwd_kernel(
    k,
    v,
    beta,
    G,
    KB,
    T_ut,
    W_out,
    U_out,
    T,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_KB: tl.constexpr = False,
):
    """The WY factors as a launch of their own (chunk.INTRA_FWD_SPLIT), after
    :func:`kda_intra_fwd_kernel` with ``WY = False``: one program per (channel block, chunk,
    batch x value head). Block ``j < K/BK`` is ``W = T Diag(beta)(K*exp(G))`` for key channels
    ``j*BK .. j*BK+BK``, block ``K/BK + i`` is ``U' = T Diag(beta) V`` for value channels
    ``i*BV .. i*BV+BV``. Reads the chunk's UT transform T ``[BT, BT]`` and G (both fp32, stored by
    the first kernel): the same operands and products as that kernel's pass 2. ``USE_KB``: the
    right factor ``Diag(beta)(K*exp(G))`` is read from KB (``[B, T, HV, K]``, the inputs' dtype,
    stored by the first kernel) instead of from k, G and beta."""
    i_blk = tl.program_id(0)  # the fastest axis: a chunk's programs share its T through L2
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2)
    b, hv, q_base, gk_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    r0 = i_t * BT
    # padded rows: beta = 0, k = v = 0 (and T's rows zero): nothing written past T
    b_beta = tl.load(beta + (b * T + rows) * HV + hv, mask=rows < T, other=0.0).to(tl.float32)
    b_T = _load_rows(T_ut + c_base, T, HV * BT, BT, r0, 0, BT, BT)
    if i_blk < K // BK:
        c0 = i_blk * BK
        if USE_KB:
            b_kb = _load_rows(KB + gk_base, T, HV * K, K, r0, c0, BT, BK).to(tl.float32)
        else:
            b_k = _load_rows(k + q_base, T, H * K, K, r0, c0, BT, BK).to(tl.float32)
            b_G = _load_rows(G + gk_base, T, HV * K, K, r0, c0, BT, BK)
            b_kb = b_k * tl.exp(b_G) * b_beta[:, None]
        b_W = tl.dot(b_T, b_kb, input_precision=DOT_PREC)
        p_w = _tile(W_out + gk_base, T, HV * K, K, r0, c0, BT, BK)
        tl.store(p_w, b_W.to(W_out.dtype.element_ty), boundary_check=(0,))
    else:
        c0 = (i_blk - K // BK) * BV
        b_v = _load_rows(v + v_base, T, HV * V, V, r0, c0, BT, BV).to(tl.float32)
        b_U = tl.dot(b_T, b_v * b_beta[:, None], input_precision=DOT_PREC)
        p_u = _tile(U_out + v_base, T, HV * V, V, r0, c0, BT, BV)
        tl.store(p_u, b_U.to(U_out.dtype.element_ty), boundary_check=(0,))


@triton.jit(do_not_specialize=["T", "NT"])
def kda_state_fwd_kernel(
    W,
    U_prime,
    KD,
    gamma,
    h0,
    h_all,
    U_new,
    hT,
    T,
    NT,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    chunk_offsets=None,
):
    """S_{n+1} = Diag(gamma_n) S_n + KD_n^T (U'_n - W_n S_n), one program per (V block, b*HV).

    W, KD ``[B, T, HV, K]`` (KD = k * exp(G_last - G)); U_prime, U_new ``[B, T, HV, V]``;
    gamma ``[B, HV, NT, K]`` (exp(G_last)); h0, hT ``[B, HV, K, V]`` fp32;
    h_all ``[B, HV, NT, K, V]`` the state entering each chunk.
    ``chunk_offsets`` (int32 ``[N + 1]``, or None): B = 1 holds N sequences, sequence i in chunks
    ``chunk_offsets[i] .. chunk_offsets[i + 1] - 1``; one program per (V block, HV, sequence), with
    h0 and hT ``[N, HV, K, V]``.
    """
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    hv = i_bh % HV
    if chunk_offsets is not None:
        i_state = tl.program_id(2) * HV + hv  # the sequence's h0 / hT
        c0 = tl.load(chunk_offsets + tl.program_id(2))
        c1 = tl.load(chunk_offsets + tl.program_id(2) + 1)
    else:
        i_state = i_bh
        c0 = 0
        c1 = NT
    offk = tl.arange(0, K)
    offv = i_v * BV + tl.arange(0, BV)
    kv_off = offk[:, None] * V + offv[None, :]
    k_base = (b * T * HV + hv) * K  # [B, T, HV, K]: token t at k_base + t HV K
    v_base = (b * T * HV + hv) * V

    h = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        h += tl.load(h0 + i_state * K * V + kv_off).to(tl.float32)
    b_w = _load_rows(W + k_base, T, HV * K, K, c0 * BT, 0, BT, K)
    b_kd = _load_rows(KD + k_base, T, HV * K, K, c0 * BT, 0, BT, K)
    p_up = _tile(U_prime + v_base, T, HV * V, V, c0 * BT, i_v * BV, BT, BV)
    b_up = tl.load(p_up, boundary_check=(0,), padding_option="zero")
    b_gamma = tl.load(gamma + (i_bh * NT + c0) * K + offk)
    # a while loop, not range(NT): Triton 3.6's CPU interpreter cannot range over a runtime int;
    # so Triton does not pipeline it, and the loads of chunk n + 1 are issued by hand before the
    # dependent matmuls of chunk n (they do not depend on the state): at B=1, T=64k on an H100 the
    # loop is the critical path (1024 chunks in sequence, 32 programs)
    n = c0
    while n < c1:
        p_h = tl.make_block_ptr(
            h_all + (i_bh * NT + n) * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0)
        )
        tl.store(p_h, h.to(h_all.dtype.element_ty))
        # chunk n + 1's tiles (zero past the end: boundary_check); gamma's row n + 1 only if it exists.
        # Block pointers are made afresh each step: Triton 3.6 cannot carry them through a while loop
        r1 = (n + 1) * BT
        p_w = _tile(W + k_base, T, HV * K, K, r1, 0, BT, K)
        p_kd = _tile(KD + k_base, T, HV * K, K, r1, 0, BT, K)
        p_up = _tile(U_prime + v_base, T, HV * V, V, r1, i_v * BV, BT, BV)
        nxt_w = tl.load(p_w, boundary_check=(0,), padding_option="zero")
        nxt_kd = tl.load(p_kd, boundary_check=(0,), padding_option="zero")
        nxt_up = tl.load(p_up, boundary_check=(0,), padding_option="zero")
        nxt_gamma = tl.load(gamma + (i_bh * NT + n + 1) * K + offk, mask=(offk < K) & (n + 1 < NT), other=1.0)
        # the matmul runs in the inputs' dtype (bf16 tensor cores for bf16), accumulating in fp32
        b_u = b_up.to(tl.float32) - tl.dot(b_w, h.to(b_w.dtype), input_precision=DOT_PREC)
        p_un = _tile(U_new + v_base, T, HV * V, V, n * BT, i_v * BV, BT, BV)
        tl.store(p_un, b_u.to(U_new.dtype.element_ty), boundary_check=(0,))
        h = h * b_gamma.to(tl.float32)[:, None] + tl.dot(
            tl.trans(b_kd), b_u.to(b_kd.dtype), input_precision=DOT_PREC
        )
        b_w, b_kd, b_up, b_gamma = nxt_w, nxt_kd, nxt_up, nxt_gamma
        n += 1
    if STORE_FINAL:
        tl.store(hT + i_state * K * V + kv_off, h)


@triton.jit(do_not_specialize=["T", "NT"])
def kda_out_fwd_kernel(
    q,
    G,
    QG,
    h_all,
    Aqk,
    U_new,
    o,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_QG: tl.constexpr = False,
):
    """O = scale (Q * exp(G)) S_n + A_qk U for one chunk and one value block. ``USE_QG``: the left
    factor ``scale Q*exp(G)`` is read from QG (``[B, T, HV, K]``, the inputs' dtype, stored by the
    intra-chunk kernel: half the bytes of Q and the fp32 G, read once per value block)."""
    i_t = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2)
    b, hv, q_base, k_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    r0 = i_t * BT
    if USE_QG:
        b_qg = _load_rows(QG + k_base, T, HV * K, K, r0, 0, BT, K)
    else:
        b_q = _load_rows(q + q_base, T, H * K, K, r0, 0, BT, K)
        b_G = _load_rows(G + k_base, T, HV * K, K, r0, 0, BT, K)
        b_qg = (b_q.to(tl.float32) * tl.exp(b_G) * scale).to(q.dtype.element_ty)
    b_h = tl.load(_tile(h_all + (i_bh * NT + i_t) * K * V, K, V, V, 0, i_v * BV, K, BV))
    b_o = tl.dot(b_qg, b_h.to(b_qg.dtype), input_precision=DOT_PREC)
    b_A = _load_rows(Aqk + c_base, T, HV * BT, BT, r0, 0, BT, BT)
    b_u = _load_rows(U_new + v_base, T, HV * V, V, r0, i_v * BV, BT, BV)
    b_o += tl.dot(b_A.to(b_u.dtype), b_u, input_precision=DOT_PREC)
    tl.store(
        _tile(o + v_base, T, HV * V, V, r0, i_v * BV, BT, BV), b_o.to(o.dtype.element_ty), boundary_check=(0,)
    )


@triton.jit(do_not_specialize=["T", "NT"])
def kda_state_bwd_kernel(
    W,
    KD,
    gamma,
    h_all,
    U_new,
    dU_ext,
    dh_ext,
    dhT,
    dW,
    dU_prime,
    dKD,
    dgamma,
    dh0,
    T,
    NT,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_DHT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Reverse of :func:`kda_state_fwd_kernel`, one program per (V block, b*HV).

    With dS the gradient reaching S_{n+1}, for n = NT-1 .. 0:
        dU_n   = dU_ext_n + KD_n dS          (U_n feeds S_{n+1} through KD_n^T U_n)
        dKD_n  = U_n dS^T
        dgamma_n = rowsum(dS * S_n)
        dW_n   = -dU_n S_n^T                 (U_n = U'_n - W_n S_n)
        dS    <- Diag(gamma_n) dS - W_n^T dU_n + dh_ext_n
    Columns of the state (value channels) evolve independently, so V is split across programs;
    dKD, dW and dgamma sum over V and are accumulated with atomic adds (zero-initialised).
    """
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    hv = i_bh % HV
    offk = tl.arange(0, K)
    offv = i_v * BV + tl.arange(0, BV)
    loc = tl.arange(0, BT)
    kv_off = offk[:, None] * V + offv[None, :]

    dS = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dhT + i_bh * K * V + kv_off).to(tl.float32)
    n = NT - 1
    while n >= 0:
        rows = n * BT + loc
        mrow = rows < T
        k_off = ((b * T + rows[:, None]) * HV + hv) * K + offk[None, :]
        v_off = ((b * T + rows[:, None]) * HV + hv) * V + offv[None, :]
        b_kd = tl.load(KD + k_off, mask=mrow[:, None], other=0.0).to(tl.float32)
        b_w = tl.load(W + k_off, mask=mrow[:, None], other=0.0).to(tl.float32)
        b_u = tl.load(U_new + v_off, mask=mrow[:, None], other=0.0).to(tl.float32)
        b_du = tl.load(dU_ext + v_off, mask=mrow[:, None], other=0.0).to(tl.float32)
        b_h = tl.load(h_all + (i_bh * NT + n) * K * V + kv_off).to(tl.float32)
        b_gamma = tl.load(gamma + (i_bh * NT + n) * K + offk).to(tl.float32)

        b_du += tl.dot(b_kd, dS, input_precision=DOT_PREC)
        b_dkd = tl.dot(b_u, tl.trans(dS), input_precision=DOT_PREC)
        b_dgamma = tl.sum(dS * b_h, axis=1)
        b_dw = -tl.dot(b_du, tl.trans(b_h), input_precision=DOT_PREC)
        tl.store(dU_prime + v_off, b_du, mask=mrow[:, None])
        tl.atomic_add(dKD + k_off, b_dkd, mask=mrow[:, None], sem="relaxed")
        tl.atomic_add(dW + k_off, b_dw, mask=mrow[:, None], sem="relaxed")
        tl.atomic_add(dgamma + (i_bh * NT + n) * K + offk, b_dgamma, sem="relaxed")
        b_dh = tl.load(dh_ext + (i_bh * NT + n) * K * V + kv_off).to(tl.float32)
        dS = dS * b_gamma[:, None] - tl.dot(tl.trans(b_w), b_du, input_precision=DOT_PREC) + b_dh
        n -= 1
    tl.store(dh0 + i_bh * K * V + kv_off, dS)


@triton.jit
def kda_decode_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    o,
    scale,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
):
    """One token of KDA, updating ``state [B, HV, K, V]`` (fp32) in place; o ``[B, 1, HV, V]``."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    hv = i_bh % HV
    hk = hv // (HV // H)
    offk = tl.arange(0, K)
    offv = i_v * BV + tl.arange(0, BV)
    kv_off = i_bh * K * V + offk[:, None] * V + offv[None, :]
    b_q = tl.load(q + (b * H + hk) * K + offk).to(tl.float32)
    b_k = tl.load(k + (b * H + hk) * K + offk).to(tl.float32)
    b_g = tl.load(g + (b * HV + hv) * K + offk).to(tl.float32)
    b_beta = tl.load(beta + b * HV + hv).to(tl.float32)
    b_v = tl.load(v + (b * HV + hv) * V + offv).to(tl.float32)
    S = tl.load(state + kv_off) * tl.exp(b_g)[:, None]  # Diag(alpha_t) S_{t-1}
    err = b_v - tl.sum(b_k[:, None] * S, axis=0)  # v_t - (Diag(alpha_t) S_{t-1})^T k_t
    S += b_beta * b_k[:, None] * err[None, :]
    tl.store(state + kv_off, S)
    b_o = tl.sum(b_q[:, None] * S, axis=0) * scale
    tl.store(o + (b * HV + hv) * V + offv, b_o.to(o.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "NT"])
def kda_state_bwd_fused_kernel(
    q,
    G,
    Aqk,
    W,
    KD,
    gamma,
    do,
    dhT,
    dU,
    dh_all,
    dh0,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_DHT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    chunk_offsets=None,
):
    """The backward's only sequential part, one program per (V block, b*HV), chunks in reverse
    (``chunk_offsets``: per (V block, HV, sequence), as in :func:`kda_state_fwd_kernel`).

    Forward per chunk n: ``U_n = U'_n - W_n S_n``, ``S_{n+1} = Diag(gamma_n) S_n + KD_n^T U_n``,
    ``O_n = scale (Q_n*exp(G_n)) S_n + A_qk,n U_n``. With dS the gradient reaching S_{n+1}:

        dU_n = A_qk,n^T dO_n + KD_n dS                      (stored: it is also dU'_n)
        dS  <- Diag(gamma_n) dS - W_n^T dU_n + scale (Q_n*exp(G_n))^T dO_n

    and dS before the update (the gradient at S_{n+1}) is stored per chunk in ``dh_all``. The
    readout's gradients (A_qk^T dO, (Q e^G)^T dO) are computed here, in the loop, rather than
    written to memory by a separate kernel and read back; everything that is a sum over the value
    channels (dW, dKD, dgamma) is left to the parallel :func:`kda_intra_bwd_split_dqk_kernel`, so this
    kernel needs no atomics.

    Tried on an H100 and left out: reading the forward's stored ``scale Q*exp(G)`` (bf16) instead
    of forming it from Q and G gave non-finite gradients at BV = 16 under Triton 3.6 (cause not
    found; the same tile pattern as W's, which is fine); loading chunk n - 1's tiles before chunk
    n's products, as the forward state kernel does, was slower (5.02 against 4.91 ms forward +
    backward at B=8, T=2048) and read shared memory out of range at BV = 16.
    """
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    _b, _hv, q_base, k_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    offk = tl.arange(0, K)
    offv = i_v * BV + tl.arange(0, BV)
    kv_off = offk[:, None] * V + offv[None, :]
    bases = (q_base, k_base, v_base, c_base)
    if chunk_offsets is not None:
        i_state = tl.program_id(2) * HV + i_bh % HV  # the sequence's dhT / dh0
        c0 = tl.load(chunk_offsets + tl.program_id(2))
        n = tl.load(chunk_offsets + tl.program_id(2) + 1) - 1
    else:
        i_state = i_bh
        c0 = 0
        n = NT - 1

    dS = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dhT + i_state * K * V + kv_off).to(tl.float32)
    while n >= c0:
        r0 = n * BT
        b_qgt, b_At, b_wt, b_kd, b_do, b_gamma = _state_bwd_tiles(
            q, G, Aqk, W, KD, gamma, do, scale, T, NT, H, HV, i_bh, i_v, n, *bases, K, V, BT, BV
        )

        tl.store(dh_all + (i_bh * NT + n) * K * V + kv_off, dS.to(dh_all.dtype.element_ty))
        # fp32 operands (tf32 tensor cores for bf16 inputs): with bf16 operands Triton 3.6 built a
        # kernel that addressed shared memory out of range on an H100 (compute-sanitizer)
        b_du = tl.dot(b_At.to(tl.float32), b_do, input_precision=DOT_PREC)
        b_du += tl.dot(b_kd.to(tl.float32), dS, input_precision=DOT_PREC)
        tl.store(_tile(dU + v_base, T, HV * V, V, r0, i_v * BV, BT, BV), b_du, boundary_check=(0,))
        dS = dS * b_gamma[:, None] - tl.dot(b_wt.to(tl.float32), b_du, input_precision=DOT_PREC)
        dS += tl.dot(b_qgt.to(tl.float32), b_do, input_precision=DOT_PREC)
        n -= 1
    tl.store(dh0 + i_state * K * V + kv_off, dS)


@triton.jit
def _state_bwd_tiles(
    q, G, Aqk, W, KD, gamma, do, scale, T, NT, H, HV, i_bh, i_v, n, q_base, k_base, v_base, c_base,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Chunk n's tiles for :func:`kda_state_bwd_fused_kernel`: ``(scale Q*exp(G))^T``, ``A_qk^T``,
    ``W^T`` (loaded transposed, ``[K, BT]`` and ``[BT, BT]``, rather than transposed in registers),
    KD, dO (fp32) and gamma (fp32)."""
    r0 = n * BT
    b_qt = _load_rows_t(q + q_base, T, H * K, K, r0, 0, BT, K)
    b_Gt = _load_rows_t(G + k_base, T, HV * K, K, r0, 0, BT, K)
    b_qgt = b_qt.to(tl.float32) * tl.exp(b_Gt) * scale
    b_At = tl.load(
        _tile_t(Aqk + c_base, T, HV * BT, BT, r0, 0, BT, BT), boundary_check=(1,), padding_option="zero"
    )
    b_wt = _load_rows_t(W + k_base, T, HV * K, K, r0, 0, BT, K)
    b_kd = _load_rows(KD + k_base, T, HV * K, K, r0, 0, BT, K)
    p_do = _tile(do + v_base, T, HV * V, V, r0, i_v * BV, BT, BV)
    b_do = tl.load(p_do, boundary_check=(0,), padding_option="zero").to(tl.float32)
    offk = tl.arange(0, K)
    b_gamma = tl.load(gamma + (i_bh * NT + n) * K + offk, mask=(offk < K) & (n >= 0), other=1.0).to(
        tl.float32
    )
    return b_qgt, b_At, b_wt, b_kd, b_do, b_gamma


@triton.jit(do_not_specialize=["T", "NT"])
def kda_out_bwd_kernel(
    q,
    G,
    Aqk,
    do,
    dU_ext,
    dh_ext,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Gradients leaving the readout O = scale (Q*exp(G)) S_n + A_qk U towards U and S_n:
    dU_ext = A_qk^T dO and dh_ext_n = scale (Q*exp(G))^T dO, for one chunk and value block."""
    i_t = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2)
    b = i_bh // HV
    hv = i_bh % HV
    hk = hv // (HV // H)
    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    mrow = rows < T
    offk = tl.arange(0, K)
    offv = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + ((b * T + rows[:, None]) * H + hk) * K + offk[None, :], mask=mrow[:, None], other=0.0)
    b_G = tl.load(G + ((b * T + rows[:, None]) * HV + hv) * K + offk[None, :], mask=mrow[:, None], other=0.0)
    b_qg = b_q.to(tl.float32) * tl.exp(b_G) * scale
    b_A = tl.load(
        Aqk + ((b * T + rows[:, None]) * HV + hv) * BT + loc[None, :], mask=mrow[:, None], other=0.0
    )
    v_off = ((b * T + rows[:, None]) * HV + hv) * V + offv[None, :]
    b_do = tl.load(do + v_off, mask=mrow[:, None], other=0.0).to(tl.float32)
    b_du = tl.dot(tl.trans(b_A.to(tl.float32)), b_do, input_precision=DOT_PREC)
    tl.store(dU_ext + v_off, b_du, mask=mrow[:, None])
    b_dh = tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
    tl.store(dh_ext + (i_bh * NT + i_t) * K * V + offk[:, None] * V + offv[None, :], b_dh)


@triton.jit(do_not_specialize=["T", "NT"])
def kda_intra_bwd_kernel(
    q,
    k,
    v,
    beta,
    G,
    T_ut,
    U_new,
    h_all,
    do,
    dW,
    dU_prime,
    dKD,
    dgamma,
    dq,
    dk,
    dv,
    dg,
    dbeta,
    scale,
    T,
    NT,
    H,
    HV,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Everything parallel over chunks in the backward pass, one program per (chunk, b*HV).

    Inputs: the forward's G (fp32), T = (I + A_kk)^{-1} (fp32), U, the chunk's incoming state,
    dO, and from :func:`kda_state_bwd_kernel` dW, dU', dKD, dgamma. Outputs per value head
    (the launcher sums dq, dk over the value heads sharing a key head): dq, dk, dv, dg, dbeta.
    Each line differentiates one line of the forward (kda_intra_fwd_kernel, kda_out_fwd_kernel).
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    hv = i_bh % HV
    hk = hv // (HV // H)
    loc = tl.arange(0, BT)
    rows = i_t * BT + loc
    mrow = rows < T
    offk = tl.arange(0, K)
    offv = tl.arange(0, V)
    qk_off = ((b * T + rows[:, None]) * H + hk) * K + offk[None, :]
    k_off = ((b * T + rows[:, None]) * HV + hv) * K + offk[None, :]
    v_off = ((b * T + rows[:, None]) * HV + hv) * V + offv[None, :]
    c_off = ((b * T + rows[:, None]) * HV + hv) * BT + loc[None, :]

    b_q = tl.load(q + qk_off, mask=mrow[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + qk_off, mask=mrow[:, None], other=0.0).to(tl.float32)
    b_v = tl.load(v + v_off, mask=mrow[:, None], other=0.0).to(tl.float32)
    b_beta = tl.load(beta + (b * T + rows) * HV + hv, mask=mrow, other=0.0).to(tl.float32)
    b_G = tl.load(G + k_off, mask=mrow[:, None], other=0.0)
    last = tl.minimum(T - i_t * BT, BT) - 1  # the chunk's last real token
    G_last = tl.sum(tl.where(loc[:, None] == last, b_G, 0.0), axis=0)
    # padded rows were never stored: in the forward their G equals G_last (g = 0 there)
    b_G = tl.where(mrow[:, None], b_G, G_last[None, :])
    b_eG = tl.exp(b_G)
    b_T = tl.load(T_ut + c_off, mask=mrow[:, None], other=0.0)
    b_u = tl.load(U_new + v_off, mask=mrow[:, None], other=0.0).to(tl.float32)
    b_do = tl.load(do + v_off, mask=mrow[:, None], other=0.0).to(tl.float32)
    b_h = tl.load(h_all + (i_bh * NT + i_t) * K * V + offk[:, None] * V + offv[None, :]).to(tl.float32)

    # readout O = scale (Q*e^G) S_n + A_qk U
    b_dqg = tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC) * scale  # d(Q*e^G)
    b_dq = b_dqg * b_eG
    b_dG = b_dq * b_q
    lower = loc[:, None] >= loc[None, :]
    M_q = tl.where(lower, tl.dot(b_do, tl.trans(b_u), input_precision=DOT_PREC), 0.0) * scale

    # WY factors W = T KB, U' = T VB with KB = beta k e^G, VB = beta v
    b_dw = tl.load(dW + k_off, mask=mrow[:, None], other=0.0)
    b_dup = tl.load(dU_prime + v_off, mask=mrow[:, None], other=0.0)
    b_KB = b_k * b_eG * b_beta[:, None]
    b_VB = b_v * b_beta[:, None]
    dT = tl.dot(b_dw, tl.trans(b_KB), input_precision=DOT_PREC) + tl.dot(
        b_dup, tl.trans(b_VB), input_precision=DOT_PREC
    )
    b_dKB = tl.dot(tl.trans(b_T), b_dw, input_precision=DOT_PREC)
    b_dVB = tl.dot(tl.trans(b_T), b_dup, input_precision=DOT_PREC)
    b_dv = b_dVB * b_beta[:, None]
    b_dbeta = tl.sum(b_dVB * b_v, axis=1) + tl.sum(b_dKB * b_k * b_eG, axis=1)
    b_dk = b_dKB * b_eG * b_beta[:, None]
    b_dG += b_dKB * b_KB
    # T = (I + A_kk)^{-1}: dA = -T^T dT T^T, strictly lower
    b_Tt = tl.trans(b_T)
    dA = -tl.dot(tl.dot(b_Tt, dT, input_precision=DOT_PREC), b_Tt, input_precision=DOT_PREC)
    dA = tl.where(loc[:, None] > loc[None, :], dA, 0.0)
    M_k = dA * b_beta[:, None]

    # KD = k e^(G_last - G) and gamma = e^G_last feed the state recurrence
    b_dkd = tl.load(dKD + k_off, mask=mrow[:, None], other=0.0)
    b_dgamma = tl.load(dgamma + (i_bh * NT + i_t) * K + offk)
    dk_tail, dG_tail, dG_last = _decay_tail_grads(b_k, b_G, G_last, b_dkd, b_dgamma)
    b_dk += dk_tail
    b_dG += dG_tail

    # A[r, i] = sum_c x_rc k_ic e^(G_rc - G_ic), factored per 16-row block as in the forward
    A_raw = tl.zeros([BT, BT], dtype=tl.float32)
    for a in tl.static_range(BT // SUB):
        x_k, k_cols, e_row, e_col, in_block, upto = _block_products(b_k, b_k, b_G, loc, a, SUB)
        A_raw += tl.dot(x_k, tl.trans(k_cols), input_precision=DOT_PREC)
        d_xk, d_xq, d_y = _row_block_grads(b_q, x_k, k_cols, e_row, e_col, in_block, upto, M_k, M_q, DOT_PREC)
        b_dk += d_xk + d_y
        b_dq += d_xq
        b_dG += d_xk * b_k + d_xq * b_q - d_y * b_k
    b_dbeta += tl.sum(tl.where(loc[:, None] > loc[None, :], dA * A_raw, 0.0), axis=1)

    # G = cumsum(g): dg_r = sum_{r' >= r} dG_r'
    b_dg = _g_grad(b_dG, dG_last, loc, BT)
    tl.store(dq + k_off, b_dq, mask=mrow[:, None])
    tl.store(dk + k_off, b_dk, mask=mrow[:, None])
    tl.store(dg + k_off, b_dg, mask=mrow[:, None])
    tl.store(dv + v_off, b_dv, mask=mrow[:, None])
    tl.store(dbeta + (b * T + rows) * HV + hv, b_dbeta, mask=mrow)


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
    LOW_DOTS: tl.constexpr = False,
):
    """First kernel of the split backward (``chunk.BACKWARD = "split"``): the chunk's ``[BT, BT]``
    gradients, one program per (chunk, b*HV), in two passes over small tiles.

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

    ``LOW_DOTS`` (bf16/fp16 inputs only; ``chunk.SPLIT_BF16_DOTS``): the three products of
    input-precision data, ``dO U^T``, ``dU V^T`` (beta applied to the product's columns after)
    and ``dU S_n^T``, take operands in the states' dtype (``h_all``'s: the inputs'), dU (fp32)
    cast, accumulating in fp32; the products with ``T`` or ``e^G`` stay fp32 (``DOT_PREC``).
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
        if LOW_DOTS:
            lt = h_all.dtype.element_ty
            b_Mq += tl.dot(b_do.to(lt), tl.trans(b_u.to(lt)))
            dT += tl.dot(b_du.to(lt), tl.trans(b_v.to(lt))) * b_beta[None, :]
            b_v = b_v.to(tl.float32)
        else:
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
            if LOW_DOTS:
                b_dw -= tl.dot(b_du.to(h_all.dtype.element_ty), tl.trans(tl.load(p_h)))
            else:
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
    """Backward of :func:`_column_strip` for column strip c, given the chunk's ``[BT, BT]`` blocks
    of dA and of the gradient M_q of ``A_qk`` (``dA_ptr``, ``Mq_ptr``; ``M_k = Diag(beta) dA``), of
    which it reads strip c ``[BT, SUB]``: ``(x = k e_row, y = k_c e_col)`` so ``dk_r += (M y) e_row``,
    ``dG_r += (M y) e_row k_r`` for the rows, and ``dk_i += (M^T x) e_col``, ``dG_i -= (M^T x) e_col
    k_i`` for the block's keys (``G_ref`` cancels in the product, so it gets no gradient). Adds the
    rows' parts to ``b_dk, b_dq, b_dG`` (``[BT, BK]``) and this channel block's part of
    ``dbeta_r += sum_i dA_ri A_raw,ri`` over the strip's columns to ``b_dbeta``, with ``A_raw``'s
    strip formed from the same factors (one more ``[BT, BK] x [BK, SUB]`` product; its upper
    triangle can overflow and is masked out of the sum). Returns the four sums, then the block's
    keys' parts for dk and dG (``[SUB, BK]``, for :func:`_rows4`)."""
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
    LOW_DOTS: tl.constexpr = False,
    FAST_EXP: tl.constexpr = False,
):
    """Second kernel of the split backward: dq, dk, dg for one block of BK key channels, one
    program per (key block, chunk, b*HV), from the readout, the WY factors, ``KD`` and ``gamma``,
    and the decayed key products (by column strips); ``dg`` is the reverse cumulative sum of dG.
    ``dW = -dU S_n^T`` is recomputed here rather than stored (a small matmul).

    Reads ``M_q`` and ``dA`` from :func:`kda_intra_bwd_split_mat_kernel` by 16-column strips
    (never a whole ``[BT, BT]`` matrix in registers) and ``T`` transposed; computes dq, dk, dg for
    its channels (all of them depend on the chunk only through those matrices: the cumulative sum
    of g runs over rows, not channels) and its part of dbeta (``sum_c dKB kg`` and the strips'
    ``dA * A_raw``), stored in ``dbeta_parts[1 + key block]``. Program 0 is the key block, so the
    programs of one chunk run together and share its tiles of dU, U, dO, T, M_q, dA in L2.
    Needs ``BT = 4 SUB`` (checked by the launcher).

    ``FAST_EXP`` (GPU only; ``chunk.SPLIT_FAST_EXP``): the exponentials by :func:`_exp`'s ftz path.
    ``LOW_DOTS`` (bf16/fp16 inputs only; ``chunk.SPLIT_BF16_DOTS``): the value-block products
    ``dU S_n^T``, ``U dS^T`` and ``dO S_n^T`` take operands in the states' dtype (``h_all``'s and
    ``dh_all``'s: the inputs'), dU (fp32) cast, accumulating in fp32; ``dgamma`` stays an fp32
    sum, and the products with ``T``, ``dA``, ``M_q`` or ``e^G`` stay fp32 (``DOT_PREC``).
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
        if LOW_DOTS:
            lt = h_all.dtype.element_ty
            b_h, b_ds = b_h.to(lt), b_ds.to(lt)
            b_dw -= tl.dot(b_du.to(lt), tl.trans(b_h))  # U = U' - W S_n
            b_dkd += tl.dot(b_u.to(lt), tl.trans(b_ds))  # S_{n+1} += KD^T U
            b_dqg += tl.dot(b_do.to(lt), tl.trans(b_h))  # O += (Q e^G) S_n
        else:
            b_h, b_ds = b_h.to(tl.float32), b_ds.to(tl.float32)
            b_u, b_do = b_u.to(tl.float32), b_do.to(tl.float32)
            b_dw -= tl.dot(b_du, tl.trans(b_h), input_precision=DOT_PREC)  # U = U' - W S_n
            b_dkd += tl.dot(b_u, tl.trans(b_ds), input_precision=DOT_PREC)  # S_{n+1} += KD^T U
            b_dqg += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)  # O += (Q e^G) S_n
        b_dgamma += tl.sum(b_ds.to(tl.float32) * b_h.to(tl.float32), axis=1)  # S_{n+1} += Diag(gamma) S_n

    # readout O = scale (Q*e^G) S_n + A_qk U
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
    # the block's keys' parts, stacked into their rows (a 0/1 product per strip instead,
    # SPLIT_B_ROWS_BY_DOT, spilled less but was slower on an H100, 6.57 against 5.57 ms, and wrong
    # in bf16 there: removed)
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
