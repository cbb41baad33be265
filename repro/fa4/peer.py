"""flash-attn-4, the paper's own CuTe-DSL kernels, as the bench's peer: its import, the adapter that
returns only its output, the smoke test's verdict (``lab/fa4_smoke.py``) that a run without it quotes,
and the bench's part ``peer`` (:func:`peer`: flash-attn-4 beside cuDNN and our two forwards, its
failures recorded and not retried). ``python -m repro.fa4.bench --only peer`` runs it
(``lab/gpu_run_peer.sh`` installs the wheels first); its shapes, inputs and FLOPs are the bench's, from
:mod:`repro.fa4.shapes`.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from paperclub.bench import (
    Budget,
    Candidate,
    Report,
    error_text,
    measure,
    plot_tflops_by_length,
    quiet_write,
    sdpa,
    sdpa_reference,
    timed_pass,
    versions,
)
from paperclub.testing import rel_error
from repro.fa4.api import Switches, attention
from repro.fa4.shapes import (
    COLUMNS,
    OURS_BEST,
    OURS_GLUON,
    _err_note,
    _report,
    _row_error,
    _shapes,
    flops,
    make_inputs,
)

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


def smoke_error(out_dir: Path | None) -> str:
    """The smoke test's note about flash-attn-4, if its JSON is in ``out_dir``."""
    for f in sorted((out_dir or Path(".")).glob("*-fa4-smoke.json")):
        notes = json.loads(f.read_text(encoding="utf-8")).get("notes", "")
        return notes.split("flash-attn-4 ", 1)[-1] if "flash-attn-4 " in notes else "smoke test passed"
    return "no smoke-test result found"


def _ours(q, k, v, causal: bool, config: Switches):
    """Our attention with ``config``: the candidate ``repro.fa4.bench.ours`` builds from the same changes."""
    return lambda: attention(q, k, v, causal=causal, config=config)


def _candidate(report: Report, row: dict, f, inputs, f_same, ref, failed: dict, notes: dict) -> Candidate:
    """One candidate of :func:`peer`. Its check compiles it (one call) and, forward, notes its distance
    from cuDNN's output; a failure is its row (flash-attn-4's first also the notes'), the rest go on."""
    name, passes, causal, s = row["impl"], row["pass"], row["causal"], row["S"]
    grad = None if passes == "fwd" else torch.randn_like(inputs[0])
    fn = timed_pass(passes, f, inputs, grad, inference=True)

    def check():
        try:
            if passes == "fwd" and f_same is not None:
                with torch.no_grad():
                    notes[name] = _err_note(rel_error(f_same(), ref))
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


def peer(
    out_dir: Path | None,
    seqlens,
    use_fa4: bool = True,
    rounds: int = PEER_ROUNDS,
    base: Switches | None = None,
) -> None:
    """The bench's part ``peer``: flash-attn-4, cuDNN (SDPA) and ours (OURS_BEST, OURS_GLUON) at the
    shapes of ``bench.full``, one process -> ``<device>-peer.json``. Ours is ``base`` (the bench's
    ``--set``; default ``Switches()``) with each forward's changes.

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
    fn4, info = load_flash_attn_4() if use_fa4 else (None, f"not run (--no-fa4): {smoke_error(out_dir)}")
    report.notes += f" flash-attn-4: {info}."
    failed: dict[tuple[str, bool], str] = {}
    for causal, s, b in _shapes(seqlens, Budget(None), 0, []):
        q, k, v = make_inputs(b, s)
        qt, kt, vt = make_inputs(b, s, layout="bhsd")
        same, ref = sdpa_reference(qt, kt, vt, causal)
        impls = (
            [("fa4-cute", fa4_cute(fn4, q, k, v, causal), (q, k, v), fa4_cute(fn4, *same, causal))]
            if fn4
            else []
        )
        impls.append(("sdpa-cudnn", sdpa(qt, kt, vt, causal, "cudnn"), (qt, kt, vt), None))
        for name, changes in (("fa4-triton-tma", OURS_BEST), ("fa4-gluon", OURS_GLUON)):
            config = replace(base or Switches(), **changes)
            impls.append((name, _ours(q, k, v, causal, config), (q, k, v), _ours(*same, causal, config)))
        for passes in ("fwd", "fwd+bwd"):
            row = dict(group="peer", causal=causal, S=s, B=b, **{"pass": passes})
            cands, notes = {}, {}
            for name, f, inputs, f_same in impls:
                if name == "fa4-cute" and (passes, causal) in failed:
                    _row_error(
                        report, **row, impl=name, note=f"not retried: {failed[(passes, causal)][:120]}"
                    )
                    continue
                cands[name] = _candidate(report, {**row, "impl": name}, f, inputs, f_same, ref, failed, notes)
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
    plot_tflops_by_length(report, [(p, {"pass": p}) for p in ("fwd", "fwd+bwd")])
    report.write(tag="peer", out_dir=out_dir)
