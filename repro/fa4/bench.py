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
  (:func:`peer`, ``--no-fa4`` leaves flash-attn-4 out) -> <device>-peer.json.
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

import functools
import itertools
import json
import sys
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from paperclub.bench import (
    Budget,
    Candidate,
    Report,
    apply_settings,
    bench_parser,
    error_text,
    failed_candidate,
    measure,
    parse_bench_args,
    quiet_write,
    select,
    time_ms,
    timed_pass,
    versions,
)
from paperclub.testing import rel_error as rel_err
from repro.fa4.api import Switches

#: The paper's sweep: 16 heads of D = 128, B x S = 16k tokens, S = 1k..16k.
HEADS = 16
HEAD_DIM = 128
TOKENS = 16384
SEQLENS = (1024, 2048, 4096, 8192, 16384)

#: The Triton forward whatever the device (``gluon=False``; the default picks Gluon on Hopper).
TRITON = {"gluon": False}

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

#: The Triton forward's fastest in results/nvidia-h100-80gb-hbm3.json (S = 4k-16k): TMA on, default launch shape.
OURS_BEST = {**TRITON, "tma": True}

#: The warp-specialised Gluon forward (repro.fa4.gluon_fwd; sm_90 only, launched with
#: repro.fa4.GLUON_LAUNCH) and the backward bwd="auto" picks: the Gluon one on Hopper since
#: 2026-11-25 (the committed peer file, of 2026-11-23, ran the FA2 Triton backward).
OURS_GLUON = {"gluon": True}

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

#: Rounds of the peer comparison (``--rounds`` changes it): each shape's candidates are timed in turn
#: this many times; back-to-back single timings of one candidate moved by up to 8% on one H100.
PEER_ROUNDS = 3

#: The columns of the comparison (<device>.json) and of the peer table (<device>-peer.json).
COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "tflops", "note"]
BWD_COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "ms_min", "ms_max", "tflops", "vs_cudnn"]
BWD_COLUMNS += ["check", "note"]
HEADS_COLUMNS = ["group", "impl", "D", "D_v", "causal", "window", "S", "B", "pass", "ms", "ms_min", "ms_max"]
HEADS_COLUMNS += ["tflops", "vs_cudnn", "tiles", "flops_ratio", "check"]

#: The config every one of our candidates is built from (its fields changed by ``--set``).
BASE = Switches()


def switches(changes: dict, base: Switches | None = None) -> dict:
    """The keyword switches of the candidate ``changes`` names, on top of ``base`` (default :data:`BASE`;
    only the fields that differ from Switches()' defaults, so that a row's candidate reads as its
    changes)."""
    cfg = replace(BASE if base is None else base, **changes)
    default = asdict(Switches())
    return {k: v for k, v in asdict(cfg).items() if default[k] != v}


def flops(b: int, s: int, causal: bool, passes: str) -> float:
    """FLOPs of one call: 4 B H S^2 D forward (halved when causal), x3.5 for "fwd+bwd", x2.5 for "bwd"."""
    f = 4.0 * b * HEADS * s * s * HEAD_DIM * (0.5 if causal else 1.0)
    return f * {"fwd+bwd": 3.5, "bwd": 2.5}.get(passes, 1.0)


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
# Inputs and candidates: ours, SDPA's backends, flash-attn-4
# ---------------------------------------------------------------------------------------------


