"""Nsight Compute on one forward + backward of chunk_kda (B=8, T=2048, bf16, H=16, K=V=128).

    python -m repro.kda.lab.ncu --out DIR [--kernels REGEX] [--source NAME] [--set NAME=VALUE]  # GPU, ncu
    python -m repro.kda.lab.ncu --target [--set NAME=VALUE]                                     # the profiled process
    python -m paperclub.lab ncu-summary DIR/ncu-raw.csv                                         # anywhere

The first form runs ``paperclub.lab.run_ncu`` (``--set full``, clocks not locked) on the second,
restricted to the kernels matching ``--kernels`` (default the forward's four), and exports the raw
and details pages and the per-instruction SASS view of each ``--source`` kernel (default the
intra-chunk kernel) under DIR, then prints the summary. The target runs one forward + backward after
a warm-up that compiles everything, between cudaProfilerStart/Stop (``paperclub.lab.profile_once``).
``--set`` changes a field of the KDAConfig profiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from paperclub.bench import apply_settings, parse_settings
from paperclub.lab import print_ncu_summary, profile_once, run_ncu
from repro.kda import KDAConfig

#: the forward's kernels (Nsight Compute on every kernel of a forward + backward takes minutes)
FORWARD_KERNELS = "kda_(intra|wy|state|out)_fwd"


def target(config: KDAConfig, B: int = 8, T: int = 2048) -> None:
    from repro.kda import chunk_kda
    from repro.kda.bench import make_inputs

    leaves = [x.requires_grad_(True) for x in make_inputs(B, T)]
    do = torch.randn_like(leaves[2])
    profile_once(lambda: torch.autograd.grad(chunk_kda(*leaves, config=config)[0], leaves, do), warmup=1)
    print(f"ncu target: one forward + backward of chunk_kda at B={B}, T={T}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="store_true", help="be the profiled process")
    ap.add_argument("--out", type=Path, default=None, help="where ncu's files go (required without --target)")
    ap.add_argument("--kernels", default=FORWARD_KERNELS, help="regex of the kernels to profile")
    ap.add_argument("--source", action="append", default=[], help="kernels whose SASS view is exported")
    ap.add_argument("--set", dest="set_", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        config = apply_settings(KDAConfig(), parse_settings(args.set_))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.target:
        target(config)
        return
    if args.out is None:
        ap.error("--out DIR is required (or --target)")
    cmd = [sys.executable, "-m", "repro.kda.lab.ncu", "--target", *(f"--set={s}" for s in args.set_)]
    res = run_ncu(
        cmd, args.out, timeout_s=args.timeout_s, kernels=args.kernels, full=True,
        source_kernels=args.source or ["kda_intra_fwd"],
    )  # fmt: skip
    print(f"ncu: {res['status']}; wrote {', '.join(res['files'])}", flush=True)
    raw = args.out / "ncu-raw.csv"
    if raw.exists():
        print_ncu_summary(raw.read_text())


if __name__ == "__main__":
    main()
