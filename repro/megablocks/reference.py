"""Plain-PyTorch references (gale2022megablocks §2-3): the top-k router, the MoE layer token by
token and expert by expert, and the capacity-factor MoE of GShard/Switch that the paper replaces.

Expert weights follow MegaBlocks' layout: ``w1, w3, w2`` are ``[E f, d]``, expert e owning rows
``[e f, (e+1) f)``. Expert e computes, for a token ``x [d]``:

* ``mlp="mlp"``: ``y = gelu(x W1_e^T) W2_e`` (tanh GELU, as MegaBlocks' default);
* ``mlp="glu"``: ``y = (silu(x W1_e^T) * (x W3_e^T)) W2_e`` (SwiGLU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MLPS = ("mlp", "glu")


def activation(h1: torch.Tensor, h3: torch.Tensor | None, mlp: str) -> torch.Tensor:
    """The expert's nonlinearity on the first layer's output(s), elementwise (any shape)."""
    if mlp == "mlp":
        return F.gelu(h1, approximate="tanh")
    return F.silu(h1) * h3


def expert(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None, e: int, ffn: int, mlp: str
) -> torch.Tensor:
    """Expert ``e`` (rows ``[e f, (e+1) f)`` of the ``w*``, ``f = ffn``) on ``x [..., d]`` -> ``[..., d]``."""
    sl = slice(e * ffn, (e + 1) * ffn)
    h1 = x @ w1[sl].t()
    h3 = x @ w3[sl].t() if mlp == "glu" else None
    return activation(h1, h3, mlp) @ w2[sl]


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k router (§2): ``p = softmax(x W_r^T)``; the k largest, renormalised to sum to one.

    ``x [T, d]``, ``router_weight [E, d]`` -> ``weights [T, k]`` (x's dtype), ``indices [T, k]`` (int64).
    """
    probs = torch.softmax((x @ router_weight.t()).float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), indices


def moe_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    num_experts: int,
    mlp: str = "mlp",
) -> torch.Tensor:
    """The MoE layer token by token (§2): ``y_t = sum_j weights[t, j] * expert_{indices[t, j]}(x_t)``.

    ``x [T, d]``, ``weights, indices [T, k]`` -> ``[T, d]``. Slow and obviously right: one small
    matmul per (token, choice). Differentiable in every tensor argument.
    """
    ffn = w1.shape[0] // num_experts
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(x.shape[1])
        for j in range(indices.shape[1]):
            y = y + weights[t, j] * expert(x[t], w1, w2, w3, int(indices[t, j]), ffn, mlp)
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def moe_dense(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    num_experts: int,
    mlp: str = "mlp",
) -> torch.Tensor:
    """The same function as :func:`moe_reference`, vectorised: every expert on every token, then the
    router weights select (for GPU tests at model sizes, where the token loop is too slow)."""
    T, d = x.shape
    ffn = w1.shape[0] // num_experts
    W1 = w1.view(num_experts, ffn, d)
    h1 = torch.einsum("td,efd->etf", x, W1)
    h3 = torch.einsum("td,efd->etf", x, w3.view(num_experts, ffn, d)) if mlp == "glu" else None
    y = torch.einsum("etf,efd->etd", activation(h1, h3, mlp), w2.view(num_experts, ffn, d))
    gate = x.new_zeros(T, num_experts).scatter_add(1, indices, weights)  # [T, E]
    return torch.einsum("te,etd->td", gate, y)


def moe_per_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    num_experts: int,
    mlp: str = "mlp",
) -> torch.Tensor:
    """The same function as :func:`moe_reference`, one dense matmul per expert over the tokens that
    chose it (for the benchmark's checks at model sizes, where the token loop is too slow and the
    all-experts :func:`moe_dense` too large)."""
    T, d = x.shape
    ffn = w1.shape[0] // num_experts
    out = x.new_zeros(T, d)
    for e in range(num_experts):
        t, j = (indices == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        out = out.index_add(0, t, expert(x[t], w1, w2, w3, e, ffn, mlp) * weights[t, j][:, None])
    return out


def capacity(num_assignments: int, num_experts: int, capacity_factor: float) -> int:
    """Expert capacity of GShard/Switch (§3): ``C = ceil(capacity_factor * T k / E)``."""
    return int(math.ceil(capacity_factor * num_assignments / num_experts))


def capacity_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    num_experts: int,
    capacity_factor: float,
    mlp: str = "mlp",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The capacity-factor MoE (§3): each expert takes at most ``C`` assignments
    (:func:`capacity`), the rest are dropped (they contribute nothing: only the residual carries
    them on); every expert computes a full ``[C, d]`` padded batch with one batched matmul.

    Priority as in GShard: all first choices, in token order, before any second choice.
    Returns ``y [T, d]`` and ``kept [T, k]`` (bool: the assignment was computed).
    """
    T, d = x.shape
    k = indices.shape[1]
    E = num_experts
    ffn = w1.shape[0] // E
    C = capacity(T * k, E, capacity_factor)
    flat = indices.t().reshape(-1)  # slot-major priority: a = j T + t
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(T * k, device=x.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)  # position within the expert
    keep = rank < C
    token = torch.arange(T * k, device=x.device) % T
    e_kept, r_kept, t_kept = flat[keep], rank[keep], token[keep]
    buf = x.new_zeros(E, C, d).index_put((e_kept, r_kept), x[t_kept])  # padded: E x C rows always
    h1 = torch.bmm(buf, w1.view(E, ffn, d).transpose(1, 2))
    h3 = torch.bmm(buf, w3.view(E, ffn, d).transpose(1, 2)) if mlp == "glu" else None
    y_buf = torch.bmm(activation(h1, h3, mlp), w2.view(E, ffn, d))
    w_flat = weights.t().reshape(-1)[keep]
    y = x.new_zeros(T, d).index_add(0, t_kept, y_buf[e_kept, r_kept] * w_flat[:, None])
    return y, keep.view(k, T).t()
