"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.

Rank r sends to r+1 and receives from r-1. The buffer is cut into n blocks. Reduce-scatter takes
n-1 steps; at step s rank r sends block r-s-1 and receives block r-s-2, which it reduces into its
own copy, so after n-1 steps rank r holds block r reduced over all ranks. All-gather then
circulates the finished blocks for n-1 more steps. Per rank that sends 2(n-1) blocks, i.e.
2(n-1)/n of the buffer (hu2025demystifying, "Ring AllReduce"; the busbw factor of nccl-tests).

Everything is listed as one batch of operations: step s+1 sends block b chunk by chunk as soon as
step s has reduced chunk k of b, so the steps pipeline like NCCL's recvReduceSend primitive.
"""

from __future__ import annotations

import torch

from nanoparallel.algorithms.common import blocks
from nanoparallel.transport.base import Recv, Reducer, Send, Transport


def ring_ops(
    tp: Transport,
    x: torch.Tensor,
    bounds: list[tuple[int, int]],
    reduce: Reducer | None,
    *,
    reduce_scatter: bool,
    all_gather: bool,
) -> list:
    """Operations for the ring phases on the 1-D buffer ``x`` split at ``bounds`` (n blocks)."""
    n, r = tp.world_size, tp.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    ch = tuple(range(tp.n_channels))

    def blk(b: int) -> torch.Tensor:
        lo, hi = bounds[b % n]
        return x[lo:hi]

    ops: list = []
    last = None
    if reduce_scatter:
        for s in range(n - 1):
            send = Send(
                nxt, blk(r - s - 1), ch, after=(last,) if last else (), label=f"ring reduce-scatter step {s}"
            )
            last = Recv(prv, blk(r - s - 2), reduce, ch, label=f"ring reduce-scatter step {s}")
            ops += [send, last]
    if all_gather:
        for s in range(n - 1):
            send = Send(nxt, blk(r - s), ch, after=(last,) if last else (), label=f"ring all-gather step {s}")
            last = Recv(prv, blk(r - s - 1), None, ch, label=f"ring all-gather step {s}")
            ops += [send, last]
    return ops


def all_reduce_ring(tp: Transport, x: torch.Tensor, reduce: Reducer) -> None:
    """In place on the 1-D contiguous ``x`` [count]."""
    bounds = blocks(x.numel(), tp.world_size)
    tp.run(ring_ops(tp, x, bounds, reduce, reduce_scatter=True, all_gather=True), "all_reduce(ring)")


def reduce_scatter_ring(tp: Transport, output: torch.Tensor, input: torch.Tensor, reduce: Reducer) -> None:
    """``input`` [n * m] -> ``output`` [m]: block ``rank`` reduced over ranks; ``input`` is untouched."""
    work = tp.scratch("ring-reduce-scatter", input.numel(), input.dtype)
    work.copy_(input)
    m = output.numel()
    bounds = [(b * m, (b + 1) * m) for b in range(tp.world_size)]
    tp.run(ring_ops(tp, work, bounds, reduce, reduce_scatter=True, all_gather=False), "reduce_scatter(ring)")
    output.copy_(work[tp.rank * m : (tp.rank + 1) * m])


def all_gather_ring(tp: Transport, output: torch.Tensor, input: torch.Tensor) -> None:
    """``input`` [m] -> ``output`` [n * m], block r from rank r."""
    m = input.numel()
    output[tp.rank * m : (tp.rank + 1) * m].copy_(input)
    bounds = [(b * m, (b + 1) * m) for b in range(tp.world_size)]
    tp.run(ring_ops(tp, output, bounds, None, reduce_scatter=False, all_gather=True), "all_gather(ring)")


def broadcast_ring(tp: Transport, x: torch.Tensor, root: int) -> None:
    """A pipelined chain root -> root+1 -> ...: each rank forwards chunk k once it has it."""
    n, r = tp.world_size, tp.rank
    ch = tuple(range(tp.n_channels))
    ops: list = []
    recv = None
    if r != root:
        recv = Recv((r - 1) % n, x, None, ch, label="ring broadcast receive")
        ops.append(recv)
    if (r + 1) % n != root:
        ops.append(Send((r + 1) % n, x, ch, after=(recv,) if recv else (), label="ring broadcast forward"))
    tp.run(ops, "broadcast(ring)")
