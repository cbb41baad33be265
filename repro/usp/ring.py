"""Ring attention (fang2024usp §2, "Ring-Attention"; causal load balance §3.2) with its own backward.

Each of the n ranks of the ring group holds a query block and a key/value block of the ring's
sequence. At step t rank r attends to the K/V block of rank s = (r - t) mod n while it passes that
block on to rank r + 1 (the transfer overlaps the block's attention), and merges the block's output
into its running result exactly through the log-sum-exp (:func:`repro.usp.reference.merge`).

Backward (the ring backward, not autograd through communication): K/V travel the ring again, and
with them the block's dK/dV accumulators, to which every rank adds the contribution of its own
queries; after n steps each accumulator is one hop from its owner and takes that last hop. Each
block's gradients use the row's final output and LSE (P = exp(S - lse)), as FlashAttention's
backward does, so no per-step statistics are kept.

Causal masks: the ring's local sequence is the concatenation of its chunks in increasing position.
With ``contiguous`` chunks rank r attends fully to blocks s < r, causally to its own, not at all to
s > r: rank n-1 works n times as long as rank 0. With ``zigzag`` (rank r holds chunks r and 2n-1-r)
every step after the first is exactly half a block of work on every rank (:func:`step_plan`).
"""

from __future__ import annotations

import torch

from repro.usp import comm
from repro.usp.local import LocalAttention
from repro.usp.reference import merge

__all__ = ["ring_attention", "step_plan"]


def step_plan(
    layout: str, causal: bool, n: int, r: int, s: int, length: int
) -> list[tuple[slice, slice, bool]]:
    """The attention calls rank r makes against the K/V block of rank s, for a local length ``length``.

    Returns (query slice, key slice, causal) triples; an empty list when the block is fully masked.
    """
    everything = slice(0, length)
    if not causal:
        return [(everything, everything, False)]
    if s == r:
        return [(everything, everything, True)]  # the diagonal block: masks line up on local indices
    if layout == "contiguous":
        return [(everything, everything, False)] if s < r else []
    half = length // 2
    if s < r:  # both my chunks come after their low chunk and before their high chunk
        return [(everything, slice(0, half), False)]
    return [(slice(half, length), everything, False)]  # only my high chunk sees them, and all of them


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, backend: LocalAttention):
        n, r = comm.group_size(group), comm.group_rank(group)
        b, length, h, d = q.shape
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(b, length, h, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, length), float("-inf"), dtype=acc, device=q.device)
        k_cur, v_cur, aux0 = k, v, None
        for t in range(n):
            s = (r - t) % n
            # start passing the block on before computing with it (the overlap of §2)
            pending = comm.ring_shift([k_cur, v_cur], group, "ring/fwd") if t < n - 1 else None
            for qs, ks, c in step_plan(layout, causal, n, r, s, length):
                o_b, lse_b, aux = backend.forward(q[:, qs], k_cur[:, ks], v_cur[:, ks], c, scale)
                aux0 = aux if aux0 is None else aux0
                o_m, lse_m = merge(out[:, qs], lse[:, :, qs], o_b.to(acc), lse_b.to(acc))
                out[:, qs], lse[:, :, qs] = o_m, lse_m
            if pending is not None:
                k_cur, v_cur = pending.wait()
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.layout, ctx.backend, ctx.aux = (
            causal, scale, group, layout, backend, aux0,
        )  # fmt: skip
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        group, backend = ctx.group, ctx.backend
        n, r = comm.group_size(group), comm.group_rank(group)
        length = q.shape[1]
        acc = _acc_dtype(q.dtype)
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur, dkv_in_flight = k, v, None
        for t in range(n):
            s = (r - t) % n
            kv_pending = comm.ring_shift([k_cur, v_cur], group, "ring/bwd") if t < n - 1 else None
            dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
            for qs, ks, c in step_plan(ctx.layout, ctx.causal, n, r, s, length):
                dq_b, dk_b, dv_b = backend.backward(
                    do[:, qs], q[:, qs], k_cur[:, ks], v_cur[:, ks], o[:, qs], lse[:, :, qs],
                    c, ctx.scale, ctx.aux,
                )  # fmt: skip
                dq[:, qs] += dq_b.to(acc)
                dk_blk[:, ks] += dk_b.to(acc)
                dv_blk[:, ks] += dv_b.to(acc)
            if dkv_in_flight is not None:  # what the ranks before me added to this block's dK/dV
                dk_in, dv_in = dkv_in_flight.wait()
                dk_blk += dk_in
                dv_blk += dv_in
            # pass the accumulators on with the block; after step n-1 this is the hop home
            dkv_in_flight = comm.ring_shift([dk_blk, dv_blk], group, "ring/bwd")
            if kv_pending is not None:
                k_cur, v_cur = kv_pending.wait()
        dk, dv = dkv_in_flight.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    group,
    layout: str,
    backend: LocalAttention,
) -> torch.Tensor:
    """Ring attention over ``group`` (None: one rank). q: [B, L, H, D], k/v: [B, L, H_kv, D], the
    ring-local sequence in increasing position (chunks as ``layout`` assigns them). Returns [B, L, H, D]."""
    return _RingAttention.apply(q, k, v, causal, scale, group, layout, backend)
