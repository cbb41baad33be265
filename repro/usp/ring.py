"""Ring attention (fang2024usp "SP approaches: Ring-Attention"; "Load balance") with its own backward.

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

__all__ = ["emulated_ring_attention", "ring_attention", "step_plan"]


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


def _forward_step(q, k_blk, v_blk, plan, out, lse, backend: LocalAttention, scale: float):
    """Attend the local queries to one K/V block and merge into (out, lse) in place; returns the
    backend's aux of the first call (None if the block is fully masked)."""
    aux0 = None
    for qs, ks, c in plan:
        o_b, lse_b, aux = backend.forward(q[:, qs], k_blk[:, ks], v_blk[:, ks], c, scale)
        aux0 = aux if aux0 is None else aux0
        o_m, lse_m = merge(out[:, qs], lse[:, :, qs], o_b.to(out.dtype), lse_b.to(lse.dtype))
        out[:, qs], lse[:, :, qs] = o_m, lse_m
    return aux0


def _backward_step(do, q, k_blk, v_blk, o, lse, plan, dq, dk_blk, dv_blk, backend, scale, aux):
    """Add one K/V block's contribution to dQ (local) and to the block's dK/dV accumulators, in place."""
    for qs, ks, c in plan:
        dq_b, dk_b, dv_b = backend.backward(
            do[:, qs], q[:, qs], k_blk[:, ks], v_blk[:, ks], o[:, qs], lse[:, :, qs], c, scale, aux
        )
        dq[:, qs] += dq_b.to(dq.dtype)
        dk_blk[:, ks] += dk_b.to(dk_blk.dtype)
        dv_blk[:, ks] += dv_b.to(dv_blk.dtype)


def _start(q):
    """Empty running output (zeros, accumulator dtype) and LSE (-inf) for queries q [B, L, H, D]."""
    b, length, h, d = q.shape
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(b, length, h, d, dtype=acc, device=q.device)
    return out, torch.full((b, h, length), float("-inf"), dtype=acc, device=q.device)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, backend: LocalAttention):
        n, r = comm.group_size(group), comm.group_rank(group)
        out, lse = _start(q)
        k_cur, v_cur, aux0 = k, v, None
        for t in range(n):
            s = (r - t) % n
            # start passing the block on before computing with it: the transfer hides behind the block
            pending = comm.ring_shift([k_cur, v_cur], group, "ring/fwd") if t < n - 1 else None
            plan = step_plan(layout, causal, n, r, s, q.shape[1])
            aux = _forward_step(q, k_cur, v_cur, plan, out, lse, backend, scale)
            aux0 = aux if aux0 is None else aux0
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
        group = ctx.group
        n, r = comm.group_size(group), comm.group_rank(group)
        acc = _acc_dtype(q.dtype)
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur, dkv_in_flight = k, v, None
        for t in range(n):
            s = (r - t) % n
            kv_pending = comm.ring_shift([k_cur, v_cur], group, "ring/bwd") if t < n - 1 else None
            dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
            plan = step_plan(ctx.layout, ctx.causal, n, r, s, q.shape[1])
            _backward_step(
                do, q, k_cur, v_cur, o, lse, plan, dq, dk_blk, dv_blk, ctx.backend, ctx.scale, ctx.aux
            )
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


class _EmulatedRing(torch.autograd.Function):
    """All n ranks of a ring in one process, one after the other, without communication: the same
    steps, plans, merges and block backwards as :class:`_RingAttention`, for measuring on one GPU what
    splitting the work costs (smaller blocks, LSE merges) and for testing large rings cheaply."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, backend: LocalAttention):
        n, length = q.shape[0], q.shape[2]
        outs, lses, aux0 = [], [], None
        for r in range(n):
            out, lse = _start(q[r])
            for t in range(n):
                s = (r - t) % n
                plan = step_plan(layout, causal, n, r, s, length)
                aux = _forward_step(q[r], k[s], v[s], plan, out, lse, backend, scale)
                aux0 = aux if aux0 is None else aux0
            outs.append(out.to(q.dtype))
            lses.append(lse)
        o, lse = torch.stack(outs), torch.stack(lses)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.layout, ctx.backend, ctx.aux = causal, scale, layout, backend, aux0
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        n, length = q.shape[0], q.shape[2]
        acc = _acc_dtype(q.dtype)
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for t in range(n):  # the order the accumulators travel: block s gets rank s, s+1, ... in turn
            for r in range(n):
                s = (r - t) % n
                plan = step_plan(ctx.layout, ctx.causal, n, r, s, length)
                _backward_step(
                    do[r],
                    q[r],
                    k[s],
                    v[s],
                    o[r],
                    lse[r],
                    plan,
                    dq[r],
                    dk[s],
                    dv[s],
                    ctx.backend,
                    ctx.scale,
                    ctx.aux,
                )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def emulated_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    layout: str,
    backend: LocalAttention,
) -> torch.Tensor:
    """Ring attention of n ranks emulated in one process. q: [n, B, L, H, D], k/v: [n, B, L, H_kv, D]:
    rank r's shards (from :func:`repro.usp.shard` with ``layout``) stacked on dim 0. Returns
    [n, B, L, H, D], rank r's output shard at index r."""
    return _EmulatedRing.apply(q, k, v, causal, scale, layout, backend)


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
