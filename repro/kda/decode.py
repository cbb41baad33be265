"""One generated token: the KDA recurrence of kimiteam2025kimilinear §3 as an RNN step on the
carried fp32 state (inference; fla's ``fused_recurrent``), after a prefill by chunk_kda.

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,     o_t = scale S_t^T q_t
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.kda.validate import check_kda_inputs, check_kernel_device

# One program per (value block, b*HV), the [K, BV] state block in registers; 64 value channels and
# 4 warps (not tuned: the step reads and writes the state once, a few microseconds)
DECODE_BV = 64
DECODE_WARPS = 4


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
    # head sizes up to 128: the step has not been compiled or run at 256
    dims = check_kda_inputs(q, k, v, g, beta, state, "decode_step", triton=True, max_head=128)
    if dims.T != 1:
        raise ValueError(
            f"decode_step: takes one token, got T={dims.T} (q.shape[1]); use chunk_kda for prefill"
        )
    check_kernel_device(q, "decode_step")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"decode_step: state must be a contiguous float32 tensor, got {state.dtype}")
    scale = dims.K**-0.5 if scale is None else float(scale)
    o = torch.empty_like(v)
    BV = min(dims.V, DECODE_BV)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    kda_decode_kernel[(triton.cdiv(dims.V, BV), dims.B * dims.HV)](
        q, k, v, g, beta, state, o, scale, H=dims.H, HV=dims.HV, K=dims.K, V=dims.V, BV=BV,
        num_warps=DECODE_WARPS,
    )  # fmt: skip
    return o
