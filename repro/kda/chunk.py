"""chunk_kda: the chunkwise algorithm of kimiteam2025kimilinear §3.1 on Triton, as one
differentiable function. This file only composes the stages; each stage's kernels, launchers and
block sizes are in the file named after it:

forward, four launches, no PyTorch math on the hot path:

1. intra_chunk.py: every chunk in parallel: cumulative decay G, the decayed key products
   A_kk and A_qk, the UT transform T = (I + A_kk)^{-1} (wy_ut.py), and the decay factors;
2. wy_ut.py: the WY factors W = T Diag(beta)(K*exp(G)), U' = T Diag(beta) V;
3. inter_chunk.py: the state recurrence, chunk after chunk (the only sequential part);
4. output.py: O = scale (Q*exp(G)) S_n + A_qk U, every chunk in parallel.

It saves what the backward needs (G, T, W, KD, A_qk, gamma, the states entering each chunk, the
pseudo-values U): no recomputation. Backward, three launches and one small sum:
backward_inter_chunk.py (the state recurrence in reverse, with the output's gradient folded in),
then backward_intra_chunk.py (the chunk's [BT, BT] gradients, then dq, dk, dg by key blocks).

Measured on an H100 (bf16, B=8, T=2048, H=16, K=V=128, median of 3 interleaved rounds, one process
with fla 0.6.0, 2026-11-23): forward 0.991 ms and forward + backward 4.799 ms against
flash-linear-attention's chunk_kda at 1.068 and 5.457 ms (results/nvidia-h100-80gb-hbm3.json:
every T from 2k to 64k). The kernel choices are one :class:`~repro.kda.config.KDAConfig`.

Log-decays below -10 (which the kernels' factored exponentials cannot take) are clamped to -10:
the first kernel counts them, and the forward runs again on the clamped g (gate.py: the error bound,
and why no kernel changed). Head sizes above 128, up to 256, are the same kernels specialised at
256 (two state value blocks chosen for it), on by default since fla's test matrix at 192 and 256 passed on an H200 (28 Nov 2026).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from paperclub.triton_compat import interpreting
from repro.kda.backward_inter_chunk import inter_chunk_bwd
from repro.kda.backward_intra_chunk import intra_chunk_bwd
from repro.kda.config import DEFAULT, KDAConfig
from repro.kda.gate import DecayCheck, check_decay_sign, clamp_decay
from repro.kda.inter_chunk import inter_chunk_fwd
from repro.kda.intra_chunk import intra_chunk_fwd
from repro.kda.output import output_fwd
from repro.kda.tiles import BT
from repro.kda.validate import TRITON_K, check_cu_seqlens, check_kda_inputs, check_kernel_device
from repro.kda.wy_ut import wy_fwd


def kda_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    config: KDAConfig = DEFAULT,
    decay_check: DecayCheck | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The four forward launches; tensors as in :func:`chunk_kda`, contiguous, head sizes the
    kernels' own. ``decay_check``: the first kernel also counts the log-decays out of range
    (:class:`~repro.kda.gate.DecayCheck`). ``chunk_offsets``: B = 1 holds chunk-aligned sequences
    (:func:`_pack_chunk_aligned`), initial_state and the final state ``[N, HV, K, V]``. Returns o,
    the final state or None, and the tensors the backward needs."""
    H, HV, V = q.shape[2], v.shape[2], v.shape[3]
    config = config.for_launch(q.shape[3], q.dtype)  # the split state launch at K = 256 (config.py)
    prec = config.dot_precision(q.dtype)
    fast_exp = not interpreting()
    intra = intra_chunk_fwd(
        q, k, g, beta, HV, V, scale, prec, fast_exp, None if decay_check is None else decay_check.count,
        block_k=config.intra_bk, warps=config.intra_warps, stages=config.intra_stages,
    )  # fmt: skip
    if decay_check is not None:
        decay_check.counted()
    W, U_prime = wy_fwd(
        v, beta, intra["KB"], intra["T_ut"], H, prec,
        block_k=config.wy_bk, block_v=config.wy_bv, warps=config.wy_warps,
    )  # fmt: skip
    h_all, U_new, hT = inter_chunk_fwd(
        W, U_prime, intra["KD"], intra["gamma"], initial_state, output_final_state, prec, chunk_offsets,
        block_v=config.state_fwd_bv, warps=config.state_fwd_warps, block_k=config.state_fwd_bk,
        stages=config.state_fwd_stages,
    )  # fmt: skip
    o = output_fwd(
        intra["QG"], h_all, intra["Aqk"], U_new, H, prec, block_v=config.out_bv, warps=config.out_warps
    )
    saved = dict(G=intra["G"], W=W, KD=intra["KD"], gamma=intra["gamma"], Aqk=intra["Aqk"])
    saved.update(T_ut=intra["T_ut"], h_all=h_all, U_new=U_new)
    return o, hT, saved


