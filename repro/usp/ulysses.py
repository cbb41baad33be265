"""The Ulysses step (fang2024usp, "SP approaches: DeepSpeed-Ulysses"): all-to-all between sequence and head shards.

Before: each of the n ranks of the Ulysses group holds S_l tokens of all H heads, [B, S_l, H, D].
After :func:`seq_to_head`: each holds all n S_l tokens of the group for H/n heads,
[B, n S_l, H/n, D] (rank j gets head group j; the tokens come in rank order).
:func:`head_to_seq` is the inverse. Each is an autograd Function whose backward is the other
all-to-all, so gradients move through the communication layer (and are counted) like activations.
"""

from __future__ import annotations

import torch

from repro.usp import comm

__all__ = ["head_to_seq", "seq_to_head"]


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
