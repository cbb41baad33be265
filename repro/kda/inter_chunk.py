"""The inter-chunk state recurrence of the forward (kimiteam2025kimilinear §3.1; chunk_torch.py,
step 4): the only sequential part. Chunk by chunk, with ``S_n`` the state entering chunk n,

    U_n = U'_n - W_n S_n,         S_{n+1} = Diag(gamma_n) S_n + KD_n^T U_n,

one ``[BT, K] x [K, BV]`` and one ``[K, BT] x [BT, BV]`` product per chunk. Columns of the state
(value channels) evolve independently, so each program of :func:`kda_state_fwd_kernel` carries a
``[K, BV]`` block of it through all the chunks of one sequence and head; it stores each chunk's
incoming state (for the output and the backward) and the pseudo-values U.

Two layouts of that block, chosen by ``KDAConfig.state_fwd_bk``: :func:`kda_state_fwd_kernel` holds
it as one ``[K, BV]`` tile and prefetches chunk n + 1's ``[BT, K]`` tiles by hand (the default up to
K = 128 and in fp32); :func:`kda_state_fwd_split_kernel` holds it as ``K / BK`` tiles of ``[BK, BV]``
(issue #42; the default at K = 256 for bf16 inputs, ``KDAConfig.large_head_state``), so that no
``[BT, K]`` tile is ever live whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.tiles import BT, _load_rows, _load_rows_t, _state_tile, _tile

# The chunks run in sequence, one program per (value block, b*HV): with few sequences and heads
# (B=1, HV=16 at T=64k) the value blocks are the only parallelism, so the block shrinks (down to
# STATE_MIN_BV) until there are STATE_MIN_PROGRAMS programs (state_block_v). Measured on an H100
# (bf16, K=V=128, HV=16, 2026-11-23): at 1 x 64k 6.35 / 5.61 / 5.37 ms with BV 64 / 32 / 16 (8
# warps), at 8 x 2k 1.116 / 1.161 / 1.233 ms (the rule keeps 64 there, 256 programs).
STATE_MIN_PROGRAMS = 128
STATE_MIN_BV = 16
STATE_FWD_LARGEST_BV = 64
# 8 warps: with 4 the kernel spills (255 registers, ptxas -v for sm_90) and took 7.35 against 6.35
# ms at 1 x 64k; BV = 32 with 4 warps read out of bounds on an H100 (Triton 3.6), 8 warps did not
STATE_FWD_WARPS = 8
# As the code is now (lab/ptx_snapshot.py --ptxas, 2026-11-27, bf16, K = V = 128, 8 warps): BV 64
# 211 registers, 48 KiB shared; BV 16 128 registers, 24 KiB; no spills.
# Key head size 256 (issue #42) holds a [256, BV] state and [BT, 256] tiles: the rule starts from
# value blocks of 32 there. Compiled offline for sm_90a (2026-11-28, bf16, 8 warps): BV 32 210
# registers, 56 KiB shared; BV 16 190, 44 KiB; no spills. Not yet run on a GPU.
STATE_FWD_LARGEST_BV_K256 = 32
# The split layout (kda_state_fwd_split_kernel) writes its key tiles out as h1..h4 (Triton has no
# arrays of tiles): at most four, e.g. K = 256 in tiles of 64, fla's layout (its
# chunk_gated_delta_rule_fwd_kernel_h_blockdim64). Its chunk loop is a tl.range that Triton can
# software-pipeline (STATE_FWD_STAGES: the next chunks' tiles go to shared memory, not registers);
# the one-tile kernel prefetches by hand and takes no stages. Compiled offline for sm_90a
# (lab/ptx_snapshot.py --state-sweep, 2026-11-29, bf16, K = V = 256, B=8, T=2048, H=16): key
# tiles of 64, BV 32, 4 warps, one stage 160 registers, 24 KiB shared (three programs an SM by
# registers; the one-tile kernel's 210 at 8 warps fit one), BV 16 112 registers; two stages 148
# registers but 153 KiB shared (one an SM), three 222 KiB; no spills but at BV 64 with 4 warps
# (the table: lab/tuning.py STATE_CANDIDATES). Timed on an H200 (2026-11-29): tiles of 64, BV 32,
# 4 warps, two stages is K = 256's default launch for bf16 inputs (config.LARGE_HEAD_STATE_FWD,
# with the numbers); the config's own default stays one stage (the fields' defaults are the
# one-tile kernel's).
STATE_FWD_MAX_KEY_TILES = 4
STATE_FWD_STAGES = 1


def state_block_v(V: int, heads: int, fixed: int | None, largest: int, min_programs: int, min_bv: int) -> int:
    """Value channels per program of a state recurrence over ``heads`` (sequences x value heads):
    ``fixed`` if given, else from ``largest`` halved (not below ``min_bv``) until there are
    ``min_programs`` programs."""
    if fixed is not None:
        return min(V, fixed)
    bv = min(V, largest)
    while bv > min_bv and triton.cdiv(V, bv) * heads < min_programs:
        bv //= 2
    return bv


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the stored per-chunk states: the inputs' (fp32 for fp32 inputs)."""
    return torch.float32 if dtype == torch.float32 else dtype


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


