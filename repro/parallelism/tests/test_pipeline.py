"""Claims of the pipeline-parallelism session: GPipe (huang2018gpipe), 1F1B (harlap2018pipedream) and the
zero-bubble schedules (qi2024zero).

Bubble counts come from the schedule simulator (pipeline_schedule.simulate) with integer pass times, so
every count is exact. The schedules also run for real on 2-4 gloo ranks (pipeline.run_stage), where
the accumulated gradients must equal the unpipelined model's (float64, tolerance 1e-12: the
micro-batches' gradients are added in another order than the whole batch's).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.parallelism.pipeline import chain_loss
from repro.parallelism.pipeline_schedule import (
    Times,
    bubble_fraction_gpipe,
    gpipe,
    one_f_one_b,
    simulate,
    zb_h1,
    zb_h2,
)
from repro.parallelism.tests import worker
from repro.parallelism.tests.common import SETTINGS
from repro.parallelism.tests.worker import PipelineCase

times = st.builds(Times, F=st.integers(1, 5), B=st.integers(1, 5), W=st.integers(1, 5))


@pytest.mark.claim("parallelism/gpipe-bubble", section="§2.3 (arXiv v5)")
@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 16), t=times)
def test_gpipe_bubble_fraction(p, m, t):
    """Every stage idles (p - 1)(T_F + T_BW) of a makespan (m + p - 1)(T_F + T_BW): the fraction
    (p - 1)/(m + p - 1), for any pass times."""
    tl = simulate(gpipe(p, m), t)
    assert tl.makespan == (m + p - 1) * (t.F + t.B + t.W)
    for s in range(p):
        assert tl.idle(s) == (p - 1) * (t.F + t.B + t.W)
        assert Fraction(tl.idle(s), tl.makespan) == bubble_fraction_gpipe(p, m)
        assert tl.peak_in_flight[s] == m  # GPipe holds every micro-batch's activations


@pytest.mark.claim("parallelism/1f1b-in-flight", section="Work scheduling, 1F1B (arXiv v1)")
@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 16), t=times)
def test_1f1b_bounds_in_flight_micro_batches(p, m, t):
    """Stage s holds at most p - s micro-batches (GPipe: m), and the idle time is GPipe's whatever m:
    more micro-batches only lengthen the steady state, in which no stage waits."""
    tl = simulate(one_f_one_b(p, m), t)
    longer = simulate(one_f_one_b(p, 2 * m), t)
    for s in range(p):
        assert tl.peak_in_flight[s] == min(p - s, m)
        assert tl.idle(s) == longer.idle(s) == (p - 1) * (t.F + t.B + t.W)


@pytest.mark.claim("parallelism/zb-h1-bubble", section="§2.1 (arXiv v1)")
@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 12), unit=st.integers(1, 4))
def test_zb_h1_bubble_is_a_third_of_1f1b(p, extra, unit):
    """T_F = T_B = T_W = unit, m >= p: ZB-H1 idles (p - 1)(T_F + T_B - T_W) = (p - 1) unit per stage,
    1F1B 3 (p - 1) unit, while no stage holds more micro-batches than under 1F1B."""
    m = p + extra
    t = Times(unit, unit, unit)
    h1 = simulate(zb_h1(p, m), t)
    base = simulate(one_f_one_b(p, m), t)
    for s in range(p):
        assert h1.idle(s) == (p - 1) * (t.F + t.B - t.W)
        assert 3 * h1.idle(s) == base.idle(s)
        assert h1.peak_in_flight[s] <= base.peak_in_flight[s]


@pytest.mark.claim("parallelism/zb-h2-zero-bubble", section="§2.2 (arXiv v1)")
@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 8), unit=st.integers(1, 4))
def test_zb_h2_has_no_bubble(p, extra, unit):
    """T_F = T_B = T_W, m >= 2p - 1: every stage works without a gap from its first pass to its last,
    stage s starting s T_F after stage 0 (the parallelogram), holding up to 2p - 1 - s micro-batches."""
    m = 2 * p - 1 + extra
    t = Times(unit, unit, unit)
    h2 = simulate(zb_h2(p, m), t)
    for s in range(p):
        assert h2.gaps(s) == 0
        assert h2.first_start(s) == s * t.F
        assert h2.span(s) == m * (t.F + t.B + t.W)
        assert h2.peak_in_flight[s] <= 2 * p - 1 - s
    assert h2.peak_in_flight[0] == 2 * p - 1


def check_pipeline(world4, case: PipelineCase) -> None:
    results = sorted(
        (r for r in world4.run(worker.run_pipeline, case, timeout=90) if r), key=lambda r: r["stage"]
    )
    x, target, weights = worker.pipeline_inputs(case)
    leaves = [(w.clone().requires_grad_(True), b.clone().requires_grad_(True)) for w, b in weights]
    loss = chain_loss(x, target, leaves)
    loss.backward()
    assert results[-1]["loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
    for s, (r, (w, b)) in enumerate(zip(results, leaves, strict=True)):
        assert_rel_close(r["dw"], w.grad, 1e-12, f"dW of stage {s} ({case})")
        assert_rel_close(r["db"], b.grad, 1e-12, f"db of stage {s} ({case})")


@st.composite
def pipeline_cases(draw, schedules) -> PipelineCase:
    p = draw(st.integers(2, 4))
    m = draw(st.integers(1, 6))
    return PipelineCase(
        seed=draw(st.integers(0, 2**16)),
        p=p,
        m=m,
        h=draw(st.integers(1, 4)),
        batch=m + draw(st.integers(0, 4)),
        schedule=draw(st.sampled_from(schedules)),
    )


def two_stages(schedule: str) -> PipelineCase:
    """A two-stage pipeline, an explicit example of every run (the draws add 3 and 4 stages)."""
    return PipelineCase(seed=3, p=2, m=4, h=3, batch=6, schedule=schedule)


@pytest.mark.claim("parallelism/gpipe-same-gradients", section="§2.2 (arXiv v5)")
@settings(max_examples=8, **SETTINGS)
@given(case=pipeline_cases(schedules=("gpipe", "1f1b")))
@example(case=two_stages("gpipe"))
@example(case=two_stages("1f1b"))
def test_pipelined_gradients_equal_the_unpipelined_model(world4, case):
    """GPipe and 1F1B on 2-4 gloo ranks: each stage's accumulated gradients and the loss equal the
    unpartitioned model's on the whole mini-batch."""
    check_pipeline(world4, case)


@pytest.mark.claim("parallelism/zb-split-backward-exact", section="§2 (arXiv v1)")
@settings(max_examples=8, **SETTINGS)
@given(case=pipeline_cases(schedules=("zb-h1", "zb-h2")))
@example(case=two_stages("zb-h1"))
@example(case=two_stages("zb-h2"))
def test_split_backward_gives_the_same_gradients(world4, case):
    """ZB-H1 and ZB-H2 on 2-4 gloo ranks, B (input gradient, sent on at once) and W (weight gradient,
    later) as separate passes: the gradients of the unpipelined model."""
    check_pipeline(world4, case)


def test_simulator_rejects_bad_schedules():
    with pytest.raises(ValueError, match="stage 1 must run each"):
        simulate([[*gpipe(2, 2)[0]], gpipe(2, 2)[1][:-1]], Times())
    bad = one_f_one_b(2, 2)
    bad[0] = list(reversed(bad[0]))  # a backward before its forward
    with pytest.raises(ValueError, match="deadlocks; stage 0 waits forever"):
        simulate(bad, Times())
    with pytest.raises(ValueError, match="number of stages p must be an int >= 1"):
        gpipe(0, 3)
