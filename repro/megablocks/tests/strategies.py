"""Hypothesis strategies: small MoE problems with drawn routings (random, skewed, all to one expert)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

ROUTINGS = ("random", "skewed", "one-expert")


@dataclass
class MoECase:
    x: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    num_experts: int
    routing: str

    def tensors(self, dtype: torch.dtype, requires_grad: bool = False) -> list[torch.Tensor]:
        """x, weights, w1, w2, w3 in ``dtype`` (leaves, optionally requiring grad)."""
        return [
            t.to(dtype).detach().requires_grad_(requires_grad)
            for t in (self.x, self.weights, self.w1, self.w2, self.w3)
        ]


def make_routing(
    gen: torch.Generator, T: int, E: int, k: int, routing: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token from structured logits, weights softmax-renormalised."""
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64)
    if routing == "skewed":  # a steep per-expert bias: some experts crowded, some empty
        logits = logits + 4.0 * torch.randn(E, generator=gen, dtype=torch.float64)
    elif routing == "one-expert":  # every token's first choice is the same expert
        logits[:, int(torch.randint(E, (1,), generator=gen))] += 100.0
    probs = torch.softmax(logits, -1)
    weights, indices = torch.topk(probs, k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), indices


def make_case(seed: int, T: int, d: int, f: int, E: int, k: int, routing: str) -> MoECase:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64)
    weights, indices = make_routing(gen, T, E, k, routing)
    w1, w2, w3 = (torch.randn(E * f, d, generator=gen, dtype=torch.float64) / d**0.5 for _ in range(3))
    return MoECase(x, weights, indices, w1, w2, w3, E, routing)


@st.composite
def moe_cases(draw, max_T: int = 40, d_choices=(16, 32, 40), f: int = 32) -> MoECase:
    E = draw(st.integers(1, 4))
    k = draw(st.integers(1, min(E, 2)))
    return make_case(
        seed=draw(st.integers(0, 2**31 - 1)),
        T=draw(st.integers(1, max_T)),
        d=draw(st.sampled_from(d_choices)),
        f=f,
        E=E,
        k=k,
        routing=draw(st.sampled_from(ROUTINGS)),
    )
