"""Tuning and comparison runs of chunk_kda on a GPU, each building :class:`repro.kda.KDAConfig`\\ s:

    python -m repro.kda.lab.tuning tune [--seqlens 2048,4096] [--only NAME] [--try NAME=VALUE[,NAME=VALUE]]
        [--head-size 256] [--peer fla_kda]
    python -m repro.kda.lab.tuning precision
    python -m repro.kda.lab.tuning breakdown [--impls ours,fla_kda]

* ``tune``: ours (fwd, fwd+bwd) with the defaults and with each change of :data:`TUNING` (``--only``
  picks some by name, ``--try`` gives others) applied alone, at B=8, T=2048 or at each T of
  ``--seqlens``, every setting timed once per round in interleaved rounds -> ``<device>-tune.json``.
  Each change is checked first (output and gradients against our fp32 path, bench.CHECK_TOL);
  ``--peer fla_kda`` times fla's chunk_kda in the same rounds, and each row says how fast it is
  against it (``*_vs_peer``: the peer's time over the row's; issue #42's target is 0.9).
  ``--only 'state-*'`` picks the state kernels' candidates (:data:`STATE_CANDIDATES`).
* ``precision``: fp16 and bf16 inputs, mild gates: ours at each product precision of the
  intra-chunk algebra (``dot_prec_fp16`` / ``dot_prec_bf16`` = tf32, tf32x3, ieee) beside fla's
  chunk_kda in the same dtype, forward + backward, each checked first -> ``<device>-precision.json``.
* ``breakdown``: GPU time of every kernel of one forward and one forward + backward, per
  implementation (torch.profiler) -> ``breakdown.json`` under ``--out``.

The common options (``--out``, ``--budget-s``, ``--set`` on the base config, ``--rounds``) are
``paperclub.bench``'s. What these runs found sits beside each tuned constant (intra_chunk.py,
wy_ut.py, inter_chunk.py, output.py, backward_*.py) and in ``results/``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import torch

from paperclub.bench import (
    Budget,
    Candidate,
    Report,
    apply_settings,
    bench_parser,
    describe_changes,
    kernel_times,
    measure,
    parse_bench_args,
    parse_settings,
    select,
)
from repro.kda import KDAConfig
from repro.kda import bench as kb

#: One change (of one or more KDAConfig fields) at a time against the defaults. The last round's
#: changes undone, and the choices settled on an H100 (H100, B=8, T=2048,
#: results/nvidia-h100-80gb-hbm3-tuning.json; the variants it also timed then, the fused forward,
#: the recomputed QG / KB, tl.exp and the other backwards, left the kernels in issue #40).
TUNING: dict[str, dict] = {
    "wy-4-warps": {"wy_warps": 4},
    "wy-32": {"wy_bk": 32, "wy_bv": 32},
    "out-bv-64": {"out_bv": 64},
    "intra-1-stage": {"intra_stages": 1},
    "dqk-1-stage": {"bwd_dqk_stages": 1},
    "dqk-4-stages": {"bwd_dqk_stages": 4},
    "dqk-bv-64": {"bwd_dqk_bv": 64},
    "mat-16x16-4-warps": {"bwd_mat_bk": 16, "bwd_mat_bv": 16, "bwd_mat_warps": 4},
    # accuracy against time for bf16 inputs: tf32x3 products everywhere
    "bf16-tf32x3": {"dot_prec_bf16": "tf32x3"},
    # the cost of chunk_kda's range check of g
    "no-decay-check": {"check_decay_range": False},
}

#: The state kernels with their block held as key tiles (issue #42, KDAConfig.state_fwd_bk /
#: state_bwd_bk), for K = V = 256, where the one-tile forward state kernel took 924 us against fla's
#: 456 (results/nvidia-h200-breakdown-d256.json). Picked from the offline sm_90a compile of every
#: launch (lab/ptx_snapshot.py --state-sweep, 2026-11-29, bf16, B=8, T=2048, H=16): those without
#: spills and within a Hopper block's shared memory. Registers / spill bytes / shared KiB, the
#: one-tile defaults first (forward BV 32, 8 warps: 210 / 0 / 56; backward BV 32, 8 warps:
#: 255 / 460 / 128):
#:   forward, one stage: k64 v16 w4 112 / 0 / 16 (four programs an SM by registers), k64 v32 w4
#:   160 / 0 / 24 (three), k64 v32 w8 128 / 0 / 24 (two), k64 v64 w8 184 / 0 / 40, k128 v32 w8
#:   128 / 0 / 32; two stages: k64 v32 w4 148 / 0 / 153 (one program an SM, by shared memory).
#:   backward: k64 v16 w4 two stages 254 / 0 / 195; k128 v32 w8 two stages 224 / 0 / 221; one
#:   stage k128 v32 w8 255 / 8 / 64 and k64 v16 w4 255 / 136 / 32 (two programs an SM).
#: Three stages ask for more shared memory than a block has (208-434 KiB) but for value blocks of
#: 16 in the forward; value blocks of 64 spill in the backward (88-1008 bytes) but for none.
STATE_CANDIDATES: dict[str, dict] = {
    "state-fwd-k64-v16-w4": dict(state_fwd_bk=64, state_fwd_bv=16, state_fwd_warps=4, state_fwd_stages=1),
    "state-fwd-k64-v32-w4": dict(state_fwd_bk=64, state_fwd_bv=32, state_fwd_warps=4, state_fwd_stages=1),
    "state-fwd-k64-v32-w8": dict(state_fwd_bk=64, state_fwd_bv=32, state_fwd_warps=8, state_fwd_stages=1),
    "state-fwd-k64-v32-w4-s2": dict(state_fwd_bk=64, state_fwd_bv=32, state_fwd_warps=4, state_fwd_stages=2),
    "state-fwd-k64-v64-w8": dict(state_fwd_bk=64, state_fwd_bv=64, state_fwd_warps=8, state_fwd_stages=1),
    "state-fwd-k128-v32-w8": dict(state_fwd_bk=128, state_fwd_bv=32, state_fwd_warps=8, state_fwd_stages=1),
    "state-bwd-k64-v16-w4-s2": dict(state_bwd_bk=64, state_bwd_bv=16, state_bwd_warps=4, state_bwd_stages=2),
    "state-bwd-k128-v32-w8-s2": dict(
        state_bwd_bk=128, state_bwd_bv=32, state_bwd_warps=8, state_bwd_stages=2
    ),
    "state-bwd-k128-v32-w8": dict(state_bwd_bk=128, state_bwd_bv=32, state_bwd_warps=8, state_bwd_stages=1),
    "state-bwd-k64-v16-w4": dict(state_bwd_bk=64, state_bwd_bv=16, state_bwd_warps=4, state_bwd_stages=1),
}
TUNING.update(STATE_CANDIDATES)

TUNE_COLUMNS = [
    "run",
    "B",
    "T",
    "change",
    "fwd_ms",
    "fwd_min",
    "fwd_max",
    "fwd_bwd_ms",
    "fwd_bwd_min",
    "fwd_bwd_max",
    "fwd_vs_peer",
    "fwd_bwd_vs_peer",
]


def tune(
    B: int = 8, T: int = 2048, rounds: int = kb.ROUNDS, changes: dict[str, dict] | None = None, base=None,
    head_size: int = kb.K, peer: str | None = None, check: bool = True,
) -> list[dict]:  # fmt: skip
    """Time ours (fwd, fwd+bwd) with ``base`` (default KDAConfig()) and with each change of ``changes``
    (default TUNING) applied alone, in ``rounds`` interleaved rounds (medians; the row keeps the
    range), at K = V = ``head_size``. A change that does not build or run, or (``check``) whose output
    or gradients are off our fp32 path (bench.gradient_check), is reported and left out. ``peer``
    (a name of bench.impls, e.g. "fla_kda"): timed in the same rounds, its own row, and every row's
    ``*_vs_peer`` the peer's time over the row's."""
    base = KDAConfig() if base is None else base
    changes = TUNING if changes is None else changes
    inputs = kb.make_inputs(B, T, dk=head_size, dv=head_size)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    do = torch.randn_like(inputs[2])
    reference = kb.fp32_path() if check else None
    from repro.kda import chunk_kda

    trials, candidates = [], {}
    for name, change in {"defaults": {}, **changes}.items():
        try:  # compile each setting once; one that fails is a result, not the end of the run
            config = apply_settings(base, change)
            torch.autograd.grad(chunk_kda(*leaves, config=config)[0], leaves, do)
            if check:
                kb.gradient_check(kb.impls(config)["ours"], inputs, reference)
        except Exception as exc:
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        trials.append((name, describe_changes(config, base) or "defaults"))
        candidates[f"{name}/fwd"] = lambda c=config: chunk_kda(*inputs, config=c)
        candidates[f"{name}/fwd+bwd"] = lambda c=config: torch.autograd.grad(
            chunk_kda(*leaves, config=c)[0], leaves, do
        )
    if peer is not None:
        fn = kb.impls(base).get(peer)
        if fn is None:
            raise ValueError(f"tune: peer {peer!r} is not importable here (bench.impls)")
        print(f"peer {peer}: first calls (compile and autotune: minutes at head size 256)", flush=True)
        torch.autograd.grad(fn(*leaves), leaves, do, allow_unused=True)
        trials.append((peer, f"peer {peer}"))
        candidates[f"{peer}/fwd"] = lambda: fn(*inputs)
        candidates[f"{peer}/fwd+bwd"] = lambda: torch.autograd.grad(
            fn(*leaves), leaves, do, allow_unused=True
        )
    res = measure(candidates, rounds=rounds)  # every setting and pass in turn, ``rounds`` times
    rows, peer_ms = [], {}
    if peer is not None and res[f"{peer}/fwd"].rounds and res[f"{peer}/fwd+bwd"].rounds:
        peer_ms = {p: statistics.median(res[f"{peer}/{p}"].rounds) for p in ("fwd", "fwd+bwd")}
    for name, change in trials:
        f_ms, fb_ms = res[f"{name}/fwd"].rounds, res[f"{name}/fwd+bwd"].rounds
        if not (f_ms and fb_ms):
            print(f"{name}: failed while timed: {res[f'{name}/fwd'].error or res[f'{name}/fwd+bwd'].error}")
            continue
        fwd_med, fb_med = statistics.median(f_ms), statistics.median(fb_ms)
        change += f" (K=V={head_size})" if head_size != kb.K else ""
        vs = (
            {p: round(peer_ms[p] / ms, 3) for p, ms in (("fwd", fwd_med), ("fwd+bwd", fb_med))}
            if peer_ms
            else {}
        )
        rows.append({"B": B, "T": T, "change": change, "fwd_ms": round(fwd_med, 4),
                     "fwd_range": [round(min(f_ms), 4), round(max(f_ms), 4)], "fwd_bwd_ms": round(fb_med, 4),
                     "fwd_bwd_range": [round(min(fb_ms), 4), round(max(fb_ms), 4)],
                     "fwd_vs_peer": vs.get("fwd"), "fwd_bwd_vs_peer": vs.get("fwd+bwd")})  # fmt: skip
        against = f"  vs {peer}: fwd {vs['fwd']:.3f}x fwd+bwd {vs['fwd+bwd']:.3f}x" if vs else ""
        print(f"B={B} T={T} {change:40s} fwd {fwd_med:7.3f} ms ({min(f_ms):.3f}-{max(f_ms):.3f})"
              f"  fwd+bwd {fb_med:7.3f} ms ({min(fb_ms):.3f}-{max(fb_ms):.3f}){against}", flush=True)  # fmt: skip
    return rows


def tune_report(rows: list[dict], base_changes: str = "", run: str = "", rounds: int = kb.ROUNDS) -> Report:
    """The rows of :func:`tune` as a results file (``<device>-tune.json``): one row per change
    (``change`` "defaults" or the fields as NAME=VALUE, over the base config), median and range."""
    report = Report(
        package="kda",
        title="KDA launch settings, one change at a time (ours, bf16, H=16, K=V=128 unless a row says)",
        columns=TUNE_COLUMNS,
        notes=f"lab/tuning.py tune: each change against the defaults{' with ' + base_changes if base_changes else ''}, "
        f"every setting timed once per round in {rounds} interleaved rounds; ms is the median, min/max the range; "
        "*_vs_peer (with --peer): the peer's median over the row's (above 1: faster than the peer).",
        measure_ceilings=False,
    )
    for r in rows:
        report.add(
            run=run, B=r["B"], T=r["T"], change=r["change"], fwd_ms=r["fwd_ms"], fwd_min=r["fwd_range"][0],
            fwd_max=r["fwd_range"][1], fwd_bwd_ms=r["fwd_bwd_ms"], fwd_bwd_min=r["fwd_bwd_range"][0],
            fwd_bwd_max=r["fwd_bwd_range"][1], fwd_vs_peer=r.get("fwd_vs_peer"),
            fwd_bwd_vs_peer=r.get("fwd_bwd_vs_peer"),
        )  # fmt: skip
    return report


PRECISION_SHAPES = ((8, 2048), (2, 8192))
#: the product precisions ``precision`` times (KDAConfig.dot_prec_fp16 / dot_prec_bf16)
DOT_PRECISION_CHOICES = ("tf32", "tf32x3", "ieee")
#: its check only refuses what is plainly wrong (bf16 rounding gives up to ~1.5e-2)
PRECISION_CHECK_TOL = {"o": 5e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2, "dg": 1e-1, "dbeta": 1e-1}


def precision(out_dir=None, budget: Budget | None = None, base=None, rounds: int = kb.ROUNDS) -> None:
    """fp16 and bf16 inputs: ours with each product precision of the intra-chunk algebra beside fla's
    chunk_kda in the same dtype, mild gates (where precision shows), forward + backward. Each
    candidate's gradients are checked first against our fp32 path at the shape (the largest relative
    error is ``err_max``); the rows then come from interleaved rounds (``measure``)."""
    base = KDAConfig() if base is None else base
    budget = budget or Budget(None)
    report = Report(
        package="kda",
        title="KDA fwd+bwd: product precision of the intra-chunk algebra, fp16 and bf16, mild gates",
        peer="flash-linear-attention 0.6.0",
        columns=["impl", "dtype", "prec", "B", "T", "ms", "ms_min", "ms_max", "check", "err_max"],
        packages=["flash-linear-attention", "fla-core"],
        notes=(
            "H=16, K=V=128, g = logsigmoid(x) / 10 (mild). prec: the products of our fp32 intra-chunk and "
            "state algebra (KDAConfig.dot_prec_fp16 for fp16, dot_prec_bf16 for bf16; defaults "
            f"{KDAConfig().dot_prec_fp16} / {KDAConfig().dot_prec_bf16}). err_max: the largest relative "
            "error of o and the input gradients against our fp32 path (ieee) on the same inputs. Medians and "
            f"range of {rounds} interleaved rounds."
        ),
        measure_ceilings=False,
    )
    fns = kb.impls(base)
    reference = kb.fp32_path()
    for B, T in PRECISION_SHAPES:
        for dtype, field in ((torch.float16, "dot_prec_fp16"), (torch.bfloat16, "dot_prec_bf16")):
            if not budget.allows():
                print(f"precision: budget spent, B={B} T={T} {dtype} not measured", flush=True)
                continue
            q, k, v, g, beta = kb.make_inputs(B, T, gate_scale=kb.GATES["mild"])
            inputs = (q.to(dtype), k.to(dtype), v.to(dtype), g, beta)
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            do = torch.randn_like(inputs[2])
            cands, errs = {}, {}
            variants = [
                ("ours", prec, kb.impls(replace(base, **{field: prec}))["ours"])
                for prec in DOT_PRECISION_CHOICES
            ]
            if "fla_kda" in fns:
                variants.append(("fla_kda", "", fns["fla_kda"]))
            for name, prec, fn in variants:

                def run_once(fn=fn, leaves=leaves, do=do):
                    return torch.autograd.grad(fn(*leaves), leaves, do, allow_unused=True)

                out = errs[(name, prec)] = {}

                def check(fn=fn, out=out, x=inputs):
                    kb.gradient_check(fn, x, reference, tol=PRECISION_CHECK_TOL, errors_out=out)

                cands[f"{name}|{prec}"] = Candidate(fn=run_once, check=check)
            print(
                f"precision {dtype} B={B} T={T}: checking {', '.join(cands)} (first calls compile: minutes)",
                flush=True,
            )
            res = measure(cands, rounds=rounds)
            for key, m in res.items():
                name, prec = key.split("|")
                err = errs.get((name, prec)) or {}
                report.add(impl=name, dtype=str(dtype).removeprefix("torch."), prec=prec, B=B, T=T,
                           err_max=round(max(err.values()), 5) if err else None, **m.row())  # fmt: skip
                print(f"{str(dtype):15s} B={B} T={T} {name:8s} {prec:7s} {m.row()}", flush=True)
            report.write(out_dir=out_dir, tag="precision")
    report.write(out_dir=out_dir, tag="precision")


def breakdown(
    B: int = 8, T: int = 2048, names: tuple[str, ...] = ("ours", "fla_kda"), base=None, head_size: int = kb.K
) -> dict:
    """GPU time of every kernel in one forward and one forward+backward, per implementation.

    Runs each implementation three times under torch.profiler (after a warm-up) and prints, for
    each, the kernels sorted by time per call: where the time goes, to compare launch by launch
    with the peer. Returns ``{impl: {pass: [(kernel, us_per_call), ...]}}``."""
    fns = kb.impls(base)
    inputs = kb.make_inputs(B, T, dk=head_size, dv=head_size)
    do = torch.randn_like(inputs[2])
    out: dict = {}
    for name in names:
        if name not in fns:
            continue
        fn = fns[name]
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]

        def fwd(fn=fn):
            return fn(*inputs)

        def fwd_bwd(fn=fn, leaves=leaves):
            return torch.autograd.grad(fn(*leaves), leaves, do, allow_unused=True)

        out[name] = {}
        for label, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            rows = [(k, ms * 1000) for k, ms, _ in kernel_times(f, reps=3)]
            total = sum(us for _, us in rows)
            print(
                f"\n{name} {label} B={B} T={T} K=V={head_size}: {total / 1000:.3f} ms of kernel time per call"
            )
            for kname, us in rows[:14]:
                print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {kname[:90]}")
            out[name][label] = [(k, round(us, 1)) for k, us in rows]
    return out


def main(argv=None) -> None:
    ap = bench_parser(__doc__.splitlines()[0], rounds=kb.ROUNDS, tag=False)
    ap.add_argument("mode", choices=["tune", "precision", "breakdown"])
    ap.add_argument(
        "--seqlens", default="", help="tune: comma-separated T values (B = 16384 // T); default 2048"
    )
    ap.add_argument(
        "--try", dest="tries", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
        help="tune: one change to time instead of TUNING's (repeatable)",
    )  # fmt: skip
    ap.add_argument("--impls", default="ours,fla_kda", help="breakdown: comma-separated implementations")
    ap.add_argument(
        "--head-size", type=int, default=kb.K, help="tune and breakdown: K = V (default 128; issue #42's 256)"
    )
    ap.add_argument(
        "--peer",
        default=None,
        help="tune: an implementation of bench.impls timed in the same rounds (fla_kda)",
    )
    args = parse_bench_args(ap, argv)
    try:
        base = apply_settings(KDAConfig(), args.settings)
        changes = None
        if args.tries:
            changes = {t: parse_settings(t.split(","), "--try") for t in args.tries}
        elif args.only:
            changes = {n: TUNING[n] for n in select(TUNING, args.only, "change")}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not torch.cuda.is_available():
        raise SystemExit("repro.kda.lab.tuning needs a CUDA GPU")
    seqlens = [int(x) for x in args.seqlens.split(",") if x] or [2048]
    if args.mode == "precision":
        precision(args.out, args.budget, base, args.rounds)
    elif args.mode == "breakdown":
        result = breakdown(
            names=tuple(x for x in args.impls.split(",") if x), base=base, head_size=args.head_size
        )
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "breakdown.json").write_text(json.dumps(result, indent=1))
    else:
        rows = []
        for T in seqlens:
            if not args.budget.allows():
                print(f"tune: budget spent, T={T} not measured", flush=True)
                continue
            rows += tune(max(1, kb.TOKENS // T), T, args.rounds, changes, base, args.head_size, args.peer)
        stamp = time.strftime("%H:%M UTC", time.gmtime())
        tune_report(rows, describe_changes(base, KDAConfig()), stamp, args.rounds).write(
            out_dir=args.out, tag="tune"
        )


if __name__ == "__main__":
    main()
