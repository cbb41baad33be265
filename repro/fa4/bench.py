"""``python -m repro.fa4.bench``: our Triton FA4-ideas attention vs cuDNN and FlashAttention-2 (SDPA).

Shapes follow the paper's sweep: D = 128, 16 heads, B x S = 16k tokens, S = 1k..16k, bf16, causal
and not; forward and forward + backward. TFLOP/s count 4 B H S^2 D for the forward (half of it
when causal) and 3.5x that for forward + backward (backward = 2.5 forwards), the FlashAttention
convention. Every switch of the kernel is ablated one at a time against the default.

Modes:
  (default)   the backward comparison (--bwd, below) first, then the full comparison and ablation;
              writes results/<device>-bwd.json, <device>.json and <device>-rescale.json
  --sweep     launch-shape sweep (block sizes, warps, pipelining depth) -> <device>-autotune.json
  --gluon-sweep  the Gluon forward's launch settings (GLUON_SWEEP) beside cuDNN at S = 4k, 8k, 16k,
              causal and not, forward only -> <device>-gluon-sweep.json
  --gluon-combos  the same for GLUON_COMBOS (the first sweep's winners combined) -> <device>-gluon-combos.json
  --quick     two sequence lengths only (smoke test)
  --fa4-smoke flash-attn-4 (``flash_attn.cute``) on one small shape against the float64 reference;
              exit status 3 when it does not import, compile or run -> <device>-fa4-smoke.json
  --peer      flash-attn-4 beside cuDNN, our best configuration (TMA on) and ours with the Gluon
              forward (fa4-gluon), same shapes, forward and forward + backward -> <device>-peer.json
              (``--no-fa4``: cuDNN and ours only)
  --bwd       the backward comparison only: forward + backward and backward alone at S = 4k, 8k, 16k,
              causal and not: ours with the fa2, the fused and the Gluon backward (Gluon forward; and the
              Triton forward + fused), cuDNN and FA2 (SDPA); each checked against cuDNN's gradients at
              that shape, then timed in interleaved rounds -> <device>-bwd.json. The default run does
              this first, then the table above. With --gluon-bwd-dq: the current Gluon backward and its
              dQ variants (GLUON_BWD_DQ_IMPLS: TMA bulk reductions, deferred dQ product, both) beside
              cuDNN and FA2 instead -> <device>-bwd-gluon-dq.json
  --bwd-sweep the fused backward's launch configurations (bench.BWD_SWEEP over bwd_fused.FUSED_CONFIGS)
              at S = 8k beside cuDNN, causal and not, backward alone and forward + backward; prints the
              best -> <device>-bwd-sweep.json
  --budget-s N  stop starting shapes after N seconds (the GPU job passes it): the default run gives
              the backward comparison 60% of it, then the table; skipped shapes are named in the notes
  --ncu-target  one forward each of ours, cuDNN and flash-attn-4 at S = 8k inside
              cudaProfilerStart/Stop, for ``ncu --profile-from-start off`` (gpu_run_peer.sh)
  --out DIR   where to write the JSON (default repro/fa4/results/)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import io
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from paperclub.bench import Candidate, Report, measure, time_ms
from repro.fa4.gluon_bwd import DQ_DEFER, DQ_TMA, DQ_VARIANTS

HEADS = 16
HEAD_DIM = 128
TOKENS = 16384
SEQLENS = (1024, 2048, 4096, 8192, 16384)

#: One switch changed at a time against the default kernel (lazy rescaling on, hardware exp2).
ABLATIONS: dict[str, dict] = {
    "default": {},
    "no-lazy-rescale": {"lazy_rescale": False},
    "soft-exp-1/4": {"soft_exp": 1},
    "soft-exp-1/2": {"soft_exp": 2},
    "soft-exp-all": {"soft_exp": 4},
    "pingpong": {"pingpong": True},
    "persistent": {"persistent": True},
    "tma": {"tma": True},
    "tma+soft-exp-1/4": {"tma": True, "soft_exp": 1},
    "warp-specialize": {"warp_specialize": True},
    "stages-2": {"num_stages": 2},
    "stages-4": {"num_stages": 4},
}


def flops(b: int, s: int, causal: bool, passes: str) -> float:
    f = 4.0 * b * HEADS * s * s * HEAD_DIM * (0.5 if causal else 1.0)
    return f * (3.5 if passes == "fwd+bwd" else 1.0)


def make_inputs(b: int, s: int, layout: str = "bshd"):
    shape = (b, s, HEADS, HEAD_DIM) if layout == "bshd" else (b, HEADS, s, HEAD_DIM)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


def timed(fn, passes: str, inputs=None) -> float:
    """Median ms of the forward (no autograd graph) or of forward + backward to q, k, v."""
    if passes == "fwd":
        with torch.no_grad():
            return time_ms(fn)
    out = fn()
    grad = torch.randn_like(out)
    # autograd.grad rather than backward(): no .grad accumulation kernels inside the timing.
    return time_ms(lambda: torch.autograd.grad(fn(), inputs, grad))


def ours(q, k, v, causal, switches):
    from repro.fa4 import attention

    return lambda: attention(q, k, v, causal=causal, **switches)


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash2": SDPBackend.FLASH_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def fn_same_inputs(name: str, qt, kt, vt, causal: bool):
    """Our variant ``name`` on the SDPA-layout inputs (made [B, S, H, D]), to compare outputs."""
    from repro.fa4 import attention

    sw = {"fa4-triton": {}, "fa4-triton-tma": {"tma": True}, "fa4-gluon": OURS_GLUON}.get(
        name, ABLATIONS.get(name, {})
    )
    q, k, v = (t.detach().transpose(1, 2).contiguous() for t in (qt, kt, vt))
    return attention(q, k, v, causal=causal, **sw)


def _row_error(report: Report, **row) -> None:
    report.add(**row, ms=float("nan"), tflops=float("nan"))


def full(out_dir: Path | None, seqlens, ablate_passes=("fwd",), deadline: float | None = None) -> None:
    columns = ["group", "impl", "causal", "S", "B", "pass", "ms", "tflops", "note"]
    report = Report(
        package="fa4",
        title="FA4 ideas in Triton vs cuDNN and FlashAttention-2 (SDPA), D=128, 16 heads, B*S=16k, bf16",
        peer=f"torch {torch.__version__} SDPA (cuDNN {torch.backends.cudnn.version()}, FlashAttention-2 backend)",
        columns=columns,
        packages=["triton", "torch"],
        notes=(
            "TFLOP/s: 4 B H S^2 D forward (halved when causal), x3.5 for forward+backward. group=compare: "
            "our default kernel, TMA on, the warp-specialised Gluon forward (fa4-gluon) and the SDPA backends; "
            "group=ablation: one switch of our kernel changed. "
            "flash-attn-4 is not in this table: `--fa4-smoke` and `--peer` (gpu_run_peer.sh) measure it in a "
            "separate call, because its CuTe-DSL runtime wheel (92 MB) is carried in two halves."
        ),
    )
    skipped = []
    for causal in (False, True):
        for s in seqlens:
            if _budget_left(deadline) < 60:
                skipped.append(f"S={s} causal={causal}")
                continue
            b = max(1, TOKENS // s)
            q, k, v = make_inputs(b, s)
            qt, kt, vt = make_inputs(b, s, layout="bhsd")
            for passes in ("fwd", "fwd+bwd"):
                impls = [("compare", "fa4-triton", ours(q, k, v, causal, {}), (q, k, v))]
                impls += [("compare", "fa4-triton-tma", ours(q, k, v, causal, {"tma": True}), (q, k, v))]
                # the warp-specialised Gluon forward (its backward is the Triton one)
                impls += [("compare", "fa4-gluon", ours(q, k, v, causal, OURS_GLUON), (q, k, v))]
                impls += [
                    ("compare", f"sdpa-{be}", sdpa(qt, kt, vt, causal, be), (qt, kt, vt))
                    for be in ("cudnn", "flash2")
                ]
                if passes in ablate_passes:
                    impls += [
                        ("ablation", name, ours(q, k, v, causal, sw), (q, k, v))
                        for name, sw in ABLATIONS.items()
                    ]
                if passes == "fwd":  # cuDNN's output: the yardstick for a correctness check of each variant
                    with torch.no_grad():
                        ref = sdpa(qt, kt, vt, causal, "cudnn")().transpose(1, 2).float()
                for group, name, fn, inputs in impls:
                    row = dict(group=group, impl=name, causal=causal, S=s, B=b, **{"pass": passes})
                    try:
                        note = ""
                        if passes == "fwd" and not name.startswith("sdpa"):
                            with torch.no_grad():
                                out = fn_same_inputs(name, qt, kt, vt, causal)
                            err = ((out.float() - ref).norm() / ref.norm()).item()
                            note = f"rel.err vs cuDNN {err:.1e}" + ("" if err < 2e-2 else " WRONG")
                        ms = timed(fn, passes, inputs)
                        tflops = flops(b, s, causal, passes) / (ms * 1e-3) / 1e12
                        report.add(**row, ms=ms, tflops=tflops, note=note)
                    except Exception as exc:  # record and go on: one failing variant must not stop the sweep
                        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                        print(f"[{name} S={s} causal={causal} {passes}] failed: {msg}", file=sys.stderr)
                        _row_error(report, **row, note=msg)
                    torch.cuda.empty_cache()
            print(f"done causal={causal} S={s}", flush=True)
            _quiet_write(report, "", out_dir)
    if skipped:
        report.notes += f" Not measured (time budget of the run): {', '.join(skipped)}."
    for causal in (False, True):
        report.plot(title=f"forward TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                    where={"group": "compare", "pass": "fwd", "causal": causal}, logx=True)  # fmt: skip
        report.plot(title=f"forward+backward TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                    where={"group": "compare", "pass": "fwd+bwd", "causal": causal}, logx=True)  # fmt: skip
        report.plot(title=f"ablation: forward TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                    where={"group": "ablation", "pass": "fwd", "causal": causal}, logx=True)  # fmt: skip
    report.write(out_dir=out_dir)
    if _budget_left(deadline) > 60:
        rescale(out_dir, seqlens)


def rescale(out_dir: Path | None, seqlens) -> None:
    """The kernel's own count of rescaling steps on random data, by sequence length."""
    from repro.fa4 import forward_with_counts

    report = Report(
        package="fa4",
        title="Fraction of key-block steps that rescale O (kernel counter, D=128, 16 heads, bf16)",
        columns=["data", "threshold", "causal", "S", "fraction"],
        measure_ceilings=False,
        notes=(
            "Steps after each tile's first. data=randn: q, k, v ~ N(0, 1) (logit std 1.4 in log2 units); "
            "data=wide: q scaled so the logit std is 6 (log2 units). threshold=0 is the always-rescale "
            "baseline's count of steps where some row's max grew (what FA2 must rescale)."
        ),
    )
    for data, q_scale in (("randn", 1.0), ("wide", 6.0 / 1.4427)):
        for causal in (False, True):
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v = (t.detach() for t in make_inputs(b, s))
                for tau, lazy in ((8.0, True), (0.0, False)):
                    _, frac = forward_with_counts(q * q_scale, k, v, causal=causal, lazy_rescale=lazy)
                    report.add(data=data, threshold=tau, causal=causal, S=s, fraction=frac)
    report.plot(title="fraction of steps that rescale", x="S", y="fraction", series="data",
                where={"threshold": 8.0, "causal": False}, logx=True)  # fmt: skip
    report.write(tag="rescale", out_dir=out_dir)


