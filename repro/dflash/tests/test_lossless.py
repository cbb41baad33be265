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
from repro.dflash.reference import accept_reference, probabilities
from repro.dflash.tests.helpers import DRAFTER_KINDS, make_drafter, tiny_dflash, tiny_target

ALPHA = 1e-3
SECTION_GREEDY = "Method: lossless verification"
SECTION_SAMPLING = "Method: lossless verification"


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


@pytest.mark.claim("dflash/lossless-sampling", section=SECTION_SAMPLING)
def test_speculative_sampling_matches_target_distribution():
    """End to end: 3 new tokens from a vocabulary of 2 (8 outcomes) by speculative sampling with an
    untrained DFlash drafter and block size 3 (the first token from the prefill, the next two from
    one draft-verify round), against the target's exact joint distribution computed by enumeration;
    500 runs, chi-square at alpha = 1e-3. The drafter must be rejected and accepted often enough
    that both branches of the rule are exercised."""
    V, new, N = 2, 3, 500
    target = tiny_target(7, vocab=V, scale=1.5)
    drafter = tiny_dflash(target, 8, scale=3.0)
    prompt = torch.tensor([0, 1])
    exact = torch.zeros(V**new, dtype=torch.float64)
    for i, seq in enumerate(itertools.product(range(V), repeat=new)):
        with torch.no_grad():
            logits, _ = target(torch.tensor([prompt.tolist() + list(seq)]))
        p = probabilities(logits[0, len(prompt) - 1 : -1], 1.0)  # rows predicting seq[0..new-1]
        exact[i] = torch.stack([p[j, s] for j, s in enumerate(seq)]).prod()
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V**new, dtype=torch.long)
    rejected = accepted = 0
    for _ in range(N):
        out = speculative_generate(target, drafter, prompt, new, block_size=3, temperature=1.0, generator=gen)
        t = out.tokens.tolist()
        counts[(t[0] * V + t[1]) * V + t[2]] += 1
        rejected += out.accepted[0] < 2
        accepted += out.accepted[0] > 0
    assert rejected > 20 and accepted > 20, (rejected, accepted)
    assert _chi_square_pvalue(counts, exact) > ALPHA
