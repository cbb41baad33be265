"""Cases for ``python -m paperclub.ab`` (issue #40: the stage split must keep speed and outputs):
``repro.kda.chunk_kda`` with its defaults, forward and forward + backward, bf16, 16 heads, K = V =
128, 16k tokens per batch, against causal attention (SDPA, cuDNN) at the same shape as the peer
whose drift is the noise floor. Imports only torch and the public API, so that it runs on a checkout
from before the split as well (``chunk_kda(q, k, v, g, beta)`` there too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repro.kda import chunk_kda

REPS = 15
#: (B, T, pass)
SHAPES = [(2, 8192, "fwd"), (2, 8192, "fwd+bwd"), (8, 2048, "fwd+bwd")]


def _make(b, t, kind, h=16, d=128):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    grad = kind != "fwd"
    g = torch.Generator(device="cuda").manual_seed(b * t)
    q = F.normalize(torch.randn(b, t, h, d, device="cuda", generator=g), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(b, t, h, d, device="cuda", generator=g), dim=-1).to(torch.bfloat16)
    v = torch.randn(b, t, h, d, device="cuda", generator=g).to(torch.bfloat16)
    gate = (F.logsigmoid(torch.randn(b, t, h, d, device="cuda", generator=g)) * 0.5).float()
    beta = torch.rand(b, t, h, device="cuda", generator=g).float()
    do = torch.randn(b, t, h, d, device="cuda", generator=g).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_(grad) for x in (q, k, v, gate, beta)]
    peer_leaves = [x.transpose(1, 2).detach().clone().requires_grad_(grad) for x in (q, k, v)]

    def ours():  # its outputs are what the trees' runs compare
        o = chunk_kda(*leaves)[0]
        return [o, *(torch.autograd.grad(o, leaves, do) if grad else [])]

    def peer():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(*peer_leaves, is_causal=True)
            if grad:
                torch.autograd.grad(o, peer_leaves, do.transpose(1, 2))

    return ours, peer


def cases(args):
    return [(f"{kind} B{b} T{t}", lambda b=b, t=t, kind=kind: _make(b, t, kind)) for b, t, kind in SHAPES]
