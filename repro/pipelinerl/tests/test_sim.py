"""The simulator: version bookkeeping over drawn timings, and the throughput and lag comparisons.

Every configuration is drawn by hypothesis: mode, batch size B, max_lag (a multiple of B so that
the conventional loop has a whole number of steps per round), actors, slots, step and train times,
and sequence lengths (short and long mixed, the long-tail effect)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.pipelinerl.reference import check_version_log
from repro.pipelinerl.sim import SimConfig, TimeModel, simulate

EXPERIMENTS = "Abstract (arXiv v1)"


@st.composite
def sim_configs(draw, mode=None, train_at_least_a_step=False):
    B = draw(st.sampled_from([2, 4, 8]))
    G = draw(st.integers(1, 4))
    tm = TimeModel(
        step_s=draw(st.floats(1e-4, 2e-3)),
        step_s_per_seq=draw(st.sampled_from([0.0, 2e-5, 1e-4])),
        train_s=draw(st.floats(1e-4, 3e-2)),
        broadcast_s=draw(st.floats(0.0, 2e-3)),
        swap_s=draw(st.floats(0.0, 1.0)),  # as a fraction of step_s, below
    )
    tm = TimeModel(**{**tm.__dict__, "swap_s": tm.swap_s * tm.step_s})  # loading weights: at most one step
    slots = draw(st.integers(1, 24))
    if train_at_least_a_step:
        # an optimizer step no shorter than one engine step at full slots (1-30 of them). Measured by
        # step_s alone, as this strategy first did, the per-slot cost made an engine step up to 25x
        # longer than an optimizer step, outside the claim's scope (issue #37's counterexample).
        full = tm.step_s + tm.step_s_per_seq * slots
        tm = TimeModel(**{**tm.__dict__, "train_s": full * draw(st.floats(1.0, 30.0))})
    lengths = draw(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 30)), min_size=1, max_size=6))
    return SimConfig(
        mode=mode or draw(st.sampled_from(["pipeline", "async", "conventional"])),
        max_lag=(G - 1) * B,
        batch_size=B,
        attempts=draw(st.sampled_from([1, 2])),
        actors=draw(st.integers(1, 3)),
        slots=slots,
        steps=25,
        time=tm,
        lengths=lengths,
        seed=draw(st.integers(0, 1000)),
    )


@pytest.mark.claim("pipelinerl/version-bookkeeping", section="Abstract (arXiv v1)")
@settings(max_examples=60, deadline=None)
@given(cfg=sim_configs())
def test_simulated_versions_are_monotone_and_within_max_lag(cfg):
    res = simulate(cfg)
    assert len(res.used) == cfg.steps * cfg.batch_size
    check_version_log(res.used, cfg.max_lag, cfg.mode, cfg.batch_size)
    assert sorted(u["index"] for u in res.used) == sorted({u["index"] for u in res.used})  # each once


@pytest.mark.claim("pipelinerl/pipeline-throughput", section=EXPERIMENTS)
@settings(max_examples=40, deadline=None)
@given(cfg=sim_configs(mode="pipeline", train_at_least_a_step=True))
def test_pipeline_busier_and_faster_than_conventional(cfg):
    """The claim's scope: an optimizer step takes at least one engine step at full slots (20-30 of them
    in our H100 runs; seconds against milliseconds at the paper's scale). Below it, see the next two
    tests."""
    pipe = simulate(cfg).summary
    conv = simulate(SimConfig(**{**cfg.__dict__, "mode": "conventional"})).summary
    # Pipeline pays a weight broadcast and an engine swap after every optimizer step, the conventional
    # loop once per round of G steps. Charged the same per-step costs, the conventional loop is never
    # faster: the schedule itself gains. 1% slack (with max_lag = 0 both run the same schedule).
    extra = cfg.steps * (cfg.time.broadcast_s + cfg.time.swap_s * cfg.actors)
    conv_charged = conv["samples"] / (conv["seconds"] + extra)
    assert pipe["samples_per_s"] >= 0.99 * conv_charged, (pipe, conv, conv_charged)
    # busier: the engine spends a larger share of the time decoding (it never waits for a round),
    # on the same charged clock (trainer-bound with 1-token samples, the extra broadcasts alone
    # would otherwise make pipeline's share smaller while it decodes exactly as much)
    conv_busy_charged = conv["engine_busy"] * conv["seconds"] / (conv["seconds"] + extra)
    assert pipe["engine_busy"] >= 0.99 * conv_busy_charged, (pipe, conv, conv_busy_charged)


@pytest.mark.claim("pipelinerl/pipeline-throughput", section=EXPERIMENTS)
def test_pipeline_admission_latency_outside_the_claims_scope():
    """Outside the scope (found by hypothesis): with an optimizer step 20x shorter than an engine step
    and samples of two engine steps, pipeline is slower than the conventional loop. Every trainer
    step opens the admission window for B samples, but the engine has started its next step before
    the trainer's step ends, so the freed slots wait one engine step: a cost of one step per two-step
    sample. The conventional loop starts its whole round at once and trains between rounds."""
    tm = TimeModel(step_s=0.001953125, step_s_per_seq=0.0, train_s=0.0001, broadcast_s=0.0, swap_s=0.0)
    cfg = SimConfig(mode="pipeline", max_lag=2, batch_size=2, attempts=1, actors=1, slots=4, steps=25,
                    time=tm, lengths=[(1, 1)], seed=0)  # fmt: skip
    pipe = simulate(cfg).summary
    conv = simulate(SimConfig(**{**cfg.__dict__, "mode": "conventional"})).summary
    assert pipe["samples_per_s"] < 0.7 * conv["samples_per_s"], (pipe, conv)
    # the same with an optimizer step as long as one engine step: back within the claim
    slow = SimConfig(**{**cfg.__dict__, "time": TimeModel(**{**tm.__dict__, "train_s": tm.step_s})})
    pipe = simulate(slow).summary
    conv = simulate(SimConfig(**{**slow.__dict__, "mode": "conventional"})).summary
    assert pipe["samples_per_s"] >= 0.99 * conv["samples_per_s"], (pipe, conv)


@pytest.mark.claim("pipelinerl/pipeline-throughput", section=EXPERIMENTS)
def test_issue_37_case_is_outside_the_scope():
    """The case hypothesis found against the earlier strategy (issue #37): max_lag 2, B 2, one actor of
    4 slots, lengths (1, 2) and (1, 6), no broadcast or swap cost, step_s = train_s = 1e-4 s. The
    simulator is right and the claim's scope was not what the strategy drew: with 1e-4 s per busy slot
    an engine step over four slots takes 5e-4 s, five optimizer steps, so pipeline's one-step delay in
    starting the samples each optimizer step admits costs more than the schedule gains (pipeline
    1524 against conventional 1567 samples/s at seed 0). With the optimizer step as long as that
    engine step, the case is inside the scope and the claim holds."""
    tm = TimeModel(step_s=1e-4, step_s_per_seq=1e-4, train_s=1e-4, broadcast_s=0.0, swap_s=0.0)
    cfg = SimConfig(mode="pipeline", max_lag=2, batch_size=2, attempts=1, actors=1, slots=4, steps=25, time=tm,
                    lengths=[(1, 2), (1, 6)], seed=0)  # fmt: skip
    pipe = simulate(cfg).summary
    conv = simulate(SimConfig(**{**cfg.__dict__, "mode": "conventional"})).summary
    assert pipe["samples_per_s"] < conv["samples_per_s"], (pipe, conv)  # outside the scope: slower
    inside = SimConfig(**{**cfg.__dict__, "time": TimeModel(**{**tm.__dict__, "train_s": 5e-4})})
    pipe = simulate(inside).summary
    conv = simulate(SimConfig(**{**inside.__dict__, "mode": "conventional"})).summary
    assert pipe["samples_per_s"] >= 0.99 * conv["samples_per_s"], (pipe, conv)


@pytest.mark.claim("pipelinerl/pipeline-fresher-than-async", section=EXPERIMENTS)
@settings(max_examples=40, deadline=None)
@given(cfg=sim_configs(mode="pipeline"))
def test_async_never_dominates_pipeline(cfg):
    """On the samples/s against mean-lag plane, async is never both faster and fresher (1% slack);
    when the trainer is not the bottleneck (async's trainer busy below 90%, the regime the
    in-flight update targets), pipeline's mean lag is at most async's up to a tenth of a step."""
    pipe = simulate(cfg).summary
    asyn = simulate(SimConfig(**{**cfg.__dict__, "mode": "async"})).summary
    faster = asyn["samples_per_s"] > 1.01 * pipe["samples_per_s"]
    fresher = asyn["lag_mean"] < 0.99 * pipe["lag_mean"]
    assert not (faster and fresher), (pipe, asyn)
    if asyn["trainer_busy"] < 0.9 and pipe["samples_per_s"] <= 1.01 * asyn["samples_per_s"]:
        assert pipe["lag_mean"] <= asyn["lag_mean"] + 0.1 * cfg.batch_size, (pipe, asyn)


def test_sim_config_errors():
    with pytest.raises(ValueError, match=r"mode must be one of"):
        simulate(SimConfig(mode="sync"))
    with pytest.raises(ValueError, match=r"multiple of batch_size \(8\) in conventional mode"):
        simulate(SimConfig(mode="conventional", max_lag=4, batch_size=8))
    with pytest.raises(ValueError, match=r"TimeModel.train_s must be >= 0"):
        TimeModel(train_s=-1.0)
    with pytest.raises(ValueError, match=r"lengths must be a non-empty list"):
        simulate(SimConfig(lengths=[]))
    with pytest.raises(ValueError, match=r"SimConfig.abort_stale must be True or False, got None"):
        simulate(SimConfig(abort_stale=None))
