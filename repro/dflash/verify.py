"""The acceptance rule of speculative decoding, batched on the device (leviathan2022fast Algorithm 1).

Every drafter (DFlash, the EAGLE-3-style drafter, the autoregressive one, a function) goes through
this one rule, in the eager loop of ``speculative.py`` and in the capturable verify step of
``static.py``; ``reference.accept_reference`` is the same rule written token by token.
"""

from __future__ import annotations

import torch

from repro.dflash.reference import probabilities, sample_inverse_cdf


def accept_tokens(
    draft: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
    u: torch.Tensor | None = None,
    u_final: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for a batch of verifications, on the device, without host syncs.

    draft ``[N, gamma]``; target_logits ``[N, gamma + 1, V]`` (row i scores draft[:, i]);
    draft_probs ``[N, gamma, V]`` (temperature > 0); u ``[N, gamma]`` and u_final ``[N]`` uniforms.
    Returns a ``[N]`` (accepted count) and the emitted target token ``[N]``. Same rule as
    :func:`repro.dflash.reference.accept_reference` (leviathan2022fast Algorithm 1).
    """
    n, gamma = draft.shape
    if temperature == 0:
        best = target_logits.argmax(-1)  # [N, gamma + 1]
        ok = draft == best[:, :gamma]
        a = ok.long().cumprod(-1).sum(-1)  # length of the agreeing prefix
        return a, best.gather(1, a[:, None])[:, 0]
    p = probabilities(target_logits, temperature)
    q = draft_probs.to(p.dtype)
    pd = p[:, :gamma].gather(-1, draft[..., None])[..., 0]
    qd = q.gather(-1, draft[..., None])[..., 0]
    ok = u.to(p.dtype) * qd < pd  # u < p/q, i.e. accept with probability min(1, p/q); qd > 0 as d ~ q
    a = ok.long().cumprod(-1).sum(-1)
    # the emitted token's distribution: the residual at the first rejection, or p_{gamma+1}
    rows = torch.cat([(p[:, :gamma] - q).clamp_min(0), p[:, gamma:]], dim=1)  # [N, gamma + 1, V]
    chosen = rows.gather(1, a[:, None, None].expand(n, 1, rows.shape[-1]))[:, 0]
    return a, sample_inverse_cdf(chosen, u_final)