def make_inputs(b: int, s: int, layout: str = "bshd", d: int = HEAD_DIM, d_v: int | None = None):
    """bf16 leaves q, k, v: [B, S, H, D] (``layout="bhsd"``: [B, H, S, D]), v's head size ``d_v``
    (default D)."""

    def leaf(dim: int) -> torch.Tensor:
        shape = (b, s, HEADS, dim) if layout == "bshd" else (b, HEADS, s, dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    return [leaf(d), leaf(d), leaf(d if d_v is None else d_v)]


@dataclass
class _Inputs:
    """One shape's inputs for the checked rows: our leaves [B, S, H, D], SDPA's [B, H, S, D] contiguous
    copies of the same values (leaves too), and dO (``grad_t``: SDPA's layout)."""

    leaves: list
    sdpa: list
    grad: torch.Tensor

    @classmethod
    def make(cls, b: int, s: int, d: int = HEAD_DIM, d_v: int | None = None) -> _Inputs:
        leaves = make_inputs(b, s, d=d, d_v=d_v)
        copies = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
        return cls(leaves, copies, torch.randn_like(leaves[2]))

    @functools.cached_property
    def grad_t(self) -> torch.Tensor:
        return self.grad.transpose(1, 2).contiguous()

    def sdpa_grads(self, causal: bool, backend: str, mask=None):
        """Output and gradients of SDPA on ``backend``, as float32 [B, S, H, D] (:func:`_grads`)."""
        return _grads(sdpa(*self.sdpa, causal, backend, mask), self.sdpa, self.grad, "bhsd")


def ours(q, k, v, causal, changes, window=None):
    from repro.fa4 import attention

    sw = switches(changes)
    return lambda: attention(q, k, v, causal=causal, window=window, **sw)


def sdpa(q, k, v, causal, backend, mask=None):
    """SDPA on one backend (q, k, v [B, H, S, D]), causal or with a boolean ``mask`` (a window)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash2": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    return run


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
    return flash_attn_func, versions(["flash-attn-4"])["flash-attn-4"]


def fa4_cute(fn, q, k, v, causal: bool):
    """flash-attn-4 on [B, S, H, D] inputs; the callable returns only the output, not the LSE."""

    def run():
        out = fn(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return run


# ---------------------------------------------------------------------------------------------
# What is timed, the checks against cuDNN, the rows
# ---------------------------------------------------------------------------------------------


def _timer(f, leaves, grad, passes: str):
    """What one timed call runs: ``paperclub.bench.timed_pass``, but the forward without an autograd
    graph (our forward rows time inference)."""
    if passes != "fwd":
        return timed_pass(passes, f, leaves, grad)

    def run():
        with torch.no_grad():
            return f()

    return run


def timed(fn, passes: str, inputs=None) -> float:
    """Median ms of one candidate timed alone (``time_ms``), the forward or forward + backward to q, k, v
    (a fresh dO each call): :func:`full` and lab/tuning's sweeps time one candidate at a time."""
    grad = None if passes == "fwd" else torch.randn_like(fn())
    return time_ms(_timer(fn, inputs, grad, passes))


def _sdpa_candidates(
    x: _Inputs, causal: bool, passes: str, backends=("cudnn", "flash2"), mask=None, suffix=""
):
    """SDPA on each of ``backends`` (with a boolean ``mask``: not causal) timed for ``passes``."""
    return {
        f"sdpa-{be}{suffix}": Candidate(fn=_timer(sdpa(*x.sdpa, causal, be, mask), x.sdpa, x.grad_t, passes))
        for be in backends
    }


def _ours_candidates(x: _Inputs, mine: dict, bad: dict, passes: str) -> dict[str, Candidate]:
    """Ours (``mine``) timed for ``passes``; one whose check failed at the shape (``bad``: the message)
    fails its check with it, so that its row says why and it is not timed."""
    return {
        name: failed_candidate(bad[name])
        if name in bad
        else Candidate(fn=_timer(f, x.leaves, x.grad, passes))
        for name, f in mine.items()
    }


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


#: The most two SDPA backends may disagree (relative L2, any of o, dq, dk, dv) for either to be the
#: yardstick: bf16 rounding gives about 3e-3. Above it (on an H200, 2026-11-29, cuDNN's gradients came
#: out uncorrelated with FA2's and ours, 1.4 relative, in a run where the peer part had timed cuDNN at
#: the same shape first; the cause is not established) a tolerance of 3x the distance would pass
#: anything, so the check fails instead.
REFERENCE_AGREEMENT = 5e-2


def _tolerance(yardstick_err: float) -> float:
    """The check's tolerance from the yardstick's distance to the reference: 3x it, at least 2e-2;
    a distance over REFERENCE_AGREEMENT raises (no trustworthy reference at this shape)."""
    if not yardstick_err <= REFERENCE_AGREEMENT:
        raise AssertionError(
            f"no reference: two SDPA backends' outputs and gradients differ by {yardstick_err:.1e} "
            f"(relative L2), more than {REFERENCE_AGREEMENT:.0e}; neither can check ours at this shape"
        )
    return max(3 * yardstick_err, 2e-2)


def _cudnn_grads(x: _Inputs, causal: bool):
    """cuDNN's output and gradients on ``x``, FA2's (SDPA) largest distance from them, and the check
    tolerance (:func:`_tolerance`, which raises when FA2 and cuDNN disagree)."""
    ref, fa2 = x.sdpa_grads(causal, "cudnn"), x.sdpa_grads(causal, "flash2")
    fa2_err = max(rel_err(a, r) for a, r in zip(fa2, ref, strict=True))
    return ref, fa2_err, _tolerance(fa2_err)


def _bwd_shape(b: int, s: int, causal: bool, d: int = HEAD_DIM):
    """lab/tuning's backward sweeps: (ours, SDPA's leaves, dO, cuDNN's grads, FA2's distance, tolerance)
    at head size ``d``."""
    x = _Inputs.make(b, s, d)
    return x.leaves, x.sdpa, x.grad, *_cudnn_grads(x, causal)


def _check_all(fns: dict, leaves, grad, ref, tol: float) -> tuple[dict, dict]:
    """Compile and check each of our candidates once: (errors by name, failure message by name). Not
    a ``Candidate.check``: one check serves both passes of a shape, and its errors go in the notes."""
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


def _cudnn_reference(qt, kt, vt, causal: bool):
    """SDPA's inputs as [B, S, H, D] (ours on the same values) and cuDNN's output on them, float32."""
    same = [t.detach().transpose(1, 2).contiguous() for t in (qt, kt, vt)]
    with torch.no_grad():
        ref = sdpa(qt, kt, vt, causal, "cudnn")().transpose(1, 2).float()
    return same, ref


def _err_note(err: float) -> str:
    return f"rel.err vs cuDNN {err:.1e}" + ("" if err < 2e-2 else " WRONG")


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


def _report(title: str, columns: list[str], notes: str, **kw) -> Report:
    """One of the bench's result tables; SDPA (cuDNN, FA2) the peer unless ``kw`` says otherwise."""
    sdpa_peer = (
        f"torch {torch.__version__} SDPA (cuDNN {torch.backends.cudnn.version()}, FlashAttention-2 backend)"
    )
    kw = {"peer": sdpa_peer, "packages": ["triton", "torch"], "measure_ceilings": False, **kw}
    return Report(package="fa4", title=title, columns=columns, notes=notes, **kw)


def _row_error(report: Report, **row) -> None:
    report.add(**row, ms=float("nan"), tflops=float("nan"))


def _add_rows(report: Report, res: dict, work: float, per_name, **fixed) -> None:
    """One row per candidate ``measure`` returned: its times and check, TFLOP/s of ``work`` FLOPs, cuDNN's
    ms over its own (``vs_cudnn``, > 1 faster) and ``per_name(name)``'s columns."""
    cudnn_ms = res["sdpa-cudnn"].median_ms
    for name, m in res.items():
        ms = m.median_ms
        tflops = work / (ms * 1e-3) / 1e12 if ms else None
        vs_cudnn = cudnn_ms / ms if ms and cudnn_ms else None
        report.add(**fixed, impl=name, **m.row(), tflops=tflops, vs_cudnn=vs_cudnn, **per_name(name))
        print(report.rows[-1], flush=True)


def _shapes(seqlens, budget: Budget, reserve_s: float, skipped: list):
    """(causal, S, B) of each length, not causal first, B x S = TOKENS; a shape that would start with
    less than ``reserve_s`` of the budget left is named in ``skipped`` instead."""
    for causal, s in itertools.product((False, True), seqlens):
        if budget.left() < reserve_s:
            skipped.append(f"S={s} causal={causal}")
            continue
        yield causal, s, max(1, TOKENS // s)


_BY_LENGTH = dict(x="S", y="tflops", series="impl", logx=True)


def _tflops_plots(report: Report, panels) -> None:
    """A TFLOP/s plot by length for each (title, where) of ``panels``, causal and not."""
    for causal in (False, True):
        for title, where in panels:
            where = {**where, "causal": causal}
            report.plot(title=f"{title} TFLOP/s, causal={causal}", where=where, **_BY_LENGTH)


# ---------------------------------------------------------------------------------------------
# compare: the comparison and the ablation
# ---------------------------------------------------------------------------------------------


def full(out_dir: Path | None, seqlens, ablate_passes=("fwd",), budget: Budget | None = None) -> None:
    """The comparison and the ablation (see the module docstring), shape by shape while ``budget`` lasts.

    Not ``measure``: each candidate is timed once, alone (:func:`timed`), and a WRONG output is still
    timed, its note saying so (the committed table's semantics)."""
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
        same, ref = _cudnn_reference(qt, kt, vt, causal)  # the yardstick of each variant's check
        for passes in ("fwd", "fwd+bwd"):
            ablation = [("ablation", n, ch) for n, ch in ABLATIONS.items()] if passes in ablate_passes else []
            for group, name, changes in compare + ablation:
                row = dict(group=group, impl=name, causal=causal, S=s, B=b, **{"pass": passes})
                try:
                    note = ""
                    if changes is None:
                        fn, inputs = sdpa(qt, kt, vt, causal, name.removeprefix("sdpa-")), (qt, kt, vt)
                    else:
                        fn, inputs = ours(q, k, v, causal, changes), (q, k, v)
                        if passes == "fwd":
                            with torch.no_grad():
                                note = _err_note(rel_err(ours(*same, causal, changes)(), ref))
                    ms = timed(fn, passes, inputs)
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
    _tflops_plots(
        report,
        [
            ("forward", {"group": "compare", "pass": "fwd"}),
            ("forward+backward", {"group": "compare", "pass": "fwd+bwd"}),
            ("ablation: forward", {"group": "ablation", "pass": "fwd"}),
        ],
    )
    report.write(out_dir=out_dir)


# ---------------------------------------------------------------------------------------------
# peer: flash-attn-4, the paper's own CuTe-DSL kernels, on Hopper (lab/gpu_run_peer.sh runs this)
# ---------------------------------------------------------------------------------------------


def _smoke_error(out_dir: Path | None) -> str:
    """The smoke test's note about flash-attn-4, if its JSON is in ``out_dir``."""
    for f in sorted((out_dir or Path(".")).glob("*-fa4-smoke.json")):
        notes = json.loads(f.read_text(encoding="utf-8")).get("notes", "")
        return notes.split("flash-attn-4 ", 1)[-1] if "flash-attn-4 " in notes else "smoke test passed"
    return "no smoke-test result found"


def _peer_candidate(
    report: Report, row: dict, f, inputs, f_same, ref, failed: dict, notes: dict
) -> Candidate:
    """One candidate of :func:`peer`. Its check compiles it (one call) and, forward, notes its distance
    from cuDNN's output; a failure is its row (flash-attn-4's first also the notes'), the rest go on."""
    name, passes, causal, s = row["impl"], row["pass"], row["causal"], row["S"]
    fn = _timer(f, inputs, None if passes == "fwd" else torch.randn_like(inputs[0]), passes)

    def check():
        try:
            if passes == "fwd" and f_same is not None:
                with torch.no_grad():
                    notes[name] = _err_note(rel_err(f_same(), ref))
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # record and go on
            msg = error_text(exc)
            print(f"[{name} S={s} causal={causal} {passes}] failed: {msg}", file=sys.stderr)
            if name == "fa4-cute":
                if not failed:
                    traceback.print_exc()
                    report.notes += f" First flash-attn-4 failure ({passes}, causal={causal}, S={s}): {msg}"
                failed[(passes, causal)] = msg
            _row_error(report, **row, note=msg)
            raise

    return Candidate(fn=fn, check=check)


def peer(out_dir: Path | None, seqlens, use_fa4: bool = True, rounds: int = PEER_ROUNDS) -> None:
    """flash-attn-4, cuDNN (SDPA) and ours (OURS_BEST) at the shapes of :func:`full`, one process.

    Each flash-attn-4 failure is recorded in its row and in the notes; after one failure for a
    (pass, causal) pair the rest of that pair is not retried (each retry would recompile).
    """
    report = _report(
        "flash-attn-4 (CuTe-DSL) beside cuDNN (SDPA) and ours (TMA on), D=128, 16 heads, B*S=16k, bf16",
        COLUMNS,
        "TFLOP/s as in the main result file (4 B H S^2 D forward, halved when causal, x3.5 for forward+backward). "
        "All timed in one process: for each shape and pass, fa4-cute, sdpa-cudnn, fa4-triton-tma and "
        "fa4-gluon (ours with the warp-specialised Gluon forward and the default backward, bwd='auto': the Gluon backward on Hopper) in turn, "
        f"{rounds} rounds, "
        "each row the median (the note gives the range); rel.err is against cuDNN's output on the same inputs.",
        peer=f"flash-attn-4 (flash_attn.cute.flash_attn_func); torch {torch.__version__} SDPA, cuDNN {torch.backends.cudnn.version()}",
        packages=FA4_DISTRIBUTIONS,
    )
    fn4, info = load_flash_attn_4() if use_fa4 else (None, f"not run (--no-fa4): {_smoke_error(out_dir)}")
    report.notes += f" flash-attn-4: {info}."
    failed: dict[tuple[str, bool], str] = {}
    for causal, s, b in _shapes(seqlens, Budget(None), 0, []):
        q, k, v = make_inputs(b, s)
        qt, kt, vt = make_inputs(b, s, layout="bhsd")
        same, ref = _cudnn_reference(qt, kt, vt, causal)
        impls = (
            [("fa4-cute", fa4_cute(fn4, q, k, v, causal), (q, k, v), fa4_cute(fn4, *same, causal))]
            if fn4
            else []
        )
        impls.append(("sdpa-cudnn", sdpa(qt, kt, vt, causal, "cudnn"), (qt, kt, vt), None))
        for name, changes in (("fa4-triton-tma", OURS_BEST), ("fa4-gluon", OURS_GLUON)):
            impls.append((name, ours(q, k, v, causal, changes), (q, k, v), ours(*same, causal, changes)))
        for passes in ("fwd", "fwd+bwd"):
            row = dict(group="peer", causal=causal, S=s, B=b, **{"pass": passes})
            cands, notes = {}, {}
            for name, f, inputs, f_same in impls:
                if name == "fa4-cute" and (passes, causal) in failed:
                    _row_error(
                        report, **row, impl=name, note=f"not retried: {failed[(passes, causal)][:120]}"
                    )
                    continue
                cands[name] = _peer_candidate(
                    report, {**row, "impl": name}, f, inputs, f_same, ref, failed, notes
                )
            # rep=50: time_ms's default, what each round ran before the move
            for name, m in measure(cands, rounds=rounds, rep=50).items():
                if m.error.startswith("while timing"):  # as before the move: this ends the part
                    raise RuntimeError(f"{name}: {m.error}")
                if m.ok:  # (a failed check is its row already)
                    spread = f"median of {len(m.rounds)} rounds, {m.min_ms:.3f}-{m.max_ms:.3f} ms"
                    note = f"{notes[name]}; {spread}" if notes.get(name) else spread
                    tflops = flops(b, s, causal, passes) / (m.median_ms * 1e-3) / 1e12
                    report.add(**row, impl=name, ms=m.median_ms, tflops=tflops, note=note)
            torch.cuda.empty_cache()
        print(f"done causal={causal} S={s}", flush=True)
        quiet_write(report, tag="peer", out_dir=out_dir)
    _tflops_plots(report, [(p, {"pass": p}) for p in ("fwd", "fwd+bwd")])
    report.write(tag="peer", out_dir=out_dir)


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
) -> Report:
    """Forward + backward and backward alone: our backwards (BWD_IMPLS) beside cuDNN and FA2 (SDPA).

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
        x = _Inputs.make(b, s)
        mine = {n: ours(*x.leaves, causal, changes) for n, changes in impls.items()}
        try:
            ref, fa2_err, tol = _cudnn_grads(x, causal)
        except AssertionError as exc:  # no trustworthy reference: every row of ours says so, untimed
            ref, fa2_err, tol = None, float("nan"), None
            errs, bad = {}, {n: str(exc) for n in mine}
            print(f"  {exc}", flush=True)
        else:
            errs, bad = _check_all(mine, x.leaves, x.grad, ref, tol)
        errs["sdpa-flash2"] = {"max": fa2_err}
        notes = functools.partial(_errors_note, errs)
        for passes in ("fwd+bwd", "bwd"):
            cands = {**_sdpa_candidates(x, causal, passes), **_ours_candidates(x, mine, bad, passes)}
            res = measure(cands, rounds=rounds)
            fixed = dict(group="bwd", causal=causal, S=s, B=b, **{"pass": passes})
            _add_rows(report, res, flops(b, s, causal, passes), notes, **fixed)
            del cands, res
        del mine, ref, x
        torch.cuda.empty_cache()
        quiet_write(report, tag=tag, out_dir=out_dir)
    if skipped:
        report.notes += f" Not measured (time budget of the run): {', '.join(skipped)}."
    _tflops_plots(report, [(p, {"pass": p}) for p in ("fwd+bwd", "bwd")])
    report.write(tag=tag, out_dir=out_dir)
    return report


# ---------------------------------------------------------------------------------------------
# heads: issue #42's head sizes off the tiles, v's own head size, the sliding window, beside cuDNN
# ---------------------------------------------------------------------------------------------


def heads(
    out_dir: Path | None, seqlens=HEAD_SEQLENS, budget: Budget | None = None, rounds: int = 3
) -> Report:
    """Issue #42's head sizes and the sliding window beside cuDNN and FA2 (SDPA), forward and forward +
    backward, ours with the default switches (D <= 128: the verified kernels on padded tiles, the Gluon
    forward on Hopper where v shares q's tile and there is no window; the layout in ``tiles``: tile /
    v's tile x chunks; D > 128: the 256 tile; a window: the window kernels).

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
    report = _report(
        "Head sizes 64-256 (issue #42) and the sliding window: ours vs cuDNN and FA2 (SDPA), 16 heads, "
        "B*S=16k, bf16",
        HEADS_COLUMNS,
        "TFLOP/s at the caller's head sizes: 2 B H S^2 (D + D_v) per forward times the visible fraction of "
        "the scores (causal about 1/2, a (left, 0) window about left/S), x3.5 for forward + backward. "
        "vs_cudnn: cuDNN's ms / this row's (> 1 faster). tiles: the tile q and k ran on / v's tile x chunks; "
        "flops_ratio: matmul work on the tiles over the caller's (1 = no padding). fa4 = ours with the "
        "default switches (gluon=None: the Gluon forward on Hopper where q, k, v share the 64 or 128 tile "
        "and there is no window, else the Triton one; bwd='auto'). Issue #42's target: at least 0.9x cuDNN where the tile is the head "
        f"size itself (64, 128, 256); elsewhere the padding's cost is flops_ratio. group=window: D = 128, a "
        "(left, 0) window; every row's TFLOP/s count the window's work, so the causal rows (ours, cuDNN) show "
        "what the window saves as time, and sdpa-cudnn-window-mask is cuDNN given the window as a boolean "
        f"mask. Interleaved: {rounds} rounds.",
    )
    skipped = []
    for causal, s, (d, d_v) in itertools.product((False, True), seqlens, HEAD_SHAPES):
        if budget.left() < 30:
            skipped.append(f"D={d} D_v={d_v} S={s} causal={causal}")
            continue
        b = max(1, TOKENS // s)
        x = _Inputs.make(b, s, d, d_v)
        ref = fa2 = None
        # the first backend that runs: the reference; the next one: the yardstick (FA2's, else the
        # memory-efficient backend's where FA2 does not take the head sizes)
        for be in ("cudnn", "flash2", "efficient"):
            if fa2 is not None:
                break
            try:
                got = x.sdpa_grads(causal, be)
            except Exception:  # this backend does not take the head sizes
                continue
            ref, fa2 = (got, None) if ref is None else (ref, got)
        if ref is None:
            skipped.append(f"D={d} D_v={d_v} S={s} causal={causal} (no SDPA backend ran)")
            continue
        mine = {"fa4": ours(*x.leaves, causal, {})}
        try:
            tol = _tolerance(max(rel_err(a, r) for a, r in zip(fa2, ref, strict=True))) if fa2 else 2e-2
        except AssertionError as exc:  # no trustworthy reference: ours is not timed, its rows say why
            bad = {"fa4": str(exc)}
        else:
            bad = _check_all(mine, x.leaves, x.grad, ref, tol)[1]
        tiles = functools.partial(_tiles, head_layout(d, d_v))
        for passes in ("fwd", "fwd+bwd"):
            cands = {**_sdpa_candidates(x, causal, passes), **_ours_candidates(x, mine, bad, passes)}
            work = attention_flops(b, s, s, d, d_v, passes, _visible(s, causal, None))
            fixed = dict(group="heads", D=d, D_v=d_v, causal=causal, window="", S=s, B=b, **{"pass": passes})
            _add_rows(report, measure(cands, rounds=rounds), work, tiles, **fixed)
        del x, ref, fa2, mine, cands
        torch.cuda.empty_cache()
        quiet_write(report, tag="heads", out_dir=out_dir)
    tiles = functools.partial(_tiles, head_layout(HEAD_DIM, HEAD_DIM))
    for s, window in itertools.product((seqlens[-1], 2 * seqlens[-1]), WINDOWS):
        if budget.left() < 30 or window[0] >= s:
            continue
        b = max(1, TOKENS // s)
        x = _Inputs.make(b, s)
        mask = window_mask(s, s, window[0], window[1], "cuda")
        mine = {"fa4-window": ours(*x.leaves, False, {}, window=window)}
        try:
            ref = x.sdpa_grads(False, "efficient", mask)
            bad = _check_all(mine, x.leaves, x.grad, ref, 2e-2)[1]
        except Exception as exc:  # no reference: our rows are not timed
            bad = {"fa4-window": f"no reference ran: {error_text(exc)}"}
        for passes in ("fwd", "fwd+bwd"):
            # beside ours: cuDNN causal (the work a window saves), cuDNN with the window as a mask, ours causal
            cands = _sdpa_candidates(x, True, passes, ("cudnn",))
            cands.update(_sdpa_candidates(x, False, passes, ("cudnn",), mask, suffix="-window-mask"))
            cands["fa4-causal"] = Candidate(fn=_timer(ours(*x.leaves, True, {}), x.leaves, x.grad, passes))
            cands.update(_ours_candidates(x, mine, bad, passes))
            work = attention_flops(b, s, s, HEAD_DIM, HEAD_DIM, passes, _visible(s, False, window))
            fixed = dict(group="window", D=HEAD_DIM, D_v=HEAD_DIM, causal=False, window=str(window), S=s, B=b)
            _add_rows(report, measure(cands, rounds=rounds), work, tiles, **fixed, **{"pass": passes})
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
        if "fa4-smoke" in parts:  # the two diagnostic parts are lab tools, loaded when they run
            from repro.fa4.lab import fa4_smoke

            if not fa4_smoke.run(out, base=BASE):
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
            from repro.fa4.lab import rescale

            rescale.run(out, seqlens)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
