"""The entry points around the kernels: a config passed in (``config=Switches(...)``) runs what its
keyword form runs; the forward with its log-sum-exp and the backward from a given output and
log-sum-exp (``attention_forward`` / ``attention_backward``, for ring attention) agree with autograd
through ``attention_any_d`` and with the exact log-sum-exp; removed options are refused by name."""

from __future__ import annotations

import math
import os

import pytest
import torch

from paperclub.testing import assert_rel_close
from repro.fa4 import Switches, attention_any_d, attention_backward, attention_forward
from repro.fa4.reference import causal_mask

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_GPU = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (INTERPRET or HAS_GPU), reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_GPU else "cpu"
# fp32 in the interpreter is exact to ~1e-7; the GPU runs fp32 dots as tf32 (10-bit mantissa)
TOL = 1e-2 if HAS_GPU else 2e-5


def _inputs(b=1, s_q=24, s_k=40, h=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(DEVICE) for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv))]


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_forward_with_lse_and_backward_from_it_match_autograd(causal):
    """attention_forward's output equals attention_any_d's and its LSE the exact natural-log
    log-sum-exp; attention_backward from that output and LSE gives autograd's gradients, with the
    backward the config names (fa2 and fused, GQA, S_q < S_k)."""
    q, k, v = _inputs()
    do = torch.randn_like(q)
    for bwd in ("fa2", "fused"):
        cfg = Switches(bwd=bwd)
        o, lse = attention_forward(q, k, v, causal=causal, config=cfg)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_o = attention_any_d(*leaves, causal=causal, config=cfg)
        assert_rel_close(o, ref_o.detach(), TOL, "o")
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2)) / math.sqrt(
            16
        )
        if causal:
            s = s.masked_fill(~causal_mask(q.shape[1], k.shape[1], s.device), float("-inf"))
        assert lse.shape == (1, 4, 24) and lse.dtype == torch.float32
        assert_rel_close(lse, torch.logsumexp(s, -1), TOL, "lse")
        grads = attention_backward(do, q, k, v, o, lse, causal=causal, config=cfg)
        for name, a, r in zip("qkv", grads, torch.autograd.grad(ref_o, leaves, do), strict=True):
            assert_rel_close(a, r, TOL, f"d{name} ({bwd})")


@needs_triton
def test_config_equals_keywords_and_is_refused_beside_them():
    q, k, v = _inputs(seed=1)
    a = attention_any_d(q, k, v, causal=True, config=Switches(lazy_rescale=False, soft_exp=2))
    b = attention_any_d(q, k, v, causal=True, lazy_rescale=False, soft_exp=2)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="config= or switch keywords, not both"):
        attention_any_d(q, k, v, config=Switches(), tma=True)
    with pytest.raises(TypeError, match="config must be a Switches"):
        attention_any_d(q, k, v, config={"tma": True})


def test_lower_level_entry_points_refuse_what_they_cannot_do():
    q, k, v = _inputs(s_q=48, s_k=40)
    if INTERPRET or HAS_GPU:
        with pytest.raises(ValueError, match="attention_forward: causal needs S_q <= S_k"):
            attention_forward(q, k, v, causal=True)
        q2, k2, v2 = _inputs()
        with pytest.raises(ValueError, match=r"attention_backward: lse must have shape \(1, 4, 24\)"):
            attention_backward(q2, q2, k2, v2, q2, torch.zeros(1, 4, 23), config=Switches(bwd="fa2"))
    with pytest.raises(ValueError, match="bwd_dq_defer: .*removed"):
        attention_any_d(q, k, v, bwd="gluon", bwd_dq_defer=False)


