"""Tuning sweeps of fa4's launch settings on the GPU: each a set of configs timed against the default
(or cuDNN) in interleaved rounds by ``paperclub.bench.sweep``, every config checked at the shape first.

    python -m repro.fa4.lab.tuning launch        [--out DIR] [--rounds N] [--budget-s S]  # -> <device>-autotune.json
    python -m repro.fa4.lab.tuning gluon         ...   # the Gluon forward's launcher knobs -> <device>-gluon-sweep.json
    python -m repro.fa4.lab.tuning gluon-combos  ...   # the winners of ``gluon`` combined -> <device>-gluon-combos.json
    python -m repro.fa4.lab.tuning bwd-fused     ...   # triton_bwd_fused.FUSED_CONFIGS at S = 8k -> <device>-bwd-sweep.json
    python -m repro.fa4.lab.tuning gluon-bwd-dq  ...   # the Gluon backward's dQ by TMA vs by atomics -> <device>-bwd-gluon-dq.json
    python -m repro.fa4.lab.tuning bwd-d256      ...   # the D = 256 backwards' launches (issue #42) -> <device>-bwd-d256.json

What each sweep found is in the constant it tuned (``triton_fwd.FWD_DEFAULTS``, ``triton_bwd.BWD_DEFAULTS``,
``api.GLUON_LAUNCH``, ``triton_bwd_fused.FUSED_DEFAULTS``, ``gluon_bwd.DQ_TMA``), each with its date,
device and result file. A sweep builds configs (``repro.fa4.Switches`` or the Gluon launcher's
keyword arguments); it never patches a module. Shapes, inputs, checks and FLOP counts are the bench's
(``repro.fa4.bench``).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from paperclub.bench import (
    SWEEP_COLUMNS,
    AttentionInputs,
    Budget,
    Candidate,
    Report,
    bench_parser,
    grad_errors,
    parse_bench_args,
    quiet_write,
    sdpa,
    sweep,
    time_alone,
    timed_pass,
    variants,
)
from repro.fa4 import bench
from repro.fa4.api import Switches
from repro.fa4.bench import HEAD_DIM, TOKENS, flops, make_inputs, rel_err

# ---------------------------------------------------------------------------------------------
# launch: the Triton forward's and the FA2 backward's launch shapes
# ---------------------------------------------------------------------------------------------

#: (block_m, block_n, num_warps, num_stages) of the forward, without and with ping-pong tiles.
FWD_LAUNCHES = [
    *[(128, 64, 8, st) for st in (2, 3, 4)],
    *[(128, 128, 8, st) for st in (2, 3)],
    *[(64, 64, 4, st) for st in (2, 3, 4)],
    *[(64, 128, 4, st) for st in (2, 3)],
    (128, 128, 4, 2),
]
PINGPONG_LAUNCHES = [(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2)]
#: (bwd_block_m, bwd_block_n, bwd_num_warps, bwd_num_stages) of the FA2 backward.
BWD_LAUNCHES = [
    (64, 128, 8, 2),
    (64, 128, 8, 3),
    (64, 64, 4, 2),
    (32, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 128, 8, 2),
]


def launch_configs() -> dict[str, dict[str, Switches]]:
    """{pass: {name: Switches}} of the launch sweep, the tuned default first in each."""
    fwd = {"default": Switches()}
    for pp, launches in ((False, FWD_LAUNCHES), (True, PINGPONG_LAUNCHES)):
        for bm, bn, nw, ns in launches:
            fwd[f"{'pp-' if pp else ''}m{bm}-n{bn}-w{nw}-s{ns}"] = Switches(
                block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, pingpong=pp
            )
    bwd = {"default": Switches(bwd="fa2")}
    for bm, bn, nw, ns in BWD_LAUNCHES:
        bwd[f"m{bm}-n{bn}-w{nw}-s{ns}"] = Switches(
            bwd="fa2", bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=nw, bwd_num_stages=ns
        )
    return {"fwd": fwd, "fwd+bwd": bwd}


def _ours(q, k, v, causal: bool, cfg: Switches, *, passes: str, ref=None) -> Candidate:
    """Our attention with ``cfg`` timed for ``passes``; checked against cuDNN's output ``ref``."""
    from repro.fa4 import attention

    def check():
        if ref is not None:
            with torch.no_grad():
                err = rel_err(attention(q, k, v, causal=causal, config=cfg), ref)
            assert err < 2e-2, f"relative error vs cuDNN {err:.1e} over 2e-2"

    def fn():
        return time_alone(lambda: attention(q, k, v, causal=causal, config=cfg), passes, (q, k, v))

    return Candidate(fn=fn, check=check)


