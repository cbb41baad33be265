"""Plain PyTorch from piche2025pipelinerl's equations: the objective, ESS, lags, and slow generation.

Everything here is the ground truth the fast path (``actor.py``'s cached engine, ``trainer.py``)
is tested against.

Objective (the paper's background on truncated importance sampling; our notation). For sequence ``i`` with completion
tokens ``y_ij`` sampled by behaviour policy ``mu`` (whatever weight version produced each token)
and current policy ``pi_theta``::

    rho_ij = pi_theta(y_ij | x_i, y_i<j) / mu(y_ij | x_i, y_i<j)
    L(theta) = -(1/B) sum_i sum_j min(rho_ij, c) * A_i * log pi_theta(y_ij | ...)     (weight not differentiated)

with ``A_i`` the reward minus its group's mean (GRPO-style baseline without std division, as the
released code's default). With ``mu = pi_theta`` every ``rho = 1`` and ``L`` is the on-policy
REINFORCE loss. ``c`` is the truncation cap: the paper truncates importance weights; the released
code clamps the ratio to ``[0, 1 + eps_high]`` with ``eps_high = 0.2``, far tighter; ours is a
parameter (``is_cap``).

Effective sample size (the paper uses it to monitor how off-policy a batch is)::

    ESS = (sum_t rho_t)^2 / (N sum_t rho_t^2)   in (0, 1],  1 when on-policy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repro.pipelinerl.task import EOS


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log pi(tokens[:, t+1] | tokens[:, :t+1])`` for every t: tokens ``[B, T]`` -> ``[B, T-1]``."""
    logits = model(tokens[:, :-1]).float() / temperature
    return torch.gather(F.log_softmax(logits, -1), 2, tokens[:, 1:, None]).squeeze(2)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards ``[B]`` in consecutive groups of ``group_size`` (same prompt) -> ``r - mean(group)``."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: rewards must be [B] with B a multiple of group_size={group_size}, "
            f"got {tuple(rewards.shape)}"
        )
    r = rewards.view(-1, group_size)
    return (r - r.mean(1, keepdim=True)).reshape(-1)


def _check(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> None:
    if logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"loss: logp and mask must both be [B, T], got {tuple(logp.shape)} and {tuple(mask.shape)}"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"loss: advantages must be [B]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}"
        )


def on_policy_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE with a baseline: ``-(1/B) sum_i A_i sum_j log pi(y_ij)``; logp, mask ``[B, T]``."""
    _check(logp, mask, advantages)
    return -(advantages[:, None] * logp * mask).sum() / logp.shape[0]


def importance_weights(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """``rho = pi / mu = exp(log pi - log mu)``, ``[B, T]``, not differentiated."""
    return torch.exp(logp.detach() - behaviour_logp)


def truncated_is_loss(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """The truncated importance-weighted policy-gradient loss ``L`` of the module docstring.

    logp ``[B, T]`` (differentiable, current policy), behaviour_logp ``[B, T]`` (recorded at
    sampling), advantages ``[B]``, mask ``[B, T]`` (True on completion tokens), cap ``c > 0``."""
    _check(logp, mask, advantages)
    if behaviour_logp.shape != logp.shape:
        raise ValueError(
            f"truncated_is_loss: behaviour_logp must be {tuple(logp.shape)}, got {tuple(behaviour_logp.shape)}"
        )
    if not cap > 0:
        raise ValueError(f"truncated_is_loss: cap must be > 0, got {cap}")
    w = importance_weights(logp, behaviour_logp).clamp(max=cap)
    return -(w * advantages[:, None] * logp * mask).sum() / logp.shape[0]


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Normalised ESS ``(sum w)^2 / (N sum w^2)`` over the masked entries of ``weights``."""
    w = weights[mask] if mask is not None else weights.reshape(-1)
    if w.numel() == 0:
        raise ValueError("effective_sample_size: no weights selected")
    w = w.double()
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def token_lags(versions: list[int], used_at: int) -> list[int]:
    """Lag of each token, in samples: trainer samples consumed at use minus the token's version."""
    return [used_at - v for v in versions]


def check_version_log(used: list[dict], max_lag: int, mode: str, batch_size: int) -> None:
    """Raise AssertionError unless a log of trained samples keeps the version bookkeeping.

    ``used``: dicts with ``index``, ``versions`` (one per completion token) and ``used_at`` (the
    trainer's samples when it trained on them). Along every sample versions never decrease; no
    token is from weights newer than the trainer's or older than ``max_lag`` samples; in async and
    conventional mode a sample has one version; in conventional mode lags are whole steps."""
    for u in used:
        v = u["versions"]
        assert v == sorted(v), f"sample {u['index']}: versions decrease along the sequence: {v}"
        assert u["used_at"] - min(v) <= max_lag, (
            f"sample {u['index']}: lag {u['used_at'] - min(v)} > {max_lag}"
        )
        assert max(v) <= u["used_at"], (
            f"sample {u['index']}: a token from weights the trainer has not made yet"
        )
        if mode != "pipeline":
            assert len(set(v)) == 1, f"{mode}: weights changed inside sample {u['index']}"
        if mode == "conventional":
            assert (u["used_at"] - v[0]) % batch_size == 0, f"sample {u['index']}: lag not a whole step"


