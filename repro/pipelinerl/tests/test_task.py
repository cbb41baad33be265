"""The task: prompts and uniforms are pure functions of (seed, index); the reward checks sorting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.pipelinerl.task import (
    BOS,
    EOS,
    SEP,
    TaskConfig,
    make_prompt,
    reward,
    sampling_uniforms,
    sft_batch,
    solution,
)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), index=st.integers(0, 10**6), max_items=st.integers(1, 12))
def test_prompts_are_deterministic_and_well_formed(seed, index, max_items):
    task = TaskConfig(max_items=max_items)
    p = make_prompt(task, seed, index)
    assert p == make_prompt(task, seed, index)
    assert p[0] == BOS and p[-1] == SEP and 1 <= len(p) - 2 <= max_items
    assert all(0 <= d <= 9 for d in p[1:-1])
    assert torch.equal(sampling_uniforms(task, seed, index), sampling_uniforms(task, seed, index))
    sol = solution(p)
    assert reward(p, sol) == 1.0
    assert reward(p, sol[:-1]) == 0.0  # no EOS
    if len(set(p[1:-1])) > 1:
        assert reward(p, [*p[1:-1][::-1], EOS]) == 0.0 or sorted(p[1:-1]) == p[1:-1][::-1]


def test_sft_batch_without_noise_is_all_correct():
    task = TaskConfig(max_items=6)
    tokens, mask = sft_batch(task, 40, torch.Generator().manual_seed(1), noise=0.0)
    for r in range(40):
        row = tokens[r].tolist()
        prompt = row[: row.index(SEP) + 1]
        assert reward(prompt, tokens[r][mask[r]].tolist()) == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_items": 0}, r"min_items <= max_items"),
        ({"min_items": 5, "max_items": 3}, r"min_items <= max_items"),
        ({"skew": 0.5}, r"skew must be >= 1"),
    ],
)
def test_bad_task_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**kwargs)


def test_bad_noise_and_prompt():
    with pytest.raises(ValueError, match=r"noise must be in \[0, 1\)"):
        sft_batch(TaskConfig(), 2, torch.Generator(), noise=1.0)
    with pytest.raises(ValueError, match=r"a prompt is \[BOS, digits.., SEP\]"):
        solution([1, 2, 3])