def _timer_only(fn, warmup, rep) -> float:
    return fn()  # each candidate's fn returns its own median ms (paperclub.bench.time_alone)


def launch(out: Path | None, rounds: int, budget: Budget, s: int = 8192) -> Report:
    """Every launch of :func:`launch_configs` at S = ``s``, causal and not, against the default."""
    report = Report(
        package="fa4",
        title=f"FA4 Triton launch-shape sweep (S={s}, D=128, 16 heads, bf16)",
        columns=["pass", "causal", "S", *SWEEP_COLUMNS, "tflops"],
        packages=["triton"],
        measure_ceilings=False,
        notes=f"repro.fa4.lab.tuning launch: each launch against the tuned default, {rounds} interleaved rounds.",
    )
    b = TOKENS // s
    q, k, v = make_inputs(b, s)
    for causal in (False, True):
        with torch.no_grad():
            ref = sdpa(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal, "cudnn")().transpose(1, 2)
        for passes, configs in launch_configs().items():
            if not budget.allows(None, reserve_s=30):
                report.notes += f" {passes} causal={causal}: not run (time budget)."
                continue
            build = functools.partial(_ours, q, k, v, causal, passes=passes, ref=ref)
            rows = sweep(configs, build, rounds=rounds, timer=_timer_only)
            for r in rows:
                ms = r["ms"]
                report.add(**{"pass": passes}, causal=causal, S=s, **r,
                           tflops=flops(b, s, causal, passes) / (ms * 1e-3) / 1e12 if ms else None)  # fmt: skip
            quiet_write(report, tag="autotune", out_dir=out)
    report.write(tag="autotune", out_dir=out)
    return report


# ---------------------------------------------------------------------------------------------
# gluon / gluon-combos: the Gluon forward's launcher knobs beside cuDNN
# ---------------------------------------------------------------------------------------------

#: Launch settings of the Gluon forward timed by ``gluon`` (keyword arguments of
#: ``gluon_attention_forward``; the base is the launcher's defaults, lazy rescaling off). ``"all"``:
#: at every S of GLUON_SWEEP_SEQLENS, causal and not; ``"8k"``: at S = 8192 only.
GLUON_SWEEP: list[tuple[str, str, dict]] = [
    ("all", "base", {}),
    ("all", "lazy", {"lazy_rescale": True}),
    ("all", "no-sync", {"pingpong_sync": False}),
    ("all", "stages-3", {"num_stages": 3}),
    ("all", "store-tma", {"store_tma": True}),
    ("8k", "lazy+no-sync", {"lazy_rescale": True, "pingpong_sync": False}),
    ("8k", "consumers-1", {"num_consumers": 1}),
    ("8k", "block-n-64+stages-4", {"block_n": 64, "num_stages": 4}),
    ("8k", "consumer-regs-232", {"consumer_regs": 232}),
]
#: The second sweep (``gluon-combos``): the knobs that won alone in the first one
#: (results/*-gluon-sweep.json: lazy rescaling, no turn barriers, TMA store, 232 registers for the
#: second consumer, each 1-7% at some shape), alone and combined, at every S. Its winner is
#: ``api.GLUON_LAUNCH`` (with Switches' lazy rescaling).
_LAZY, _NOSYNC = {"lazy_rescale": True}, {"pingpong_sync": False}
_TMA, _R232 = {"store_tma": True}, {"consumer_regs": 232}
GLUON_COMBOS: list[tuple[str, str, dict]] = [
    ("all", "base", {}),
    ("all", "lazy", _LAZY),
    ("all", "no-sync", _NOSYNC),
    ("all", "store-tma", _TMA),
    ("all", "lazy+no-sync", {**_LAZY, **_NOSYNC}),
    ("all", "lazy+tma", {**_LAZY, **_TMA}),
    ("all", "no-sync+tma", {**_NOSYNC, **_TMA}),
    ("all", "lazy+no-sync+tma", {**_LAZY, **_NOSYNC, **_TMA}),
    ("all", "lazy+no-sync+tma+r232", {**_LAZY, **_NOSYNC, **_TMA, **_R232}),
    ("all", "no-sync+tma+r232", {**_NOSYNC, **_TMA, **_R232}),
]
GLUON_SWEEP_SEQLENS = (4096, 8192, 16384)


