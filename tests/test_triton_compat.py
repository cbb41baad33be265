"""paperclub.triton_compat: bf16 under Triton's CPU interpreter, against torch on the same values.

Triton 3.6's interpreter keeps bf16 as raw uint16 bit patterns and multiplies those patterns in
``tl.dot`` (relative error ~4e9). After :func:`patch_interpreter` a bf16 dot must equal an fp32
matmul of the bf16 values (fp32 accumulation, as on the GPU), and the other bf16 operations our
kernels use (casts, arithmetic, comparisons, reductions, atomics) must match torch. fp16 / fp32 /
tf32 dots must be untouched. The kernel tests need the interpreter (the pytest plugin sets it when
there is no GPU) and are skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import rel_error
from paperclub.triton_compat import (
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    interpreting,
    patch_interpreter,
)

needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="needs TRITON_INTERPRET=1 (the CPU interpreter)"
)

if interpreting():
    import triton
    import triton.language as tl

    patch_interpreter()

    @triton.jit
    def _dot_kernel(
        A, B, Acc, C,
        M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
        TRANS_B: tl.constexpr, USE_ACC: tl.constexpr, OUT_BF16: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(A + rm[:, None] * K + rk[None, :])
        if TRANS_B:  # B stored [N, K]: the attention pattern Q K^T
            b = tl.trans(tl.load(B + rn[:, None] * K + rk[None, :]))
        else:
            b = tl.load(B + rk[:, None] * N + rn[None, :])
        if USE_ACC:
            c = tl.dot(a, b, acc=tl.load(Acc + rm[:, None] * N + rn[None, :]), input_precision=PREC)
        else:
            c = tl.dot(a, b, input_precision=PREC)
        if OUT_BF16:
            c = c.to(tl.bfloat16)
        tl.store(C + rm[:, None] * N + rn[None, :], c)

    @triton.jit
    def _bmm_kernel(A, B, C, Z: tl.constexpr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        rz, rm, rk, rn = tl.arange(0, Z), tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(A + rz[:, None, None] * M * K + rm[None, :, None] * K + rk[None, None, :])
        b = tl.load(B + rz[:, None, None] * K * N + rk[None, :, None] * N + rn[None, None, :])
        tl.store(C + rz[:, None, None] * M * N + rm[None, :, None] * N + rn[None, None, :], tl.dot(a, b))

    @triton.jit
    def _elementwise_kernel(X, Y, ADD, MUL, MAX, LT, WHERE, NEG, ABS, SQRT, N: tl.constexpr):
        r = tl.arange(0, N)
        x = tl.load(X + r)
        y = tl.load(Y + r)
        tl.store(ADD + r, x + y)
        tl.store(MUL + r, x * y)
        tl.store(MAX + r, tl.maximum(x, y))
        tl.store(LT + r, (x < y).to(tl.int8))
        tl.store(WHERE + r, tl.where(x < y, x, y))
        tl.store(NEG + r, -x)
        tl.store(ABS + r, tl.abs(x))
        tl.store(SQRT + r, tl.sqrt(tl.abs(x).to(tl.float32)).to(tl.bfloat16))

    @triton.jit
    def _cast_kernel(
        F32, BF, I32, F16, TO_BF, TO_BF_RTZ, TO_F32, FROM_INT, TO_F16, FROM_F16, FULL, N: tl.constexpr
    ):
        r = tl.arange(0, N)
        f = tl.load(F32 + r)
        b = tl.load(BF + r)
        tl.store(TO_BF + r, f.to(tl.bfloat16))
        tl.store(TO_BF_RTZ + r, f.to(tl.bfloat16, fp_downcast_rounding="rtz"))
        tl.store(TO_F32 + r, b.to(tl.float32))
        tl.store(FROM_INT + r, tl.load(I32 + r).to(tl.bfloat16))
        tl.store(TO_F16 + r, b.to(tl.float16))
        tl.store(FROM_F16 + r, tl.load(F16 + r).to(tl.bfloat16))
        tl.store(FULL + r, tl.full([N], 1.7, tl.bfloat16))

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)  # bf16 in, fp32 out: the generic reduce must cope

    @triton.jit
    def _reduce_kernel(
        X, SUM, MAX, MIN, ARGMAX, CUMSUM, TOTAL, RMAX, CUMMAX, M: tl.constexpr, N: tl.constexpr
    ):  # fmt: skip
        rm, rn = tl.arange(0, M), tl.arange(0, N)
        x = tl.load(X + rm[:, None] * N + rn[None, :])
        tl.store(TOTAL, tl.sum(x))
        tl.store(RMAX + rm, tl.reduce(x, 1, _max_combine))
        tl.store(CUMMAX + rm[:, None] * N + rn[None, :], tl.associative_scan(x, 1, _max_combine))
        tl.store(SUM + rm, tl.sum(x, axis=1))
        tl.store(MAX + rm, tl.max(x, axis=1))
        tl.store(MIN + rm, tl.min(x, axis=1))
        tl.store(ARGMAX + rm, tl.argmax(x, axis=1))
        tl.store(CUMSUM + rm[:, None] * N + rn[None, :], tl.cumsum(x, axis=1))

    @triton.jit
    def _exp_kernel(X, Y, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(Y + r, tl.exp(tl.load(X + r)))

    @triton.jit
    def _atomic_kernel(OUT, IDX, VAL, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.atomic_add(OUT + tl.load(IDX + r), tl.load(VAL + r), mask=r < N - 1)


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


# ---- the bit conversions, against torch's own bf16 -----------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_float32_to_bf16_bits_rounds_like_torch(values):
    """Round-to-nearest-even with overflow to inf, bit for bit as torch's fp32 -> bf16."""
    x = torch.tensor(values, dtype=torch.float32)
    ours = float32_to_bf16_bits(x.numpy())
    theirs = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(bf16_bits_to_float32(ours), x.to(torch.bfloat16).float().numpy())


