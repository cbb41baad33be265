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
* ``rescale``: the kernel's own count of rescaling steps by length -> <device>-rescale.json; a lab
  tool, ``repro.fa4.lab.rescale``, run from here (when a minute of the budget is left).
* ``peer``: flash-attn-4 beside cuDNN and our two forwards, forward and forward + backward
  (``repro.fa4.peer``, with flash-attn-4's import; ``--no-fa4`` leaves it out) -> <device>-peer.json.
* ``fa4-smoke``: flash-attn-4 at one small shape against float64; exit status 3 when it does not
  import, compile or run -> <device>-fa4-smoke.json; a lab tool, ``repro.fa4.lab.fa4_smoke``, run
  from here.
* ``heads``: issue #42's head sizes (:data:`HEAD_SHAPES`: 64 to 256, D_v != D) and the sliding window
  beside cuDNN and FA2 (SDPA), forward and forward + backward (:func:`heads`) -> <device>-heads.json.

``--set NAME=VALUE`` changes a field of the base :class:`repro.fa4.Switches` every one of our
candidates is built from; ``--rounds`` the interleaved rounds (default 3); ``--quick`` two lengths
(one for ``bwd``). The common options are ``paperclub.bench``'s. Tuning sweeps, the Nsight Compute
target, the offline compile reports and the two diagnostic parts are in ``repro/fa4/lab/`` (its
README lists them).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from paperclub.bench import (
    AttentionInputs,
    Budget,
    Report,
    add_measured_rows,
    apply_settings,
    bench_parser,
    error_text,
    measure,
    parse_bench_args,
    plot_tflops_by_length,
    quiet_write,
    reference_tolerance,
    sdpa,
    sdpa_reference,
    select,
    time_alone,
    within_budget,
)
from paperclub.testing import rel_error as rel_err
from repro.fa4.api import Switches

# the part ``peer`` and flash-attn-4's import, adapter and smoke verdict (read from here by the tests)
from repro.fa4.peer import fa4_cute, load_flash_attn_4, peer  # noqa: F401
from repro.fa4.peer import smoke_error as _smoke_error  # noqa: F401

# the shapes, FLOPs, inputs and rows the part ``peer`` shares with the others
from repro.fa4.shapes import (
    COLUMNS,
    HEAD_DIM,
    HEADS,
    OURS_BEST,
    OURS_GLUON,
    SEQLENS,
    TOKENS,
    TRITON,
    _err_note,
    _report,
    _row_error,
    _shapes,
    flops,
    make_inputs,
)

#: One switch of the Triton forward changed at a time against its defaults (lazy rescaling on, hardware
#: exp2): FA4's ideas one by one, on the kernel that has them all as switches.
ABLATIONS: dict[str, dict] = {
    name: {**TRITON, **changes}
    for name, changes in {
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
    }.items()
}

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

#: Shapes of the backward comparison (D = 128, HEADS heads, B x S = TOKENS, bf16).
BWD_SEQLENS = (4096, 8192, 16384)

#: (D, D_v) of the head-size comparison: the verified tiles (64, 128) as baselines, the sizes padded
#: to them or to the 256 tile (96, 160, 192, 224), the 256 tile itself, and MLA's 192 / 128.
HEAD_SHAPES = ((64, 64), (96, 96), (128, 128), (160, 160), (192, 192), (192, 128), (224, 224), (256, 256))
#: Lengths of the head-size comparison (B x S = TOKENS, HEADS heads, bf16); ``--quick``: the first.
HEAD_SEQLENS = (4096, 8192)
#: (left, right) windows of the window rows (D = 128): 1k and 4k keys of history.
WINDOWS = ((1023, 0), (4095, 0))

BWD_COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "ms_min", "ms_max", "tflops", "vs_cudnn"]
BWD_COLUMNS += ["check", "note"]
HEADS_COLUMNS = ["group", "impl", "D", "D_v", "causal", "window", "S", "B", "pass", "ms", "ms_min", "ms_max"]
HEADS_COLUMNS += ["tflops", "vs_cudnn", "tiles", "flops_ratio", "check"]


