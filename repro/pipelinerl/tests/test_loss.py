"""pipelinerl/is-equals-on-policy and pipelinerl/ess-range: the objective against its special cases.

Values and gradients in fp64: the two losses are the same expression when every weight is 1
(exp(0) is exact), so they agree to rounding (1e-12 relative)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.pipelinerl.model import Policy, load_flat_weights
from repro.pipelinerl.reference import (
    effective_sample_size,
    group_advantages,
    importance_weights,
    on_policy_loss,
    token_logprobs,
    truncated_is_loss,
)
from repro.pipelinerl.task import sft_batch
from repro.pipelinerl.tests.conftest import MODEL, TASK
from repro.pipelinerl.trainer import collate

SECTION = "Abstract (arXiv v1)"


def _case(B, T, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logits, tokens, mask, adv


@pytest.mark.claim("pipelinerl/is-equals-on-policy", section=SECTION)
@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 6), T=st.integers(1, 9), V=st.integers(2, 14), seed=st.integers(0, 10**6),
    cap=st.floats(1.0, 10.0),
)  # fmt: skip
def test_is_loss_equals_on_policy_loss_when_policies_coincide(B, T, V, seed, cap):
    logits, tokens, mask, adv = _case(B, T, V, seed)

    def logp_of(lg):
        return torch.log_softmax(lg, -1).gather(2, tokens[..., None]).squeeze(2)

    logp = logp_of(logits)
    behaviour = logp.detach().clone()  # mu = pi_theta: the data were sampled by the current weights
    is_loss = truncated_is_loss(logp, behaviour, adv, mask, cap)
    (g_is,) = torch.autograd.grad(is_loss, logits)
    logp2 = logp_of(logits)
    on_loss = on_policy_loss(logp2, adv, mask)
    (g_on,) = torch.autograd.grad(on_loss, logits)
    assert_rel_close(is_loss, on_loss, 1e-12, "loss")
    assert_rel_close(g_is, g_on, 1e-12, "gradient")
    w = importance_weights(logp, behaviour)
    assert torch.all(w[mask] == 1.0)
    assert effective_sample_size(w, mask) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.claim("pipelinerl/is-equals-on-policy", section=SECTION)
def test_trainer_batch_on_policy_gradient_equals_reinforce(pretrained):
    """Same check through the trainer's collate and the policy model (fp64 copy of the weights)."""
    model = Policy(MODEL).double()
    load_flat_weights(model, pretrained.double())
    tokens, mask = sft_batch(TASK, 8, torch.Generator().manual_seed(3), noise=0.3)
    logp = token_logprobs(model, tokens)
    m = mask[:, 1:]
    adv = group_advantages(torch.arange(8, dtype=torch.float64) % 3, 4)
    (g_is,) = torch.autograd.grad(truncated_is_loss(logp, logp.detach(), adv, m, 1.2), model.head.weight)
    (g_on,) = torch.autograd.grad(on_policy_loss(token_logprobs(model, tokens), adv, m), model.head.weight)
    assert_rel_close(g_is, g_on, 1e-12, "head gradient")
    assert collate  # the trainer builds the same [B, T-1] layout (checked in test_run)


@pytest.mark.claim("pipelinerl/is-equals-on-policy", section=SECTION)
@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 8), seed=st.integers(0, 10**6), cap=st.floats(0.5, 3.0))
def test_truncation_caps_each_weight(B, T, seed, cap):
    """Off-policy: the loss is the on-policy loss with every token weighted by min(rho, c)."""
    logits, tokens, mask, adv = _case(B, T, 6, seed)
    logp = torch.log_softmax(logits, -1).gather(2, tokens[..., None]).squeeze(2)
    behaviour = logp.detach() + torch.randn(
        B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    w = importance_weights(logp, behaviour).clamp(max=cap)
    expected = -(w * adv[:, None] * logp * mask).sum() / B
    assert_rel_close(truncated_is_loss(logp, behaviour, adv, mask, cap), expected, 1e-12, "loss")
    assert float(w.max()) <= cap


@pytest.mark.claim("pipelinerl/ess-range", section=SECTION)
@settings(max_examples=50, deadline=None)
@given(
    w=st.lists(st.floats(1e-6, 1e6, allow_nan=False), min_size=1, max_size=40),
)
def test_ess_in_unit_interval(w):
    t = torch.tensor(w, dtype=torch.float64)
    ess = effective_sample_size(t)
    assert 0.0 < ess <= 1.0 + 1e-12
    if max(w) == min(w):
        assert ess == pytest.approx(1.0, abs=1e-12)
    else:
        assert ess < 1.0
    assert effective_sample_size(torch.full_like(t, w[0])) == pytest.approx(1.0, abs=1e-12)


def test_loss_errors_name_arguments():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]=\(2,\)"):
        truncated_is_loss(logp, logp, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match=r"behaviour_logp must be \(2, 3\)"):
        truncated_is_loss(logp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match=r"cap must be > 0"):
        truncated_is_loss(logp, logp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match=r"multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"no weights selected"):
        effective_sample_size(torch.ones(3), torch.zeros(3, dtype=torch.bool))
