"""KDA's special cases (§3): no decay is DeltaNet, channel-equal decay is Gated DeltaNet, beta = 0
only decays. Each is checked against an independent reference (reference.py writes the delta rule
and the gated delta rule in their error-correcting form, not as KDA with a special gate).

Tolerances: fp64 paths 1e-10 (rounding). The Triton path runs in fp32: 1e-4, because
exp(G) with G a cumulative log-decay of up to several hundred carries G's absolute fp32 rounding
(|G| * 2^-24 per addition) as a relative error.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.kda import chunk_kda, chunk_kda_torch, recurrent_kda
from repro.kda.reference import delta_rule_reference, dplr_reference, gated_delta_rule_reference, kda_as_dplr
from repro.kda.tests.strategies import kda_cases

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _per_head(case, g, beta, fn):
    """Run a single-head reference fn(q, k, v, [log_a,] beta, scale, h0) for every (b, value head)."""
    B, T, H, K = case.q.shape
    HV, V = case.v.shape[2], case.v.shape[3]
    group = HV // H
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    S = torch.zeros(B, HV, K, V, dtype=torch.float64)
    for b in range(B):
        for j in range(HV):
            h0 = None if case.h0 is None else case.h0[b, j]
            o[b, :, j], S[b, j] = fn(b, j, j // group, h0)
    return o, S


def _all_impls(case, g, beta):
    """(name, o, S) for the recurrence, the fp64 chunk form and the fp32 Triton kernels."""
    q, k, v, h0 = case.q, case.k, case.v, case.h0
    out = [("recurrent", *recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True))]
    out.append(
        (
            "chunk_torch",
            *chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16),
        )
    )
    args = [None if x is None else x.to(DEVICE, torch.float32) for x in (q, k, v, g, beta, h0)]
    o, s = chunk_kda(*args[:5], initial_state=args[5], output_final_state=True)
    out.append(("chunk_triton", o.cpu().double(), s.cpu().double()))
    return out


def _tol(name):
    return 1e-4 if name == "chunk_triton" else 1e-10


@pytest.mark.claim("kda/reduces-to-delta-rule", section="§3 (arXiv v2)")
@settings(max_examples=6, deadline=None)
@given(case=kda_cases(max_T=64))
def test_zero_decay_is_delta_rule(case):
    g = torch.zeros_like(case.g)
    scale = case.q.shape[-1] ** -0.5
    o_ref, s_ref = _per_head(
        case, g, case.beta,
        lambda b, j, h, h0: delta_rule_reference(case.q[b, :, h], case.k[b, :, h], case.v[b, :, j], case.beta[b, :, j], scale, h0),
    )  # fmt: skip
    for name, o, s in _all_impls(case, g, case.beta):
        assert_rel_close(o, o_ref, _tol(name), f"{name} o")
        assert_rel_close(s, s_ref, _tol(name), f"{name} state")


@pytest.mark.claim("kda/reduces-to-gated-delta-rule", section="Abstract; §3 (arXiv v2)")
@settings(max_examples=6, deadline=None)
@given(case=kda_cases(max_T=64), strength=st.sampled_from([0.1, 1.0, 5.0]))
def test_channel_equal_decay_is_gated_delta_rule(case, strength):
    B, T, HV, K = case.g.shape
    gen = torch.Generator().manual_seed(T * 31 + K)
    log_a = -strength * torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    g = log_a.unsqueeze(-1).expand(B, T, HV, K).contiguous()  # one decay shared by all channels
    scale = K**-0.5
    o_ref, s_ref = _per_head(
        case, g, case.beta,
        lambda b, j, h, h0: gated_delta_rule_reference(
            case.q[b, :, h], case.k[b, :, h], case.v[b, :, j], log_a[b, :, j], case.beta[b, :, j], scale, h0
        ),
    )  # fmt: skip
    for name, o, s in _all_impls(case, g, case.beta):
        assert_rel_close(o, o_ref, _tol(name), f"{name} o")
        assert_rel_close(s, s_ref, _tol(name), f"{name} state")


@pytest.mark.claim("kda/beta-zero-decays-only", section="§3 (arXiv v2)")
@settings(max_examples=6, deadline=None)
# decay kept mild enough that exp(G_T) stays a normal fp32 number: here the state is nothing but
# exp(G_T) * S_0, and a relative error on a value fp32 flushes to zero would say nothing
@given(case=kda_cases(max_T=64, g_choices=(0.01, 0.5, 1.0)))
def test_beta_zero_only_decays(case):
    B, T, H, K = case.q.shape
    HV = case.v.shape[2]
    h0 = case.h0 if case.h0 is not None else torch.randn(B, HV, K, case.v.shape[3], dtype=torch.float64)
    case.h0 = h0
    beta = torch.zeros_like(case.beta)
    G = case.g.cumsum(dim=1)  # [B, T, HV, K]: total decay up to each token
    s_expected = torch.exp(G[:, -1]).unsqueeze(-1) * h0
    q_v = case.q.repeat_interleave(HV // H, dim=2)
    # o_t = scale * S_t^T q_t with S_t = Diag(exp(G_t)) S_0
    o_expected = torch.einsum("btjk,bjkv->btjv", q_v * torch.exp(G), h0) * K**-0.5
    for name, o, s in _all_impls(case, case.g, beta):
        assert_rel_close(o, o_expected, _tol(name), f"{name} o")
        assert_rel_close(s, s_expected, _tol(name), f"{name} state")


@pytest.mark.claim("kda/dplr-special-case", section="Abstract; §3 (arXiv v2)")
@settings(max_examples=10, deadline=None)
@given(kda_cases(max_T=40))
def test_kda_is_dplr_with_tied_vectors(case):
    """The general DPLR recurrence (reference.dplr_reference, two free vectors) fed KDA's tied ones
    (reference.kda_as_dplr: a = alpha k, b = -beta k, the written key beta k) gives the KDA
    recurrence: outputs and final state to fp64 rounding. The bench's DPLR rows rest on this."""
    o_ref, S_ref = recurrent_kda(
        case.q, case.k, case.v, case.g, case.beta, initial_state=case.h0, output_final_state=True
    )
    K = case.q.shape[-1]
    group = case.v.shape[2] // case.q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (case.q, case.k))
    q, kw, v, a, b, gk = kda_as_dplr(q, k, case.v, case.g, case.beta)

    def head(bi, j, _hk, h0):
        return dplr_reference(q[bi, :, j], kw[bi, :, j], v[bi, :, j], a[bi, :, j], b[bi, :, j], gk[bi, :, j],
                              K**-0.5, h0)  # fmt: skip

    o, S = _per_head(case, case.g, case.beta, head)
    assert_rel_close(o, o_ref, 1e-10)
    assert_rel_close(S, S_ref, 1e-10)
