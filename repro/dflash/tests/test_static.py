"""The capturable decoding path (``static.py``): same tokens as the eager loop, no host reads in a step.

On the CPU ``mode="graphs"`` runs the same static steps eagerly (no capture), so these tests check
the static functions: attention over the whole cache under a device-side mask, ``index_copy_``
writes at device positions, DFlash's padded context update, the accepted length kept on the device.
The graph replay itself is checked on the GPU (``test_gpu.py``). fp64 tiny models, as in the other
tests, so that exact token equality is the right check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.dflash import Target, TargetConfig, generate, speculative_generate
from repro.dflash.static import StaticDecoder
from repro.dflash.tests.helpers import (
    DRAFTER_KINDS,
    make_drafter,
    randomize,
    tiny_dflash,
    tiny_eagle,
    tiny_target,
)

SECTION = "Abstract; §3.1 (arXiv v2)"


@pytest.mark.claim("dflash/lossless-greedy", section=SECTION)
@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    new=st.integers(1, 14),
    block_size=st.integers(2, 8),
    kind=st.sampled_from(DRAFTER_KINDS),
    mode=st.sampled_from(["static", "graphs"]),
)
def test_static_greedy_equals_eager_and_target(seed, new, block_size, kind, mode):
    target = tiny_target(seed, vocab=9)
    prompt = torch.randint(0, 9, (3,), generator=torch.Generator().manual_seed(seed))
    expected = generate(target, prompt, new)
    eager = speculative_generate(
        target, make_drafter(kind, target, seed + 1), prompt, new, block_size=block_size
    )
    out = speculative_generate(
        target, make_drafter(kind, target, seed + 1), prompt, new, block_size=block_size, mode=mode
    )
    assert torch.equal(out.tokens, expected), f"{kind}: {out.tokens.tolist()} != {expected.tolist()}"
    assert out.accepted == eager.accepted and out.target_forwards == eager.target_forwards
    assert out.drafter_forwards == eager.drafter_forwards
    assert torch.equal(generate(target, prompt, new, mode=mode), expected)


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.integers(2, 7),
    kind=st.sampled_from(["dflash", "eagle", "ar", "random"]),
)
def test_static_sampling_equals_eager(seed, block_size, kind):
    """Temperature 1: the same uniforms in the same order give the same tokens and accepted lengths."""
    target = tiny_target(seed, vocab=7)
    prompt = torch.tensor([1, 4, 2])
    outs = []
    for mode in ("eager", "static"):
        gen = torch.Generator().manual_seed(seed)
        drafter = make_drafter(kind, target, seed + 1)
        outs.append(
            speculative_generate(
                target, drafter, prompt, 12, block_size=block_size, temperature=1.0, generator=gen, mode=mode
            )
        )
    assert torch.equal(outs[0].tokens, outs[1].tokens) and outs[0].accepted == outs[1].accepted
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    assert torch.equal(
        generate(target, prompt, 12, 1.0, generator=g1),
        generate(target, prompt, 12, 1.0, generator=g2, mode="static"),
    )


@pytest.mark.claim("dflash/lossless-greedy", section=SECTION)
@pytest.mark.parametrize("kind", ["dflash", "eagle", "oracle1", "constant"])
def test_static_fills_the_cache(kind):
    """prompt + new tokens + block = max_len exactly: the last verification writes the cache's last
    positions, and the padded DFlash context update too; still the target's greedy output."""
    max_len, block, p_len = 32, 6, 5
    target = Target(TargetConfig(vocab_size=8, d_model=16, n_layers=2, n_heads=2, max_len=max_len))
    target = randomize(target.double(), 3, 2.0).eval()
    prompt = torch.randint(0, 8, (p_len,), generator=torch.Generator().manual_seed(1))
    new = max_len - p_len - block
    expected = generate(target, prompt, new)
    out = speculative_generate(
        target, make_drafter(kind, target, 4), prompt, new, block_size=block, mode="static"
    )
    assert torch.equal(out.tokens, expected)
    assert torch.equal(
        generate(target, prompt, max_len - p_len, mode="static"), generate(target, prompt, max_len - p_len)
    )


class _NoHostReads:
    """Makes every Tensor method that hands a value to the host raise (item, tolist, cpu, numpy,
    truth value, int/float/index conversion, nonzero): a step that calls one fails the test."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __enter__(self):
        for name in self.NAMES:
            self.monkeypatch.setattr(torch.Tensor, name, self._raiser(name))
        return self

    def __exit__(self, *exc):
        self.monkeypatch.undo()

    @staticmethod
    def _raiser(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"host read inside a static step: Tensor.{name}")

        return fail


@pytest.mark.parametrize("kind", ["dflash", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_steps_make_no_host_reads(monkeypatch, temperature, kind):
    target = tiny_target(11, vocab=9)
    drafter = tiny_dflash(target, 12) if kind == "dflash" else tiny_eagle(target, 12)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        spec = StaticDecoder(target, drafter, 5, temperature, graphs=True)
        plain = StaticDecoder(target, None, 1, temperature, graphs=True)
        for dec in (spec, plain):
            dec.prefill(torch.tensor([1, 2, 3]), gen)
            dec.draw_uniforms(gen)
        n_before = int(spec.n)
        with _NoHostReads(monkeypatch):
            with pytest.raises(AssertionError, match="host read"):  # the guard works
                torch.ones(1).item()
            for _ in range(3):
                spec.steps["draft"]()
                spec.steps["verify"]()
                plain.steps["step"]()
        assert int(spec.n) > n_before and int(plain.n) == 3 + 1 + 3


def test_bad_mode():
    target = tiny_target(0)
    with pytest.raises(ValueError, match="mode must be one of"):
        generate(target, torch.tensor([1]), 2, mode="cuda-graphs")


def test_graph_key_follows_where_weights_live():
    """A captured decoder is reused only while both models' weights stay where the graph read them:
    replacing the drafter's or the target's parameters (``.float()`` of these fp64 models) changes the key, an in-place
    update does not, and a function drafter contributes no weights."""
    from repro.dflash.static import graph_key

    target = tiny_target(0, vocab=7, n_layers=2, d=16, heads=2)
    drafter = make_drafter("dflash", target, 1)
    key = graph_key(target, drafter, 4, 0.0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1.0)  # in place: same storage
    assert graph_key(target, drafter, 4, 0.0) == key
    assert graph_key(target, drafter, 5, 0.0) != key and graph_key(target, drafter, 4, 1.0) != key
    drafter.float()
    assert graph_key(target, drafter, 4, 0.0) != key
    key2 = graph_key(target, drafter, 4, 0.0)
    target.float()
    assert graph_key(target, drafter, 4, 0.0) != key2
    assert graph_key(target, make_drafter("random", target, 1), 4, 0.0)[-1] == ()