def test_auto_forward_picks_gluon_only_where_it_runs(monkeypatch):
    """gluon=None (the default) runs the Gluon forward on a Hopper GPU with bf16/fp16, q, k and v on one
    tile of 64, 128 or 256 and no window, and the Triton one wherever any of these fails or a Triton-only
    switch is set; an explicit gluon=True/False is kept as given."""
    from types import SimpleNamespace

    from repro.fa4 import api, auto_forward, gluon_fwd
    from repro.fa4.api import head_layout

    monkeypatch.setattr(api, "interpreting", lambda: False)
    monkeypatch.setattr(gluon_fwd, "HAS_GLUON", True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    q = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    on_tile = head_layout(96, 96)  # padded to the verified 128 tile
    assert on_tile.verified
    assert auto_forward(q, None, on_tile, Switches()) is True
    assert auto_forward(q, None, on_tile, Switches(lazy_rescale=False)) is True  # the Gluon kernel has it
    assert auto_forward(q, None, on_tile, Switches(gluon=False)) is False
    for changes in ({"tma": True}, {"soft_exp": 2}, {"pingpong": True}, {"block_m": 64}):
        assert auto_forward(q, None, on_tile, Switches(**changes)) is False, changes
    assert auto_forward(q, (128, 0), on_tile, Switches()) is False  # a window: the Triton window kernel
    assert auto_forward(q, None, head_layout(200, 200), Switches()) is True  # q, k, v on the 256 tile
    assert auto_forward(q, None, head_layout(256, 64), Switches()) is False  # v on a tile of its own
    assert (
        auto_forward(SimpleNamespace(device=q.device, dtype=torch.float32), None, on_tile, Switches())
        is False
    )
    assert (
        auto_forward(SimpleNamespace(device=torch.device("cpu"), dtype=q.dtype), None, on_tile, Switches())
        is False
    )
    capability[0] = (8, 0)  # an A100: no Gluon kernel for it
    assert auto_forward(q, None, on_tile, Switches()) is False
    assert auto_forward(q, None, on_tile, Switches(gluon=True)) is True  # asked for: checked at launch
    monkeypatch.setattr(api, "interpreting", lambda: True)
    capability[0] = (9, 0)
    assert auto_forward(q, None, on_tile, Switches()) is False  # the CPU interpreter runs no Gluon


def test_run_layout_pads_v_to_q_tile_where_the_gluon_kernels_take_it(monkeypatch):
    """D > 128 with a narrower v (MLA's 192 / 128): v padded to q's 256 tile where the Gluon kernels
    run the call (Hopper, gluon None or True), v on its own tile elsewhere (off Hopper, a window,
    gluon=False, own_v_tile, a Triton-only switch, the interpreter); D <= 128 and D_v on q's tile
    already: head_layout's tiles unchanged."""
    from types import SimpleNamespace

    from repro.fa4 import api, gluon_fwd
    from repro.fa4.api import PUBLIC_TILES, head_layout, run_layout

    monkeypatch.setattr(api, "interpreting", lambda: False)
    monkeypatch.setattr(gluon_fwd, "HAS_GLUON", True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])

    def q(d, dtype=torch.bfloat16):
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(1, 8, 2, d))

    lay = run_layout(q(192), None, PUBLIC_TILES, Switches(), 128)
    assert (lay.tile, lay.tile_v, lay.chunks) == (256, 256, 1) and lay.gluon_forward and lay.gluon_backward
    assert lay.flops_ratio() == pytest.approx(512 / 320)
    assert run_layout(q(192), None, PUBLIC_TILES, Switches(gluon=True), 64).tile_v == 256
    own = head_layout(192, 128)
    assert own.tile_v == 128
    for args in (
        (q(192), (64, 0), Switches()),  # a window: the Triton window kernels
        (q(192), None, Switches(gluon=False)),
        (q(192), None, Switches(own_v_tile=True)),
        (q(192), None, Switches(tma=True)),  # a Triton-only forward switch
        (q(192, torch.float32), None, Switches()),
    ):
        assert run_layout(*args[:2], PUBLIC_TILES, args[2], 128) == own, args
    for d, d_v in ((96, 64), (128, 512), (256, 256), (200, 300)):
        assert run_layout(q(d), None, PUBLIC_TILES, Switches(), d_v) == head_layout(d, d_v)
    capability[0] = (8, 0)
    assert run_layout(q(192), None, PUBLIC_TILES, Switches(), 128) == own
    capability[0] = (9, 0)
    monkeypatch.setattr(api, "interpreting", lambda: True)
    assert run_layout(q(192), None, PUBLIC_TILES, Switches(), 128) == own
