"""The EAGLE-3-style baseline (``eagle.py``): lossless through the same verify step, cache equal to
recomputation, and a training-time test that trains exactly what drafting runs.

fp64 tiny random models, as in the other property tests (exact token equality is then the right
check). The sampling-distribution test of this path is in ``test_lossless.py``; the ordering that
training-time test buys (a trained drafter, CPU seconds) in ``test_orderings.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.dflash import generate, speculative_generate, speculative_generate_reference
from repro.dflash.eagle import ttt_mask
from repro.dflash.tests.helpers import tiny_eagle, tiny_target
from repro.dflash.train import eagle_loss

EAGLE_LOSSLESS = pytest.mark.claim("dflash/eagle-lossless", section="§4, Metrics (arXiv v3)")
EAGLE_TTT = pytest.mark.claim("dflash/eagle-ttt-mask", section="§3.2, Figure 6 (arXiv v3)")


@EAGLE_LOSSLESS
@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(3, 12),
    prompt_len=st.integers(1, 6),
    new=st.integers(1, 16),
    block_size=st.integers(2, 9),
    n_layers=st.integers(1, 2),
    mode=st.sampled_from(["eager", "static"]),
)
def test_eagle_greedy_equals_target(seed, vocab, prompt_len, new, block_size, n_layers, mode):
    """Greedy decoding with an (untrained, peaked) EAGLE-style drafter, eagerly or through the
    capturable static steps (run eagerly on the CPU), emits the target's greedy tokens; the drafter
    runs once per drafted token (gamma forwards per round, the autoregressive cost)."""
    target = tiny_target(seed, vocab=vocab)
    drafter = tiny_eagle(target, seed + 1, n_layers=n_layers)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    out = speculative_generate(target, drafter, prompt, new, block_size=block_size, mode=mode)
    assert torch.equal(out.tokens, generate(target, prompt, new)), (out.tokens.tolist(), out.accepted)
    assert out.drafter_forwards == (block_size - 1) * len(out.accepted)


@EAGLE_LOSSLESS
@settings(max_examples=5, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    new=st.integers(1, 10),
    block_size=st.integers(2, 6),
    temperature=st.sampled_from([0.0, 0.8, 1.0]),
)
def test_eagle_cache_equals_recompute(seed, new, block_size, temperature):
    """The cached drafter (cropped after each verification, the accepted positions' features fed on
    the next draft) and its static form against ``reference.py``, which recomputes the target
    features and the whole drafter forward for every drafted token: the same tokens and accepted
    lengths from the same random numbers."""
    target = tiny_target(seed, vocab=7)
    drafter = tiny_eagle(target, seed + 1)
    prompt = torch.tensor([1, 4, 2])
    outs = []
    for mode in ("eager", "static", "reference"):
        gen = torch.Generator().manual_seed(seed)
        kw = dict(block_size=block_size, temperature=temperature, generator=gen)
        if mode == "reference":
            tokens, accepted = speculative_generate_reference(target, drafter, prompt, new, **kw)
        else:
            o = speculative_generate(target, drafter, prompt, new, mode=mode, **kw)
            tokens, accepted = o.tokens, o.accepted
        outs.append((tokens.tolist(), accepted))
    assert outs[0] == outs[1] == outs[2]


@EAGLE_TTT
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), T=st.integers(6, 14), steps=st.integers(1, 4), n_layers=st.integers(1, 2))
def test_training_time_test_equals_drafting(seed, T, steps, n_layers):
    """Step s of the training forward at pair position j gives the logits that drafting computes for
    its (s+1)-th token when the pairs up to ``j - s`` carry target features and the next s carry the
    drafter's own outputs, the true tokens beside them (1e-10, fp64): EAGLE-3's training-time test
    trains the situation drafting is in, nothing else."""
    target = tiny_target(seed, vocab=9, n_layers=3)
    drafter = tiny_eagle(target, seed + 1, n_layers=n_layers)
    ids = torch.randint(0, 9, (2, T), generator=torch.Generator().manual_seed(seed))
    _, feats = target(ids, feature_layers=drafter.feature_layers)
    logits = drafter.forward_train(feats, ids, steps)  # [S, 2, T - 1, V]
    g = drafter.fuse_features(feats)
    for b in range(2):
        for s in range(steps):
            for j in range(s, T - 1):
                cache = drafter.new_cache()
                a = drafter(g[b : b + 1, : j - s + 1], ids[b : b + 1, 1 : j - s + 2], cache)[:, -1:]
                for k in range(j - s + 1, j + 1):  # s steps on its own outputs
                    a = drafter(a, ids[b : b + 1, k + 1 : k + 2], cache)
                assert_rel_close(logits[s, b, j], drafter.logits(a[0, 0]), 1e-10, f"step {s}, position {j}")


@EAGLE_TTT
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 12), step=st.integers(0, 5))
def test_ttt_mask_enumerated(n, step):
    """The mask of Figure 6: step 0 causal over the target-feature pairs up to ``j - step``, and one
    key per later step, on the query's diagonal."""
    mask = ttt_mask(n, step)
    assert mask.shape == (n, (step + 1) * n)
    for j in range(n):
        for s in range(step + 1):
            for c in range(n):
                allowed = c <= j - step if s == 0 else c == j - step + s
                assert bool(mask[j, s * n + c]) == allowed
        assert mask[j].any()  # every query sees its own key: no empty softmax row


def test_eagle_loss_falls_and_target_stays_frozen():
    """A few optimiser steps lower the training-time-test loss on a fixed batch; the target does not
    move and shares no parameter with the drafter (its embedding and LM head are used, not owned)."""
    target = tiny_target(0, vocab=9, n_layers=3).float()
    drafter = tiny_eagle(target, 1).float()
    before = [p.clone() for p in target.parameters()]
    ids = torch.randint(0, 9, (2, 16), generator=torch.Generator().manual_seed(0))
    drafter.train().requires_grad_(True)
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = eagle_loss(drafter, ids, 4.0, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters(), strict=True))
    assert not {id(p) for p in drafter.parameters()} & {id(p) for p in target.parameters()}


@pytest.mark.parametrize("distill", [False, True])
def test_eagle_loss_by_hand(distill):
    """The loss recomputed one (step, position) at a time: label of step s at pair j is x_{j+2} (or
    the target's distribution at j + 1), weight exp(-s / decay), rows j < s and the last one out."""
    target = tiny_target(2, vocab=7, n_layers=3)
    drafter = tiny_eagle(target, 3)
    ids = torch.randint(0, 7, (1, 9), generator=torch.Generator().manual_seed(1))
    loss = eagle_loss(drafter, ids, 3.0, distill=distill, steps=3)
    t_logits, feats = target(ids, feature_layers=drafter.feature_layers)
    logq = torch.log_softmax(drafter.forward_train(feats, ids, 3), -1)[:, 0]  # [S, T - 1, V]
    num = den = 0.0
    for s in range(3):
        w = torch.exp(torch.tensor(-s / 3.0, dtype=torch.float64))
        for j in range(s, ids.shape[1] - 2):
            if distill:
                nll = -(torch.softmax(t_logits[0, j + 1], -1) * logq[s, j]).sum()
            else:
                nll = -logq[s, j, ids[0, j + 2]]
            num, den = num + w * nll, den + w
    assert_rel_close(loss, num / den, 1e-10, "training-time-test loss")
