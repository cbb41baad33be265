"""``python -m repro.fa4.bench``: our FA4-ideas attention against cuDNN and FlashAttention-2 (SDPA), and
against flash-attn-4 (the paper's own kernels) where it runs.

Shapes follow the paper's sweep: D = 128, 16 heads, B x S = 16k tokens, S = 1k..16k, bf16, causal
and not; forward, forward + backward and the backward alone. TFLOP/s count 4 B H S^2 D for the
forward (half of it when causal), 3.5x that for forward + backward and 2.5x for the backward
(:func:`flops`, the FlashAttention convention). Every candidate is checked against cuDNN's output
(and gradients) at the shape before it is timed; candidates of one shape are timed in interleaved
rounds (``paperclub.bench.measure``), ours and the peers in one process.

Parts (``--only`` picks some; the default runs the first three, in this order, inside ``--budget-s``):

* ``bwd``: the backward comparison (:func:`bwd_compare`): forward + backward and backward alone at
  S = 4k, 8k, 16k, causal and not: ours with the Gluon backward (the default on Hopper), the fused and
  the FA2 Triton backwards, cuDNN and FA2 (SDPA); checked against cuDNN's gradients -> <device>-bwd.json.
  It gets 60% of the budget.
* ``compare``: forward and forward + backward of our default kernel, TMA on, the Gluon forward, cuDNN
  and FA2, and the ablation (:data:`ABLATIONS`: one switch of ours at a time, forward) ->
  <device>.json (:func:`full`).
* ``rescale``: the kernel's own count of rescaling steps by length (:func:`rescale`) -> <device>-rescale.json.
* ``peer``: flash-attn-4 beside cuDNN and our two forwards, forward and forward + backward
  (:func:`peer`, ``--no-fa4`` leaves flash-attn-4 out) -> <device>-peer.json.
* ``fa4-smoke``: flash-attn-4 at one small shape against float64 (:func:`fa4_smoke`); exit status 3
  when it does not import, compile or run -> <device>-fa4-smoke.json.
* ``heads``: issue #42's head sizes (:data:`HEAD_SHAPES`: 64 to 256, D_v != D) and the sliding window
  beside cuDNN and FA2 (SDPA), forward and forward + backward (:func:`heads`) -> <device>-heads.json.

``--set NAME=VALUE`` changes a field of the base :class:`repro.fa4.Switches` every one of our
candidates is built from; ``--rounds`` the interleaved rounds (default 3); ``--quick`` two lengths
(one for ``bwd``). The common options are ``paperclub.bench``'s. Tuning sweeps, the Nsight Compute
target and the offline compile reports are in ``repro/fa4/lab/`` (its README lists them).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from paperclub.bench import (
    Budget,
    Candidate,
    Report,
    apply_settings,
    bench_parser,
    error_text,
    measure,
    parse_bench_args,
    quiet_write,
    select,
    time_ms,
)
from repro.fa4.api import Switches

#: The paper's sweep: 16 heads of D = 128, B x S = 16k tokens, S = 1k..16k.
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


#: The config every one of our candidates is built from (its fields changed by ``--set``).
BASE = Switches()


def switches(changes: dict) -> dict:
    """The keyword switches of the candidate ``changes`` names, on top of :data:`BASE` (only the fields
    that differ from Switches()' defaults, so that a row's candidate reads as its changes)."""
    cfg = replace(BASE, **changes)
    default = asdict(Switches())
    return {k: v for k, v in asdict(cfg).items() if default[k] != v}


def flops(b: int, s: int, causal: bool, passes: str) -> float:
    """FLOPs of one call: 4 B H S^2 D forward (halved when causal), x3.5 for "fwd+bwd"."""
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


def ours(q, k, v, causal, changes, window=None):
    from repro.fa4 import attention

    sw = switches(changes)
    return lambda: attention(q, k, v, causal=causal, window=window, **sw)


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash2": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def fn_same_inputs(name: str, qt, kt, vt, causal: bool):
    """Our variant ``name`` on the SDPA-layout inputs (made [B, S, H, D]), to compare outputs."""
    from repro.fa4 import attention

    sw = switches(
        {"fa4-triton": {}, "fa4-triton-tma": OURS_BEST, "fa4-gluon": OURS_GLUON}.get(
            name, ABLATIONS.get(name, {})
        )
    )
    q, k, v = (t.detach().transpose(1, 2).contiguous() for t in (qt, kt, vt))
    return attention(q, k, v, causal=causal, **sw)


def _row_error(report: Report, **row) -> None:
    report.add(**row, ms=float("nan"), tflops=float("nan"))


def full(out_dir: Path | None, seqlens, ablate_passes=("fwd",), budget: Budget | None = None) -> None:
    """The comparison and the ablation (see the module docstring), shape by shape while ``budget`` lasts."""
    budget = budget or Budget(None)
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
            "flash-attn-4 is not in this table: `--only fa4-smoke` and `--only peer` (lab/gpu_run_peer.sh) measure it in a "
            "separate call, because its CuTe-DSL runtime wheel (92 MB) is carried in two halves."
        ),
    )
    skipped = []
    for causal in (False, True):
        for s in seqlens:
            if budget.left() < 60:
                skipped.append(f"S={s} causal={causal}")
                continue
            b = max(1, TOKENS // s)
            q, k, v = make_inputs(b, s)
            qt, kt, vt = make_inputs(b, s, layout="bhsd")
            for passes in ("fwd", "fwd+bwd"):
                impls = [("compare", "fa4-triton", ours(q, k, v, causal, {}), (q, k, v))]
                impls += [("compare", "fa4-triton-tma", ours(q, k, v, causal, {"tma": True}), (q, k, v))]
                # the warp-specialised Gluon forward (its backward: what bwd="auto" picks, Gluon on Hopper)
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
            quiet_write(report, out_dir=out_dir)
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


# ---------------------------------------------------------------------------------------------
# flash-attn-4, the paper's own CuTe-DSL kernels, as a peer on Hopper (lab/gpu_run_peer.sh runs this)
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
        "fa4-triton-tma": lambda q, k, v, c: attention(q, k, v, causal=c, **switches(OURS_BEST)),
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


#: Rounds of the peer comparison (``--rounds`` changes it): each shape's candidates are timed in turn
#: this many times; back-to-back single timings of one candidate moved by up to 8% on one H100.
PEER_ROUNDS = 3


def peer(out_dir: Path | None, seqlens, use_fa4: bool = True, rounds: int = PEER_ROUNDS) -> None:
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
            "fa4-gluon (ours with the warp-specialised Gluon forward and the default backward, bwd='auto': the Gluon backward on Hopper) in turn, "
            f"{rounds} rounds, "
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
                for row, ts, note in zip(rows, _interleaved_ms(timers, rounds), notes, strict=True):
                    ms = statistics.median(ts)
                    spread = f"median of {len(ts)} rounds, {min(ts):.3f}-{max(ts):.3f} ms"
                    report.add(**row, ms=ms, tflops=flops(b, s, causal, passes) / (ms * 1e-3) / 1e12,
                               note=f"{note}; {spread}" if note else spread)  # fmt: skip
                torch.cuda.empty_cache()
            print(f"done causal={causal} S={s}", flush=True)
            quiet_write(report, tag="peer", out_dir=out_dir)
    for causal in (False, True):
        for passes in ("fwd", "fwd+bwd"):
            report.plot(title=f"{passes} TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                        where={"pass": passes, "causal": causal}, logx=True)  # fmt: skip
    report.write(tag="peer", out_dir=out_dir)


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


# ---------------------------------------------------------------------------------------------
# The backward: ours (Gluon, fused, FA2) against cuDNN and FA2 (SDPA)
# ---------------------------------------------------------------------------------------------

#: Shapes of the backward comparison (D = 128, HEADS heads, B x S = TOKENS, bf16).
BWD_SEQLENS = (4096, 8192, 16384)

BWD_COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "ms_min", "ms_max", "tflops", "vs_cudnn",
               "check", "note"]  # fmt: skip


#: Our candidates in the backward comparison: the Gluon forward with each backward, and the Triton
#: forward (TMA) with the fused one. fa4-gluon-gluonbwd is what ``bwd="auto"`` runs on Hopper (the Gluon
#: backward, GPU-tested on an H100 since 2026-11-25, dQ by TMA since 2026-11-27); the others are the
#: Triton backwards, the default elsewhere.
BWD_IMPLS: dict[str, dict] = {
    "fa4-gluon-gluonbwd": {"gluon": True, "bwd": "gluon"},
    "fa4-gluon": {"gluon": True, "bwd": "fa2"},
    "fa4-gluon-fused": {"gluon": True, "bwd": "fused"},
    "fa4-triton-tma-fused": {"tma": True, "bwd": "fused"},
}


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
    budget: Budget | None = None,
    impls=None,
    tag: str = "bwd",
    rounds: int = 3,
) -> Report:
    """Forward + backward and backward alone: our backwards (BWD_IMPLS) beside cuDNN and FA2 (SDPA).

    At each shape every candidate's output and gradients are checked once against cuDNN's on the same
    values (tolerance: 3x FA2's own distance from cuDNN, at least 2e-2); candidates that pass are
    timed in ``rounds`` interleaved rounds through ``paperclub.bench.measure``. Writes
    ``<device>-<tag>.json``; shapes the budget does not reach are left out and named in the notes.
    """
    impls = BWD_IMPLS if impls is None else impls
    budget = budget or Budget(None)
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
            "fa4-triton-tma-fused = Triton forward (TMA) + fused backward; fa4-gluon-gluonbwd = Gluon forward + "
            "the warp-specialised Gluon backward (repro.fa4.gluon_bwd, bwd='auto' on Hopper); "
            "fa4-gluon-gluonbwd-dqatomic (repro.fa4.lab.tuning gluon-bwd-dq) = the same with dQ by atomics. "
            f"Interleaved: {rounds} rounds."
        ),
    )
    skipped = []
    for causal in (False, True):
        for s in seqlens:
            if budget.left() < 45:
                skipped.append(f"S={s} causal={causal}")
                continue
            b = max(1, TOKENS // s)
            print(f"bwd: S={s} causal={causal}: checking against cuDNN", flush=True)
            ours_leaves, sdpa_leaves, grad, ref, fa2_err, tol = _bwd_shape(b, s, causal)
            grad_t = grad.transpose(1, 2).contiguous()
            mine = {n: ours(*ours_leaves, causal, changes) for n, changes in impls.items()}
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
            quiet_write(report, tag=tag, out_dir=out_dir)
    if skipped:
        report.notes += f" Not measured (time budget of the run): {', '.join(skipped)}."
    for causal in (False, True):
        for passes in ("fwd+bwd", "bwd"):
            report.plot(title=f"{passes} TFLOP/s, causal={causal}", x="S", y="tflops", series="impl",
                        where={"pass": passes, "causal": causal}, logx=True)  # fmt: skip
    report.write(tag=tag, out_dir=out_dir)
    return report


# ---------------------------------------------------------------------------------------------
# Issue #42: head sizes off the tiles, v's own head size, the sliding window, beside cuDNN
# ---------------------------------------------------------------------------------------------

#: (D, D_v) of the head-size comparison: the verified tiles (64, 128) as baselines, the sizes padded
#: to them or to the 256 tile (96, 160, 192, 224), the 256 tile itself, and MLA's 192 / 128.
HEAD_SHAPES = ((64, 64), (96, 96), (128, 128), (160, 160), (192, 192), (192, 128), (224, 224), (256, 256))
#: Lengths of the head-size comparison (B x S = TOKENS, HEADS heads, bf16); ``--quick``: the first.
HEAD_SEQLENS = (4096, 8192)
#: (left, right) windows of the window rows (D = 128): 1k and 4k keys of history.
WINDOWS = ((1023, 0), (4095, 0))


def attention_flops(b: int, s_q: int, s_k: int, d: int, d_v: int, passes: str, visible: float) -> float:
    """FLOPs of one call at the caller's head sizes (not the tiles'): 2 B H S_q S_k (D + D_v) forward
    times the fraction of (query, key) pairs that are visible, x3.5 for forward + backward."""
    f = 2.0 * b * HEADS * s_q * s_k * (d + d_v) * visible
    return f * (3.5 if passes == "fwd+bwd" else 1.0)


def _visible(s: int, causal: bool, window) -> float:
    """The fraction of the S x S score matrix a causal mask or a (left, 0) window leaves."""
    if window is not None:
        left = window[0]
        return (sum(min(i, left) + 1 for i in range(s))) / (s * s)
    return (s + 1) / (2 * s) if causal else 1.0


def _head_inputs(b: int, s: int, d: int, d_v: int):
    """bf16 leaves [B, S, H, D] (v [B, S, H, D_v]) and SDPA's [B, H, S, D] copies of the same values."""
    q, k = (
        torch.randn(b, s, HEADS, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
    )
    v = torch.randn(b, s, HEADS, d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return (q, k, v), _sdpa_bwd_inputs(q, k, v)


def _sdpa_masked(qt, kt, vt, mask, backend):
    """SDPA with a boolean mask (a window), on one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

    return run


def _pass_timer(f, leaves, grad, passes: str):
    """What one timed call runs: the forward alone (no autograd graph) or forward + backward."""
    if passes == "fwd":

        def run():
            with torch.no_grad():
                return f()

        return run
    return _timer(f, leaves, grad, passes)


def _heads_rows(report, cands: dict, fixed: dict, b, s, d, d_v, causal, window, passes, rounds, layout):
    """Time ``cands`` (name -> (fn, check)) in interleaved rounds; one row each, with TFLOP/s at the
    caller's head sizes, the ratio to cuDNN and the tiles ours ran on."""
    res = measure({n: Candidate(fn=f, check=c) for n, (f, c) in cands.items()}, rounds=rounds)
    cudnn = res.get("sdpa-cudnn")
    base = cudnn.median_ms if cudnn is not None and cudnn.ok else None
    f_ = attention_flops(b, s, s, d, d_v, passes, _visible(s, causal, window))
    for name, m in res.items():
        ms = m.median_ms
        report.add(
            **fixed, impl=name, D=d, D_v=d_v, causal=causal, window=str(window) if window else "", S=s, B=b,
            **{"pass": passes}, **m.row(), tflops=f_ / (ms * 1e-3) / 1e12 if ms else None,
            vs_cudnn=base / ms if ms and base else None,
            tiles=f"{layout.tile}/{layout.tile_v}x{layout.chunks}" if name.startswith("fa4") else "",
            flops_ratio=round(layout.flops_ratio(), 3) if name.startswith("fa4") else None,
        )  # fmt: skip
        print(report.rows[-1], flush=True)


def heads(
    out_dir: Path | None, seqlens=HEAD_SEQLENS, budget: Budget | None = None, rounds: int = 3
) -> Report:
    """Issue #42's head sizes and the sliding window beside cuDNN and FA2 (SDPA), forward and forward +
    backward, ours with the default switches (D <= 128: the verified kernels on padded tiles, the
    layout in ``tiles``: tile / v's tile x chunks; D > 128: the 256 tile; a window: the window kernels).

    Each shape's candidates are checked once against cuDNN's output and gradients (tolerance 3x FA2's
    own distance from cuDNN, at least 2e-2; where cuDNN does not run, against FA2's or the
    memory-efficient backend's) and then timed in ``rounds`` interleaved rounds. TFLOP/s count the
    caller's head sizes, so a padded layout shows its padding as lower TFLOP/s (``flops_ratio``: the
    matmul work the tiles do over the caller's). Window rows: D = 128, (left, 0) windows, beside ours
    and cuDNN causal (the work a window saves) and cuDNN with the window as a boolean mask.
    Writes ``<device>-heads.json``."""
    from repro.fa4.api import head_layout
    from repro.fa4.reference import window_mask

    budget = budget or Budget(None)
    report = Report(
        package="fa4",
        title="Head sizes 64-256 (issue #42) and the sliding window: ours vs cuDNN and FA2 (SDPA), 16 heads, "
        "B*S=16k, bf16",
        peer=f"torch {torch.__version__} SDPA (cuDNN {torch.backends.cudnn.version()}, FlashAttention-2 backend)",
        columns=[
            "group",
            "impl",
            "D",
            "D_v",
            "causal",
            "window",
            "S",
            "B",
            "pass",
            "ms",
            "ms_min",
            "ms_max",
            "tflops",
            "vs_cudnn",
            "tiles",
            "flops_ratio",
            "check",
        ],  # fmt: skip
        packages=["triton", "torch"],
        measure_ceilings=False,
        notes=(
            "TFLOP/s at the caller's head sizes: 2 B H S^2 (D + D_v) per forward times the visible fraction of "
            "the scores (causal about 1/2, a (left, 0) window about left/S), x3.5 for forward + backward. "
            "vs_cudnn: cuDNN's ms / this row's (> 1 faster). tiles: the tile q and k ran on / v's tile x chunks; "
            "flops_ratio: matmul work on the tiles over the caller's (1 = no padding). fa4 = ours with the "
            "default switches (bwd='auto'). Issue #42's target: at least 0.9x cuDNN where the tile is the head "
            f"size itself (64, 128, 256); elsewhere the padding's cost is flops_ratio. group=window: D = 128, a "
            "(left, 0) window; every row's TFLOP/s count the window's work, so the causal rows (ours, cuDNN) show "
            "what the window saves as time, and sdpa-cudnn-window-mask is cuDNN given the window as a boolean "
            f"mask. Interleaved: {rounds} rounds."
        ),
    )
    skipped = []
    for causal in (False, True):
        for s in seqlens:
            for d, d_v in HEAD_SHAPES:
                if budget.left() < 30:
                    skipped.append(f"D={d} D_v={d_v} S={s} causal={causal}")
                    continue
                b = max(1, TOKENS // s)
                layout = head_layout(d, d_v)
                leaves, sdpa_leaves = _head_inputs(b, s, d, d_v)
                grad = torch.randn(b, s, HEADS, d_v, device="cuda", dtype=torch.bfloat16)
                grad_t = grad.transpose(1, 2).contiguous()
                ref = fa2 = None
                for be in ("cudnn", "flash2", "efficient"):
                    try:
                        got = _grads(sdpa(*sdpa_leaves, causal, be), sdpa_leaves, grad, "bhsd")
                    except Exception:  # this backend does not take the head sizes
                        continue
                    ref, fa2 = (got, fa2) if ref is None else (ref, got)
                if ref is None:
                    skipped.append(f"D={d} D_v={d_v} S={s} causal={causal} (no SDPA backend ran)")
                    continue
                tol = (
                    max(3 * max(rel_err(a, r) for a, r in zip(fa2, ref, strict=True)), 2e-2) if fa2 else 2e-2
                )
                mine = ours(*leaves, causal, {})
                check_msg = _check_all({"fa4": mine}, leaves, grad, ref, tol)[1].get("fa4")
                for passes in ("fwd", "fwd+bwd"):
                    cands = {
                        f"sdpa-{be}": (
                            _pass_timer(sdpa(*sdpa_leaves, causal, be), sdpa_leaves, grad_t, passes),
                            None,
                        )
                        for be in ("cudnn", "flash2")
                    }
                    cands["fa4"] = (
                        (lambda: None, _failed(check_msg))
                        if check_msg
                        else (_pass_timer(mine, leaves, grad, passes), None)
                    )
                    _heads_rows(report, cands, dict(group="heads"), b, s, d, d_v, causal, None, passes, rounds,
                                layout)  # fmt: skip
                del leaves, sdpa_leaves, grad, grad_t, ref, fa2, mine
                torch.cuda.empty_cache()
                quiet_write(report, tag="heads", out_dir=out_dir)
    for s in (seqlens[-1], 2 * seqlens[-1]):
        for window in WINDOWS:
            if budget.left() < 30 or window[0] >= s:
                continue
            b = max(1, TOKENS // s)
            layout = head_layout(HEAD_DIM, HEAD_DIM)
            leaves, sdpa_leaves = _head_inputs(b, s, HEAD_DIM, HEAD_DIM)
            grad = torch.randn_like(leaves[0])
            grad_t = grad.transpose(1, 2).contiguous()
            mask = window_mask(s, s, window[0], window[1], "cuda")
            mine = ours(*leaves, False, {}, window=window)
            try:
                ref = _grads(_sdpa_masked(*sdpa_leaves, mask, "efficient"), sdpa_leaves, grad, "bhsd")
                check_msg = _check_all({"fa4": mine}, leaves, grad, ref, 2e-2)[1].get("fa4")
            except Exception as exc:  # no reference: our rows are not timed
                check_msg = f"no reference ran: {error_text(exc)}"
            for passes in ("fwd", "fwd+bwd"):
                cands = {
                    "sdpa-cudnn": (
                        _pass_timer(sdpa(*sdpa_leaves, True, "cudnn"), sdpa_leaves, grad_t, passes),
                        None,
                    ),
                    "sdpa-cudnn-window-mask": (
                        _pass_timer(_sdpa_masked(*sdpa_leaves, mask, "cudnn"), sdpa_leaves, grad_t, passes),
                        None,
                    ),
                    "fa4-causal": (_pass_timer(ours(*leaves, True, {}), leaves, grad, passes), None),
                    "fa4-window": (
                        (lambda: None, _failed(check_msg))
                        if check_msg
                        else (_pass_timer(mine, leaves, grad, passes), None)
                    ),
                }
                _heads_rows(report, cands, dict(group="window"), b, s, HEAD_DIM, HEAD_DIM, False, window, passes,
                            rounds, layout)  # fmt: skip
            del leaves, sdpa_leaves, grad, grad_t, mask
            torch.cuda.empty_cache()
            quiet_write(report, tag="heads", out_dir=out_dir)
    if skipped:
        report.notes += f" Not measured: {', '.join(skipped)}."
    for causal in (False, True):
        report.plot(title=f"forward + backward vs cuDNN by head size, causal={causal}", x="D", y="vs_cudnn",
                    series="impl", where={"group": "heads", "pass": "fwd+bwd", "causal": causal})  # fmt: skip
    report.write(tag="heads", out_dir=out_dir)
    return report


PARTS = ("bwd", "compare", "rescale", "peer", "fa4-smoke", "heads")
DEFAULT_PARTS = ("bwd", "compare", "rescale")


def main(argv: list[str] | None = None) -> None:
    global BASE
    ap = bench_parser(__doc__.split("\n\n")[0], rounds=3, quick_help="two lengths (one for bwd)", tag=False)
    ap.add_argument("--no-fa4", action="store_true", help="peer: cuDNN and ours only, without flash-attn-4")
    args = parse_bench_args(ap, argv)
    try:
        parts = select(PARTS, args.only, what="part") if args.only else list(DEFAULT_PARTS)
        BASE = apply_settings(Switches(), args.settings)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit("repro.fa4.bench needs a CUDA GPU (an H100 for the numbers on the paper page)")
    out, budget = args.out, args.budget
    try:
        if "fa4-smoke" in parts and not fa4_smoke(out):
            raise SystemExit(3)
        if "peer" in parts:
            peer(out, (2048, 8192) if args.quick else SEQLENS, use_fa4=not args.no_fa4, rounds=args.rounds)
        if "heads" in parts:
            heads(out, HEAD_SEQLENS[:1] if args.quick else HEAD_SEQLENS, budget=budget, rounds=args.rounds)
        if "bwd" in parts:
            # first: the GPU job's budget may not reach the end of the table; 60% of it when more follows
            first = budget.part(0.6) if len(set(parts) & {"compare", "rescale"}) else budget
            bwd_compare(out, (8192,) if args.quick else BWD_SEQLENS, budget=first, rounds=args.rounds)
        seqlens = (2048, 8192) if args.quick else SEQLENS
        if "compare" in parts:
            full(out, seqlens, budget=budget)
        if "rescale" in parts and budget.left() > 60:
            rescale(out, seqlens)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
