"""dflash/cache-equals-recompute: KV caches with rollback give what recomputing from scratch gives.

The fast path (target KV cache cropped after each verification, DFlash context cache extended with
the accepted positions only, autoregressive drafter cache cropped) against ``reference.py``, which
recomputes every forward over the whole sequence: the same tokens and the same accepted lengths
from the same random numbers, greedy and sampling. fp64, so rounding differences (~1e-15) cannot
flip a decision except on a set of measure zero.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.dflash import speculative_generate, speculative_generate_reference
from repro.dflash.tests.helpers import make_drafter, tiny_dflash, tiny_target

SECTION = "§4.1, Conditioning via KV injection; §A.3 (arXiv v2)"


@pytest.mark.claim("dflash/cache-equals-recompute", section=SECTION)
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    new=st.integers(1, 14),
    block_size=st.integers(2, 7),
    kind=st.sampled_from(["dflash", "ar", "random"]),
    temperature=st.sampled_from([0.0, 0.8, 1.0]),
)
def test_fast_path_equals_recompute(seed, new, block_size, kind, temperature):
    target = tiny_target(seed, vocab=7)
    drafter = make_drafter(kind, target, seed + 1)
    if kind == "random":  # its function draws from its own generator: build two identical ones
        drafter2 = make_drafter(kind, target, seed + 1)
    else:
        drafter2 = drafter
    prompt = torch.tensor([1, 4, 2])
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    out = speculative_generate(
        target, drafter, prompt, new, block_size=block_size, temperature=temperature, generator=g1
    )
    ref, accepted = speculative_generate_reference(
        target, drafter2, prompt, new, block_size=block_size, temperature=temperature, generator=g2
    )
    assert torch.equal(out.tokens, ref)
    assert out.accepted == accepted


@pytest.mark.claim("dflash/cache-equals-recompute", section=SECTION)
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    block=st.integers(2, 8),
)
def test_context_cache_in_pieces_equals_at_once(seed, cuts, block):
    """Extending DFlash's context cache piece by piece (as verifications do) gives the same keys,
    values and draft logits as one extension with all features (1e-12: fp64, same products)."""
    target = tiny_target(seed, vocab=9)
    drafter = tiny_dflash(target, seed + 1)
    n = sum(cuts)
    ids = torch.randint(0, 9, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    _, feats = target(ids[:, :n], feature_layers=drafter.feature_layers)
    whole, parts = drafter.new_cache(), drafter.new_cache()
    drafter.extend_context(whole, feats)
    start = 0
    for c in cuts:
        drafter.extend_context(parts, feats[:, start : start + c])
        start += c
    assert whole.length == parts.length == n
    assert_rel_close(parts.k[:, :, :, :n], whole.k[:, :, :, :n], 1e-12, "context keys")
    assert_rel_close(parts.v[:, :, :, :n], whole.v[:, :, :, :n], 1e-12, "context values")
    anchor = ids[0, n]
    assert_rel_close(
        drafter.draft_logits(parts, anchor, block), drafter.draft_logits(whole, anchor, block), 1e-12
    )