def test_bf16_bit_conversions_special_values():
    """Ties round to even, NaN stays NaN, round-to-zero truncates, and subnormals decode exactly."""
    halfway = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008001], dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(float32_to_bf16_bits(halfway), [0x3F80, 0x3F82, 0x7F80, 0x0001])
    np.testing.assert_array_equal(
        float32_to_bf16_bits(halfway, round_to_zero=True), [0x3F80, 0x3F81, 0x7F7F, 0x0000]
    )
    nan = float32_to_bf16_bits(np.array([np.nan, -np.nan, np.inf, -np.inf], dtype=np.float32))
    assert np.isnan(bf16_bits_to_float32(nan[:2])).all()
    np.testing.assert_array_equal(bf16_bits_to_float32(nan[2:]), [np.inf, -np.inf])
    tiny = torch.tensor([1e-40, -3e-39], dtype=torch.bfloat16)  # subnormal in bf16
    np.testing.assert_array_equal(bf16_bits_to_float32(tiny.view(torch.int16).numpy()), tiny.float().numpy())


# ---- tl.dot ------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("m, k, n", [(16, 16, 16), (16, 32, 16), (32, 16, 64), (64, 32, 16)])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("use_acc", [False, True])
def test_bf16_dot_matches_fp32_matmul(m, k, n, trans_b, use_acc):
    """bf16 x bf16 -> fp32 equals torch's fp32 matmul of the same (bf16-rounded) values (+ acc).

    Products of bf16 values are exact in fp32; only the fp32 summation order differs from torch's,
    so the error is a few fp32 ulps of the sums (tolerance 1e-6; the bug gave ~4e9)."""
    a = _bf16(m, k, seed=m + k)
    b = _bf16(n, k, seed=n) if trans_b else _bf16(k, n, seed=n)
    acc = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    c = torch.empty(m, n)
    _dot_kernel[(1,)](a, b, acc, c, m, k, n, trans_b, use_acc, False, "ieee")
    ref = a.float() @ (b.float().T if trans_b else b.float()) + (acc if use_acc else 0)
    assert rel_error(c, ref) < 1e-6


@needs_interpreter
def test_bf16_batched_dot():
    """A 3-D (batched) bf16 dot, [2, 16, 32] x [2, 32, 16], equals torch's fp32 bmm of the values."""
    a, b = _bf16(2, 16, 32, seed=12), _bf16(2, 32, 16, seed=13)
    c = torch.empty(2, 16, 16)
    _bmm_kernel[(1,)](a, b, c, 2, 16, 32, 16)
    assert rel_error(c, torch.bmm(a.float(), b.float())) < 1e-6


@needs_interpreter
@pytest.mark.parametrize("m, k, n", [(16, 32, 16), (32, 64, 16)])
@pytest.mark.parametrize("trans_b", [False, True])
def test_bf16_dot_cast_to_bf16(m, k, n, trans_b):
    """The fp32 dot cast to bf16 in the kernel: torch's RTNE cast of the fp32 result, up to one bf16
    ulp where the fp32 sums of a different order straddle a rounding boundary."""
    a, b = _bf16(m, k, seed=1), _bf16(n, k, seed=2) if trans_b else _bf16(k, n, seed=2)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    _dot_kernel[(1,)](a, b, c, c, m, k, n, trans_b, False, True, "ieee")
    ref = a.float() @ (b.float().T if trans_b else b.float())
    assert c.dtype == torch.bfloat16
    torch.testing.assert_close(c.float(), ref.bfloat16().float(), rtol=2**-8, atol=1e-6)
    assert (c.float() == ref.bfloat16().float()).float().mean() > 0.95


