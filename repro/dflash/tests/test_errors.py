"""Bad input raises a clear error that names the argument and the expected value."""

from __future__ import annotations

import pytest
import torch

from repro.dflash import DFlashDrafter, DrafterConfig, TargetConfig, generate, speculative_generate
from repro.dflash.tests.helpers import tiny_dflash, tiny_target


@pytest.fixture(scope="module")
def models():
    t = tiny_target(0, vocab=5)
    return t, tiny_dflash(t, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 1}, "block_size must be an int >= 2"),
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
    with pytest.raises(TypeError, match="drafter must be a DFlashDrafter"):
        speculative_generate(t, object(), torch.tensor([1]), 4, block_size=3)


def test_bad_configs():
    with pytest.raises(ValueError, match="d_model=30 must split into n_heads=4"):
        TargetConfig(d_model=30, n_heads=4)
    t = tiny_target(0, vocab=5)
    with pytest.raises(ValueError, match=r"feature_layers \(5,\) must lie in \[0, 2\)"):
        DFlashDrafter(t, DrafterConfig(feature_layers=(5,)))


def test_auto_mode_is_eager_on_the_cpu(models, monkeypatch):
    """The default mode, "auto", runs the eager loop on a CPU target (graphs only on a CUDA one)."""
    from repro.dflash import speculative as spec

    t, d = models
    called = []
    monkeypatch.setattr(spec, "_speculative_static", lambda *a, **k: called.append(a))
    out = speculative_generate(t, d, torch.tensor([1, 2]), 5, block_size=3)
    assert not called and out.tokens.shape == (5,)
    assert spec._resolve_mode("auto", t) == "eager" and spec._resolve_mode("static", t) == "static"
