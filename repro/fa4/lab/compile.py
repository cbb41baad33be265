"""Offline sm_90a compiles of every fa4 kernel (no GPU): the compile driver behind the compile reports,
the CPU tests of the Gluon kernels and the fingerprint comparison (``lab/fingerprints.py``).

A case is a dict naming the kernel and its launch, as the launchers in the fast path launch it::

    {"kernel": "fwd", "d": 128, "dtype": "bf16", "causal": False, "block_m": 128, "block_n": 128,
     "num_warps": 8, "num_stages": 3, "lazy_rescale": True, "soft_exp": 0, "tma": False, ...}
    {"kernel": "bwd_dkdv" | "bwd_dq", "d", "dtype", "causal", "block_m", "block_n", "num_warps", "num_stages"}
    {"kernel": "preprocess", "d", "dtype", "block_m"}
    {"kernel": "fused", "d", "dtype", "causal", "config": <a FUSED_CONFIGS name>}   (or "launch": the tuple)
    {"kernel": "gluon_fwd", "d", "dtype", "causal", "lazy_rescale", "num_consumers", "pingpong_sync",
     "store_tma", "block_n", "num_stages", "load_regs", "consumer_regs"}   (launcher defaults where left out)
    {"kernel": "gluon_bwd", "d", "dtype", "causal", "dq_tma", "block_m", "num_stages"}

The Triton kernels also take ``"d_v"`` (v's head size, default ``d``) and ``"window": True`` (the
sliding-window entry point of the same kernel: ``_fwd_window_kernel``, ``_bwd_dkdv_window_kernel``,
``_bwd_dq_window_kernel``, ``_bwd_fused_window_kernel``; ``causal`` does not apply there). Constexprs
a kernel does not declare (``D_V`` before issue #42) are left out, so that the same case compiles the
code before a change and after it.

:func:`report` compiles each case with :func:`paperclub.lab.compile_sm90` and returns
:func:`paperclub.lab.compile_report`'s row (the case's fields first; ``error`` where it does not
compile); :func:`checks` the same without the SASS fingerprint (what the CPU tests read). It must
run without ``TRITON_INTERPRET``: from a test or a CPU shell use
``paperclub.lab.offline("repro.fa4.lab.compile:report", cases)``, or
``python -m repro.fa4.lab.compile ['<cases JSON>']`` (no cases: every kernel at the fast path's
launches, ``lab/fingerprints.py``'s CASES).

The kernels are found by name in the modules of issue #40's layout (``triton_fwd``, ``triton_bwd``,
``triton_bwd_fused``, ``gluon_fwd``, ``gluon_bwd``) and, failing that, in the modules before it
(``kernels``, ``bwd_fused``), so that ``lab/fingerprints.py`` can compile main's code before the move
and this checkout's after it with the same cases.
"""

from __future__ import annotations

import importlib
import json
import sys

from paperclub.lab import compile_sm90, report_or_error

#: kernel -> (attribute, modules to look in, first found wins: issue #40's layout, then the one before)
KERNELS = {
    "fwd_window": ("_fwd_window_kernel", ("repro.fa4.triton_fwd",)),
    "bwd_dkdv_window": ("_bwd_dkdv_window_kernel", ("repro.fa4.triton_bwd",)),
    "bwd_dq_window": ("_bwd_dq_window_kernel", ("repro.fa4.triton_bwd",)),
    "fused_window": ("_bwd_fused_window_kernel", ("repro.fa4.triton_bwd_fused",)),
    "fwd": ("_fwd_kernel", ("repro.fa4.triton_fwd", "repro.fa4.kernels")),
    "bwd_dkdv": ("_bwd_dkdv_kernel", ("repro.fa4.triton_bwd", "repro.fa4.kernels")),
    "bwd_dq": ("_bwd_dq_kernel", ("repro.fa4.triton_bwd", "repro.fa4.kernels")),
    "preprocess": ("_bwd_preprocess_kernel", ("repro.fa4.triton_bwd_fused", "repro.fa4.bwd_fused")),
    "fused": ("_bwd_fused_kernel", ("repro.fa4.triton_bwd_fused", "repro.fa4.bwd_fused")),
    "gluon_fwd": ("_gluon_fwd_kernel", ("repro.fa4.gluon_fwd",)),
    "gluon_bwd": ("_gluon_bwd_kernel", ("repro.fa4.gluon_bwd",)),
}


def _module(names: tuple[str, ...]):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    raise ModuleNotFoundError(f"none of {names}")


def _kernel(kind: str):
    attr, modules = KERNELS[kind]
    return getattr(_module(modules), attr), _module(modules)


def _pointers(names, dtype: str) -> dict[str, str]:
    return {n: f"*{dtype}" for n in names}


def _strides(fn) -> list[str]:
    return [a for a in fn.arg_names if a.startswith("stride_")]


