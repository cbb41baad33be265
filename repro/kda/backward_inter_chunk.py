"""The backward of the inter-chunk state recurrence, with the output's gradient towards U and the
states folded in: the backward's only sequential part (chunks in reverse), no atomics.

Forward per chunk n: ``U_n = U'_n - W_n S_n``, ``S_{n+1} = Diag(gamma_n) S_n + KD_n^T U_n``,
``O_n = scale (Q_n*exp(G_n)) S_n + A_qk,n U_n``. With dS the gradient reaching ``S_{n+1}``:

    dU_n = A_qk,n^T dO_n + KD_n dS                      (also dU'_n)
    dS  <- Diag(gamma_n) dS - W_n^T dU_n + scale (Q_n*exp(G_n))^T dO_n

Everything that is a sum over value channels (dW, dKD, dgamma) is left to the parallel
per-channel kernel (backward_intra_chunk.py), which reads ``dS`` per chunk from ``dh_all``.

As in the forward (inter_chunk.py), two layouts of a program's ``[K, BV]`` block of dS, chosen by
``KDAConfig.state_bwd_bk``: one tile (:func:`kda_state_bwd_fused_kernel`), or ``K / BK`` tiles of key
rows (:func:`kda_state_bwd_split_kernel`, issue #42; the default at K = 256 for bf16 inputs,
``KDAConfig.large_head_state``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.inter_chunk import STATE_MIN_BV, STATE_MIN_PROGRAMS, state_block_v
from repro.kda.tiles import BT, _head_bases, _load_rows, _load_rows_t, _state_tile, _tile, _tile_t

# The value block's rule (inter_chunk.state_block_v) starts from 64 here: BV 64 at B=8, T=2048 (256
# programs) took forward + backward from 5.04 to 4.75 ms and at B=4, T=4096 from 5.06 to 4.77 on an
# H100 (bf16, 2026-11-23); at 1 x 64k BV 16 is 0.8 ms faster than 32, at 8 x 2k 0.6 ms slower.
STATE_BWD_LARGEST_BV = 64
STATE_BWD_WARPS = 8  # with 4 warps the [K, BV] state and the [BT, K] tiles spill (ptxas -v)
# ... except at value block 16, which takes 4 warps, whatever the config says: Triton 3.6 compiles
# this kernel wrongly at BV = 16 with 8 warps on an H100 (its tf32 products of [64 or 128, BT]
# tiles by [BT, 16] ones, spread over two warpgroups). Found 2026-11-24 with fla's mild-gate case
# (B=2, T=1500, H=4, K=V=128, fp16, g = logsigmoid(x) / 10): dU 0.16 and dh0 0.93 relative error
# against the same recurrence in fp64 (lab/diagnose_bwd.py), and compute-sanitizer reports
# "Invalid __shared__ read of size 512 bytes" at the (Q e^G)^T dO product (B=1, H=1: an illegal
# address). The same kernel at 4 warps, at BV >= 32, or with ieee products is right (5.7e-4) and
# clean. Mild gates show it because the wrong dS is carried from chunk to chunk; strong decay
# forgets it within a chunk or two.
STATE_BWD_WARPS_BV16 = 4
# As the code is now (lab/ptx_snapshot.py --ptxas, 2026-11-27, K = V = 128): bf16 BV 64 / 8 warps
# 255 registers, 280 bytes of spill stores, 96 KiB shared; BV 16 / 4 warps 184 bytes, 56 KiB; fp16
# (tf32x3 products) BV 16 / 4 warps 1160 bytes, 72 KiB.
# Key head size 256 (issue #42): value blocks of 32 at 8 warps, always (offline sm_90a, 2026-11-28,
# bf16: 255 registers, 460 bytes of spill stores, 128 KiB shared; BV 16 at 4 warps spilled 1044
# bytes). Run on an H200 on 2026-11-28: bf16 and fp16 passed fla's D = 256 case.
STATE_BWD_BV_K256 = 32
# ... but fp32 inputs (ieee products) at K = 256 take value blocks of 16: at 32 the kernel needs
# 237,568 bytes of shared memory, over Hopper's 232,448 per block (Triton's OutOfResources at
# launch, fla's B2-T300-H2-D256 fp32 case on an H200, 2026-11-28; the offline snapshot had shown
# the same number). At 16: see lab/ptx_snapshot.py's d256-fp32 case.
STATE_BWD_BV_K256_FP32 = 16
# The split layout (kda_state_bwd_split_kernel): at most four key tiles (dS1..dS4), its reversed
# chunk loop pipelined by Triton with STATE_BWD_STAGES stages. Offline sm_90a (lab/ptx_snapshot.py
# --state-sweep, 2026-11-29, bf16, K = V = 256): it still holds more than 255 registers' worth
# at most launches (fp32 operands for every product, the tf32 A operands in registers); without
# spills only key tiles of 64, BV 16, 4 warps, two stages (254 registers, 195 KiB shared) and key
# tiles of 128, BV 32, 8 warps, two stages (224, 221 KiB); one stage spills 136 and 8 bytes
# there (32 and 64 KiB). The one-tile kernel: 255 registers, 460 bytes of spills, 128 KiB. Timed
# on an H200 (2026-11-29): key tiles of 128, BV 32, 8 warps, two stages is K = 256's default launch
# for bf16 inputs (config.LARGE_HEAD_STATE_BWD, with the numbers).
STATE_BWD_MAX_KEY_TILES = 4
STATE_BWD_STAGES = 2


def state_bwd_warps(bv: int, warps: int = STATE_BWD_WARPS) -> int:
    """Warps of the state backward at value block ``bv`` (see STATE_BWD_WARPS_BV16)."""
    return STATE_BWD_WARPS_BV16 if bv <= 16 else warps


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
    """One program per (V block, b*HV), chunks in reverse (``chunk_offsets``: per (V block, HV,
    sequence), as in inter_chunk.kda_state_fwd_kernel); the recurrence of the module docstring.

    dU is stored per chunk, and dS before the update (the gradient at S_{n+1}) in ``dh_all``. The
    output's gradients (A_qk^T dO, (Q e^G)^T dO) are computed here, in the loop, rather than
    written to memory by a separate kernel and read back ("fused"). The first all-Triton backward
    had that separate kernel, a state kernel with atomics and one intra-chunk gradient kernel per
    chunk and head: 10.36 ms forward + backward against 5.57 for this one and the two intra-chunk
    kernels (H100, bf16, B=8, T=2048, 2026-11-23; commits 218a00c, 1971e97; removed for issue #40).

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


@triton.jit
def _plus_kd_ds(acc, KD_head, T, HV, K: tl.constexpr, r0, i_k: tl.constexpr, dS, BT: tl.constexpr,
                BK: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """``acc + KD^(i) dS^(i)``: KD's key columns of tile ``i_k`` ([BT, BK]) times that tile of dS."""
    b_kd = _load_rows(KD_head, T, HV * K, K, r0, i_k * BK, BT, BK)
    return tl.dot(b_kd.to(tl.float32), dS, acc, input_precision=DOT_PREC)


@triton.jit
def _state_bwd_tile_step(
    dS, q_head, G_head, W_head, gamma_row, scale, T, H, HV, K: tl.constexpr, r0, i_k: tl.constexpr,
    b_du, b_do, BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Tile ``i_k`` of ``dS <- Diag(gamma) dS - W^T dU + scale (Q*exp(G))^T dO``, the key columns
    of the tile loaded transposed ([BK, BT])."""
    b_qt = _load_rows_t(q_head, T, H * K, K, r0, i_k * BK, BT, BK)
    b_Gt = _load_rows_t(G_head, T, HV * K, K, r0, i_k * BK, BT, BK)
    b_qgt = b_qt.to(tl.float32) * tl.exp(b_Gt) * scale
    b_wt = _load_rows_t(W_head, T, HV * K, K, r0, i_k * BK, BT, BK)
    b_gamma = tl.load(gamma_row + i_k * BK + tl.arange(0, BK)).to(tl.float32)
    dS = dS * b_gamma[:, None] - tl.dot(b_wt.to(tl.float32), b_du, input_precision=DOT_PREC)
    return tl.dot(b_qgt, b_do, dS, input_precision=DOT_PREC)


@triton.jit(do_not_specialize=["T", "NT"])
def kda_state_bwd_split_kernel(
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
    BK: tl.constexpr,
    USE_DHT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
    chunk_offsets=None,
):
    """:func:`kda_state_bwd_fused_kernel`'s recurrence (same arguments, same outputs) with dS held
    as ``NK = K / BK`` tiles ``dS^(i)`` of key rows (``dS1`` .. ``dS4``, NK <= 4):

        dU_n = A_qk,n^T dO_n + sum_i KD_n^(i) dS^(i),
        dS^(i) <- Diag(gamma_n^(i)) dS^(i) - W_n^(i)T dU_n + scale (Q_n*exp(G_n))^(i)T dO_n,

    so every product is ``[BT, BK] x [BK, BV]`` or ``[BK, BT] x [BT, BV]`` on tiles loaded just
    before it, the reversed chunk loop pipelined by Triton (``STAGES``). Products on fp32
    operands, as in the one-tile kernel (its note on Triton 3.6 and bf16 operands)."""
    NK: tl.constexpr = K // BK
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    _b, _hv, q_base, k_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    if chunk_offsets is not None:
        i_state = tl.program_id(2) * HV + i_bh % HV  # the sequence's dhT / dh0
        c0 = tl.load(chunk_offsets + tl.program_id(2))
        c1 = tl.load(chunk_offsets + tl.program_id(2) + 1)
    else:
        i_state = i_bh
        c0 = 0
        c1 = NT
    q_head, G_head, W_head, KD_head = q + q_base, G + k_base, W + k_base, KD + k_base

    dS1 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 1:
        dS2 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 2:
        dS3 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 3:
        dS4 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        d_in = dhT + i_state * K * V
        dS1 += tl.load(_state_tile(d_in, 0, i_v, K, V, BK, BV)).to(tl.float32)
        if NK > 1:
            dS2 += tl.load(_state_tile(d_in, 1, i_v, K, V, BK, BV)).to(tl.float32)
        if NK > 2:
            dS3 += tl.load(_state_tile(d_in, 2, i_v, K, V, BK, BV)).to(tl.float32)
        if NK > 3:
            dS4 += tl.load(_state_tile(d_in, 3, i_v, K, V, BK, BV)).to(tl.float32)
    for i_n in tl.range(0, c1 - c0, num_stages=STAGES):
        n = c1 - 1 - i_n  # chunks in reverse
        r0 = n * BT
        # the gradient reaching S_{n+1}, before chunk n's update
        dh_n = dh_all + (i_bh * NT + n) * K * V
        tl.store(_state_tile(dh_n, 0, i_v, K, V, BK, BV), dS1.to(dh_all.dtype.element_ty))
        if NK > 1:
            tl.store(_state_tile(dh_n, 1, i_v, K, V, BK, BV), dS2.to(dh_all.dtype.element_ty))
        if NK > 2:
            tl.store(_state_tile(dh_n, 2, i_v, K, V, BK, BV), dS3.to(dh_all.dtype.element_ty))
        if NK > 3:
            tl.store(_state_tile(dh_n, 3, i_v, K, V, BK, BV), dS4.to(dh_all.dtype.element_ty))
        b_At = tl.load(
            _tile_t(Aqk + c_base, T, HV * BT, BT, r0, 0, BT, BT), boundary_check=(1,), padding_option="zero"
        )
        p_do = _tile(do + v_base, T, HV * V, V, r0, i_v * BV, BT, BV)
        b_do = tl.load(p_do, boundary_check=(0,), padding_option="zero").to(tl.float32)
        # dU_n, its state part summed over the key tiles
        b_du = tl.dot(b_At.to(tl.float32), b_do, input_precision=DOT_PREC)
        b_du = _plus_kd_ds(b_du, KD_head, T, HV, K, r0, 0, dS1, BT, BK, DOT_PREC)
        if NK > 1:
            b_du = _plus_kd_ds(b_du, KD_head, T, HV, K, r0, 1, dS2, BT, BK, DOT_PREC)
        if NK > 2:
            b_du = _plus_kd_ds(b_du, KD_head, T, HV, K, r0, 2, dS3, BT, BK, DOT_PREC)
        if NK > 3:
            b_du = _plus_kd_ds(b_du, KD_head, T, HV, K, r0, 3, dS4, BT, BK, DOT_PREC)
        tl.store(_tile(dU + v_base, T, HV * V, V, r0, i_v * BV, BT, BV), b_du, boundary_check=(0,))
        # dS, tile by tile
        gamma_row = gamma + (i_bh * NT + n) * K
        args = (q_head, G_head, W_head, gamma_row, scale, T, H, HV, K, r0)
        dS1 = _state_bwd_tile_step(dS1, *args, 0, b_du, b_do, BT, BK, DOT_PREC)
        if NK > 1:
            dS2 = _state_bwd_tile_step(dS2, *args, 1, b_du, b_do, BT, BK, DOT_PREC)
        if NK > 2:
            dS3 = _state_bwd_tile_step(dS3, *args, 2, b_du, b_do, BT, BK, DOT_PREC)
        if NK > 3:
            dS4 = _state_bwd_tile_step(dS4, *args, 3, b_du, b_do, BT, BK, DOT_PREC)
    d_out = dh0 + i_state * K * V
    tl.store(_state_tile(d_out, 0, i_v, K, V, BK, BV), dS1)
    if NK > 1:
        tl.store(_state_tile(d_out, 1, i_v, K, V, BK, BV), dS2)
    if NK > 2:
        tl.store(_state_tile(d_out, 2, i_v, K, V, BK, BV), dS3)
    if NK > 3:
        tl.store(_state_tile(d_out, 3, i_v, K, V, BK, BV), dS4)


def inter_chunk_bwd(
    q: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    dhT: torch.Tensor | None,
    scale: float,
    prec: str,
    chunk_offsets: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
    warps: int = STATE_BWD_WARPS,
    block_k: int | None = None,
    stages: int = STATE_BWD_STAGES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dU ``[B, T, HV, V]`` (= dU', fp32), the gradient reaching each chunk's outgoing state
    ``dh_all [B, HV, NT, K, V]`` (h_all's dtype) and dh0 ``[NS, HV, K, V]`` (fp32; per sequence
    with ``chunk_offsets``), from the forward's saved G, A_qk, W, KD, gamma, h_all and U, and dO
    (contiguous), dhT or None. ``block_v``: a fixed value block, or None for the rule. ``block_k``:
    None for dS as one tile (:func:`kda_state_bwd_fused_kernel`), else key rows per tile of
    :func:`kda_state_bwd_split_kernel` (min(block_k, K), at most STATE_BWD_MAX_KEY_TILES tiles),
    whose loop has ``stages`` pipeline stages."""
    B, T, H, K = q.shape
    HV, NT = saved["W"].shape[2], saved["gamma"].shape[2]
    V = saved["U_new"].shape[-1]
    NS = B if chunk_offsets is None else chunk_offsets.numel() - 1
    f32 = dict(device=q.device, dtype=torch.float32)
    dU = torch.empty(B, T, HV, V, **f32)
    dh_all = torch.empty_like(saved["h_all"])
    dh0 = torch.empty(NS, HV, K, V, **f32)
    dhT_c = dhT.float().contiguous() if dhT is not None else None
    if K > 128 and block_v is None:
        block_v = STATE_BWD_BV_K256_FP32 if q.dtype == torch.float32 else STATE_BWD_BV_K256
    BV = state_block_v(V, NS * HV, block_v, STATE_BWD_LARGEST_BV, STATE_MIN_PROGRAMS, STATE_MIN_BV)
    grid = (triton.cdiv(V, BV), B * HV) + (() if chunk_offsets is None else (NS,))
    if block_k is not None:
        BK = min(block_k, K)
        if K // BK > STATE_BWD_MAX_KEY_TILES:
            raise ValueError(
                f"inter_chunk_bwd: key block {block_k} (KDAConfig.state_bwd_bk) splits K = {K} into "
                f"{K // BK} tiles; the split state backward holds at most {STATE_BWD_MAX_KEY_TILES}: "
                f"expected a key block of at least {K // STATE_BWD_MAX_KEY_TILES}"
            )
        kda_state_bwd_split_kernel[grid](
            q, saved["G"], saved["Aqk"], saved["W"], saved["KD"], saved["gamma"], do, dhT_c, dU, dh_all,
            dh0, scale, T, NT, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, BK=BK, USE_DHT=dhT is not None,
            DOT_PREC=prec, STAGES=stages, num_warps=state_bwd_warps(BV, warps), chunk_offsets=chunk_offsets,
        )  # fmt: skip
        return dU, dh_all, dh0
    kda_state_bwd_fused_kernel[grid](
        q, saved["G"], saved["Aqk"], saved["W"], saved["KD"], saved["gamma"], do, dhT_c, dU, dh_all, dh0,
        scale, T, NT, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=dhT is not None, DOT_PREC=prec,
        num_warps=state_bwd_warps(BV, warps), chunk_offsets=chunk_offsets,
    )  # fmt: skip
    return dU, dh_all, dh0
