"""Megatron-LM's tensor parallelism (shoeybi2019megatron §3): the MLP and attention blocks split over
``t`` ranks so that each block needs one all-reduce in the forward pass and one in the backward.

MLP (§3, Fig. 3a): ``Y = GeLU(X A)`` with A split by columns, ``A = [A_1, ..., A_t]``, so rank i
computes ``Y_i = GeLU(X A_i)`` with no communication (GeLU is elementwise; splitting A by rows would
need a sum before it). B is split by rows, ``B = [B_1; ...; B_t]``, so ``Z = sum_i Y_i B_i``: one
all-reduce (``g``) before dropout. The input X reaches every rank through ``f`` (identity; its
backward all-reduces the input gradient, which each rank only knows in part).

Self-attention (§3, Fig. 3b): the heads are split, rank i holding heads ``i a/t ... (i+1) a/t - 1``:
the Q, K, V projections are column-parallel (each rank computes its heads' Q, K, V and their attention
locally) and the output projection is row-parallel, again followed by one all-reduce.

A transformer layer therefore runs two all-reduces in its forward pass and two in its backward
(§3, Fig. 4), counted by :func:`repro.parallelism.comm.count_collectives`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repro.parallelism.comm import copy_to_tensor_parallel, group_size, reduce_from_tensor_parallel
from repro.parallelism.reference import LayerWeights, attention_core, dropout, merge_heads, split_heads

__all__ = ["check_divisible", "parallel_attention", "parallel_layer", "parallel_mlp", "shard_weights"]


def check_divisible(h: int, heads: int, ffn: int, t: int, where: str) -> None:
    """Tensor parallelism over t ranks needs t to divide the heads (hence h) and the MLP width."""
    if h % heads:
        raise ValueError(f"{where}: hidden size h={h} is not divisible by heads a={heads}")
    if heads % t:
        raise ValueError(f"{where}: heads a={heads} is not divisible by the tensor-parallel size t={t}")
    if ffn % t:
        raise ValueError(f"{where}: MLP width {ffn} is not divisible by the tensor-parallel size t={t}")


def shard_weights(w: LayerWeights, heads: int, rank: int, t: int) -> LayerWeights:
    """Rank ``rank``'s shard of a whole layer's weights (new leaf tensors that require grad).

    Column-parallel: the Q, K, V columns of this rank's heads, A's columns and their biases.
    Row-parallel: the matching rows of the output projection and of B. Layer norms and the biases
    added after the reduction (b_o, b_B) are replicated."""
    h = w.w_qkv.shape[0]
    ffn = w.w_1.shape[1]
    check_divisible(h, heads, ffn, t, "shard_weights")
    if not 0 <= rank < t:
        raise ValueError(f"shard_weights: rank must be in [0, {t}), got {rank}")
    h_l, f_l = h // t, ffn // t
    cols = torch.cat([torch.arange(j * h + rank * h_l, j * h + (rank + 1) * h_l) for j in range(3)])
    mine = slice(rank * h_l, (rank + 1) * h_l)
    ff = slice(rank * f_l, (rank + 1) * f_l)
    raw = LayerWeights(
        ln1_w=w.ln1_w,
        ln1_b=w.ln1_b,
        w_qkv=w.w_qkv[:, cols],
        b_qkv=w.b_qkv[cols],
        w_o=w.w_o[mine, :],
        b_o=w.b_o,
        ln2_w=w.ln2_w,
        ln2_b=w.ln2_b,
        w_1=w.w_1[:, ff],
        b_1=w.b_1[ff],
        w_2=w.w_2[ff, :],
        b_2=w.b_2,
    )
    return raw.map(lambda t_: t_.detach().clone().contiguous().requires_grad_(True))


def parallel_mlp(y: torch.Tensor, w: LayerWeights, group) -> torch.Tensor:
    """The MLP block on this rank's shard. y: [s, b, h] (the same on every rank) -> [s, b, h]."""
    y = copy_to_tensor_parallel(y, group)  # f
    partial = F.gelu(y @ w.w_1 + w.b_1) @ w.w_2  # Y_i B_i
    return reduce_from_tensor_parallel(partial, group) + w.b_2  # g, then the bias once


def parallel_attention(y: torch.Tensor, w: LayerWeights, heads: int, group, p_attn: float) -> torch.Tensor:
    """The self-attention block on this rank's heads. y: [s, b, h] (the same on every rank) -> [s, b, h]."""
    t = group_size(group)
    y = copy_to_tensor_parallel(y, group)  # f
    q, k, v = split_heads(y @ w.w_qkv + w.b_qkv, heads // t)
    partial = merge_heads(attention_core(q, k, v, p_attn)) @ w.w_o
    return reduce_from_tensor_parallel(partial, group) + w.b_o  # g


def parallel_layer(x: torch.Tensor, w: LayerWeights, heads: int, group, p_drop: float = 0.0) -> torch.Tensor:
    """A whole layer with Megatron's tensor parallelism. x: [s, b, h], replicated on the group's ranks;
    w: this rank's :func:`shard_weights`. Returns [s, b, h], the same on every rank."""
    s, b, h = x.shape
    check_divisible(h, heads, w.w_1.shape[1] * group_size(group), group_size(group), "parallel_layer")
    x1 = x + dropout(
        parallel_attention(F.layer_norm(x, (h,), w.ln1_w, w.ln1_b), w, heads, group, p_drop), p_drop
    )
    return x1 + dropout(parallel_mlp(F.layer_norm(x1, (h,), w.ln2_w, w.ln2_b), w, group), p_drop)