def kda_bwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    h0: torch.Tensor | None,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    dhT: torch.Tensor | None,
    config: KDAConfig = DEFAULT,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The backward launches: dq, dk, dv, dg, dbeta and dh0 (None without an initial state)."""
    config = config.for_launch(q.shape[3], q.dtype)
    prec = config.dot_precision(q.dtype)
    do = do.contiguous()
    dU, dh_all, dh0 = inter_chunk_bwd(
        q,
        saved,
        do,
        dhT,
        scale,
        prec,
        chunk_offsets,
        block_v=config.state_bwd_bv,
        warps=config.state_bwd_warps,
        block_k=config.state_bwd_bk,
        stages=config.state_bwd_stages,
    )
    grads = intra_chunk_bwd(
        q, k, v, g, beta, scale, saved, do, dU, dh_all, prec, not interpreting(),
        mat_bk=config.bwd_mat_bk, mat_bv=config.bwd_mat_bv, mat_warps=config.bwd_mat_warps,
        mat_stages=config.bwd_mat_stages, dqk_bk=config.bwd_dqk_bk, dqk_bv=config.bwd_dqk_bv,
        dqk_warps=config.bwd_dqk_warps, dqk_stages=config.bwd_dqk_stages,
    )  # fmt: skip
    return *grads, dh0.to(h0.dtype) if h0 is not None else None


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, scale, initial_state, output_final_state, config, decay_check, chunk_offsets
    ):
        o, hT, saved = kda_fwd_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, config, decay_check, chunk_offsets
        )
        ctx.chunk_offsets = chunk_offsets
        ctx.config = config  # the backward runs with the forward's choices
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
        dq, dk, dv, dg, dbeta, dh0 = kda_bwd_triton(
            q, k, v, g, beta, ctx.scale, h0, saved, do, dhT, ctx.config, ctx.chunk_offsets
        )
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None


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
    *,
    config: KDAConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA with Triton kernels, differentiable (module docstring).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g ``[B, T, HV, K]`` the
    log-decay, any ``g <= 0`` (``alpha = exp(g)``; exact for ``-10 <= g <= 0``, below -10 clamped
    to -10: error bound in gate.py); beta ``[B, T, HV]`` in [0, 1]; initial_state ``[B, HV, K, V]``;
    scale defaults to ``K ** -0.5``. Any T. Returns o ``[B, T, HV, V]`` (v's dtype) and the final
    state ``[B, HV, K, V]`` (fp32) or None. dtypes float32, bfloat16 or float16 (q, k, v one dtype;
    g, beta and the initial state each any of them); any strides (made contiguous here); all on one
    CUDA device (or CPU tensors under Triton's interpreter). K and V up to 256: the kernels are
    written for 16, 32, 64, 128 and 256, and other sizes (fla's tests use 60 and 100) are
    zero-padded up to the next one (padded key channels have k = q = 0 and g = 0, so they never
    touch the state; padded value channels are sliced off), at the cost of the padded size's time.

    ``cu_seqlens`` (int ``[N + 1]``, offsets ``0 = c_0 < c_1 < ... < c_N = T``): N sequences of
    different lengths packed along T with B = 1, as flash-linear-attention takes them; each
    sequence starts from its own initial state (``[N, HV, K, V]``) and has its own final state.
    They are laid out one after another in one row, each from a chunk boundary (at most BT - 1 zero
    tokens after each, with k = v = g = beta = 0, which leave the state exactly as it is), and the
    two state kernels run one program per (value block, head, sequence) over that sequence's
    chunks: the time of about the packed tokens. (A padded batch ``[N, longest]`` took 2.2x fla's
    varlen time on the benchmark's mix, H100 2026-11-25, results/*-seqlens-16384-8192-32768-65536.json.)

    ``config``: the kernel choices (:class:`~repro.kda.config.KDAConfig`; default the tuned ones).
    """
    config = DEFAULT if config is None else config
    if not isinstance(config, KDAConfig):
        raise ValueError(f"chunk_kda: config must be a repro.kda.KDAConfig, got {type(config).__name__}")
    B, T = q.shape[:2] if q.dim() == 4 else (None, None)
    g_in = g
    check_kda_inputs(
        q, k, v, g, beta, initial_state if cu_seqlens is None else None, "chunk_kda", triton=True,
        pad_heads=True,
    )  # fmt: skip
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    check_kernel_device(q, "chunk_kda")
    scale = K**-0.5 if scale is None else float(scale)
    dest = chunk_offsets = None
    if cu_seqlens is not None:
        lengths = check_cu_seqlens(cu_seqlens, T, B, initial_state, HV, K, V, "chunk_kda")
        dest, chunk_offsets, rows = _chunk_aligned_layout(lengths, q.device)
        q, k, v, g, beta = (_pack_chunk_aligned(x, dest, rows) for x in (q, k, v, g, beta))
    Kp, Vp = _kernel_dim(K), _kernel_dim(V)
    if Kp != K:
        q, k, g = (F.pad(x, (0, Kp - K)) for x in (q, k, g))
    if Vp != V:
        v = F.pad(v, (0, Vp - V))
    if initial_state is not None and (Kp, Vp) != (K, V):
        initial_state = F.pad(initial_state, (0, Vp - V, 0, Kp - K))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if config.clamp_decay_first:
        g = clamp_decay(g)
    # the intra-chunk kernel counts the log-decays outside [G_MIN, 0] (gate.DecayCheck)
    decay_check = DecayCheck(g, "chunk_kda") if config.check_decay_range and g.numel() else None
    o, hT = ChunkKDAFunction.apply(
        q, k, v, g, beta, scale, initial_state, output_final_state, config, decay_check, chunk_offsets
    )
    if decay_check is not None and decay_check.out_of_range():
        # refuse g > 0 or NaN (naming the range found); decays below G_MIN forget within the token:
        # clamp them to G_MIN and run the forward again (bound in gate.py; this forward is dropped)
        check_decay_sign(g_in, "chunk_kda")
        o, hT = ChunkKDAFunction.apply(
            q,
            k,
            v,
            clamp_decay(g),
            beta,
            scale,
            initial_state,
            output_final_state,
            config,
            None,
            chunk_offsets,
        )
    if Vp != V:
        o = o[..., :V]
    if hT is not None and (Kp, Vp) != (K, V):
        hT = hT[:, :, :K, :V]
    if dest is not None:
        o = o[:, dest]
    return o, hT


def _kernel_dim(d: int) -> int:
    """The smallest head size the kernels are written for that holds ``d`` channels."""
    return next(s for s in TRITON_K if s >= d)


def _chunk_aligned_layout(lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For sequences of ``lengths``: where each packed token goes in the chunk-aligned row
    (``dest``, int64 ``[sum(lengths)]``), each sequence's first chunk (int32 ``[N + 1]``, the last
    entry the number of chunks) and the row's length in tokens."""
    chunks = [triton.cdiv(n, BT) for n in lengths]
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
