"""Unit checks of the shared bookkeeping: admission window, stale-group drops, the time-model fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.pipelinerl.actor import Sample, Shared
from repro.pipelinerl.sim import fit_time_model
from repro.pipelinerl.trainer import take_batch


def _sample(index: int, versions: list[int]) -> Sample:
    return Sample(index=index, prompt=[], tokens=[], logprobs=[], versions=versions, reward=0.0)


@settings(max_examples=30, deadline=None)
@given(B=st.sampled_from([2, 4]), G=st.integers(1, 3), v=st.integers(0, 5))
def test_admission_window_is_b_plus_max_lag_ahead_of_the_weights(B, G, v):
    shared = Shared(mode="pipeline", batch_size=B, max_lag=(G - 1) * B)
    version = v * B
    shared.started = version
    admitted = []
    while (i := shared.try_admit(version)) is not None:
        admitted.append(i)
    assert admitted == list(range(version, version + G * B))
    shared.dropped += 2  # dropped samples are credited back to the window
    assert shared.try_admit(version) == version + G * B


def test_stale_groups_are_dropped_and_fresh_ones_batched():
    shared = Shared(mode="pipeline", batch_size=2, max_lag=2)
    shared.finished = [_sample(0, [0, 0]), _sample(1, [0, 2]), _sample(2, [4, 4]), _sample(3, [4, 6])]
    batch, dropped = take_batch(shared, attempts=2, trained=6, need=2)
    assert [s.index for s in dropped] == [0, 1]  # oldest token 0: lag 6 > 2
    assert [s.index for s in batch] == [2, 3]
    assert shared.consumed == 4 and shared.dropped == 2 and shared.finished == []


def test_incomplete_groups_wait():
    shared = Shared(mode="async", batch_size=2, max_lag=0)
    shared.finished = [_sample(1, [0])]  # its partner, sample 0, is still generating
    batch, dropped = take_batch(shared, attempts=2, trained=0, need=2)
    assert batch is None and dropped == [] and len(shared.finished) == 1


@settings(max_examples=20, deadline=None)
@given(a=st.floats(1e-4, 1e-2), b=st.floats(0.0, 1e-3), train=st.floats(1e-3, 1e-1))
def test_time_model_fit_recovers_a_linear_step_time(a, b, train):
    steps = [(0.0, a + b * busy, busy) for busy in (1, 3, 5, 8, 8, 2)]
    result = SimpleNamespace(
        actor_steps=[steps],
        swaps=[[(0.0, 1, 1e-4)]],
        steps=[{"train_s": train, "broadcast_s": 0.0}, {"train_s": train, "broadcast_s": 2e-3}],
        used=[{"prompt_len": 3, "versions": [0, 0]}],
    )
    tm, lengths = fit_time_model(result)
    assert tm.step_s == pytest.approx(a, rel=1e-6, abs=1e-12)
    assert tm.step_s_per_seq == pytest.approx(b, rel=1e-6, abs=1e-12)
    assert tm.train_s == train and tm.broadcast_s == 2e-3 and tm.swap_s == 1e-4
    assert lengths == [(3, 2)]
