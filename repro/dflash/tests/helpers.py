"""Tiny random models for the property tests (fp64 on the CPU, so that cached and recomputed
forwards agree to rounding and argmax ties have probability zero)."""

from __future__ import annotations

import torch

from repro.dflash import (
    DFlashDrafter,
    DrafterConfig,
    EagleConfig,
    EagleDrafter,
    FunctionDrafter,
    Target,
    TargetConfig,
    generate,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randomize(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """Redraw every weight matrix with std ``scale / sqrt(fan_in)``-like spread from ``seed``, so that a
    random model's next-token distributions are peaked (not near uniform) and drafters sometimes agree."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale / p.shape[-1] ** 0.5)
            elif p.dim() == 1 and p.shape[0] > 0:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def tiny_target(seed: int, vocab: int = 8, n_layers: int = 2, d: int = 16, heads: int = 2, scale: float = 2.0,
                device: str = "cpu", dtype=torch.float64) -> Target:  # fmt: skip
    t = Target(TargetConfig(vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=heads, max_len=128))
    return randomize(t.to(dtype), seed, scale).to(device).eval()


def tiny_dflash(
    target: Target, seed: int, n_layers: int = 1, max_block: int = 8, scale: float = 2.0
) -> DFlashDrafter:
    n_feat = min(2, target.cfg.n_layers)
    d = DFlashDrafter(target, DrafterConfig(n_layers=n_layers, n_features=n_feat, max_block=max_block))
    return randomize(d.to(target.dtype), seed, scale).to(target.device).eval()


def tiny_eagle(target: Target, seed: int, n_layers: int = 1, scale: float = 2.0) -> EagleDrafter:
    n_feat = min(3, target.cfg.n_layers)
    d = EagleDrafter(target, EagleConfig(n_layers=n_layers, n_features=n_feat))
    return randomize(d.to(target.dtype), seed, scale).to(target.device).eval()


def tiny_ar(target: Target, seed: int, scale: float = 2.0) -> Target:
    c = target.cfg
    t = Target(
        TargetConfig(vocab_size=c.vocab_size, d_model=c.d_model, n_layers=1, n_heads=c.n_heads, max_len=128)
    )
    return randomize(t.to(target.dtype), seed, scale).to(target.device).eval()


def oracle_then_wrong(target: Target, correct: int) -> FunctionDrafter:
    """Adversary: drafts the target's own greedy continuation for ``correct`` tokens, then a wrong
    token, then the right ones again (so a bug that skips a rejected position would show)."""

    def fn(committed: torch.Tensor, gamma: int) -> torch.Tensor:
        cont = generate(target, committed, gamma).tolist()
        V = target.cfg.vocab_size
        toks = [(t + 1) % V if i == correct else t for i, t in enumerate(cont)]
        return torch.nn.functional.one_hot(torch.tensor(toks), V).to(target.dtype).to(committed.device)

    return FunctionDrafter(fn)


def random_drafter(vocab: int, seed: int, peaked: float = 3.0, dtype=torch.float64) -> FunctionDrafter:
    """Drafts from random distributions (a different draw every call), peaked by ``peaked``."""
    gen = torch.Generator().manual_seed(seed)

    def fn(committed: torch.Tensor, gamma: int) -> torch.Tensor:
        z = torch.randn(gamma, vocab, generator=gen, dtype=dtype) * peaked
        return torch.softmax(z, -1).to(committed.device)

    return FunctionDrafter(fn)


def constant_drafter(vocab: int, token: int, dtype=torch.float64) -> FunctionDrafter:
    """Always drafts the same token."""

    def fn(committed: torch.Tensor, gamma: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.full((gamma,), token), vocab).to(dtype).to(committed.device)

    return FunctionDrafter(fn)


def make_drafter(kind: str, target: Target, seed: int):
    V = target.cfg.vocab_size
    if kind == "dflash":
        return tiny_dflash(target, seed)
    if kind == "eagle":
        return tiny_eagle(target, seed)
    if kind == "ar":
        return tiny_ar(target, seed)
    if kind == "random":
        return random_drafter(V, seed)
    if kind == "constant":
        return constant_drafter(V, seed % V)
    if kind.startswith("oracle"):
        return oracle_then_wrong(target, int(kind[len("oracle") :]))
    raise ValueError(kind)


DRAFTER_KINDS = ["dflash", "eagle", "ar", "random", "constant", "oracle0", "oracle2"]
