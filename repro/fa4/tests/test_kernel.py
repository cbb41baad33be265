"""The Triton kernels against the reference: forward, gradients, switches, errors.

On a machine without a GPU these run under TRITON_INTERPRET=1 (set by the pytest plugin) through
``attention_any_d``, the internal entry point that also takes D in {16, 32} and float32 so that
the interpreter stays fast; the public ``attention`` keeps D in {64, 128} and bf16/fp16. The tests
marked ``gpu`` run the public API at real sizes and are skipped without a GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.fa4 import attention, attention_any_d, forward_with_counts
from repro.fa4.reference import attention_exact, lazy_rescale_attention

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_GPU = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (INTERPRET or HAS_GPU), reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_GPU else "cpu"

switch_sets = st.fixed_dictionaries(
    {
        "lazy_rescale": st.booleans(),
        "soft_exp": st.sampled_from([0, 1, 2, 4]),
        "pingpong": st.booleans(),
        "persistent": st.booleans(),
        "tma": st.booleans(),
        # On the GPU, Triton 3.6's warp specialisation may refuse to compile on Hopper; that case
        # has its own test below. In the interpreter the flag is accepted and must be harmless.
        "warp_specialize": st.just(False) if HAS_GPU else st.booleans(),
    }
)


def _inputs(seed, b, s_q, s_k, h, h_kv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()
    return mk(b, s_q, h, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d)


def _check_against_reference(q, k, v, causal, out_tol, grad_tol, **switches):
    out = attention_any_d(q, k, v, causal=causal, **switches)
    ref = attention_exact(q, k, v, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    g = torch.Generator().manual_seed(out.numel())  # a fixed dO per shape: reruns see the same case
    do = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.to(torch.float64))
    assert_rel_close(out, ref, out_tol, "output")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_rel_close(g, r, grad_tol, f"d{name}")


@needs_triton
@pytest.mark.claim(
    "fa4/kernel-equals-reference",
    section="Abstract, contributions (1) and (2): the forward algorithm and its backward (arXiv v1)",
)
@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 2),
    s_q=st.integers(1, 64),
    extra=st.integers(0, 20),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]),
    d=st.sampled_from([16, 32]),
    causal=st.booleans(),
    switches=switch_sets,
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference(b, s_q, extra, heads, d, causal, switches, seed):
    h, h_kv = heads
    s_k = s_q + extra if causal else max(1, s_q + extra - 10)
    q, k, v = _inputs(seed, b, s_q, s_k, h, h_kv, d, torch.float32)
    # fp32 through the interpreter is exact-ish (~1e-7); the degree-3 exp2 adds its 8.6e-5
    # relative error per term, ~3e-5 on outputs and gradients (the backward's P uses hardware exp2).
    tol = 2e-4 if switches["soft_exp"] else 2e-5
    if HAS_GPU:
        tol = max(tol, 1e-2)  # fp32 dots run as tf32 (10-bit mantissa) on the GPU
    _check_against_reference(q, k, v, causal, tol, tol, **switches)


@needs_triton
@pytest.mark.claim(
    "fa4/kernel-equals-reference",
    section="Abstract, contributions (1) and (2): the forward algorithm and its backward (arXiv v1)",
)
@settings(max_examples=2, deadline=None)
@given(causal=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_half_precision(causal, seed):
    """Half-precision inputs: P is rounded to the input type before P V, like every FA kernel.
    bf16 on the GPU; fp16 in the interpreter (Triton 3.6's CPU interpreter gets bf16 dots wrong)."""
    dtype = torch.bfloat16 if HAS_GPU else torch.float16
    q, k, v = _inputs(seed, 1, 24, 24, 2, 1, 16, dtype)
    # bf16 keeps 8 bits: ~4e-3 per rounding, a few roundings: 2e-2 (fp16 is 8x finer).
    _check_against_reference(q, k, v, causal, 2e-2, 3e-2, soft_exp=2)


@needs_triton
@pytest.mark.claim(
    "fa4/kernel-rescale-count", section="Abstract, contribution (2): conditional softmax rescaling (arXiv v1)"
)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), sigma=st.floats(4.0, 10.0), s=st.sampled_from([48, 64]))
def test_kernel_rescale_count_matches_emulation(seed, sigma, s):
    g = torch.Generator().manual_seed(seed)
    d = 16
    q, k, v = (torch.randn(1, s, 2, d, generator=g) for _ in range(3))
    scale = sigma / (math.log2(math.e) * math.sqrt(d))
    out, frac = forward_with_counts(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), scale=scale, block_m=16, block_n=16
    )
    emu, stats = lazy_rescale_attention(q, k, v, scale=scale, block_m=16, block_n=16)
    # Exact fp32 in the interpreter; on the GPU fp32 dots are tf32, which can move a logit across
    # the threshold now and then, so there the count may differ by a step or two.
    assert_rel_close(out.cpu(), emu, 1e-2 if HAS_GPU else 1e-4, "output")
    assert frac == pytest.approx(stats.fraction, abs=0.05 if HAS_GPU else 1e-9), (frac, stats.fraction)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2)), "v must be"),
        (
            lambda: (torch.randn(1, 8, 2, 264), torch.randn(1, 8, 2, 264), torch.randn(1, 8, 2, 264)),
            "head dim D = 264",
        ),
        (
            lambda: (torch.randn(1, 8, 3, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)),
            "H_kv = 2 must divide",
        ),
        (lambda: (torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32)), "k must be"),
        (lambda: (torch.randn(2, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)), "k must be"),
        (
            lambda: (torch.randn(1, 8, 2, 64), torch.randn(1, 9, 2, 64), torch.randn(1, 8, 2, 64)),
            r"v must be \[B, S_k, H_kv, D_v\]",
        ),
    ],
)
def test_bad_shapes_raise(make, match):
    q, k, v = (t.to(torch.bfloat16) for t in make())
    with pytest.raises(ValueError, match=match):
        attention(q, k, v)


