"""Chunkwise KDA on Triton: launchers, the autograd Function, the decode step.

Forward: four Triton launches (kernels.py): the intra-chunk products and UT transform, the WY
factors (``INTRA_FWD_SPLIT``, the default; False folds them into the first kernel: three launches,
4% slower on an H100), the state recurrence, the readout; no PyTorch math on the hot path. The
first kernel also stores the factors the WY and readout kernels multiply by (``INTRA_FWD_KB``,
``INTRA_FWD_QG``), and on a GPU the exponentials of the intra-chunk kernels are single
``ex2.approx.ftz`` instructions (``INTRA_FWD_FAST_EXP``, ``SPLIT_FAST_EXP``). It saves the
intermediates the backward needs (cumulative decay G, the UT transform T, W, KD, the states
entering each chunk, the pseudo-values U): no recomputation.

Backward (``BACKWARD = "split"``, the default): the reverse state recurrence with the readout's
gradient folded in (``kda_state_bwd_fused_kernel``, the only sequential part, no atomics), then the
intra-chunk gradients in two kernels with many small programs: ``kda_intra_bwd_split_mat_kernel``
computes each chunk's ``[BT, BT]`` gradients (M_q for A_qk, dA = -T^T dT T^T for the UT transform)
plus dv, and ``kda_intra_bwd_split_dqk_kernel`` the per-channel gradients dq, dk, dg, one program per
block of SPLIT_BKB key channels, reading those matrices back from memory. Measured on an H100
(bf16, B=8, T=2048, H=16, K=V=128, median of 3 interleaved rounds, one process with fla 0.6.0):
forward 0.991 ms and forward + backward 4.799 ms against flash-linear-attention's chunk_kda at
1.068 and 5.457 ms (results/nvidia-h100-80gb-hbm3.json: every T from 2k to 64k).

``BACKWARD = "triton"``: the first all-Triton backward, three launches: the readout's gradient
(``kda_out_bwd_kernel``), the reverse state recurrence (``kda_state_bwd_kernel``, atomics) and all
intra-chunk gradients in one kernel holding whole ``[BT, K]`` tiles (``kda_intra_bwd_kernel``):
10.36 ms. A fused backward came between "triton" and "split" (the same state kernel, then all
intra-chunk gradients in one program per chunk and head: 7.64 ms) and was removed once "split"
replaced it.

``BACKWARD = "torch"`` selects the first, slower backward: PyTorch autograd over a recomputation
of the intra-chunk parts around the Triton state-recurrence backward. The tests check both
against the recurrence, so each is a check on the other.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
import triton

from paperclub.triton_compat import interpreting
from repro.kda.chunk_torch import chunk_matrices
from repro.kda.kernels import (
    kda_decode_kernel,
    kda_intra_bwd_kernel,
    kda_intra_bwd_split_dqk_kernel,
    kda_intra_bwd_split_mat_kernel,
    kda_intra_fwd_kernel,
    kda_out_bwd_kernel,
    kda_out_fwd_kernel,
    kda_state_bwd_fused_kernel,
    kda_state_bwd_kernel,
    kda_state_fwd_kernel,
    kda_wy_fwd_kernel,
)
from repro.kda.validate import TRITON_K, check_cu_seqlens, check_kda_inputs

BT = 64  # chunk size of the Triton path
SUB = 16  # rows per sub-block in the intra-chunk matrices
LOG_SUB, LOG_NB = SUB.bit_length() - 1, (BT // SUB).bit_length() - 1  # 16 = 2^4, 64 / 16 = 2^2
# launch settings of the parallel kernels (tuned on an H100; see bench.py --breakdown)
INTRA_FWD_WARPS = 4  # 0.91 ms at B=8, T=2048 on an H100 against 1.72 ms with 8 warps
INTRA_BK = 32  # key channels per step of the forward intra-chunk kernel
# A_kk, A_qk by column strips (kda_intra_fwd_kernel's STRIPS) rather than masked row blocks: on an
# H100 at B=8, T=2048 the forward took 1.135 ms against 1.297 ms (4 warps; 8 warps: 1.68, 2.07)
INTRA_FWD_STRIPS = True
INTRA_FWD_STAGES = 3  # software-pipelining depth of the key/value-block loops (Triton's default)
# The forward's intra-chunk work as two launches: kda_intra_fwd_kernel without its second pass (G,
# gamma, KD, A_qk and T only; WY=False), then kda_wy_fwd_kernel, one program per chunk, head and
# block of WY_FWD_BK key or WY_FWD_BV value channels, computing W or U' from the stored T and G.
# The fused kernel runs one latency-bound program per (chunk, head) at ~255 registers, its second
# pass (~0.32 ms of the kernel, an older 8-warp measurement) in sequence after the first; split,
# that pass runs as many small programs. Measured on an H100 (bf16, B=8, T=2048, kernel time of
# the forward, bench.py --breakdown): 1.085 ms (intra 0.528 + wy 0.195 + state 0.187 + readout
# 0.175) against 1.131 ms fused (intra 0.770); in the benchmark, forward 1.089 ms and forward +
# backward 5.51 ms against flash-linear-attention's 1.067 and 5.46 (same process)
INTRA_FWD_SPLIT = True
# exp as one ex2.approx.ftz in the forward intra-chunk kernel (kernels._exp): inline PTX, so only
# on a GPU; under TRITON_INTERPRET (the CPU tests) the kernel keeps tl.exp
INTRA_FWD_FAST_EXP = True
# The intra-chunk kernel, which has q, k and G in registers, also stores the readout's left factor
# scale Q*exp(G) (INTRA_FWD_QG) and, in the split forward, the WY kernel's right factor
# Diag(beta) K*exp(G) (INTRA_FWD_KB), both in the inputs' dtype: those two kernels then read 16-bit
# tiles instead of Q or K plus the fp32 G (the readout reads them once per value block)
INTRA_FWD_QG = True
INTRA_FWD_KB = True
# Compiled offline for sm_90a (Triton 3.6, bf16, K = V = 128; shared memory from the compiled
# metadata, registers and spills from the bundled ptxas -v): kda_intra_fwd_kernel at 4 warps with
# its second pass 255 registers, 1884 bytes of spill stores; without it (WY=False) still 255
# registers, 640 bytes (at 8 warps: 156 bytes with it; none and 248 registers without): no fewer
# registers, so no more programs per SM, only less spilling. kda_wy_fwd_kernel: BK = BV = 64 at 8 warps 110 registers (4 warps: 254), 32 KiB shared;
# 32 at 8 warps 48 registers (4 warps: 116), 24 KiB; 128 at 8 warps 228 (4 warps: 255, 328 bytes
# of spill stores), 48 KiB; no spills otherwise.
# 64-channel blocks: four programs per chunk and head at K = V = 128 (16384 at B=8, T=2048, HV=16),
# each chunk's 16 KiB fp32 T read four times (from L2: the block is the fastest grid axis)
WY_FWD_BK = 64
WY_FWD_BV = 64
WY_FWD_WARPS = 8  # 110 registers (4 warps: 254): two programs per SM either way, twice the warps
# the readout kernel (one program per chunk, value block and head): value channels and warps
# (with QG read from memory, 128 channels read it once: 0.978 against 0.987 ms forward at B=8,
# T=2048 on an H100; with 8 warps 1.001)
OUT_FWD_BV = 128
OUT_FWD_WARPS = 4
# the split backward (BACKWARD = "split"; timings in the module docstring). Kernel A (the [BT, BT] gradients
# per chunk) steps through SPLIT_A_BK key and SPLIT_A_BV value channels; kernel B runs one program
# per SPLIT_BKB key channels of a chunk (K / SPLIT_BKB programs per chunk and head). Compiled
# offline for sm_90a (Triton 3.6, bf16 inputs, K = V = 128; shared memory from the compiled
# metadata, registers and spills from the bundled ptxas -v):
#   A, BK 16, BV 16, 4 warps: 48 KiB, 255 registers, no spills (BK 16, BV 32: 60 KiB, 344 bytes
#     of spill stores at 4 warps, none at 8; BK 32, BV 32, 4 warps: 532 bytes)
#   B, BKB 16, BV 32, 8 warps: 24 KiB, 255 registers, 160 bytes of spill stores (4 warps: 1256;
#     BKB 32: 32 KiB, 560 bytes at 8 warps, 3204 at 4). Most of it is stacking the four strips'
#     [16, BKB] key parts into rows (_rows4): without that step B spills nothing at BKB 16, 8
#     warps. (The removed fused backward's single intra-chunk kernel, BK 16, BV 32, 4 warps, spilled 1776.)
# Shared memory leaves room for 2+ programs per SM for both; registers (65536 per SM) allow two
# 4-warp programs of 255 registers, one 8-warp program
# kernel A measured on an H100 (B=8, T=2048, fwd+bwd, median of 3 interleaved rounds): BK 32, BV
# 32, 8 warps 5.49 ms; BK 16, BV 16, 4 warps 5.64; BK 16, BV 32, 8 warps 5.68
SPLIT_A_BK = 32
SPLIT_A_BV = 32
SPLIT_A_WARPS = 8
# kernel B measured on an H100 (B=8, T=2048, fwd+bwd, median of 3 interleaved rounds, bench.py
# --tune): BKB 32 / 4 warps 5.57 ms; 32 / 8: 6.55; 16 / 4: 6.71; 16 / 8: 9.01; 64 / 8: 6.44.
# Two programs of 4 warps fit per SM (registers), one of 8; at BKB 32 and 4 warps it spills more
# (offline) yet is the fastest
SPLIT_BKB = 32
SPLIT_B_BV = 32
SPLIT_B_WARPS = 4
# software-pipelining depth of the value-block loops of kernels A and B (1: none; the removed
# fused backward's loops asked for more shared memory than an H100 has when pipelined)
SPLIT_A_STAGES = 1
SPLIT_B_STAGES = 3
# bf16/fp16 inputs: kernels A and B take the products of input-precision data with native 16-bit
# operands (fp32 accumulation) rather than fp32 ones in tf32: A's dO U^T, dU V^T, dU S_n^T and B's
# dU S_n^T, U dS^T, dO S_n^T (U, dO, S_n and dS are stored in the inputs' dtype, dU in fp32 is cast).
# Twice the tensor-core rate for those products; it does not relieve the registers (offline,
# sm_90a, bf16: kernel B's spill stores 160 -> 192 bytes at BKB 16, 8 warps, 3204 -> 3776 at BKB
# 32, 4 warps, 560 -> 544 at BKB 32, 8 warps; kernel A still none at BK 16, BV 16, 4 warps; shared
# memory the same or 4 KiB less). Everything with T, dA, M_k, M_q or exp(G) stays fp32/tf32, and
# fp32 inputs are unaffected. Timed on an H100 (B=8, T=2048): no faster (5.72 against 5.57 ms at BKB
# 32, 4 warps; 6.67 against 6.55 at BKB 32, 8 warps): the kernels are bound by latency, not by
# tensor-core rate. Kept as a switch, off. The state kernels keep fp32 operands (bf16 ones there
# built a kernel that read shared memory out of range)
SPLIT_BF16_DOTS = False
# kernel B's exponentials as one ex2.approx.ftz each (kernels._exp; GPU only, as INTRA_FWD_FAST_EXP)
SPLIT_FAST_EXP = True
# The two state recurrences run chunks in sequence, one program per (value block, b*HV): with few
# sequences and heads (B=1, HV=16 at T=64k) the value blocks are the only parallelism, so the
# block shrinks (down to STATE_MIN_BV) until there are STATE_MIN_PROGRAMS programs. Measured on an
# H100 (bf16, K=V=128, HV=16): forward at 1 x 64k 6.35 / 5.61 / 5.37 ms with BV 64 / 32 / 16 (8
# warps), at 8 x 2k 1.116 / 1.161 / 1.233 ms; backward (fused state kernel) at 1 x 64k BV 16 0.8 ms faster than
# 32, at 8 x 2k 0.6 ms slower; starting the backward's rule from 64 rather than 32 (BV 64 at
# 8 x 2k, 256 programs) took forward + backward there from 5.01 to 4.74 ms. None = by this rule;
# an int fixes the block.
STATE_MIN_PROGRAMS = 128
STATE_MIN_BV = 16
STATE_FWD_BV = None
# 8 warps: with 4 the forward spills (255 registers, ptxas -v for sm_90) and took 7.35 against 6.35
# ms at 1 x 64k; BV = 32 with 4 warps read out of bounds on an H100 (Triton 3.6), 8 warps did not
STATE_FWD_WARPS = 8
STATE_BWD_BV = None
STATE_BWD_LARGEST_BV = 64  # where the split backward's state kernel's rule starts (was 32)
STATE_BWD_WARPS = 8  # with 4 warps the [K, BV] state and the [BT, K] tiles spill (ptxas -v)
# ... except at value block 16, which takes 4 warps: Triton 3.6 compiles the fused state backward
# wrongly at BV = 16 with 8 warps on an H100 (its tf32 products of [64 or 128, BT] tiles by [BT, 16]
# ones, spread over two warpgroups). Found with fla's mild-gate case (B=2, T=1500, H=4, K=V=128,
# fp16, g = logsigmoid(x) / 10): dU 0.16 and dh0 0.93 relative error against the same recurrence
# in fp64 (repro/kda/diagnose_bwd.py), and compute-sanitizer reports "Invalid __shared__ read of
# size 512 bytes" at the (Q e^G)^T dO product (B=1, H=1: an illegal address). The same kernel at 4
# warps, at BV >= 32, or with ieee products is right (5.7e-4) and clean. Mild gates show it because
# the wrong dS is carried from chunk to chunk; strong decay forgets it within a chunk or two.
STATE_BWD_WARPS_BV16 = 4


def _state_bwd_warps(bv: int) -> int:
    """Warps of the fused state backward for value block ``bv`` (see STATE_BWD_WARPS_BV16)."""
    return STATE_BWD_WARPS_BV16 if bv <= 16 else STATE_BWD_WARPS


@contextlib.contextmanager
def changed_settings(changes: dict):
    """The module settings named in ``changes`` (e.g. ``{"BACKWARD": "triton", "STATE_BWD_BV": 32}``)
    set for the block and restored after it; for tests, the diagnosis and the benchmark's tuning."""
    module = sys.modules[__name__]
    saved = {name: getattr(module, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _state_block_v(V: int, heads: int, fixed: int | None, largest: int) -> int:
    """Value channels per program of a state recurrence (see STATE_MIN_PROGRAMS)."""
    if fixed is not None:
        return min(V, fixed)
    bv = min(V, largest)
    while bv > STATE_MIN_BV and triton.cdiv(V, bv) * heads < STATE_MIN_PROGRAMS:
        bv //= 2
    return bv


# The products of the fp32 intra-chunk and state algebra for 16-bit inputs: "tf32" (tensor cores,
# 10-bit mantissa), "tf32x3" (three tf32 products, about fp32 accuracy) or "ieee" (fp32 FMA, slow).
# Measured on an H100 (2026-11-25, fla's test_chunk inputs, RMS error against fp64, ours / fla 0.6.0's
# on the same inputs, repro/kda/results/*-gpu-matrix.jsonl): with tf32 everywhere, bf16 errors equal
# fla's (the inputs' 2^-8 rounding dominates), but fp16 ones were 4-13x fla's once the gates are mild
# (normaliser 10: the chunk's triangular solve is ill-conditioned and amplifies the products'
# rounding), e.g. dh0 8.2e-3 vs 1.0e-3 and the final state 6.0e-3 vs 4.5e-4, over fla's tolerances.
# fp16's inputs round at 2^-11, as tf32 does: its products need more than tf32; bf16's do not.
DOT_PREC_BF16 = "tf32"
DOT_PREC_FP16 = "tf32x3"
DOT_PRECISIONS = ("tf32", "tf32x3", "ieee")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-precision dots (the tests compare against fp64 at ~1e-5)
    for name, value in (("DOT_PREC_BF16", DOT_PREC_BF16), ("DOT_PREC_FP16", DOT_PREC_FP16)):
        if value not in DOT_PRECISIONS:
            raise ValueError(
                f"chunk.{name} = {value!r}: expected one of {', '.join(map(repr, DOT_PRECISIONS))}"
            )
    if dtype == torch.float32:
        return "ieee"
    return DOT_PREC_FP16 if dtype == torch.float16 else DOT_PREC_BF16


def _block_v(V: int) -> int:
    return min(V, 64)


def _block_k(K: int) -> int:
    return min(K, INTRA_BK)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else dtype


def kda_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    decay_check: DecayCheck | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The three forward launches (four with INTRA_FWD_SPLIT); tensors as in
    :func:`repro.kda.chunk_kda`, contiguous. ``decay_check``: the first kernel also counts the
    log-decays out of range (:class:`DecayCheck`). ``chunk_offsets``: B = 1 holds chunk-aligned
    sequences (see :func:`_pack_chunk_aligned`), initial_state and the final state ``[N, HV, K, V]``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = triton.cdiv(T, BT)
    prec = _dot_precision(q.dtype)
    G, W, KD, U_prime, Aqk, gamma, T_ut, QG = _intra_fwd(q, k, v, g, beta, scale, prec, decay_check)
    h_all, U_new, hT = _state_fwd(
        W, U_prime, KD, gamma, initial_state, output_final_state, prec, chunk_offsets
    )
    o = torch.empty_like(v)
    BV = min(V, OUT_FWD_BV)
    kda_out_fwd_kernel[(NT, triton.cdiv(V, BV), B * HV)](
        q, G, QG, h_all, Aqk, U_new, o, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, DOT_PREC=prec, USE_QG=QG is not None, num_warps=OUT_FWD_WARPS,
    )  # fmt: skip
    saved = dict(G=G, W=W, KD=KD, gamma=gamma, Aqk=Aqk, T_ut=T_ut, h_all=h_all, U_new=U_new)
    return o, hT, saved


def _intra_fwd(q, k, v, g, beta, scale, prec, decay_check=None):
    """The intra-chunk launches of the forward: ``kda_intra_fwd_kernel`` alone (with the WY
    factors), or with INTRA_FWD_SPLIT that kernel without them followed by ``kda_wy_fwd_kernel``.
    Returns G, W, KD, U', A_qk, gamma, T and QG (``scale Q*exp(G)`` with INTRA_FWD_QG, else None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = triton.cdiv(T, BT)
    dev, dt = q.device, q.dtype
    G = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
    W = torch.empty(B, T, HV, K, device=dev, dtype=dt)
    KD = torch.empty(B, T, HV, K, device=dev, dtype=dt)
    U_prime = torch.empty(B, T, HV, V, device=dev, dtype=dt)
    Aqk = torch.empty(B, T, HV, BT, device=dev, dtype=dt)
    gamma = torch.empty(B, HV, NT, K, device=dev, dtype=torch.float32)
    T_ut = torch.empty(B, T, HV, BT, device=dev, dtype=torch.float32)
    QG = torch.empty(B, T, HV, K, device=dev, dtype=dt) if INTRA_FWD_QG else None
    KB = torch.empty(B, T, HV, K, device=dev, dtype=dt) if INTRA_FWD_KB and INTRA_FWD_SPLIT else None
    kda_intra_fwd_kernel[(NT, B * HV)](
        q, k, v, g, beta, G, W, U_prime, Aqk, KD, gamma, T_ut, QG, KB, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, SUB=SUB, LOG_SUB=LOG_SUB, LOG_NB=LOG_NB, BK=_block_k(K),
        BV=_block_v(V), DOT_PREC=prec, STRIPS=INTRA_FWD_STRIPS and BT == 4 * SUB, WY=not INTRA_FWD_SPLIT,
        STORE_QG=QG is not None, STORE_KB=KB is not None, FAST_EXP=INTRA_FWD_FAST_EXP and not interpreting(),
        g_bad=None if decay_check is None else decay_check.count, G_MIN=G_MIN,
        num_warps=INTRA_FWD_WARPS, num_stages=INTRA_FWD_STAGES,
    )  # fmt: skip
    if decay_check is not None:
        decay_check.counted()
    if INTRA_FWD_SPLIT:
        BK, BV = min(K, WY_FWD_BK), min(V, WY_FWD_BV)
        # the channel block is the fastest grid axis: a chunk's programs run side by side and
        # read its T from L2 rather than memory
        kda_wy_fwd_kernel[(K // BK + V // BV, NT, B * HV)](
            k, v, beta, G, KB, T_ut, W, U_prime, T,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC=prec, USE_KB=KB is not None,
            num_warps=WY_FWD_WARPS,
        )  # fmt: skip
    return G, W, KD, U_prime, Aqk, gamma, T_ut, QG


def _state_fwd(W, U_prime, KD, gamma, h0, output_final_state, prec, chunk_offsets=None):
    B, T, HV, K = W.shape
    V = U_prime.shape[-1]
    NT = gamma.shape[2]
    NS = B if chunk_offsets is None else chunk_offsets.numel() - 1  # states: per batch row or sequence
    h_all = torch.empty(B, HV, NT, K, V, device=W.device, dtype=_state_dtype(W.dtype))
    U_new = torch.empty_like(U_prime)
    hT = torch.empty(NS, HV, K, V, device=W.device, dtype=torch.float32) if output_final_state else None
    BV = _state_block_v(V, NS * HV, STATE_FWD_BV, 64)
    h0c = h0.float().contiguous() if h0 is not None else None
    grid = (triton.cdiv(V, BV), B * HV) + (() if chunk_offsets is None else (NS,))
    kda_state_fwd_kernel[grid](
        W, U_prime, KD, gamma, h0c, h_all, U_new, hT, T, NT,
        HV=HV, K=K, V=V, BT=BT, BV=BV, USE_H0=h0 is not None, STORE_FINAL=output_final_state,
        DOT_PREC=prec, num_warps=STATE_FWD_WARPS, chunk_offsets=chunk_offsets,
    )  # fmt: skip
    return h_all, U_new, hT


def _state_bwd(W, KD, gamma, h_all, U_new, dU_ext, dh_ext, dhT, prec):
    B, T, HV, K = W.shape
    V = U_new.shape[-1]
    NT = gamma.shape[2]
    f32 = dict(device=W.device, dtype=torch.float32)
    # zeros: V blocks add their parts of dW, dKD, dgamma atomically
    dW = torch.zeros(B, T, HV, K, **f32)
    dKD = torch.zeros(B, T, HV, K, **f32)
    dgamma = torch.zeros(B, HV, NT, K, **f32)
    dU_prime = torch.empty(B, T, HV, V, **f32)
    dh0 = torch.empty(B, HV, K, V, **f32)
    dhT_c = dhT.float().contiguous() if dhT is not None else None
    BV = min(V, 32)
    kda_state_bwd_kernel[(triton.cdiv(V, BV), B * HV)](
        W, KD, gamma, h_all, U_new, dU_ext, dh_ext, dhT_c, dW, dU_prime, dKD, dgamma, dh0, T, NT,
        HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=dhT is not None, DOT_PREC=prec, num_warps=4,
    )  # fmt: skip
    return dW, dKD, dU_prime, dgamma, dh0


class _StateRecurrence(torch.autograd.Function):
    """The inter-chunk recurrence as one differentiable op with Triton forward and backward.

    Inputs W, KD ``[B, T, HV, K]``, U_prime ``[B, T, HV, V]``, gamma ``[B, HV, NT, K]``, h0
    ``[B, HV, K, V]`` (T a multiple of the chunk size). Outputs the incoming state of every
    chunk ``[B, HV, NT, K, V]``, the pseudo-values U ``[B, T, HV, V]`` and the final state.
    """

    @staticmethod
    def forward(ctx, W, U_prime, KD, gamma, h0):
        prec = _dot_precision(W.dtype)
        h_all, U_new, hT = _state_fwd(W, U_prime, KD, gamma, h0, True, prec)
        ctx.save_for_backward(W, KD, gamma, h_all, U_new)
        ctx.has_h0 = h0 is not None
        ctx.prec = prec
        return h_all, U_new, hT

    @staticmethod
    def backward(ctx, dh_all, dU_new, dhT):
        W, KD, gamma, h_all, U_new = ctx.saved_tensors
        B, T, HV, K = W.shape
        V = U_new.shape[-1]
        NT = gamma.shape[2]
        f32 = dict(device=W.device, dtype=torch.float32)
        dh_all = torch.zeros(B, HV, NT, K, V, **f32) if dh_all is None else dh_all.float().contiguous()
        dU_new = torch.zeros(B, T, HV, V, **f32) if dU_new is None else dU_new.float().contiguous()
        dW, dKD, dU_prime, dgamma, dh0 = _state_bwd(W, KD, gamma, h_all, U_new, dU_new, dh_all, dhT, ctx.prec)
        return dW, dU_prime, dKD, dgamma, (dh0 if ctx.has_h0 else None)


def _to_chunks(x: torch.Tensor, N: int) -> torch.Tensor:
    """[B, Tpad, HV, D] -> [B, HV, N, C, D] (a view where possible)."""
    B, Tp, HV, D = x.shape
    return x.reshape(B, N, BT, HV, D).permute(0, 3, 1, 2, 4)


def _from_chunks(x: torch.Tensor) -> torch.Tensor:
    """[B, HV, N, C, D] -> [B, N*C, HV, D], contiguous."""
    B, HV, N, C, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, HV, D).contiguous()


def _kda_differentiable(q, k, v, g, beta, scale, h0, T_fwd):
    """The chunkwise forward again, as PyTorch ops around :class:`_StateRecurrence` (fp32)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    N = triton.cdiv(T, BT)
    pad = N * BT - T
    group = HV // H

    def prep(x):
        return F.pad(x.float(), (0, 0, 0, 0, 0, pad))

    qp = prep(q.repeat_interleave(group, dim=2))
    kp = prep(k.repeat_interleave(group, dim=2))
    vp, gp = prep(v), prep(g)
    bp = F.pad(beta.float(), (0, 0, 0, pad))
    qc, kc, vc, gc = (_to_chunks(x, N) for x in (qp, kp, vp, gp))
    bc = bp.reshape(B, N, BT, HV).permute(0, 3, 1, 2)  # [B, HV, N, C]

    G = gc.cumsum(dim=-2)
    A_kk, A_qk = chunk_matrices(qc, kc, G, bc, scale)
    # the forward kernel's UT transform, reused; _UTInverse supplies its gradient
    T_saved = _to_chunks(F.pad(T_fwd, (0, 0, 0, 0, 0, pad)), N)
    T_ut = _UTInverse.apply(A_kk, T_saved)
    eG = torch.exp(G)
    W = T_ut @ (bc.unsqueeze(-1) * kc * eG)
    U_prime = T_ut @ (bc.unsqueeze(-1) * vc)
    G_last = G[..., -1:, :]
    KD = kc * torch.exp(G_last - G)
    gamma = torch.exp(G_last).squeeze(-2)  # [B, HV, N, K]

    dt = q.dtype
    h_all, U_new, hT = _StateRecurrence.apply(
        _from_chunks(W).to(dt), _from_chunks(U_prime).to(dt), _from_chunks(KD).to(dt), gamma.contiguous(), h0
    )
    Uc = _to_chunks(U_new.float(), N)
    o = (qc * eG * scale) @ h_all.float() + A_qk @ Uc
    o = _from_chunks(o)[:, :T]
    return o, hT


class _UTInverse(torch.autograd.Function):
    """T = (I + A)^{-1} for strictly lower A, with T supplied (from the forward kernel).

    Gradient: dT = -T dA T, so dA = -T^T dT T^T, kept strictly lower (A's structure).
    """

    @staticmethod
    def forward(ctx, A, T_ut):
        ctx.save_for_backward(T_ut)
        return T_ut.clone()

    @staticmethod
    def backward(ctx, dT):
        (T_ut,) = ctx.saved_tensors
        Tt = T_ut.transpose(-1, -2)
        return -(Tt @ dT @ Tt).tril(-1), None


def kda_bwd_triton(q, k, v, g, beta, scale, h0, saved, do, dhT):
    """The backward pass in three Triton launches: readout, reverse state recurrence, intra-chunk."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = triton.cdiv(T, BT)
    prec = _dot_precision(q.dtype)
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous()
    dU_ext = torch.empty(B, T, HV, V, **f32)
    dh_ext = torch.empty(B, HV, NT, K, V, **f32)
    BV = _block_v(V)
    kda_out_bwd_kernel[(NT, triton.cdiv(V, BV), B * HV)](
        q, saved["G"], saved["Aqk"], do, dU_ext, dh_ext, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, DOT_PREC=prec, num_warps=4,
    )  # fmt: skip
    dW, dKD, dU_prime, dgamma, dh0 = _state_bwd(
        saved["W"], saved["KD"], saved["gamma"], saved["h_all"], saved["U_new"], dU_ext, dh_ext, dhT, prec
    )
    dq = torch.empty(B, T, HV, K, **f32)
    dk = torch.empty(B, T, HV, K, **f32)
    dg = torch.empty(B, T, HV, K, **f32)
    dv = torch.empty(B, T, HV, V, **f32)
    dbeta = torch.empty(B, T, HV, **f32)
    kda_intra_bwd_kernel[(NT, B * HV)](
        q, k, v, beta, saved["G"], saved["T_ut"], saved["U_new"], saved["h_all"], do,
        dW, dU_prime, dKD, dgamma, dq, dk, dv, dg, dbeta, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, SUB=SUB, DOT_PREC=prec, num_warps=8,
    )  # fmt: skip
    group = HV // H
    # value heads that share a key head add their gradients into it
    dq = dq.view(B, T, H, group, K).sum(3)
    dk = dk.view(B, T, H, group, K).sum(3)
    return (
        dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
        dh0.to(h0.dtype) if h0 is not None else None,
    )  # fmt: skip


def _state_bwd_fused(q, saved, do, dhT, scale, prec, chunk_offsets=None):
    """The reverse state recurrence with the readout's gradient folded in: dU (= dU'), the
    gradient reaching each chunk's outgoing state, dh0 (per sequence with ``chunk_offsets``)."""
    B, T, H, K = q.shape
    HV, NT = saved["W"].shape[2], saved["gamma"].shape[2]
    V = saved["U_new"].shape[-1]
    NS = B if chunk_offsets is None else chunk_offsets.numel() - 1
    f32 = dict(device=q.device, dtype=torch.float32)
    dU = torch.empty(B, T, HV, V, **f32)
    dh_all = torch.empty_like(saved["h_all"])
    dh0 = torch.empty(NS, HV, K, V, **f32)
    dhT_c = dhT.float().contiguous() if dhT is not None else None
    BVs = _state_block_v(V, NS * HV, STATE_BWD_BV, STATE_BWD_LARGEST_BV)
    grid = (triton.cdiv(V, BVs), B * HV) + (() if chunk_offsets is None else (NS,))
    kda_state_bwd_fused_kernel[grid](
        q, saved["G"], saved["Aqk"], saved["W"], saved["KD"], saved["gamma"], do, dhT_c, dU, dh_all, dh0,
        scale, T, NT, H=H, HV=HV, K=K, V=V, BT=BT, BV=BVs, USE_DHT=dhT is not None, DOT_PREC=prec,
        num_warps=_state_bwd_warps(BVs), chunk_offsets=chunk_offsets,
    )  # fmt: skip
    return dU, dh_all, dh0


def kda_bwd_triton_split(q, k, v, g, beta, scale, h0, saved, do, dhT, chunk_offsets=None):
    """The backward pass in three Triton launches (and one small sum): the reverse state
    recurrence, the chunks' ``[BT, BT]`` gradients (kernel A), the per-channel gradients by blocks
    of key channels (kernel B)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = triton.cdiv(T, BT)
    if BT != 4 * SUB:
        raise ValueError(
            f"BACKWARD='split' reads dA and M_q in four column strips: needs BT = 4 * SUB, got {BT}, {SUB}"
        )
    prec = _dot_precision(q.dtype)
    low = SPLIT_BF16_DOTS and q.dtype != torch.float32  # never for fp32 inputs
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous()
    dU, dh_all, dh0 = _state_bwd_fused(q, saved, do, dhT, scale, prec, chunk_offsets)
    BKB = min(K, SPLIT_BKB)
    NKB = K // BKB  # K and SPLIT_BKB are powers of two (check_kda_inputs): no remainder
    # fp32, one contiguous [BT, BT] block per (b, hv, chunk): written by kernel A, read by kernel B
    M_q = torch.empty(B, HV, NT, BT, BT, **f32)
    dA = torch.empty(B, HV, NT, BT, BT, **f32)
    # dbeta is a sum over value channels (kernel A) and over key channels (each program of kernel
    # B): each writes its own slot and they are summed below, rather than added atomically, so the
    # result does not depend on the order the programs run in (deterministic), and the extra
    # buffer is small ((1 + K/BKB) x B x T x HV fp32: 9 MiB at B=8, T=2048, HV=16, K=128, BKB=16)
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
        H=H, HV=HV, K=K, V=V, BT=BT, BK=min(K, SPLIT_A_BK), BV=min(V, SPLIT_A_BV), DOT_PREC=prec,
        LOW_DOTS=low, num_warps=SPLIT_A_WARPS, num_stages=SPLIT_A_STAGES,
    )  # fmt: skip
    # the key block is the fastest grid axis: a chunk's NKB programs run side by side and read its
    # tiles of dU, U, dO, T, M_q, dA from L2 rather than memory
    kda_intra_bwd_split_dqk_kernel[(NKB, NT, B * HV)](
        q, k, beta, saved["G"], saved["T_ut"], saved["U_new"], saved["h_all"], dh_all, do, dU,
        M_q, dA, dq, dk, dg, dbeta_parts, scale, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, SUB=SUB, BK=BKB, BV=min(V, SPLIT_B_BV), DOT_PREC=prec,
        LOW_DOTS=low, FAST_EXP=SPLIT_FAST_EXP and not interpreting(), num_warps=SPLIT_B_WARPS,
        num_stages=SPLIT_B_STAGES,
    )  # fmt: skip
    dbeta = dbeta_parts.sum(0).to(beta.dtype)
    if group > 1:
        dq = dq.view(B, T, H, group, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, group, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg, dbeta, dh0.to(h0.dtype) if h0 is not None else None


# "split": the fused state kernel then two intra-chunk kernels with more, smaller programs
# (kda_bwd_triton_split), the fastest measured (module docstring). "triton": three launches
# (kda_bwd_triton), the first all-Triton backward.
# "torch": PyTorch autograd over a recomputation plus the Triton state-recurrence backward (the
# first version; a second, independent backward).
BACKWARD = "split"
_TRITON_BACKWARDS = {"triton": kda_bwd_triton, "split": kda_bwd_triton_split}


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, scale, initial_state, output_final_state, decay_check=None, chunk_offsets=None
    ):
        o, hT, saved = kda_fwd_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, decay_check, chunk_offsets
        )
        ctx.chunk_offsets = chunk_offsets
        ctx.names = list(saved)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *saved.values())
        ctx.scale = scale
        ctx.output_final_state = output_final_state
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, g, beta, h0, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.names, rest, strict=True))
        if not ctx.output_final_state:
            dhT = None
        if ctx.chunk_offsets is not None:  # chunk-aligned sequences: the split backward only
            if BACKWARD != "split":
                raise ValueError(
                    f"chunk_kda with cu_seqlens ran its forward for BACKWARD='split' (chunk-aligned "
                    f"sequences); chunk.BACKWARD is now {BACKWARD!r}: set it before the forward"
                )
            grads = kda_bwd_triton_split(q, k, v, g, beta, ctx.scale, h0, saved, do, dhT, ctx.chunk_offsets)
            return *grads[:5], None, grads[5], None, None, None
        if BACKWARD in _TRITON_BACKWARDS:
            grads = _TRITON_BACKWARDS[BACKWARD](q, k, v, g, beta, ctx.scale, h0, saved, do, dhT)
            return *grads[:5], None, grads[5], None, None, None
        if BACKWARD != "torch":
            raise ValueError(
                f"chunk.BACKWARD = {BACKWARD!r}: expected one of {[*_TRITON_BACKWARDS, 'torch']}"
            )
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
            h0_leaf = h0.detach().float().requires_grad_(True) if h0 is not None else None
            o, hT = _kda_differentiable(*leaves, ctx.scale, h0_leaf, saved["T_ut"])
            outputs, grads = [o], [do]
            if dhT is not None:
                outputs.append(hT)
                grads.append(dhT)
            inputs = leaves + ([h0_leaf] if h0_leaf is not None else [])
            grad_inputs = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        dq, dk, dv, dg, dbeta = grad_inputs[:5]
        dh0 = grad_inputs[5].to(h0.dtype) if h0 is not None else None
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA with Triton kernels (forward fused, backward see module docstring).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g ``[B, T, HV, K]`` the
    log-decay (``alpha = exp(g)``, exact for ``-10 <= g <= 0``); beta ``[B, T, HV]`` in [0, 1];
    initial_state ``[B, HV, K, V]``; scale defaults to ``K ** -0.5``. Any T.
    Returns o ``[B, T, HV, V]`` (v's dtype) and the final state ``[B, HV, K, V]`` (fp32) or None.
    dtypes float32, bfloat16 or float16. K and V up to 128: the kernels are written for 16, 32,
    64 and 128, and other sizes (fla's tests use 60 and 100) are zero-padded up to the next one
    (padded key channels have k = q = 0 and g = 0, so they never touch the state; padded value
    channels are sliced off), at the cost of the padded size's time.

    ``cu_seqlens`` (int ``[N + 1]``, offsets ``0 = c_0 < c_1 < ... < c_N = T``): N sequences of
    different lengths packed along T with B = 1, as flash-linear-attention takes them; each
    sequence starts from its own initial state (``[N, HV, K, V]``) and has its own final state.
    They run as a padded batch ``[N, max length]`` whose padding tokens have k = v = g = beta = 0,
    which leave the state exactly as it is: the time of N x max length tokens.
    """
    B, T = q.shape[:2] if q.dim() == 4 else (None, None)
    check_kda_inputs(
        q, k, v, g, beta, initial_state if cu_seqlens is None else None, "chunk_kda", triton=True,
        pad_heads=True,
    )  # fmt: skip
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    decay_check = DecayCheck(g, "chunk_kda") if CHECK_DECAY_RANGE and g.numel() else None
    scale = K**-0.5 if scale is None else float(scale)
    mask = dest = chunk_offsets = None
    if cu_seqlens is not None:
        lengths = check_cu_seqlens(cu_seqlens, T, B, initial_state, HV, K, V, "chunk_kda")
        if VARLEN_CHUNK_ALIGNED and BACKWARD == "split":
            dest, chunk_offsets, rows = _chunk_aligned_layout(lengths, q.device)
            q, k, v, g, beta = (_pack_chunk_aligned(x, dest, rows) for x in (q, k, v, g, beta))
        else:
            # token j of sequence i goes to row i, column j; row-major order of the mask is the packed order
            steps = torch.arange(max(lengths), device=q.device)
            mask = steps[None, :] < torch.tensor(lengths, device=q.device)[:, None]
            q, k, v, g, beta = (_pack(x, mask) for x in (q, k, v, g, beta))
    Kp, Vp = _kernel_dim(K), _kernel_dim(V)
    if Kp != K:
        q, k, g = (F.pad(x, (0, Kp - K)) for x in (q, k, g))
    if Vp != V:
        v = F.pad(v, (0, Vp - V))
    if initial_state is not None and (Kp, Vp) != (K, V):
        initial_state = F.pad(initial_state, (0, Vp - V, 0, Kp - K))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, hT = ChunkKDAFunction.apply(
        q, k, v, g, beta, scale, initial_state, output_final_state, decay_check, chunk_offsets
    )
    if decay_check is not None:
        decay_check.raise_if_bad()
    if Vp != V:
        o = o[..., :V]
    if hT is not None and (Kp, Vp) != (K, V):
        hT = hT[:, :, :K, :V]
    if mask is not None:
        o = o[mask].unsqueeze(0)
    if dest is not None:
        o = o[:, dest]
    return o, hT


# The kernels factor exp(G_r - G_c) inside a chunk as exp(G_r - G_a) exp(G_a - G_c) around an anchor
# row, in fp32: a per-token log-decay below -10 overflows those factors (g = -12 already gives inf on
# the CPU interpreter; fla's test case with gate_logit_normalizer 0.1, g down to about -40, gave inf
# on an H100). flash-linear-attention accepts such gates; we refuse them rather than return inf.
G_MIN = -10.0


#: chunk_kda checks every log-decay against [G_MIN, 0] (DecayCheck: counted by the forward's first
#: kernel, read back before chunk_kda returns). Set False to skip it where the gates are bounded by
#: construction. The first form of the check (torch.aminmax over g before the kernels, then a
#: device-to-host copy) cost 0.31 ms of 1.29 ms in the forward at B=8, T=2048 and 0.57 of 5.0 ms at
#: T=64k on an H100 (bench --tune, 2026-11-25): a pass over g and a synchronisation that left the GPU
#: idle while the host launched the forward's kernels.
CHECK_DECAY_RANGE = True


class DecayCheck:
    """chunk_kda's range check of g without a pass or a stall of its own: ``kda_intra_fwd_kernel``
    adds the number of out-of-range log-decays to ``count``; right after that launch ``counted``
    queues a copy of the count to pinned host memory and records an event; ``raise_if_bad``, called
    once every forward kernel is queued, waits for that event only (the GPU goes on with the rest
    of the forward meanwhile) and raises :func:`check_decay_range`'s error (exact min and max) if
    any value was out of range. The outputs of such a call are never returned."""

    def __init__(self, g: torch.Tensor, fn: str):
        self.g, self.fn = g, fn
        self.count = torch.zeros(1, dtype=torch.int32, device=g.device)
        self._host: torch.Tensor | None = None
        self._event = None

    def counted(self) -> None:
        if self.count.is_cuda:
            self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._host.copy_(self.count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def raise_if_bad(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            n_bad = int(self._host[0])
        else:
            n_bad = int(self.count[0])
        if n_bad:
            check_decay_range(self.g, self.fn)  # raises, naming the range found
            raise ValueError(f"{self.fn}: {n_bad} log-decays of g outside [{G_MIN:g}, 0] or NaN")


def check_decay_range(g: torch.Tensor, fn: str) -> None:
    """Raise unless every log-decay is in ``[G_MIN, 0]`` (NaN fails too). One reduction and one
    device-to-host copy per call: microseconds beside the kernels, but a synchronisation."""
    if g.numel() == 0:
        return
    lo, hi = torch.aminmax(g.detach())
    lo, hi = float(lo), float(hi)
    if not (lo >= G_MIN and hi <= 0.0):
        raise ValueError(
            f"{fn}: g (log-decay, g.shape {tuple(g.shape)}) must lie in [{G_MIN:g}, 0] per token and channel "
            f"for the Triton kernels (alpha = exp(g) in [4.5e-5, 1]); got min {lo:.4g}, max {hi:.4g}. "
            "Clamp stronger decays (alpha < 4.5e-5 forgets within a token anyway), or use recurrent_kda"
        )


def _kernel_dim(d: int) -> int:
    """The smallest head size the kernels are written for that holds ``d`` channels."""
    return next(s for s in TRITON_K if s >= d)


#: cu_seqlens with the split backward (the default): the sequences are laid out one after another in
#: one row, each starting at a chunk boundary (at most BT - 1 zero tokens after each), and the two
#: state kernels run one program per (value block, head, sequence) over that sequence's chunks: the
#: time of about the packed tokens. False, or another backward: a padded batch [N, max length] (the
#: time of N x the longest sequence; 2.2x fla's varlen time on the benchmark's mix, H100 2026-11-25).
VARLEN_CHUNK_ALIGNED = True


def _chunk_aligned_layout(lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For sequences of ``lengths``: where each packed token goes in the chunk-aligned row
    (``dest``, int64 ``[sum(lengths)]``), each sequence's first chunk (int32 ``[N + 1]``, the last
    entry the number of chunks) and the row's length in tokens."""
    chunks = [-(-n // BT) for n in lengths]
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c)
    dest = torch.cat([torch.arange(n) + BT * c0 for n, c0 in zip(lengths, offsets, strict=False)])
    return dest.to(device), torch.tensor(offsets, dtype=torch.int32, device=device), BT * offsets[-1]


def _pack_chunk_aligned(x: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """``[1, T, ...]`` packed sequences -> ``[1, BT x chunks, ...]``, each sequence from a chunk
    boundary, zeros in between (k = v = g = beta = 0 there: the state passes through unchanged)."""
    out = x.new_zeros(1, rows, *x.shape[2:])
    out[:, dest] = x
    return out


def _pack(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[1, T, ...]`` packed sequences -> ``[N, max length, ...]``, zeros after each sequence's end."""
    out = x.new_zeros(*mask.shape, *x.shape[2:])
    out[mask] = x[0]
    return out


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One generated token: updates ``state`` in place and returns o ``[B, 1, HV, V]``.

    q, k ``[B, 1, H, K]``; v ``[B, 1, HV, V]``; g ``[B, 1, HV, K]``; beta ``[B, 1, HV]``;
    state ``[B, HV, K, V]`` float32 (the cache: its size does not depend on how many tokens
    came before). Forward only (inference).
    """
    dims = check_kda_inputs(q, k, v, g, beta, state, "decode_step", triton=True)
    if dims.T != 1:
        raise ValueError(
            f"decode_step: takes one token, got T={dims.T} (q.shape[1]); use chunk_kda for prefill"
        )
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"decode_step: state must be a contiguous float32 tensor, got {state.dtype}")
    scale = dims.K**-0.5 if scale is None else float(scale)
    o = torch.empty_like(v)
    BV = _block_v(dims.V)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    kda_decode_kernel[(triton.cdiv(dims.V, BV), dims.B * dims.HV)](
        q, k, v, g, beta, state, o, scale, H=dims.H, HV=dims.HV, K=dims.K, V=dims.V, BV=BV, num_warps=4
    )
    return o
