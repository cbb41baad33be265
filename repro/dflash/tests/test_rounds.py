"""dflash/progress-per-verify and dflash/one-pass-per-block: forwards counted with hooks.

Each verification emits a + 1 >= 1 tokens, so n tokens need at most n - 1 verifications after the
prefill; the DFlash drafter's layers run exactly once per verification whatever the block size,
the autoregressive drafter's gamma times.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.dflash import speculative_generate
from repro.dflash.tests.helpers import make_drafter, tiny_ar, tiny_dflash, tiny_target

SECTION_VERIFY = "§3.1, Eq. 1 (arXiv v2)"
SECTION_PARALLEL = "§3.2, Eqs. 2-3 (arXiv v2)"


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.claim("dflash/progress-per-verify", section=SECTION_VERIFY)
@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    new=st.integers(1, 16),
    block_size=st.integers(2, 8),
    kind=st.sampled_from(["dflash", "eagle", "ar", "random", "constant"]),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_every_verification_emits_a_token(seed, new, block_size, kind, temperature):
    target = tiny_target(seed, vocab=6)
    drafter = make_drafter(kind, target, seed + 1)
    target_calls = _count_calls(target)
    gen = torch.Generator().manual_seed(seed)
    out = speculative_generate(
        target,
        drafter,
        torch.tensor([1, 2]),
        new,
        block_size=block_size,
        temperature=temperature,
        generator=gen,
    )
    assert all(0 <= a <= block_size - 1 for a in out.accepted)
    emitted = 1 + sum(a + 1 for a in out.accepted)  # the prefill's token, then a + 1 per verification
    assert emitted >= new
    if out.accepted:  # the last verification was needed: before it fewer than new tokens existed
        assert emitted - (out.accepted[-1] + 1) < new
    assert len(out.accepted) <= new - 1
    assert target_calls[0] == out.target_forwards == 1 + len(out.accepted)
    assert out.tokens.shape == (new,)


@pytest.mark.claim("dflash/one-pass-per-block", section=SECTION_PARALLEL)
@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    new=st.integers(2, 16),
    block_size=st.integers(2, 8),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_dflash_drafts_in_one_pass(seed, new, block_size, temperature):
    target = tiny_target(seed, vocab=6)
    drafter = tiny_dflash(target, seed + 1, n_layers=2)
    calls = [_count_calls(layer) for layer in drafter.layers]
    gen = torch.Generator().manual_seed(seed)
    out = speculative_generate(
        target, drafter, torch.tensor([3]), new, block_size=block_size, temperature=temperature, generator=gen
    )
    rounds = len(out.accepted)
    assert out.drafter_forwards == rounds
    assert [c[0] for c in calls] == [rounds] * len(drafter.layers)  # each layer once per block


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), new=st.integers(2, 12), block_size=st.integers(2, 6))
def test_autoregressive_drafter_runs_gamma_times(seed, new, block_size):
    """The baseline's cost grows with the block: gamma = block_size - 1 forwards per verification."""
    target = tiny_target(seed, vocab=6)
    ar = tiny_ar(target, seed + 1)
    out = speculative_generate(target, ar, torch.tensor([3]), new, block_size=block_size)
    assert out.drafter_forwards == (block_size - 1) * len(out.accepted)
