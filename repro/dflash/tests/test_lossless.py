"""dflash/lossless-greedy and dflash/lossless-sampling: verification makes any drafter lossless.

Greedy: fp64 tiny random targets (peaked weights, so that drafters sometimes agree and the
acceptance path is exercised), every kind of drafter (untrained DFlash, untrained autoregressive,
random, constant, an oracle that plants one wrong token), drawn prompts, lengths and block sizes:
the speculative output equals plain greedy decoding token for token. Exact equality is the right
test: the same argmax over fp64 logits that agree to ~1e-15.

Sampling: a chi-square goodness-of-fit test of the emitted tokens against the target's exact
distribution, at significance alpha = 1e-3 (the false-alarm rate of one run with a fresh seed); the
generator seeds are fixed, so each run of the suite is reproducible.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.dflash import accept_tokens, generate, speculative_generate
from repro.dflash.reference import accept_reference, probabilities, sample_inverse_cdf
from repro.dflash.tests.helpers import DRAFTER_KINDS, make_drafter, tiny_dflash, tiny_eagle, tiny_target

ALPHA = 1e-3
SECTION_GREEDY = "Abstract; §3.1 (arXiv v2)"
SECTION_SAMPLING = "Abstract; §5.1, Table 1, temperature = 1 (arXiv v2)"


@pytest.mark.claim("dflash/lossless-greedy", section=SECTION_GREEDY)
@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(3, 12),
    prompt_len=st.integers(1, 6),
    new=st.integers(1, 16),
    block_size=st.integers(2, 8),
    kind=st.sampled_from(DRAFTER_KINDS),
)
def test_greedy_output_equals_target(seed, vocab, prompt_len, new, block_size, kind):
    target = tiny_target(seed, vocab=vocab)
    drafter = make_drafter(kind, target, seed + 1)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    expected = generate(target, prompt, new)
    out = speculative_generate(target, drafter, prompt, new, block_size=block_size)
    assert torch.equal(out.tokens, expected), f"{kind}: {out.tokens.tolist()} != {expected.tolist()}"
    if kind == "oracle0":  # first draft always wrong: exactly one token per verification
        assert set(out.accepted) <= {0}
    if kind == "oracle2":  # two right, then a planted error: never more than two accepted
        assert all(a <= min(2, block_size - 1) for a in out.accepted)


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts against probabilities; cells with expected count < 5 are
    pooled into one (the usual validity condition of the chi-square approximation)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    # survival function of chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _draws_for_rule(p, q, gamma, n, seed, temperature=1.0):
    """n independent verifications of a gamma-token draft d ~ q against target logits; returns the
    first emitted token (the accepted d_1 or the token the target adds at position 1)."""
    gen = torch.Generator().manual_seed(seed)
    V = p.shape[-1]
    draft = torch.multinomial(q.expand(n, gamma, V).reshape(-1, V), 1, generator=gen).view(n, gamma)
    u = torch.rand(n, gamma, generator=gen, dtype=torch.float64)
    u_final = torch.rand(n, generator=gen, dtype=torch.float64)
    logits = (p.log() * temperature).expand(n, gamma + 1, V)
    a, nxt = accept_tokens(draft, logits, q.expand(n, gamma, V), temperature, u, u_final)
    return torch.where(a > 0, draft[:, 0], nxt)


@pytest.mark.claim("dflash/lossless-sampling", section=SECTION_SAMPLING)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 6), sharp=st.floats(0.5, 4.0))
def test_acceptance_rule_preserves_distribution(seed, vocab, sharp):
    """The rule alone: the first emitted token of a verification is distributed as p, whatever q is
    (leviathan2022fast Theorem 1). 20000 draws, chi-square at alpha = 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * sharp, -1)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * sharp, -1)
    tokens = _draws_for_rule(p, q, 2, 20_000, seed)
    counts = torch.bincount(tokens, minlength=vocab)
    assert _chi_square_pvalue(counts, p) > ALPHA


