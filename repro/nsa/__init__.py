"""Native Sparse Attention (yuan2025nsa): three gated branches with Triton kernels.

Public API (shapes as flash-linear-attention: q [B, T, HQ, D], k, v [B, T, H, D], H dividing HQ)::

    from repro.nsa import NSA, NSAConfig
    layer = NSA(dim=1024, n_heads=64, n_kv_heads=4, head_dim=128)   # the paper's defaults in NSAConfig
    y = layer(x)                                                     # x [B, T, dim] -> [B, T, dim]

    from repro.nsa import selected_attention, compressed_attention, sliding_window_attention
    o = selected_attention(q, k, v, block_indices, block_size=64)   # block_indices [B, T, H, S], -1 = none
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, block_len=32, stride=16)
    k_cmp = compress(k, phi, block_len=32, stride=16)                # phi: CompressionMLP or mean_pool
    scores = selection_scores(q, k_cmp, lse, num_blocks, ...)         # Eqs. 8-10, [B, T, H, Ns]
    idx = select_blocks(scores, n_select=16, select_len=64)           # top-n with initial + local blocks
    o, idx = nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    o, idx, tokens = nsa_decode(q1, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates1)

``repro.nsa.reference`` holds the same functions in plain PyTorch (the ground truth).
"""

from __future__ import annotations

import torch
from torch import nn

from repro.nsa.ops import (
    compressed_attention,
    nsa_attention,
    nsa_decode,
    selected_attention,
    selection_scores,
    sliding_window_attention,
)
from repro.nsa.reference import (
    CompressionMLP,
    NSAConfig,
    compress,
    mean_pool,
    select_blocks,
    tokens_read,
)

__all__ = [
    "NSA",
    "CompressionMLP",
    "NSAConfig",
    "compress",
    "compressed_attention",
    "mean_pool",
    "nsa_attention",
    "nsa_decode",
    "select_blocks",
    "selected_attention",
    "selection_scores",
    "sliding_window_attention",
    "tokens_read",
]


class NSA(nn.Module):
    """An NSA attention layer (§3.2): query projection, separate keys and values for each branch,
    compression MLPs (Eq. 7), sigmoid gates from the input (Eq. 5), output projection.

    x [B, T, dim] -> [B, T, dim]. ``use_kernels=False`` runs ``reference.nsa_attention`` instead of
    the Triton path (same parameters, same function).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int = 64,
        n_kv_heads: int = 4,
        head_dim: int = 128,
        config: NSAConfig | None = None,
        use_kernels: bool = True,
    ):
        super().__init__()
        config = config or NSAConfig()  # the paper's l, d, l', n, w
        config.validate()
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"NSA: n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads}")
        self.config, self.use_kernels = config, use_kernels
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        # keys and values of the three branches: independent projections (§3.2)
        self.kv_proj = nn.Linear(dim, 3 * 2 * n_kv_heads * head_dim, bias=False)
        self.compress_k = CompressionMLP(config.block_len, head_dim)
        self.compress_v = CompressionMLP(config.block_len, head_dim)
        self.gate_proj = nn.Linear(dim, n_heads * 3)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from repro.nsa import reference

        if x.dim() != 3:
            raise ValueError(f"NSA: x must be [B, T, dim], got shape {tuple(x.shape)}")
        b, t, _ = x.shape
        cfg = self.config
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        kv = self.kv_proj(x).view(b, t, 6, self.n_kv_heads, self.head_dim)
        k_c, v_c, k_s, v_s, k_w, v_w = kv.unbind(2)
        k_cmp = compress(k_c, self.compress_k, cfg.block_len, cfg.stride)
        v_cmp = compress(v_c, self.compress_v, cfg.block_len, cfg.stride)
        gates = torch.sigmoid(self.gate_proj(x)).view(b, t, self.n_heads, 3)
        fn = nsa_attention if self.use_kernels else reference.nsa_attention
        o, _ = fn(q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates, cfg)
        return self.o_proj(o.to(x.dtype).reshape(b, t, -1))
