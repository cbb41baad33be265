"""Overlapping a collective with the matmul that depends on it, by decomposition (wang2023overlap).

Sequence-parallel tensor parallelism (korthikanti2022reducing) puts a collective right before or after
each big matmul: an all-gather of the sequence shards before the column-parallel layer, a
reduce-scatter of the partial sums after the row-parallel one. The matmul needs the collective's whole
result (or produces its whole input), so the two run one after the other and the links idle while the
tensor cores work, and the other way round.

wang2023overlap (ASPLOS 2023) splits both into t steps around a ring of the t ranks, so that step j's
transfer runs while step j's partial matmul computes; PyTorch calls the same decomposition *async tensor
parallelism* (``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``):

* all-gather + matmul: ``A = [A_0; ...; A_{t-1}]`` gathered by rows, ``A W = [A_0 W; ...; A_{t-1} W]``.
  At step j rank r holds the shard of rank ``(r - j) mod t``, computes its rows of the product and at
  the same time passes the shard on to rank r + 1.
* matmul + reduce-scatter: rank r needs ``sum_q A^(q)_r W^(q)`` (block r of every rank's partial
  product). An accumulator travels the ring: at step j rank r adds the block ``(r - j - 1) mod t`` of its
  own product to the accumulator received from rank r - 1 and sends it on; after t - 1 hops each block
  has collected every rank's term and sits on its owner.

Both compute exactly the plain pair (up to the order of the reduction's additions); the overlap is a
question of speed, measured on GPUs by ``python -m repro.parallelism.bench``.
"""

from __future__ import annotations

import torch

from repro.parallelism.comm import all_gather, group_rank, group_size, reduce_scatter, ring_shift

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


def _check(a: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if a.dim() < 2 or w.dim() != 2:
        raise ValueError(
            f"{what}: a must be [m, ..., k] and w [k, n]; got a {tuple(a.shape)}, w {tuple(w.shape)}"
        )
    if a.shape[-1] != w.shape[0]:
        raise ValueError(f"{what}: a's last dim {a.shape[-1]} differs from w's first dim {w.shape[0]}")
    if a.dtype != w.dtype or a.device != w.device:
        raise ValueError(f"{what}: a ({a.dtype}, {a.device}) and w ({w.dtype}, {w.device}) must match")


def all_gather_matmul(
    a_shard: torch.Tensor, w: torch.Tensor, group, *, decomposed: bool, pass_: str = "fwd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather ``a_shard`` [m, ..., k] along dim 0 over the group, then multiply by ``w`` [k, n].

    Returns (the gathered A [t m, ..., k], A W [t m, ..., n]). ``decomposed``: t ring steps, each
    multiplying the shard it holds while the next one arrives (wang2023overlap)."""
    _check(a_shard, w, "all_gather_matmul")
    t = group_size(group)
    if not decomposed or t == 1:
        a = all_gather(a_shard, group, pass_)
        return a, a @ w
    r, m = group_rank(group), a_shard.shape[0]
    a = torch.empty((t * m, *a_shard.shape[1:]), dtype=a_shard.dtype, device=a_shard.device)
    out = torch.empty((t * m, *a_shard.shape[1:-1], w.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    held = a_shard.contiguous()
    for j in range(t):
        src = (r - j) % t  # whose shard this rank holds at step j
        pending = ring_shift(held, group, pass_) if j < t - 1 else None  # in flight during the matmul
        rows = slice(src * m, (src + 1) * m)
        torch.matmul(held, w, out=out[rows])
        a[rows] = held
        if pending is not None:
            held = pending.wait()
    return a, out


def matmul_reduce_scatter(
    a: torch.Tensor, w: torch.Tensor, group, *, decomposed: bool, pass_: str = "fwd"
) -> torch.Tensor:
    """``a`` [t m, ..., k] @ ``w`` [k, n], summed over the group, this rank's block of rows kept:
    [m, ..., n]. ``decomposed``: the accumulator of each block travels the ring, each rank adding its
    term while the previous accumulator is in flight (wang2023overlap)."""
    _check(a, w, "matmul_reduce_scatter")
    t = group_size(group)
    if a.shape[0] % t:
        raise ValueError(f"matmul_reduce_scatter: a's first dim {a.shape[0]} is not divisible by t={t}")
    if not decomposed or t == 1:
        return reduce_scatter(a @ w, group, pass_)
    r, m = group_rank(group), a.shape[0] // t
    pending = None
    for j in range(t):
        block = (r - j - 1) % t  # the block whose accumulator this rank extends at step j
        partial = a[block * m : (block + 1) * m] @ w  # computed while the accumulator travels
        acc = partial if pending is None else pending.wait() + partial
        if j < t - 1:
            pending = ring_shift(acc, group, pass_)
    return acc
