"""Direct (full-mesh) algorithms: one-shot and two-shot all-reduce, all-gather, reduce-scatter,
broadcast and all-to-all. Every rank talks to every other rank in one batch.

* one-shot all-reduce: every rank sends its whole buffer to every peer and reduces all n copies
  locally. One message of latency, (n-1) buffers of traffic: the small-message choice.
* two-shot all-reduce: direct reduce-scatter (rank r collects block r from everyone) then direct
  all-gather: two message latencies, the ring's 2(n-1)/n traffic.

All local reductions add the ranks' contributions in rank order 0, 1, ..., n-1, so every rank
computes bitwise the same result and repeated runs agree.
"""

from __future__ import annotations

import torch

from nanoparallel.algorithms.common import blocks
from nanoparallel.transport.base import Recv, Reducer, Send, Transport


def _ordered_reduce(tp: Transport, rows: list[torch.Tensor], reduce: Reducer, out: torch.Tensor) -> None:
    """out = rows[0] (op) rows[1] (op) ... in rank order, with as few passes over memory as we can:
    ``out`` may be one of the rows (it is this rank's own contribution)."""
    rows = list(rows)
    for k in range(1, len(rows)):
        if rows[k].numel() and rows[k].data_ptr() == out.data_ptr():
            keep = tp.scratch("direct-own", out.numel(), out.dtype)
            keep.copy_(out)  # out is about to be overwritten with rows[0]
            rows[k] = keep
    if not (rows[0].numel() and rows[0].data_ptr() == out.data_ptr()):
        out.copy_(rows[0])
    for row in rows[1:]:
        reduce(out, row)


def _rows(tp: Transport, name: str, mine: torch.Tensor, numel: int) -> list[torch.Tensor]:
    """One receive buffer per peer (reused across calls), and ``mine`` in this rank's place."""
    buf = tp.scratch(name, tp.world_size * numel, mine.dtype).view(tp.world_size, numel)
    return [mine if p == tp.rank else buf[p] for p in range(tp.world_size)]


def _peers(tp: Transport) -> list[int]:
    return [p for p in range(tp.world_size) if p != tp.rank]


def all_reduce_one_shot(tp: Transport, x: torch.Tensor, reduce: Reducer) -> None:
    ch = tuple(range(tp.n_channels))
    rows = _rows(tp, "one-shot", x, x.numel())
    ops: list = [Send(p, x, ch, label="one-shot send") for p in _peers(tp)]
    ops += [Recv(p, rows[p], None, ch, label="one-shot receive") for p in _peers(tp)]
    tp.run(ops, "all_reduce(one_shot)")
    _ordered_reduce(tp, rows, reduce, x)


def _reduce_scatter_direct(
    tp: Transport, x: torch.Tensor, bounds, reduce: Reducer, out: torch.Tensor
) -> None:
    ch = tuple(range(tp.n_channels))
    lo, hi = bounds[tp.rank]
    rows = _rows(tp, "direct-reduce-scatter", x[lo:hi], hi - lo)
    ops: list = [
        Send(p, x[bounds[p][0] : bounds[p][1]], ch, label="direct reduce-scatter send") for p in _peers(tp)
    ]
    ops += [Recv(p, rows[p], None, ch, label="direct reduce-scatter receive") for p in _peers(tp)]
    tp.run(ops, "reduce_scatter(direct)")
    _ordered_reduce(tp, rows, reduce, out)


def _all_gather_direct(tp: Transport, x: torch.Tensor, bounds) -> None:
    ch = tuple(range(tp.n_channels))
    lo, hi = bounds[tp.rank]
    ops: list = [Send(p, x[lo:hi], ch, label="direct all-gather send") for p in _peers(tp)]
    ops += [
        Recv(p, x[bounds[p][0] : bounds[p][1]], None, ch, label="direct all-gather receive")
        for p in _peers(tp)
    ]
    tp.run(ops, "all_gather(direct)")


def all_reduce_two_shot(tp: Transport, x: torch.Tensor, reduce: Reducer) -> None:
    bounds = blocks(x.numel(), tp.world_size)
    lo, hi = bounds[tp.rank]
    _reduce_scatter_direct(tp, x, bounds, reduce, x[lo:hi])
    _all_gather_direct(tp, x, bounds)


def reduce_scatter_direct(tp: Transport, output: torch.Tensor, input: torch.Tensor, reduce: Reducer) -> None:
    m = output.numel()
    _reduce_scatter_direct(tp, input, [(b * m, (b + 1) * m) for b in range(tp.world_size)], reduce, output)


def all_gather_direct(tp: Transport, output: torch.Tensor, input: torch.Tensor) -> None:
    m = input.numel()
    output[tp.rank * m : (tp.rank + 1) * m].copy_(input)
    _all_gather_direct(tp, output, [(b * m, (b + 1) * m) for b in range(tp.world_size)])


def broadcast_direct(tp: Transport, x: torch.Tensor, root: int) -> None:
    ch = tuple(range(tp.n_channels))
    if tp.rank == root:
        tp.run([Send(p, x, ch, label="direct broadcast send") for p in _peers(tp)], "broadcast(direct)")
    else:
        tp.run([Recv(root, x, None, ch, label="direct broadcast receive")], "broadcast(direct)")


def all_to_all_direct(
    tp: Transport, output: torch.Tensor, input: torch.Tensor, out_bounds, in_bounds
) -> None:
    """``input[in_bounds[p]]`` goes to rank p, ``output[out_bounds[p]]`` comes from rank p (1-D)."""
    ch = tuple(range(tp.n_channels))
    r = tp.rank
    output[out_bounds[r][0] : out_bounds[r][1]].copy_(input[in_bounds[r][0] : in_bounds[r][1]])
    ops: list = [
        Send(p, input[in_bounds[p][0] : in_bounds[p][1]], ch, label=f"all_to_all send to {p}")
        for p in _peers(tp)
    ]
    ops += [
        Recv(p, output[out_bounds[p][0] : out_bounds[p][1]], None, ch, label=f"all_to_all receive from {p}")
        for p in _peers(tp)
    ]
    tp.run(ops, "all_to_all(direct)")
