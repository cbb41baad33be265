"""The output of each chunk (kimiteam2025kimilinear §3.1; chunk_torch.py, step 5), every chunk in
parallel once the state recurrence has stored the states entering the chunks:

    O = scale (Q * exp(G)) S_n + A_qk U,

the decayed queries against the incoming state plus the intra-chunk part through the pseudo-values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.tiles import BT, _head_bases, _load_rows, _tile

# One program per chunk, value block and head. 128 value channels read the left factor QG (stored
# by the intra-chunk kernel) once: forward 0.978 against 0.987 ms at 64 (H100, bf16, B=8, T=2048,
# 2026-11-23); with 8 warps 1.001.
OUT_BV = 128
OUT_WARPS = 4  # offline sm_90a, 2026-11-27 (bf16, K = V = 128): 128 registers, 48 KiB shared, no spills


@triton.jit(do_not_specialize=["T", "NT"])
def kda_out_fwd_kernel(
    QG,
    h_all,
    Aqk,
    U_new,
    o,
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
    """O = QG S_n + A_qk U for one chunk and one value block, with the left factor
    ``QG = scale Q*exp(G)`` read from memory (``[B, T, HV, K]``, the inputs' dtype, stored by the
    intra-chunk kernel: half the bytes of Q and the fp32 G, read once per value block)."""
    i_t = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2)
    b, hv, q_base, k_base, v_base, c_base = _head_bases(i_bh, T, H, HV, K, V, BT)
    r0 = i_t * BT
    b_qg = _load_rows(QG + k_base, T, HV * K, K, r0, 0, BT, K)
    b_h = tl.load(_tile(h_all + (i_bh * NT + i_t) * K * V, K, V, V, 0, i_v * BV, K, BV))
    b_o = tl.dot(b_qg, b_h.to(b_qg.dtype), input_precision=DOT_PREC)
    b_A = _load_rows(Aqk + c_base, T, HV * BT, BT, r0, 0, BT, BT)
    b_u = _load_rows(U_new + v_base, T, HV * V, V, r0, i_v * BV, BT, BV)
    b_o += tl.dot(b_A.to(b_u.dtype), b_u, input_precision=DOT_PREC)
    tl.store(
        _tile(o + v_base, T, HV * V, V, r0, i_v * BV, BT, BV), b_o.to(o.dtype.element_ty), boundary_check=(0,)
    )


def output_fwd(
    QG: torch.Tensor,
    h_all: torch.Tensor,
    Aqk: torch.Tensor,
    U_new: torch.Tensor,
    H: int,
    prec: str,
    *,
    block_v: int = OUT_BV,
    warps: int = OUT_WARPS,
) -> torch.Tensor:
    """o ``[B, T, HV, V]`` (U's dtype) from QG ``[B, T, HV, K]``, the incoming states h_all
    ``[B, HV, NT, K, V]``, A_qk ``[B, T, HV, BT]`` and U ``[B, T, HV, V]``; H key heads."""
    B, T, HV, K = QG.shape
    V = U_new.shape[-1]
    NT = h_all.shape[2]
    o = torch.empty_like(U_new)
    BV = min(V, block_v)
    kda_out_fwd_kernel[(NT, triton.cdiv(V, BV), B * HV)](
        QG, h_all, Aqk, U_new, o, T, NT,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, DOT_PREC=prec, num_warps=warps,
    )  # fmt: skip
    return o
