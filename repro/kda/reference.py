"""Kimi Delta Attention as the paper writes it: one token at a time, in fp32 or fp64.

This file is the ground truth for everything else in ``repro/kda``. It follows the KDA
recurrence of kimiteam2025kimilinear §3 ("Kimi Delta Attention"):

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T      (KDA update)
    o_t = S_t^T q_t                                                            (readout)

with the state ``S_t`` of shape ``[K, V]`` (keys index rows), a per-channel forget gate
``alpha_t = exp(g_t)`` in ``(0, 1]^K`` (``g`` is the log-decay, what the kernels take) and a
scalar learning rate ``beta_t`` in ``[0, 1]``. We multiply the readout by ``scale`` (default
``K ** -0.5``), as flash-linear-attention does.

Two independent, smaller references live here too, for the paper's reductions (§2 and §3:
KDA generalises Gated DeltaNet, which generalises DeltaNet):

* :func:`delta_rule_reference`: DeltaNet, ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``,
  written in its "error-correcting" form rather than as a product of transitions;
* :func:`gated_delta_rule_reference`: Gated DeltaNet, one scalar decay per head and token;
* :func:`dplr_reference`: the general diagonal-plus-low-rank recurrence (two free vectors per
  token), with :func:`kda_as_dplr`, KDA written in its terms (the abstract's "specialized variant
  of the DPLR transition matrices": both vectors tied to the key).

Shapes follow flash-linear-attention: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` with ``HV`` a
multiple of ``H`` (value head ``j`` reads key head ``j // (HV // H)``), ``g [B, T, HV, K]``,
``beta [B, T, HV]``, state ``[B, HV, K, V]``.
"""

from __future__ import annotations

import torch

from repro.kda.validate import check_kda_inputs


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # fp64 stays fp64 (tests use it as the exact reference); everything else runs in fp32.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def kda_step(
    S: torch.Tensor,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    beta_t: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA token step for all batch entries and value heads at once.

    S ``[B, HV, K, V]``; q_t, k_t ``[B, HV, K]`` (already expanded to value heads);
    v_t ``[B, HV, V]``; g_t ``[B, HV, K]``; beta_t ``[B, HV]``. Returns (o_t ``[B, HV, V]``, S_t).
    """
    alpha = torch.exp(g_t)  # §3: alpha_t = exp(g_t), the per-channel forget gate
    S = alpha.unsqueeze(-1) * S  # Diag(alpha_t) S_{t-1}: channel c of the key space forgets at its own rate
    # (I - beta k k^T) X = X - beta k (k^T X): apply the Householder-like factor without forming it
    kS = torch.einsum("bhk,bhkv->bhv", k_t, S)
    S = S - beta_t[..., None, None] * k_t.unsqueeze(-1) * kS.unsqueeze(-2)
    S = S + beta_t[..., None, None] * k_t.unsqueeze(-1) * v_t.unsqueeze(-2)  # + beta_t k_t v_t^T
    o = torch.einsum("bhk,bhkv->bhv", q_t, S) * scale  # o_t = S_t^T q_t
    return o, S


def kda_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KDA recurrence of §3, token by token.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (log-decay, <= 0);
    beta ``[B, T, HV]``; initial_state ``[B, HV, K, V]`` or None (zeros).
    Returns o ``[B, T, HV, V]`` in v's dtype and the final state ``[B, HV, K, V]`` (fp32 or
    fp64) when ``output_final_state``, else None. Differentiable through autograd.
    """
    dims = check_kda_inputs(q, k, v, g, beta, initial_state, "kda_recurrence", triton=False)
    B, T, H, K, HV, V = dims.B, dims.T, dims.H, dims.K, dims.HV, dims.V
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, beta)
    group = HV // H
    # value head j reads key head j // group
    qe = q.to(dt).repeat_interleave(group, dim=2)
    ke = k.to(dt).repeat_interleave(group, dim=2)
    S = torch.zeros(B, HV, K, V, dtype=dt, device=q.device)
    if initial_state is not None:
        S = S + initial_state.to(dt)
    outs = []
    for t in range(T):
        o_t, S = kda_step(S, qe[:, t], ke[:, t], v[:, t].to(dt), g[:, t].to(dt), beta[:, t].to(dt), scale)
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V, dtype=dt)
    return o.to(v.dtype), (S if output_final_state else None)


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeltaNet, one head, written independently of KDA (no gate, no Householder product).

    q, k ``[T, K]``; v ``[T, V]``; beta ``[T]``; initial_state ``[K, V]``. The delta rule
    predicts ``v_t`` from ``k_t`` with the current memory and writes back a beta-weighted
    fraction of the error: ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``.
    Returns (o ``[T, V]``, S_T ``[K, V]``).
    """
    S = torch.zeros(k.shape[1], v.shape[1], dtype=v.dtype) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(k.shape[0]):
        prediction = k[t] @ S
        error = v[t] - prediction
        S = S + beta[t] * torch.outer(k[t], error)
        outs.append(scale * (q[t] @ S))
    return torch.stack(outs), S


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet, one head: a single scalar decay ``a_t = exp(log_a_t)`` per token.

    q, k ``[T, K]``; v ``[T, V]``; log_a, beta ``[T]``; initial_state ``[K, V]``.
    ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T``: decay the whole memory,
    then apply the delta-rule correction. Returns (o ``[T, V]``, S_T ``[K, V]``).
    """
    S = torch.zeros(k.shape[1], v.shape[1], dtype=v.dtype) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(k.shape[0]):
        S = torch.exp(log_a[t]) * S
        error = v[t] - k[t] @ S
        S = S + beta[t] * torch.outer(k[t], error)
        outs.append(scale * (q[t] @ S))
    return torch.stack(outs), S


def dplr_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general DPLR recurrence, one head, in flash-linear-attention's convention (its
    ``chunk_dplr_delta_rule``): ``S_t = (Diag(exp(gk_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T``,
    ``o_t = scale S_t^T q_t``; the two low-rank vectors a, b are free.

    q, k, a, b, gk ``[T, K]``; v ``[T, V]``; initial_state ``[K, V]``. Returns (o ``[T, V]``, S_T)."""
    S = torch.zeros(k.shape[1], v.shape[1], dtype=v.dtype) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(k.shape[0]):
        S = torch.exp(gk[t])[:, None] * S + torch.outer(b[t], a[t] @ S) + torch.outer(k[t], v[t])
        outs.append(scale * (q[t] @ S))
    return torch.stack(outs), S


def kda_as_dplr(q, k, v, g, beta):
    """KDA's step in DPLR terms: ``(I - beta k k^T) Diag(alpha) = Diag(alpha) - (beta k)(alpha k)^T``,
    so ``a = exp(g) k``, ``b = -beta k``, the written key ``beta k``, ``gk = g``; q and v as they
    are. Any layout whose last dimension is the key's (beta one dimension less); returns (q, k', v,
    a, b, gk) with k', a, b in k's dtype, products formed in at least fp32."""
    kf = k.to(torch.promote_types(k.dtype, torch.float32))
    bk = beta[..., None] * kf
    return q, bk.to(k.dtype), v, (torch.exp(g) * kf).to(k.dtype), (-bk).to(k.dtype), g
