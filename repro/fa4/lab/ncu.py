"""Nsight Compute on one forward each of ours, cuDNN and flash-attn-4, for the gap between our forward and
cuDNN's (pipe utilisations, stalls, registers).

    python -m repro.fa4.lab.ncu --out DIR [--no-fa4] [--timeout-s 120]   # on the GPU machine, with ncu
    python -m repro.fa4.lab.ncu --target [--no-fa4]                        # the profiled process itself
    python -m paperclub.lab ncu-summary DIR/ncu-raw.csv                    # the summary table, anywhere

The first form runs ``paperclub.lab.run_ncu`` on the second (``--profile-from-start off``, clocks not
locked, the sections and pipe metrics of ``paperclub.lab``) and writes ``ncu.log``, ``ncu-raw.csv`` and
``ncu-details.csv`` under DIR, then prints the summary. The target runs one forward each of our
Triton kernel with TMA, our Gluon forward, cuDNN and flash-attn-4 (unless ``--no-fa4`` or it does not
import) at S = 8k, non-causal, each after three untimed calls, between cudaProfilerStart/Stop
(``paperclub.lab.profile_once``). ``lab/gpu_run_peer.sh`` runs it after the peer benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from paperclub.bench import error_text
from paperclub.lab import print_ncu_summary, profile_once, run_ncu


def target(use_fa4: bool = True, s: int = 8192, causal: bool = False) -> None:
    """One forward each of ours (OURS_BEST and OURS_GLUON), cuDNN and flash-attn-4, each profiled once."""
    from paperclub.bench import sdpa
    from repro.fa4.bench import OURS_BEST, OURS_GLUON, TOKENS, make_inputs, ours
    from repro.fa4.peer import fa4_cute, load_flash_attn_4

    b = TOKENS // s
    q, k, v = (t.detach() for t in make_inputs(b, s))
    qt, kt, vt = (t.detach() for t in make_inputs(b, s, layout="bhsd"))
    runs = [
        ("fa4-triton-tma", ours(q, k, v, causal, OURS_BEST)),
        ("fa4-gluon", ours(q, k, v, causal, OURS_GLUON)),
        ("sdpa-cudnn", sdpa(qt, kt, vt, causal, "cudnn")),
    ]
    if use_fa4:
        fn, info = load_flash_attn_4()
        if fn is None:
            print(f"ncu-target: flash-attn-4 left out: {info}")
        else:
            runs.append(("fa4-cute", fa4_cute(fn, q, k, v, causal)))
    with torch.no_grad():
        for name, f in runs:
            try:
                profile_once(f)
                print(
                    f"ncu-target: profiled one forward of {name} (S={s}, B={b}, causal={causal})", flush=True
                )
            except Exception as exc:
                print(f"ncu-target: {name} failed: {error_text(exc)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="store_true", help="be the profiled process")
    ap.add_argument("--no-fa4", action="store_true", help="leave flash-attn-4 out")
    ap.add_argument("--out", type=Path, default=None, help="where ncu's files go (required without --target)")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    if args.target:
        target(use_fa4=not args.no_fa4)
        return
    if args.out is None:
        ap.error("--out DIR is required (or --target)")
    cmd = [sys.executable, "-m", "repro.fa4.lab.ncu", "--target", *(["--no-fa4"] if args.no_fa4 else [])]
    res = run_ncu(cmd, args.out, timeout_s=args.timeout_s)
    print(f"ncu: {res['status']}; wrote {', '.join(res['files'])}", flush=True)
    raw = args.out / "ncu-raw.csv"
    if raw.exists():
        print_ncu_summary(raw.read_text(encoding="utf-8", errors="replace"))


if __name__ == "__main__":
    main()
