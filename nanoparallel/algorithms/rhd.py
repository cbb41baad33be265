"""Recursive halving / doubling all-reduce (Rabenseifner), with the non-power-of-two fold.

With p = 2^k ranks: reduce-scatter by recursive halving (k steps; at step i a rank swaps half of
its current range with the partner whose rank differs in bit k-1-i and keeps the half its bit
selects), then all-gather by recursive doubling (the same exchanges in reverse). 2*log2(p)
messages and 2(p-1)/p of the buffer per rank: the ring's bandwidth with logarithmic latency.

When n is not a power of two, let p be the largest power of two below n and e = n - p. First the
2e lowest ranks pair up: each even one sends its whole buffer to the odd one above it, which adds
it and takes part in the p-rank algorithm; at the end it sends the result back. The extra
step costs one full-buffer message each way.
"""

from __future__ import annotations

import torch

from nanoparallel.algorithms.common import blocks
from nanoparallel.transport.base import Recv, Reducer, Send, Transport


def all_reduce_rhd(tp: Transport, x: torch.Tensor, reduce: Reducer) -> None:
    """In place on 1-D ``x`` [count]."""
    n, r = tp.world_size, tp.rank
    ch = tuple(range(tp.n_channels))
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    # fold: ranks below 2*extra pair up (even -> odd)
    if r < 2 * extra:
        if r % 2 == 0:
            tp.run([Send(r + 1, x, ch, label="rhd fold: send to partner")], "all_reduce(rhd) fold")
            tp.run([Recv(r + 1, x, None, ch, label="rhd unfold: receive result")], "all_reduce(rhd) unfold")
            return
        tp.run([Recv(r - 1, x, reduce, ch, label="rhd fold: receive partner")], "all_reduce(rhd) fold")
        v = r // 2
    else:
        v = r - extra

    def real(vr: int) -> int:
        return 2 * vr + 1 if vr < extra else vr + extra

    bounds = blocks(x.numel(), p)
    lo, hi = 0, p  # range of blocks this rank is responsible for
    history = []
    mask = p >> 1
    while mask:
        partner = real(v ^ mask)
        mid = (lo + hi) // 2
        if v & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        kx = x[bounds[keep[0]][0] : bounds[keep[1] - 1][1]]
        gx = x[bounds[give[0]][0] : bounds[give[1] - 1][1]]
        tp.run(
            [
                Send(partner, gx, ch, label=f"rhd halving mask {mask}"),
                Recv(partner, kx, reduce, ch, label=f"rhd halving mask {mask}"),
            ],
            "all_reduce(rhd) halving",
        )
        history.append((partner, kx, gx))
        lo, hi = keep
        mask >>= 1
    for partner, kx, gx in reversed(history):
        tp.run(
            [Send(partner, kx, ch, label="rhd doubling"), Recv(partner, gx, None, ch, label="rhd doubling")],
            "all_reduce(rhd) doubling",
        )
    if r < 2 * extra:
        tp.run([Send(r - 1, x, ch, label="rhd unfold: send result")], "all_reduce(rhd) unfold")