def switches(changes: dict, base: Switches | None = None) -> dict:
    """The keyword switches of the candidate ``changes`` names, on top of ``base`` (the config every one
    of our candidates is built from: ``--set``'s, default ``Switches()``; only the fields that differ
    from Switches()' defaults, so that a row's candidate reads as its changes)."""
    cfg = replace(Switches() if base is None else base, **changes)
    default = asdict(Switches())
    return {k: v for k, v in asdict(cfg).items() if default[k] != v}


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


# ---------------------------------------------------------------------------------------------
# Inputs and candidates: ours (SDPA's backends: paperclub.bench.sdpa; flash-attn-4: repro.fa4.peer)
# ---------------------------------------------------------------------------------------------


def _inputs(b: int, s: int, d: int = HEAD_DIM, d_v: int | None = None) -> AttentionInputs:
    """:func:`make_inputs` with SDPA's copies of the same values and dO (``paperclub.bench``)."""
    return AttentionInputs.of(make_inputs(b, s, d=d, d_v=d_v))


def ours(q, k, v, causal, changes, window=None, base: Switches | None = None):
    from repro.fa4 import attention

    sw = switches(changes, base)
    return lambda: attention(q, k, v, causal=causal, window=window, **sw)


# ---------------------------------------------------------------------------------------------
# The checks against cuDNN, the rows' notes and columns, the shapes within the budget
# ---------------------------------------------------------------------------------------------


#: The most two SDPA backends may disagree (relative L2, any of o, dq, dk, dv) for either to be the
#: yardstick: bf16 rounding gives about 3e-3. Above it (on an H200, 2026-11-29, cuDNN's gradients came
#: out uncorrelated with FA2's and ours, 1.4 relative, in a run where the peer part had timed cuDNN at
#: the same shape first; the cause is not established) a tolerance of 3x the distance would pass
#: anything, so the check fails instead.
REFERENCE_AGREEMENT = 5e-2


def _tolerance(yardstick_err: float) -> float:
    """The check's tolerance from the yardstick's distance to the reference: 3x it, at least 2e-2;
    a distance over REFERENCE_AGREEMENT raises (no trustworthy reference at this shape)."""
    return reference_tolerance(yardstick_err, REFERENCE_AGREEMENT)


def _errors_note(errs: dict, name: str) -> dict:
    """The note of a backward row: the candidate's errors against cuDNN's output and gradients."""
    note = ", ".join(f"{n} {e:.1e}" for n, e in errs.get(name, {}).items())
    return {"note": f"rel.err vs cuDNN: {note}" if note else ""}


def _tiles(layout, name: str) -> dict:
    """The tiles columns of a head-size row: the layout ours ran on (the peers': none)."""
    if not name.startswith("fa4"):
        return {"tiles": "", "flops_ratio": None}
    return {
        "tiles": f"{layout.tile}/{layout.tile_v}x{layout.chunks}",
        "flops_ratio": round(layout.flops_ratio(), 3),
    }


def _head_shape_name(shape) -> str:
    causal, s, (d, d_v) = shape
    return f"D={d} D_v={d_v} S={s} causal={causal}"


# ---------------------------------------------------------------------------------------------
# compare: the comparison and the ablation
# ---------------------------------------------------------------------------------------------


