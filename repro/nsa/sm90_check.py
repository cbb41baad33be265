"""``python -m repro.nsa.sm90_check [bf16|fp16|fp32] [NAME]``: compile every NSA kernel (or those whose case
name contains NAME) offline for sm_90a (no GPU
needed) at the launch shapes ``ops.py`` uses for D = 128, and print shared memory, registers and
spills from Triton's bundled ptxas (``paperclub.triton_compat.ptxas_usage``). A compile error here is one
the GPU would hit too."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from repro.nsa import kernels as kn  # noqa: E402


def cases(dt: str) -> list[tuple]:
    """(name, kernel, pointer types, constexprs, num_warps, num_stages) as ops.py launches them."""
    p, fp32 = f"*{dt}", dt == "fp32"
    grads = {
        "Q": p,
        "K": p,
        "V": p,
        "DO": p,
        "O": p,
        "LSE": "*fp32",
        "DELTA": "*fp32",
        "DQ": p,
        "DK": "*fp32",
        "DV": "*fp32",
    }
    out = []
    for name, win, stride, off in (("compressed", 0, 16, 31), ("window", 512, 1, 0)):
        geo = dict(STRIDE=stride, OFFSET=off, WINDOW=win, D=128, IEEE=fp32)
        fwd = (dict(BM=64, BN=64), 8, 2) if fp32 else (dict(BM=64 if win else 128, BN=64), 4 if win else 8, 3)
        for split in (False, True):  # ops.STRIDED_SPLIT: one masked loop, or edge / interior / diagonal loops
            out.append((f"strided_fwd[{name}{',split' if split else ''}]", kn._strided_fwd_kernel,
                        {"Q": p, "K": p, "V": p, "O": p, "LSE": "*fp32"}, {**geo, **fwd[0], "SPLIT": split},
                        fwd[1], fwd[2]))  # fmt: skip
        for kname, kern in (("dq", kn._strided_bwd_dq_kernel), ("dkdv", kn._strided_bwd_dkdv_kernel)):
            out.append((f"strided_{kname}[{name}]", kern, grads, {**geo, "BM": 64, "BN": 64}, 8, 2))
    for l, d, lp in ((32, 16, 64), (64, 64, 64)):
        out.append((f"scores[l={l},d={d}]", kn._scores_kernel, {"Q": p, "KC": p, "LSE": "*fp32", "SCORES": "*fp32"},
                    dict(STRIDE=d, BLOCK_LEN=l, SELECT_LEN=lp, D=128, BM=64, BJ=16, IEEE=fp32), 8, 2))  # fmt: skip
        out.append((f"scores_masked[l={l},d={d}]", kn._scores_kernel, {"Q": p, "KC": p, "LSE": "*fp32", "SCORES": "*fp32"},
                    dict(STRIDE=d, BLOCK_LEN=l, SELECT_LEN=lp, D=128, BM=64, BJ=16, IEEE=fp32,
                         MASKED=True, N_INITIAL=1, N_LOCAL=2), 8, 2))  # fmt: skip
    out.append(
        ("gate_sum", kn._gate_sum_kernel, {"G": p, "A": p, "B": p, "C": p, "O": p}, dict(D=128, BR=32), 4, 1)
    )
    out.append(("sort_picks", kn._sort_picks_kernel, {"TOP_VAL": "*fp32", "TOP_IDX": "*i64", "BI": "*i32"},
                dict(BR=32, BSEL=16), 4, 1))  # fmt: skip
    # ops.topk_blocks_fused at Ns = 1024 (T = 65536, l' = 64), n = 16: 8 rows of 1024 scores a program
    out.append(("topn_rows[Ns=1024,n=16]", kn._topn_rows_kernel, {"SCORES": "*fp32", "BI": "*i32"},
                dict(BR=8, NS_POW2=1024, BSEL=16), 4, 1))  # fmt: skip
    slc = dict(D=128, BS=64, BG=16, IEEE=fp32)
    out.append(
        (
            "slc_fwd",
            kn._slc_fwd_kernel,
            {"Q": p, "K": p, "V": p, "BI": "*i32", "O": p, "LSE": "*fp32"},
            slc,
            4,
            2,
        )
    )
    out.append(("slc_dq", kn._slc_bwd_dq_kernel, {**grads, "BI": "*i32"}, slc, 4, 2))
    out.append(("slc_dkdv", kn._slc_bwd_dkdv_kernel, {**grads, "KEYS": "*i64"}, {**slc, "CHUNK": 256}, 8, 1))
    # ops.TILED_SLC_BWD: the dQ kernel with delta fused, and the block-major dK/dV kernel at G = 16
    # (BGP = 16) with BQ queries per tile: the launch ops.py uses (BQ BGP = SLC_TILED_ROWS = 64, 8
    # warps, SLC_TILED_STAGES = 2) first, then the alternatives the bench's --slc-bwd rows time
    # (4 warps spill 0.7-1.2 KB at 32-64 rows, 128 rows 0.55 KB at 8 warps: left out)
    out.append(("slc_dq[fuse_delta]", kn._slc_bwd_dq_kernel, {**grads, "BI": "*i32"}, {**slc, "FUSE_DELTA": True},
                4, 2))  # fmt: skip
    tiled_ptrs = {**grads, "QIDX": "*i32", "OFFS": "*i32", "ITEM_SEG": "*i32", "FIRST_ITEM": "*i32"}
    # fp32 tiles are twice the bytes: ops.py takes 16 rows and 1 stage there (64 rows spill 29 KB)
    shapes = ((1, 8, 1),) if fp32 else ((4, 8, 2), (4, 8, 1), (2, 8, 2), (2, 8, 1))
    for bq, warps, stages in shapes:
        tiled = dict(D=128, BS=64, BGP=16, BQ=bq, CHUNK=1024, IEEE=fp32)
        out.append((f"slc_dkdv_tiled[rows={bq * 16},w={warps},st={stages}]", kn._slc_bwd_dkdv_tiled_kernel,
                    tiled_ptrs, tiled, warps, stages))  # fmt: skip
    out.append(("decode_cmp", kn._decode_cmp_kernel,
                {"Q": p, "KC": p, "VC": p, "OC": "*fp32", "LOGITS": "*fp32", "SCORES": "*fp32", "COUNTS": "*i32"},
                dict(STRIDE=16, BLOCK_LEN=32, SELECT_LEN=64, N_INITIAL=1, N_LOCAL=2, D=128, BN=64, BG=16,
                     BJ=64, BC=256, IEEE=fp32), 8, 3))  # fmt: skip
    out.append(("decode_sparse", kn._decode_sparse_kernel,
                {"Q": p, "K": p, "V": p, "KW": p, "VW": p, "TOP_VAL": "*fp32", "TOP_IDX": "*i64", "OC": "*fp32",
                 "GATES": p, "O": p, "BI": "*i32", "COUNTS": "*i32"},
                dict(D=128, BS=64, BN=64, BG=16, BSEL=16, IEEE=fp32), 8, 3))  # fmt: skip
    return out


def signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for a in fn.arg_names:
        if a in constexprs:
            sig[a] = "constexpr"
        elif a in pointers:
            sig[a] = pointers[a]
        elif a in ("scale_log2", "scale"):
            sig[a] = "fp32"
        else:
            sig[a] = "i64" if a == "INVALID" else "i32"
    return sig


def main() -> int:
    from paperclub.triton_compat import ptxas_usage

    dt = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    only = sys.argv[2] if len(sys.argv) > 2 else ""  # compile only the cases whose name contains this
    failed = 0
    for name, fn, pointers, constexprs, warps, stages in cases(dt):
        if only not in name:
            continue
        try:
            src = ASTSource(fn, signature(fn, pointers, constexprs), constexprs=constexprs)
            k = triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)
            )
            print(f"{name:28s} shared {k.metadata.shared:7d} B  {ptxas_usage(k.asm['ptx'])}", flush=True)
        except Exception as exc:
            failed += 1
            print(f"{name:28s} FAILED {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
