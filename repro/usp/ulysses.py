"""The Ulysses step (fang2024usp, "SP approaches: DeepSpeed-Ulysses"): all-to-all between sequence and head shards.

Before: each of the n ranks of the Ulysses group holds S_l tokens of all H heads, [B, S_l, H, D].
After: each holds all n S_l tokens of the group for H/n heads, [B, n S_l, H/n, D] (rank j gets head
group j).

Two forms:

* :func:`seq_to_head` / :func:`head_to_seq`: one tensor each way, tokens in rank order; each is an
  autograd Function whose backward is the other all-to-all. The plain DeepSpeed-Ulysses the tests
  compare against.
* what :func:`repro.usp.usp_attention` runs: :func:`ulysses_in` / :func:`ulysses_out` move Q, K and V
  in *one* all-to-all (packed along the head dim) and put the gathered tokens in position order on
  the way (the zigzag layout's chunks arrive as lo_0 hi_0 lo_1 hi_1 ...; the ring and the causal mask
  need lo_0 .. lo_{n-1} hi_{n-1} .. hi_0), so there is one copy per direction instead of a copy, an
  all-to-all per tensor and an index_select. :func:`ulysses_attention` (ring degree 1) does the whole
  layer, optionally split into head groups that form a pipeline: the all-to-all of group g+1 (and the
  output all-to-all of group g-1) run on the communication stream while group g's attention
  computes; the backward likewise.

All bytes go through :mod:`repro.usp.comm` and are counted under ``ulysses/fwd`` / ``ulysses/bwd``.
"""

from __future__ import annotations

import torch

from repro.usp import comm
from repro.usp.local import LocalAttention

__all__ = ["head_groups_for", "head_to_seq", "seq_to_head", "ulysses_attention", "ulysses_in", "ulysses_out"]


# ------------------------------------------------------------------- plain, one tensor, rank order


