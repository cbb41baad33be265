"""``python -m repro.nsa.lab.sm90_check [bf16|fp16|fp32] [NAME]``: every kernel the NSA fast path launches at
the paper's attention shape (B = 1, T = 4096, 64 query / 4 KV heads, D = 128), compiled offline for
sm_90a (no GPU), with shared memory, registers and spills from Triton's bundled ptxas.

The launches are the fast path's own (``launches.scenarios`` at that shape: the layer forward +
backward with the default switches and with each non-default one, the bench's cmp+slc setting, the
strided sweep's tiles, the split forced either way, the top-n fallback, the fused gate, decode at an
8k cache), each kernel once (``NAME``: only the kernels whose name contains it). A compile error here
is one the GPU would hit too. Rows from ``paperclub.lab.compile_report``.

Compiled as launched, with Triton's argument specialisation (16-byte aligned pointers, sizes and
strides divisible by 16): the check before issue #40 compiled each kernel from a hand-written
signature without it, so without aligned vector loads, and reported more registers and spills (the
window's forward 284 bytes per thread, the block-major dK/dV kernel 196, the query-major one 578,
where this check finds none at the paper's shape in bf16).
"""

from __future__ import annotations

import sys

from repro.nsa.lab import launches as ln  # first: it removes TRITON_INTERPRET before Triton loads

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def rows(dtype: str = "bf16", only: str = "") -> list[dict]:
    """One compile report per distinct kernel launch (kernel, constexprs, warps, stages)."""
    import torch

    from paperclub.lab import compile_report

    dt = getattr(torch, DTYPES[dtype])
    shape = ln.Shape(1, 4096, 64, 4, 128, dt)
    api = ln.Api()
    seen, out = set(), []
    for launch in ln.record(api, ln.scenarios(api, [shape], [(4, 8192, dt, 64, 4, 128)])):
        for c in ln.compile_launch(launch):
            key = (c["kernel"], repr(c["constexprs"]), repr(c["options"]))
            if key in seen or only not in c["kernel"]:
                continue
            seen.add(key)
            out.append(compile_report(c["compiled"], scenario=launch.scenario, constexprs=c["constexprs"],
                                      options=c["options"]))  # fmt: skip
    return out


def main() -> int:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    if dtype not in DTYPES:
        raise SystemExit(f"sm90_check: dtype {dtype!r}, expected one of {list(DTYPES)}")
    failed = 0
    for r in rows(dtype, only):
        consts = ",".join(f"{k}={v}" for k, v in r["constexprs"].items() if k not in ("D", "IEEE"))
        opts = ",".join(f"{k[4:] if k.startswith('num_') else k}={v}" for k, v in r["options"].items())
        if "ptxas_error" in r:
            failed += 1
        print(f"{r['kernel']:28s} {consts} {opts}: shared {r['shared']:6d} B, registers {r.get('registers')}, "
              f"spills {r.get('spill_stores')} B" + (f"  PTXAS ERROR {r['ptxas_error'][-300:]}" if "ptxas_error" in r else ""),
              flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
