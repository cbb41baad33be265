"""The fused one-pass backward (``bwd="fused"``, ``repro.fa4.triton_bwd_fused``) against the fp64 reference.

Under TRITON_INTERPRET=1 (the pytest plugin sets it without a GPU) through ``attention_any_d`` with
D in {16, 32} and the interpreter's 16 x 16 tiles, so that every path of the kernel runs on a few
tiles: the causal band and the skipped tiles before it, ragged query and key tails, several key
blocks adding into one dQ row (the atomics), GQA groups summed in registers, TMA loads of Q and dO,
and causal S_q > S_k (rows that see no key: zero output and gradient). The GPU matrix at the public
head dims is ``test_gpu_bwd.py``.

Tolerances: fp32 through the interpreter is exact to rounding (measured ~3e-7 against fp64): 2e-5
leaves room for longer sums. bf16 rounds P, dS and the outputs to 8 bits (~2e-3 measured): 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from paperclub.triton_compat import interpreting
from repro.fa4 import attention_any_d
from repro.fa4.reference import attention_exact

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")

CLAIM = "fa4/fused-backward-exact"
SECTION = "Abstract, contribution (3): the backward pass (arXiv v1)"


def _check(b, s_q, s_k, h, h_kv, d, causal, dtype, seed, tol, **switches):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(b, s, n, d, generator=g).to(dtype) for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv))
    )
    do = torch.randn(b, s_q, h, d, generator=g).to(dtype)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_exact(*ref_leaves, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_any_d(*leaves, causal=causal, bwd="fused", **switches)
    grads = torch.autograd.grad(out, leaves, do)
    assert_rel_close(out, ref, tol, "output")
    for name, a, r in zip("qkv", grads, ref_grads, strict=True):
        assert a.dtype == dtype and a.shape == r.shape
        assert_rel_close(a, r, tol, f"d{name}")
    return grads


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 2),
    s_q=st.integers(1, 50),
    s_k=st.integers(1, 50),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]),
    d=st.sampled_from([16, 32]),
    causal=st.booleans(),
    tma=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_backward_matches_reference(b, s_q, s_k, heads, d, causal, tma, seed):
    """fp32, drawn shapes: lengths on and off the 16-row tile, S_q above, equal to and below S_k."""
    h, h_kv = heads
    _check(b, s_q, s_k, h, h_kv, d, causal, torch.float32, seed, 2e-5, bwd_tma=tma)


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize(
    "s_q, s_k, causal",
    [(40, 40, True), (33, 57, True), (57, 33, True), (40, 23, False)],
    ids=["square-causal", "sq<sk-causal", "sq>sk-causal", "ragged-full"],
)
def test_fused_backward_gqa_fixed_cases(s_q, s_k, causal):
    """The cases the drawn ones may miss, with GQA (4 query heads on 2 KV heads) at D = 32."""
    _check(1, s_q, s_k, 4, 2, 32, causal, torch.float32, s_q + s_k, 2e-5)


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_backward_bf16(causal):
    """bf16 (the interpreter's bf16 dots are mended by patch_interpreter), GQA, ragged lengths."""
    _check(1, 37, 45, 4, 2, 16, causal, torch.bfloat16, 7, 1e-2)


def test_fused_backward_equals_fa2_backward():
    """The two backwards agree with each other to fp32 rounding (same forward, same dO)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 41, n, 16, generator=g) for n in (2, 1, 1))
    do = torch.randn(1, 41, 2, 16, generator=g)
    grads = {}
    for bwd in ("fa2", "fused"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads[bwd] = torch.autograd.grad(attention_any_d(*leaves, causal=True, bwd=bwd), leaves, do)
    for name, a, r in zip("qkv", grads["fused"], grads["fa2"], strict=True):
        assert_rel_close(a, r, 2e-6, f"d{name} fused vs fa2")


def test_causal_rows_without_keys_are_zero():
    """Causal, S_q = 40 > S_k = 20: the first 20 query rows see no key: output and dq exactly zero."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 40, 2, 16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 20, 2, 16, generator=g).requires_grad_() for _ in range(2))
    for bwd in ("fa2", "fused"):
        out = attention_any_d(q, k, v, causal=True, bwd=bwd)
        (dq,) = torch.autograd.grad(out.square().sum(), (q,))
        assert torch.equal(out[:, :20], torch.zeros_like(out[:, :20]))
        assert torch.equal(dq[:, :20], torch.zeros_like(dq[:, :20]))
        assert out[:, 20:].abs().sum() > 0 and dq[:, 20:].abs().sum() > 0


def test_dq_tma_refused_in_the_interpreter_and_unknown_config():
    from repro.fa4.triton_bwd_fused import config_switches

    q = torch.randn(1, 16, 1, 16, requires_grad=True)
    out = attention_any_d(q, q, q, bwd="fused", bwd_dq_tma=True)
    with pytest.raises(ValueError, match="dq_tma"):
        out.sum().backward()
    with pytest.raises(ValueError, match="unknown configuration"):
        config_switches("m999")
    assert config_switches("m64-n128-w8-s2-tma")["bwd_block_n"] == 128