def trial_row(report: Report, row: dict, run, flop: float, extra=None) -> dict:
    """Time one launch setting and add its row; a setting that fails to compile or run is a row with its error.

    ``run()`` returns the median ms, or (ms, note); ``extra(ms)`` gives more columns for the row.
    Prints and returns the row.
    """
    try:
        res = run()
        ms, note = res if isinstance(res, tuple) else (res, "")
        report.add(**row, ms=ms, tflops=flop / (ms * 1e-3) / 1e12, note=note, **(extra(ms) if extra else {}))
    except Exception as exc:
        report.add(
            **row, ms=float("nan"), tflops=float("nan"), note=f"{type(exc).__name__}: {str(exc)[:120]}"
        )
    print(report.rows[-1], flush=True)
    return report.rows[-1]


def sweep(out_dir: Path | None) -> None:
    """Launch shapes for forward and backward; the best become FWD_DEFAULTS / BWD_DEFAULTS."""
    columns = [
        "kernel",
        "causal",
        "S",
        "block_m",
        "block_n",
        "num_warps",
        "num_stages",
        "pingpong",
        "ms",
        "tflops",
        "note",
    ]
    report = Report(package="fa4", title="FA4 Triton launch-shape sweep (D=128, 16 heads, bf16)", columns=columns,
                    packages=["triton"], measure_ceilings=False)  # fmt: skip
    fwd_cfgs = [(128, 64, 8, st) for st in (2, 3, 4)] + [(128, 128, 8, st) for st in (2, 3)]
    fwd_cfgs += (
        [(64, 64, 4, st) for st in (2, 3, 4)] + [(64, 128, 4, st) for st in (2, 3)] + [(128, 128, 4, 2)]
    )
    pp_cfgs = [(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2)]
    s = 8192
    b = TOKENS // s
    q, k, v = make_inputs(b, s)

    def trial(row: dict, run, causal: bool) -> None:
        trial_row(report, row, run, flops(b, s, causal, row["kernel"]))

    def cfg_row(kernel: str, causal: bool, cfg: tuple, pingpong: bool) -> dict:
        bm, bn, nw, ns = cfg
        return dict(
            kernel=kernel, causal=causal, S=s, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns,
            pingpong=pingpong,
        )  # fmt: skip

    for causal in (False, True):
        for pp, cfgs in ((False, fwd_cfgs), (True, pp_cfgs)):
            for bm, bn, nw, ns in cfgs:
                sw = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, pingpong=pp)
                row = cfg_row("fwd", causal, (bm, bn, nw, ns), pp)
                trial(row, lambda sw=sw, causal=causal: timed(ours(q, k, v, causal, sw), "fwd"), causal)
        bwd_cfgs = [
            (64, 128, 8, 2),
            (64, 128, 8, 3),
            (64, 64, 4, 2),
            (32, 128, 8, 2),
            (64, 128, 4, 2),
            (128, 128, 8, 2),
        ]
        for bm, bn, nw, ns in bwd_cfgs:
            sw = dict(bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=nw, bwd_num_stages=ns)
            row = cfg_row("fwd+bwd", causal, (bm, bn, nw, ns), False)
            trial(
                row,
                lambda sw=sw, causal=causal: timed(ours(q, k, v, causal, sw), "fwd+bwd", (q, k, v)),
                causal,
            )
    report.write(tag="autotune", out_dir=out_dir)


