"""Helpers every algorithm shares: how a buffer splits into blocks, and the reduction functions."""

from __future__ import annotations

import torch

from nanoparallel.transport.base import Reducer


def blocks(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous blocks ``[start, end)``; the first
    ``count % parts`` blocks hold one element more, so any count works, including 0."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for b in range(parts):
        end = start + base + (1 if b < extra else 0)
        out.append((start, end))
        start = end
    return out


def _sum(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _max(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


def _min(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


REDUCERS: dict[str, Reducer] = {"sum": _sum, "max": _max, "min": _min, "avg": _sum}


def channel_split(channels: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """Deal channels to ``parts`` concurrent flows (the two trees); share them if too few."""
    if len(channels) >= parts:
        return [channels[i::parts] for i in range(parts)]
    return [channels] * parts
