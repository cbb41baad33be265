"""megablocks/capacity-drops: the capacity-factor baseline drops exactly the assignments over
capacity and equals the reference on the rest. fp64 throughout: 1e-10 relative."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.megablocks import capacity, capacity_moe, moe_dense, moe_per_expert, moe_reference
from repro.megablocks.tests.strategies import moe_cases

CLAIM = "megablocks/capacity-drops"
SECTION = "§2.2 (arXiv v1)"


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=30, deadline=None)
@given(
    case=moe_cases(max_T=60),
    cf=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]),
    mlp=st.sampled_from(["mlp", "glu"]),
)
def test_drops_exactly_the_overflow(case, cf, mlp):
    x, w, w1, w2, w3 = case.tensors(torch.float64)
    w3 = w3 if mlp == "glu" else None
    E = case.num_experts
    T, k = case.indices.shape
    y, kept = capacity_moe(x, w, case.indices, w1, w2, w3, E, cf, mlp)
    C = capacity(T * k, E, cf)
    counts = torch.bincount(case.indices.reshape(-1), minlength=E)
    kept_per_expert = torch.bincount(case.indices[kept], minlength=E)
    assert torch.equal(kept_per_expert, counts.clamp(max=C)), "each expert keeps min(n_e, C)"
    assert int((~kept).sum()) == int((counts - C).clamp(min=0).sum())
    # on the kept assignments it is the reference; dropped ones contribute nothing
    assert_rel_close(y, moe_dense(x, w * kept, case.indices, w1, w2, w3, E, mlp), 1e-10, "kept part")
    if C >= int(counts.max()):
        assert bool(kept.all())
        assert_rel_close(y, moe_dense(x, w, case.indices, w1, w2, w3, E, mlp), 1e-10, "no drops")


@pytest.mark.claim(CLAIM, section=SECTION)
def test_first_choices_take_priority():
    """GShard's order: all first choices before any second choice (T = 4, E = 2, k = 2, C = 2)."""
    indices = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0]])
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.full((4, 2), 0.5, dtype=torch.float64)
    ws = [torch.randn(2 * 4, 8, dtype=torch.float64) for _ in range(2)]
    _, kept = capacity_moe(x, w, indices, ws[0], ws[1], None, 2, 0.5)
    assert capacity(8, 2, 0.5) == 2
    assert kept[:, 0].all() and not kept[:, 1].any()


@pytest.mark.claim(CLAIM, section=SECTION)
def test_reference_loop_equals_dense_reference():
    """The three references agree (the vectorised ones stand in for the loop in GPU tests and the bench)."""
    from repro.megablocks.tests.strategies import make_case

    case = make_case(seed=2, T=20, d=16, f=32, E=3, k=2, routing="skewed")
    x, w, w1, w2, w3 = case.tensors(torch.float64)
    for mlp in ("mlp", "glu"):
        a = moe_reference(x, w, case.indices, w1, w2, w3, 3, mlp)
        b = moe_dense(x, w, case.indices, w1, w2, w3, 3, mlp)
        assert_rel_close(a, b, 1e-12, mlp)
        assert_rel_close(moe_per_expert(x, w, case.indices, w1, w2, w3, 3, mlp), a, 1e-12, mlp)
