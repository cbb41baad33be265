"""The grouped GEMM's TMA kernel (GPU_CONFIG["gmm_tma"], kernels._gmm_tma_kernel) against the pointer
kernel and an fp64 per-group product.

On CPU, Triton 3.6's interpreter emulates the host-side tensor descriptors (zero fill past each
dimension included), with 16 x 16 tiles: groups that are empty, smaller than a tile and off the
tile size, K off the k-step, both weight layouts the dMoE passes (w [G, K, N] and its transposed
views), bf16 and fp16, forward and the data gradient (the weight gradient's TMA kernel,
gmm_wgrad_tma, is tested in test_gmm_wgrad_tma.py).
There both kernels compute each tile with the same products in the same order, so their outputs
are bitwise equal; against fp64, 1e-2 relative for bf16 (8 mantissa bits) and 2e-3 for fp16.
On the GPU: the 8e-top2 layer's dims (d 4096, ffn 14336, 8 experts) at 1024 routed rows.
``python -m repro.megablocks.tests.sm90_gmm`` compiles both kernels offline for sm_90a."""

from __future__ import annotations

import pytest
import torch

from paperclub.testing import assert_rel_close, dispatched
from repro.megablocks import gmm
from repro.megablocks import kernels as kn
from repro.megablocks.kernels import kernel_config

