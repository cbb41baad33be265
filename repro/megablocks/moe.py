"""The dropless MoE layer (gale2022megablocks §4-5): permute, pad to blocks, compute the experts as
block-sparse products (SDD, activation, DSD) or as grouped GEMMs, un-permute and combine.

Functional forms :func:`dmoe_sparse` and :func:`dmoe_grouped` take the routing (``weights,
indices [T, k]``) so that the benchmark and the tests can fix it; :class:`dMoE` adds the router.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from repro.megablocks.glue import combine, expand, slot_rows, swiglu
from repro.megablocks.kernels import GPU_CONFIG, dsd, gmm, grouped_schedule, sdd
from repro.megablocks.reference import MLPS, activation, route
from repro.megablocks.topology import check_block_size, moe_topology, permute

IMPLS = ("sparse", "grouped")


def _check_mlp(mlp: str) -> None:
    if mlp not in MLPS:
        raise ValueError(f"mlp={mlp!r}: expected one of {MLPS}")


def _check(x, weights, indices, w1, w2, w3, num_experts, mlp):
    if x.dim() != 2:
        raise ValueError(f"x must be [T, hidden], got shape {tuple(x.shape)}")
    if weights.shape != indices.shape or indices.dim() != 2 or indices.shape[0] != x.shape[0]:
        raise ValueError(
            f"weights and indices must both be [T, k] with T={x.shape[0]}, got {tuple(weights.shape)} "
            f"and {tuple(indices.shape)}"
        )
    _check_mlp(mlp)
    d = x.shape[1]
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if w is None:
            if name == "w3" and mlp == "glu":
                raise ValueError("mlp='glu' needs w3 (the up projection)")
            continue
        if w.dim() != 2 or w.shape[1] != d or w.shape[0] % num_experts:
            raise ValueError(
                f"{name} must be [num_experts * ffn_hidden_size, hidden] = [E f, {d}], got {tuple(w.shape)}"
            )
    if w2.shape != w1.shape or (w3 is not None and w3.shape != w1.shape):
        raise ValueError(f"w1, w2 (and w3) must share one shape, got {tuple(w1.shape)} and {tuple(w2.shape)}")


def _combine(y_sorted: torch.Tensor, perm, weights: torch.Tensor, T: int) -> torch.Tensor:
    """Un-permute and scale (§2): ``out[t] = sum_j weights[t, j] y[(t, j)]``."""
    w_sorted = weights.reshape(-1)[perm.order]
    return y_sorted.new_zeros(T, y_sorted.shape[1]).index_add(0, perm.token, y_sorted * w_sorted[:, None])


def _act(h1: torch.Tensor, h3: torch.Tensor | None, mlp: str) -> torch.Tensor:
    """The expert nonlinearity: the fused SwiGLU kernel where GPU_CONFIG['fused_glue'] is on."""
    if mlp == "glu" and GPU_CONFIG["fused_glue"]:
        return swiglu(h1, h3)
    return activation(h1, h3, mlp)


def _gather(x: torch.Tensor, perm, padded: bool):
    """``(x in expert order, rows [T, k] or None)``: fused or through PyTorch indexing."""
    if GPU_CONFIG["fused_glue"]:
        rows = slot_rows(perm.order, perm.dest, x.shape[0], perm.top_k)
        return expand(x, rows, perm.padded_rows), rows
    if padded:
        return x.new_zeros(perm.padded_rows, x.shape[1]).index_put((perm.dest,), x[perm.token]), None
    return x[perm.token], None


def _scatter(y: torch.Tensor, perm, rows, weights: torch.Tensor, T: int) -> torch.Tensor:
    if rows is not None:
        return combine(y, rows, weights)
    return _combine(y[perm.dest] if y.shape[0] != perm.dest.numel() else y, perm, weights, T)


def dmoe_sparse(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    num_experts: int,
    mlp: str = "mlp",
    block_size: int = 128,
) -> torch.Tensor:
    """dMoE with block-sparse kernels. ``x [T, d]``, ``weights, indices [T, k]``, ``w* [E f, d]``
    -> ``[T, d]``; every (token, choice) is computed (no capacity)."""
    check_block_size(block_size)
    _check(x, weights, indices, w1, w2, w3, num_experts, mlp)
    ffn = w1.shape[0] // num_experts
    T = x.shape[0]
    with torch.no_grad():
        perm = permute(indices, num_experts, block_size)
        topo = moe_topology(perm.padded_counts, ffn, block_size)
    # gather into expert order, each expert's group padded with zero rows to a multiple of b
    x_pad, rows = _gather(x, perm, padded=True)
    h1 = sdd(x_pad, w1.t(), topo)  # [nnz, b, b]: only the block-diagonal blocks of X W1
    h3 = sdd(x_pad, w3.t(), topo) if mlp == "glu" else None
    a = _act(h1, h3, mlp)  # on the stored blocks only
    y_pad = dsd(a, w2, topo)  # [P, d]
    return _scatter(y_pad, perm, rows, weights, T)


def dmoe_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    num_experts: int,
    mlp: str = "mlp",
) -> torch.Tensor:
    """dMoE with our Triton grouped GEMM over the unpadded groups; arguments as :func:`dmoe_sparse`."""
    _check(x, weights, indices, w1, w2, w3, num_experts, mlp)
    E, d = num_experts, x.shape[1]
    ffn = w1.shape[0] // E
    with torch.no_grad():
        perm = permute(indices, E, 1)
        sched = grouped_schedule(perm.counts)
    xs, rows = _gather(x, perm, padded=False)
    h1 = gmm(xs, w1.view(E, ffn, d).transpose(1, 2), perm.counts, sched)
    h3 = gmm(xs, w3.view(E, ffn, d).transpose(1, 2), perm.counts, sched) if mlp == "glu" else None
    y = gmm(_act(h1, h3, mlp), w2.view(E, ffn, d), perm.counts, sched)
    return _scatter(y, perm, rows, weights, x.shape[0])


class dMoE(nn.Module):  # noqa: N801 (the paper's name)
    """Dropless mixture-of-experts layer (gale2022megablocks §4).

    ``dMoE(hidden_size, ffn_hidden_size, num_experts, top_k, *, mlp="mlp"|"glu",
    impl="sparse"|"grouped", block_size=128)``; ``forward(x)`` takes ``[T, hidden]`` or
    ``[B, S, hidden]`` and returns the same shape. Parameters: ``router [E, hidden]`` and the expert
    weights ``w1, w2`` (and ``w3`` for GLU), each ``[E f, hidden]``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        mlp: str = "mlp",
        impl: str = "sparse",
        block_size: int = 128,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts}: expected at least 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= num_experts={num_experts}")
        _check_mlp(mlp)
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
        if impl == "sparse":
            check_block_size(block_size)
            if ffn_hidden_size % block_size:
                raise ValueError(
                    f"ffn_hidden_size={ffn_hidden_size} must be a multiple of block_size={block_size} "
                    "for impl='sparse'"
                )
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.mlp, self.impl, self.block_size = mlp, impl, block_size
        kw = {"device": device, "dtype": dtype}
        rows = num_experts * ffn_hidden_size
        self.router = nn.Parameter(torch.randn(num_experts, hidden_size, **kw) / math.sqrt(hidden_size))
        self.w1 = nn.Parameter(torch.randn(rows, hidden_size, **kw) / math.sqrt(hidden_size))
        self.w2 = nn.Parameter(torch.randn(rows, hidden_size, **kw) / math.sqrt(ffn_hidden_size))
        self.w3 = (
            nn.Parameter(torch.randn(rows, hidden_size, **kw) / math.sqrt(hidden_size))
            if mlp == "glu"
            else None
        )

    def experts(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The expert computation for a given routing: ``x [T, d]``, ``weights, indices [T, k]``."""
        if self.impl == "sparse":
            return dmoe_sparse(
                x, weights, indices, self.w1, self.w2, self.w3, self.num_experts, self.mlp, self.block_size
            )
        return dmoe_grouped(x, weights, indices, self.w1, self.w2, self.w3, self.num_experts, self.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x must be [T, {self.hidden_size}] or [B, S, {self.hidden_size}], got {tuple(x.shape)}"
            )
        flat = x.reshape(-1, self.hidden_size)
        weights, indices = route(flat, self.router, self.top_k)
        return self.experts(flat, weights, indices).view(x.shape)
