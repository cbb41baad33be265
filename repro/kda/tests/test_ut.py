"""kda/ut-transform: the inverse of the chunk's unit lower-triangular matrix, four ways, against
torch.linalg.solve_triangular: forward substitution (ut_transform), the blocked form with a
nilpotent series (ut_transform_blocked), the blocked form with repeated squaring
(ut_transform_doubling), and the Triton intra-chunk kernel, which uses the last and stores T for
the backward pass.

Tolerances: fp64 1e-10 (rounding). The Triton kernel runs in fp32 (ieee dots for fp32 inputs):
1e-5, since T's entries are sums of products along chains of up to 64 rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.kda import ut_transform
from repro.kda.chunk import BT, kda_fwd_triton
from repro.kda.chunk_torch import chunk_matrices, ut_transform_blocked, ut_transform_doubling
from repro.kda.tests.strategies import HEAD_DIMS, make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _chunk_A(case, C):
    G = case.g[0, :C, 0].cumsum(0)
    A_kk, _ = chunk_matrices(case.q[0, :C, 0], case.k[0, :C, 0], G, case.beta[0, :C, 0], 1.0)
    return A_kk


def _solve(A):
    eye = torch.eye(A.shape[-1], dtype=A.dtype)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


@pytest.mark.claim("kda/ut-transform", section="§3.1 (arXiv v2)")
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    C=st.sampled_from([1, 2, 16, 32, 64]),
    K=st.sampled_from([16, 32, 128]),
    g_max=st.sampled_from([0.0, 1.0, 10.0]),
)
def test_ut_transform_equals_triangular_solve(seed, C, K, g_max):
    """A built as in a real chunk (normalised keys, gates, betas), in fp64."""
    case = make_case(seed=seed, B=1, T=C, H=1, group=1, K=K, V=16, g_max=g_max, with_h0=False)
    A_kk = _chunk_A(case, C)
    expected = _solve(A_kk)
    ways = [("substitution", ut_transform(A_kk)), ("blocked", ut_transform_blocked(A_kk))]
    ways.append(("doubling", ut_transform_doubling(A_kk)))
    for name, got in ways:
        assert_rel_close(got, expected, 1e-10, f"(I + A)^-1 by {name}")
        assert torch.equal(got.triu(1), torch.zeros_like(got)), (
            f"{name}: the inverse must stay lower-triangular"
        )


@pytest.mark.claim("kda/ut-transform", section="§3.1 (arXiv v2)")
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 128), g_max=st.sampled_from([0.01, 2.0, 10.0]))
def test_triton_ut_transform_equals_triangular_solve(seed, T, g_max):
    K = HEAD_DIMS[-1]
    case = make_case(seed=seed, B=1, T=T, H=1, group=1, K=K, V=16, g_max=g_max, with_h0=False)
    args = [x.to(DEVICE, torch.float32) for x in (case.q, case.k, case.v, case.g, case.beta)]
    _, _, saved = kda_fwd_triton(*args, K**-0.5, None, False)
    T_kernel = saved["T_ut"][0, :, 0].cpu().double()  # [T, BT]: row r holds row r % BT of its chunk's T
    for start in range(0, T, BT):
        rows = min(BT, T - start)

        def chunk(x, start=start, rows=rows):
            # one chunk of one head, zero-padded to BT rows as the kernel pads the tail
            x = x[0, start : start + rows, 0]
            return torch.cat([x, x.new_zeros(BT - rows, *x.shape[1:])])

        G = chunk(case.g).cumsum(0)
        A_kk, _ = chunk_matrices(chunk(case.q), chunk(case.k), G, chunk(case.beta), 1.0)
        expected = _solve(A_kk)[:rows, :rows]
        assert_rel_close(T_kernel[start : start + rows, :rows], expected, 1e-5, f"Triton T, chunk at {start}")
