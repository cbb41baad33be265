"""Ring Self-Attention (li2021sequence, "Ring Self-Attention"): the first sequence-parallel attention.

Each of the n ranks holds a block of c = S/n tokens: its queries Q_r and its keys and values K_r, V_r.
Attention needs every key, so RSA runs two rings. In the first, the key blocks travel around the ring
and rank r fills its row block of scores, S_r = [Q_r K_0^T, ..., Q_r K_{n-1}^T] (c x S), one block per
step; softmax then runs over the whole row, as on one device. In the second, the value blocks travel
and rank r adds up O_r = sum_j P_r[:, block j] V_j.

Unlike Ring Attention (liu2023ring), RSA keeps the whole c x S score row block, so its memory per rank
grows with the total length S, not only with the block: that is what blockwise attention with an
online softmax removed (liu2023blockwise, liu2023ring). Forward only here (the paper's backward runs the
same rings in reverse).
"""

from __future__ import annotations

import math

import torch

from repro.parallelism.comm import group_rank, group_size, ring_shift

__all__ = ["ring_self_attention"]


def ring_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """RSA forward over the group. q, k, v: [B, c, H, D], this rank's contiguous block of the sequence
    (rank r holds tokens r c ... (r+1) c - 1). Returns this rank's output block [B, c, H, D]."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(
            f"ring_self_attention: q, k, v must share one shape [B, c, H, D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, r = group_size(group), group_rank(group)
    b, c, h, d = q.shape
    scores = torch.empty(b, h, c, n * c, dtype=q.dtype, device=q.device)
    held = k.contiguous()
    for j in range(n):  # ring 1: the key blocks
        src = (r - j) % n
        pending = ring_shift(held, group, "fwd") if j < n - 1 else None
        scores[..., src * c : (src + 1) * c] = torch.einsum("bqhd,bkhd->bhqk", q, held) / math.sqrt(d)
        if pending is not None:
            held = pending.wait()
    probs = torch.softmax(scores, dim=-1)  # over the whole row: every key of the sequence
    out = torch.zeros_like(q)
    held = v.contiguous()
    for j in range(n):  # ring 2: the value blocks
        src = (r - j) % n
        pending = ring_shift(held, group, "fwd") if j < n - 1 else None
        out += torch.einsum("bhqk,bkhd->bqhd", probs[..., src * c : (src + 1) * c], held)
        if pending is not None:
            held = pending.wait()
    return out