def gluon_sweep_plan(seqlens=GLUON_SWEEP_SEQLENS, plan=None) -> list[tuple[int, bool, str, dict]]:
    """(S, causal, config name, launcher kwargs) of every Gluon setting the sweep times, in order."""
    return [
        (s, causal, name, kw)
        for s in seqlens
        for causal in (False, True)
        for where, name, kw in (GLUON_SWEEP if plan is None else plan)
        if where == "all" or s == 8192
    ]


def gluon_settings(kw: dict) -> dict:
    """The row's launch columns: ``kw`` over the launcher's defaults (None block_n/num_stages: D=128's)."""
    from repro.fa4.gluon_fwd import CONSUMER_REGS, LOAD_REGS, launch_config

    cfg = launch_config(HEAD_DIM, kw.get("block_n"), kw.get("num_stages"))
    return dict(
        lazy_rescale=kw.get("lazy_rescale", False),
        pingpong_sync=kw.get("pingpong_sync", True) and kw.get("num_consumers", 2) == 2,
        num_consumers=kw.get("num_consumers", 2),
        block_n=cfg["BLOCK_N"],
        num_stages=cfg["NUM_STAGES"],
        store_tma=kw.get("store_tma", False),
        load_regs=kw.get("load_regs", LOAD_REGS),
        consumer_regs=kw.get("consumer_regs", CONSUMER_REGS),
    )


GLUON_SETTING_COLUMNS = list(gluon_settings({}))


def _gluon_candidate(q, k, v, causal: bool, kw: dict, *, ref) -> Candidate:
    """The Gluon forward launched with ``kw``, checked against cuDNN's output ``ref``."""
    from repro.fa4.gluon_fwd import gluon_attention_forward

    def fwd():
        return gluon_attention_forward(q, k, v, causal=causal, **kw)[0]

    def check():
        with torch.no_grad():
            err = rel_err(fwd(), ref)
        assert err < 2e-2, f"relative error vs cuDNN {err:.1e} over 2e-2"

    return Candidate(fn=lambda: time_alone(fwd, "fwd"), check=check)


