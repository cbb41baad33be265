"""Bad input raises a clear error that names the argument and the expected value."""

from __future__ import annotations

import pytest
import torch

from repro.dflash import (
    DFlashDrafter,
    DrafterConfig,
    EagleConfig,
    EagleDrafter,
    FunctionDrafter,
    TargetConfig,
    generate,
    speculative_generate,
)
from repro.dflash.tests.helpers import tiny_ar, tiny_dflash, tiny_eagle, tiny_target


@pytest.fixture(scope="module")
def models():
    t = tiny_target(0, vocab=5)
    return t, tiny_dflash(t, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 1}, "block_size must be an int >= 2"),
        ({"block_size": 0}, "block_size must be an int >= 2"),
        ({"block_size": -3}, "block_size must be an int >= 2"),
        ({"block_size": 2.5}, "block_size must be an int >= 2"),
        ({"block_size": True}, "block_size must be an int >= 2"),
        ({"block_size": 9}, "exceeds the drafter's max_block=8"),
        ({"block_size": 4, "temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"block_size": 4, "temperature": float("nan")}, "temperature must be a finite number >= 0"),
        (
            {"block_size": 4, "mode": "cuda-graphs"},
            r"mode must be one of \('auto', 'eager', 'static', 'graphs'\)",
        ),
    ],
)
def test_bad_speculative_args(models, kwargs, match):
    t, d = models
    with pytest.raises(ValueError, match=match):
        speculative_generate(t, d, torch.tensor([1, 2]), 5, **kwargs)


def test_bad_prompts_and_lengths(models):
    t, d = models
    with pytest.raises(ValueError, match="prompt_ids must be a non-empty 1-D tensor"):
        generate(t, torch.tensor([[1, 2]]), 3)
    with pytest.raises(ValueError, match="prompt_ids must be a non-empty 1-D tensor"):
        generate(t, torch.tensor([], dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, vocab_size=5\)"):
        generate(t, torch.tensor([7]), 3)
    with pytest.raises(ValueError, match="prompt_ids must hold integer token ids"):
        generate(t, torch.tensor([1.0]), 3)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        speculative_generate(t, d, torch.tensor([1]), 0, block_size=4)
    with pytest.raises(ValueError, match="exceeds the target's max_len=128"):
        speculative_generate(t, d, torch.tensor([1]), 125, block_size=4)


@pytest.mark.parametrize("kind", ["dflash", "eagle", "ar"])
def test_bad_lengths_every_drafter(kind):
    """Empty prompt, max_new_tokens <= 0 and a block longer than the context left: a ValueError naming
    the argument, raised before any forward (so nothing can loop), whatever the drafter."""
    t = tiny_target(0, vocab=5)
    d = {"dflash": tiny_dflash, "eagle": tiny_eagle, "ar": tiny_ar}[kind](t, 1)
    cases = [
        (dict(prompt_ids=torch.tensor([], dtype=torch.long), max_new_tokens=3, block_size=3), "prompt_ids must be a non-empty"),
        (dict(prompt_ids=torch.tensor([1]), max_new_tokens=-1, block_size=3), "max_new_tokens must be a positive int"),
        (dict(prompt_ids=torch.tensor([1]), max_new_tokens=0, block_size=3), "max_new_tokens must be a positive int"),
        (dict(prompt_ids=torch.tensor([1]), max_new_tokens=2.0, block_size=3), "max_new_tokens must be a positive int"),
        (dict(prompt_ids=torch.tensor([1]), max_new_tokens=4, block_size=0), "block_size must be an int >= 2"),
        # block larger than the context: 1 + 4 + 124 > max_len = 128
        (dict(prompt_ids=torch.tensor([1]), max_new_tokens=4, block_size=124), "exceeds"),
    ]  # fmt: skip
    calls = [0]
    t.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for kwargs, match in cases:
        for mode in ("eager", "static"):
            with pytest.raises(ValueError, match=match):
                speculative_generate(t, d, mode=mode, **kwargs)
    assert calls[0] == 0


def test_mismatched_vocabularies():
    """A drafter over another vocabulary than the target's is refused with both sizes named."""
    t = tiny_target(0, vocab=5)
    ar = tiny_ar(tiny_target(1, vocab=7), 2)
    with pytest.raises(ValueError, match=r"vocab_size=7 differs from the target's vocab_size=5"):
        speculative_generate(t, ar, torch.tensor([1]), 4, block_size=3)
    wrong_rows = FunctionDrafter(lambda ids, gamma: torch.full((gamma, 7), 1 / 7, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"fn must return \[gamma=2, vocab_size=5\] probabilities, got \(2, 7\)"
    ):
        speculative_generate(t, wrong_rows, torch.tensor([1]), 4, block_size=3)
    other = tiny_target(3, vocab=7)
    with pytest.raises(ValueError, match="EagleDrafter was built for another target"):
        speculative_generate(
            t, EagleDrafter(other, EagleConfig(n_features=1)).double(), torch.tensor([1]), 4, block_size=3
        )
    with pytest.raises(ValueError, match="DFlashDrafter was built for another target"):
        speculative_generate(t, tiny_dflash(other, 1), torch.tensor([1]), 4, block_size=3)


def test_wrong_drafter(models):
    t, _ = models
    other = tiny_target(3, vocab=5)
    with pytest.raises(ValueError, match="built for another target"):
        speculative_generate(
            t,
            DFlashDrafter(other, DrafterConfig(n_layers=1, n_features=1)).double(),
            torch.tensor([1]),
            4,
            block_size=3,
        )
    with pytest.raises(TypeError, match="drafter must be a DFlashDrafter, an EagleDrafter"):
        speculative_generate(t, object(), torch.tensor([1]), 4, block_size=3)


def test_bad_configs():
    with pytest.raises(ValueError, match="d_model=30 must split into n_heads=4"):
        TargetConfig(d_model=30, n_heads=4)
    t = tiny_target(0, vocab=5)
    with pytest.raises(ValueError, match=r"feature_layers \(5,\) must lie in \[0, 2\)"):
        DFlashDrafter(t, DrafterConfig(feature_layers=(5,)))
    with pytest.raises(ValueError, match=r"EagleDrafter: feature_layers \(5,\) must lie in \[0, 2\)"):
        EagleDrafter(t, EagleConfig(feature_layers=(5,)))
    with pytest.raises(ValueError, match="n_layers and ttt_steps must be >= 1"):
        EagleDrafter(t, EagleConfig(n_features=1, ttt_steps=0))
    with pytest.raises(ValueError, match="injection must be 'kv' or 'input'"):
        DrafterConfig(injection="cross")


def test_auto_mode_is_eager_on_the_cpu(models, monkeypatch):
    """The default mode, "auto", runs the eager loop on a CPU target (graphs only on a CUDA one)."""
    from repro.dflash import speculative as spec

    t, d = models
    called = []
    monkeypatch.setattr(spec, "_speculative_static", lambda *a, **k: called.append(a))
    out = speculative_generate(t, d, torch.tensor([1, 2]), 5, block_size=3)
    assert not called and out.tokens.shape == (5,)
    assert spec._resolve_mode("auto", t) == "eager" and spec._resolve_mode("static", t) == "static"
