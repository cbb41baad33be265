"""flash-attn-4 (the paper's own CuTe-DSL kernels) at one small shape, output and gradients against
float64, with cuDNN and ours (TMA on) beside it: does it import, compile and run on this GPU, and is it
right there?

    python -m repro.fa4.lab.fa4_smoke --out DIR [--set NAME=VALUE]   # on a GPU -> <device>-fa4-smoke.json

Exit status 3 when flash-attn-4 does not import, compile or run; its error is printed with the
traceback and kept in the JSON's notes (a failure on Hopper is itself the answer). ``--set`` changes
the base ``repro.fa4.Switches`` of our row, as the bench's does. ``python -m repro.fa4.bench --only
fa4-smoke`` runs it (``lab/gpu_run_peer.sh`` does, before the peer benchmark, whose ``--no-fa4`` run
quotes this file's note).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

from paperclub.bench import Report, apply_settings, bench_parser, error_text, parse_bench_args, sdpa
from repro.fa4.api import Switches
from repro.fa4.bench import HEAD_DIM, HEADS, OURS_BEST, rel_err, switches
from repro.fa4.peer import FA4_DISTRIBUTIONS, fa4_cute, load_flash_attn_4

#: (B, S, H, D) of the smoke test: small enough for a float64 reference with gradients.
SMOKE_SHAPE = (2, 512, HEADS, HEAD_DIM)


def run(out_dir: Path | None, base: Switches | None = None) -> bool:
    """flash-attn-4 at SMOKE_SHAPE, forward and gradients, against float64; cuDNN and ours (``base``
    with OURS_BEST) beside it. Writes <device>-fa4-smoke.json; returns whether flash-attn-4 ran."""
    from repro.fa4 import attention
    from repro.fa4.reference import attention_exact

    base = Switches() if base is None else base
    b, s, h, d = SMOKE_SHAPE
    report = Report(
        package="fa4",
        title=f"flash-attn-4 smoke test: B={b}, S={s}, H={h}, D={d}, bf16, relative error vs float64",
        columns=["impl", "causal", "out_err", "dq_err", "dk_err", "dv_err", "note"],
        packages=FA4_DISTRIBUTIONS,
        measure_ceilings=False,
        notes="Relative L2 errors of the output and of dq, dk, dv (one random dO) against exact float64 attention.",
    )
    fn, info = load_flash_attn_4()
    print(f"flash-attn-4: {info}", flush=True)
    ok = fn is not None
    if not ok:
        report.notes += f" flash-attn-4 did not import: {info}"

    def cudnn(q, k, v, c):
        return sdpa(*(t.transpose(1, 2) for t in (q, k, v)), c, "cudnn")().transpose(1, 2)

    impls = {
        "sdpa-cudnn": cudnn,
        "fa4-triton-tma": lambda q, k, v, c: attention(q, k, v, causal=c, **switches(OURS_BEST, base)),
    }
    if fn is not None:
        impls = {"fa4-cute": lambda q, k, v, c: fa4_cute(fn, q, k, v, c)(), **impls}
    g = torch.Generator(device="cuda").manual_seed(0)
    for causal in (False, True):
        q, k, v, do = (
            torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
        )
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref = attention_exact(*leaves64, causal=causal)
        ref_grads = torch.autograd.grad(ref, leaves64, do.double())
        for name, f in impls.items():
            row = dict(impl=name, causal=causal)
            try:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = f(*leaves, causal)
                grads = torch.autograd.grad(out, leaves, do)
                torch.cuda.synchronize()
                errs = [rel_err(out, ref)] + [rel_err(a, r) for a, r in zip(grads, ref_grads, strict=True)]
                report.add(
                    **row, **dict(zip(["out_err", "dq_err", "dk_err", "dv_err"], errs, strict=True)), note=""
                )
            except Exception as exc:
                print(f"[smoke {name} causal={causal}] failed:", file=sys.stderr)
                traceback.print_exc()
                report.add(**row, note=error_text(exc))
                if name == "fa4-cute":
                    ok = False
                    if "flash-attn-4 failed" not in report.notes:
                        report.notes += f" flash-attn-4 failed on this GPU: {error_text(exc)}"
    report.write(tag="fa4-smoke", out_dir=out_dir)
    return ok


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__.split("\n\n")[0], rounds=None, only=False, tag=False)
    args = parse_bench_args(ap, argv)
    try:
        base = apply_settings(Switches(), args.settings)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit("repro.fa4.lab.fa4_smoke needs a CUDA GPU")
    if not run(args.out, base):
        raise SystemExit(3)


if __name__ == "__main__":
    main()