def full(
    out_dir: Path | None,
    seqlens,
    ablate_passes=("fwd",),
    budget: Budget | None = None,
    base: Switches | None = None,
) -> None:
    """The comparison and the ablation (see the module docstring), shape by shape while ``budget`` lasts;
    ours built on ``base`` (:func:`switches`).

    Not ``measure``: each candidate is timed once, alone (``paperclub.bench.time_alone``), and a WRONG
    output is still timed, its note saying so (the committed table's semantics)."""
    budget = budget or Budget(None)
    report = _report(
        "FA4 ideas in Triton vs cuDNN and FlashAttention-2 (SDPA), D=128, 16 heads, B*S=16k, bf16",
        COLUMNS,
        "TFLOP/s: 4 B H S^2 D forward (halved when causal), x3.5 for forward+backward. group=compare: "
        "our default kernel, TMA on, the warp-specialised Gluon forward (fa4-gluon) and the SDPA backends; "
        "group=ablation: one switch of our kernel changed. "
        "flash-attn-4 is not in this table: `--only fa4-smoke` and `--only peer` (lab/gpu_run_peer.sh) measure it in a "
        "separate call, because its CuTe-DSL runtime wheel (92 MB) is carried in two halves.",
        measure_ceilings=True,
    )
    # fa4-gluon: the warp-specialised Gluon forward (its backward: what bwd="auto" picks, Gluon on Hopper)
    compare = [
        ("compare", n, ch)
        for n, ch in (("fa4-triton", TRITON), ("fa4-triton-tma", OURS_BEST), ("fa4-gluon", OURS_GLUON))
    ]
    compare += [("compare", "sdpa-cudnn", None), ("compare", "sdpa-flash2", None)]
    skipped = []
    for causal, s, b in _shapes(seqlens, budget, 60, skipped):
        q, k, v = make_inputs(b, s)
        qt, kt, vt = make_inputs(b, s, layout="bhsd")
        same, ref = sdpa_reference(qt, kt, vt, causal)  # the yardstick of each variant's check
        for passes in ("fwd", "fwd+bwd"):
            ablation = [("ablation", n, ch) for n, ch in ABLATIONS.items()] if passes in ablate_passes else []
            for group, name, changes in compare + ablation:
                row = dict(group=group, impl=name, causal=causal, S=s, B=b, **{"pass": passes})
                try:
                    note = ""
                    if changes is None:
                        fn, inputs = sdpa(qt, kt, vt, causal, name.removeprefix("sdpa-")), (qt, kt, vt)
                    else:
                        fn, inputs = ours(q, k, v, causal, changes, base=base), (q, k, v)
                        if passes == "fwd":
                            with torch.no_grad():
                                note = _err_note(rel_err(ours(*same, causal, changes, base=base)(), ref))
                    ms = time_alone(fn, passes, inputs)
                    report.add(
                        **row, ms=ms, tflops=flops(b, s, causal, passes) / (ms * 1e-3) / 1e12, note=note
                    )
                except Exception as exc:  # record and go on: one failing variant must not stop the sweep
                    msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                    print(f"[{name} S={s} causal={causal} {passes}] failed: {msg}", file=sys.stderr)
                    _row_error(report, **row, note=msg)
                torch.cuda.empty_cache()
        print(f"done causal={causal} S={s}", flush=True)
        quiet_write(report, out_dir=out_dir)
    if skipped:
        report.notes += f" Not measured (time budget of the run): {', '.join(skipped)}."
    plot_tflops_by_length(
        report,
        [
            ("forward", {"group": "compare", "pass": "fwd"}),
            ("forward+backward", {"group": "compare", "pass": "fwd+bwd"}),
            ("ablation: forward", {"group": "ablation", "pass": "fwd"}),
        ],
    )
    report.write(out_dir=out_dir)


# ---------------------------------------------------------------------------------------------
# bwd: the backward, ours (Gluon, fused, FA2) against cuDNN and FA2 (SDPA)
# ---------------------------------------------------------------------------------------------


