"""The sliding-window branch (yuan2025nsa §3.3.3): query t attends to keys t - w < s <= t, through the
strided-attention kernels of ``compression.py`` with stride 1, offset 0 and the window w. Only the
forward's tile is the window's own (:func:`window_tile`); the backward is the compressed branch's.

``Switches.window_kernel = "fa4"`` runs it through ``repro.fa4``'s attention with a sliding window
instead (flash-attn's ``window_size = (w - 1, 0)``), where this checkout's repro.fa4 has one
(:func:`fa4_window_available`); off by default until it has run on a GPU."""

from __future__ import annotations

import torch

from repro.nsa.common import check_qkv, interpreting, kernel_dims, pad_heads, softmax_scale
from repro.nsa.compression import StridedAttention, forward_tile
from repro.nsa.config import Switches


def window_tile(d: int, itemsize: int) -> dict:
    """The window's forward tile: 64 x 64 with 4 warps and 3 stages. A 128-query tile reads 639 keys
    for 512 a query (the tile's rows are 127 positions apart), a 64-query tile 575. Measured on an H100
    at T = 64k, w = 512, bf16 (2026-11-27, 5 interleaved rounds, results/*-strided-sweep.json): 3.83 ms
    against 4.79 ms with the compressed branch's 128 x 64 shape. fp32 and the interpreter take the
    compressed branch's (:func:`compression.forward_tile`)."""
    if interpreting() or itemsize > 2:
        return forward_tile(d, itemsize)
    return {"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 3}


def fa4_window_available() -> tuple[bool, str]:
    """Whether ``repro.fa4.attention`` takes a sliding window here, and why not (its window is the
    work of another branch of issue #39; this is the hook that waits for it)."""
    import inspect

    try:
        from repro.fa4 import api
    except Exception as exc:  # an optional path: say why
        return False, f"import repro.fa4 failed: {type(exc).__name__}: {exc}"
    if "window" not in inspect.signature(api.attention).parameters:
        return False, "repro.fa4.attention takes no sliding window in this checkout"
    return True, ""


def fa4_window_attention(q, k, v, window: int, scale: float) -> torch.Tensor:
    """The window branch through repro.fa4 (``Switches.window_kernel = "fa4"``): causal attention with
    flash-attn's window (w - 1, 0), i.e. keys t - w < s <= t. repro.fa4 pads head sizes itself; its
    interpreter entry point (``attention_any_d``, float32 and small tiles) under TRITON_INTERPRET=1."""
    ok, why = fa4_window_available()
    if not ok:
        raise RuntimeError(f"sliding_window_attention: Switches.window_kernel = 'fa4' cannot run: {why}")
    from repro.fa4 import api

    fn = api.attention_any_d if interpreting() else api.attention
    return fn(q, k, v, causal=True, scale=scale, window=(int(window) - 1, 0))


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int = 512,
    scale: float | None = None,
    switches: Switches | None = None,
) -> torch.Tensor:
    """Sliding-window branch (§3.3.3): query t attends keys t - w < s <= t. q [B, T, HQ, Dk];
    k [B, T, H, Dk], v [B, T, H, Dv]. Returns [B, T, HQ, Dv]. Head sizes the kernels do not take are
    zero-padded (``common.kernel_dims``)."""
    b, t, hq, h, dk, dv = check_qkv("sliding_window_attention", q, k, v, k_len=q.shape[1])
    if window < 1:
        raise ValueError(f"sliding_window_attention: window must be >= 1, got {window}")
    scale = softmax_scale(scale, dk)
    if (switches or Switches()).window_kernel == "fa4":
        return fa4_window_attention(q, k, v, window, scale)
    dk_k, dv_k = kernel_dims(dk, dv)
    q, k, v = pad_heads(q, dk_k), pad_heads(k, dk_k), pad_heads(v, dv_k)
    tile = window_tile(max(dk_k, dv_k), q.element_size())
    o = StridedAttention.apply(q, k, v, scale, 1, 0, int(window), tile, switches or Switches())[0]
    return o if dv_k == dv else o[..., :dv]
