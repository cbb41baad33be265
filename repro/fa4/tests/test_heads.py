"""Head sizes, v's own head size and the sliding window (issue #42), on a CPU.

* :func:`repro.fa4.api.head_layout` and :func:`repro.fa4.api.attention_mask` are plain Python: every
  head size flash-attn takes gets tiles that hold it, and the verified kernels serve every D <= 128;
  a window is normalised as flash-attn's is.
* The kernels on those layouts, in Triton's interpreter (fp32, the interpreter's 16 x 16 tiles,
  small shapes), against the float64 reference: padded q and k, v padded and cut into chunks, v on a
  tile of its own (the D_V != D kernels), the D = 256 tile, and sliding windows (the window kernels,
  forward and both Triton backwards), with GQA, ragged lengths and S_q > S_k. Tolerance: fp32 through
  the interpreter is exact to rounding (measured 1e-7 to 3e-7 against fp64): 2e-5.
* Bad input is refused before any kernel runs, naming the argument, the value and what is taken;
  inputs with any strides work.

The GPU side (flash-attn's own test matrices) is ``test_gpu_peer_matrix.py``; the offline sm_90a
compiles of the new kernels are in ``test_lab.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from paperclub.triton_compat import interpreting
from repro.fa4 import Switches, attention, attention_any_d, attention_backward, attention_forward
from repro.fa4.api import (
    MAX_HEAD_DIM,
    MAX_HEAD_DIM_V,
    PUBLIC_TILES,
    TEST_TILES,
    attention_mask,
    empty_rows,
    head_layout,
)
from repro.fa4.reference import attention_exact, window_mask

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")
CLAIM = pytest.mark.claim(
    "fa4/kernel-equals-reference",
    section="Abstract, contributions (1) and (2): the forward algorithm and its backward (arXiv v1)",
)
TOL = 2e-5


# ---------------------------------------------------------------------------------------------
# Plain Python: tiles and masks
# ---------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(d=st.integers(1, MAX_HEAD_DIM), d_v=st.integers(1, MAX_HEAD_DIM_V), own=st.booleans())
def test_every_head_size_gets_tiles_that_hold_it(d, d_v, own):
    """Every (D, D_v) flash-attn takes maps to tiles that hold it. D <= 128 runs the verified kernels
    (one tile of 64 or 128 for q, k and v, v in chunks of it) unless v asks for its own tile, on the
    tile that does the least matmul work; otherwise q and k take the smallest tile that holds D and v
    the smallest that holds D_v (chunks of 256 beyond)."""
    lay = head_layout(d, d_v, PUBLIC_TILES, own)
    assert lay.tile >= d and lay.tile_v * lay.chunks >= d_v > lay.tile_v * (lay.chunks - 1)
    assert lay.tile in PUBLIC_TILES and lay.tile_v in PUBLIC_TILES
    assert lay.verified == (lay.tile == lay.tile_v <= 128)
    if d <= 128 and not own:
        assert lay.verified
    assert lay.flops_ratio() >= 1
    if d <= 128 and not own:
        work = [-(-d_v // t) * 2 * t for t in (64, 128) if t >= d]
        assert lay.chunks * 2 * lay.tile == min(work)
    else:
        assert lay.tile == min(t for t in PUBLIC_TILES if t >= d)
        assert lay.tile_v == min((t for t in PUBLIC_TILES if t >= d_v), default=256)


def test_head_layouts_of_the_common_sizes():
    """The layouts the page and the bench name: exact at 64, 128, 256; 96 on the 128 tile (1.33x the
    matmul work); 192 / 128 (MLA's q/k and v) on 256 and 128; D_v = 512 at D = 64 in four chunks of the
    128 tile (as cheap as eight of 64, fewer calls)."""
    for d in (64, 128, 256):
        assert head_layout(d, d).exact
    assert head_layout(96, 96).tile == 128 and not head_layout(96, 96).exact
    assert head_layout(96, 96).flops_ratio() == pytest.approx(4 / 3)
    lay = head_layout(192, 128)
    assert (lay.tile, lay.tile_v, lay.chunks) == (256, 128, 1) and lay.flops_ratio() == pytest.approx(1.2)
    lay = head_layout(64, 512)
    assert (lay.tile, lay.tile_v, lay.chunks) == (128, 128, 4) and lay.verified
    assert head_layout(16, 16, TEST_TILES).exact and head_layout(16, 16).tile == 64


@pytest.mark.parametrize(
    "window, causal, s_q, s_k, want",
    [
        (None, True, 5, 9, (True, None)),
        ((-1, -1), False, 5, 9, (False, None)),  # flash-attn's "no window"
        ((None, None), True, 5, 9, (True, None)),
        ((8, 0), False, 5, 9, (True, None)),  # the whole past and no future: causal
        ((3, 100), True, 5, 9, (False, (3, 0))),  # causal makes right 0
        ((8, 4), False, 5, 9, (False, None)),  # hides nothing
        ((2, 3), False, 5, 9, (False, (2, 3))),
        ((None, 2), False, 5, 9, (False, (14, 2))),  # unbounded: S_q + S_k
        (torch.tensor([2, 3]), False, 5, 9, (False, (2, 3))),  # flash-attn's tests pass a tensor
    ],
)
def test_window_is_normalised_as_flash_attn_does(window, causal, s_q, s_k, want):
    assert attention_mask(window, causal, s_q, s_k) == want


def test_rows_without_keys_are_a_prefix_counted_by_the_right_bound():
    assert empty_rows(10, 4, True, None) == 6
    assert empty_rows(10, 4, False, (2, 1)) == 5 and empty_rows(10, 4, False, (2, 6)) == 0
    assert empty_rows(10, 4, False, None) == 0 and empty_rows(4, 10, True, None) == 0


# ---------------------------------------------------------------------------------------------
# The kernels on those layouts (interpreter)
# ---------------------------------------------------------------------------------------------


def _check(b, s_q, s_k, h, h_kv, d, d_v, causal, window, seed, **switches):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(b, s, n, w, generator=g).requires_grad_()
        for s, n, w in ((s_q, h, d), (s_k, h_kv, d), (s_k, h_kv, d_v))
    )
    out = attention_any_d(q, k, v, causal=causal, window=window, **switches)
    ref = attention_exact(q, k, v, causal=causal, window=window)
    assert out.shape == (b, s_q, h, d_v) and out.dtype == q.dtype
    do = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    assert_rel_close(out, ref, TOL, "output")
    for name, a, r in zip("qkv", grads, ref_grads, strict=True):
        if r.norm() > 0:  # one key per row (a window of width 1) has exact zero dq, dk
            assert_rel_close(a, r, TOL, f"d{name}")


@needs_interpreter
@CLAIM
@settings(max_examples=10, deadline=None)
@given(
    s_q=st.integers(1, 40),
    s_k=st.integers(1, 40),
    heads=st.sampled_from([(2, 1), (3, 3), (4, 2)]),
    dims=st.sampled_from([(8, 8), (24, 24), (16, 40), (40, 16), (24, 72)]),
    mask=st.sampled_from(["none", "causal", "window"]),
    left=st.integers(-1, 30),
    right=st.integers(-1, 30),
    bwd=st.sampled_from(["fa2", "fused"]),
    own_v_tile=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_padded_chunked_and_windowed_attention_is_exact(
    s_q, s_k, heads, dims, mask, left, right, bwd, own_v_tile, seed
):
    """Head sizes off the tiles (padded), v wider than q's tile (chunks) or on its own tile, and
    sliding windows (either side unbounded at -1), forward and both Triton backwards: the float64
    reference's output and gradients."""
    h, h_kv = heads
    d, d_v = dims
    window = (left, right) if mask == "window" else None
    _check(1, s_q, s_k, h, h_kv, d, d_v, mask == "causal", window, seed, bwd=bwd, own_v_tile=own_v_tile)


@needs_interpreter
@CLAIM
@pytest.mark.parametrize(
    "d, d_v, window", [(136, 136, None), (200, 72, (5, 3))], ids=["d136-pad256", "d200-dv72-window"]
)
def test_the_256_tile(d, d_v, window):
    """D > 128 runs the D = 256 tile (not yet run on a GPU): q, k padded to 256, v on its own tile."""
    assert head_layout(d, d_v, TEST_TILES).tile == 256
    _check(1, 20, 27, 2, 1, d, d_v, False, window, 0, bwd="fused")


@needs_interpreter
@CLAIM
def test_window_forward_and_backward_with_the_log_sum_exp():
    """attention_forward / attention_backward with a window (NSA's sliding-window branch calls them):
    the reference's output, its log-sum-exp over the keys each row sees, and its gradients."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 37, n, 16, generator=g) for n in (4, 2, 2))
    window = (7, 0)
    for bwd in ("fa2", "fused"):
        o, lse = attention_forward(q, k, v, window=window, config=Switches(bwd=bwd))
        leaves = [t.clone().double().requires_grad_() for t in (q, k, v)]
        ref = attention_exact(*leaves, window=window)
        assert_rel_close(o, ref, TOL, "o")
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2)) / 4.0
        s = s.masked_fill(~window_mask(37, 37, *window), float("-inf"))
        assert_rel_close(lse, torch.logsumexp(s, -1), TOL, "lse")
        do = torch.randn(o.shape, generator=g)
        grads = attention_backward(do, q, k, v, o, lse, window=window, config=Switches(bwd=bwd))
        for name, a, r in zip("qkv", grads, torch.autograd.grad(ref, leaves, do.double()), strict=True):
            assert_rel_close(a, r, TOL, f"d{name} ({bwd})")


@needs_interpreter
@CLAIM
def test_public_entry_point_in_bf16_at_head_size_96_with_a_window():
    """The public ``attention`` at D = 96 (padded to the verified 128 tile) in bf16 and with a window,
    inputs of any strides (transposed views), against fp64 SDPA-equivalent: bf16 rounds P, dS and the
    outputs to 8 bits (~3e-3 measured): 1e-2."""
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(1, n, 40, 96, generator=g).bfloat16() for n in (2, 1, 1)]
    q, k, v = (t.transpose(1, 2) for t in base)  # [B, S, H, D] views with the head dim outermost
    assert not q.is_contiguous()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, window=(9, 2))
    ref = attention_exact(*ref_leaves, window=(9, 2))
    do = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, leaves, do.bfloat16())
    assert_rel_close(out, ref, 1e-2, "output (bf16)")
    for name, a, r in zip("qkv", grads, torch.autograd.grad(ref, ref_leaves, do.double()), strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape
        assert_rel_close(a, r, 1e-2, f"d{name} (bf16)")


# ---------------------------------------------------------------------------------------------
# Refusals: before any kernel, naming the argument, the value and what is taken
# ---------------------------------------------------------------------------------------------


def _bf16(*shapes):
    return [torch.randn(*s).bfloat16() for s in shapes]


@pytest.mark.parametrize(
    "shapes, kwargs, error, match",
    [
        (((1, 8, 2, 264), (1, 8, 2, 264), (1, 8, 2, 264)), {}, ValueError, r"D = 264 of q and k .* 1 to 256"),
        (((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 520)), {}, ValueError, r"D_v = 520 of v .* 1 to 512"),
        (((1, 8, 2, 64), (1, 8, 2, 64), (1, 9, 2, 64)), {}, ValueError, r"v must be \[B, S_k, H_kv, D_v\]"),
        (
            ((1, 8, 2, 64), (1, 8, 2, 32), (1, 8, 2, 64)),
            {},
            ValueError,
            r"k must be \[B=1, S_k, H_kv, D=64\]",
        ),
        (((1, 8, 2, 64),) * 3, {"window": (2,)}, TypeError, r"window must be \(left, right\)"),
        (
            ((1, 8, 2, 64),) * 3,
            {"window": (2.5, 0)},
            TypeError,
            r"window left must be an int or None, got 2.5",
        ),
        (((1, 8, 2, 64),) * 3, {"window": (2, True)}, TypeError, r"window right must be an int or None"),
    ],
)
def test_bad_input_is_refused_before_any_kernel(shapes, kwargs, error, match):
    with pytest.raises(error, match=match):
        attention(*_bf16(*shapes), **kwargs)


@needs_interpreter
def test_switches_that_cannot_serve_an_input_are_refused_by_name():
    q, k, v = _bf16((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64))
    with pytest.raises(ValueError, match=r"gluon=True runs q, k and v on one tile .* window = \(2, 0\)"):
        attention(q, k, v, window=(2, 0), gluon=True)
    with pytest.raises(ValueError, match=r"bwd='gluon' runs .* D = 200, D_v = 64 \(tiles 256, 64\)"):
        attention(*_bf16((1, 8, 2, 200), (1, 8, 2, 200), (1, 8, 2, 64)), bwd="gluon")
    # gluon=True pads v to q's 256 tile (run_layout); with v on its own tile asked for, refused
    with pytest.raises(ValueError, match=r"gluon=True runs .* D = 200, D_v = 64 \(tiles 256, 64\)"):
        attention(*_bf16((1, 8, 2, 200), (1, 8, 2, 200), (1, 8, 2, 64)), gluon=True, own_v_tile=True)
    with pytest.raises(ValueError, match="sliding window runs one query tile per program"):
        attention(q, k, v, window=(2, 0), pingpong=True)
    with pytest.raises(ValueError, match="q, k, v must be on one device, got cpu, meta, cpu"):
        attention(q, k.to("meta"), v)
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        attention(q, k.half(), v)
    with pytest.raises(ValueError, match=r"a window \(left, right\) needs S_q <= S_k \+ right"):
        attention_forward(*_bf16((1, 9, 2, 64), (1, 4, 2, 64), (1, 4, 2, 64)), window=(3, 1))
