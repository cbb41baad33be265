"""Reference speculative decoding: the acceptance rules token by token, and a generation loop that
recomputes every forward from scratch (no KV cache, no rollback). Slow and obviously right; the
fast path in ``speculative.py`` must produce the same tokens from the same random numbers.

Acceptance (leviathan2022fast Algorithm 1; chen2023accelerating Algorithm 2), for a draft
``d_1..d_gamma`` with drafter distributions ``q_i`` and target distributions ``p_i`` (``p_i`` scores
``d_i`` given everything before it; ``p_{gamma+1}`` follows the whole draft):

* greedy (temperature 0): accept ``d_i`` while ``d_i = argmax p_i``; the first mismatch, or the end
  of the draft, is followed by ``argmax p_{a+1}`` (the target's own token), so each verification
  emits ``a + 1 >= 1`` tokens;
* sampling: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; on the first rejection
  emit a token from the residual ``norm(max(0, p_i - q_i))`` and stop; if all are accepted, emit one
  from ``p_{gamma+1}``. The emitted sequence is distributed exactly as sampling from ``p``.

Random numbers: every categorical draw is an inverse-CDF lookup of one uniform
(:func:`sample_inverse_cdf`), and the uniforms are drawn in a fixed order (documented in
``speculative.py``), so a seed fixes the output of both implementations.
"""

from __future__ import annotations

import torch

from repro.dflash.eagle import EagleDrafter
from repro.dflash.model import DFlashDrafter, Target


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Categorical draw by inverse CDF: probs ``[..., V]`` (non-negative, any positive total),
    u ``[...]`` uniform in [0, 1) -> indices ``[...]``: the first index whose cumulative mass exceeds
    ``u * total``. Tokens of zero mass are never returned."""
    cdf = probs.cumsum(-1)
    x = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in at least fp32 (temperature > 0)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits.to(dtype) / temperature, dim=-1)


def accept_reference(
    draft: list[int],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
    u: list[float] | None = None,
    u_final: float | None = None,
) -> tuple[int, int]:
    """One verification, token by token. draft: gamma tokens; target_logits ``[gamma + 1, V]``
    (row i scores draft[i]; the last row follows the whole draft); draft_probs ``[gamma, V]``
    (sampling only); u: gamma uniforms for the acceptance tests, u_final: one for the emitted token.

    Returns (a, token): the number of accepted draft tokens and the token the target adds.
    """
    gamma = len(draft)
    if temperature == 0:
        a = 0
        while a < gamma and draft[a] == int(target_logits[a].argmax()):
            a += 1
        return a, int(target_logits[a].argmax())
    p = probabilities(target_logits, temperature)
    q = draft_probs.to(p.dtype)
    for i in range(gamma):
        d = draft[i]
        if u[i] < min(1.0, float(p[i, d] / q[i, d])):  # accept d_i with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0)  # reject: resample from norm(max(0, p - q))
        return i, int(sample_inverse_cdf(residual, torch.tensor(u_final)))
    return gamma, int(sample_inverse_cdf(p[gamma], torch.tensor(u_final)))


def _rand(n: int, generator: torch.Generator | None, device) -> list[float]:
    return torch.rand(n, generator=generator, device=device, dtype=torch.float64).tolist()


def _draft_reference(drafter, target: Target, seq: list[int], gamma: int, temperature: float, generator):
    """The drafter's proposal recomputed from the whole sequence (no cache). Returns (tokens, probs)."""
    dev = target.device
    if isinstance(drafter, DFlashDrafter):
        # context = target features of every position but the anchor, recomputed from scratch
        _, feats = target(torch.tensor([seq[:-1]], device=dev), feature_layers=drafter.feature_layers)
        cache = drafter.new_cache()
        drafter.extend_context(cache, feats)
        logits = drafter.draft_logits(cache, torch.tensor(seq[-1], device=dev), gamma + 1)
        if temperature == 0:
            return logits.argmax(-1).tolist(), None
        q = probabilities(logits, temperature)
        u = torch.tensor(_rand(gamma, generator, dev), device=dev)
        return sample_inverse_cdf(q, u).tolist(), q
    if isinstance(drafter, EagleDrafter):
        # pairs (g_j, e(x_{j+1})) of every verified position j < n - 1, from a fresh target forward;
        # then each drafted token's pair (a, e(d_i)), a the previous output; the whole causal
        # forward recomputed for every token
        _, feats = target(torch.tensor([seq[:-1]], device=dev), feature_layers=drafter.feature_layers)
        h = drafter.fuse_features(feats)  # [1, n - 1, d]
        toks = torch.tensor([seq[1:]], device=dev)
        u = torch.tensor(_rand(gamma, generator, dev), device=dev) if temperature > 0 else None
        tokens, rows = [], []
        for i in range(gamma):
            a = drafter(h, toks)[:, -1:]  # no cache: positions 0 .. n - 2 + i
            logits = drafter.logits(a[0])
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                q = probabilities(logits, temperature)
                tok = sample_inverse_cdf(q, u[i : i + 1])
                rows.append(q[0])
            tokens.append(int(tok))
            h, toks = torch.cat([h, a], 1), torch.cat([toks, tok[None]], 1)
        return tokens, (torch.stack(rows) if rows else None)
    if isinstance(drafter, Target):  # classic autoregressive drafter, one token per full forward
        tokens, rows = [], []
        for _ in range(gamma):
            logits, _ = drafter(torch.tensor([seq + tokens], device=dev))
            if temperature == 0:
                tokens.append(int(logits[0, -1].argmax()))
            else:
                q = probabilities(logits[0, -1], temperature)
                tokens.append(
                    int(sample_inverse_cdf(q, torch.tensor(_rand(1, generator, dev)[0], device=dev)))
                )
                rows.append(q)
        return tokens, (torch.stack(rows) if rows else None)
    q = drafter.fn(torch.tensor(seq, device=dev), gamma)  # FunctionDrafter: stateless by definition
    if temperature == 0:
        return q.argmax(-1).tolist(), None
    u = torch.tensor(_rand(gamma, generator, dev), device=dev)
    return sample_inverse_cdf(q, u).tolist(), q


