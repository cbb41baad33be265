"""Cases for ``python -m paperclub.ab`` (issue #40: the stage split must keep speed and outputs):
``repro.fa4.attention`` with its defaults, forward and forward + backward, bf16, D = 128, 16 heads,
against cuDNN (SDPA) in the same process. Imports only torch and the public API, so that it runs on
a checkout from before the split as well (``attention(q, k, v, causal=...)`` there too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repro.fa4 import attention

REPS = 15
#: (B, S, causal, pass): the paper's 16k tokens per batch at 2k and 8k
SHAPES = [(8, 2048, True, "fwd"), (2, 8192, False, "fwd"), (2, 8192, True, "fwd"),
          (2, 8192, False, "fwd+bwd"), (2, 8192, True, "fwd+bwd")]  # fmt: skip


def _make(b, s, causal, kind, h=16, d=128):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(b * s + causal)
    q, k, v, do = (
        torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)
    )
    leaves = [t.clone().requires_grad_(kind != "fwd") for t in (q, k, v)]
    peer_leaves = [t.transpose(1, 2).detach().clone().requires_grad_(kind != "fwd") for t in (q, k, v)]

    def ours():  # its outputs are what the trees' runs compare
        o = attention(*leaves, causal=causal)
        return [o, *(torch.autograd.grad(o, leaves, do) if kind != "fwd" else [])]

    def peer():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(*peer_leaves, is_causal=causal)
            if kind != "fwd":
                torch.autograd.grad(o, peer_leaves, do.transpose(1, 2))

    return ours, peer


def cases(args):
    return [(f"{kind} B{b} S{s} causal={c}", lambda b=b, s=s, c=c, kind=kind: _make(b, s, c, kind))
            for b, s, c, kind in SHAPES]  # fmt: skip
