"""bf16 through the public entry points on the CPU (Triton's interpreter, made right for bf16 by
paperclub.triton_compat.patch_interpreter): dmoe_sparse, dmoe_grouped and the dMoE module against the
fp32 dense reference fed the same bf16-rounded inputs, 2e-2 (bf16 intermediates, 8 mantissa bits)."""

from __future__ import annotations

import pytest
import torch

from paperclub.testing import assert_rel_close
from repro.megablocks import dMoE, dmoe_grouped, dmoe_sparse, moe_dense
from repro.megablocks.tests.strategies import make_case


@pytest.mark.parametrize("impl", ["sparse", "grouped"])
@pytest.mark.parametrize("mlp", ["mlp", "glu"])
def test_functional_bf16_on_cpu(impl, mlp):
    case = make_case(seed=5, T=40, d=32, f=32, E=4, k=2, routing="random")
    ours = [t.detach().requires_grad_(True) for t in case.tensors(torch.bfloat16)]
    ref = [t.detach().float().requires_grad_(True) for t in ours]
    w3o, w3r = (ours[4], ref[4]) if mlp == "glu" else (None, None)
    if impl == "sparse":
        y = dmoe_sparse(ours[0], ours[1], case.indices, ours[2], ours[3], w3o, 4, mlp, 16)
    else:
        y = dmoe_grouped(ours[0], ours[1], case.indices, ours[2], ours[3], w3o, 4, mlp)
    y_ref = moe_dense(ref[0], ref[1], case.indices, ref[2], ref[3], w3r, 4, mlp)
    assert y.dtype == torch.bfloat16
    assert_rel_close(y, y_ref, 2e-2, f"{impl} {mlp} bf16 output")
    g = torch.randn_like(y_ref)
    n = 5 if mlp == "glu" else 4
    for name, a, b in zip(
        ["x", "weights", "w1", "w2", "w3"],
        torch.autograd.grad(y, ours[:n], g.to(torch.bfloat16)),
        torch.autograd.grad(y_ref, ref[:n], g),
        strict=False,
    ):
        assert_rel_close(a, b, 2e-2, f"{impl} {mlp} bf16 d{name}")


def test_module_bf16_on_cpu():
    torch.manual_seed(0)
    layer = dMoE(32, 32, 4, 2, mlp="glu", impl="sparse", block_size=16, dtype=torch.bfloat16)
    x = torch.randn(2, 20, 32, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