def gluon(out: Path | None, rounds: int, budget: Budget, plan=None, tag: str = "gluon-sweep") -> Report:
    """cuDNN and the Gluon forward over ``plan`` (GLUON_SWEEP by default), forward only, each setting
    checked against cuDNN's output on the same inputs; vs_baseline is against cuDNN."""
    report = Report(
        package="fa4",
        title="Gluon forward launch-setting sweep vs cuDNN (SDPA), D=128, 16 heads, B*S=16k, bf16, forward",
        peer=f"torch {torch.__version__} SDPA, cuDNN {torch.backends.cudnn.version()}",
        columns=["S", "causal", "B", *SWEEP_COLUMNS, *GLUON_SETTING_COLUMNS, "tflops"],
        packages=["triton", "torch"],
        measure_ceilings=False,
        notes=(
            "TFLOP/s: 4 B H S^2 D (halved when causal). vs_baseline: cuDNN's ms / this row's ms at the same "
            "shape (> 1 is faster than cuDNN). Each Gluon row calls repro.fa4.gluon_fwd.gluon_attention_forward "
            "directly with the row's settings; base = the launcher's defaults (block_n 128, 2 stages, two "
            "consumer warpgroups with ping-pong turn barriers, register stores, lazy rescaling off). "
            f"{rounds} interleaved rounds."
        ),
    )
    steps = gluon_sweep_plan(plan=plan)
    for s in GLUON_SWEEP_SEQLENS:
        b = max(1, TOKENS // s)
        q, k, v = (t.detach() for t in make_inputs(b, s))
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        for causal in (False, True):
            if not budget.allows(None, reserve_s=30):
                report.notes += f" S={s} causal={causal}: not run (time budget)."
                continue
            with torch.no_grad():
                ref = sdpa(qt, kt, vt, causal, "cudnn")().transpose(1, 2)
            configs = {name: kw for s_, c_, name, kw in steps if s_ == s and c_ == causal}

            build = functools.partial(_gluon_candidate, q, k, v, causal, ref=ref)
            cudnn = sdpa(qt, kt, vt, causal, "cudnn")
            rows = sweep(configs, build, peers={"sdpa-cudnn": lambda f=cudnn: time_alone(f, "fwd")},
                         baseline="sdpa-cudnn", rounds=rounds, timer=_timer_only)  # fmt: skip
            for r in rows:
                ms = r["ms"]
                cols = gluon_settings(configs[r["config"]]) if r["config"] in configs else {}
                report.add(S=s, causal=causal, B=b, **r, **cols,
                           tflops=flops(b, s, causal, "fwd") / (ms * 1e-3) / 1e12 if ms else None)  # fmt: skip
            torch.cuda.empty_cache()
        quiet_write(report, tag=tag, out_dir=out)
    for causal in (False, True):
        report.plot(title=f"Gluon forward TFLOP/s by setting, causal={causal}", x="S", y="tflops",
                    series="config", where={"causal": causal}, logx=True)  # fmt: skip
    report.write(tag=tag, out_dir=out)
    return report


# ---------------------------------------------------------------------------------------------
# bwd-fused / gluon-bwd-dq: backward configs beside cuDNN, checked against its gradients
# ---------------------------------------------------------------------------------------------

#: Configurations ``bwd-fused`` times (most promising first, by the first H100 sweep in
#: results/*-bwd-smoke.json: a budget cut drops the tail).
BWD_SWEEP = [
    "m64-n128-w8-s2",
    "m64-n128-w8-s2-dqtma",
    "m64-n128-w8-s3",
    "m64-n128-w8-s2-tma-dqtma",
    "m64-n128-w8-s2-tma",
    "m32-n128-w8-s3-tma",
    "m64-n128-w8-s3-tma",
    "m64-n128-w8-s1-tma",
    "m32-n128-w8-s2-tma",
    "m64-n64-w4-s2-tma",
    "m32-n128-w8-s2-tma-dqtma",
    "m32-n64-w4-s2-tma",
    "m128-n64-w8-s2-tma",
]


def fused_configs() -> dict[str, Switches]:
    """BWD_SWEEP's fused-backward configs behind the Gluon forward."""
    from repro.fa4.triton_bwd_fused import config_switches

    return {name: Switches(gluon=True, **config_switches(name)) for name in BWD_SWEEP}


def dq_configs() -> dict[str, Switches]:
    """The Gluon backward with dQ by TMA (the default) and by atomics (the cross-check)."""
    return variants(
        Switches(gluon=True, bwd="gluon"), {"dqatomic": {"bwd_dq_tma": False}}, baseline="gluonbwd"
    )


#: The D = 256 backward launches ``bwd-d256`` times (issue #42: the first default was 0.26-0.33x cuDNN
#: forward + backward on an H200, 2026-11-29): every (block_m, block_n, warps, stages) of the fused
#: and the FA2 backward that compiles for sm_90a (bf16, offline, 2026-11-29, ``lab/compile.py``) within
#: the 232,448 bytes of shared memory a block may use and with at most 140 bytes of register spills
#: (the screen: block_m 16-128, block_n 32/64, 4/8 warps, 1/2 stages; at 4 warps every fused launch
#: spilled 52-6,404 bytes, and of the FA2 ones only 32 x 32 in two stages kept both kernels clean). In brackets: registers, spill bytes (the two FA2 kernels: dK/dV; dQ).
D256_SWEEP = {
    "fused-m32-n32-w8-s1": ("fused", 32, 32, 8, 1),  # the first default (192 registers, 0)
    "fused-m32-n32-w8-s2": ("fused", 32, 32, 8, 2),  # (226, 0)
    "fused-m16-n32-w8-s2": ("fused", 16, 32, 8, 2),  # (182, 0)
    "fused-m16-n64-w8-s2": ("fused", 16, 64, 8, 2),  # (252, 0), 147,584 B shared
    "fused-m64-n32-w8-s1": ("fused", 64, 32, 8, 1),  # (255, 20)
    "fused-m64-n32-w8-s2": ("fused", 64, 32, 8, 2),  # (255, 24)
    "fused-m32-n64-w8-s2": ("fused", 32, 64, 8, 2),  # (255, 140); the default since this sweep
    "fa2-m64-n32-w8-s2": ("fa2", 64, 32, 8, 2),  # the first FA2 default (244, 0; 168, 0)
    "fa2-m64-n32-w8-s1": ("fa2", 64, 32, 8, 1),  # (218, 0; 254, 0)
    "fa2-m32-n32-w8-s2": ("fa2", 32, 32, 8, 2),  # (174, 0; 128, 16)
    "fa2-m32-n64-w8-s2": ("fa2", 32, 64, 8, 2),  # (255, 8; 159, 0); the FA2 default since this sweep
    "fa2-m128-n32-w8-s2": ("fa2", 128, 32, 8, 2),  # (255, 8; 255, 0)
    "fa2-m32-n32-w4-s2": ("fa2", 32, 32, 4, 2),  # (255, 0; 210, 0)
}


def screen_d256(jobs: int | None = None) -> list[dict]:
    """Every launch of :data:`D256_SWEEP` compiled offline for sm_90a (no GPU): one row per kernel
    with its shared memory, registers and spills, and ``fits`` when it stays inside a Hopper block's
    shared memory with at most 140 bytes of spills (the screen's bound). Run before spending GPU time
    on ``bwd-d256`` after the sweep or the backward kernels change (``tuning.py screen-d256``)."""
    from paperclub.lab import CPU_JOBS, HOPPER_SMEM_PER_BLOCK, offline

    cases = []
    for name, (bwd, bm, bn, nw, ns) in D256_SWEEP.items():
        base = dict(d=256, dtype="bf16", causal=True, name=name)
        if bwd == "fused":
            cases.append(dict(base, kernel="fused", launch=[bm, bn, nw, ns, False, False]))
        else:
            launch = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            cases += [dict(base, kernel=k, **launch) for k in ("bwd_dkdv", "bwd_dq")]
    rows = offline("repro.fa4.lab.compile:checks", cases, jobs=jobs or CPU_JOBS)
    for row in rows:
        row["fits"] = (
            "error" not in row
            and 0 < row.get("shared", 0) <= HOPPER_SMEM_PER_BLOCK
            and row.get("spill_stores", 0) <= 140
        )
    return rows


def d256_configs() -> dict[str, Switches]:
    """D256_SWEEP's launches as configs (the Triton forward at D = 256, its default)."""
    return {
        name: Switches(bwd=bwd, bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=nw, bwd_num_stages=ns)
        for name, (bwd, bm, bn, nw, ns) in D256_SWEEP.items()
    }


def _bwd_candidate(leaves, grad, ref, tol: float, causal: bool, cfg: Switches, *, passes: str) -> Candidate:
    """Ours with ``cfg`` timed for ``passes`` ("bwd" or "fwd+bwd"), checked against cuDNN's output and
    gradients ``ref`` within ``tol``."""
    from repro.fa4 import attention

    def f():
        return attention(*leaves, causal=causal, config=cfg)

    def check():
        errs = grad_errors(f, leaves, grad, "bshd", ref)
        over = {n: f"{e:.1e}" for n, e in errs.items() if not e <= tol}
        assert not over, f"vs cuDNN over {tol:.1e}: {over}"

    return Candidate(fn=timed_pass(passes, f, leaves, grad, inference=True), check=check)


def _bwd_shape(b: int, s: int, causal: bool, d: int = HEAD_DIM):
    """The backward sweeps' shape: (ours, SDPA's leaves, dO, cuDNN's grads, FA2's distance, tolerance)
    at head size ``d`` (the bench's inputs and check)."""
    x = AttentionInputs.of(make_inputs(b, s, d=d))
    return x.leaves, x.sdpa, x.grad, *x.reference(causal, bench.REFERENCE_AGREEMENT)


def backward_sweep(out: Path | None, rounds: int, budget: Budget, configs: dict[str, Switches], tag: str,
                   title: str, seqlens=(8192,), d: int = bench.HEAD_DIM) -> Report:  # fmt: skip
    """``configs`` beside cuDNN and FA2 (SDPA) at each S of ``seqlens``, causal and not, backward alone
    and forward + backward; every config checked first against cuDNN's output and gradients on the same
    values (bench's tolerance: 3x FA2's own distance from cuDNN, at least 2e-2)."""
    report = Report(
        package="fa4",
        title=f"{title}, D={d}, 16 heads, B*S=16k, bf16",
        peer=f"torch {torch.__version__} SDPA (cuDNN {torch.backends.cudnn.version()}, FlashAttention-2 backend)",
        columns=["pass", "causal", "S", "B", *SWEEP_COLUMNS, "tflops"],
        packages=["triton", "torch"],
        measure_ceilings=False,
        notes=(
            "vs_baseline: cuDNN's ms / this row's ms (> 1 is faster than cuDNN). pass=bwd times "
            "torch.autograd.grad on a kept graph. Each config checked against cuDNN's gradients first "
            f"(3x FA2's own distance, at least 2e-2), then timed in {rounds} interleaved rounds."
        ),
    )
    for s in seqlens:
        b = max(1, TOKENS // s)
        for causal in (False, True):
            if not budget.allows(None, reserve_s=45):
                report.notes += f" S={s} causal={causal}: not run (time budget)."
                continue
            ours_leaves, sdpa_leaves, grad, ref, _, tol = _bwd_shape(b, s, causal, d)
            grad_t = grad.transpose(1, 2).contiguous()
            for passes in ("bwd", "fwd+bwd"):
                build = functools.partial(_bwd_candidate, ours_leaves, grad, ref, tol, causal, passes=passes)
                peers = {
                    f"sdpa-{be}": Candidate(fn=timed_pass(passes, sdpa(*sdpa_leaves, causal, be), sdpa_leaves, grad_t, inference=True))
                    for be in ("cudnn", "flash2")
                }  # fmt: skip
                rows = sweep(configs, build, peers=peers, baseline="sdpa-cudnn", rounds=rounds)
                f_ = flops(b, s, causal, "fwd") * d / bench.HEAD_DIM * (3.5 if passes == "fwd+bwd" else 2.5)
                for r in rows:
                    ms = r["ms"]
                    report.add(**{"pass": passes}, causal=causal, S=s, B=b, **r,
                               tflops=f_ / (ms * 1e-3) / 1e12 if ms else None)  # fmt: skip
                    print(report.rows[-1], flush=True)
            del ours_leaves, sdpa_leaves, grad, grad_t, ref
            torch.cuda.empty_cache()
            quiet_write(report, tag=tag, out_dir=out)
    report.write(tag=tag, out_dir=out)
    return report


SWEEPS = ("launch", "gluon", "gluon-combos", "bwd-fused", "gluon-bwd-dq", "bwd-d256", "screen-d256")


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__.split("\n\n")[0], rounds=5, only=False, settings=False, tag=False)
    ap.add_argument("sweep", choices=SWEEPS)
    args = parse_bench_args(ap, argv)
    if args.sweep == "screen-d256":  # offline compiles: no GPU needed
        rows = screen_d256()
        for r in rows:
            print({k: r.get(k) for k in ("name", "kernel", "shared", "registers", "spill_stores", "fits", "error")})
        bad = [r["name"] for r in rows if not r["fits"]]
        if bad:
            raise SystemExit(f"launches that do not fit a Hopper block: {bad}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("repro.fa4.lab.tuning needs a CUDA GPU")
    out, budget = args.out, args.budget
    if args.sweep == "launch":
        launch(out, args.rounds, budget)
    elif args.sweep == "gluon":
        gluon(out, args.rounds, budget)
    elif args.sweep == "gluon-combos":
        gluon(out, args.rounds, budget, plan=GLUON_COMBOS, tag="gluon-combos")
    elif args.sweep == "bwd-fused":
        backward_sweep(
            out, args.rounds, budget, fused_configs(), "bwd-sweep", "Fused backward launch sweep vs cuDNN"
        )
    elif args.sweep == "bwd-d256":
        backward_sweep(out, args.rounds, budget, d256_configs(), "bwd-d256",
                       "D = 256 backward launches (fused and FA2) vs cuDNN", d=256)  # fmt: skip
    else:
        backward_sweep(out, args.rounds, budget, dq_configs(), "bwd-gluon-dq",
                       "Gluon backward: dQ by TMA bulk reductions vs by atomics, vs cuDNN",
                       seqlens=(8192,) if args.quick else bench.BWD_SEQLENS)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