#: Launch settings of the Gluon forward timed by --gluon-sweep (keyword arguments of
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
#: The second sweep (--gluon-combos): the knobs that won alone in the first one
#: (results/*-gluon-sweep.json: lazy rescaling, no turn barriers, TMA store, 232 registers for the
#: second consumer, each 1-7% at some shape), alone and combined, at every S, in interleaved rounds.
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
GLUON_SWEEP_COLUMNS = [
    "impl",
    "config",
    "causal",
    "S",
    "B",
    "lazy_rescale",
    "pingpong_sync",
    "num_consumers",
    "block_n",
    "num_stages",
    "store_tma",
    "load_regs",
    "consumer_regs",
    "ms",
    "tflops",
    "vs_cudnn",
    "note",
]


def gluon_sweep_plan(seqlens=GLUON_SWEEP_SEQLENS, sweep=None) -> list[tuple[int, bool, str, dict]]:
    """(S, causal, config name, launcher kwargs) of every Gluon setting the sweep times, in order."""
    return [
        (s, causal, name, kw)
        for s in seqlens
        for causal in (False, True)
        for where, name, kw in (GLUON_SWEEP if sweep is None else sweep)
        if where == "all" or s == 8192
    ]


def gluon_sweep_settings(kw: dict) -> dict:
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


def _raise(exc: BaseException):
    raise exc


def _vs(cudnn_ms: float, ms: float) -> dict:
    return dict(vs_cudnn=cudnn_ms / ms)


def _gluon_fwd(q, k, v, causal: bool, kw: dict):
    from repro.fa4.gluon_fwd import gluon_attention_forward

    return lambda: gluon_attention_forward(q, k, v, causal=causal, **kw)[0]


#: Rounds of the Gluon sweeps: every candidate of a shape (cuDNN included) is timed once per round,
#: in turn, and its row gives the median over rounds. Back-to-back single timings of the same
#: setting moved by up to 8% between two runs on one H100 (clocks, temperature); interleaving
#: makes that drift hit every candidate alike.
GLUON_SWEEP_ROUNDS = 5


def _interleaved_ms(timers: list, rounds: int) -> list[list[float]]:
    """ms of each timer (a call that times one candidate once), in turn (A B C A B C ...) ``rounds`` times,
    through the shared interleaved timer (``paperclub.bench.measure``); a timer's error is raised."""
    res = measure(
        {str(i): t for i, t in enumerate(timers)}, rounds=rounds, timer=lambda fn, warmup, rep: fn()
    )
    for key, m in res.items():
        if not m.ok:
            raise RuntimeError(f"timer {key}: {m.error}")
    return [res[str(i)].rounds for i in range(len(timers))]


def gluon_sweep(
    out_dir: Path | None, seqlens=GLUON_SWEEP_SEQLENS, sweep=None, tag: str = "gluon-sweep"
) -> None:
    """cuDNN once per shape and the Gluon forward over ``sweep`` (GLUON_SWEEP by default), forward only
    (D=128, 16 heads, bf16), written as ``<device>-<tag>.json``.

    Each Gluon setting is checked once against cuDNN's output on the same inputs (note "WRONG" past
    2e-2 relative L2 error); one that fails to compile or run is a row with its error. The others and
    cuDNN are timed in GLUON_SWEEP_ROUNDS interleaved rounds; each row is the median (the note gives
    the range).
    """
    report = Report(
        package="fa4",
        title="Gluon forward launch-setting sweep vs cuDNN (SDPA), D=128, 16 heads, B*S=16k, bf16, forward",
        peer=f"torch {torch.__version__} SDPA, cuDNN {torch.backends.cudnn.version()}",
        columns=GLUON_SWEEP_COLUMNS,
        packages=["triton", "torch"],
        measure_ceilings=False,
        notes=(
            "TFLOP/s: 4 B H S^2 D (halved when causal). vs_cudnn: cuDNN's ms / this row's ms at the same shape "
            "(> 1 is faster than cuDNN). Each Gluon row calls repro.fa4.gluon_fwd.gluon_attention_forward "
            "directly with the row's settings; base = the launcher's defaults (block_n 128, 2 stages, two "
            "consumer warpgroups with ping-pong turn barriers, register stores, lazy rescaling off)."
        ),
    )
    plan = gluon_sweep_plan(seqlens, sweep)
    for s in seqlens:
        b = max(1, TOKENS // s)
        q, k, v = (t.detach() for t in make_inputs(b, s))
        qt, kt, vt = (t.detach() for t in make_inputs(b, s, layout="bhsd"))
        for causal in (False, True):
            flop = flops(b, s, causal, "fwd")
            with torch.no_grad():  # cuDNN on our inputs: the yardstick for each setting's output
                ref = sdpa(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), causal, "cudnn")()
                ref = ref.transpose(1, 2)
            base = dict(causal=causal, S=s, B=b)
            rows = [dict(impl="sdpa-cudnn", config="cudnn", **base)]
            fns, notes = [sdpa(qt, kt, vt, causal, "cudnn")], [""]
            for _, _, name, kw in (p for p in plan if p[0] == s and p[1] == causal):
                row = dict(impl="fa4-gluon", config=name, **base, **gluon_sweep_settings(kw))
                fn = _gluon_fwd(q, k, v, causal, kw)
                try:  # compile and check once; a setting that fails is a row with its error, not timed
                    with torch.no_grad():
                        err = rel_err(fn(), ref)
                except Exception as exc:
                    trial_row(report, row, functools.partial(_raise, exc), flop)
                    continue
                rows.append(row)
                fns.append(fn)
                notes.append(f"rel.err vs cuDNN {err:.1e}" + ("" if err < 2e-2 else " WRONG"))
            times = _interleaved_ms([functools.partial(timed, f, "fwd") for f in fns], GLUON_SWEEP_ROUNDS)
            cudnn_ms = statistics.median(times[0])
            for row, ts, note in zip(rows, times, notes, strict=True):
                ms = statistics.median(ts)
                spread = f"{len(ts)} rounds, {min(ts):.3f}-{max(ts):.3f} ms"
                trial_row(report, row, lambda ms=ms, n=note, sp=spread: (ms, f"{n}; {sp}" if n else sp), flop,
                          extra=functools.partial(_vs, cudnn_ms))  # fmt: skip
            torch.cuda.empty_cache()
        _quiet_write(report, tag, out_dir)
    for causal in (False, True):
        report.plot(title=f"Gluon forward TFLOP/s by setting, causal={causal}", x="S", y="tflops",
                    series="config", where={"causal": causal}, logx=True)  # fmt: skip
    report.write(tag=tag, out_dir=out_dir)
    best = {}
    for r in report.rows:
        if r["impl"] == "fa4-gluon" and r["vs_cudnn"] is not None and r["vs_cudnn"] == r["vs_cudnn"]:
            key = (r["S"], r["causal"])
            if "WRONG" not in (r["note"] or "") and (
                key not in best or r["vs_cudnn"] > best[key]["vs_cudnn"]
            ):
                best[key] = r
    for (s, causal), r in sorted(best.items()):
        print(
            f"best S={s} causal={causal}: {r['config']} {r['tflops']:.0f} TFLOP/s, {r['vs_cudnn']:.3f}x cuDNN"
        )


