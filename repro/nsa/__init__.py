"""Native Sparse Attention (yuan2025nsa): three gated branches with Triton kernels.

Public API (shapes as flash-linear-attention: q [B, T, HQ, Dk], k [B, T, H, Dk], v [B, T, H, Dv], H
dividing HQ; Dk up to 192 and Dv up to 128, sizes the kernels do not tile zero-padded, ``common.py``)::

    from repro.nsa import NSA, NSAConfig, Switches
    layer = NSA(dim=2560, n_heads=64, n_kv_heads=4, head_dim=192, value_head_dim=128)  # the paper's, §4.1
    y = layer(x)                                                     # x [B, T, dim] -> [B, T, dim]

    from repro.nsa import selected_attention, compressed_attention, sliding_window_attention
    o = selected_attention(q, k, v, block_indices, block_size=64)   # block_indices [B, T, H, S], -1 = none
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, block_len=32, stride=16)
    k_cmp = compress(k, phi, block_len=32, stride=16)                # phi: CompressionMLP or mean_pool
    scores = selection_scores(q, k_cmp, lse, num_blocks, ...)         # Eqs. 8-10, [B, T, H, Ns]
    idx = select_blocks(scores, n_select=16, select_len=64)           # top-n with initial + local blocks
    o, idx = nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    o, idx, tokens = nsa_decode(q1, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates1)

Every kernel entry point takes ``switches=Switches(...)`` (``config.py``), the kernel choices; the
defaults are the measured fastest. One file per stage of the paper's §3: ``compression.py`` (§3.3.1,
Eq. 7), ``selection.py`` (scores and top-n, Eqs. 8-11), ``selected.py`` (the selected branch, Eq. 12,
and §3.4's kernel), ``window.py`` (§3.3.3), ``gate.py`` (Eq. 5), ``decode.py`` (§5.2), ``layer.py``
(the layer, §3.2); ``common.py`` holds what their kernels share. ``repro.nsa.reference`` holds the
same functions in plain PyTorch (the ground truth); ``repro.nsa.lab`` the sweeps and diagnosis, which
nothing here imports.
"""

from __future__ import annotations

from repro.nsa.compression import compressed_attention
from repro.nsa.config import Switches
from repro.nsa.decode import nsa_decode
from repro.nsa.layer import NSA, nsa_attention
from repro.nsa.reference import (
    CompressionMLP,
    NSAConfig,
    compress,
    mean_pool,
    select_blocks,
    tokens_read,
)
from repro.nsa.selected import selected_attention
from repro.nsa.selection import selection_scores
from repro.nsa.window import sliding_window_attention

__all__ = [
    "NSA",
    "CompressionMLP",
    "NSAConfig",
    "Switches",
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