@torch.no_grad()
def speculative_generate_reference(
    target: Target,
    drafter,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Speculative decoding with every forward recomputed over the whole sequence.

    Same arguments as :func:`repro.dflash.speculative_generate`; returns (tokens ``[max_new_tokens]``,
    accepted draft tokens per verification).
    """
    dev = target.device
    gamma = block_size - 1
    seq = prompt_ids.tolist()
    p0 = len(seq)
    logits, _ = target(torch.tensor([seq], device=dev))
    if temperature == 0:
        seq.append(int(logits[0, -1].argmax()))
    else:
        u0 = torch.tensor(_rand(1, generator, dev)[0], device=dev)
        seq.append(int(sample_inverse_cdf(probabilities(logits[0, -1], temperature), u0)))
    accepted = []
    while len(seq) - p0 < max_new_tokens:
        draft, q = _draft_reference(drafter, target, seq, gamma, temperature, generator)
        logits, _ = target(torch.tensor([seq + draft], device=dev))
        block_logits = logits[0, len(seq) - 1 :]  # [gamma + 1, V]: rows for anchor, d_1 .. d_gamma
        if temperature == 0:
            a, nxt = accept_reference(draft, block_logits, None, 0.0)
        else:
            u = _rand(gamma, generator, dev)
            u_final = _rand(1, generator, dev)[0]
            a, nxt = accept_reference(draft, block_logits, q, temperature, u, u_final)
        seq += draft[:a] + [nxt]
        accepted.append(a)
    return torch.tensor(seq[p0 : p0 + max_new_tokens]), accepted


@torch.no_grad()
def generate_reference(
    target: Target, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, generator=None
) -> torch.Tensor:
    """Plain autoregressive decoding with the full sequence recomputed at every step."""
    dev = target.device
    seq = prompt_ids.tolist()
    for _ in range(max_new_tokens):
        logits, _ = target(torch.tensor([seq], device=dev))
        if temperature == 0:
            seq.append(int(logits[0, -1].argmax()))
        else:
            u = torch.tensor(_rand(1, generator, dev)[0], device=dev)
            seq.append(int(sample_inverse_cdf(probabilities(logits[0, -1], temperature), u)))
    return torch.tensor(seq[len(prompt_ids) :])
