"""The grouped GEMM's weight-gradient TMA kernel (GPU_CONFIG["gmm_wgrad_tma"],
kernels._gmm_wgrad_tma_kernel) against the pointer kernel (_gmm_wgrad_kernel) and an fp64 per-group
product DW[g] = X[rows of g]^T G[rows of g].

On CPU, Triton 3.6's interpreter emulates the host-side tensor descriptors with 16 x 16 tiles: groups
that are empty, smaller than the 16-row reduction step and off it (so that a step's box reaches into
the next group's rows, which the kernel must zero), K and N off the tile, bf16 and fp16, and both
call forms of _GMM.backward (x, g for w [G, K, N]; g, x for a transposed view, dw^T = G^T X).
Both kernels add the same products in the same order, so their outputs are bitwise equal; against
fp64, 1e-2 relative for bf16 and 2e-3 for fp16. On the GPU: the 8e-top2 layer's dims at 1024 routed
rows. ``python -m repro.megablocks.tests.sm90_gmm`` compiles both kernels offline for sm_90a."""

from __future__ import annotations

import pytest
import torch

from paperclub.testing import assert_rel_close, dispatched
from repro.megablocks import gmm
from repro.megablocks import kernels as kn
from repro.megablocks.kernels import kernel_config

CLAIM = "megablocks/kernels-equal-dense"
SECTION = "§5.1 (arXiv v1)"
COUNTS = [0, 5, 33, 16, 0, 21]  # empty, under a 16-row step, off the step, one step exactly
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
NAMES = ["_gmm_wgrad_kernel", "_gmm_wgrad_tma_kernel"]


