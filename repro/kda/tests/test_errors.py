"""Bad input raises ValueError naming the argument, what was got and what was expected."""

from __future__ import annotations

import pytest
import torch

from repro.kda import KDAConfig, chunk_kda, chunk_kda_torch, decode_step, recurrent_kda


def _inputs(B=1, T=8, H=2, HV=4, K=16, V=16, dtype=torch.float32):
    return dict(
        q=torch.randn(B, T, H, K, dtype=dtype),
        k=torch.randn(B, T, H, K, dtype=dtype),
        v=torch.randn(B, T, HV, V, dtype=dtype),
        g=-torch.rand(B, T, HV, K),
        beta=torch.rand(B, T, HV),
    )


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda, chunk_kda_torch])
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.update(q=d["q"][0]), r"q must be 4-D"),
        (lambda d: d.update(k=d["k"][:, :4]), r"k must have q's shape"),
        (lambda d: d.update(v=torch.randn(1, 8, 3, 16)), r"HV=3.*multiple of the key heads H=2"),
        (lambda d: d.update(g=d["g"][..., :8]), r"g \(log-decay\) must have shape \[B, T, HV, K\]"),
        (lambda d: d.update(beta=d["beta"][..., None]), r"beta must have shape"),
        (lambda d: d.update(initial_state=torch.zeros(1, 2, 16, 16)), r"initial_state must have shape"),
        (lambda d: d.update(v=d["v"].to(torch.float16)), r"share one dtype"),
        (lambda d: d.update(q=d["q"].to(torch.int64)), r"q has dtype torch.int64"),
    ],
)
def test_bad_inputs_are_named(fn, change, match):
    d = _inputs()
    change(d)
    with pytest.raises(ValueError, match=match):
        fn(**d)


def test_triton_head_dims_are_listed():
    # chunk_kda zero-pads K = 24 to 32 (test_varlen.py checks the values); decode_step does not pad
    d = _inputs(K=24, T=1)
    with pytest.raises(ValueError, match=r"K=24 is not supported.*\(16, 32, 64, 128\)"):
        decode_step(**d, state=torch.zeros(1, 4, 24, 16))
    with pytest.raises(ValueError, match=r"value head dim 512 \(v.shape\[-1\]\) is larger.*at most 256"):
        chunk_kda(**_inputs(V=512))
    with pytest.raises(ValueError, match=r"K=256 is not supported.*\(16, 32, 64, 128\)"):
        decode_step(**_inputs(K=256, T=1), state=torch.zeros(1, 4, 256, 16))
    with pytest.raises(ValueError, match=r"float64"):
        chunk_kda(**_inputs(dtype=torch.float64))


def test_decode_step_rejects_many_tokens_and_bad_state():
    d = _inputs(T=1)
    with pytest.raises(ValueError, match=r"state must be a contiguous float32"):
        decode_step(**d, state=torch.zeros(1, 4, 16, 16, dtype=torch.bfloat16))
    d = _inputs(T=3)
    with pytest.raises(ValueError, match=r"one token, got T=3"):
        decode_step(**d, state=torch.zeros(1, 4, 16, 16))


def test_chunk_size_is_checked():
    with pytest.raises(ValueError, match=r"chunk_size"):
        chunk_kda_torch(**_inputs(), chunk_size=24)


def test_bad_config_is_named_before_any_kernel():
    """A config value outside what the kernels take names the field, the value and what is expected;
    chunk_kda refuses anything but a KDAConfig."""
    with pytest.raises(ValueError, match=r"KDAConfig.wy_bk = 24: expected one of \(16, 32, 64, 128\)"):
        KDAConfig(wy_bk=24)
    with pytest.raises(ValueError, match=r"KDAConfig.bwd_dqk_warps = 3: expected one of"):
        KDAConfig(bwd_dqk_warps=3)
    with pytest.raises(ValueError, match=r"KDAConfig.state_bwd_bv = True"):
        KDAConfig(state_bwd_bv=True)
    with pytest.raises(ValueError, match=r"config must be a repro.kda.KDAConfig, got dict"):
        chunk_kda(**_inputs(), config={"wy_bk": 16})


