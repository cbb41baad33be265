"""The communication layer: every byte USP moves goes through the two functions here.

* :func:`all_to_all` (the Ulysses step, fang2024usp "SP approaches" and "Unified SP"; over a torch process group, or over a
  ``nanoparallel`` Communicator when one is passed as the Ulysses group) and
* :func:`ring_shift` (the Ring step: send to the next ring rank, receive from the previous one),

so the bytes each rank sends can be counted in one place (:func:`count_bytes`) and compared with the
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

__all__ = ["Exchange", "all_to_all", "count_bytes", "group_rank", "group_size", "ring_shift"]

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
