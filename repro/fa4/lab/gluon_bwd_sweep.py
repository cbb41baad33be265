"""Run the Gluon backward over the GPU matrix's shapes, one process per group, to find a fault's shape.

    python -m repro.fa4.lab.gluon_bwd_sweep [--out DIR] [--budget-s 300] [--shapes matrix|boundary]
                                            [--dq tma|atomic] [--no-pad]

A kernel that faults on the GPU ("an illegal instruction") ends its process's CUDA context, and with
it every test after it. This tool runs each (head dim, causal, dtype, forward) group of the GPU matrix
(``tests/test_gpu_bwd.SHAPES``, or :data:`BOUNDARY_SHAPES`) in a process of its own, shape by shape
(:func:`sweep_one`), each shape printing one JSON line as soon as it finishes: the gradients' largest
relative error against the FA2 Triton backward on the same forward. Where a process dies or hangs, the
shape after its last line is recorded as the one that faulted and the group goes on from the next
shape in a new process. ``--no-pad`` launches without the per-head padding of LSE and delta
(``gluon_bwd.pad_stats``) to reproduce the fault it fixed; ``--dq`` picks the dQ accumulation.
``--out`` writes the rows as a Report (``<device>-gluon-bwd-sweep[-<dq>][-nopad].json``, or
``-boundary``).

History (results/*-gluon-bwd-sweep.json, *-gluon-bwd-boundary-pad-off.json / -pad-on.json): on the
first H100 run every shape with S_q % 4 != 0 faulted; the padding fixed it (see the history above
``gluon_bwd.check_device``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from paperclub.bench import Budget, Report, bench_parser, parse_bench_args
from paperclub.testing import rel_error

#: behind the Gluon forward first (the pairing that faulted, and the one the benchmark times), D = 128 first
SWEEP_GROUPS = [
    (d, c, t, f)
    for f in ("gluon", "triton")
    for d in (128, 64)
    for c in (False, True)
    for t in ("bf16", "fp16")
]

#: The H100 sweep of 2026-11-25 (D = 128, behind the Gluon forward, bf16 and fp16, causal or not):
#: every matrix shape with S_q in {1, 113} faulted ("an illegal instruction"), every one with S_q in
#: {1000, 2048} ran (1e-5 to 1e-4 from the FA2 backward), whatever S_k, B and the GQA group. These
#: shapes (B, S_q, S_k, H, H_kv) find the S_q boundary and whether the group size matters.
BOUNDARY_SHAPES = [
    *[(1, s, s, 2, 2) for s in (1, 64, 65, 113, 127, 128, 129, 192, 255, 256, 257, 384, 511)],
    (1, 113, 113, 8, 2), (1, 256, 256, 8, 2), (1, 1000, 1000, 2, 2),
]  # fmt: skip

SWEEP_COLUMNS = ["d", "causal", "dtype", "fwd", "dq", "shape", "B", "S_q", "S_k", "H", "H_kv", "status",
                 "rel_err_vs_fa2"]  # fmt: skip
DQ = {"tma": True, "atomic": False}


def matrix_shapes() -> list[tuple[int, ...]]:
    """The GPU matrix's shapes (B, S_q, S_k, H, H_kv): the tests' own list, so that the sweep reproduces them."""
    from repro.fa4.tests.test_gpu_bwd import SHAPES

    return list(SHAPES)


def sweep_one(
    d: int, causal: bool, dtype: str, fwd: str, start: int, shapes: list, dq: str, pad: bool
) -> None:
    """``shapes`` from index ``start`` on: the forward (Triton or Gluon), then the FA2 backward and the Gluon
    backward (``dq``, ``pad``) from the same output and LSE; one JSON line per shape."""
    from repro.fa4.api import Switches, resolve, run_backward, run_forward
    from repro.fa4.gluon_bwd import gluon_attention_backward

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    sw = resolve(Switches(gluon=fwd == "gluon", bwd="fa2"), d, False)
    for i, (b, s_q, s_k, h, h_kv) in enumerate(shapes):
        if i < start or (causal and s_q > s_k):
            continue
        g = torch.Generator().manual_seed(i)
        q, k, v = (
            torch.randn(b, s, n, d, generator=g).to("cuda", dt)
            for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv))
        )
        do = torch.randn(b, s_q, h, d, generator=g).to("cuda", dt)
        scale = d**-0.5
        o, lse, _ = run_forward(q, k, v, causal, scale, sw)
        ref = run_backward(do, q, k, v, o, lse, causal, scale, sw)
        got = gluon_attention_backward(do, q, k, v, o, lse, causal, scale, dq_tma=DQ[dq], pad=pad)
        torch.cuda.synchronize()
        row = {"d": d, "causal": causal, "dtype": dtype, "fwd": fwd, "dq": dq, "shape": i,
               "B_Sq_Sk_H_Hkv": [b, s_q, s_k, h, h_kv]}  # fmt: skip
        err = max(rel_error(a, r) for a, r in zip(got, ref, strict=True))  # the worst of dq, dk, dv
        print(json.dumps({**row, "status": "ran", "rel_err_vs_fa2": err}), flush=True)


def sweep(
    shapes: list,
    groups: list,
    dq: str = "tma",
    pad: bool = True,
    timeout_s: float = 90.0,
    budget: Budget | None = None,
) -> list[dict]:
    """Each group of ``groups`` over ``shapes`` in its own processes (see the module docstring), while
    ``budget`` (default 300 s from this call) has time left."""
    rows, budget = [], budget or Budget(300.0)
    for d, causal, dtype, fwd in groups:
        start = 0
        while start < len(shapes):
            if not budget.allows():
                rows.append(
                    {
                        "d": d,
                        "causal": causal,
                        "dtype": dtype,
                        "fwd": fwd,
                        "dq": dq,
                        "status": "not run: budget",
                    }
                )
                break
            args = ["--one", json.dumps([d, causal, dtype, fwd, start, shapes, dq, pad])]
            try:
                r = subprocess.run([sys.executable, "-m", "repro.fa4.lab.gluon_bwd_sweep", *args], capture_output=True,
                                   text=True, timeout=timeout_s)  # fmt: skip
                text, failed, status = r.stdout, r.returncode != 0, f"failed (exit {r.returncode})"
                err = (r.stderr or "")[-600:]
            except subprocess.TimeoutExpired as exc:
                text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                failed, status, err = True, f"timeout after {timeout_s:.0f} s", ""
            done = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
            rows.extend(done)
            for row in done:
                print(json.dumps(row), flush=True)
            if not failed:
                break
            last = done[-1]["shape"] if done else start - 1
            nxt = next(
                (i for i in range(last + 1, len(shapes)) if not (causal and shapes[i][1] > shapes[i][2])),
                None,
            )
            if nxt is None:
                break
            bad = {"d": d, "causal": causal, "dtype": dtype, "fwd": fwd, "dq": dq, "shape": nxt,
                   "B_Sq_Sk_H_Hkv": list(shapes[nxt]), "status": status, "error": err}  # fmt: skip
            print(json.dumps(bad), flush=True)
            rows.append(bad)
            start = nxt + 1
    return rows


def sweep_report(rows: list[dict], what: str, measure_ceilings: bool = True) -> Report:
    """``sweep``'s rows as a Report (one row per shape: ran with its error against the FA2 backward, or
    the process's fault; groups the budget did not reach as one row each)."""
    rep = Report(
        package="fa4",
        title=f"Gluon backward on the GPU matrix's shapes, one process per group ({what})",
        columns=SWEEP_COLUMNS,
        peer="the FA2 Triton backward on the same forward (rel_err_vs_fa2: largest over dq, dk, dv)",
        notes="status 'failed (exit 1): an illegal instruction': the kernel faulted at that shape (the "
        "process's stderr says so); 'not run: budget': the call's budget ended before that group",
        measure_ceilings=measure_ceilings,
    )
    for r in rows:
        b, s_q, s_k, h, h_kv = r.get("B_Sq_Sk_H_Hkv") or [None] * 5
        status = r["status"]
        err = r.get("error", "").lower().replace(" ", "")
        if status.startswith("failed") and "illegalinstruction" in err:
            status += ": an illegal instruction"
        rep.add(
            d=r["d"], causal=r["causal"], dtype=r["dtype"], fwd=r["fwd"], dq=r.get("dq", "atomic"), shape=r.get("shape"),
            B=b, S_q=s_q, S_k=s_k, H=h, H_kv=h_kv, status=status, rel_err_vs_fa2=r.get("rel_err_vs_fa2"),
        )  # fmt: skip
    return rep


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:  # a child process: one group from a start index
        d, causal, dtype, fwd, start, shapes, dq, pad = json.loads(argv[1])
        sweep_one(d, causal, dtype, fwd, start, shapes, dq, pad)
        return
    ap = bench_parser(
        __doc__.split("\n\n")[0], budget_s=300.0, rounds=None, only=False, settings=False, tag=False
    )
    ap.add_argument("--shapes", choices=("matrix", "boundary"), default="matrix")
    ap.add_argument("--dq", choices=tuple(DQ), default="tma")
    ap.add_argument(
        "--no-pad", action="store_true", help="without gluon_bwd.pad_stats (reproduces the fault)"
    )
    ap.add_argument("--timeout-s", type=float, default=90.0, help="per process")
    args = parse_bench_args(ap, argv)
    boundary = args.shapes == "boundary"
    shapes = [list(s) for s in (BOUNDARY_SHAPES if boundary else matrix_shapes())]
    groups = (
        SWEEP_GROUPS[:1] if boundary else SWEEP_GROUPS
    )  # the boundary: D = 128, not causal, bf16, Gluon fwd
    rows = sweep(shapes, groups, args.dq, not args.no_pad, args.timeout_s, args.budget)
    if args.out:
        tag = ("gluon-bwd-boundary" if boundary else "gluon-bwd-sweep") + (
            "" if args.dq == "tma" else f"-{args.dq}"
        )
        tag += "-nopad" if args.no_pad else ""
        sweep_report(rows, tag).write(tag=tag, out_dir=Path(args.out))


if __name__ == "__main__":
    main()