def test_chi_square_detects_a_wrong_rule():
    """The test has power: emitting the draft unconditionally (no rejection) gives q, not p, and is caught."""
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    draft = torch.multinomial(q, 20_000, replacement=True, generator=gen)
    assert _chi_square_pvalue(torch.bincount(draft, minlength=3), p) < ALPHA
    assert _chi_square_pvalue(torch.bincount(_draws_for_rule(p, q, 1, 20_000, 1), minlength=3), p) > ALPHA


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 7),
    gamma=st.integers(1, 6),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
)
def test_batched_rule_equals_reference(seed, vocab, gamma, temperature):
    """accept_tokens (batched, on device) makes the same decision as the token-by-token reference."""
    gen = torch.Generator().manual_seed(seed)
    n = 16
    logits = torch.randn(n, gamma + 1, vocab, generator=gen, dtype=torch.float64) * 2
    q = torch.softmax(torch.randn(n, gamma, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    draft = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(n, gamma)
    u = torch.rand(n, gamma, generator=gen, dtype=torch.float64)
    u_final = torch.rand(n, generator=gen, dtype=torch.float64)
    a, nxt = accept_tokens(draft, logits, q if temperature else None, temperature, u, u_final)
    for i in range(n):
        ra, rn = accept_reference(
            draft[i].tolist(), logits[i], q[i], temperature, u[i].tolist(), float(u_final[i])
        )
        assert (int(a[i]), int(nxt[i])) == (ra, rn)


# End to end: the joint distribution of 5 sampled tokens over a 2-token vocabulary (32 outcomes)
# against the target's, computed exactly by enumerating the 32 sequences. Block size 3: the first
# token comes from the prefill, the other four from at least two draft-verify rounds, so the test
# covers the second round (drafts made after a rollback) and positions behind accepted drafts, not
# only the first token. The drafters are untrained and peaked (weights of scale 3): they are
# rejected about half the time, so both branches of the rule (accept; resample from the residual)
# are exercised at every position.
#
# Power, and why N = 800: Pearson's chi-square at alpha = 1e-3, cells with expected count < 5 pooled
# (23 cells left at N = 800: df = 22, critical value 48.3). Against an alternative with effect size
# w^2 = sum((p1 - p0)^2 / p0) the statistic is about noncentral chi-square(df, N w^2). Measured with
# 4000 samples each (seed 1; the noise floor of that estimate is 31/4000 = 0.008): resampling from p
# instead of the residual at a rejection gives w^2 = 0.13 with the DFlash drafter and 0.22 with the
# EAGLE-style one; an EAGLE-style drafter that reports its first row's q for every drafted token (a
# stale q, the bug a chain drafter invites) gives w^2 = 2.5. At N = 800 the noncentrality is >= 100
# for all three, where the power is 0.99999 (simulated: noncentral chi-square(22, 100) exceeds 48.3
# in all but 9 of 10^6 draws; at 63, i.e. N = 500, it would be 0.992). The two negative controls
# below are rejected at this N and seed (and at seeds 0-9: p <= 5e-8); the correct paths give
# p-values above 1e-3 at every seed tried (0-29; smallest 0.012), as they must for all but about one
# seed in 1000. The seeds are fixed, so CI is deterministic.
SAMPLES, NEW, V_SMALL, BLOCK = 800, 5, 2, 3


def _exact_joint(target, prompt: torch.Tensor) -> torch.Tensor:
    """The target's probability of each of the V^NEW continuations ``[V^NEW]`` (row-major order)."""
    exact = torch.zeros(V_SMALL**NEW, dtype=torch.float64)
    for i, seq in enumerate(itertools.product(range(V_SMALL), repeat=NEW)):
        with torch.no_grad():
            logits, _ = target(torch.tensor([prompt.tolist() + list(seq)]))
        p = probabilities(logits[0, len(prompt) - 1 : -1], 1.0)  # rows predicting seq[0 .. NEW-1]
        exact[i] = torch.stack([p[j, s] for j, s in enumerate(seq)]).prod()
    return exact


def _sampled_joint(kind: str, seed: int = 1234):
    """(counts of the continuations over SAMPLES speculative samples ``[V^NEW]``, the exact joint,
    draft tokens accepted, verifications)."""
    target = tiny_target(7, vocab=V_SMALL, scale=1.5)
    drafter = tiny_dflash(target, 8, scale=3.0) if kind == "dflash" else tiny_eagle(target, 8, scale=3.0)
    prompt = torch.tensor([0, 1])
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V_SMALL**NEW, dtype=torch.long)
    accepted = rounds = 0
    for _ in range(SAMPLES):
        out = speculative_generate(
            target, drafter, prompt, NEW, block_size=BLOCK, temperature=1.0, generator=gen
        )
        counts[int("".join(map(str, out.tokens.tolist())), V_SMALL)] += 1
        accepted += sum(out.accepted)
        rounds += len(out.accepted)
    return counts, _exact_joint(target, prompt), accepted, rounds


def _check_joint(kind: str) -> None:
    counts, exact, accepted, rounds = _sampled_joint(kind)
    assert rounds >= 2 * SAMPLES  # at least two rounds per sample
    # both branches of the rule at every position: some drafts accepted, many rejected
    assert 0.2 * rounds < accepted < 0.8 * (BLOCK - 1) * rounds, (accepted, rounds)
    assert _chi_square_pvalue(counts, exact) > ALPHA


@pytest.mark.claim("dflash/lossless-sampling", section=SECTION_SAMPLING)
def test_speculative_sampling_matches_target_distribution():
    """DFlash path: the joint of 5 sampled tokens is the target's (chi-square, alpha = 1e-3)."""
    _check_joint("dflash")


@pytest.mark.claim("dflash/eagle-lossless", section="§4, Metrics (arXiv v3)")
def test_eagle_sampling_matches_target_distribution():
    """EAGLE-style path, through the same verify step: the joint of 5 sampled tokens is the target's."""
    _check_joint("eagle")


def _resample_from_p(draft, target_logits, draft_probs, temperature, u=None, u_final=None):
    """A wrong rule: at the first rejection, resample from p instead of norm(max(0, p - q))."""
    n, gamma = draft.shape
    p = probabilities(target_logits, temperature)
    q = draft_probs.to(p.dtype)
    pd = p[:, :gamma].gather(-1, draft[..., None])[..., 0]
    qd = q.gather(-1, draft[..., None])[..., 0]
    a = (u.to(p.dtype) * qd < pd).long().cumprod(-1).sum(-1)
    return a, sample_inverse_cdf(p.gather(1, a[:, None, None].expand(n, 1, p.shape[-1]))[:, 0], u_final)


@pytest.mark.parametrize("bug", ["rule-resamples-from-p", "eagle-stale-q"])
def test_sampling_test_rejects_biased_implementations(monkeypatch, bug):
    """Negative controls: the test above, at the same N and seed, rejects a wrong acceptance rule
    (with the DFlash drafter) and an EAGLE-style drafter that reports a stale q (the first drafted
    token's distribution for all of them), so passing it means something."""
    from repro.dflash import speculative

    if bug == "rule-resamples-from-p":
        monkeypatch.setattr(speculative, "accept_tokens", _resample_from_p)
        kind = "dflash"
    else:
        propose = speculative._EagleSession.propose

        def stale(self, *args, **kwargs):
            tokens, q = propose(self, *args, **kwargs)
            return tokens, q[:1].expand_as(q).clone()

        monkeypatch.setattr(speculative._EagleSession, "propose", stale)
        kind = "eagle"
    counts, exact, _, _ = _sampled_joint(kind)
    assert _chi_square_pvalue(counts, exact) < ALPHA
