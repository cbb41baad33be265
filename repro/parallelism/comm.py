"""The communication layer of the tensor- and sequence-parallel blocks: every collective they run goes
through the functions here, so it can be counted in one place (:func:`count_collectives`).

Megatron-LM's two conjugate operators (shoeybi2019megatron §3, Fig. 3) and their sequence-parallel
counterparts (korthikanti2022reducing §4.2.2, Fig. 5) are autograd functions over a torch process group
(gloo on CPU, NCCL on GPUs):

====================  ===========================  ===========================
operator              forward                      backward
====================  ===========================  ===========================
``f`` (copy_to)       identity                     all-reduce
``g`` (reduce_from)   all-reduce                   identity
``g`` (gather_from)   all-gather along the seq.    reduce-scatter along the seq.
``g-bar`` (scatter)   reduce-scatter along seq.    all-gather along the seq.
====================  ===========================  ===========================

A group of ``None`` stands for one rank: every operator is then the identity and nothing is counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = [
    "all_gather",
    "all_reduce",
    "copy_to_tensor_parallel",
    "count_collectives",
    "gather_from_sequence_parallel",
    "group_rank",
    "group_size",
    "reduce_from_tensor_parallel",
    "reduce_scatter",
    "ring_shift",
    "scatter_to_sequence_parallel",
]

_counter: Counter | None = None

# torch 2.13 renamed the flat collectives (the old names warn); the GPU machine's 2.11 has only the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives this process runs inside the block, by ``"<kind>/<pass>"`` (e.g.
    ``"all_reduce/fwd"``, ``"reduce_scatter/bwd"``). Only collectives over more than one rank count."""
    global _counter
    previous, _counter = _counter, Counter()
    try:
        yield _counter
    finally:
        _counter = previous


def _count(kind: str, pass_: str) -> None:
    if _counter is not None:
        _counter[f"{kind}/{pass_}"] += 1


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, pass_: str) -> torch.Tensor:
    """The sum of ``x`` over the group (a new tensor)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    _count("all_reduce", pass_)
    return out


def all_gather(x: torch.Tensor, group, pass_: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order: [.., n, ..] -> [.., t n, ..]."""
    t = group_size(group)
    if t == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((t * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, moved, group=group)
    _count("all_gather", pass_)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, pass_: str, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's block along ``dim``: [.., t n, ..] -> [.., n, ..]."""
    t = group_size(group)
    if t == 1:
        return x
    if x.shape[dim] % t:
        raise ValueError(
            f"reduce_scatter: dimension {dim} of x has size {x.shape[dim]}, not divisible by the group size {t}"
        )
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // t, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, moved, group=group)
    _count("reduce_scatter", pass_)
    return out.movedim(0, dim)


class Exchange:
    """A ring transfer in flight (:func:`ring_shift`); :meth:`wait` returns the received tensor."""

    def __init__(self, requests: list, received: torch.Tensor, sent: torch.Tensor | None):
        self._requests, self._received, self._sent = requests, received, sent  # sent: alive until done

    def wait(self) -> torch.Tensor:
        for req in self._requests:
            req.wait()
        self._requests, self._sent = [], None
        return self._received


def ring_shift(x: torch.Tensor, group, pass_: str) -> Exchange:
    """Start sending ``x`` to the next rank of the group and receiving the previous rank's tensor of
    the same shape; returns at once, so the caller computes while the transfer runs. Send and receive
    go out as one batch (NCCL cannot deadlock on the cycle). Counted as ``ring_shift/<pass>``."""
    t = group_size(group)
    if t == 1:
        return Exchange([], x, None)
    r = dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % t), dist.get_global_rank(group, (r - 1) % t)
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, received, prv, group)]
    _count("ring_shift", pass_)
    return Exchange(dist.batch_isend_irecv(ops), received, x)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: the input enters every rank's shard of the block unchanged; the shards'
    input gradients are partial sums, added by an all-reduce in the backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group, "bwd"), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: the row-parallel layer's partial outputs are summed by an all-reduce; its
    gradient is the same on every rank, so the backward passes it through."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's ``g``: the sequence shards are all-gathered before the column-parallel
    layer; the backward reduce-scatters the (partial) gradient back to the shards."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, "fwd", dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, "bwd", ctx.dim), None, None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's ``g-bar``: the row-parallel layer's partial outputs are reduce-scattered
    along the sequence; the backward all-gathers the shards' gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, "fwd", dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, "bwd", ctx.dim), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    return _GatherFromSequenceParallel.apply(x, group, dim)


def scatter_to_sequence_parallel(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    return _ScatterToSequenceParallel.apply(x, group, dim)
