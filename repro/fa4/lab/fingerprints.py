"""Do the kernels compile to the same code after a refactoring? Offline sm_90a fingerprints of every fa4
kernel that runs by default, and of the cross-checks, at the launches the fast path uses (no GPU).

    python -m repro.fa4.lab.fingerprints record OUT.json            # this checkout's kernels
    python -m repro.fa4.lab.fingerprints compare BEFORE.json AFTER.json

``record`` compiles :data:`CASES` (through ``lab/compile.py``, in a process without the interpreter)
and writes one row per case: the case, ``kernel``, ``ptx_sha`` and ``sass_sha`` (the PTX without its
debug information, and the SASS, each hashed: see :mod:`paperclub.lab`), shared memory, registers and
spills. ``compare`` prints a markdown table, one line per case, and exits 1 when a case's
fingerprints differ, a case fails to compile, or a case of the first file is missing from the second;
a case only the second has (a kernel the change added) is listed as new.

Issue #40 moved the kernels into files named by stage and deleted the Gluon backward's bisect
(``SKIP``) and deferred-dQ (``DQ_DEFER``) constexprs; recorded on main before the move (a plain
export of the base commit with this folder and ``paperclub/lab.py`` copied in) and on the branch
after it, every case's PTX and SASS fingerprints are equal: the results are in the issue's report.

Issue #42 (head sizes 1-256 by padding, v's own head size, the sliding window) kept every kernel that
ran on a GPU before as it was and added the window entry points and the D = 256 launches
(:func:`issue42_cases`): recorded on main and on the branch, the 66 cases before it have equal PTX and
SASS fingerprints. A first attempt, which moved the backward kernels' bodies into functions shared
with the window kernels, moved a debug label in their PTX (``$L__tmp`` after ``ret``) and, for the
fused backward's TMA launch at D = 128, ptxas's schedule: main's backward kernels are kept verbatim.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from paperclub.lab import offline

_FWD_BASE = dict(kernel="fwd", dtype="bf16", d=128, block_m=128, block_n=128, num_warps=8, num_stages=3)
#: the Triton forward's Switches one at a time, as bench.ABLATIONS (the launch after api.resolve)
_FWD_VARIANTS = {
    "default": {},
    "no-lazy-rescale": {"lazy_rescale": False},
    "soft-exp-1/4": {"soft_exp": 1, "num_stages": 2},
    "soft-exp-1/2": {"soft_exp": 2},
    "soft-exp-all": {"soft_exp": 4},
    "pingpong": {"pingpong": True, "block_m": 64},
    "persistent": {"persistent": True},
    "tma": {"tma": True},
    "warp-specialize": {"warp_specialize": True},
    "count": {"count": True},
}
#: Switches' default Gluon forward launch (api.GLUON_LAUNCH: no turn barriers, TMA store; lazy rescaling on)
_GLUON_FWD = dict(kernel="gluon_fwd", lazy_rescale=True, pingpong_sync=False, store_tma=True)

CASES: list[dict] = [
    *[
        {**_FWD_BASE, **change, "causal": c, "name": f"fwd {name}"}
        for name, change in _FWD_VARIANTS.items()
        for c in (False, True)
    ],
    *[
        {**_FWD_BASE, "d": 64, "dtype": "fp16", "causal": c, "name": "fwd default d64 fp16"}
        for c in (False, True)
    ],
    *[
        dict(kernel=k, d=d, dtype="bf16", causal=c, block_m=64, block_n=64, num_warps=4, num_stages=2, name=k)
        for k in ("bwd_dkdv", "bwd_dq")
        for d in (64, 128)
        for c in (False, True)
    ],
    *[dict(kernel="preprocess", d=d, dtype="bf16", block_m=64, name="preprocess") for d in (64, 128)],
    *[
        dict(kernel="fused", d=d, dtype="bf16", causal=c, config=cfg, name=f"fused {cfg}")
        for cfg in ("m64-n128-w8-s2", "m64-n128-w8-s2-tma-dqtma")
        for d in (64, 128)
        for c in (False, True)
    ],
    *[
        {**_GLUON_FWD, "d": d, "dtype": t, "causal": c, "name": "gluon_fwd default"}
        for d in (64, 128)
        for c in (False, True)
        for t in ("bf16", "fp16")
    ],
    *[
        dict(kernel="gluon_fwd", d=128, dtype="bf16", causal=c, name="gluon_fwd launcher defaults")
        for c in (False, True)
    ],
    *[
        dict(
            kernel="gluon_bwd",
            d=d,
            dtype=t,
            causal=c,
            dq_tma=tma,
            name=f"gluon_bwd {'tma' if tma else 'atomic'}",
        )
        for tma in (True, False)
        for d in (64, 128)
        for c in (False, True)
        for t in ("bf16", "fp16")
    ],
]


def issue42_cases() -> list[dict]:
    """The kernels issue #42 made reachable, at the launches ``api.resolve`` gives them on a GPU: the
    Triton forward and both Triton backwards at D = 256 (padded head sizes above 128; v on its own
    tile of 128 for D = 192 / D_v = 128), v on its own tile at D = 64 (``own_v_tile``, off by default),
    and the sliding-window entry points at D = 64, 128 and 256: offline-compiled here (spills checked
    in ``tests/test_lab.py``), run on a GPU by flash-attn's test matrix (``tests/test_gpu_peer_matrix.py``)."""
    from repro.fa4.api import Switches, resolve

    out = []
    layouts = ((256, 256, False), (256, 128, False), (64, 128, False), (64, 64, True), (128, 128, True),
               (256, 256, True))  # fmt: skip
    for d, d_v, window in layouts:
        general = window or d_v != d
        # as api._prepare: the general kernels' launch tables, at the wider of the two tiles
        fwd = resolve(Switches(bwd="fa2"), max(d, d_v), False, general)
        fused = resolve(Switches(bwd="fused"), max(d, d_v), False, general)
        tag = f"d{d}" + (f" dv{d_v}" if d_v != d else "") + (" window" if window else "")
        common = dict(d=d, d_v=d_v, dtype="bf16", causal=not window, window=window)
        out.append(dict(kernel="fwd", **common, block_m=fwd.block_m, block_n=fwd.block_n,
                        num_warps=fwd.num_warps, num_stages=fwd.num_stages, name=f"fwd {tag}"))  # fmt: skip
        bwd = dict(block_m=fwd.bwd_block_m, block_n=fwd.bwd_block_n, num_warps=fwd.bwd_num_warps,
                   num_stages=fwd.bwd_num_stages)  # fmt: skip
        for kernel in ("bwd_dkdv", "bwd_dq"):
            out.append(dict(kernel=kernel, **{**common, "window": general}, **bwd, name=f"{kernel} {tag}"))
        launch = [
            fused.bwd_block_m,
            fused.bwd_block_n,
            fused.bwd_num_warps,
            fused.bwd_num_stages,
            False,
            False,
        ]
        out.append(dict(kernel="fused", **{**common, "window": general}, launch=launch, name=f"fused {tag}"))
    return out