def _seq_to_head(x: torch.Tensor, group, key: str) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    b, s, h, d = x.shape
    chunks = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4)  # [n, B, S_l, H/n, D]: chunk j -> rank j
    got = comm.all_to_all(chunks, group, key)  # chunk j: rank j's tokens, my heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _head_to_seq(y: torch.Tensor, group, key: str) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return y
    b, ns, hl, d = y.shape
    s = ns // n
    chunks = y.reshape(b, n, s, hl, d).permute(1, 0, 2, 3, 4)  # chunk j: rank j's tokens
    got = comm.all_to_all(chunks, group, key)  # chunk j: my tokens, head group j
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, n * hl, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group, "ulysses/fwd")

    @staticmethod
    def backward(ctx, g):
        return _head_to_seq(g.contiguous(), ctx.group, "ulysses/bwd"), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _head_to_seq(y, group, "ulysses/fwd")

    @staticmethod
    def backward(ctx, g):
        return _seq_to_head(g.contiguous(), ctx.group, "ulysses/bwd"), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S_l, H, D] sequence shard -> [B, n S_l, H/n, D] head shard over the Ulysses group."""
    return _SeqToHead.apply(x, group)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """[B, n S_l, H/n, D] head shard -> [B, S_l, H, D] sequence shard (inverse of :func:`seq_to_head`)."""
    return _HeadToSeq.apply(y, group)


# ------------------------------------------------------------------- packed, position order, pipelined


def _pack_seq(xs: list[torch.Tensor], n: int, groups: int, g: int) -> torch.Tensor:
    """Sequence shards [B, S_l, H_i, D] -> the send buffer of head group g, [n, B, S_l, sum h_i, D]:
    chunk j holds, for each tensor, the heads of group g of rank j's head slice (one copy)."""
    parts = []
    for x in xs:
        b, s, h, d = x.shape
        parts.append(x.reshape(b, s, n, groups, h // (n * groups), d)[:, :, :, g].permute(2, 0, 1, 3, 4))
    return torch.cat(parts, dim=3)


def _unpack_seq(buf: torch.Tensor, outs: list[torch.Tensor], n: int, groups: int, g: int) -> None:
    """Inverse of :func:`_pack_seq`: a received [n, B, S_l, sum h_i, D] (chunk j: my tokens, rank j's
    heads of group g) written into the sequence shards ``outs`` [B, S_l, H_i, D]."""
    off = 0
    for out in outs:
        b, s, h, d = out.shape
        hg = h // (n * groups)
        out.view(b, s, n, groups, hg, d)[:, :, :, g].copy_(
            buf[:, :, :, off : off + hg].permute(1, 2, 0, 3, 4)
        )
        off += hg


def _gather_tokens(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[n, B, S_l, h, D] (chunk u: rank u's tokens) -> [B, n S_l, h, D] in position order. Zigzag:
    rank u holds its low chunk then its high chunk, and position order is lo_0 .. lo_{n-1} hi_{n-1} .. hi_0."""
    n, b, s, h, d = x.shape
    out = torch.empty(b, n * s, h, d, dtype=x.dtype, device=x.device)
    if layout != "zigzag":
        out.view(b, n, s, h, d).copy_(x.permute(1, 0, 2, 3, 4))
        return out
    half = s // 2
    lows = out[:, : n * half].view(b, n, half, h, d)
    highs = out[:, n * half :].view(b, n, half, h, d)
    lows.copy_(x[:, :, :half].permute(1, 0, 2, 3, 4))
    for u in range(n):  # high chunks in reverse rank order
        highs[:, n - 1 - u].copy_(x[u, :, half:])
    return out


def _scatter_tokens(y: torch.Tensor, n: int, layout: str, into: torch.Tensor) -> None:
    """Inverse of :func:`_gather_tokens`: [B, n S_l, h, D] in position order -> ``into`` [n, B, S_l, h, D]."""
    b, ns, h, d = y.shape
    s = ns // n
    if layout != "zigzag":
        into.copy_(y.view(b, n, s, h, d).permute(1, 0, 2, 3, 4))
        return
    half = s // 2
    into[:, :, :half].copy_(y[:, : n * half].view(b, n, half, h, d).permute(1, 0, 2, 3, 4))
    highs = y[:, n * half :].view(b, n, half, h, d)
    for u in range(n):
        into[u, :, half:].copy_(highs[:, n - 1 - u])


def _pack_heads(ys: list[torch.Tensor], n: int, layout: str) -> torch.Tensor:
    """Head shards [B, n S_l, h_i, D] in position order -> send buffer [n, B, S_l, sum h_i, D]
    (chunk j: rank j's tokens)."""
    b, ns, _, d = ys[0].shape
    buf = torch.empty(n, b, ns // n, sum(y.shape[2] for y in ys), d, dtype=ys[0].dtype, device=ys[0].device)
    off = 0
    for y in ys:
        _scatter_tokens(y, n, layout, buf[:, :, :, off : off + y.shape[2]])
        off += y.shape[2]
    return buf


def _unpack_heads(buf: torch.Tensor, sizes: list[int], layout: str) -> list[torch.Tensor]:
    """A received [n, B, S_l, sum h_i, D] (chunk u: rank u's tokens) -> [B, n S_l, h_i, D] each."""
    out, off = [], 0
    for h in sizes:
        out.append(_gather_tokens(buf[:, :, :, off : off + h], layout))
        off += h
    return out


def head_groups_for(requested: int, h_kv: int, n: int) -> int:
    """The number of head groups the pipeline uses: the largest g <= ``requested`` dividing the
    H_kv / n key/value heads each rank gets (so every group has whole K/V heads and the query
    heads that share them)."""
    if not (isinstance(requested, int) and requested >= 1):
        raise ValueError(f"usp_attention: head_groups must be an int >= 1, got {requested!r}")
    per_rank = h_kv // n
    return max(g for g in range(1, min(requested, per_rank) + 1) if per_rank % g == 0)


class _UlyssesIn(torch.autograd.Function):
    """q, k, v sequence shards -> head shards in position order, one all-to-all each way."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout):
        n = comm.group_size(group)
        ctx.group, ctx.layout, ctx.shapes = group, layout, (q.shape, k.shape, v.shape)
        with comm.mark("usp:all-to-all"):
            (buf,) = comm.all_to_all_start(_pack_seq([q, k, v], n, 1, 0), group, "ulysses/fwd").wait()
        return tuple(_unpack_heads(buf, [q.shape[2] // n, k.shape[2] // n, v.shape[2] // n], layout))

    @staticmethod
    def backward(ctx, dq_h, dk_h, dv_h):
        n = comm.group_size(ctx.group)
        grads = [g.to(dq_h.dtype) for g in (dq_h, dk_h, dv_h)]
        with comm.mark("usp:all-to-all"):
            (buf,) = comm.all_to_all_start(_pack_heads(grads, n, ctx.layout), ctx.group, "ulysses/bwd").wait()
        outs = [torch.empty(s, dtype=dq_h.dtype, device=dq_h.device) for s in ctx.shapes]
        _unpack_seq(buf, outs, n, 1, 0)
        return (*outs, None, None)


class _UlyssesOut(torch.autograd.Function):
    """o head shard (position order) -> sequence shard, one all-to-all each way."""

    @staticmethod
    def forward(ctx, o_h, group, layout):
        n = comm.group_size(group)
        ctx.group, ctx.layout = group, layout
        b, ns, h, d = o_h.shape
        with comm.mark("usp:all-to-all"):
            (buf,) = comm.all_to_all_start(_pack_heads([o_h], n, layout), group, "ulysses/fwd").wait()
        o = torch.empty(b, ns // n, h * n, d, dtype=o_h.dtype, device=o_h.device)
        _unpack_seq(buf, [o], n, 1, 0)
        return o

    @staticmethod
    def backward(ctx, do):
        n = comm.group_size(ctx.group)
        with comm.mark("usp:all-to-all"):
            (buf,) = comm.all_to_all_start(_pack_seq([do], n, 1, 0), ctx.group, "ulysses/bwd").wait()
        return _unpack_heads(buf, [do.shape[2] // n], ctx.layout)[0], None, None


def ulysses_in(q, k, v, group, layout: str):
    """q [B, S_l, H, D], k/v [B, S_l, H_kv, D] -> [B, n S_l, H/n, D], [B, n S_l, H_kv/n, D] x 2, the
    tokens in position order (``layout`` is how the sequence was sharded); differentiable."""
    return _UlyssesIn.apply(q, k, v, group, layout)


def ulysses_out(o_h, group, layout: str):
    """[B, n S_l, H/n, D] (position order) -> [B, S_l, H, D]; differentiable."""
    return _UlyssesOut.apply(o_h, group, layout)


class _UlyssesAttention(torch.autograd.Function):
    """All-to-all, local attention, all-to-all back, in ``groups`` head groups that pipeline."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, backend: LocalAttention, groups):
        n = comm.group_size(group)
        b, s, h, d = q.shape
        sizes = [h // (n * groups), k.shape[2] // (n * groups), v.shape[2] // (n * groups)]
        with comm.mark("usp:all-to-all"):  # every group's transfer queued at once, in group order
            ins = [comm.all_to_all_start(_pack_seq([q, k, v], n, groups, g), group, "ulysses/fwd") for g in range(groups)]  # fmt: skip
        outs, saved, auxes = [], [], []
        for g in range(groups):
            (buf,) = ins[g].wait()
            q_g, k_g, v_g = _unpack_heads(buf, sizes, layout)
            with comm.mark("usp:attention"):
                o_g, lse_g, aux = backend.forward(q_g, k_g, v_g, causal, scale)
            o_g = o_g.to(q.dtype)
            with comm.mark("usp:all-to-all"):
                outs.append(comm.all_to_all_start(_pack_heads([o_g], n, layout), group, "ulysses/fwd"))
            saved += [q_g, k_g, v_g, o_g, lse_g]
            auxes.append(aux)
        o = torch.empty_like(q)
        for g in range(groups):
            (buf,) = outs[g].wait()
            _unpack_seq(buf, [o], n, groups, g)
        ctx.save_for_backward(*saved)
        ctx.causal, ctx.scale, ctx.group, ctx.layout, ctx.backend, ctx.groups, ctx.auxes = (
            causal, scale, group, layout, backend, groups, auxes,
        )  # fmt: skip
        ctx.shapes = (q.shape, k.shape, v.shape)
        return o

    @staticmethod
    def backward(ctx, do):
        n, groups, layout = comm.group_size(ctx.group), ctx.groups, ctx.layout
        saved = ctx.saved_tensors
        do = do.contiguous()
        with comm.mark("usp:all-to-all"):
            ins = [comm.all_to_all_start(_pack_seq([do], n, groups, g), ctx.group, "ulysses/bwd") for g in range(groups)]  # fmt: skip
        backs = []
        for g in range(groups):
            q_g, k_g, v_g, o_g, lse_g = saved[5 * g : 5 * g + 5]
            (buf,) = ins[g].wait()
            (do_g,) = _unpack_heads(buf, [q_g.shape[2]], layout)
            with comm.mark("usp:attention-backward"):
                grads = ctx.backend.backward(
                    do_g, q_g, k_g, v_g, o_g, lse_g, ctx.causal, ctx.scale, ctx.auxes[g]
                )
            grads = [t.to(do.dtype) for t in grads]
            with comm.mark("usp:all-to-all"):
                backs.append(comm.all_to_all_start(_pack_heads(grads, n, layout), ctx.group, "ulysses/bwd"))
        outs = [torch.empty(s, dtype=do.dtype, device=do.device) for s in ctx.shapes]
        for g in range(groups):
            (buf,) = backs[g].wait()
            _unpack_seq(buf, outs, n, groups, g)
        return (*outs, None, None, None, None, None, None)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    group,
    layout: str,
    backend: LocalAttention,
    head_groups: int = 1,
) -> torch.Tensor:
    """DeepSpeed-Ulysses attention over ``group`` (n ranks, n | H and n | H_kv): q [B, S_l, H, D],
    k/v [B, S_l, H_kv, D] sequence shards in ``layout`` -> o [B, S_l, H, D]; differentiable.

    ``head_groups`` > 1 splits each rank's heads into that many groups (see :func:`head_groups_for`)
    whose all-to-alls overlap the other groups' attention, forward and backward."""
    n = comm.group_size(group)
    groups = head_groups_for(head_groups, k.shape[2], n)
    return _UlyssesAttention.apply(q, k, v, causal, scale, group, layout, backend, groups)
