"""The communication layer: every byte USP moves goes through the two functions here.

* :func:`all_to_all` (the Ulysses step, fang2024usp "SP approaches" and "Unified SP"; over a torch process group, or over a
  ``nanoparallel`` Communicator when one is passed as the Ulysses group) and
* :func:`ring_shift` (the Ring step: send to the next ring rank, receive from the previous one),

and :func:`all_to_all_start`, the all-to-all that returns at once (the pipelined Ulysses step), so
the bytes each rank sends can be counted in one place (:func:`count_bytes`) and compared with the
paper's communication analysis ("Communication and memory analysis", the formulas in :mod:`repro.usp.cost`). A rank's bytes *sent*
are counted: for an all-to-all over n ranks that is (n - 1)/n of its buffer (its own chunk stays),
for a ring shift the whole tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = [
    "Exchange", "all_to_all", "all_to_all_start", "count_bytes", "group_rank", "group_size", "mark", "ring_shift",
]  # fmt: skip

# Overlap: on NCCL every transfer runs on the process group's own stream (ProcessGroupNCCL issues each
# operation there after making that stream wait for the work already queued on the caller's stream);
# Exchange.wait makes the caller's stream wait for the transfer, nothing more. So a transfer started
# before a block's attention is queued runs beside it, and the caller's stream only waits where it
# needs the data. On gloo (CPU) the same calls complete on a background thread.

_counter: dict[str, int] | None = None


@contextmanager
def count_bytes() -> Iterator[dict[str, int]]:
    """Count the bytes this process sends inside the block, by key (``"ulysses/fwd"``, ``"ring/bwd"``)."""
    global _counter
    previous, _counter = _counter, defaultdict(int)
    try:
        yield _counter
    finally:
        _counter = previous


def _count(key: str, nbytes: int) -> None:
    if _counter is not None:
        _counter[key] += int(nbytes)


def mark(name: str):
    """A named range (``torch.profiler.record_function``) for the profiler's timeline
    (:mod:`repro.usp.timeline`), which files the GPU work launched inside it under this name. A few
    microseconds of host time each, a handful per attention call."""
    return torch.profiler.record_function(name)


def _is_nanoparallel(group) -> bool:
    """A nanoparallel Communicator (our own collectives library) instead of a torch process group."""
    return type(group).__module__.startswith("nanoparallel")


def group_size(group) -> int:
    """Size of ``group``; None stands for a group of one rank (no communication)."""
    if group is None:
        return 1
    return group.world_size if _is_nanoparallel(group) else dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None:
        return 0
    return group.rank if _is_nanoparallel(group) else dist.get_rank(group)


def all_to_all(x: torch.Tensor, group, key: str) -> torch.Tensor:
    """x: [n, ...] with n = group size; chunk i goes to rank i. Returns [n, ...] whose chunk j came
    from rank j. Counts (n - 1)/n of x's bytes under ``key``."""
    n = group_size(group)
    if x.shape[0] != n:
        raise ValueError(f"all_to_all: first dim must be the group size {n}, got shape {tuple(x.shape)}")
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    if _is_nanoparallel(group):  # the Ulysses all-to-all through nanoparallel (its direct algorithm)
        group.all_to_all(out, x)
    else:
        dist.all_to_all_single(out, x, group=group)
    _count(key, x.numel() * x.element_size() * (n - 1) // n)
    return out


def all_to_all_start(x: torch.Tensor, group, key: str) -> Exchange:
    """:func:`all_to_all` that returns at once: ``.wait()`` gives ``[out]``. Counted like it. A
    nanoparallel group completes it before returning (its collectives are blocking)."""
    n = group_size(group)
    if x.shape[0] != n:
        raise ValueError(f"all_to_all: first dim must be the group size {n}, got shape {tuple(x.shape)}")
    if n == 1:
        return Exchange([], [x])
    if _is_nanoparallel(group):
        return Exchange([], [all_to_all(x, group, key)])
    x = x.contiguous()
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x, group=group, async_op=True)
    _count(key, x.numel() * x.element_size() * (n - 1) // n)
    return Exchange([work], [out], [x])


class Exchange:
    """Transfers in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, requests: list, received: list[torch.Tensor], sent: list[torch.Tensor] = ()):
        # keep the sent buffers alive until the transfers finish
        self._requests, self._received, self._sent = requests, received, list(sent)

    def wait(self) -> list[torch.Tensor]:
        for req in self._requests:
            req.wait()
        self._requests, self._sent = [], []
        return self._received


def ring_shift(tensors: list[torch.Tensor], group, key: str) -> Exchange:
    """Start sending ``tensors`` to the next rank of the ring and receiving the same shapes from the
    previous one; returns at once (the caller computes meanwhile: the ring's overlap) with an
    :class:`Exchange`. Sends and receives are issued as one batch so that NCCL cannot deadlock on
    the cycle. Counts every sent byte under ``key``."""
    n = group_size(group)
    if n == 1:
        return Exchange([], list(tensors))
    if _is_nanoparallel(group):
        return _ring_shift_nanoparallel(tensors, group, key)
    r = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (r + 1) % n)
    prv = dist.get_global_rank(group, (r - 1) % n)
    received = [torch.empty_like(t) for t in tensors]
    ops, sent = [], []
    for t, buf in zip(tensors, received, strict=True):
        t = t.contiguous()
        sent.append(t)
        ops.append(dist.P2POp(dist.isend, t, nxt, group))
        ops.append(dist.P2POp(dist.irecv, buf, prv, group))
        _count(key, t.numel() * t.element_size())
    return Exchange(dist.batch_isend_irecv(ops), received, sent)


def _ring_shift_nanoparallel(tensors: list[torch.Tensor], comm, key: str) -> Exchange:
    """The ring step over a nanoparallel Communicator (blocking send/recv). Rank 0 sends first and
    every other rank receives first, so the cycle of blocking calls cannot deadlock: the send of
    rank 0 starts a chain that ends with rank n-1's send to rank 0, which is then receiving."""
    n, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    received = [torch.empty_like(t) for t in tensors]
    sends = [t.contiguous() for t in tensors]
    if r == 0:
        for t in sends:
            comm.send(t, nxt)
        for buf in received:
            comm.recv(buf, prv)
    else:
        for buf in received:
            comm.recv(buf, prv)
        for t in sends:
            comm.send(t, nxt)
    for t in sends:
        _count(key, t.numel() * t.element_size())
    return Exchange([], received)