@triton.jit
def _plus_w_s(acc, W_head, T, HV, K: tl.constexpr, r0, i_k: tl.constexpr, h, BT: tl.constexpr,
              BK: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """``acc + W^(i) S^(i)``: chunk rows ``r0 ..`` of W's key columns of tile ``i_k`` ([BT, BK])
    times that tile of the state ([BK, BV])."""
    b_w = _load_rows(W_head, T, HV * K, K, r0, i_k * BK, BT, BK)
    return tl.dot(b_w, h.to(b_w.dtype), acc, input_precision=DOT_PREC)


@triton.jit
def _decay_plus_kd_u(h, KD_head, gamma_row, T, HV, K: tl.constexpr, r0, i_k: tl.constexpr, b_u,
                     BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """``Diag(gamma^(i)) S^(i) + KD^(i)T U``: tile ``i_k`` of the state update, KD's key columns
    of the tile loaded transposed ([BK, BT])."""
    b_kdt = _load_rows_t(KD_head, T, HV * K, K, r0, i_k * BK, BT, BK)
    b_gamma = tl.load(gamma_row + i_k * BK + tl.arange(0, BK)).to(tl.float32)
    return tl.dot(b_kdt, b_u.to(b_kdt.dtype), h * b_gamma[:, None], input_precision=DOT_PREC)


@triton.jit(do_not_specialize=["T", "NT"])
def kda_state_fwd_split_kernel(
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
    BK: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
    chunk_offsets=None,
):
    """:func:`kda_state_fwd_kernel`'s recurrence (same arguments, same outputs) with the program's
    ``[K, BV]`` state held as ``NK = K / BK`` tiles ``S^(i)`` of key rows ``[i BK, (i+1) BK)``
    (``h1`` .. ``h4``, NK <= 4). With ``W^(i)``, ``KD^(i)`` and ``gamma^(i)`` the same key columns,

        U_n = U'_n - sum_i W_n^(i) S_n^(i),     S_{n+1}^(i) = Diag(gamma_n^(i)) S_n^(i) + KD_n^(i)T U_n:

    the key rows of the state stay independent except through U's sum, and every product is
    ``[BT, BK] x [BK, BV]`` or ``[BK, BT] x [BT, BV]``, on tiles loaded just before it (the loop is
    pipelined by Triton, ``STAGES``): no ``[BT, K]`` tile is live whole, as it is in the other
    kernel, which holds chunk n + 1's W and KD in registers beside chunk n's. (The interpreter runs
    a ``tl.range`` over runtime bounds with paperclub.triton_compat's ``__index__`` fix.)"""
    NK: tl.constexpr = K // BK
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
    W_head = W + (b * T * HV + hv) * K  # [B, T, HV, K]: token t at + t HV K
    KD_head = KD + (b * T * HV + hv) * K
    v_base = (b * T * HV + hv) * V

    h1 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 1:
        h2 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 2:
        h3 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 3:
        h4 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        h_in = h0 + i_state * K * V
        h1 += tl.load(_state_tile(h_in, 0, i_v, K, V, BK, BV)).to(tl.float32)
        if NK > 1:
            h2 += tl.load(_state_tile(h_in, 1, i_v, K, V, BK, BV)).to(tl.float32)
        if NK > 2:
            h3 += tl.load(_state_tile(h_in, 2, i_v, K, V, BK, BV)).to(tl.float32)
        if NK > 3:
            h4 += tl.load(_state_tile(h_in, 3, i_v, K, V, BK, BV)).to(tl.float32)
    for n in tl.range(c0, c1, num_stages=STAGES):
        r0 = n * BT
        # S_n, the state entering chunk n
        h_n = h_all + (i_bh * NT + n) * K * V
        tl.store(_state_tile(h_n, 0, i_v, K, V, BK, BV), h1.to(h_all.dtype.element_ty))
        if NK > 1:
            tl.store(_state_tile(h_n, 1, i_v, K, V, BK, BV), h2.to(h_all.dtype.element_ty))
        if NK > 2:
            tl.store(_state_tile(h_n, 2, i_v, K, V, BK, BV), h3.to(h_all.dtype.element_ty))
        if NK > 3:
            tl.store(_state_tile(h_n, 3, i_v, K, V, BK, BV), h4.to(h_all.dtype.element_ty))
        # W_n S_n, summed over the key tiles (the matmul in the inputs' dtype, fp32 accumulation)
        b_ws = _plus_w_s(tl.zeros([BT, BV], dtype=tl.float32), W_head, T, HV, K, r0, 0, h1, BT, BK, DOT_PREC)
        if NK > 1:
            b_ws = _plus_w_s(b_ws, W_head, T, HV, K, r0, 1, h2, BT, BK, DOT_PREC)
        if NK > 2:
            b_ws = _plus_w_s(b_ws, W_head, T, HV, K, r0, 2, h3, BT, BK, DOT_PREC)
        if NK > 3:
            b_ws = _plus_w_s(b_ws, W_head, T, HV, K, r0, 3, h4, BT, BK, DOT_PREC)
        p_up = _tile(U_prime + v_base, T, HV * V, V, r0, i_v * BV, BT, BV)
        b_u = tl.load(p_up, boundary_check=(0,), padding_option="zero").to(tl.float32) - b_ws
        p_un = _tile(U_new + v_base, T, HV * V, V, r0, i_v * BV, BT, BV)
        tl.store(p_un, b_u.to(U_new.dtype.element_ty), boundary_check=(0,))
        # S_{n+1}, tile by tile
        gamma_row = gamma + (i_bh * NT + n) * K
        h1 = _decay_plus_kd_u(h1, KD_head, gamma_row, T, HV, K, r0, 0, b_u, BT, BK, DOT_PREC)
        if NK > 1:
            h2 = _decay_plus_kd_u(h2, KD_head, gamma_row, T, HV, K, r0, 1, b_u, BT, BK, DOT_PREC)
        if NK > 2:
            h3 = _decay_plus_kd_u(h3, KD_head, gamma_row, T, HV, K, r0, 2, b_u, BT, BK, DOT_PREC)
        if NK > 3:
            h4 = _decay_plus_kd_u(h4, KD_head, gamma_row, T, HV, K, r0, 3, b_u, BT, BK, DOT_PREC)
    if STORE_FINAL:
        h_out = hT + i_state * K * V
        tl.store(_state_tile(h_out, 0, i_v, K, V, BK, BV), h1)
        if NK > 1:
            tl.store(_state_tile(h_out, 1, i_v, K, V, BK, BV), h2)
        if NK > 2:
            tl.store(_state_tile(h_out, 2, i_v, K, V, BK, BV), h3)
        if NK > 3:
            tl.store(_state_tile(h_out, 3, i_v, K, V, BK, BV), h4)


def inter_chunk_fwd(
    W: torch.Tensor,
    U_prime: torch.Tensor,
    KD: torch.Tensor,
    gamma: torch.Tensor,
    h0: torch.Tensor | None,
    output_final_state: bool,
    prec: str,
    chunk_offsets: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
    largest_bv: int = STATE_FWD_LARGEST_BV,
    min_programs: int = STATE_MIN_PROGRAMS,
    min_bv: int = STATE_MIN_BV,
    warps: int = STATE_FWD_WARPS,
    block_k: int | None = None,
    stages: int = STATE_FWD_STAGES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The state recurrence: h_all ``[B, HV, NT, K, V]`` (each chunk's incoming state, the inputs'
    dtype), U ``[B, T, HV, V]`` and the final state ``[NS, HV, K, V]`` (fp32) or None, with NS = B,
    or the number of sequences with ``chunk_offsets`` (chunk_kda's packed layout). ``block_v``: a
    fixed value block, or None for :func:`state_block_v`'s rule. ``block_k``: None for the state as
    one ``[K, BV]`` tile (:func:`kda_state_fwd_kernel`), else key rows per tile of
    :func:`kda_state_fwd_split_kernel` (taken as min(block_k, K), at most
    STATE_FWD_MAX_KEY_TILES tiles), whose loop has ``stages`` pipeline stages."""
    B, T, HV, K = W.shape
    V = U_prime.shape[-1]
    NT = gamma.shape[2]
    NS = B if chunk_offsets is None else chunk_offsets.numel() - 1  # states: per batch row or sequence
    h_all = torch.empty(B, HV, NT, K, V, device=W.device, dtype=state_dtype(W.dtype))
    U_new = torch.empty_like(U_prime)
    hT = torch.empty(NS, HV, K, V, device=W.device, dtype=torch.float32) if output_final_state else None
    if K > 128:
        largest_bv = min(largest_bv, STATE_FWD_LARGEST_BV_K256)
    BV = state_block_v(V, NS * HV, block_v, largest_bv, min_programs, min_bv)
    h0c = h0.float().contiguous() if h0 is not None else None
    grid = (triton.cdiv(V, BV), B * HV) + (() if chunk_offsets is None else (NS,))
    if block_k is not None:
        BK = min(block_k, K)
        if K // BK > STATE_FWD_MAX_KEY_TILES:
            raise ValueError(
                f"inter_chunk_fwd: key block {block_k} (KDAConfig.state_fwd_bk) splits K = {K} into "
                f"{K // BK} tiles; the split state kernel holds at most {STATE_FWD_MAX_KEY_TILES}: "
                f"expected a key block of at least {K // STATE_FWD_MAX_KEY_TILES}"
            )
        kda_state_fwd_split_kernel[grid](
            W, U_prime, KD, gamma, h0c, h_all, U_new, hT, T, NT,
            HV=HV, K=K, V=V, BT=BT, BV=BV, BK=BK, USE_H0=h0 is not None, STORE_FINAL=output_final_state,
            DOT_PREC=prec, STAGES=stages, num_warps=warps, chunk_offsets=chunk_offsets,
        )  # fmt: skip
        return h_all, U_new, hT
    kda_state_fwd_kernel[grid](
        W, U_prime, KD, gamma, h0c, h_all, U_new, hT, T, NT,
        HV=HV, K=K, V=V, BT=BT, BV=BV, USE_H0=h0 is not None, STORE_FINAL=output_final_state,
        DOT_PREC=prec, num_warps=warps, chunk_offsets=chunk_offsets,
    )  # fmt: skip
    return h_all, U_new, hT
