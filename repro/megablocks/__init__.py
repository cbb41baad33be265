"""MegaBlocks (gale2022megablocks): dropless mixture-of-experts with block-sparse Triton kernels.

Public API:

* :class:`dMoE` (hidden_size, ffn_hidden_size, num_experts, top_k, *, mlp="mlp"|"glu",
  impl="sparse"|"grouped", block_size=128): ``nn.Module``, ``[T, d]`` or ``[B, S, d]`` in and out.
* :func:`dmoe_sparse`, :func:`dmoe_grouped` (x, weights, indices, w1, w2, w3, num_experts, mlp, ...):
  the layer for a given routing (``weights, indices [T, k]``; ``w* [E f, d]``).
* :func:`sdd`, :func:`dsd`, :func:`dds` on a :class:`Topology` (block-sparse products, differentiable);
  :func:`gmm` (grouped matmul); :func:`moe_topology`, :func:`topology_from_mask`, :func:`permute`.
* References: :func:`route` (top-k softmax router), :func:`moe_reference` (token by token),
  :func:`moe_dense`, :func:`moe_per_expert`, :func:`capacity_moe` (capacity-factor baseline, returns the kept mask).
"""

from __future__ import annotations

from repro.megablocks.kernels import dds, dsd, gmm, sdd
from repro.megablocks.moe import dMoE, dmoe_grouped, dmoe_sparse
from repro.megablocks.reference import capacity, capacity_moe, moe_dense, moe_per_expert, moe_reference, route
from repro.megablocks.topology import Permutation, Topology, moe_topology, permute, topology_from_mask

__all__ = [
    "Permutation",
    "Topology",
    "capacity",
    "capacity_moe",
    "dMoE",
    "dds",
    "dmoe_grouped",
    "dmoe_sparse",
    "dsd",
    "gmm",
    "moe_dense",
    "moe_per_expert",
    "moe_reference",
    "moe_topology",
    "permute",
    "route",
    "sdd",
    "topology_from_mask",
]
