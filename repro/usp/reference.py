"""Single-device attention, written from the equations: the ground truth for Ulysses, Ring and USP.

Everything is in the heads-last layout the paper's code uses, ``[B, S, H, D]``, with grouped-query
attention (``H_kv`` key/value heads shared by ``H / H_kv`` query heads each). The causal mask is the
usual top-left one (query ``i`` sees keys ``j <= i``) on square problems; every causal block the ring
computes is square (fang2024usp, "Load balance": the diagonal block of each step), so no other alignment is needed.

Besides the output we return the log-sum-exp of every score row,

    lse_i = log sum_j exp(s_ij),   s_ij = scale * q_i . k_j,

because that is what lets partial results over disjoint key blocks be merged exactly
(:func:`merge`, the online-softmax identity the paper's ring step relies on).
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention", "attention_lse", "attention_lse_backward", "causal_pairs", "merge"]


def _expand_kv(k: torch.Tensor, h: int) -> torch.Tensor:
    """[B, S, H_kv, D] -> [B, S, H, D]: query head i uses key/value head i // (H / H_kv)."""
    h_kv = k.shape[2]
    if h % h_kv:
        raise ValueError(f"attention: H_kv = {h_kv} key/value heads must divide H = {h} query heads")
    return k.repeat_interleave(h // h_kv, dim=2) if h_kv != h else k


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """s = scale * Q K^T as [B, H, S_q, S_k], masked with -inf above the diagonal when causal."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, _expand_kv(k, q.shape[2])) * scale
    if causal:
        s_q, s_k = s.shape[-2:]
        if s_q != s_k:
            raise ValueError(f"attention: causal blocks must be square, got S_q = {s_q}, S_k = {s_k}")
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale Q K^T) V and the row log-sum-exp.

    q: [B, S_q, H, D]; k, v: [B, S_k, H_kv, D]. Returns o [B, S_q, H, D] in q's dtype and
    lse [B, H, S_q] (natural log) in float32, or float64 for float64 inputs.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    s = _scores(q.to(acc), k.to(acc), causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, S_q]
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v.to(acc), q.shape[2]))
    return o.to(q.dtype), lse


def attention_lse_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one key block, given the output ``o`` and ``lse`` of the *whole* row.

    With P_ij = exp(s_ij - lse_i) (lse over all keys of the row, not just this block) and
    delta_i = sum_d dO_id O_id:  dV = P^T dO,  dS = P * (dO V^T - delta),  dQ = scale dS K,
    dK = scale dS^T Q. The ring backward calls this once per block it holds; summing the blocks'
    dQ gives the full dQ, and each block's dK/dV is complete once every query block has added to it.
    Shapes as :func:`attention_lse`; dk, dv come back with H_kv heads.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    h, h_kv = q.shape[2], k.shape[2]
    q_, k_, v_, do_, o_ = (t.to(acc) for t in (q, k, v, do, o))
    p = torch.exp(_scores(q_, k_, causal, scale) - lse.to(acc)[..., None])
    v_full = _expand_kv(v_, h)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do_)
    dp = torch.einsum("bqhd,bkhd->bhqk", do_, v_full)
    delta = (do_ * o_).sum(-1).transpose(1, 2)  # [B, H, S_q]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k_, h)) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q_) * scale
    if h_kv != h:  # sum the query heads that share each key/value head
        b, s_k, _, d = dk.shape
        dk = dk.view(b, s_k, h_kv, h // h_kv, d).sum(3)
        dv = dv.view(b, s_k, h_kv, h // h_kv, d).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """Plain differentiable attention on one device: [B, S, H, D] x [B, S, H_kv, D] -> [B, S, H, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, causal, scale)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), _expand_kv(v, q.shape[2]))


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets (fang2024usp, "SP approaches: Ring-Attention").

    lse = log(e^lse_a + e^lse_b);  o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b.
    o: [B, S, H, D], lse: [B, H, S]. A row with lse = -inf (no keys yet) takes the other side as is.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe).transpose(1, 2)[..., None]
    w_b = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    return w_a * o_a + w_b * o_b, lse


def causal_pairs(q_positions: torch.Tensor, k_positions: torch.Tensor) -> int:
    """Number of (query, key) pairs with key position <= query position: the unmasked work."""
    return int((k_positions[None, :] <= q_positions[:, None]).sum())
