"""The NSA layer (yuan2025nsa §3.2, Eq. 5): the three branches on their own keys and values, the
selection between them, and the gated sum; :func:`nsa_attention` with the kernels, :class:`NSA` the
module with its projections, compression MLPs and gates.

The stages, in the order one forward runs them: ``compression.compressed_attention`` (§3.3.1) gives
o_cmp and its log-sum-exp; ``selection.masked_selection_scores`` and ``selection.topk_blocks``
(§3.3.2, Eqs. 8-11) pick each group's n blocks; ``selected.selected_attention`` (Eq. 12) and
``window.sliding_window_attention`` (§3.3.3) run on them; ``gate.gated_sum`` (Eq. 5) mixes the three.
"""

from __future__ import annotations

import torch
from torch import nn

from repro.nsa import reference as ref
from repro.nsa.common import check_gates, check_qkv, check_value_dims, kernel_dims, pad_heads, softmax_scale
from repro.nsa.compression import CompressionMLP, compress, compressed_attention
from repro.nsa.config import Switches
from repro.nsa.gate import gated_sum
from repro.nsa.selected import selected_attention
from repro.nsa.selection import masked_selection_scores, topk_blocks
from repro.nsa.window import sliding_window_attention


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    config: ref.NSAConfig | None = None,
    scale: float | None = None,
    block_indices: torch.Tensor | None = None,
    switches: Switches | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 with the Triton kernels: the same arguments and result as ``reference.nsa_attention``.

    q [B, T, HQ, Dk]; k_cmp [B, Nc, H, Dk], v_cmp [B, Nc, H, Dv]; k_slc, k_win [B, T, H, Dk]; v_slc, v_win
    [B, T, H, Dv]; gates [B, T, HQ, 3]. Returns (o [B, T, HQ, Dv], block_indices [B, T, H, n]).
    Differentiable in everything but the indices (top-n is not differentiated, §3.3.2). ``switches``
    choose the kernels (``config.Switches``). Head sizes the kernels do not take (Dk = 60, Dv = 100)
    are zero-padded once here (``common.kernel_dims``) and the output sliced back.
    """
    sw = switches or Switches()
    cfg = config or ref.NSAConfig()
    cfg.validate()
    b, t, hq, h, dk, dv = check_qkv("nsa_attention", q, k_slc, v_slc, k_len=q.shape[1])
    check_qkv("nsa_attention (window keys)", q, k_win, v_win, k_len=t)
    check_qkv("nsa_attention (compressed keys)", q, k_cmp, v_cmp)
    check_value_dims("nsa_attention", v_cmp, v_slc, v_win)
    check_gates("nsa_attention", gates, (b, t, hq, 3), "[B, T, HQ, 3]")
    scale = softmax_scale(scale, dk)
    dk_k, dv_k = kernel_dims(dk, dv)
    q, k_cmp, k_slc, k_win = (pad_heads(x, dk_k) for x in (q, k_cmp, k_slc, k_win))
    v_cmp, v_slc, v_win = (pad_heads(x, dv_k) for x in (v_cmp, v_slc, v_win))
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, cfg.block_len, cfg.stride, scale, sw)
    if block_indices is None:
        with torch.no_grad():
            # Eq. 11 in two launches: the scores kernel writes the masks too, top-n reads them
            scores = masked_selection_scores(q, k_cmp, lse, cfg, scale, sw)
            block_indices = topk_blocks(scores, cfg.n_select, sw)
            del scores
        check = False
    else:
        check = True
    o_slc = selected_attention(q, k_slc, v_slc, block_indices, cfg.select_len, scale, check, sw)
    o_win = sliding_window_attention(q, k_win, v_win, cfg.window, scale, sw)
    o = gated_sum(gates, o_cmp, o_slc, o_win, sw)
    return (o if dv_k == dv else o[..., :dv]), block_indices


class NSA(nn.Module):
    """An NSA attention layer (§3.2): query projection, separate keys and values for each branch,
    compression MLPs (Eq. 7), sigmoid gates from the input (Eq. 5), output projection.

    x [B, T, dim] -> [B, T, dim]. ``head_dim`` is the query and key head size, ``value_head_dim`` the
    value head size (default ``head_dim``; the paper's model, §4.1, has 192 and 128).
    ``use_kernels=False`` runs ``reference.nsa_attention`` instead of the Triton path (same parameters,
    same function); ``switches`` choose the kernels.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int = 64,
        n_kv_heads: int = 4,
        head_dim: int = 128,
        config: ref.NSAConfig | None = None,
        use_kernels: bool = True,
        switches: Switches | None = None,
        value_head_dim: int | None = None,
    ):
        super().__init__()
        config = config or ref.NSAConfig()  # the paper's l, d, l', n, w
        config.validate()
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"NSA: n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads}")
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        if head_dim < 1 or value_head_dim < 1:
            raise ValueError(
                f"NSA: head sizes must be >= 1, got head_dim {head_dim}, value_head_dim {value_head_dim}"
            )
        self.config, self.use_kernels, self.switches = config, use_kernels, switches or Switches()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.value_head_dim = value_head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        # keys and values of the three branches: independent projections (§3.2)
        self.k_proj = nn.Linear(dim, 3 * n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, 3 * n_kv_heads * value_head_dim, bias=False)
        self.compress_k = CompressionMLP(config.block_len, head_dim)
        self.compress_v = CompressionMLP(config.block_len, value_head_dim)
        self.gate_proj = nn.Linear(dim, n_heads * 3)
        self.o_proj = nn.Linear(n_heads * value_head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"NSA: x must be [B, T, dim], got shape {tuple(x.shape)}")
        b, t, _ = x.shape
        cfg = self.config
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k_c, k_s, k_w = self.k_proj(x).view(b, t, 3, self.n_kv_heads, self.head_dim).unbind(2)
        v_c, v_s, v_w = self.v_proj(x).view(b, t, 3, self.n_kv_heads, self.value_head_dim).unbind(2)
        k_cmp = compress(k_c, self.compress_k, cfg.block_len, cfg.stride)
        v_cmp = compress(v_c, self.compress_v, cfg.block_len, cfg.stride)
        gates = torch.sigmoid(self.gate_proj(x)).view(b, t, self.n_heads, 3)
        if self.use_kernels:
            o, _ = nsa_attention(q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates, cfg, switches=self.switches)
        else:
            o, _ = ref.nsa_attention(q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates, cfg)
        return self.o_proj(o.to(x.dtype).reshape(b, t, -1))