CASES += issue42_cases()

_KEY_FIELDS = ("name", "d", "dtype", "causal")


def key(row: dict) -> str:
    return " ".join(f"{row.get(f)}" for f in _KEY_FIELDS)


def record(out: Path) -> list[dict]:
    """Compile every case offline and write the rows to ``out``."""
    rows = offline("repro.fa4.lab.compile:report", CASES, timeout_s=3600)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if "error" in r]
    print(f"{len(rows)} cases, {len(bad)} failed to compile; wrote {out}")
    for r in bad:
        print(f"  {key(r)}: {r['error'][-300:]}")
    return rows


def compare(before: list[dict], after: list[dict]) -> tuple[str, int]:
    """A markdown table of the cases (same / DIFFERENT / missing) and the number that are not the same."""
    a = {key(r): r for r in before}
    b = {key(r): r for r in after}
    lines = [
        "| case | kernel | ptx_sha | sass_sha | registers | spills | shared | verdict |",
        "|" + "---|" * 8,
    ]
    differ = 0
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k), b.get(k)
        if x is None and y is not None and "error" not in y:  # a kernel the change added: nothing to compare
            lines.append(
                f"| {k} | {y['kernel']} | {y['ptx_sha']} | {y['sass_sha']} | {y.get('registers')} | "
                f"{y.get('spill_stores')} | {y.get('shared')} | new |"
            )
            continue
        if x is None or y is None or "error" in x or "error" in y:
            differ += 1
            lines.append(
                f"| {k} | | | | | | | missing or error ({'before' if x is None or 'error' in x else 'after'}) |"
            )
            continue
        same = x["ptx_sha"] == y["ptx_sha"] and x["sass_sha"] == y["sass_sha"]
        differ += not same

        def pair(f: str, x: dict = x, y: dict = y) -> str:
            return str(x.get(f)) if x.get(f) == y.get(f) else f"{x.get(f)} -> {y.get(f)}"

        lines.append(
            f"| {k} | {pair('kernel')} | {pair('ptx_sha')} | {pair('sass_sha')} | {pair('registers')} | "
            f"{pair('spill_stores')} | {pair('shared')} | {'same' if same else 'DIFFERENT'} |"
        )
    return "\n".join(lines), differ


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "record":
        record(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        before, after = (json.loads(Path(p).read_text()) for p in argv[1:])
        table, differ = compare(before, after)
        print(table)
        new = table.count("| new |")
        print(
            f"\n{differ} of {len(before)} cases differ"
            if differ
            else f"\nall {len(before)} cases of the first file: the same code; {new} new in the second"
        )
        return 1 if differ else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
