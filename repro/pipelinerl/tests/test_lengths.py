"""Length distributions: where pipeline's gain over the conventional loop comes from (simulator),
and the heavy-tailed task variant of the real run.

* With every sample the same length the schedule can only overlap generation with training, so the
  simulated pipeline / conventional samples/s ratio stays under ``fixed_length_gain_bound`` (about
  2 when the two jobs take equal time, less when either dominates), for drawn configurations.
* With a heavy tail (lognormal lengths, same mean) the conventional loop also waits for each
  round's longest sample: the ratio grows past that bound.
* The ``sort-long`` task: its reward is right on right and wrong answers, its lengths vary widely."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.pipelinerl.model import ModelConfig
from repro.pipelinerl.pipeline import Config, run
from repro.pipelinerl.sim import (
    SimConfig,
    TimeModel,
    fixed_length_gain_bound,
    length_distribution,
    simulate,
    task_lengths,
)
from repro.pipelinerl.task import EOS, TASKS, TaskConfig, make_prompt, reward, sft_batch, solution
from repro.pipelinerl.train import config_from, parse


def ratio(cfg: SimConfig) -> tuple[float, dict, dict]:
    pipe = simulate(cfg).summary
    conv = simulate(SimConfig(**{**cfg.__dict__, "mode": "conventional"})).summary
    return pipe["samples_per_s"] / conv["samples_per_s"], pipe, conv


@settings(max_examples=40, deadline=None)
@given(
    B=st.sampled_from([2, 4, 8]),
    G=st.integers(1, 3),
    prompt=st.integers(1, 4),
    completion=st.integers(1, 40),
    actors=st.integers(1, 3),
    slots=st.integers(1, 24),
    step_s=st.floats(1e-4, 2e-3),
    per_seq=st.sampled_from([0.0, 2e-5]),
    train_s=st.floats(1e-4, 3e-2),
    broadcast_s=st.floats(0.0, 5e-3),
    swap_s=st.floats(0.0, 2e-3),
)
def test_fixed_length_gain_is_bounded(
    B, G, prompt, completion, actors, slots, step_s, per_seq, train_s, broadcast_s, swap_s
):
    tm = TimeModel(
        step_s=step_s, step_s_per_seq=per_seq, train_s=train_s, broadcast_s=broadcast_s, swap_s=swap_s
    )
    cfg = SimConfig(
        mode="pipeline", max_lag=(G - 1) * B, batch_size=B, attempts=2, actors=actors, slots=slots,
        steps=4 * G, time=tm, lengths=length_distribution("fixed", completion, prompt=prompt),
    )  # fmt: skip
    r, pipe, conv = ratio(cfg)
    bound = fixed_length_gain_bound(cfg)
    assert r <= bound * (1 + 1e-9), (r, bound, pipe, conv)
    # the bound itself: overlap at most halves the time, up to wave quantisation q (a round of G B
    # samples on A S slots), the step time's spread r and the per-round swap
    x = G * B / (actors * slots)
    q = math.ceil(x) / x if x > 1 else 1.0
    spread = (step_s + per_seq * slots) / (step_s + per_seq)
    assert bound <= (q * spread + 1 + swap_s / (G * (train_s + broadcast_s))) * (1 + 1e-9), bound


def test_heavy_tail_gain_grows_past_the_fixed_length_bound():
    # generation-dominated, one actor, the fitted step costs' shape; mean completion 48 tokens
    tm = TimeModel(step_s=7e-4, train_s=6e-3, broadcast_s=2e-3, swap_s=1e-3)
    base = dict(
        mode="pipeline", max_lag=64, batch_size=16, attempts=4, slots=32, steps=40, time=tm
    )  # whole rounds (G = 5)
    fixed = SimConfig(**base, lengths=length_distribution("fixed", 48, prompt=2))
    heavy = SimConfig(**base, lengths=length_distribution("lognormal", 48, sigma=1.25, prompt=2, cap=1024))
    mean_fixed = statistics.fmean(c for _, c in fixed.lengths)
    mean_heavy = statistics.fmean(c for _, c in heavy.lengths)
    assert abs(mean_heavy / mean_fixed - 1) < 0.1  # same mean work per sample
    r_fixed, _, _ = ratio(fixed)
    r_heavy, pipe, conv = ratio(heavy)
    bound = fixed_length_gain_bound(fixed)
    assert r_fixed <= bound
    assert r_heavy > r_fixed, (r_heavy, r_fixed)
    assert r_heavy > bound, (r_heavy, bound)  # beyond what overlap alone can give
    # and not only by training on fewer, shorter samples: trained tokens/s grows too
    assert pipe["tokens_per_s"] / conv["tokens_per_s"] > r_fixed, (pipe, conv)


def test_length_distribution_shapes():
    assert length_distribution("fixed", 7.4, prompt=3) == [(3, 7)]
    lens = length_distribution("lognormal", 40, sigma=1.0, cap=300, n=4000, seed=1)
    c = [x for _, x in lens]
    assert min(c) >= 1 and max(c) <= 300
    assert abs(statistics.fmean(c) / 40 - 1) < 0.1
    assert max(c) > 5 * statistics.median(c)  # a heavy tail
    with pytest.raises(ValueError, match=r"dist must be 'fixed' or 'lognormal'"):
        length_distribution("pareto", 10)
    with pytest.raises(ValueError, match=r"need mean >= 1"):
        length_distribution("fixed", 0.5)


# ----------------------------------------------------------------------------- the sort-long task


def test_sort_long_reward_and_lengths():
    task = TASKS["sort-long"]
    lens = [len(make_prompt(task, 0, i)) - 2 for i in range(2000)]
    assert min(lens) >= task.min_items and max(lens) <= task.max_items
    assert max(lens) >= 4 * statistics.median(lens)  # answers vary widely in length
    assert statistics.pstdev(lens) > 0.8 * statistics.fmean(lens)
    for i in range(50):
        p = make_prompt(task, 0, i)
        sol = solution(p)
        assert reward(p, sol) == 1.0
        assert reward(p, sol[:-1]) == 0.0  # no EOS
        assert reward(p, [*sol[:-1], 0, EOS]) == 0.0  # one item too many
        if len(set(p[1:-1])) > 1:
            assert reward(p, [*sol[:-1][::-1], EOS]) == 0.0  # descending
    # pre-training batches follow the same length distribution and are correct without noise
    tok, mask = sft_batch(task, 400, torch.Generator().manual_seed(0), noise=0.0)
    n = mask.sum(1) - 1
    assert abs(statistics.median(n.tolist()) - statistics.median(lens)) <= 3
    assert reward(tok[0][: int(n[0]) + 2].tolist(), tok[0][mask[0]].tolist()) == 1.0
    # the simulator's view of the task: completions n + 1, prompts n + 2
    assert all(p == c + 1 for p, c in task_lengths(task, n=50))


def test_lognormal_task_config_errors():
    with pytest.raises(ValueError, match=r"dist must be 'skew' or 'lognormal'"):
        TaskConfig(dist="zipf")
    with pytest.raises(ValueError, match=r"median > 0 and sigma >= 0"):
        TaskConfig(dist="lognormal", sigma=-1.0)


def test_train_cli_task_option():
    assert config_from(parse([])).task == TaskConfig(max_items=8)  # the default is unchanged
    cfg = config_from(parse(["--task", "sort-long"]))
    assert cfg.task == TASKS["sort-long"] and cfg.model.max_len == cfg.task.max_seq_len


def test_tiny_sort_long_run_generates_varying_lengths():
    task = TaskConfig(min_items=1, max_items=12, dist="lognormal", median=2.0, sigma=1.0)
    cfg = Config(
        mode="pipeline", steps=4, batch_size=4, attempts=2, max_lag=8, slots=8, task=task,
        model=ModelConfig(d_model=16, n_layers=1, n_heads=2, max_len=task.max_seq_len), pretrain_steps=5,
    )  # fmt: skip
    res = run(cfg)
    assert res.summary["steps"] == 4
    prompt_lens = {u["prompt_len"] for u in res.used}
    assert len(prompt_lens) >= 3  # lists of several lengths reached the trainer