def bwd_compare(
    out_dir: Path | None,
    seqlens=BWD_SEQLENS,
    budget: Budget | None = None,
    impls=None,
    tag: str = "bwd",
    rounds: int = 3,
    base: Switches | None = None,
) -> Report:
    """Forward + backward and backward alone: our backwards (BWD_IMPLS, on ``base``: :func:`switches`)
    beside cuDNN and FA2 (SDPA).

    At each shape every candidate's output and gradients are checked once against cuDNN's on the same
    values (tolerance: 3x FA2's own distance from cuDNN, at least 2e-2); candidates that pass are
    timed in ``rounds`` interleaved rounds through ``paperclub.bench.measure``. Writes
    ``<device>-<tag>.json``; shapes the budget does not reach are left out and named in the notes.
    """
    impls = BWD_IMPLS if impls is None else impls
    budget = budget or Budget(None)
    report = _report(
        "Backward: fused (FA3 schedule) vs fa2 (two kernels) vs cuDNN and FA2 (SDPA), D=128, 16 heads, "
        "B*S=16k, bf16",
        BWD_COLUMNS,
        "TFLOP/s: 4 B H S^2 D per forward (halved when causal); forward+backward x3.5, backward alone x2.5. "
        "pass=bwd times torch.autograd.grad on a kept graph (the backward kernels alone, with their "
        "preprocess). vs_cudnn: cuDNN's ms / this row's ms (> 1 is faster). check: output and "
        "gradients against cuDNN's on the same inputs, tolerance 3x the FA2 backend's own distance "
        "from cuDNN (at least 2e-2); where FA2 and cuDNN differ by more than REFERENCE_AGREEMENT (5e-2) "
        "there is no reference and ours is not timed. fa4-gluon = Gluon forward + fa2 backward (the previous default "
        "pairing); fa4-gluon-fused = Gluon forward + fused backward (FUSED_DEFAULTS); "
        "fa4-triton-tma-fused = Triton forward (TMA) + fused backward; fa4-gluon-gluonbwd = Gluon forward + "
        "the warp-specialised Gluon backward (repro.fa4.gluon_bwd, bwd='auto' on Hopper); "
        "fa4-gluon-gluonbwd-dqatomic (repro.fa4.lab.tuning gluon-bwd-dq) = the same with dQ by atomics. "
        f"Interleaved: {rounds} rounds.",
    )
    skipped = []
    for causal, s, b in _shapes(seqlens, budget, 45, skipped):
        print(f"bwd: S={s} causal={causal}: checking against cuDNN", flush=True)
        x = _inputs(b, s)
        mine = {n: ours(*x.leaves, causal, changes, base=base) for n, changes in impls.items()}
        try:
            ref, fa2_err, tol = x.reference(causal, REFERENCE_AGREEMENT)
        except AssertionError as exc:  # no trustworthy reference: every row of ours says so, untimed
            ref, fa2_err, tol = None, float("nan"), None
            errs, bad = {}, {n: str(exc) for n in mine}
            print(f"  {exc}", flush=True)
        else:
            errs, bad = x.check(mine, ref, tol)
        errs["sdpa-flash2"] = {"max": fa2_err}
        notes = functools.partial(_errors_note, errs)
        for passes in ("fwd+bwd", "bwd"):
            cands = {**x.sdpa_candidates(causal, passes), **x.candidates(mine, bad, passes)}
            res = measure(cands, rounds=rounds)
            fixed = dict(group="bwd", causal=causal, S=s, B=b, **{"pass": passes})
            add_measured_rows(report, res, flops(b, s, causal, passes), notes, **fixed)
            del cands, res
        del mine, ref, x
        torch.cuda.empty_cache()
        quiet_write(report, tag=tag, out_dir=out_dir)
    if skipped:
        report.notes += f" Not measured (time budget of the run): {', '.join(skipped)}."
    plot_tflops_by_length(report, [(p, {"pass": p}) for p in ("fwd+bwd", "bwd")])
    report.write(tag=tag, out_dir=out_dir)
    return report


# ---------------------------------------------------------------------------------------------
# heads: issue #42's head sizes off the tiles, v's own head size, the sliding window, beside cuDNN
# ---------------------------------------------------------------------------------------------