# ---------------------------------------------------------------------------------------------
# flash-attn-4, the paper's own CuTe-DSL kernels, as a peer on Hopper (gpu_run_peer.sh runs this)
# ---------------------------------------------------------------------------------------------

#: Distributions whose versions go into the peer JSON.
FA4_DISTRIBUTIONS = [
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-cu13",
    "quack-kernels",
    "apache-tvm-ffi",
    "triton",
    "torch",
]
#: Our fastest forward in results/nvidia-h100-80gb-hbm3.json (S = 4k-16k): TMA on, default launch shape.
OURS_BEST = {"tma": True}
#: The warp-specialised Gluon forward (repro.fa4.gluon_fwd; sm_90 only, launched with
#: repro.fa4.GLUON_LAUNCH) and the backward bwd="auto" picks: the Gluon one on Hopper since
#: 2026-11-25 (the committed peer file, of 2026-11-23, ran the FA2 Triton backward).
OURS_GLUON = {"gluon": True}
#: (B, S, H, D) of the smoke test: small enough for a float64 reference with gradients.
SMOKE_SHAPE = (2, 512, HEADS, HEAD_DIM)
PEER_COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "tflops", "note"]


def error_text(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line (whitespace collapsed), cut to ``limit`` characters, for JSON notes."""
    msg = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_flash_attn_4():
    """(forward, version) of flash-attn-4, or (None, why the import failed).

    The forward is ``flash_attn.cute.flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...)``
    on [B, S, H, D] tensors (H_kv dividing H, scale 1/sqrt(D) by default); it returns ``(out, lse)``
    and is differentiable in ``out``. On an H100 it dispatches to its sm90 kernels.
    """
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # not installed, or its CuTe-DSL runtime does not load
        return None, f"import flash_attn.cute failed: {error_text(exc)}"
    from paperclub.bench import versions

    return flash_attn_func, versions(["flash-attn-4"])["flash-attn-4"]


def fa4_cute(fn, q, k, v, causal: bool):
    """flash-attn-4 on [B, S, H, D] inputs; the callable returns only the output, not the LSE."""

    def run():
        out = fn(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return run


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm()).item()


def _quiet_write(report: Report, tag: str, out_dir: Path | None) -> None:
    """Save the JSON so far without printing the table: a run killed by its timeout keeps its rows."""
    with contextlib.redirect_stdout(io.StringIO()):
        report.write(tag=tag, out_dir=out_dir)


def fa4_smoke(out_dir: Path | None) -> bool:
    """flash-attn-4 at SMOKE_SHAPE, forward and gradients, against float64; cuDNN and ours beside it.

    Writes <device>-fa4-smoke.json; returns whether flash-attn-4 ran. Its error, if any, is printed
    with the traceback and kept in the JSON's notes (a failure on Hopper is itself the answer).
    """
    from repro.fa4 import attention
    from repro.fa4.reference import attention_exact

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
    impls = {
        "sdpa-cudnn": lambda q, k, v, c: sdpa(*(t.transpose(1, 2) for t in (q, k, v)), c, "cudnn")().transpose(1, 2),
        "fa4-triton-tma": lambda q, k, v, c: attention(q, k, v, causal=c, **OURS_BEST),
    }  # fmt: skip
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


def _smoke_error(out_dir: Path | None) -> str:
    """The smoke test's note about flash-attn-4, if its JSON is in ``out_dir``."""
    for f in sorted((out_dir or Path(".")).glob("*-fa4-smoke.json")):
        notes = json.loads(f.read_text(encoding="utf-8")).get("notes", "")
        return notes.split("flash-attn-4 ", 1)[-1] if "flash-attn-4 " in notes else "smoke test passed"
    return "no smoke-test result found"


#: Rounds of --peer: each shape's candidates are timed in turn this many times (see GLUON_SWEEP_ROUNDS).
PEER_ROUNDS = 3