def test_bad_dtypes_and_options_raise():
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(TypeError, match="dtype torch.float32"):
        attention(q, q, q)  # float32 is for the interpreter's internal entry point only
    qb = q.to(torch.bfloat16)
    with pytest.raises(TypeError, match="share a dtype"):
        attention(qb, qb, q.to(torch.float16))
    if INTERPRET or HAS_GPU:
        qd = q.to(DEVICE)
        with pytest.raises(ValueError, match="bwd must be one of"):
            attention_any_d(qd, qd, qd, bwd="fa3")
        with pytest.raises(ValueError, match="bwd_tma applies to bwd='fused' only"):
            attention_any_d(qd, qd, qd, bwd_tma=True)
        with pytest.raises(ValueError, match="soft_exp"):
            attention_any_d(qd, qd, qd, soft_exp=3)
        with pytest.raises(TypeError, match="unknown switches"):
            attention_any_d(qd, qd, qd, lazy=True)


# --------------------------------------------------------------------------------------------
# Real GPU: public API, real head dims, every switch, bf16 and fp16.
# --------------------------------------------------------------------------------------------

GPU_SWITCHES = [
    {},
    {"lazy_rescale": False},
    {"soft_exp": 1},
    {"soft_exp": 2},
    {"soft_exp": 4},
    {"pingpong": True},
    {"persistent": True},
    {"tma": True},
    {"tma": True, "soft_exp": 1, "persistent": True},
    {"num_stages": 2},
]


GPU_CASES = [(sw, 128, causal) for sw in GPU_SWITCHES for causal in (False, True)]
GPU_CASES += [({}, 64, False), ({}, 64, True), ({"soft_exp": 2, "pingpong": True}, 64, True)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "switches, d, causal",
    GPU_CASES,
    ids=[",".join(f"{k}={v}" for k, v in sw.items()) + f"-d{d}-causal{c}" for sw, d, c in GPU_CASES],
)
def test_gpu_public_api(switches, d, causal):
    for seed, (b, s, h, h_kv) in enumerate([(2, 1000, 4, 2), (1, 2048, 8, 8)]):
        q, k, v = _inputs(seed, b, s, s, h, h_kv, d, torch.bfloat16)
        out = attention(q, k, v, causal=causal, **switches)
        ref = attention_exact(q, k, v, causal=causal)
        assert_rel_close(out, ref, 1.5e-2, "output")
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
        for name, g_, r in zip("qkv", grads, ref_grads, strict=True):
            assert_rel_close(g_, r, 3e-2, f"d{name}")


@pytest.mark.gpu
def test_gpu_warp_specialize_compiles_or_says_why():
    """Triton 3.6's automatic warp specialisation is experimental on Hopper: either it compiles and is
    right, or it raises a compiler error (which bench.py records); it must never be silently wrong."""
    q, k, v = _inputs(0, 1, 1024, 1024, 4, 4, 128, torch.bfloat16)
    try:
        out = attention(q, k, v, warp_specialize=True)
    except Exception as exc:  # noqa: BLE001 - we only want to know that it failed loudly
        pytest.skip(f"warp_specialize does not compile here: {type(exc).__name__}: {str(exc)[:200]}")
    assert_rel_close(out, attention_exact(q, k, v), 1.5e-2, "output")
