"""Do the kernels compile to the same code after a change of files? Offline sm_90a fingerprints of every
kernel launch the NSA fast path makes (no GPU).

    python -m repro.nsa.lab.fingerprints record OUT.json [--legacy]   # this checkout's launches
    python -m repro.nsa.lab.fingerprints compare BEFORE.json AFTER.json

``record`` runs ``launches.scenarios`` (the layer forward + backward at the bench's and the GPU tests'
shapes, every non-default switch, the strided sweep's tiles, the split forced either way, the top-n
fallback, the fused gate, decode), compiles each launch with its own arguments (``launches``) and
writes one row per compiled kernel: scenario, launch number, kernel, constexprs, warps and stages,
the specialised signature, and ``paperclub.lab.compile_report``'s ``ptx_sha`` (the PTX without its
debug information: ``.file`` / ``.loc`` lines and ``.debug_*`` sections name the source file and
line, which moving a kernel changes) and ``sass_sha``. ``compare`` matches two records launch by
launch and exits 1 when anything differs or a launch is missing on either side.

The stage split of issue #40 (``ops.py`` + ``kernels.py`` into one file per stage, switches as a
frozen object) was recorded on main before it (``--legacy``, on a plain export of main's commit with
this folder and ``paperclub/lab.py`` copied in: ``fingerprints-before-stage-split.json``) and on the branch
after it: every launch the same, kernel, launch arguments and both fingerprints.

Issue #39 (separate key and value head sizes, keys in two pieces) was recorded the same way on main
before it (``fingerprints-before-head-sizes.json``, commit 0cde878) and compared with the branch after
it: all 236 launches the same. The launches of the new head sizes are ``launches.head_size_scenarios``,
outside this record (they did not exist before).

Issue #40's kernel helpers (``compression._value_layout`` / ``_tile_offsets``, ``common.dq_step`` /
``dkdv_step``) were recorded before and after each step, 2026-11-29: every launch's SASS the same (the
PTX differs in its debug labels, ``$L__tmp``, where an inlined call adds a scope). The same helpers in
the strided dQ tile, the strided dK/dV step and the two strided backward kernels' own offsets changed
the SASS of the fp32 split launches (register order), and ``selected._selected_block`` in the decoding
kernel that of its fp32 D = 16 launch: those stay written out.
"""

from __future__ import annotations

import argparse
import json
import sys

from repro.nsa.lab import launches as ln  # first: it removes TRITON_INTERPRET before Triton loads

FIELDS = ("kernel", "constexprs", "options", "signature", "ptx_sha", "sass_sha")


def record_rows(api) -> list[dict]:
    """One row per compiled kernel of every launch of every scenario (an autotuned launch: per config)."""
    from paperclub.lab import compile_report

    rows, cache, counter = [], {}, {}
    for launch in ln.record(api, ln.scenarios(api)):
        for c in ln.compile_launch(launch):
            n = counter.get(launch.scenario, 0)
            counter[launch.scenario] = n + 1
            key = json.dumps([c["kernel"], c["constexprs"], c["options"], c["signature"]], sort_keys=True)
            if key not in cache:
                rep = compile_report(c["compiled"], ptxas=False)
                cache[key] = {k: rep[k] for k in ("ptx_sha", "sass_sha", "shared")}
                print(
                    f"compiled {c['kernel']} {c['constexprs']} {c['options']}: {cache[key]['ptx_sha']}",
                    flush=True,
                )
            rows.append(
                {"scenario": launch.scenario, "launch": n, **{k: c[k] for k in FIELDS[:4]}, **cache[key]}
            )
    return rows


def compare(before: list[dict], after: list[dict]) -> int:
    """Print each launch whose kernel, arguments or fingerprints differ, or that one side lacks; return
    how many."""
    key = lambda r: (r["scenario"], r["launch"])  # noqa: E731
    a, b = {key(r): r for r in before}, {key(r): r for r in after}
    diffs = 0
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            diffs += 1
            print(f"{k}: only {'after' if k in b else 'before'}")
            continue
        changed = [f for f in FIELDS if a[k].get(f) != b[k].get(f)]
        if changed:
            diffs += 1
            print(f"{k}: " + ", ".join(f"{f} {a[k].get(f)} -> {b[k].get(f)}" for f in changed))
    kernels = len({r["ptx_sha"] for r in after})
    print(f"{len(set(a) & set(b))} launches in both records, {diffs} differ; {kernels} distinct kernels")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="compile this checkout's launches and write their fingerprints")
    r.add_argument("out")
    r.add_argument("--legacy", action="store_true", help="drive the layout before the stage split")
    c = sub.add_parser("compare", help="compare two records")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        with open(args.before) as f, open(args.after) as g:
            return 1 if compare(json.load(f)["launches"], json.load(g)["launches"]) else 0
    import torch
    import triton

    rows = record_rows(ln.LegacyApi() if args.legacy else ln.Api())
    with open(args.out, "w") as f:
        json.dump({"triton": triton.__version__, "torch": torch.__version__, "launches": rows}, f, indent=0)
    print(f"wrote {args.out}: {len(rows)} compiled launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
