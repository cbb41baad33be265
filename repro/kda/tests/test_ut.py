"""kda/ut-transform: forward substitution equals torch.linalg.solve_triangular on random chunks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.kda import ut_transform
from repro.kda.chunk_torch import chunk_matrices
from repro.kda.tests.strategies import make_case


@pytest.mark.claim("kda/ut-transform", section="§3.1")
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    C=st.sampled_from([1, 2, 16, 32, 64]),
    K=st.sampled_from([16, 32, 128]),
    g_max=st.sampled_from([0.0, 1.0, 10.0]),
)
def test_ut_transform_equals_triangular_solve(seed, C, K, g_max):
    """A built as in a real chunk (normalised keys, gates, betas); fp64, so 1e-10 is rounding."""
    case = make_case(seed=seed, B=1, T=C, H=1, group=1, K=K, V=16, g_max=g_max, with_h0=False)
    G = case.g[0, :, 0].cumsum(0)
    A_kk, _ = chunk_matrices(case.q[0, :, 0], case.k[0, :, 0], G, case.beta[0, :, 0], 1.0)
    eye = torch.eye(C, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(eye + A_kk, eye, upper=False, unitriangular=True)
    got = ut_transform(A_kk)
    assert_rel_close(got, expected, 1e-10, "(I + A)^-1")
    assert torch.equal(got.triu(1), torch.zeros_like(got).triu(1)), "the inverse must stay lower-triangular"
