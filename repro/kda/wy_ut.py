"""The WY representation of a chunk's transitions and the UT transform (kimiteam2025kimilinear §3.1;
derivation in chunk_torch.py, steps 2 and 3).

Inside a chunk the pseudo-values solve one unit lower-triangular system, ``(I + A_kk) U =
Diag(beta) (V - (K * Gamma) S_0)``. The UT transform ``T = (I + A_kk)^{-1}``
(:func:`_unit_lower_inverse`, ten matmuls for a chunk of 64, inlined into the intra-chunk kernel,
which has ``A_kk`` in registers) turns it into ``U = U' - W S_0`` with the WY factors

    W = T Diag(beta) (K * exp(G)),      U' = T Diag(beta) V,

which :func:`kda_wy_fwd_kernel` computes from the stored ``T`` and ``KB = Diag(beta) (K * exp(G))``,
every chunk in parallel: they depend on the chunk's own tokens only, so the incoming state enters
the chunk through the single product ``W S_0`` (inter_chunk.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.tiles import BT, _head_bases, _load_rows, _tile

# The WY factors as a launch of their own, one program per chunk, head and block of WY_BK key or
# WY_BV value channels, rather than a second pass of the intra-chunk kernel over the same program:
# the fused kernel ran one latency-bound program per (chunk, head) at ~255 registers, its second
# pass (~0.32 ms of the kernel, an older 8-warp measurement) in sequence after the first; split, that
# pass runs as many small programs. Measured on an H100 (bf16, B=8, T=2048, kernel time of the
# forward, bench.py --breakdown, 2026-11-23): 1.085 ms (intra 0.528 + wy 0.195 + state 0.187 +
# readout 0.175) against 1.131 ms fused (intra 0.770). Compiled offline for sm_90a (Triton 3.6,
# bf16, K = V = 128; shared memory from the compiled metadata, registers and spills from the
# bundled ptxas -v): the intra-chunk kernel at 4 warps with the second pass 255 registers, 1884
# bytes of spill stores; without it still 255 registers, 640 bytes: no more programs per SM, only
# less spilling. This kernel: BK = BV = 64 at 8 warps 110 registers (4 warps: 254), 32 KiB shared;
# 32 at 8 warps 48 registers (4 warps: 116), 24 KiB; 128 at 8 warps 228 (4 warps: 255, 328 bytes of
# spill stores), 48 KiB; no spills otherwise.
# 64-channel blocks: four programs per chunk and head at K = V = 128 (16384 at B=8, T=2048, HV=16),
# each chunk's 16 KiB fp32 T read four times (from L2: the block is the fastest grid axis)
WY_BK = 64
WY_BV = 64
WY_WARPS = 8  # 110 registers (4 warps: 254): two programs per SM either way, twice the warps
# As the code is now (KB read from memory; lab/ptx_snapshot.py --ptxas, 2026-11-27, K = V = 128, 8
# warps): bf16 43 registers, fp16 (tf32x3) 122, 32 KiB shared, no spills.


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
    """The UT transform: ``(I + A)^{-1}`` for a strictly lower ``[BT, BT]`` A, in ten matmuls for
    BT = 64, SUB = 16.

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


@triton.jit(do_not_specialize=["T"])
def kda_wy_fwd_kernel(
    v,
    beta,
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
):
    """The WY factors, one program per (channel block, chunk, batch x value head). Block
    ``j < K/BK`` is ``W = T KB`` for key channels ``j*BK .. j*BK+BK``, block ``K/BK + i`` is
    ``U' = T Diag(beta) V`` for value channels ``i*BV .. i*BV+BV``. Reads the chunk's UT
    transform T ``[BT, BT]`` (fp32) and ``KB = Diag(beta)(K*exp(G))`` (``[B, T, HV, K]``, the
    inputs' dtype), both stored by the intra-chunk kernel."""
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
        b_kb = _load_rows(KB + gk_base, T, HV * K, K, r0, c0, BT, BK).to(tl.float32)
        b_W = tl.dot(b_T, b_kb, input_precision=DOT_PREC)
        p_w = _tile(W_out + gk_base, T, HV * K, K, r0, c0, BT, BK)
        tl.store(p_w, b_W.to(W_out.dtype.element_ty), boundary_check=(0,))
    else:
        c0 = (i_blk - K // BK) * BV
        b_v = _load_rows(v + v_base, T, HV * V, V, r0, c0, BT, BV).to(tl.float32)
        b_U = tl.dot(b_T, b_v * b_beta[:, None], input_precision=DOT_PREC)
        p_u = _tile(U_out + v_base, T, HV * V, V, r0, c0, BT, BV)
        tl.store(p_u, b_U.to(U_out.dtype.element_ty), boundary_check=(0,))


def wy_fwd(
    v: torch.Tensor,
    beta: torch.Tensor,
    KB: torch.Tensor,
    T_ut: torch.Tensor,
    H: int,
    prec: str,
    *,
    block_k: int = WY_BK,
    block_v: int = WY_BV,
    warps: int = WY_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W ``[B, T, HV, K]`` and U' ``[B, T, HV, V]`` (the inputs' dtype) from v ``[B, T, HV, V]``,
    beta ``[B, T, HV]``, KB ``[B, T, HV, K]`` and T ``[B, T, HV, BT]``; H key heads."""
    B, T, HV, K = KB.shape
    V = v.shape[-1]
    BK, BV = min(K, block_k), min(V, block_v)
    W = torch.empty(B, T, HV, K, device=v.device, dtype=v.dtype)
    U_prime = torch.empty(B, T, HV, V, device=v.device, dtype=v.dtype)
    # the channel block is the fastest grid axis: a chunk's programs run side by side and read its T
    # from L2 rather than memory
    kda_wy_fwd_kernel[(K // BK + V // BV, triton.cdiv(T, BT), B * HV)](
        v, beta, KB, T_ut, W, U_prime, T,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC=prec, num_warps=warps,
    )  # fmt: skip
    return W, U_prime
