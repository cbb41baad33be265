"""USP (fang2024usp, "Unified SP"): Ulysses inside, Ring across, on a P_u x P_r mesh of the sequence-parallel ranks.

    q, k, v [B, S/P, H, D]  --all-to-all in the Ulysses group-->  [B, S/P_r, H/P_u, D]
        --ring attention in the ring group-->  o [B, S/P_r, H/P_u, D]
        --all-to-all back-->  o [B, S/P, H, D]

P_r = 1 is DeepSpeed-Ulysses, P_u = 1 is Ring attention; one code path serves all three.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from repro.usp import comm
from repro.usp.layout import LAYOUTS
from repro.usp.local import LocalAttention, get_backend
from repro.usp.ring import local_attention, ring_attention
from repro.usp.ulysses import ulysses_attention, ulysses_in, ulysses_out

__all__ = ["kv_heads_after_replication", "local_attention", "make_groups", "usp_attention"]


def kv_heads_after_replication(h_kv: int, ulysses_degree: int) -> int:
    """K/V heads sent through the Ulysses all-to-all: H_kv when P_u divides it, else lcm(H_kv, P_u).

    With fewer (or indivisible) K/V heads than the Ulysses degree, each K/V head is repeated until
    every rank of the group receives the K/V heads its query heads need (the paper's replication for
    GQA/MQA, "Unified SP"). lcm(H_kv, P_u) is the fewest heads that split evenly and keep query head i on
    K/V head i // (H / H_kv): it divides H because both H_kv and P_u do.
    """
    return h_kv if h_kv % ulysses_degree == 0 else math.lcm(h_kv, ulysses_degree)


def _check(q, k, v, causal, layout, pu) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"usp_attention: {name} must be a local shard [B, S_local, H, D], got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"usp_attention: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, s, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"usp_attention: k must be [B={b}, S_local={s}, H_kv, D={d}] like q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"usp_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"usp_attention: H_kv = {h_kv} key/value heads must divide H = {h} query heads")
    if layout not in LAYOUTS:
        raise ValueError(f"usp_attention: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"usp_attention: causal must be a bool, got {causal!r}")
    if h % pu:
        raise ValueError(
            f"usp_attention: the Ulysses degree {pu} must divide the H = {h} query heads "
            "(each rank of the Ulysses group takes H / ulysses_degree heads); use more ring degree instead"
        )
    if layout == "zigzag" and s % 2:
        raise ValueError(
            f"usp_attention: layout 'zigzag' needs an even local sequence length (each rank holds two "
            f"chunks), got S_local = {s}; shard the sequence with repro.usp.shard(..., layout='zigzag')"
        )


def _ring_order(pu: int, s_local: int, device) -> torch.Tensor:
    """Permutation of the gathered Ulysses sequence into increasing positions (zigzag layout).

    Ulysses rank u of ring rank r holds world chunks r P_u + u (low) and 2P-1-r P_u-u (high), so the
    gather in rank order reads lo_0 hi_0 lo_1 hi_1 ...; in position order that is
    lo_0 .. lo_{P_u-1} hi_{P_u-1} .. hi_0, i.e. the ring's own zigzag chunks r and 2P_r-1-r.
    """
    half = s_local // 2
    lows = [torch.arange(u * s_local, u * s_local + half) for u in range(pu)]
    highs = [torch.arange(u * s_local + half, (u + 1) * s_local) for u in reversed(range(pu))]
    return torch.cat(lows + highs).to(device)


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    ulysses_group=None,
    ring_group=None,
    layout: str = "zigzag",
    scale: float | None = None,
    backend: str | LocalAttention = "auto",
    head_groups: int = 1,
) -> torch.Tensor:
    """Attention of a sequence sharded over ``P = P_u P_r`` ranks; differentiable.

    q: [B, S_local, H, D], k and v: [B, S_local, H_kv, D]: this rank's shard from
    :func:`repro.usp.shard` with ``world_size = P`` and ``rank = ring_rank * P_u + ulysses_rank``
    (the order :func:`make_groups` builds). ``ulysses_group`` / ``ring_group``: process groups of
    sizes P_u / P_r, None for size 1. ``layout`` must be the one the inputs were sharded with.
    ``backend``: local attention, ``"auto"`` (default: cuDNN on CUDA fp16/bf16, PyTorch's flash kernel
    elsewhere), ``"sdpa"``, ``"sdpa_cudnn"``, ``"math"``, ``"fa4"``, ``"fa4_gluon"``
    (:mod:`repro.usp.local`). ``scale`` defaults to 1/sqrt(D). ``head_groups``: with ring degree 1,
    split each rank's heads into up to that many groups whose all-to-alls overlap the other groups'
    attention (:func:`repro.usp.ulysses.ulysses_attention`); ignored when P_r > 1 or P_u = 1.
    Returns this rank's output shard [B, S_local, H, D], equal to single-device attention over the
    full sequence.

    The paths: P = 1 is one local attention call; P_r = 1 is Ulysses (one packed all-to-all each way);
    P_u = 1 is the ring; otherwise Ulysses around the ring.

    Requires P_u | H; K/V heads are split over the Ulysses group when P_u | H_kv and replicated up to
    lcm(H_kv, P_u) heads otherwise. Zigzag needs S_local even.
    """
    pu, pr = comm.group_size(ulysses_group), comm.group_size(ring_group)
    _check(q, k, v, causal, layout, pu)
    if not (isinstance(head_groups, int) and not isinstance(head_groups, bool) and head_groups >= 1):
        raise ValueError(f"usp_attention: head_groups must be an int >= 1, got {head_groups!r}")
    local = get_backend(backend)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    h_kv = k.shape[2]
    h_kv_sent = kv_heads_after_replication(h_kv, pu)
    if h_kv_sent != h_kv:  # local op: autograd sums the copies' gradients
        k = k.repeat_interleave(h_kv_sent // h_kv, dim=2)
        v = v.repeat_interleave(h_kv_sent // h_kv, dim=2)
    if pu == 1:  # no all-to-all: the ring (or, on one rank, one local call)
        return ring_attention(
            q, k, v, causal=causal, scale=scale, group=ring_group, layout=layout, backend=local
        )
    if pr == 1:
        return ulysses_attention(
            q, k, v, causal=causal, scale=scale, group=ulysses_group, layout=layout, backend=local,
            head_groups=head_groups,
        )  # fmt: skip
    # the gathered tokens come back in position order (the causal masks and the ring plan need it)
    q_h, k_h, v_h = ulysses_in(q, k, v, ulysses_group, layout)
    o_h = ring_attention(
        q_h, k_h, v_h, causal=causal, scale=scale, group=ring_group, layout=layout, backend=local
    )
    return ulysses_out(o_h, ulysses_group, layout)


def make_groups(
    ulysses_degree: int, ring_degree: int, *, ranks: Sequence[int] | None = None, backend: str | None = None
):
    """Build the Ulysses and ring process groups of a USP mesh; collective over the default world.

    The sequence-parallel domain has P = ulysses_degree x ring_degree ranks; the world (or ``ranks``,
    a subset every rank passes identically) is split into len / P data-parallel replicas of
    consecutive ranks. Inside a replica starting at rank ``base``, SP rank i = r P_u + u is global
    rank base + i; Ulysses groups are consecutive ranks (put them on NVLink), ring groups stride P_u.
    Every rank of the world must call this (torch.distributed.new_group is collective).

    Returns (ulysses_group, ring_group) for the calling rank, (None, None) if it is not in ``ranks``.
    """
    for name, val in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if not (isinstance(val, int) and val >= 1):
            raise ValueError(f"make_groups: {name} must be an int >= 1, got {val!r}")
    if not dist.is_initialized():
        raise RuntimeError("make_groups: torch.distributed is not initialised (init_process_group first)")
    world = list(range(dist.get_world_size())) if ranks is None else [int(x) for x in ranks]
    p = ulysses_degree * ring_degree
    if len(world) % p:
        raise ValueError(
            f"make_groups: ulysses_degree x ring_degree = {ulysses_degree} x {ring_degree} = {p} must "
            f"divide the number of ranks {len(world)} (data-parallel replicas of the SP group)"
        )
    me = dist.get_rank()
    mine = [None, None]
    for base in range(0, len(world), p):
        sp = world[base : base + p]
        for r in range(ring_degree):
            members = [sp[r * ulysses_degree + u] for u in range(ulysses_degree)]
            g = dist.new_group(members, backend=backend)
            if me in members:
                mine[0] = g
        for u in range(ulysses_degree):
            members = [sp[r * ulysses_degree + u] for r in range(ring_degree)]
            g = dist.new_group(members, backend=backend)
            if me in members:
                mine[1] = g
    return mine[0], mine[1]
