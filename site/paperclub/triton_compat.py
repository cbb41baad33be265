"""Work-arounds for Triton's CPU interpreter (``TRITON_INTERPRET=1``), shared by every repro, and
the check whether it is in use. Call :func:`patch_interpreter` once where a package's kernels are
defined; it touches only the interpreter, and only when it is in use.

Two quirks of Triton 3.6's interpreter are mended:

* ``__index__``: a scalar tensor becomes a Python int through ``int(array)`` on a one-element
  array, which numpy >= 2.4 refuses; any loop over a run-time bound then fails. The fix converts
  through the element instead.
* bfloat16: numpy has no bf16, so the interpreter keeps bf16 tensors as their raw 16-bit patterns
  (uint16) and then computes on those patterns as if they were integers. Loads, stores, copies,
  ``tl.where`` and reshapes are exact, but ``tl.dot`` of two bf16 tiles multiplies the bit patterns
  (relative error ~1e9); bf16 arithmetic, comparisons, ``tl.sum`` / ``tl.max`` / ``tl.cumsum`` and
  bf16 atomic adds do the same; int -> bf16 casts store the integer as a bit pattern; fp32 -> bf16
  truncates where the GPU rounds to nearest even (half the values one ulp off); ``tl.full`` of bf16
  fails. Math functions (``tl.exp`` ...) refuse bf16 on the GPU too. The fix decodes bf16 operands to
  their float32 values (``bits << 16``), computes in float32 (a dot accumulates in float32, as the
  tensor cores do) and encodes a bf16 result with round-to-nearest-even. Every other dtype takes
  the interpreter's own path unchanged.

And one cost of it is cut, with the same result: before every call of a jitted function, kernel or
helper, the interpreter points each ``@builtin`` of ``triton.language`` (and of its tensor class,
math module and tensor descriptors) at an interpreter version, finding them by
``inspect.getmembers`` over the whole module each time (about a tenth of a small kernel's time
under the interpreter, which the CPU test suite spends most of its time in). The names of those
builtins are found once per module; every call still patches exactly the members that are builtins
at that moment (:func:`fix_interpreter_patch_speed`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
    "fix_interpreter_index",
    "fix_interpreter_patch_speed",
    "interpreting",
    "patch_interpreter",
]


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``): no GPU, and no
    inline PTX or Gluon there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter() -> None:
    """Install every interpreter fix of this module (the ``__index__`` fix, the bf16 fix and the
    faster builtin patching).

    Idempotent, and a no-op unless ``TRITON_INTERPRET=1``. Call it at import time of a module that
    defines or launches Triton kernels; it patches Triton's interpreter classes, so it covers every
    kernel of the process, whoever calls it.
    """
    if not interpreting():
        return
    fix_interpreter_index()
    _fix_interpreter_bf16()
    fix_interpreter_patch_speed()


def fix_interpreter_index() -> None:
    """Install the ``__index__`` fix once (a no-op unless ``TRITON_INTERPRET=1``).

    Prefer :func:`patch_interpreter`, which installs this and the bf16 fix."""
    if not interpreting():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_paperclub_fixed", False):
        return

    def index(self) -> int:
        data = np.asarray(self.handle.data)
        if data.size != 1:
            raise ValueError(f"a tensor of {data.size} elements used as an integer")
        return int(data.reshape(-1)[0])

    def truth(self) -> bool:
        # the interpreter's own rule: a block counts as true, a scalar by its value
        data = np.asarray(self.handle.data)
        return bool(data.reshape(-1)[0]) if data.size == 1 else True

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", index)
        scope.set_attr(tensor, "__bool__", truth)

    patched._paperclub_fixed = True
    interpreter._patch_lang_tensor = patched


def fix_interpreter_patch_speed() -> None:
    """Replace the interpreter's ``_patch_builtin(pkg, builder, scope)`` (a no-op unless
    ``TRITON_INTERPRET=1``; installed once) by one that lists ``pkg``'s builtin names once and, on
    every call, patches those of them whose current member is a builtin, in the same (sorted) order.

    The same members are patched as by Triton's own version, which patches every member that
    ``inspect.getmembers`` finds to be a builtin at that moment: a module's builtins are fixed once
    it is imported, and a member already patched by an enclosing call (an interpreter lambda, not a
    builtin) is skipped by both. The first listing happens at the first kernel launch, before
    anything is patched."""
    if not interpreting():
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._patch_builtin, "_paperclub_fixed", False):
        return
    is_builtin = tl.core.is_builtin
    patch_attr = interpreter._patch_attr
    names: dict[int, tuple[Any, list[str]]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            known = names[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg) if is_builtin(m)])
        for name in known[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin._paperclub_fixed = True
    interpreter._patch_builtin = patch_builtin


# --- bf16 <-> float32 on raw bit patterns ---------------------------------------------------------


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16 or int16 array, any shape) -> their exact float32 values.

    bf16 is the upper half of a float32, so the value is the pattern shifted into the high bits."""
    bits = np.asarray(bits)
    return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray, round_to_zero: bool = False) -> np.ndarray:
    """float32 values (any shape) -> bf16 bit patterns (uint16), rounded to nearest even as the GPU's
    ``cvt.rn.bf16.f32`` does (or toward zero when ``round_to_zero``). Overflow gives +-inf; NaN
    stays a (quiet) NaN."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if round_to_zero:
        out = bits >> np.uint32(16)
    else:
        # add 0x7FFF plus the lowest kept bit: a tie rounds to the even pattern
        out = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), out)
    return out.astype(np.uint16)


# --- the bf16 fix -------------------------------------------------------------------------------

# Builder methods whose float operands may be bf16: computed on float32 values, and a float result
# encoded back to bf16 (a comparison's boolean result is returned as it is).
_BINARY = (
    "create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem", "create_precise_divf",
    "create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf",
    "create_fcmpOLT", "create_fcmpOGT", "create_fcmpOLE", "create_fcmpOGE", "create_fcmpOEQ", "create_fcmpONE",
    "create_fcmpULT", "create_fcmpUGT", "create_fcmpULE", "create_fcmpUGE", "create_fcmpUEQ", "create_fcmpUNE",
)  # fmt: skip
_UNARY = (
    "create_cos", "create_sin", "create_exp", "create_exp2", "create_log", "create_log2", "create_floor",
    "create_ceil", "create_sqrt", "create_precise_sqrt", "create_rsqrt", "create_erf",
)  # fmt: skip
_TERNARY = ("create_fma", "create_clampf")


def _fix_interpreter_bf16() -> None:
    """Patch Triton's interpreter builder and its reduce / scan ops for bf16 (see the module doc)."""
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    if getattr(builder_cls, "_paperclub_bf16_fixed", False):
        return
    import triton.language as tl

    handle_cls = interpreter.TensorHandle
    bf16 = tl.bfloat16

    def is_bf16(h: Any) -> bool:
        return isinstance(h, handle_cls) and h.dtype == bf16

    def widen(h: Any) -> Any:
        return handle_cls(bf16_bits_to_float32(h.data), tl.float32) if is_bf16(h) else h

    def narrow(h: Any) -> Any:
        # a float32 result of a bf16 operation back to bf16; booleans (comparisons) stay
        if isinstance(h, handle_cls) and h.data.dtype == np.float32:
            return handle_cls(float32_to_bf16_bits(h.data), bf16)
        return h

    def in_float32(original: Callable) -> Callable:
        @functools.wraps(original)
        def patched(self, *args, **kwargs):
            if not any(is_bf16(a) for a in args):
                return original(self, *args, **kwargs)
            return narrow(original(self, *(widen(a) for a in args), **kwargs))

        return patched

    for name in _BINARY + _UNARY + _TERNARY:
        setattr(builder_cls, name, in_float32(getattr(builder_cls, name)))

    original_dot = builder_cls.create_dot

    @functools.wraps(original_dot)
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 x bf16: products of float32 values (exact: 8-bit x 8-bit significands) summed in the
        # float32 accumulator d, as the tensor cores do. Other dtypes: the interpreter's own dot.
        if is_bf16(a) or is_bf16(b):
            a, b = widen(a), widen(b)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot

    original_cast = builder_cls.cast_impl

    @functools.wraps(original_cast)
    def cast_impl(self, src, dst_type):
        # every float / int <-> bf16 conversion (fp_ext, fp_trunc, si/ui_to_fp, fp_to_si/ui) lands here
        dst = dst_type.scalar
        if not is_bf16(src) and dst != bf16:
            return original_cast(self, src, dst_type)
        values = bf16_bits_to_float32(src.data) if is_bf16(src) else src.data
        if dst == bf16:
            return handle_cls(float32_to_bf16_bits(values.astype(np.float32)), bf16)
        return handle_cls(values.astype(interpreter._get_np_dtype(dst)), dst)

    builder_cls.cast_impl = cast_impl

    original_fp_to_fp = builder_cls.create_fp_to_fp

    @functools.wraps(original_fp_to_fp)
    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        # non-default rounding (rtz) between bf16 and fp16/fp32/fp64; fp8 keeps the interpreter's path
        dst = dst_type.scalar
        if dst.is_fp8() or src.dtype.is_fp8() or not (is_bf16(src) or dst == bf16):
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        values = (bf16_bits_to_float32(src.data) if is_bf16(src) else src.data).astype(np.float32)
        if dst == bf16:
            rtz = rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ
            return handle_cls(float32_to_bf16_bits(values, round_to_zero=rtz), bf16)
        return handle_cls(values.astype(interpreter._get_np_dtype(dst)), dst)

    builder_cls.create_fp_to_fp = create_fp_to_fp

    def get_bf16(self, value):
        # tl.full(..., value, tl.bfloat16) asks the builder for a bf16 constant; 3.6 has none
        return handle_cls(float32_to_bf16_bits(np.array([value], dtype=np.float32)), bf16)

    if not hasattr(builder_cls, "get_bf16"):
        builder_cls.get_bf16 = get_bf16

    original_rmw = builder_cls.create_atomic_rmw

    @functools.wraps(original_rmw)
    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        # Triton allows only add on bf16. Programs run one at a time in the interpreter, so a
        # read-add-write per lane, in lane order, is atomic; lanes hitting one address all add.
        if not is_bf16(val) or rmwOp != interpreter._ir.ATOMIC_OP.FADD:
            return original_rmw(self, rmwOp, ptr, val, mask, sem, scope)
        ptrs, vals, masks = np.broadcast_arrays(ptr.data, val.data, mask.data)
        old = np.zeros(ptrs.shape, dtype=np.uint16)
        for i in np.ndindex(ptrs.shape):
            if not masks[i]:
                continue
            p = np.array([ptrs[i]], dtype=np.uint64)
            one = np.ones(1, dtype=bool)
            cur = interpreter._interpreter.load(p, one, np.zeros(1, dtype=np.uint16), np.dtype(np.uint16))
            old[i] = cur[0]
            new = bf16_bits_to_float32(cur) + bf16_bits_to_float32(np.array([vals[i]], dtype=np.uint16))
            interpreter._interpreter.store(p, float32_to_bf16_bits(new), one)
        return handle_cls(old, bf16)

    builder_cls.create_atomic_rmw = create_atomic_rmw

    # tl.sum / tl.max / tl.min / tl.argmax / tl.cumsum / tl.cumprod take numpy shortcuts on the raw
    # data, and tl.reduce / tl.associative_scan with a combine function store its results into an
    # array of the input's raw type (a combine that widens bf16 to fp32, as tl.maximum does, wrote
    # fp32 values there as integers). Run them all on float32 values; encode the outputs of bf16
    # inputs back to bf16 (indices and outputs of other inputs stay as they are).
    def tensor_as(t: Any, data: np.ndarray, dtype: Any) -> Any:
        ty = t.type.with_element_ty(dtype) if t.type.is_block() else dtype
        return tl.core.tensor(handle_cls(data, dtype), ty)

    def back(t: Any) -> Any:
        if isinstance(t, tl.core.tensor) and t.dtype == tl.float32:
            return tensor_as(t, float32_to_bf16_bits(t.handle.data), bf16)
        return t

    def reduce_in_float32(original: Callable) -> Callable:
        @functools.wraps(original)
        def patched(self, input, *args, **kwargs):
            many = isinstance(input, (tuple, list))
            items = list(input) if many else [input]
            was_bf16 = [isinstance(t, tl.core.tensor) and t.dtype == bf16 for t in items]
            if not any(was_bf16):
                return original(self, input, *args, **kwargs)
            wide = [
                tensor_as(t, bf16_bits_to_float32(t.handle.data), tl.float32) if w else t
                for t, w in zip(items, was_bf16, strict=True)
            ]
            out = original(self, type(input)(wide) if many else wide[0], *args, **kwargs)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            # output i belongs to input i (min_max's extra index output has none)
            outs = [back(t) if i < len(was_bf16) and was_bf16[i] else t for i, t in enumerate(outs)]
            return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]

        return patched

    for cls, names in (
        (interpreter.ReduceOps, ("sum", "min_max", "generic_reduce")),
        (interpreter.ScanOps, ("cumsum", "cumprod", "generic_scan")),
    ):
        for name in names:
            setattr(cls, name, reduce_in_float32(getattr(cls, name)))

    builder_cls._paperclub_bf16_fixed = True


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes of the kernel in ``ptx``, from Triton's bundled ``ptxas -v`` for sm_90a
    (empty if this Triton has no bundled ptxas; ``ptxas_error`` if it fails). Registers are the
    launch allocation (warp-specialised kernels then move them with setmaxnreg). Offline: no GPU."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.ptx"
        f.write_text(ptx)
        r = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(f), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if r.returncode != 0:
        return {"ptxas_error": (r.stdout + r.stderr)[-2000:]}
    return ptxas_log_usage(r.stdout + r.stderr)


def ptxas_log_usage(text: str) -> dict:
    """Registers and spill bytes from the text ``ptxas -v`` prints (its first kernel's; keys None where
    the text does not say)."""
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
    }
