"""chunk_kda takes any log-decay ``g <= 0``: below ``gate.G_MIN = -10`` it clamps (gate.py derives
the bound). These tests hold the kernels to that bound against the *unclamped* recurrence in fp64:

    ||o'_t - o_t||_2 <= scale ||q_t||_2 e^{-10} sum_{s <= t} ||P_s S_{s-1}||_F      (and the state)

with ``S`` the exact state and ``P_s`` the channels clamped at token s. The inputs put a few
"reset" tokens (every channel of a head far below -10: -10.5 up to -1000) among mild decays, so
that at a reset the clamp's effect is a fair part of the bound (about a quarter: ``||E^T q||`` against
``||E||_F ||q||`` for a random q in 16 dimensions) and far above fp32's own rounding (about 1e-7 of o).
Both sides are checked: a clamp at -8 would be several times over the bound, one at -12 (or none
needed) under its floor, no clamp inf.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import rel_error
from paperclub.triton_compat import interpreting
from repro.kda import KDAConfig, chunk_kda, recurrent_kda
from repro.kda.gate import G_MIN

B, T, H, K, V = 1, 70, 2, 16, 16  # one full chunk and a padded tail
SCALE = K**-0.5
# fp32 kernels against fp64: ||o_t - o_ref_t|| measured up to 1.5e-7 of max_t ||o_ref_t|| away from
# the resets on these inputs; the margin for it
FP32_SLACK = 1e-6


def _inputs(seed: int, resets: list[int], depth: float):
    """fp64 inputs: k L2-normalised, beta in [0, 1], mild decays in [-0.5, 0]; at the tokens
    ``resets`` every channel of head 0 decays by ``depth`` (< -10), and one channel of head 1."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    q = torch.randn(B, T, H, K, generator=gen, dtype=f64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=f64)
    g = -0.5 * torch.rand(B, T, H, K, generator=gen, dtype=f64)
    for t in resets:
        g[0, t, 0, :] = depth
        g[0, t, 1, t % K] = depth
    beta = torch.rand(B, T, H, generator=gen, dtype=f64)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=f64)
    return q, k, v, g, beta, h0


def _bound(q, k, v, g, beta, h0):
    """Per token and head: the bound on ||o'_t - o_t||_2 and on ||S'_t - S_t||_F (fp64, from the
    exact recurrence's states)."""
    c = math.exp(G_MIN)
    S = h0[0].clone()  # [H, K, V]
    acc = torch.zeros(H, dtype=torch.float64)
    o_bound = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        clamped = (g[0, t] < G_MIN).to(torch.float64)  # [H, K]: P_t
        acc += c * (clamped[:, :, None] * S).flatten(1).norm(dim=1)
        o_bound[t] = SCALE * q[0, t].norm(dim=-1) * acc
        kt, bt = k[0, t], beta[0, t]
        S = torch.exp(g[0, t])[:, :, None] * S
        err = v[0, t] - torch.einsum("hk,hkv->hv", kt, S)
        S = S + bt[:, None, None] * kt[:, :, None] * err[:, None, :]
    return o_bound, acc


def check_bound(seed: int, resets: list[int], depth: float, device: str) -> None:
    """Outputs and final state of chunk_kda (fp32, on ``device``) against the unclamped fp64
    recurrence: within the bound at every token, and at the first reset at least 5% of the part of
    it the clamp moved (``1 - e^{depth + 10}`` of ``e^-10``)."""
    q, k, v, g, beta, h0 = _inputs(seed, sorted(resets), depth)
    o_ref, h_ref = recurrent_kda(q, k, v, g, beta, SCALE, h0, True)
    o, hT = chunk_kda(*(x.float().to(device) for x in (q, k, v, g, beta)), SCALE, h0.float().to(device), True)
    o, hT = o.cpu(), hT.cpu()
    o_bound, s_bound = _bound(q, k, v, g, beta, h0)
    err = (o.double() - o_ref)[0].norm(dim=-1)  # [T, H]
    slack = FP32_SLACK * o_ref[0].norm(dim=-1).max()
    assert torch.all(err <= o_bound * (1 + 1e-6) + slack), (err - o_bound).max()
    assert torch.all((hT.double() - h_ref)[0].flatten(1).norm(dim=1) <= s_bound * (1 + 1e-6) + slack)
    first = min(resets)  # head 0 loses its whole memory there: the clamp keeps e^-10 of it
    moved = 1 - math.exp(depth - G_MIN)
    assert err[first, 0] >= 0.05 * moved * o_bound[first, 0], (err[first, 0], o_bound[first, 0])


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter test (test_clamp_bound_on_gpu on a GPU)")
@settings(max_examples=3, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    resets=st.lists(st.integers(1, T - 2), min_size=1, max_size=3, unique=True),
    depth=st.sampled_from([-10.5, -15.0, -40.0, -1000.0]),
)
def test_clamped_decay_stays_within_its_bound(seed, resets, depth):
    check_bound(seed, resets, depth, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seed, resets, depth",
    [(0, [5, 40], -10.5), (1, [1, 30, 68], -1000.0), (2, [63, 64], -15.0), (3, [20], -40.0)],
)
def test_clamp_bound_on_gpu(seed, resets, depth):
    """The same bound with the GPU's kernels (ftz exponentials, tensor-core products at ieee)."""
    check_bound(seed, resets, depth, "cuda")


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")
def test_clamp_is_the_host_clamp_and_gradients_stay_close():
    """The on-demand clamp gives what chunk_kda on ``g.clamp(min=-10)`` gives, bit for bit, and so
    does ``clamp_decay_first``; the gradients agree with the unclamped fp64 recurrence's to 1e-3
    (the clamped entries of g get gradient 0, the exact one is below e^-10 of dL/dalpha)."""
    q, k, v, g, beta, h0 = _inputs(7, [5, 40], -1000.0)
    x32 = [x.float() for x in (q, k, v, g, beta, h0)]
    o, hT = chunk_kda(*x32[:5], SCALE, x32[5], True)
    o_c, hT_c = chunk_kda(*x32[:3], x32[3].clamp(min=G_MIN), x32[4], SCALE, x32[5], True)
    o_f, hT_f = chunk_kda(*x32[:5], SCALE, x32[5], True, config=KDAConfig(clamp_decay_first=True))
    assert torch.equal(o, o_c) and torch.equal(hT, hT_c) and torch.equal(o, o_f) and torch.equal(hT, hT_f)

    ours = [x.clone().requires_grad_(True) for x in x32]
    ref = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for side, fn in ((ours, chunk_kda), (ref, recurrent_kda)):
        o, hT = fn(*side[:5], SCALE, side[5], True)
        torch.autograd.backward([o, hT], [do.to(o.dtype), torch.ones_like(hT)])
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ours, ref, strict=True):
        assert rel_error(a.grad, b.grad) < 1e-3, (name, rel_error(a.grad, b.grad))
    assert torch.all(ours[3].grad[g < G_MIN] == 0)
