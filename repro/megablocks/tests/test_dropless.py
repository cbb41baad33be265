"""megablocks/dropless: the dMoE (block-sparse and grouped) equals the token-by-token MoE.

Tolerances (relative Frobenius error, paperclub.testing): the kernels run in fp32 (IEEE products,
fp32 accumulation) against the fp64 token loop: 1e-5 for outputs and gradients (sums of at most
a few hundred fp32 products, relative rounding ~1e-7 each). fp16 at 5e-3 (11-bit mantissa;
inputs and stored intermediates rounded to fp16, products accumulated in fp32).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.megablocks import dMoE, dmoe_grouped, dmoe_sparse, moe_dense, moe_reference
from repro.megablocks.tests.strategies import make_case, moe_cases

CLAIM = "megablocks/dropless"
SECTION = "§4 (arXiv v1)"


def _run(impl: str, x, weights, indices, w1, w2, w3, E, mlp, block_size=16):
    w3 = w3 if mlp == "glu" else None
    if impl == "sparse":
        return dmoe_sparse(x, weights, indices, w1, w2, w3, E, mlp, block_size)
    return dmoe_grouped(x, weights, indices, w1, w2, w3, E, mlp)


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
@settings(max_examples=8, deadline=None)
@given(case=moe_cases(), mlp=st.sampled_from(["mlp", "glu"]), block_size=st.sampled_from([16, 32]))
def test_dmoe_equals_token_loop(impl, case, mlp, block_size):
    """Outputs and the gradients of x, router weights, w1, w2 (w3) equal the fp64 token loop."""
    ours = case.tensors(torch.float32, requires_grad=True)
    ref = case.tensors(torch.float64, requires_grad=True)
    y = _run(impl, ours[0], ours[1], case.indices, *ours[2:], case.num_experts, mlp, block_size)
    y_ref = moe_reference(
        ref[0], ref[1], case.indices, *ref[2:4], ref[4] if mlp == "glu" else None, case.num_experts, mlp
    )
    assert_rel_close(y, y_ref, 1e-5, f"{impl} output ({case.routing} routing)")
    g = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    n = 5 if mlp == "glu" else 4
    grads = torch.autograd.grad(y, ours[:n], g.float())
    grads_ref = torch.autograd.grad(y_ref, ref[:n], g)
    for name, a, b in zip(["x", "weights", "w1", "w2", "w3"], grads, grads_ref, strict=False):
        if name == "weights":
            _check_weights_grad(a, b, ref, case, g, mlp)
        else:
            assert_rel_close(a, b, 1e-5, f"{impl} d{name} ({case.routing} routing)")


def _check_weights_grad(got, want, ref, case, g, mlp):
    """d weights[t, j] = <expert_j(x_t), g_t>: one dot product each, which may cancel to near zero,
    so a relative error on few entries is no measure. Bound each entry's error instead by fp32
    rounding of the expert output: |got - want| <= 1e-5 ||expert_j(x_t)|| ||g_t||."""
    T, k = case.indices.shape
    ones = torch.ones(T, 1, dtype=torch.float64)
    w3 = ref[4] if mlp == "glu" else None
    for j in range(k):
        y_j = moe_reference(
            ref[0], ones, case.indices[:, j : j + 1], ref[2], ref[3], w3, case.num_experts, mlp
        )
        bound = 1e-5 * y_j.norm(dim=1) * g.norm(dim=1) + 1e-12
        err = (got[:, j].double() - want[:, j]).abs()
        assert (err <= bound).all(), f"d weights[:, {j}]: error {err.max():.3e} above the fp32 bound"


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
def test_every_token_to_one_expert(impl):
    """The extreme case a capacity factor cannot serve: all T tokens pick expert 2 (of 4) first;
    T = 37 is not a multiple of the block, and two experts get nothing. Nothing is dropped."""
    case = make_case(seed=5, T=37, d=32, f=32, E=4, k=1, routing="one-expert")
    counts = torch.bincount(case.indices.reshape(-1), minlength=4)
    assert counts.max() == 37
    x, w, w1, w2, w3 = case.tensors(torch.float32)
    y = _run(impl, x, w, case.indices, w1, w2, w3, 4, "glu")
    y_ref = moe_reference(
        *case.tensors(torch.float64)[:2], case.indices, *case.tensors(torch.float64)[2:], 4, "glu"
    )
    assert_rel_close(y, y_ref, 1e-5, "output")
    assert (y.norm(dim=1) > 0).all(), "a token came out zero: it was dropped"


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
@settings(max_examples=4, deadline=None)
@given(case=moe_cases(max_T=32), data=st.data())
def test_token_output_independent_of_batch(impl, case, data):
    """A token's output is the same whether it is computed with the whole batch or with any
    sub-batch (the capacity-factor MoE fails this: who gets dropped depends on the others)."""
    T = case.x.shape[0]
    keep = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=T, unique=True), label="sub-batch")
    keep = torch.tensor(sorted(keep))
    x, w, w1, w2, w3 = case.tensors(torch.float32)
    full = _run(impl, x, w, case.indices, w1, w2, w3, case.num_experts, "mlp")
    sub = _run(impl, x[keep], w[keep], case.indices[keep], w1, w2, w3, case.num_experts, "mlp")
    assert_rel_close(sub, full[keep], 1e-6, "sub-batch output")


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
def test_fp16_matches_reference(impl):
    """fp16 through the kernels (fp32 accumulation) against the fp64 loop: 5e-3."""
    case = make_case(seed=11, T=30, d=32, f=32, E=3, k=2, routing="skewed")
    x, w, w1, w2, w3 = case.tensors(torch.float16)
    y = _run(impl, x, w, case.indices, w1, w2, w3, 3, "glu")
    ref = case.tensors(torch.float64)
    assert_rel_close(y, moe_reference(ref[0], ref[1], case.indices, *ref[2:], 3, "glu"), 5e-3, "fp16 output")


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
def test_module_shapes_and_router(impl):
    """dMoE takes [B, S, d] and returns it; with its own router it equals the reference routed by
    the same router (gradients reach the router weights through the combine)."""
    torch.manual_seed(0)
    layer = dMoE(32, 32, 4, 2, mlp="glu", impl=impl, block_size=16)
    x = torch.randn(2, 9, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    from repro.megablocks import route

    flat = x.reshape(-1, 32)
    w, i = route(flat, layer.router, 2)
    y_ref = moe_dense(flat, w, i, layer.w1, layer.w2, layer.w3, 4, "glu").view_as(x)
    assert_rel_close(y, y_ref, 1e-5, "module output")
    g_router = torch.autograd.grad(y.square().sum(), layer.router)[0]
    g_router_ref = torch.autograd.grad(y_ref.square().sum(), layer.router)[0]
    assert_rel_close(g_router, g_router_ref, 1e-4, "router gradient")


# ---- GPU: block 128 (the default), bf16 and fp32, model-like widths -------------------------


def _check_on_gpu(impl, mlp, routing, dtype_tols):
    """The dMoE at block 128 against the fp32 dense reference on the GPU, fed the same rounded
    inputs (so the tolerance covers the kernels only), for each (dtype, tolerance): output and the
    gradients of x, router weights, w1, w2 (w3)."""
    case = make_case(seed=3, T=1000, d=320, f=256, E=8, k=2, routing=routing)
    idx = case.indices.cuda()
    for dtype, tol in dtype_tols:
        ours = [t.cuda().detach().requires_grad_(True) for t in case.tensors(dtype)]
        ref = [t.detach().float().requires_grad_(True) for t in ours]
        w3o, w3r = (ours[4], ref[4]) if mlp == "glu" else (None, None)
        y = _run(impl, ours[0], ours[1], idx, ours[2], ours[3], w3o, 8, mlp, block_size=128)
        y_ref = moe_dense(ref[0], ref[1], idx, ref[2], ref[3], w3r, 8, mlp)
        assert_rel_close(y, y_ref, tol, f"{dtype} output")
        g = torch.randn_like(y_ref)
        n = 5 if mlp == "glu" else 4
        for name, a, b in zip(
            ["x", "weights", "w1", "w2", "w3"],
            torch.autograd.grad(y, ours[:n], g.to(dtype)),
            torch.autograd.grad(y_ref, ref[:n], g),
            strict=False,
        ):
            assert_rel_close(a, b, tol, f"{dtype} d{name}")


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
@pytest.mark.parametrize("mlp", ["mlp", "glu"])
@pytest.mark.parametrize("routing", ["random", "one-expert"])
def test_dmoe_bf16_on_gpu(impl, mlp, routing):
    """bf16 at block 128, d = 320 (not a multiple of the 128 tile), f = 256, 8 experts top-2, T = 1000,
    against the fp32 dense reference on the GPU fed the same rounded inputs: 2e-2 for outputs and
    gradients (bf16 intermediates, 8 mantissa bits; fp32 sums over up to 320 products). fp32 at 1e-4
    (IEEE products in the kernels; the reference's matmuls in full fp32, PyTorch's default)."""
    _check_on_gpu(impl, mlp, routing, ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)))


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
@pytest.mark.parametrize("mlp", ["mlp", "glu"])
def test_dmoe_fp16_on_gpu(impl, mlp):
    """fp16, the other dtype the default kernels take (the grouped path's TMA GEMM included), at the
    same shape as the bf16 test: 5e-3 against the fp32 reference fed the same fp16 inputs (11-bit
    mantissa, intermediates stored in fp16, fp32 accumulation; the CPU fp16 test's bound). The
    grouped path must run the TMA kernel (the default for fp16 with these 16-byte-aligned rows): a
    silent fall-back to the pointer kernel would leave that path untested, so its launches are
    counted."""
    from paperclub.testing import dispatched
    from repro.megablocks import kernels as kn

    with dispatched(kn, ["_gmm_tma_kernel"]) as (_, launches):
        _check_on_gpu(impl, mlp, "random", ((torch.float16, 5e-3),))
    if impl == "grouped":
        assert launches, "the grouped path did not run the TMA GEMM in fp16"


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("impl", ["sparse", "grouped"])
def test_module_defaults_on_gpu(impl):
    """The module as users build it (block 128, its own router) in bf16 on [B, S, d] = [2, 300, 256]:
    2e-2 against the dense reference routed by the same router, fed the same bf16 parameters."""
    from repro.megablocks import route

    torch.manual_seed(0)
    layer = dMoE(256, 384, 8, 2, mlp="glu", impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    # the routing the layer computed (in bf16: an fp32 router could break near-ties differently)
    w, i = route(x.reshape(-1, 256), layer.router, 2)
    flat = x.reshape(-1, 256).float()
    y_ref = moe_dense(flat, w.float(), i, layer.w1.float(), layer.w2.float(), layer.w3.float(), 8, "glu")
    assert_rel_close(y.reshape(-1, 256), y_ref, 2e-2, "module output")