def test_decay_above_zero_or_nan_is_refused():
    """g > 0 (a growing state) and NaN are refused with the range found; below -10 is clamped, not
    refused (test_decay_clamp.py)."""
    d = _inputs()
    d["g"] = torch.full_like(d["g"], 0.5)
    with pytest.raises(ValueError, match=r"g \(log-decay.*must be <= 0.*got min 0.5, max 0.5"):
        chunk_kda(**d)
    d["g"] = torch.full_like(d["g"], float("nan"))
    with pytest.raises(ValueError, match=r"must be <= 0"):
        chunk_kda(**d)
    d["g"] = torch.full_like(d["g"], -12.0)
    d["g"][0, 3, 2, 1] = 1e-3  # one positive entry among strong decays: still refused
    with pytest.raises(ValueError, match=r"must be <= 0.*got min -12, max 0.001"):
        chunk_kda(**d)


@pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1", reason="interpreter case (CPU tensors allowed)"
)
def test_tensors_on_a_device_the_kernels_do_not_run_on_are_refused():
    """Under the interpreter the kernels take CPU tensors; a tensor elsewhere is named before any launch."""
    from repro.kda.validate import check_kernel_device

    check_kernel_device(torch.zeros(1), "chunk_kda")  # CPU under TRITON_INTERPRET=1 (conftest)
    with pytest.raises(
        ValueError, match=r"chunk_kda: the tensors are on meta; the Triton kernels run on a CUDA"
    ):
        check_kernel_device(torch.zeros(1, device="meta"), "chunk_kda")


def test_non_contiguous_and_mixed_dtype_inputs_work():
    """Strided views (a transposed layout) and g, beta, initial_state in other dtypes than q, k, v
    give what the contiguous same-dtype call gives."""
    d = _inputs(T=20, K=16, V=16)
    h0 = torch.randn(1, 4, 16, 16)
    o_ref, h_ref = chunk_kda(**d, initial_state=h0, output_final_state=True)
    strided = {n: x.transpose(1, 2).contiguous().transpose(1, 2) for n, x in d.items()}
    assert not strided["q"].is_contiguous()
    o, h = chunk_kda(
        **strided, initial_state=h0.transpose(-1, -2).contiguous().transpose(-1, -2), output_final_state=True
    )
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)
    mixed = dict(d, g=d["g"].to(torch.bfloat16), beta=d["beta"].to(torch.float16))
    o, h = chunk_kda(**mixed, initial_state=h0.to(torch.bfloat16), output_final_state=True)
    assert o.dtype == torch.float32 and torch.isfinite(o).all() and h.dtype == torch.float32


def test_unknown_dot_precision_setting_is_named():
    with pytest.raises(ValueError, match=r"dot_prec_bf16 = 'fp8': expected one of 'tf32', 'tf32x3', 'ieee'"):
        chunk_kda(**_inputs(dtype=torch.float16), config=KDAConfig(dot_prec_bf16="fp8"))


def test_decay_range_check_can_be_turned_off_and_is_on_by_default():
    """KDAConfig.check_decay_range (on by default) counts g outside [-10, 0] and clamps what is below;
    turned off, the same input is not inspected (the user vouches for the range): nothing clamped,
    so the one entry at -10.5 reaches the kernels as it is (still finite here: one token at -10.5)."""
    assert KDAConfig().check_decay_range is True
    d = _inputs()
    d["g"][0, 5, 1, 3] = -10.5  # one entry of 512, in the middle: the kernel's count must see it
    o, _ = chunk_kda(**d)
    o_clamped, _ = chunk_kda(**dict(d, g=d["g"].clamp(min=-10.0)))
    assert torch.equal(o, o_clamped)
    o_unchecked, _ = chunk_kda(**d, config=KDAConfig(check_decay_range=False))
    assert o_unchecked.shape == d["v"].shape and not torch.equal(o_unchecked, o_clamped)


def test_decay_check_counts_in_the_first_kernel_over_every_chunk_and_channel_block():
    """DecayCheck's count comes from kda_intra_fwd_kernel: one bad entry anywhere (the last chunk,
    the last key channel, a T that is not a multiple of the chunk) is counted once; none, nothing."""
    from repro.kda.chunk import kda_fwd_triton
    from repro.kda.gate import DecayCheck

    d = _inputs(T=70, K=32)
    q, k, v, g, beta = (d[n].contiguous() for n in ("q", "k", "v", "g", "beta"))
    for where, value, want in (((0, 69, 3, 31), 0.25, 1), ((0, 0, 0, 0), float("nan"), 1), (None, 0.0, 0)):
        gg = g.clone()
        if where is not None:
            gg[where] = value
        check = DecayCheck(gg, "t")
        kda_fwd_triton(q, k, v, gg, beta, 0.25, None, False, decay_check=check)
        assert int(check.count[0]) == want, (where, value)