def peer(out_dir: Path | None, seqlens, use_fa4: bool = True) -> None:
    """flash-attn-4, cuDNN (SDPA) and ours (OURS_BEST) at the shapes of :func:`full`, one process.

    Each flash-attn-4 failure is recorded in its row and in the notes; after one failure for a
    (pass, causal) pair the rest of that pair is not retried (each retry would recompile).
    """
    report = Report(
        package="fa4",
        title="flash-attn-4 (CuTe-DSL) beside cuDNN (SDPA) and ours (TMA on), D=128, 16 heads, B*S=16k, bf16",
        peer=f"flash-attn-4 (flash_attn.cute.flash_attn_func); torch {torch.__version__} SDPA, cuDNN {torch.backends.cudnn.version()}",
        columns=PEER_COLUMNS,
        packages=FA4_DISTRIBUTIONS,
        measure_ceilings=False,
        notes=(
            "TFLOP/s as in the main result file (4 B H S^2 D forward, halved when causal, x3.5 for forward+backward). "
            "All timed in one process: for each shape and pass, fa4-cute, sdpa-cudnn, fa4-triton-tma and "
            "fa4-gluon (ours with the warp-specialised Gluon forward and the default backward, bwd='auto': the Gluon backward on Hopper) in turn, PEER_ROUNDS rounds, "
            "each row the median (the note gives the range); rel.err is against cuDNN's output on the same inputs."
        ),
    )
    fn, info = load_flash_attn_4() if use_fa4 else (None, f"not run (--no-fa4): {_smoke_error(out_dir)}")
    report.notes += f" flash-attn-4: {info}."
    failed: dict[tuple[str, bool], str] = {}
    for causal in (False, True):
        for s in seqlens:
            b = max(1, TOKENS // s)
            q, k, v = make_inputs(b, s)
            qt, kt, vt = make_inputs(b, s, layout="bhsd")
            # cuDNN's inputs as [B, S, H, D], for the error check against its output
            same = [t.detach().transpose(1, 2).contiguous() for t in (qt, kt, vt)]
            with torch.no_grad():
                ref = sdpa(qt, kt, vt, causal, "cudnn")().transpose(1, 2).float()
            for passes in ("fwd", "fwd+bwd"):
                impls = []
                if fn is not None:
                    impls.append(
                        ("fa4-cute", fa4_cute(fn, q, k, v, causal), (q, k, v), fa4_cute(fn, *same, causal))
                    )
                impls.append(("sdpa-cudnn", sdpa(qt, kt, vt, causal, "cudnn"), (qt, kt, vt), None))
                impls.append(("fa4-triton-tma", ours(q, k, v, causal, OURS_BEST), (q, k, v), ours(*same, causal, OURS_BEST)))  # fmt: skip
                impls.append(("fa4-gluon", ours(q, k, v, causal, OURS_GLUON), (q, k, v), ours(*same, causal, OURS_GLUON)))  # fmt: skip
                timers, rows, notes = [], [], []
                for name, f, inputs, f_same in impls:
                    row = dict(group="peer", impl=name, causal=causal, S=s, B=b, **{"pass": passes})
                    if name == "fa4-cute" and (passes, causal) in failed:
                        _row_error(report, **row, note=f"not retried: {failed[(passes, causal)][:120]}")
                        continue
                    try:  # compile (and check the output) once; a failure is a row, the rest go on
                        note = ""
                        if passes == "fwd" and f_same is not None:
                            with torch.no_grad():
                                err = rel_err(f_same(), ref)
                            note = f"rel.err vs cuDNN {err:.1e}" + ("" if err < 2e-2 else " WRONG")
                        timer = functools.partial(timed, f, passes, inputs)
                        timer()
                    except Exception as exc:  # record and go on
                        msg = error_text(exc)
                        print(f"[{name} S={s} causal={causal} {passes}] failed: {msg}", file=sys.stderr)
                        if name == "fa4-cute":
                            if not failed:
                                traceback.print_exc()
                                report.notes += (
                                    f" First flash-attn-4 failure ({passes}, causal={causal}, S={s}): {msg}"
                                )
                            failed[(passes, causal)] = msg
                        _row_error(report, **row, note=msg)
                        continue
                    timers.append(timer)
                    rows.append(row)
                    notes.append(note)
                for row, ts, note in zip(rows, _interleaved_ms(timers, PEER_ROUNDS), notes, strict=True):
                    ms = statistics.median(ts)
                    spread = f"median of {len(ts)} rounds, {min(ts):.3f}-{max(ts):.3f} ms"
                    report.add(**row, ms=ms, tflops=flops(b, s, causal, passes) / (ms * 1e-3) / 1e12,
                               note=f"{note}; {spread}" if note else spread)  # fmt: skip
                torch.cuda.empty_cache()
            print(f"done causal={causal} S={s}", flush=True)
            _quiet_write(report, "peer", out_dir)
    for causal in (False, True):
        for passes in ("fwd", "fwd+bwd"):
            report.plot(title=f"{passes} TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                        where={"pass": passes, "causal": causal}, logx=True)  # fmt: skip
    report.write(tag="peer", out_dir=out_dir)


# ---------------------------------------------------------------------------------------------
# The backward: fused (FA3's one-pass schedule) against fa2 (two kernels), cuDNN and FA2 (SDPA)
# ---------------------------------------------------------------------------------------------

#: Shapes of the backward comparison (D = 128, HEADS heads, B x S = TOKENS, bf16).
BWD_SEQLENS = (4096, 8192, 16384)
#: Rounds of the backward comparison and the sweep (every candidate timed once per round, in turn).
BWD_ROUNDS = 3
BWD_COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "ms_min", "ms_max", "tflops", "vs_cudnn",
               "check", "note"]  # fmt: skip
#: Our candidates in the backward comparison: the Gluon forward with each backward, and the Triton
#: forward (TMA) with the fused one.
BWD_IMPLS: dict[str, dict] = {
    "fa4-gluon": {"gluon": True, "bwd": "fa2"},
    "fa4-gluon-fused": {"gluon": True, "bwd": "fused"},
    "fa4-triton-tma-fused": {"tma": True, "bwd": "fused"},
}
#: Gluon forward + the warp-specialised Gluon backward (repro.fa4.gluon_bwd; Hopper only). Not yet run
#: on a GPU: timed only with --gluon-bwd, after its GPU tests have passed (a wrong result is recorded
#: as its rows' check, but a hang or a memory fault would take the other rows of the run with it).
GLUON_BWD_IMPLS: dict[str, dict] = {"fa4-gluon-gluonbwd": {"gluon": True, "bwd": "gluon"}}
#: The Gluon backward's dQ variants (repro.fa4.gluon_bwd.DQ_VARIANTS; off by default, written and
#: compiled offline, not yet run on a GPU), timed beside the current Gluon backward and cuDNN with
#: --gluon-bwd-dq (run ``python -m repro.fa4.gluon_bwd --sweep - 300 matrix <variant>`` first: a fault
#: here takes the whole run down). -dqtma: dQ by TMA bulk reductions; -dqdefer: the dQ product a step
#: later, off the dS^T exchange's barrier; -dqtma-defer: both (FA3's way).
GLUON_BWD_DQ_IMPLS: dict[str, dict] = {
    f"fa4-gluon-gluonbwd-dq{variant}": {
        "gluon": True,
        "bwd": "gluon",
        "bwd_dq_tma": tma,
        "bwd_dq_defer": defer,
    }
    for variant, (tma, defer) in DQ_VARIANTS.items()
    if (tma, defer) != (DQ_TMA, DQ_DEFER)  # the default Gluon backward: GLUON_BWD_IMPLS' row
}


def gluon_bwd_dq_impls(names: str) -> dict[str, dict]:
    """The rows of GLUON_BWD_DQ_IMPLS for comma-separated dQ variant names (``tma,defer``); an
    unknown name is an error naming the known ones."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [k.removeprefix("fa4-gluon-gluonbwd-dq") for k in GLUON_BWD_DQ_IMPLS]
    bad = [n for n in wanted if n not in known]
    if bad or not wanted:
        raise SystemExit(f"--gluon-bwd-dq: unknown variant(s) {bad or names!r}; known: {', '.join(known)}")
    return {f"fa4-gluon-gluonbwd-dq{n}": GLUON_BWD_DQ_IMPLS[f"fa4-gluon-gluonbwd-dq{n}"] for n in wanted}


#: Configurations the --bwd-sweep times (most promising first, by the first H100 sweep in
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


def _sdpa_bwd_inputs(q, k, v):
    """Contiguous [B, H, S, D] copies of q, k, v (SDPA's layout) holding the same values, as leaves."""
    return [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]


def _grads(out_fn, leaves, grad, layout: str):
    """Output and (dq, dk, dv) of one call, as float32 [B, S, H, D]."""
    out = out_fn()
    grads = torch.autograd.grad(out, leaves, grad if layout == "bshd" else grad.transpose(1, 2))
    to = (lambda t: t.float()) if layout == "bshd" else (lambda t: t.transpose(1, 2).float())
    return [to(t) for t in (out, *grads)]


def _grad_errors(out_fn, leaves, grad, layout, ref) -> dict[str, float]:
    """Relative L2 errors of the output and dq, dk, dv of one call against ``ref`` (cuDNN's)."""
    got = _grads(out_fn, leaves, grad, layout)
    return {n: rel_err(a, r) for n, a, r in zip(("o", "dq", "dk", "dv"), got, ref, strict=True)}


def _timer(f, leaves, grad, passes: str):
    """What one timed call runs: forward + backward, or ("bwd") the backward alone from a kept graph."""
    if passes == "fwd+bwd":
        return lambda: torch.autograd.grad(f(), leaves, grad)
    out = f()
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def _failed(msg: str):
    """A Candidate check that fails with ``msg`` (the candidate failed its check or did not run)."""

    def check():
        raise AssertionError(msg)

    return check


def _budget_left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.monotonic()


def _bwd_shape(b: int, s: int, causal: bool):
    """Inputs of one shape (ours [B, S, H, D], SDPA's [B, H, S, D] copies of the same values, dO),
    cuDNN's output and gradients, FA2's (SDPA) largest distance from them, and the check tolerance:
    3x that distance, at least 2e-2."""
    q, k, v = make_inputs(b, s)
    sdpa_leaves = _sdpa_bwd_inputs(q, k, v)
    grad = torch.randn_like(q)
    ref = _grads(sdpa(*sdpa_leaves, causal, "cudnn"), sdpa_leaves, grad, "bhsd")
    fa2 = _grads(sdpa(*sdpa_leaves, causal, "flash2"), sdpa_leaves, grad, "bhsd")
    fa2_err = max(rel_err(a, r) for a, r in zip(fa2, ref, strict=True))
    return (q, k, v), sdpa_leaves, grad, ref, fa2_err, max(3 * fa2_err, 2e-2)


def _check_all(fns: dict, leaves, grad, ref, tol: float) -> tuple[dict, dict]:
    """Compile and check each of our candidates once: (errors by name, failure message by name)."""
    errs, bad = {}, {}
    for name, f in fns.items():
        try:
            errs[name] = _grad_errors(f, leaves, grad, "bshd", ref)
            over = {n: f"{e:.1e}" for n, e in errs[name].items() if not e <= tol}
            if over:
                bad[name] = f"vs cuDNN over {tol:.1e}: {over}"
        except Exception as exc:  # fails to compile or run: its rows say why
            bad[name] = error_text(exc)
        print(
            f"  check {name}: {bad.get(name) or {n: f'{e:.1e}' for n, e in errs[name].items()}}", flush=True
        )
    return errs, bad


def _bwd_rows(report, res, errs, fixed: dict, b, s, causal, passes, extra=None) -> None:
    """One row per measured candidate (``res`` from ``measure``), with TFLOP/s and the ratio to cuDNN."""
    cudnn_ms = res["sdpa-cudnn"].median_ms
    f_ = flops(b, s, causal, "fwd") * (3.5 if passes == "fwd+bwd" else 2.5)
    for name, m in res.items():
        ms = m.median_ms
        note = ", ".join(f"{n} {e:.1e}" for n, e in errs.get(name, {}).items())
        report.add(
            **fixed, impl=name, causal=causal, S=s, B=b, **{"pass": passes}, **m.row(),
            tflops=f_ / (ms * 1e-3) / 1e12 if ms else None,
            vs_cudnn=cudnn_ms / ms if ms and cudnn_ms else None,
            note=f"rel.err vs cuDNN: {note}" if note else "", **(extra(name) if extra else {}),
        )  # fmt: skip
        print(report.rows[-1], flush=True)


def bwd_compare(
    out_dir: Path | None,
    seqlens=BWD_SEQLENS,
    deadline: float | None = None,
    impls=None,
    tag: str = "bwd",
    rounds: int = BWD_ROUNDS,
) -> Report:
    """Forward + backward and backward alone: our backwards (BWD_IMPLS) beside cuDNN and FA2 (SDPA).

    At each shape every candidate's output and gradients are checked once against cuDNN's on the same
    values (tolerance: 3x FA2's own distance from cuDNN, at least 2e-2); candidates that pass are
    timed in ``rounds`` interleaved rounds through ``paperclub.bench.measure``. Writes
    ``<device>-<tag>.json``; shapes past the deadline are left out and named in the notes.
    """
    impls = BWD_IMPLS if impls is None else impls
    report = Report(
        package="fa4",
        title="Backward: fused (FA3 schedule) vs fa2 (two kernels) vs cuDNN and FA2 (SDPA), D=128, 16 heads, "
        "B*S=16k, bf16",
        peer=f"torch {torch.__version__} SDPA (cuDNN {torch.backends.cudnn.version()}, FlashAttention-2 backend)",
        columns=BWD_COLUMNS,
        packages=["triton", "torch"],
        measure_ceilings=False,
        notes=(
            "TFLOP/s: 4 B H S^2 D per forward (halved when causal); forward+backward x3.5, backward alone x2.5. "
            "pass=bwd times torch.autograd.grad on a kept graph (the backward kernels alone, with their "
            "preprocess). vs_cudnn: cuDNN's ms / this row's ms (> 1 is faster). check: output and "
            "gradients against cuDNN's on the same inputs, tolerance 3x the FA2 backend's own distance "
            "from cuDNN (at least 2e-2). fa4-gluon = Gluon forward + fa2 backward (the previous default "
            "pairing); fa4-gluon-fused = Gluon forward + fused backward (FUSED_DEFAULTS); "
            "fa4-triton-tma-fused = Triton forward (TMA) + fused backward; fa4-gluon-gluonbwd (only with --gluon-bwd) = Gluon forward + "
            "the warp-specialised Gluon backward (repro.fa4.gluon_bwd); fa4-gluon-gluonbwd-dq* (only with --gluon-bwd-dq) = "
            "the same with its dQ variants (dqtma: TMA bulk reductions; dqdefer: dQ product a step later; both). "
            f"Interleaved: {rounds} rounds."
        ),
    )
    skipped = []
    for causal in (False, True):
        for s in seqlens:
            if _budget_left(deadline) < 45:
                skipped.append(f"S={s} causal={causal}")
                continue
            b = max(1, TOKENS // s)
            print(f"bwd: S={s} causal={causal}: checking against cuDNN", flush=True)
            ours_leaves, sdpa_leaves, grad, ref, fa2_err, tol = _bwd_shape(b, s, causal)
            grad_t = grad.transpose(1, 2).contiguous()
            mine = {n: ours(*ours_leaves, causal, sw) for n, sw in impls.items()}
            errs, bad = _check_all(mine, ours_leaves, grad, ref, tol)
            errs["sdpa-flash2"] = {"max": fa2_err}
            for passes in ("fwd+bwd", "bwd"):
                cands = {
                    f"sdpa-{be}": Candidate(
                        fn=_timer(sdpa(*sdpa_leaves, causal, be), sdpa_leaves, grad_t, passes)
                    )
                    for be in ("cudnn", "flash2")
                }
                for name, f in mine.items():
                    if name in bad:
                        cands[name] = Candidate(fn=lambda: None, check=_failed(bad[name]))
                    else:
                        cands[name] = Candidate(fn=_timer(f, ours_leaves, grad, passes))
                res = measure(cands, rounds=rounds)
                _bwd_rows(report, res, errs, dict(group="bwd"), b, s, causal, passes)
                del cands, res
            del mine, ref, ours_leaves, sdpa_leaves, grad, grad_t
            torch.cuda.empty_cache()
            _quiet_write(report, tag, out_dir)
    if skipped:
        report.notes += f" Not measured (time budget of the run): {', '.join(skipped)}."
    for causal in (False, True):
        for passes in ("fwd+bwd", "bwd"):
            report.plot(title=f"{passes} TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                        where={"pass": passes, "causal": causal}, logx=True)  # fmt: skip
    report.write(tag=tag, out_dir=out_dir)
    return report


def bwd_sweep(
    out_dir: Path | None, deadline: float | None = None, s: int = 8192, configs=None, rounds: int = BWD_ROUNDS
) -> Report:
    """The fused backward's launch configurations (BWD_SWEEP) at S = ``s`` beside cuDNN, causal and not:
    the backward alone and forward + backward (Gluon forward), checked against cuDNN's gradients,
    interleaved rounds. Writes ``<device>-bwd-sweep.json`` and prints the best configuration per case."""
    from repro.fa4.bwd_fused import config_switches

    configs = BWD_SWEEP if configs is None else configs
    report = Report(
        package="fa4",
        title=f"Fused backward launch sweep vs cuDNN, S={s}, D=128, 16 heads, B*S=16k, bf16",
        peer=f"torch {torch.__version__} SDPA, cuDNN {torch.backends.cudnn.version()}",
        columns=["config", *BWD_COLUMNS],
        packages=["triton", "torch"],
        measure_ceilings=False,
        notes=(
            "Each config: repro.fa4.bwd_fused.FUSED_CONFIGS[config] (block_m, block_n, num_warps, "
            "num_stages, TMA loads of Q/dO, dQ by TMA reductions) behind the Gluon forward. "
            "vs_cudnn > 1 is faster than cuDNN. Checked against cuDNN's gradients as in the -bwd table."
        ),
    )
    b = max(1, TOKENS // s)
    best: dict = {}
    for causal in (False, True):
        ours_leaves, sdpa_leaves, grad, ref, _, tol = _bwd_shape(b, s, causal)
        grad_t = grad.transpose(1, 2).contiguous()
        cudnn = sdpa(*sdpa_leaves, causal, "cudnn")
        mine = {}
        for name in configs:
            if _budget_left(deadline) < 30:
                report.notes += f" {name} (causal={causal}) not run: time budget."
                continue
            mine[name] = ours(*ours_leaves, causal, {"gluon": True, **config_switches(name)})
        errs, bad = _check_all(mine, ours_leaves, grad, ref, tol)
        for passes in ("bwd", "fwd+bwd"):
            cands = {"sdpa-cudnn": Candidate(fn=_timer(cudnn, sdpa_leaves, grad_t, passes))}
            for name, f in mine.items():
                if name in bad:
                    cands[name] = Candidate(fn=lambda: None, check=_failed(bad[name]))
                else:
                    cands[name] = Candidate(fn=_timer(f, ours_leaves, grad, passes))
            res = measure(cands, rounds=rounds)
            _bwd_rows(report, res, errs, dict(group="bwd-sweep"), b, s, causal, passes,
                      extra=lambda n: {"config": "" if n == "sdpa-cudnn" else n})  # fmt: skip
            cudnn_ms = res["sdpa-cudnn"].median_ms
            ratios = {n: cudnn_ms / m.median_ms for n, m in res.items() if n != "sdpa-cudnn" and m.median_ms}
            if ratios and cudnn_ms:
                top = max(ratios, key=ratios.get)
                best[(passes, causal)] = (top, ratios[top])
            del cands, res
        del mine, ref, ours_leaves, sdpa_leaves, grad, grad_t, cudnn
        torch.cuda.empty_cache()
        _quiet_write(report, "bwd-sweep", out_dir)
    summary = "; ".join(f"{p} causal={c}: {n} {vs:.3f}x cuDNN" for (p, c), (n, vs) in sorted(best.items()))
    report.notes += f" Best: {summary}." if summary else " No configuration ran."
    print("best:", summary, flush=True)
    report.write(tag="bwd-sweep", out_dir=out_dir)
    return report


def ncu_target(use_fa4: bool = True, s: int = 8192, causal: bool = False) -> None:
    """One forward each of ours (OURS_BEST and OURS_GLUON), cuDNN and flash-attn-4 between cudaProfilerStart/Stop.

    Three untimed calls first compile and warm each; run under ``ncu --profile-from-start off`` so
    that only the measured calls (and their small helper kernels, e.g. a fill) are profiled.
    """
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
                for _ in range(3):
                    f()
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                f()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print(
                    f"ncu-target: profiled one forward of {name} (S={s}, B={b}, causal={causal})", flush=True
                )
            except Exception as exc:
                print(f"ncu-target: {name} failed: {error_text(exc)}", flush=True)


#: What the ncu summary prints: a label and the raw-page metric names to try, first found wins.
NCU_SUMMARY: dict[str, tuple[str, ...]] = {
    "duration (us)": ("gpu__time_duration.sum",),
    "registers/thread": ("launch__registers_per_thread",),
    "dyn. shared mem/block (B)": ("launch__shared_mem_per_block_dynamic",),
    "achieved occupancy %": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "tensor pipe %": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",),
    "tensor GMMA inst. %": ("sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",),
    "XU (MUFU, exp2) pipe %": (
        "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    ),
    "FMA pipe %": (
        "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    ),
    "ALU pipe %": ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",),
    "issue slots busy %": (
        "sm__inst_issued.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
    ),
    "SM throughput %": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "DRAM throughput %": (
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",  # the name ncu 2025 prints
    ),
    # Clocks are not locked under --clock-control none: compare kernels in cycles, not microseconds.
    "SM cycles active": ("sm__cycles_active.avg",),
}


#: ncu's time units (it scales them per metric unless told --print-units base) in microseconds.
TIME_UNITS_IN_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def ncu_summary(csv_text: str, top_stalls: int = 4) -> list[dict]:
    """ncu's ``--csv --page raw`` output reduced to the metrics of NCU_SUMMARY, one dict per kernel.

    Each dict has ``kernel`` (the name, cut to 60 characters), the NCU_SUMMARY labels (None where the
    report lacks every candidate metric) and ``stalls``: the ``top_stalls`` largest
    ``smsp__average_warps_issue_stalled_*_per_issue_active.ratio`` values as "reason ratio" strings
    (``selected``, the issuing warp itself, left out).
    Lines that ncu prefixes with ``==`` and the units row are skipped.
    """
    lines = [ln for ln in csv_text.splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header, out = rows[0], []
    for r in rows[1:]:
        rec = dict(zip(header, r, strict=False))
        if not rec.get("ID", "").strip().isdigit():  # the units row
            continue
        item: dict = {"kernel": rec.get("Kernel Name", "?")[:60]}
        for label, names in NCU_SUMMARY.items():
            item[label] = next((_number(rec[n]) for n in names if rec.get(n, "") != ""), None)
        if isinstance(item["duration (us)"], float):
            unit = _units(rows, header, "gpu__time_duration.sum")
            item["duration (us)"] *= TIME_UNITS_IN_US.get(unit, float("nan"))
        stalls = []
        for name, val in rec.items():
            if name.startswith("smsp__average_warps_issue_stalled_") and name.endswith(
                "_per_issue_active.ratio"
            ):
                v = _number(val)
                reason = name.removeprefix("smsp__average_warps_issue_stalled_").removesuffix(
                    "_per_issue_active.ratio"
                )
                # "selected" is the warp that issued (always 1 per issue), not a stall.
                if isinstance(v, float) and reason != "selected":
                    stalls.append((v, reason))
        item["stalls"] = [f"{reason} {v:.2f}" for v, reason in sorted(stalls, reverse=True)[:top_stalls]]
        out.append(item)
    return out


def print_ncu_summary(csv_text: str) -> None:
    """The ncu summary as a markdown table, one row per profiled kernel."""
    from paperclub.bench import markdown_table

    items = ncu_summary(csv_text)
    if not items:
        print("ncu summary: no kernels in the report")
        return
    print(markdown_table(list(items[0]), [{**i, "stalls": "; ".join(i["stalls"])} for i in items]))


def _units(rows: list[list[str]], header: list[str], column: str) -> str:
    if len(rows) > 1 and column in header and not rows[1][0].strip().isdigit():
        return rows[1][header.index(column)]
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--gluon-sweep", action="store_true")
    parser.add_argument("--gluon-combos", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fa4-smoke", action="store_true")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--no-fa4", action="store_true")
    parser.add_argument("--ncu-target", action="store_true")
    parser.add_argument("--ncu-summary", type=Path, default=None, metavar="CSV")
    parser.add_argument(
        "--bwd", action="store_true", help="the backward comparison only (-> <device>-bwd.json)"
    )
    parser.add_argument(
        "--gluon-bwd",
        action="store_true",
        help="with --bwd: also time the Gluon backward explicitly (fa4-gluon-gluonbwd; GPU-tested on an H100, 2026-11-25)",
    )
    parser.add_argument(
        "--bwd-rounds",
        type=int,
        default=BWD_ROUNDS,
        help=f"interleaved rounds of --bwd and --bwd-sweep (default {BWD_ROUNDS})",
    )
    parser.add_argument(
        "--gluon-bwd-dq",
        nargs="?",
        const=",".join(k.removeprefix("fa4-gluon-gluonbwd-dq") for k in GLUON_BWD_DQ_IMPLS),
        default=None,
        metavar="VARIANT,...",
        help="with --bwd: the current Gluon backward and its dQ variants (GLUON_BWD_DQ_IMPLS; all, or those "
        "named, e.g. tma,defer) beside cuDNN, instead of BWD_IMPLS",
    )
    parser.add_argument(
        "--bwd-sweep",
        action="store_true",
        help="the fused backward's launch configurations at S=8k (-> <device>-bwd-sweep.json)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget: shapes that would start after it are skipped and named in the notes",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)  # fmt: skip
    if args.bwd_rounds < 1:
        parser.error(f"--bwd-rounds must be at least 1, got {args.bwd_rounds}")
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    if args.ncu_summary is not None:  # reads a file: no GPU needed
        print_ncu_summary(args.ncu_summary.read_text(encoding="utf-8", errors="replace"))
        return
    if not torch.cuda.is_available():
        raise SystemExit("repro.fa4.bench needs a CUDA GPU (an H100 for the numbers on the paper page)")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    try:
        if args.sweep:
            sweep(out)
        elif args.gluon_sweep:
            gluon_sweep(out)
        elif args.gluon_combos:
            gluon_sweep(out, sweep=GLUON_COMBOS, tag="gluon-combos")
        elif args.fa4_smoke:
            if not fa4_smoke(out):
                raise SystemExit(3)
        elif args.peer:
            peer(out, (2048, 8192) if args.quick else SEQLENS, use_fa4=not args.no_fa4)
        elif args.ncu_target:
            ncu_target(use_fa4=not args.no_fa4)
        elif args.bwd:
            impls = {**BWD_IMPLS, **GLUON_BWD_IMPLS} if args.gluon_bwd else None
            if args.gluon_bwd_dq:
                impls = {**GLUON_BWD_IMPLS, **gluon_bwd_dq_impls(args.gluon_bwd_dq)}
            bwd_compare(out, (8192,) if args.quick else BWD_SEQLENS, deadline=deadline, impls=impls,
                        rounds=args.bwd_rounds,
                        tag="bwd-gluon-dq" if args.gluon_bwd_dq else "bwd")  # fmt: skip
        elif args.bwd_sweep:
            bwd_sweep(out, deadline=deadline, rounds=args.bwd_rounds)
        else:
            # the backward comparison first (the GPU job's budget may not reach the end of the table)
            if args.budget_s is None:
                bwd_deadline = None
            else:
                bwd_deadline = time.monotonic() + 0.6 * args.budget_s
            bwd_compare(
                out, (8192,) if args.quick else BWD_SEQLENS, deadline=bwd_deadline, rounds=args.bwd_rounds
            )
            full(out, (2048, 8192) if args.quick else SEQLENS, deadline=deadline)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