@needs_interpreter
@pytest.mark.parametrize(
    "dtype, prec", [(torch.float16, "ieee"), (torch.float32, "ieee"), (torch.float32, "tf32")]
)
def test_other_dtype_dots_unchanged(dtype, prec):
    """fp16 and fp32 (ieee or tf32 requested) dots still take the interpreter's own path: exact fp32
    arithmetic on the values (the interpreter has no tf32 rounding, before or after the patch)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g).to(dtype), torch.randn(32, 16, generator=g).to(dtype)
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, c, 16, 32, 16, False, False, False, prec)
    assert rel_error(c, a.float() @ b.float()) < 1e-6


# ---- the other bf16 operations ------------------------------------------------------------------


@needs_interpreter
def test_bf16_elementwise_match_torch():
    """Arithmetic rounds once to bf16 (as torch's bf16 ops do), comparisons and max order the values
    (not the bit patterns: negative numbers), where/neg/abs are exact."""
    n = 64
    x, y = _bf16(n, seed=5, scale=3.0), _bf16(n, seed=6, scale=3.0)
    outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(3)]
    lt = torch.empty(n, dtype=torch.int8)
    where, neg, absx, sqrt = [torch.empty(n, dtype=torch.bfloat16) for _ in range(4)]
    _elementwise_kernel[(1,)](x, y, *outs, lt, where, neg, absx, sqrt, n)
    torch.testing.assert_close(outs[0], x + y, rtol=0, atol=0)
    torch.testing.assert_close(outs[1], x * y, rtol=0, atol=0)
    torch.testing.assert_close(outs[2], torch.maximum(x, y), rtol=0, atol=0)
    torch.testing.assert_close(lt, (x < y).to(torch.int8), rtol=0, atol=0)
    torch.testing.assert_close(where, torch.minimum(x, y), rtol=0, atol=0)
    torch.testing.assert_close(neg, -x, rtol=0, atol=0)
    torch.testing.assert_close(absx, x.abs(), rtol=0, atol=0)
    torch.testing.assert_close(sqrt, x.float().abs().sqrt().bfloat16(), rtol=0, atol=0)


@needs_interpreter
def test_bf16_casts_match_torch():
    """fp32 -> bf16 rounds to nearest even (the interpreter truncated), or toward zero on request;
    bf16 -> fp32 / fp16 and int / fp16 -> bf16 are torch's conversions; tl.full makes a bf16 constant."""
    n = 256
    g = torch.Generator().manual_seed(7)
    f = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    b = _bf16(n, seed=8, scale=100.0)
    i = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32)
    h = (torch.randn(n, generator=g) * 10).half()
    to_bf, to_bf_rtz, from_int, from_f16, full = [torch.empty(n, dtype=torch.bfloat16) for _ in range(5)]
    to_f32, to_f16 = torch.empty(n), torch.empty(n, dtype=torch.float16)
    _cast_kernel[(1,)](f, b, i, h, to_bf, to_bf_rtz, to_f32, from_int, to_f16, from_f16, full, n)
    torch.testing.assert_close(to_bf, f.bfloat16(), rtol=0, atol=0)
    rtz = (f.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)  # drop the low 16 bits
    torch.testing.assert_close(to_bf_rtz, rtz, rtol=0, atol=0)
    torch.testing.assert_close(to_f32, b.float(), rtol=0, atol=0)
    torch.testing.assert_close(from_int, i.float().bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(to_f16, b.half(), rtol=0, atol=0)
    torch.testing.assert_close(from_f16, h.float().bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(full, torch.full((n,), 1.7).bfloat16(), rtol=0, atol=0)


@needs_interpreter
def test_bf16_reductions_match_torch():
    """tl.sum / tl.cumsum of bf16 add the values (in fp32, rounded once); max / min / argmax order
    the values, not the bit patterns; tl.reduce / tl.associative_scan with a combine function that
    widens to fp32 give the bf16 of its result."""
    m, n = 8, 32
    x = _bf16(m, n, seed=9, scale=2.0)
    s, mx, mn = [torch.empty(m, dtype=torch.bfloat16) for _ in range(3)]
    am = torch.empty(m, dtype=torch.int32)
    cs, cummax = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
    total, rmax = torch.empty(1, dtype=torch.bfloat16), torch.empty(m, dtype=torch.bfloat16)
    _reduce_kernel[(1,)](x, s, mx, mn, am, cs, total, rmax, cummax, m, n)
    torch.testing.assert_close(total, x.float().sum().reshape(1).bfloat16(), rtol=2**-8, atol=1e-2)
    torch.testing.assert_close(rmax, x.max(1).values, rtol=0, atol=0)
    torch.testing.assert_close(cummax, x.cummax(1).values, rtol=0, atol=0)
    torch.testing.assert_close(s, x.float().sum(1).bfloat16(), rtol=2**-8, atol=1e-2)
    torch.testing.assert_close(mx, x.max(1).values, rtol=0, atol=0)
    torch.testing.assert_close(mn, x.min(1).values, rtol=0, atol=0)
    torch.testing.assert_close(am, x.float().argmax(1).int(), rtol=0, atol=0)
    torch.testing.assert_close(cs, x.float().cumsum(1).bfloat16(), rtol=2**-8, atol=1e-2)


@needs_interpreter
def test_bf16_math_is_refused_as_on_the_gpu():
    """tl.exp & co. accept fp32 / fp64 only (libdevice's rule): bf16 is an error, in the interpreter as
    on the GPU, never a silent result; kernels widen first (``x.to(tl.float32)``)."""
    x = _bf16(16, seed=11)
    with pytest.raises(Exception, match=r"Expected dtype \['fp32', 'fp64'\] but got bf16"):
        _exp_kernel[(1,)](x, torch.empty_like(x), 16)


@needs_interpreter
def test_bf16_atomic_add_adds_values():
    """bf16 atomic adds add values, every lane counted when several hit one address; masked lanes
    add nothing."""
    n = 16
    idx = torch.tensor([0, 1, 2, 3] * 4, dtype=torch.int32)
    val = _bf16(n, seed=10)
    out = torch.zeros(4, dtype=torch.bfloat16)
    _atomic_kernel[(1,)](out, idx, val, n)
    ref = torch.zeros(4).index_add_(0, idx[: n - 1].long(), val[: n - 1].float())
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-2)


# ---- installation ------------------------------------------------------------------------------


def _run(code: str, interpret: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_patch_is_a_no_op_without_the_interpreter():
    """Without TRITON_INTERPRET=1 nothing is patched, and triton is not even imported."""
    code = (
        "import sys\n"
        "from paperclub.triton_compat import patch_interpreter, fix_interpreter_index\n"
        "patch_interpreter(); fix_interpreter_index()\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "from triton.runtime import interpreter as i\n"
        "assert not hasattr(i.InterpreterBuilder, '_paperclub_bf16_fixed')\n"
        "assert not hasattr(i.InterpreterBuilder.create_dot, '__wrapped__')\n"
        "assert not getattr(i._patch_lang_tensor, '_paperclub_fixed', False)\n"
    )
    res = _run(code, "0")
    assert res.returncode == 0, res.stderr


def test_patch_is_idempotent_under_the_interpreter():
    """A second call (another package importing it) wraps nothing twice."""
    code = (
        "from paperclub.triton_compat import patch_interpreter\n"
        "from triton.runtime import interpreter as i\n"
        "original = i.InterpreterBuilder.create_dot\n"
        "patch_interpreter()\n"
        "first = (i.InterpreterBuilder.create_dot, i.InterpreterBuilder.create_fadd, i.ReduceOps.sum,\n"
        "         i._patch_lang_tensor)\n"
        "patch_interpreter()\n"
        "assert first == (i.InterpreterBuilder.create_dot, i.InterpreterBuilder.create_fadd,\n"
        "                 i.ReduceOps.sum, i._patch_lang_tensor)\n"
        "assert i.InterpreterBuilder.create_dot.__wrapped__ is original\n"
    )
    res = _run(code, "1")
    assert res.returncode == 0, res.stderr


@needs_interpreter
def test_faster_builtin_patching_patches_what_triton_would():
    """fix_interpreter_patch_speed's _patch_builtin patches, in order, exactly the members Triton's
    own version would (every member inspect.getmembers finds to be a builtin), on each of the
    modules and classes the interpreter patches, and nothing more while an enclosing patch is in
    place (a nested jitted call)."""
    import inspect

    from triton.runtime import interpreter

    assert getattr(interpreter._patch_builtin, "_paperclub_fixed", False)
    for pkg in (tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        expected = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        assert expected, f"no builtins found in {pkg}"
        outer = interpreter._LangPatchScope()
        try:
            interpreter._patch_builtin(pkg, interpreter.interpreter_builder, outer)
            assert [name for _, name, _ in outer._changes] == expected, pkg
            nested = interpreter._LangPatchScope()
            interpreter._patch_builtin(pkg, interpreter.interpreter_builder, nested)
            assert nested._changes == [], pkg
        finally:
            outer.restore()
        assert [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)] == expected
