"""How a sequence of S tokens is split over P sequence-parallel ranks (fang2024usp, "Load balance").

* ``contiguous``: rank i holds tokens [i S/P, (i+1) S/P).
* ``zigzag``: the sequence is cut into 2P chunks of S/(2P) tokens and rank i holds chunks i and
  2P-1-i (one early, one late chunk), which gives every rank the same causal work.

The rank here is the sequence-parallel rank ``ring_rank * ulysses_degree + ulysses_rank``, the
order :func:`repro.usp.make_groups` builds. With that order the zigzag split over all P ranks is,
seen from a ring rank after the Ulysses all-to-all gathers its group, exactly the zigzag split over
the P_r ring ranks (low chunk r, high chunk 2P_r-1-r): one data layout serves every P_u x P_r
factorisation, so a model can change its USP degrees without re-sharding its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")

__all__ = ["LAYOUTS", "positions", "shard", "unshard"]


def _check_layout(layout: str, fn: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {list(LAYOUTS)}, got {layout!r}")


def _chunks(seq_len: int, world_size: int, layout: str, fn: str) -> int:
    """Number of equal chunks the layout cuts the sequence into; checks divisibility."""
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"{fn}: world_size must be an int >= 1, got {world_size!r}")
    _check_layout(layout, fn)
    n = 2 * world_size if layout == "zigzag" else world_size
    if seq_len % n:
        raise ValueError(
            f"{fn}: sequence length {seq_len} does not split evenly in layout {layout!r} over "
            f"{world_size} ranks: it must be a multiple of {n}"
            + (" (2 x world_size chunks)" if layout == "zigzag" else "")
        )
    return n


def positions(
    seq_len: int, world_size: int, rank: int, layout: str = "zigzag", *, fn: str = "positions"
) -> torch.Tensor:
    """Global token positions held by ``rank``, in local order: LongTensor [S / world_size]."""
    n = _chunks(seq_len, world_size, layout, fn)
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"{fn}: rank must be an int in [0, {world_size}), got {rank!r}")
    c = seq_len // n
    ids = [rank, n - 1 - rank] if layout == "zigzag" else [rank]
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids])


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of a full sequence.

    x: [B, S, ...] (sequence on dim 1). Returns [B, S / world_size, ...]. S must be a multiple of
    world_size (contiguous) or 2 world_size (zigzag).
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"shard: x must be a tensor [B, S, ...], got {getattr(x, 'shape', type(x))}")
    idx = positions(x.shape[1], world_size, rank, layout, fn="shard").to(x.device)
    return x.index_select(1, idx)


def unshard(shards: Sequence[torch.Tensor], layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard`: every rank's part, in rank order, back into [B, S, ...]."""
    _check_layout(layout, "unshard")
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("unshard: shards must hold one tensor per rank, got an empty sequence")
    s_local = shards[0].shape[1]
    if any(t.shape != shards[0].shape for t in shards):
        raise ValueError(f"unshard: all shards must have one shape, got {[tuple(t.shape) for t in shards]}")
    seq_len = s_local * world_size
    out = shards[0].new_empty(shards[0].shape[0], seq_len, *shards[0].shape[2:])
    for r, t in enumerate(shards):
        out[:, positions(seq_len, world_size, r, layout, fn="unshard").to(t.device)] = t
    return out
