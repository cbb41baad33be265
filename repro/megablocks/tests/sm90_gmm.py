"""``python -m repro.megablocks.tests.sm90_gmm ['<cases as JSON>']``: the grouped GEMM's forward / data-gradient kernels
(the pointer one, _gmm_kernel, and the TMA one, _gmm_tma_kernel, both weight layouts) and its weight
gradient's (_gmm_wgrad_kernel, _gmm_wgrad_tma_kernel: kernels "wgrad_pointer", "wgrad_tma") compiled
offline for sm_90a (no GPU: Triton's compiler and its bundled ptxas), at the bf16 tile settings of
GPU_CONFIG and of the bench's candidate. Prints one row per kernel and setting (shared memory,
ptxas registers and spills via ``paperclub.triton_compat.ptxas_usage``, wgmma and TMA instructions in
the PTX) and, last, all rows as JSON. Arguments are specialised as a launch at the 8e-top2 shape
would (pointers, N, K and the row stride divisible by 16, the unit stride a constant)."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

from paperclub.lab import compile_sm90  # noqa: E402
from repro.megablocks import kernels as kn  # noqa: E402

#: (name, BM, BN, BK, num_warps, num_stages): the earlier defaults (gmm_n 128) and GPU_CONFIG's gmm_n = 256
SETTINGS = [("default", 128, 128, 64, 8, 3), ("gmm_n=256", 128, 256, 64, 8, 3)]
DIVISIBLE = {"X", "W", "Y", "tile_group", "tile_row", "ends", "N", "K", "stride_xm", "stride_wg",
             "stride_wk", "stride_ym"}  # fmt: skip
WGRAD_DIVISIBLE = {
    "X",
    "G",
    "DW",
    "starts",
    "ends",
    "K",
    "N",
    "stride_xm",
    "stride_gm",
    "stride_dg",
    "stride_dk",
}


def compile_gmm(tma: bool, w_t: bool, bm: int, bn: int, bk: int, warps: int, stages: int, dt: str = "bf16"):
    """One kernel compiled for sm_90a; returns Triton's CompiledKernel. The pointer kernel's w_t
    means w's K dimension is the contiguous one (its unit stride specialised as at a launch)."""
    fn = kn._gmm_tma_kernel if tma else kn._gmm_kernel
    if tma:
        w_block = [1, bn, bk] if w_t else [1, bk, bn]
        constexprs = dict(BM=bm, BN=bn, BK=bk, W_T=w_t, GROUP_M=8, stride_yn=1)
        types = {"X": f"tensordesc<{dt}[{bm}, {bk}]>", "W": f"tensordesc<{dt}{w_block}>"}
    else:
        unit = "stride_wk" if w_t else "stride_wn"
        constexprs = dict(BM=bm, BN=bn, BK=bk, IEEE=False, GROUP_M=8, stride_xk=1, stride_yn=1, **{unit: 1})
        types = {"X": f"*{dt}", "W": f"*{dt}"}
    types.update(Y=f"*{dt}", tile_group="*i32", tile_row="*i32", ends="*i32")
    divisible = [a for a in fn.arg_names if a in DIVISIBLE]
    return compile_sm90(
        fn, constexprs=constexprs, types=types, num_warps=warps, num_stages=stages, divisible=divisible
    )


def compile_wgrad(tma: bool, bm: int, bn: int, bk: int, warps: int, stages: int, dt: str = "bf16"):
    """The weight gradient's kernel compiled for sm_90a at a setting of SETTINGS: its DW tile is
    [setting's BM, BN] (the kernel's BK x BN) and it reduces the setting's BK rows per step (the
    kernel's BM), as _gmm_wgrad launches it (BK 128, _k_step(128) = 64 rows)."""
    fn = kn._gmm_wgrad_tma_kernel if tma else kn._gmm_wgrad_kernel
    step, tile = bk, bm
    if tma:
        constexprs = dict(BM=step, BN=bn, BK=tile, GROUP_M=8, stride_dn=1)
        types = {"X": f"tensordesc<{dt}[{step}, {tile}]>", "G": f"tensordesc<{dt}[{step}, {bn}]>"}
    else:
        constexprs = dict(
            BM=step, BN=bn, BK=tile, IEEE=False, GROUP_M=8, stride_xk=1, stride_gn=1, stride_dn=1
        )
        types = {"X": f"*{dt}", "G": f"*{dt}"}
    types.update(DW=f"*{dt}", starts="*i32", ends="*i32")
    divisible = [a for a in fn.arg_names if a in WGRAD_DIVISIBLE]
    return compile_sm90(
        fn, constexprs=constexprs, types=types, num_warps=warps, num_stages=stages, divisible=divisible
    )


def report(cases: list | None = None) -> list[dict]:
    """One row per case ``[setting name, kernel, w_t]``, kernel "tma", "pointer", "wgrad_tma" or
    "wgrad_pointer" (w_t ignored for the weight gradient, whose operands are row-major in both of
    _GMM.backward's call forms); default: all of them."""
    from paperclub.triton_compat import ptxas_usage

    settings = {name: rest for name, *rest in SETTINGS}
    if cases is None:
        cases = [[name, k, w_t] for name in settings for k in ("pointer", "tma") for w_t in (False, True)]
        cases += [[name, k, False] for name in settings for k in ("wgrad_pointer", "wgrad_tma")]
    rows = []
    for name, kernel, w_t in cases:
        wgrad = kernel.startswith("wgrad_")
        row = dict(kernel=kernel, w="-" if wgrad else "[G,N,K] (w_t)" if w_t else "[G,K,N]", setting=name)
        try:
            if wgrad:
                c = compile_wgrad(kernel == "wgrad_tma", *settings[name])
            else:
                c = compile_gmm(kernel == "tma", w_t, *settings[name])
            ptx = c.asm["ptx"]
            row.update(
                shared=c.metadata.shared,
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                **ptxas_usage(ptx),
            )
        except Exception as exc:  # reported, the test decides
            row["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    # python -m repro.megablocks.tests.sm90_gmm ['<cases as JSON>']: the rows, then all as JSON
    print(json.dumps(report(json.loads(sys.argv[1]) if len(sys.argv) > 1 else None)))
