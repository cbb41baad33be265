"""Hypothesis strategies for KDA inputs: small shapes, gates and learning rates in range."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st


@dataclass
class KDACase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor | None

    def tensors(self, dtype: torch.dtype) -> list:
        return [
            None if x is None else x.to(dtype) for x in (self.q, self.k, self.v, self.g, self.beta, self.h0)
        ]


def make_case(
    seed: int, B: int, T: int, H: int, group: int, K: int, V: int, g_max: float, with_h0: bool
) -> KDACase:
    """Random inputs in fp64. k is L2-normalised per head, as KDA does (§3) so that the
    Householder-like factor I - beta k k^T has eigenvalues in [0, 1]; log-decay g in [-g_max, 0]."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * group
    f64 = torch.float64
    q = torch.randn(B, T, H, K, generator=gen, dtype=f64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=f64)
    g = -g_max * torch.rand(B, T, HV, K, generator=gen, dtype=f64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=f64)
    h0 = torch.randn(B, HV, K, V, generator=gen, dtype=f64) if with_h0 else None
    return KDACase(q, k, v, g, beta, h0)


# On a GPU every new head size is a fresh Triton compile (seconds each); the CPU interpreter
# compiles nothing and covers both sizes, the GPU run one.
HEAD_DIMS = [32] if torch.cuda.is_available() else [16, 32]


@st.composite
def kda_cases(draw, max_T: int = 64, max_B: int = 2, g_choices=(0.01, 0.5, 2.0, 10.0)) -> KDACase:
    return make_case(
        seed=draw(st.integers(0, 2**31 - 1)),
        B=draw(st.integers(1, max_B)),
        T=draw(st.integers(1, max_T)),
        H=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2])),
        K=draw(st.sampled_from(HEAD_DIMS)),
        V=draw(st.sampled_from(HEAD_DIMS)),
        # from almost no decay to the strongest the kernels support (g >= -10 per token)
        g_max=draw(st.sampled_from(g_choices)),
        with_h0=draw(st.booleans()),
    )