CLAIM = "megablocks/kernels-equal-dense"
SECTION = "§5.1 (arXiv v1)"
COUNTS = [0, 5, 33, 16, 0, 21]  # empty, under a 16-row tile, off the tile size, one tile exactly
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _problem(counts, K, N, w_t, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = torch.tensor(counts, device=device)
    x = torch.randn(int(counts.sum()), K, generator=gen, device=device)
    G = counts.numel()
    w = (
        torch.randn(G, N, K, generator=gen, device=device).transpose(1, 2)
        if w_t
        else torch.randn(G, K, N, generator=gen, device=device)
    )
    g = torch.randn(x.shape[0], N, generator=gen, device=device)
    return counts, x.to(dtype), w.to(dtype), g.to(dtype)


def _run(x, w, counts, g, mode):
    """y and dx (the two products of the kernel; w's gradient is the wgrad kernel's, not asked)."""
    x = x.detach().requires_grad_(True)
    with kernel_config(gmm_tma=mode):
        y = gmm(x, w, counts)
        (dx,) = torch.autograd.grad(y, [x], g)
    return y, dx


def _reference(x, w, counts, g):
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    x64 = x.double().requires_grad_(True)
    y = torch.einsum("mk,mkn->mn", x64, w.double()[group])
    return y, *torch.autograd.grad(y, [x64], g.double())


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("dtype, w_t", [(torch.bfloat16, False), (torch.float16, True)])
def test_tma_kernel_equals_pointer_kernel(dtype, w_t):
    """The forward reads w in one layout and the data gradient (w^T) in the other: both W_T cases."""
    counts, x, w, g = _problem(COUNTS, 40, 40, w_t, dtype)
    tma = _run(x, w, counts, g, "require")
    pointer = _run(x, w, counts, g, False)
    for a, b, r, what in zip(tma, pointer, _reference(x, w, counts, g), ("y", "dx"), strict=True):
        assert torch.equal(a, b), f"{what}: the TMA and pointer kernels differ"
        assert_rel_close(a, r, TOL[dtype], f"gmm tma {what}")


def test_flag_dispatches_to_tma_kernel():
    """gmm_tma False: the pointer kernel; True (the default): the TMA kernel for the forward and the
    data gradient; True on fp32 (not a TMA input): the pointer kernel, silently and correctly;
    'require' on fp32, or a value other than False / True / 'require': a ValueError."""
    assert kn.GPU_CONFIG["gmm_tma"] is True
    counts, x, w, g = _problem([20, 0, 12], 24, 16, True, torch.bfloat16)
    names = ["_gmm_kernel", "_gmm_tma_kernel"]
    for mode, dtype, want in [
        (False, torch.bfloat16, ["_gmm_kernel", "_gmm_kernel"]),
        (True, torch.bfloat16, ["_gmm_tma_kernel", "_gmm_tma_kernel"]),
        (True, torch.float32, ["_gmm_kernel"]),
    ]:
        with dispatched(kn, names) as (_, launches), kernel_config(gmm_tma=mode):
            gmm(x.to(dtype), w.to(dtype), counts) if dtype == torch.float32 else _run(x, w, counts, g, mode)
        assert launches == want, (mode, dtype)
    with kernel_config(gmm_tma="require"), pytest.raises(ValueError, match="dtype torch.float32"):
        gmm(x.float(), w.float(), counts)
    with kernel_config(gmm_tma="yes"), pytest.raises(ValueError, match="gmm_tma"):
        gmm(x, w, counts)


def test_unsupported_inputs_are_named():
    """The cases the TMA kernel leaves to the pointer kernel, each with its reason."""
    x, w = torch.randn(8, 24).bfloat16(), torch.randn(2, 24, 16).bfloat16()
    assert kn._gmm_tma_unsupported(x, w) is None
    assert kn._gmm_tma_unsupported(x, w.transpose(1, 2).contiguous().transpose(1, 2)) is None
    assert "x strides" in kn._gmm_tma_unsupported(x.t().contiguous().t(), w)
    assert "w strides" in kn._gmm_tma_unsupported(x, w.permute(1, 2, 0).contiguous().permute(2, 0, 1))
    odd = torch.randn(8, 20).bfloat16()  # 40-byte rows
    assert "16-byte" in kn._gmm_tma_unsupported(odd, torch.randn(2, 20, 16).bfloat16())
    assert "aligned" in kn._gmm_tma_unsupported(torch.randn(8 * 24 + 1).bfloat16()[1:].view(8, 24), w)
    assert "empty" in kn._gmm_tma_unsupported(x[:0], w)


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("gmm_n", [128, 256])
@pytest.mark.parametrize("K, N, w_t", [(4096, 14336, True), (14336, 4096, False), (200, 264, True)])
def test_tma_kernel_on_gpu(K, N, w_t, gmm_n):
    """bf16 at the 8e-top2 layer's dims, W1 read as a transposed view and W2 as stored (the data
    gradients read each in the other layout: the four products of the dMoE's experts), with 1024
    routed rows over 8 experts (an empty one, some under a 128-row tile), and a small shape off
    every tile; GPU_CONFIG's 128-wide column tiles and the candidate's 256. The TMA kernel (required,
    its launches counted) against the pointer kernel and fp32 products per group, y and dx: 1e-2
    relative (bf16 inputs and outputs, fp32 accumulation)."""
    counts, x, w, g = _problem([300, 0, 7, 129, 64, 1, 400, 123], K, N, w_t, torch.bfloat16, "cuda")
    with kernel_config(gmm_n=gmm_n):
        with dispatched(kn, ["_gmm_tma_kernel"]) as (_, launches):
            tma = _run(x, w, counts, g, "require")
        assert launches == ["_gmm_tma_kernel"] * 2
        pointer = _run(x, w, counts, g, False)
    for got, want, what in zip(tma, pointer, ("y", "dx"), strict=True):
        assert_rel_close(got, want.float(), 1e-2, f"{what}: tma vs pointer kernel")
    ends = torch.cumsum(counts, 0).tolist()
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if end > start:
            assert_rel_close(tma[0][start:end], x[start:end].float() @ w[e].float(), 1e-2, f"y, expert {e}")
            assert_rel_close(
                tma[1][start:end], g[start:end].float() @ w[e].float().t(), 1e-2, f"dx, expert {e}"
            )


def test_tma_kernel_compiles_for_sm90(tmp_path):
    """The TMA kernel compiled offline for sm_90a (Triton's compiler and bundled ptxas, no GPU) at the
    candidate's 128 x 256 tiles, w read as [G, N, K] and transposed in shared memory (the W_T path,
    the one with more to lower; both layouts and settings: ``python -m repro.megablocks.tests.sm90_gmm``):
    TMA loads feeding wgmma, no register spills."""
    from paperclub.lab import offline

    cases = [["gmm_n=256", "tma", True]]
    for row in offline("repro.megablocks.tests.sm90_gmm", cases, cache_dir=tmp_path):
        assert "error" not in row, row
        assert row["tma_loads"] > 0 and row["wgmma"] > 0, row
        if "registers" in row:  # this Triton has its bundled ptxas
            assert row["spill_stores"] == 0 and row["registers"] <= 255, row
