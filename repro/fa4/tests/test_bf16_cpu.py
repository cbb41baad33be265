"""bf16 through the public ``attention`` on a CPU (Triton's interpreter), against fp64 SDPA.

Triton 3.6's interpreter computed bf16 dots on raw bit patterns (``attention`` on bf16 gave a
relative error of 3e9); ``paperclub.triton_compat.patch_interpreter``, installed by
``repro.fa4.triton_fwd`` and the backwards, computes them on the values. These tests keep that so, at the public head
dim (D = 64) and S = 80 (a padded tail block). The reference runs in fp64 on the same bf16 values,
so only the kernel's error is measured: bf16 rounding of P before P V, of O, and of the gradients
(8 mantissa bits, ~2e-3 measured); tolerance 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paperclub.testing import assert_rel_close
from paperclub.triton_compat import interpreting
from repro.fa4 import attention

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")

TOL = 1e-2


def _sdpa64(q, k, v, causal):
    """fp64 scaled-dot-product attention in the [B, S, H, D] layout, key heads repeated for GQA."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize(
    "switches",
    [{}, {"lazy_rescale": False, "soft_exp": 2, "pingpong": True, "persistent": True, "tma": True}],
    ids=["default", "other-paths"],
)
def test_attention_bf16_forward_and_gradients(causal, heads, switches):
    """attention on bf16 q, k, v (S = 80, D = 64): output and dq, dk, dv within 1e-2 of fp64 SDPA,
    with FA4's default switches and with the other forward paths at once (every-block rescale, the
    polynomial exp2 on half the columns, two query tiles per program, a persistent grid, K/V through
    tensor descriptors)."""
    h, h_kv = heads
    g = torch.Generator().manual_seed(h + 2 * causal)
    q, k, v = (torch.randn(1, 80, n, 64, generator=g).bfloat16() for n in (h, h_kv, h_kv))
    ref = [x.double().requires_grad_(True) for x in (q, k, v)]
    low = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out_ref = _sdpa64(*ref, causal)
    do = torch.randn(out_ref.shape, generator=g, dtype=torch.float64)
    out_ref.backward(do)
    out = attention(*low, causal=causal, **switches)
    out.backward(do.to(out.dtype))
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, out_ref, TOL, "attention output (bf16)")
    for name, a, b in zip("qkv", ref, low, strict=True):
        assert b.grad is not None and b.grad.dtype == torch.bfloat16, f"d{name}: missing or not bf16"
        assert_rel_close(b.grad, a.grad, TOL, f"d{name} (bf16)")
