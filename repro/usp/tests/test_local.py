"""The pieces the ring is built from, on one process: the LSE merge and the local backends' LSE.

Tolerances: float64 1e-12 (rounding only); fa4 runs float32 under the Triton interpreter: 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.usp.local import get_backend
from repro.usp.reference import attention_lse, attention_lse_backward, merge
from repro.usp.tests.sections import RING_SECTION


@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    s_q=st.integers(1, 12),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    h_kv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    scale=st.sampled_from([0.3, 1.0, 4.0]),
)
def test_lse_merge_over_any_key_partition(seed, s_q, cuts, h_kv, group, scale):
    """Attention over any partition of the keys into blocks, merged through the LSE in any order,
    equals attention over all keys (the ring's online softmax); large scales test the stability."""
    gen = torch.Generator().manual_seed(seed)
    s_k = sum(cuts)
    q = torch.randn(2, s_q, h_kv * group, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, s_k, h_kv, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    o_full, lse_full = attention_lse(q, k, v, scale=scale)
    bounds = torch.tensor([0, *cuts]).cumsum(0).tolist()
    blocks = [(bounds[i], bounds[i + 1]) for i in range(len(cuts))]
    order = torch.randperm(len(blocks), generator=gen).tolist()
    out = torch.zeros_like(o_full)
    lse = torch.full_like(lse_full, float("-inf"))
    for i in order:
        a, b = blocks[i]
        out, lse = merge(out, lse, *attention_lse(q, k[:, a:b], v[:, a:b], scale=scale))
    assert_rel_close(out, o_full, 1e-12, "merged output")
    assert_rel_close(lse, lse_full, 1e-12, "merged lse")
    # the backward of each block with the row's final O and LSE sums to the full gradients
    do = torch.randn(o_full.shape, generator=gen, dtype=torch.float64)
    want = attention_lse_backward(do, q, k, v, o_full, lse_full, scale=scale)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b in blocks:
        dq_b, dk_b, dv_b = attention_lse_backward(do, q, k[:, a:b], v[:, a:b], o_full, lse_full, scale=scale)
        dq += dq_b
        dks.append(dk_b)
        dvs.append(dv_b)
    assert_rel_close(dq, want[0], 1e-12, "dq")
    assert_rel_close(torch.cat(dks, 1), want[1], 1e-12, "dk")
    assert_rel_close(torch.cat(dvs, 1), want[2], 1e-12, "dv")


def _block_check(backend: str, dtype, tol: float, seed: int, s: int, causal: bool, d: int) -> None:
    """One block of a row whose other keys live elsewhere: forward LSE and the backward with the row's
    final O/LSE, against the explicit-math reference."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, s, 4, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2 * s, 2, d, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, s, 4, d, generator=gen, dtype=torch.float64)
    scale = d**-0.5
    # the block: the last s keys (square, so causal applies); the row also sees the first s keys fully
    o1, l1 = attention_lse(q, k[:, :s], v[:, :s], scale=scale)
    o2, l2 = attention_lse(q, k[:, s:], v[:, s:], causal, scale)
    o_row, lse_row = merge(o1, l1, o2, l2)
    want_fwd = (o2, l2)
    want_bwd = attention_lse_backward(do, q, k[:, s:], v[:, s:], o_row, lse_row, causal, scale)
    be = get_backend(backend)
    t = [x.to(dtype) for x in (q, k[:, s:], v[:, s:], do, o_row)]
    o_b, lse_b, aux = be.forward(t[0], t[1], t[2], causal, scale)
    assert_rel_close(o_b, want_fwd[0], tol, f"{backend} o")
    assert_rel_close(lse_b, want_fwd[1], tol, f"{backend} lse")
    grads = be.backward(t[3], t[0], t[1], t[2], t[4], lse_row.to(lse_b.dtype), causal, scale, aux)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_bwd, strict=True):
        assert_rel_close(got, want, tol, f"{backend} {name}")


@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    s=st.integers(1, 20),
    causal=st.booleans(),
    backend=st.sampled_from(["math", "sdpa"]),
)
def test_backends_give_the_lse_and_block_gradients(seed, s, causal, backend):
    _block_check(backend, torch.float64, 1e-12, seed, s, causal, 8)


@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), s=st.sampled_from([8, 19]), causal=st.booleans())
def test_fa4_gives_the_lse_and_block_gradients(seed, s, causal):
    """repro.fa4's kernels (Triton interpreter, float32, D = 16): LSE converted from log2 units."""
    _block_check("fa4", torch.float32, 1e-5, seed, s, causal, 16)