#: constexprs that only some versions or entry points of a kernel declare: passed where declared
_OPTIONAL = ("D_V", "CAUSAL", "PINGPONG", "PERSISTENT")


def _declared(fn, cx: dict) -> dict:
    return {k: v for k, v in cx.items() if k not in _OPTIONAL or k in fn.arg_names}


def compile_case(case: dict):
    """The kernel of ``case`` compiled for sm_90a (Triton's CompiledKernel)."""
    kind, d, dt = case["kernel"], case.get("d", 128), case.get("dtype", "bf16")
    d_v = case.get("d_v", d)
    causal = bool(case.get("causal", False))
    if case.get("window") and kind in ("fwd", "bwd_dkdv", "bwd_dq", "fused"):
        kind = f"{kind}_window"
    fn, mod = _kernel(kind)
    window = kind.endswith("_window")
    if window:
        kind = kind.removesuffix("_window")
    if kind == "fwd":
        bm, bn = case.get("block_m", 128), case.get("block_n", 128)
        tma = bool(case.get("tma", False))
        kv = f"tensordesc<{dt}[{bn}, {d}]>" if tma else f"*{dt}"
        types = {
            "Q": f"*{dt}",
            "K": kv,
            "V": f"tensordesc<{dt}[{bn}, {d_v}]>" if tma else f"*{dt}",
            "O": f"*{dt}",
            "LSE": "*fp32",
            "COUNTS": "*i32",
            "qk_scale": "fp32",
        }
        cx = dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, LAZY_RESCALE=bool(case.get("lazy_rescale", True)),
                  RESCALE_TAU=float(case.get("rescale_threshold", 8.0)), SOFT_EXP=int(case.get("soft_exp", 0)),
                  PINGPONG=bool(case.get("pingpong", False)), WARP_SPEC=bool(case.get("warp_specialize", False)),
                  PERSISTENT=bool(case.get("persistent", False)), COUNT=bool(case.get("count", False)),
                  USE_TMA=tma, D_V=d_v)  # fmt: skip
        cx = _declared(fn, cx)
        divisible = ["Q", "O", "LSE", "COUNTS", *([] if tma else ["K", "V"]), *_strides(fn)]
        return compile_sm90(fn, constexprs=cx, types=types, divisible=divisible,
                            num_warps=case.get("num_warps", 8), num_stages=case.get("num_stages", 3))  # fmt: skip
    if kind in ("bwd_dkdv", "bwd_dq"):
        bm, bn = case.get("block_m", 64), case.get("block_n", 64)
        if kind == "bwd_dq":  # the launcher transposes the tile: many query rows, fewer keys per step
            bm, bn = bn, bm
        ptrs = ("Q", "K", "V", "DO", "DK", "DV", "DQ")
        types = {**_pointers([p for p in ptrs if p in fn.arg_names], dt), "LSE": "*fp32", "DELTA": "*fp32",
                 "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
        cx = _declared(fn, dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, D_V=d_v))
        divisible = [a for a in fn.arg_names if a in types and types[a].startswith("*")] + _strides(fn)
        return compile_sm90(fn, constexprs=cx, types=types, divisible=divisible,
                            num_warps=case.get("num_warps", 4), num_stages=case.get("num_stages", 2))  # fmt: skip
    if kind == "preprocess":
        types = {"O": f"*{dt}", "DO": f"*{dt}", "DELTA": "*fp32", "DQACC": "*fp32"}
        cx = dict(D=d, BLOCK_M=case.get("block_m", 64))
        return compile_sm90(fn, constexprs=cx, types=types, divisible=[*types, *_strides(fn)], num_warps=4)
    if kind == "fused":
        launch = case.get("launch")  # (block_m, block_n, warps, stages, tma, dq_tma), or a config's name
        bm, bn, nw, ns, tma, dq_tma = launch if launch is not None else mod.FUSED_CONFIGS[case["config"]]
        qdesc = f"tensordesc<{dt}[{bm}, {d}]>" if tma else f"*{dt}"
        dodesc = f"tensordesc<{dt}[{bm}, {d_v}]>" if tma else f"*{dt}"
        types = {"Q": qdesc, "K": f"*{dt}", "V": f"*{dt}", "DO": dodesc, "LSE": "*fp32", "DELTA": "*fp32",
                 "DQACC": f"tensordesc<fp32[{bm}, {d}]>" if dq_tma else "*fp32", "DK": f"*{dt}", "DV": f"*{dt}",
                 "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
        cx = _declared(
            fn, dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, USE_TMA=tma, DQ_TMA=dq_tma, D_V=d_v)
        )
        divisible = [a for a, t in types.items() if t.startswith("*")] + _strides(fn)
        return compile_sm90(fn, constexprs=cx, types=types, divisible=divisible, num_warps=nw, num_stages=ns)
    if kind == "gluon_fwd":
        return _gluon_fwd(fn, mod, case, d, dt, causal)
    if kind == "gluon_bwd":
        return _gluon_bwd(fn, mod, case, d, dt, causal)
    raise ValueError(f"compile case: unknown kernel {kind!r}, expected one of {list(KERNELS)}")


