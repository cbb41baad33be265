"""The benchmark's shapes and routings, shared by ``bench.py`` and the peer's probe (``peer.py``).

* ``64e-top8``: 64 experts, top-8, hidden 2048, ffn 1408 (DeepSeek-V2-Lite / Qwen-MoE-like), T = 16384;
* ``8e-top2``: 8 experts, top-2, hidden 4096, ffn 14336 (Mixtral-like), T = 8192.

Routings, fixed for every candidate: ``balanced`` (every expert gets exactly T k / E assignments) and
``skewed`` (each token draws its k experts without replacement with probability proportional to
1 / (rank + 1)^SKEW).
"""

from __future__ import annotations

import torch

SHAPES = {
    "64e-top8": dict(E=64, k=8, d=2048, f=1408, T=16384),
    "8e-top2": dict(E=8, k=2, d=4096, f=14336, T=8192),
}
QUICK_TOKENS = {"64e-top8": 4096, "8e-top2": 2048}
ROUTINGS = ("balanced", "skewed")
SKEW = 1.2
MLP = "glu"


def make_routing(T: int, E: int, k: int, routing: str, device, seed: int = 0):
    """``weights [T, k]`` (positive, rows summing to one) and distinct ``indices [T, k]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if routing == "balanced":
        # token t takes experts (t k + j) mod E: every expert exactly T k / E times when E | T k
        base = (torch.arange(T, device=device)[:, None] * k + torch.arange(k, device=device)) % E
        indices = base[torch.randperm(T, device=device, generator=gen)]
    elif routing == "skewed":
        p = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32) ** SKEW
        indices = torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
    else:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    weights = torch.softmax(torch.randn(T, k, device=device, generator=gen), -1)
    return weights, indices


def bench_shapes(quick: bool) -> dict:
    """The shapes of a run: ``--quick`` has 64e-top8 only, at fewer tokens."""
    if quick:
        return {"64e-top8": dict(SHAPES["64e-top8"], T=QUICK_TOKENS["64e-top8"])}
    return SHAPES
