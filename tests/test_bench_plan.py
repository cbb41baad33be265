"""The shared time budget and step plan (paperclub.bench.Budget, Step, Plan): a step starts only when
its cost, predicted from the steps already run, fits what is left; skipped steps are named."""

from __future__ import annotations

import pytest

from paperclub.bench import Budget, Plan, Step, process_age


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_budget_counts_from_its_start_and_splits():
    clock = Clock()
    b = Budget(60, spent=5, clock=clock)
    assert b.elapsed() == 5 and b.left() == 55
    clock.t += 20
    assert b.elapsed() == 25 and b.allows(35) and not b.allows(36) and b.allows(None)
    assert not b.allows(20, reserve_s=16)
    first = b.part(0.5)  # the first phase ends at 30 s of the same clock
    assert first.left() == 5 and first.seconds == 30
    clock.t += 40
    assert b.left() < 0 and not b.allows(None)
    free = Budget(None, clock=clock)
    assert free.left() == float("inf") and free.allows(1e9) and free.part(0.5).seconds is None
    with pytest.raises(ValueError, match="positive"):
        Budget(0)
    with pytest.raises(ValueError, match="fraction"):
        b.part(0)
    assert 0 <= process_age() < 3600  # this test process is young
    assert Budget.from_process_start(10).elapsed() >= 0


def test_plan_predicts_from_the_same_kind_and_skips_what_does_not_fit():
    clock = Clock()
    steps = [
        Step("fwd T=8k", kind="fwd", size=8192, exponent=2),
        Step("bwd T=8k", kind="bwd", size=8192, exponent=2, first_cost=3.0),
        Step("fwd T=16k", kind="fwd", size=16384, exponent=2),
        Step("fwd T=64k", kind="fwd", size=65536, exponent=2),
        Step("decode", kind="decode"),
    ]
    log: list[str] = []
    plan = Plan(steps, Budget(100, clock=clock), log=log.append)
    ran = []
    for step in plan:
        ran.append(step.name)
        cost = {"fwd T=8k": (4, 1), "bwd T=8k": (10, 5), "fwd T=16k": (6, 4)}.get(step.name, (1, 1))
        if step.name == "bwd T=8k":
            # predicted 3 x the first step's 5 s before it ran
            assert plan.predict(step) == pytest.approx(15)
        clock.t += sum(cost)
        plan.record(step, *cost)
        if step.name == "fwd T=8k":
            # the first run of a kind holds the compile: its check part is not scaled; timing x (2)^2
            assert plan.predict(steps[2]) == pytest.approx(4 + 1 * 4)
        if step.name == "fwd T=16k":
            # after two runs the check part scales too: 6 x 4 + 4 x 16 = 88 s > 100 - 30 spent
            assert plan.predict(steps[3]) == pytest.approx(6 * 4 + 4 * 16)
    assert ran == ["fwd T=8k", "bwd T=8k", "fwd T=16k", "decode"]
    assert [s.name for s in plan.skipped] == ["fwd T=64k"]
    assert plan.notes() == "Not measured (time budget of 100 s): fwd T=64k."
    assert any("fwd T=64k: not started" in line for line in log)
    assert plan.pending() == []


def test_plan_without_a_budget_runs_everything_and_names_must_be_unique():
    plan = Plan([Step("a"), Step("b")], Budget(None), log=lambda _: None)
    assert [s.name for s in plan] == ["a", "b"] and plan.notes() == ""
    with pytest.raises(ValueError, match="unique"):
        Plan([Step("a"), Step("a")], Budget(None))
