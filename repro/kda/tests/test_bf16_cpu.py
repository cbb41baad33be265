"""bf16 through the public entry points on a CPU (Triton's interpreter), against fp64.

Triton 3.6's interpreter computed bf16 dots on raw bit patterns (``chunk_kda`` on bf16 gave a
relative error of 5e12); ``paperclub.triton_compat.patch_interpreter``, installed by
``repro.kda``, computes them on the values. These tests keep that so. Inputs are rounded to bf16
first and the fp64 recurrence runs on the same rounded values, so only the kernels' own error is
measured. Tolerance 2e-2, the bf16 budget of the GPU bf16 test (8 mantissa bits; measured ~3e-3
here at T = 70, K = V = 32).
"""

from __future__ import annotations

import pytest
import torch

from paperclub.testing import assert_rel_close
from paperclub.triton_compat import interpreting
from repro.kda import chunk_kda, decode_step, recurrent_kda
from repro.kda.tests.strategies import make_case

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")

TOL = 2e-2
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def _bf16_case(seed: int, T: int, group: int):
    """The case's q, k, v, g, beta rounded to bf16; the initial state (fp32 in the API) in fp64."""
    case = make_case(seed=seed, B=1, T=T, H=2, group=group, K=32, V=32, g_max=2.0, with_h0=True)
    x64 = case.tensors(torch.float64)
    return [x.to(torch.bfloat16) for x in x64[:5]], x64[5]


@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
def test_chunk_kda_bf16_forward_and_gradients(group):
    """chunk_kda on bf16 q, k, v, g, beta (T = 70: one full chunk and a padded tail; value heads
    sharing key heads or not): outputs, final state and all six gradients within 2e-2 of the fp64
    recurrence. (The backward's 16-bit dots, a second case here, left the kernels in issue #40.)"""
    bf, h0 = _bf16_case(seed=11 + group, T=70, group=group)
    ref = [x.double().requires_grad_(True) for x in bf] + [h0.clone().requires_grad_(True)]
    low = [x.clone().requires_grad_(True) for x in bf] + [h0.float().requires_grad_(True)]
    o_ref, s_ref = recurrent_kda(*ref[:5], initial_state=ref[5], output_final_state=True)
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward([o_ref, s_ref], [do, ds])

    o, s = chunk_kda(*low[:5], initial_state=low[5], output_final_state=True)
    torch.autograd.backward([o, s], [do.to(o.dtype), ds.float()])
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_rel_close(o, o_ref, TOL, "o (bf16)")
    assert_rel_close(s, s_ref, TOL, "final state (bf16)")
    for name, a, b in zip(NAMES, ref, low, strict=True):
        assert b.grad is not None, f"no gradient reached {name}"
        assert b.grad.dtype == b.dtype, f"d{name} has dtype {b.grad.dtype}, expected {b.dtype}"
        assert_rel_close(b.grad, a.grad, TOL, f"d{name} (bf16)")


def test_decode_step_bf16():
    """decode_step on bf16 tokens after a bf16 prefill: the outputs and the carried fp32 state follow
    the fp64 recurrence on the same bf16 values."""
    bf, h0 = _bf16_case(seed=3, T=20, group=2)
    o_ref, s_ref = recurrent_kda(*(x.double() for x in bf), initial_state=h0, output_final_state=True)
    T1 = 16
    o_pre, state = chunk_kda(*(x[:, :T1] for x in bf), initial_state=h0.float(), output_final_state=True)
    outs = [o_pre]
    for t in range(T1, bf[0].shape[1]):
        outs.append(decode_step(*(x[:, t : t + 1] for x in bf), state))
    o = torch.cat(outs, dim=1)
    assert o.dtype == torch.bfloat16
    assert_rel_close(o, o_ref, TOL, "prefill + decode outputs (bf16)")
    assert_rel_close(state, s_ref, TOL, "state after decoding (bf16)")