def _gluon_fwd(fn, mod, case, d, dt, causal):
    from triton.experimental.gluon import language as gl

    cx = mod._constexprs(
        d, causal, bool(case.get("lazy_rescale", False)), float(case.get("rescale_threshold", 8.0)),
        int(case.get("num_consumers", mod.NUM_CONSUMERS)), bool(case.get("pingpong_sync", True)),
        case.get("block_n"), case.get("num_stages"), bool(case.get("store_tma", False)),
        int(case.get("load_regs", mod.LOAD_REGS)), int(case.get("consumer_regs", mod.CONSUMER_REGS)),
    )  # fmt: skip
    bm, bn = cx["BLOCK_M"], cx["BLOCK_N"]
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dt]
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, d], gdt)
    signature = {
        "q_desc": f"tensordesc<{dt}[{bm}, {d}],{q_layout!r}>",
        "k_desc": f"tensordesc<{dt}[{bn}, {d}],{kv_layout!r}>",
        "v_desc": f"tensordesc<{dt}[{bn}, {d}],{kv_layout!r}>",
        "O": f"*{dt}",
        "o_desc": f"tensordesc<{dt}[{bm}, {d}],{q_layout!r}>",
        "LSE": "*fp32",
        "H": "i32", "GROUP": "i32", "S_Q": "i32", "S_K": "i32", "qk_scale": "fp32", "N_M_BLOCKS": "i32",
        **{name: "constexpr" for name in cx},
    }  # fmt: skip
    return compile_sm90(fn, constexprs=cx, signature=signature, num_warps=4)


#: constexprs of the Gluon backward before issue #40 (the fault bisect's SKIP, the deferred dQ), at
#: the values its launcher used: passed only where the kernel still declares them
_LEGACY_GLUON_BWD = {"SKIP": 0, "DQ_DEFER": False}


def _gluon_bwd(fn, mod, case, d, dt, causal):
    from triton.experimental.gluon import language as gl

    dq_tma = bool(case.get("dq_tma", True))
    cx = mod._constexprs(d, causal, case.get("block_m"), case.get("num_stages"), dq_tma=dq_tma)
    if hasattr(mod, "kernel_for"):  # D = 256 has a kernel of its own (issue #42)
        fn = mod.kernel_for(d)
    cx = {**cx, **{k: v for k, v in _LEGACY_GLUON_BWD.items() if k in fn.arg_names and k not in cx}}
    bm = cx["BLOCK_M"]
    qo_layout, kv_layout, vec_layout = mod._layouts(d, bm, {"bf16": gl.bfloat16, "fp16": gl.float16}[dt])
    n = cx.get("BLOCK_N", mod.BLOCK_N)
    signature = {
        "q_desc": f"tensordesc<{dt}[{bm}, {d}],{qo_layout!r}>",
        "do_desc": f"tensordesc<{dt}[{bm}, {d}],{qo_layout!r}>",
        "lse_desc": f"tensordesc<fp32[{bm}],{vec_layout!r}>",
        "delta_desc": f"tensordesc<fp32[{bm}],{vec_layout!r}>",
        "k_desc": f"tensordesc<{dt}[{n}, {d}],{kv_layout!r}>",
        "v_desc": f"tensordesc<{dt}[{n}, {d}],{kv_layout!r}>",
        "DQACC": f"tensordesc<fp32[{bm}, {d // 2}],{mod._dq_layout(d, bm)!r}>" if dq_tma else "*fp32",
        "DK": f"*{dt}", "DV": f"*{dt}",
        "H": "i32", "H_KV": "i32", "GROUP": "i32", "S_Q": "i32", "S_K": "i32", "S_STAT": "i32",
        "qk_scale": "fp32", "sm_scale": "fp32",
        **{name: "constexpr" for name in cx},
    }  # fmt: skip
    return compile_sm90(fn, constexprs=cx, signature=signature, num_warps=4)


def report(cases: list[dict]) -> list[dict]:
    """One row per case (:func:`paperclub.lab.compile_report`; ``error`` where it does not compile)."""
    return [report_or_error(lambda c=c: compile_case(c), **c) for c in cases]


def checks(cases: list[dict]) -> list[dict]:
    """:func:`report` without the SASS fingerprint (one disassembly per kernel saved): what the CPU
    tests read (shared memory, registers, spills, instruction counts)."""
    return [report_or_error(lambda c=c: compile_case(c), sass=False, **c) for c in cases]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(report(json.loads(sys.argv[1]))))
    else:
        from repro.fa4.lab.fingerprints import CASES

        print(json.dumps(report(CASES)))