def _operands(counts, K, N, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = torch.tensor(counts, device=device)
    M = int(counts.sum())
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    g = torch.randn(M, N, generator=gen, device=device).to(dtype)
    return counts, x, g


def _wgrad(a, b, counts, mode):
    with kernel_config(gmm_wgrad_tma=mode):
        return kn._gmm_wgrad(a, b, kn._gmm_tiles(counts), counts.numel())


def _reference(a, b, counts):
    ends = torch.cumsum(counts, 0).tolist()
    return torch.stack(
        [a[s:e].double().t() @ b[s:e].double() for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    )


@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_tma_kernel_equals_pointer_kernel(dtype):
    """Both call forms of _GMM.backward: (x [M, 40], g [M, 24]) -> [G, 40, 24] and (g, x) -> [G, 24, 40]."""
    counts, x, g = _operands(COUNTS, 40, 24, dtype)
    for a, b in ((x, g), (g, x)):
        tma = _wgrad(a, b, counts, "require")
        pointer = _wgrad(a, b, counts, False)
        assert torch.equal(tma, pointer), "the weight gradient's TMA and pointer kernels differ"
        assert_rel_close(tma, _reference(a, b, counts), TOL[dtype], "gmm wgrad tma")
        assert not tma[0].any() and not tma[4].any()  # empty groups: zero gradient


@pytest.mark.parametrize("w_t", [False, True])
def test_wgrad_tma_through_autograd(w_t):
    """gmm's backward with gmm_wgrad_tma 'require' (the TMA kernel for w's gradient, in the form the
    weight's layout asks for) equals it with False, bitwise."""
    counts, x, g = _operands([7, 0, 20], 24, 40, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    shape = (3, 40, 24) if w_t else (3, 24, 40)
    w = torch.randn(*shape, generator=gen).bfloat16()
    w = w.transpose(1, 2) if w_t else w
    grads = []
    for mode in ("require", False):
        leaf = w.detach().requires_grad_(True)
        with kernel_config(gmm_wgrad_tma=mode), dispatched(kn, NAMES) as (_, launches):
            (dw,) = torch.autograd.grad(gmm(x, leaf, counts), [leaf], g)
        assert launches == [NAMES[mode == "require"]], (mode, launches)
        grads.append(dw)
    assert torch.equal(*grads)
    ref = _reference(g, x, counts).transpose(1, 2) if w_t else _reference(x, g, counts)
    assert_rel_close(grads[0], ref, TOL[torch.bfloat16], "gmm dw through autograd")


def test_flag_dispatches_to_wgrad_tma_kernel():
    """gmm_wgrad_tma False (the default): the pointer kernel; True: the TMA kernel; True on fp32 (not
    a TMA input): the pointer kernel, silently and correctly; 'require' on fp32, or a value other
    than False / True / 'require': a ValueError."""
    assert kn.GPU_CONFIG["gmm_wgrad_tma"] is False
    counts, x, g = _operands([20, 0, 12], 24, 16, torch.bfloat16)
    for mode, dtype, want in [
        (False, torch.bfloat16, "_gmm_wgrad_kernel"),
        (True, torch.bfloat16, "_gmm_wgrad_tma_kernel"),
        (True, torch.float32, "_gmm_wgrad_kernel"),
    ]:
        with dispatched(kn, NAMES) as (_, launches):
            dw = _wgrad(x.to(dtype), g.to(dtype), counts, mode)
        assert launches == [want], (mode, dtype)
        assert_rel_close(dw, _reference(x.to(dtype), g.to(dtype), counts), TOL[torch.bfloat16], f"{mode}")
    with pytest.raises(ValueError, match="gmm weight gradient: .*'require'.*dtype torch.float32"):
        _wgrad(x.float(), g.float(), counts, "require")
    with pytest.raises(ValueError, match="gmm_wgrad_tma"):
        _wgrad(x, g, counts, "yes")


def test_unsupported_wgrad_inputs_are_named():
    """The cases the weight gradient's TMA kernel leaves to the pointer kernel, each with its reason."""
    x, g = torch.randn(8, 24).bfloat16(), torch.randn(8, 16).bfloat16()
    assert kn._gmm_wgrad_tma_unsupported(x, g) is None
    assert kn._gmm_wgrad_tma_unsupported(g, x) is None
    assert "dtype torch.float32" in kn._gmm_wgrad_tma_unsupported(x.float(), g.float())
    assert "dtypes" in kn._gmm_wgrad_tma_unsupported(x, g.half())
    assert "contiguous" in kn._gmm_wgrad_tma_unsupported(x.t().contiguous().t(), g)
    assert "contiguous" in kn._gmm_wgrad_tma_unsupported(x, g.t().contiguous().t())
    odd = torch.randn(8, 20).bfloat16()  # 40-byte rows
    assert "16-byte" in kn._gmm_wgrad_tma_unsupported(odd, g)
    assert "aligned" in kn._gmm_wgrad_tma_unsupported(torch.randn(8 * 24 + 1).bfloat16()[1:].view(8, 24), g)
    assert "empty" in kn._gmm_wgrad_tma_unsupported(x[:0], g[:0])


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("gmm_n", [128, 256])
@pytest.mark.parametrize("K, N", [(4096, 14336), (14336, 4096), (200, 264)])
def test_wgrad_tma_kernel_on_gpu(K, N, gmm_n):
    """bf16 at the 8e-top2 layer's dims (x [M, 4096] with the up-projection's gradient [M, 14336],
    and the down-projection's pair; both call forms), 1024 routed rows over 8 experts (an empty one,
    some under a 64-row step, so that steps reach into the next expert's rows), and a small shape off
    every tile; 128- and 256-wide column tiles. The TMA kernel (required, its launches counted) against
    the pointer kernel and fp32 products per group: 1e-2 relative (bf16 output, fp32 accumulation)."""
    counts, x, g = _operands([300, 0, 7, 129, 64, 1, 400, 123], K, N, torch.bfloat16, "cuda")
    ends = torch.cumsum(counts, 0).tolist()
    for a, b in ((x, g), (g, x)):
        with kernel_config(gmm_n=gmm_n):
            with dispatched(kn, NAMES) as (_, launches):
                tma = _wgrad(a, b, counts, "require")
            assert launches == ["_gmm_wgrad_tma_kernel"]
            pointer = _wgrad(a, b, counts, False)
        assert_rel_close(tma, pointer.float(), 1e-2, "dw: tma vs pointer kernel")
        assert not tma[1].any(), "the empty expert's gradient is not zero"
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            if end > start:
                want = a[start:end].float().t() @ b[start:end].float()
                assert_rel_close(tma[e], want, 1e-2, f"dw, expert {e}")


def test_wgrad_tma_kernel_compiles_for_sm90(tmp_path):
    """The weight gradient's TMA kernel compiled offline for sm_90a (Triton's compiler and bundled
    ptxas, no GPU) at 128 x 128 and 128 x 256 tiles of DW, 64 rows per step: TMA loads feeding wgmma,
    no register spills."""
    from paperclub.lab import offline

    cases = [["default", "wgrad_tma", False], ["gmm_n=256", "wgrad_tma", False]]
    for row in offline("repro.megablocks.tests.sm90_gmm", cases, cache_dir=tmp_path):
        assert "error" not in row, row
        assert row["tma_loads"] > 0 and row["wgmma"] > 0, row
        if "registers" in row:  # this Triton has its bundled ptxas
            assert row["spill_stores"] == 0 and row["registers"] <= 255, row
