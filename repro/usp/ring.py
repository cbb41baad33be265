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

__all__ = ["emulated_ring_attention", "local_attention", "ring_attention", "step_plan"]


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


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """:func:`repro.usp.reference.merge` in place: (out, lse) <- merge((out, lse), (o_b, lse_b)).

    out [B, L, H, D] in the accumulator dtype, o_b in any dtype (read once, never upcast into a
    temporary), lse/lse_b [B, H, L]: two passes over out (scale, then add the block), where the
    out-of-place merge made five and three temporaries (measured in results/: the merges were a
    visible share of a ring step)."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # rows with no key yet
    w_a = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_a).addcmul_(o_b, w_b)
    lse.copy_(new)


def _forward_step(q, k_blk, v_blk, plan, out, lse, backend: LocalAttention, scale: float, first: bool):
    """Attend the local queries to one K/V block and merge into (out, lse) in place; returns the
    backend's aux of each call. ``first``: the block is the first one (its plan covers every row), so
    its result is copied in, not merged."""
    auxes = []
    for qs, ks, c in plan:
        with comm.mark("usp:attention"):
            o_b, lse_b, aux = backend.forward(q[:, qs], k_blk[:, ks], v_blk[:, ks], c, scale)
        auxes.append(aux)
        with comm.mark("usp:merge"):
            if first:
                out[:, qs].copy_(o_b)
                lse[:, :, qs].copy_(lse_b)
            else:
                _merge_into(out[:, qs], lse[:, :, qs], o_b, lse_b.to(lse.dtype))
    return auxes


def _backward_step(do, q, k_blk, v_blk, o, lse, plan, dq, dkv_blk, backend, scale, auxes):
    """Add one K/V block's contribution to dQ (local) and to the block's packed dK/dV accumulator
    ``dkv_blk`` [2, B, L, H_kv, D], in place (mixed-dtype in-place adds: no upcast temporaries)."""
    for (qs, ks, c), aux in zip(plan, auxes, strict=True):
        with comm.mark("usp:attention-backward"):
            dq_b, dk_b, dv_b = backend.backward(
                do[:, qs], q[:, qs], k_blk[:, ks], v_blk[:, ks], o[:, qs], lse[:, :, qs], c, scale, aux
            )
        dq[:, qs].add_(dq_b)
        dkv_blk[0][:, ks].add_(dk_b)
        dkv_blk[1][:, ks].add_(dv_b)


def _start(q):
    """Empty running output and LSE (accumulator dtype) for queries q [B, L, H, D]; the first block
    (the diagonal one, whose plan covers every row) fills them."""
    b, length, h, d = q.shape
    acc = _acc_dtype(q.dtype)
    return (
        torch.empty(b, length, h, d, dtype=acc, device=q.device),
        torch.empty(b, h, length, dtype=acc, device=q.device),
    )


class _LocalAttention(torch.autograd.Function):
    """One local attention call with its backend's backward: the whole ring when it has one rank
    (no accumulators, no merge, no casts: the kernel's own output and gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend: LocalAttention):
        with comm.mark("usp:attention"):
            o, lse, aux = backend.forward(q, k, v, causal, scale)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.backend, ctx.aux = causal, scale, backend, aux
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        with comm.mark("usp:attention-backward"):
            dq, dk, dv = ctx.backend.backward(
                do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale, ctx.aux
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def local_attention(q, k, v, *, causal: bool, scale: float, backend: LocalAttention) -> torch.Tensor:
    """Single-device attention through ``backend`` (q [B, S, H, D], k/v [B, S, H_kv, D]); differentiable."""
    return _LocalAttention.apply(q, k, v, causal, scale, backend)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, backend: LocalAttention):
        n, r = comm.group_size(group), comm.group_rank(group)
        out, lse = _start(q)
        kv = torch.stack([k, v])  # one buffer: one send and one receive per step
        auxes = []
        for t in range(n):
            s = (r - t) % n
            # start passing the block on before computing with it: the transfer hides behind the block
            with comm.mark("usp:ring"):
                pending = comm.ring_shift([kv], group, "ring/fwd") if t < n - 1 else None
            plan = step_plan(layout, causal, n, r, s, q.shape[1])
            auxes.append(_forward_step(q, kv[0], kv[1], plan, out, lse, backend, scale, first=t == 0))
            if pending is not None:
                (kv,) = pending.wait()
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.layout, ctx.backend, ctx.auxes = (
            causal, scale, group, layout, backend, auxes,
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
        kv, dkv_in_flight = torch.stack([k, v]), None
        for t in range(n):
            s = (r - t) % n
            with comm.mark("usp:ring"):
                kv_pending = comm.ring_shift([kv], group, "ring/bwd") if t < n - 1 else None
            dkv_blk = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            plan = step_plan(ctx.layout, ctx.causal, n, r, s, q.shape[1])
            _backward_step(
                do, q, kv[0], kv[1], o, lse, plan, dq, dkv_blk, ctx.backend, ctx.scale, ctx.auxes[t]
            )
            if dkv_in_flight is not None:  # what the ranks before me added to this block's dK/dV
                (dkv_in,) = dkv_in_flight.wait()
                dkv_blk += dkv_in
            # pass the accumulators on with the block; after step n-1 this is the hop home
            with comm.mark("usp:ring"):
                dkv_in_flight = comm.ring_shift([dkv_blk], group, "ring/bwd")
            if kv_pending is not None:
                (kv,) = kv_pending.wait()
        (dkv,) = dkv_in_flight.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


class _EmulatedRing(torch.autograd.Function):
    """All n ranks of a ring in one process, one after the other, without communication: the same
    steps, plans, merges and block backwards as :class:`_RingAttention`, for measuring on one GPU what
    splitting the work costs (smaller blocks, LSE merges) and for testing large rings cheaply."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, backend: LocalAttention):
        n, length = q.shape[0], q.shape[2]
        outs, lses, auxes = [], [], {}
        for r in range(n):
            out, lse = _start(q[r])
            for t in range(n):
                s = (r - t) % n
                plan = step_plan(layout, causal, n, r, s, length)
                auxes[r, t] = _forward_step(q[r], k[s], v[s], plan, out, lse, backend, scale, first=t == 0)
            outs.append(out.to(q.dtype))
            lses.append(lse)
        o, lse = torch.stack(outs), torch.stack(lses)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.layout, ctx.backend, ctx.auxes = causal, scale, layout, backend, auxes
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        n, length = q.shape[0], q.shape[2]
        acc = _acc_dtype(q.dtype)
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros((n, 2, *k.shape[1:]), dtype=acc, device=k.device)
        for t in range(n):  # the order the accumulators travel: block s gets rank s, s+1, ... in turn
            for r in range(n):
                s = (r - t) % n
                plan = step_plan(ctx.layout, ctx.causal, n, r, s, length)
                _backward_step(
                    do[r], q[r], k[s], v[s], o[r], lse[r], plan, dq[r], dkv[s], ctx.backend, ctx.scale,
                    ctx.auxes[r, t],
                )  # fmt: skip
        return dq.to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype), None, None, None, None


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
    ring-local sequence in increasing position (chunks as ``layout`` assigns them). Returns [B, L, H, D].
    A ring of one rank is one local attention call (:func:`local_attention`)."""
    if comm.group_size(group) == 1:
        return _LocalAttention.apply(q, k, v, causal, scale, backend)
    return _RingAttention.apply(q, k, v, causal, scale, group, layout, backend)
