"""dflash/training-mask: all blocks of a sequence trained in one pass see exactly what inference sees.

The training forward (many anchors per window under ``training_mask``) against the inference path
(context cache holding the target features of positions < anchor, then one block): equal logits
(1e-10, fp64: the same sums in a different order). And the mask itself, enumerated.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.dflash.model import training_mask
from repro.dflash.tests.helpers import tiny_dflash, tiny_target
from repro.dflash.train import drafter_loss, position_weights, sample_anchors

SECTION = "§4.2, Figure 4 (arXiv v2)"


@pytest.mark.claim("dflash/training-mask", section=SECTION)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), T=st.integers(10, 24), m=st.integers(1, 4), block=st.integers(2, 6))
def test_training_forward_equals_inference(seed, T, m, block):
    target = tiny_target(seed, vocab=9)
    drafter = tiny_dflash(target, seed + 1, n_layers=2, max_block=block)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (2, T), generator=gen)
    anchors, sizes = sample_anchors(2, T, m, block, 2, gen)
    _, feats = target(ids, feature_layers=drafter.feature_layers)
    logits = drafter.forward_train(feats, ids, anchors, sizes, block)  # [2, m, block, V]
    for b in range(2):
        for j in range(m):
            a, size = int(anchors[b, j]), int(sizes[b, j])
            cache = drafter.new_cache()
            drafter.extend_context(cache, feats[b : b + 1, :a])  # features of positions < anchor
            ref = drafter.draft_logits(cache, ids[b, a], size)  # [size - 1, V]
            assert_rel_close(logits[b, j, 1:size], ref, 1e-10, f"block {j} of row {b}")


@pytest.mark.claim("dflash/training-mask", section=SECTION)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), T=st.integers(10, 20), m=st.integers(1, 4), block=st.integers(2, 5))
def test_mask_enumerated(seed, T, m, block):
    gen = torch.Generator().manual_seed(seed)
    anchors, sizes = sample_anchors(1, T, m, block, 1, gen)
    mask = training_mask(anchors, sizes, T, block)[0]
    for i in range(m):
        for j in range(block):
            row = mask[i * block + j]
            for t in range(T):  # context: strictly before the anchor
                assert bool(row[t]) == (t < int(anchors[0, i]))
            for i2 in range(m):  # blocks: only its own, only positions inside its length
                for j2 in range(block):
                    assert bool(row[T + i2 * block + j2]) == (i2 == i and j2 < int(sizes[0, i]))


def test_position_weights_decay():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.all(w[2:] < w[1:-1])
    assert_rel_close(w[8], torch.tensor(torch.e ** (-1.0)), 1e-6)


def test_drafter_loss_falls_and_target_stays_frozen():
    """A few optimiser steps lower the block loss on a fixed batch; the target's weights do not move."""
    target = tiny_target(0, vocab=9).float()
    drafter = tiny_dflash(target, 1).float()
    before = [p.clone() for p in target.parameters()]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (2, 16), generator=gen)
    anchors, sizes = sample_anchors(2, 16, 3, 4, 2, gen)
    drafter.train().requires_grad_(True)
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = drafter_loss(drafter, ids, anchors, sizes, 4, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters(), strict=True))
    # the shared embedding and LM head are used, not owned: the optimiser never sees them
    assert not {id(p) for p in drafter.parameters()} & {id(p) for p in target.parameters()}


def test_drafter_loss_gradients():
    """Autograd's gradient of the block loss through the injected context, the mask embedding and
    the attention mask matches finite differences (fp64 gradcheck on a tiny drafter)."""
    target = tiny_target(3, vocab=5, n_layers=2, d=8, heads=2)
    drafter = tiny_dflash(target, 4, max_block=3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (1, 8), generator=gen)
    anchors, sizes = sample_anchors(1, 8, 2, 3, 2, gen)
    params = [drafter.mask_embedding, drafter.fuse.weight]

    def loss(mask_embedding, fuse_weight):
        with torch.nn.utils.stateless._reparametrize_module(
            drafter, {"mask_embedding": mask_embedding, "fuse.weight": fuse_weight}
        ):
            return drafter_loss(drafter, ids, anchors, sizes, 3, 2.0)

    inputs = [p.detach().clone().requires_grad_(True) for p in params]
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), block=st.integers(2, 5))
def test_distill_loss_uses_the_targets_next_token_distribution(seed, block):
    """With distill, the label of block position k is the target's distribution at position a + k - 1
    (its prediction of x_{a+k}); computed here one position at a time (1e-10, fp64)."""
    target = tiny_target(seed, vocab=7)
    drafter = tiny_dflash(target, seed + 1, max_block=block)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (1, 14), generator=gen)
    anchors, sizes = sample_anchors(1, 14, 2, block, 2, gen)
    loss = drafter_loss(drafter, ids, anchors, sizes, block, 3.0, distill=True)
    t_logits, feats = target(ids, feature_layers=drafter.feature_layers)
    q = torch.log_softmax(drafter.forward_train(feats, ids, anchors, sizes, block), -1)[0]
    w_all = position_weights(block, 3.0)
    num = den = 0.0
    for j in range(2):
        a = int(anchors[0, j])
        for k in range(1, int(sizes[0, j])):
            p = torch.softmax(t_logits[0, a + k - 1], -1)
            num = num + w_all[k] * -(p * q[j, k]).sum()
            den = den + w_all[k]
    assert_rel_close(loss, num / den, 1e-10, "distilled block loss")