def heads(
    out_dir: Path | None,
    seqlens=HEAD_SEQLENS,
    budget: Budget | None = None,
    rounds: int = 3,
    base: Switches | None = None,
    shapes=HEAD_SHAPES,
) -> Report:
    """Issue #42's head sizes and the sliding window beside cuDNN and FA2 (SDPA), forward and forward +
    backward, ours with ``base`` (default: the default switches; D <= 128: the verified kernels on padded tiles, the Gluon
    forward on Hopper where v shares q's tile and there is no window; the layout in ``tiles``: tile /
    v's tile x chunks; D > 128: the 256 tile; a window: the window kernels).

    Each shape's candidates are checked once against cuDNN's output and gradients (tolerance 3x FA2's
    own distance from cuDNN, at least 2e-2; where cuDNN does not run, against FA2's or the
    memory-efficient backend's) and then timed in ``rounds`` interleaved rounds. TFLOP/s count the
    caller's head sizes, so a padded layout shows its padding as lower TFLOP/s (``flops_ratio``: the
    matmul work the tiles do over the caller's). Window rows: D = 128, (left, 0) windows, beside ours
    and cuDNN causal (the work a window saves) and cuDNN with the window as a boolean mask.
    Writes ``<device>-heads.json``."""
    from repro.fa4.api import PUBLIC_TILES, head_layout, run_layout
    from repro.fa4.reference import window_mask

    budget = budget or Budget(None)
    report = _report(
        "Head sizes 64-256 (issue #42) and the sliding window: ours vs cuDNN and FA2 (SDPA), 16 heads, "
        "B*S=16k, bf16",
        HEADS_COLUMNS,
        "TFLOP/s at the caller's head sizes: 2 B H S^2 (D + D_v) per forward times the visible fraction of "
        "the scores (causal about 1/2, a (left, 0) window about left/S), x3.5 for forward + backward. "
        "vs_cudnn: cuDNN's ms / this row's (> 1 faster). tiles: the tile q and k ran on / v's tile x chunks; "
        "flops_ratio: matmul work on the tiles over the caller's (1 = no padding). fa4 = ours with the "
        "default switches (gluon=None: the Gluon forward on Hopper where q, k, v share the 64, 128 or 256 tile "
        "(v padded to q's 256 tile for it: run_layout) and there is no window, else the Triton one; bwd='auto'). Issue #42's target: at least 0.9x cuDNN where the tile is the head "
        f"size itself (64, 128, 256); elsewhere the padding's cost is flops_ratio. group=window: D = 128, a "
        "(left, 0) window; every row's TFLOP/s count the window's work, so the causal rows (ours, cuDNN) show "
        "what the window saves as time, and sdpa-cudnn-window-mask is cuDNN given the window as a boolean "
        f"mask. Interleaved: {rounds} rounds.",
    )
    skipped = []
    shapes = itertools.product((False, True), seqlens, shapes)
    for causal, s, (d, d_v) in within_budget(shapes, budget, 30, skipped, _head_shape_name):
        b = max(1, TOKENS // s)
        x = _inputs(b, s, d, d_v)
        # the reference: cuDNN where it runs; the yardstick: FA2, else the memory-efficient backend
        ref, fa2 = x.first_references(causal)
        if ref is None:
            skipped.append(f"D={d} D_v={d_v} S={s} causal={causal} (no SDPA backend ran)")
            continue
        mine = {"fa4": ours(*x.leaves, causal, {}, base=base)}
        try:
            tol = _tolerance(max(rel_err(a, r) for a, r in zip(fa2, ref, strict=True))) if fa2 else 2e-2
        except AssertionError as exc:  # no trustworthy reference: ours is not timed, its rows say why
            bad = {"fa4": str(exc)}
        else:
            bad = x.check(mine, ref, tol)[1]
        tiles = functools.partial(
            _tiles, run_layout(x.leaves[0], None, PUBLIC_TILES, base or Switches(), d_v)
        )
        for passes in ("fwd", "fwd+bwd"):
            cands = {**x.sdpa_candidates(causal, passes), **x.candidates(mine, bad, passes)}
            work = attention_flops(b, s, s, d, d_v, passes, _visible(s, causal, None))
            fixed = dict(group="heads", D=d, D_v=d_v, causal=causal, window="", S=s, B=b, **{"pass": passes})
            add_measured_rows(report, measure(cands, rounds=rounds), work, tiles, **fixed)
        del x, ref, fa2, mine, cands
        torch.cuda.empty_cache()
        quiet_write(report, tag="heads", out_dir=out_dir)
    tiles = functools.partial(_tiles, head_layout(HEAD_DIM, HEAD_DIM))
    for s, window in itertools.product((seqlens[-1], 2 * seqlens[-1]), WINDOWS):
        if budget.left() < 30 or window[0] >= s:
            continue
        b = max(1, TOKENS // s)
        x = _inputs(b, s)
        mask = window_mask(s, s, window[0], window[1], "cuda")
        mine = {"fa4-window": ours(*x.leaves, False, {}, window=window, base=base)}
        try:
            ref = x.sdpa_grads(False, "efficient", mask)
            bad = x.check(mine, ref, 2e-2)[1]
        except Exception as exc:  # no reference: our rows are not timed
            bad = {"fa4-window": f"no reference ran: {error_text(exc)}"}
        for passes in ("fwd", "fwd+bwd"):
            # beside ours: cuDNN causal (the work a window saves), cuDNN with the window as a mask, ours causal
            cands = x.sdpa_candidates(True, passes, ("cudnn",))
            cands.update(x.sdpa_candidates(False, passes, ("cudnn",), mask, suffix="-window-mask"))
            cands.update(x.candidates({"fa4-causal": ours(*x.leaves, True, {}, base=base)}, {}, passes))
            cands.update(x.candidates(mine, bad, passes))
            work = attention_flops(b, s, s, HEAD_DIM, HEAD_DIM, passes, _visible(s, False, window))
            fixed = dict(group="window", D=HEAD_DIM, D_v=HEAD_DIM, causal=False, window=str(window), S=s, B=b)
            add_measured_rows(report, measure(cands, rounds=rounds), work, tiles, **fixed, **{"pass": passes})
        del x, mask, mine, cands
        torch.cuda.empty_cache()
        quiet_write(report, tag="heads", out_dir=out_dir)
    if skipped:
        report.notes += f" Not measured: {', '.join(skipped)}."
    for causal in (False, True):
        where = {"group": "heads", "pass": "fwd+bwd", "causal": causal}
        title = f"forward + backward vs cuDNN by head size, causal={causal}"
        report.plot(title=title, x="D", y="vs_cudnn", series="impl", where=where)
    report.write(tag="heads", out_dir=out_dir)
    return report


def _head_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``--heads 192:128,256:256`` -> ((192, 128), (256, 256))."""
    try:
        shapes = tuple(tuple(int(n) for n in part.split(":")) for part in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(p) != 2 or not (1 <= p[0] <= 256 and 1 <= p[1] <= 512) for p in shapes):
        raise argparse.ArgumentTypeError(
            f"--heads takes D:DV pairs separated by commas, D 1-256 and DV 1-512, got {text!r}"
        )
    return shapes


PARTS = ("bwd", "compare", "rescale", "peer", "fa4-smoke", "heads")
DEFAULT_PARTS = ("bwd", "compare", "rescale")


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__.split("\n\n")[0], rounds=3, quick_help="two lengths (one for bwd)", tag=False)
    ap.add_argument("--no-fa4", action="store_true", help="peer: cuDNN and ours only, without flash-attn-4")
    ap.add_argument(
        "--heads",
        type=_head_shapes,
        default=HEAD_SHAPES,
        metavar="D:DV[,D:DV]",
        help="heads: only these (D, D_v) (default: HEAD_SHAPES)",
    )
    args = parse_bench_args(ap, argv)
    try:
        parts = select(PARTS, args.only, what="part") if args.only else list(DEFAULT_PARTS)
        base = apply_settings(Switches(), args.settings)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit("repro.fa4.bench needs a CUDA GPU (an H100 for the numbers on the paper page)")
    out, budget = args.out, args.budget
    try:
        if "fa4-smoke" in parts:  # the two diagnostic parts are lab tools, loaded when they run
            from repro.fa4.lab import fa4_smoke

            if not fa4_smoke.run(out, base=base):
                raise SystemExit(3)
        if "peer" in parts:
            seqlens = (2048, 8192) if args.quick else SEQLENS
            peer(out, seqlens, use_fa4=not args.no_fa4, rounds=args.rounds, base=base)
        if "heads" in parts:
            heads_seqlens = HEAD_SEQLENS[:1] if args.quick else HEAD_SEQLENS
            heads(out, heads_seqlens, budget=budget, rounds=args.rounds, base=base, shapes=args.heads)
        if "bwd" in parts:
            # first: the GPU job's budget may not reach the end of the table; 60% of it when more follows
            first = budget.part(0.6) if len(set(parts) & {"compare", "rescale"}) else budget
            bwd_seqlens = (8192,) if args.quick else BWD_SEQLENS
            bwd_compare(out, bwd_seqlens, budget=first, rounds=args.rounds, base=base)
        seqlens = (2048, 8192) if args.quick else SEQLENS
        if "compare" in parts:
            full(out, seqlens, budget=budget, base=base)
        if "rescale" in parts and budget.left() > 60:
            from repro.fa4.lab import rescale

            rescale.run(out, seqlens)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