def sample_token(
    logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling: logits ``[S, V]``, uniforms ``u [S]`` -> tokens ``[S]``, their log-probs ``[S]``.

    Deterministic given the uniforms, so a sample's tokens depend only on its own random numbers and
    the weights, never on which slot or batch it was decoded in."""
    logp = F.log_softmax(logits.double() / temperature, -1)
    cdf = logp.exp().cumsum(-1)
    tok = (
        torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1]).unsqueeze(1))
        .squeeze(1)
        .clamp(max=logits.shape[-1] - 1)
    )
    return tok, logp.gather(1, tok[:, None]).squeeze(1).float()


@torch.no_grad()
def generate_reference(
    model: torch.nn.Module, prompt: list[int], uniforms: torch.Tensor, max_new: int, temperature: float = 1.0
) -> tuple[list[int], list[float]]:
    """One completion, no KV cache: the whole prefix through :meth:`Policy.forward` at every step.

    Returns the generated tokens (EOS included when produced) and their log-probs."""
    device = next(model.parameters()).device
    seq = list(prompt)
    out, lps = [], []
    for j in range(max_new):
        logits = model(torch.tensor([seq], device=device))[:, -1]
        tok, lp = sample_token(logits, uniforms[j : j + 1].to(device), temperature)
        out.append(int(tok))
        lps.append(float(lp))
        seq.append(int(tok))
        if out[-1] == EOS:
            break
    return out, lps


@torch.no_grad()
def generate_stale_cache_reference(
    models: list[torch.nn.Module],
    weights_at,
    prompt: list[int],
    uniforms: torch.Tensor,
    max_new: int,
    temperature: float = 1.0,
    forced: list[int] | None = None,
) -> tuple[list[int], list[float]]:
    """One completion as an engine that swaps weights mid-sequence and keeps its KV cache computes it.

    ``weights_at(t)`` is the index into ``models`` of the weights that process position ``t`` (the
    prompt's positions included): those weights compute position ``t``'s query, key and value, and
    attend to the keys and values that earlier positions' weights computed and left in the cache
    (piche2025pipelinerl v1, Abstract: new weights arrive "during the generation of token
    sequences"; the cache is not recomputed). Written from the model's modules with plain loops over
    positions and a hand-written softmax attention, not through :meth:`Policy.decode`, so that it is
    a separate statement of what the engine should compute. ``weights_at = lambda t: 0`` with one
    model is plain generation; ``lambda t: 1`` after a swap the recomputed-cache alternative.

    ``forced``: completion tokens to score instead of sampling (teacher forcing); the log-probs are
    those of the forced tokens. Returns the completion tokens (EOS included when produced) and their
    log-probs."""
    device = next(models[0].parameters()).device
    seq = list(prompt)
    keys: list[list[torch.Tensor]] = [[] for _ in models[0].blocks]  # per layer: [H, dh] per position
    values: list[list[torch.Tensor]] = [[] for _ in models[0].blocks]
    out, lps = [], []
    t = 0
    while True:
        m = models[weights_at(t)]
        H = m.blocks[0].h
        x = m.tok(torch.tensor(seq[t], device=device)) + m.pos(torch.tensor(t, device=device))  # [D]
        for layer, blk in enumerate(m.blocks):
            D = x.shape[0]
            q, k, v = blk.qkv(blk.ln1(x)).view(3, H, D // H).unbind(0)
            keys[layer].append(k)
            values[layer].append(v)
            K, V = torch.stack(keys[layer], 1), torch.stack(values[layer], 1)  # [H, t+1, dh]
            w = torch.softmax((K @ q[:, :, None]).squeeze(2) / (D // H) ** 0.5, dim=-1)  # [H, t+1]
            a = (w[:, None, :] @ V).squeeze(1)  # [H, dh]
            x = x + blk.proj(a.reshape(D))
            x = x + blk.mlp(blk.ln2(x))
        if t >= len(prompt) - 1:  # this position's output is completion token j
            j = t - (len(prompt) - 1)
            logits = m.head(m.ln(x))[None]
            if forced is None:
                tok, lp = sample_token(logits, uniforms[j : j + 1].to(device), temperature)
                tok, lp = int(tok), float(lp)
            else:
                tok = forced[j]
                lp = float(F.log_softmax(logits.double() / temperature, -1)[0, tok])
            out.append(tok)
            lps.append(lp)
            if tok == EOS or len(out) == max_new or (forced is not None and len(out) == len(forced)):
                return out, lps
            seq.append(tok)
        t += 1
