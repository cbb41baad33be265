"""``python -m repro.nsa.lab.sm90_check [bf16|fp16|fp32] [NAME] [--heads 192,128 | --heads 128]``:
every kernel the NSA fast path launches at the paper's attention shape (B = 1, T = 4096, 64 query / 4
KV heads, bf16), compiled offline for sm_90a (no GPU), with shared memory, registers and spills from
Triton's bundled ptxas. ``--heads``: the query/key and value head sizes, the paper's Dk = 192, Dv = 128
(yuan2025nsa §4.1; the default) or one size for both (128: the bench's D = 128 rows).

The launches are the fast path's own: at D = 128, ``launches.scenarios`` at that shape (the layer
forward + backward with the default switches and with each non-default one, the bench's cmp+slc
setting, the strided sweep's tiles, the split forced either way, the top-n fallback, the fused gate,
decode at an 8k cache); at 192 / 128, ``launches.head_size_scenarios`` (the layer with the default
switches, with the block-major backward's other launch shapes and with the strided backward split, the
cmp+slc setting, decode at an 8k cache); each kernel once (``NAME``: only the kernels whose name
contains it). A compile error here is one the GPU would hit too. Rows from ``paperclub.lab.compile_report``.

Compiled as launched, with Triton's argument specialisation (16-byte aligned pointers, sizes and
strides divisible by 16): the check before issue #40 compiled each kernel from a hand-written
signature without it, so without aligned vector loads, and reported more registers and spills (the
window's forward 284 bytes per thread, the block-major dK/dV kernel 196, the query-major one 578,
where this check finds none at D = 128 in bf16).
"""

from __future__ import annotations

import argparse

from repro.nsa.lab import launches as ln  # first: it removes TRITON_INTERPRET before Triton loads

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def rows(dtype: str = "bf16", only: str = "", dk: int = 192, dv: int = 128) -> list[dict]:
    """One compile report per distinct kernel launch (kernel, constexprs, warps, stages)."""
    import torch

    from paperclub.lab import compile_report

    dt = getattr(torch, DTYPES[dtype])
    api = ln.Api()
    if dk == dv:
        shape = ln.Shape(1, 4096, 64, 4, dk, dt)
        scen = ln.scenarios(api, [shape], [(4, 8192, dt, 64, 4, dk)])
    else:
        shape = ln.Shape(1, 4096, 64, 4, dk, dt, dv=dv)
        scen = ln.head_size_scenarios(api, [shape], [(4, 8192, dt, 64, 4, dk, dv)])
    seen, out = set(), []
    for launch in ln.record(api, scen):
        for c in ln.compile_launch(launch):
            key = (c["kernel"], repr(c["constexprs"]), repr(c["options"]))
            if key in seen or only not in c["kernel"]:
                continue
            seen.add(key)
            out.append(compile_report(c["compiled"], scenario=launch.scenario, constexprs=c["constexprs"],
                                      options=c["options"]))  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dtype", nargs="?", default="bf16", choices=list(DTYPES))
    ap.add_argument("only", nargs="?", default="", help="only kernels whose name contains this")
    ap.add_argument("--heads", default="192,128", help="Dk,Dv (default the paper's 192,128) or one D")
    args = ap.parse_args(argv)
    heads = [int(x) for x in args.heads.split(",")]
    dk, dv = (heads[0], heads[-1]) if len(heads) in (1, 2) else ap.error("--heads takes Dk,Dv or D")
    failed = 0
    for r in rows(args.dtype, args.only, dk, dv):
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
