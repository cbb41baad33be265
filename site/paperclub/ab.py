"""Before and after a refactoring, on one GPU in one call: the same timing driver run on two checkouts.

A refactoring that moves kernels between files (issue #40) must keep each kernel's speed and output.
Fingerprints of the compiled code (:mod:`paperclub.lab`) show the machine code is the same; this
shows the same on the GPU, end to end through each tree's public entry point::

    python -m paperclub.ab --driver repro/fa4/lab/ab_driver.py --tree old=/tmp/old --tree new=. \\
        --package fa4 --rounds 2 --out repro/fa4/results

The driver is a file that imports only torch and the reproduction's public API, which resolves to
the tree on ``PYTHONPATH`` (``TREE/site:TREE``): so one driver file runs both trees. It defines
``cases(args)``, run by :mod:`paperclub.ab_worker` (which times them): per case the time of ours and
of a peer that does not change between the trees (cuDNN, SDPA) in the same process, and a ``check``
(numbers summarising what ours returns, e.g. sums of the output and gradients) to compare.

The trees run as separate processes, ``--rounds`` times each, the order alternating (old new, new
old, ...), so that drift of clocks and temperature falls on both. Per case the result has each
tree's median time of ours and of the peer, ``new_vs_old`` (ours' time after / before, > 1 slower),
``peer_drift`` (the same for the peer, the noise floor of the comparison), ``check_rel``, the
largest relative difference of the check numbers between the trees, and ``check_noise``, the same
between two runs of one tree (nonzero for a kernel that is not deterministic: atomics).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["compare", "run_tree", "summarise"]


def run_tree(
    driver: Path, tree: Path, *, args: list[str], timeout_s: float, python: str = sys.executable
) -> dict:
    """One run of ``driver`` against ``tree``: its last line's JSON (``{"cases": ...}``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "site"), str(tree)]), PYTHONUNBUFFERED="1")
    worker = Path(__file__).with_name("ab_worker.py")  # by path: it imports nothing of paperclub
    r = subprocess.run(
        [python, str(worker), str(driver), *args], cwd=tree, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stdout + r.stderr)[-1500:]
        raise RuntimeError(f"{driver.name} on {tree} exited {r.returncode}:\n{tail}")
    return json.loads(lines[-1])


def _rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two lists of check numbers (inf if they differ in length)."""
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b, strict=True)), default=0.0)


def summarise(runs: dict[str, list[dict]], old: str, new: str) -> list[dict]:
    """Rows per case from each tree's runs (``{label: [driver output, ...]}``)."""
    rows = []
    cases = [c for c in runs[new][0]["cases"] if all(c in r["cases"] for rs in runs.values() for r in rs)]
    for case in cases:
        row: dict = {"case": case}
        for label in (old, new):
            got = [r["cases"][case] for r in runs[label]]
            row[f"{label}_ms"] = round(statistics.median(g["ours_ms"] for g in got), 4)
            row[f"{label}_peer_ms"] = round(statistics.median(g["peer_ms"] for g in got), 4)
        row["new_vs_old"] = round(row[f"{new}_ms"] / row[f"{old}_ms"], 4)
        row["peer_drift"] = round(row[f"{new}_peer_ms"] / row[f"{old}_peer_ms"], 4)
        a, b = runs[old][0]["cases"][case].get("check", []), runs[new][0]["cases"][case].get("check", [])
        if a and len(a) == len(b):
            row["check_rel"] = _rel(a, b)
        # the same between two runs of one tree: what a nondeterministic kernel (atomics) gives anyway
        same = [
            _rel(rs[0]["cases"][case].get("check", []), r["cases"][case].get("check", []))
            for rs in runs.values()
            for r in rs[1:]
        ]
        if same:
            row["check_noise"] = max(same)
        rows.append(row)
    return rows


def compare(driver: Path, trees: dict[str, Path], *, rounds: int, args: list[str], timeout_s: float) -> dict:
    """Run the driver ``rounds`` times on each of the two trees (old first, new second in ``trees``),
    alternating the order, and summarise."""
    if len(trees) != 2:
        raise ValueError(f"--tree: expected two trees (old and new), got {len(trees)}: {sorted(trees)}")
    if rounds < 1:
        raise ValueError(f"--rounds: expected at least 1, got {rounds}")
    old, new = trees
    runs: dict[str, list[dict]] = {old: [], new: []}
    order = [old, new]
    started = time.monotonic()
    for i in range(rounds):
        for label in order if i % 2 == 0 else order[::-1]:
            runs[label].append(run_tree(driver, trees[label], args=args, timeout_s=timeout_s))
            print(f"[ab] round {i + 1}: {label} done at {time.monotonic() - started:.0f} s", flush=True)
    return {"rows": summarise(runs, old, new), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paperclub.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", type=Path, required=True, help="the timing script (run on each tree)")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR", help="old first, then new")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=400, help="one driver run's limit")
    ap.add_argument("--package", required=True, help="the reproduction the result belongs to, e.g. fa4")
    ap.add_argument("--out", type=Path, required=True, help="the result folder (<device>-<tag>.json in it)")
    ap.add_argument("--tag", default="ab")
    ap.add_argument("--title", default="")
    ap.add_argument("driver_args", nargs="*", help="passed to the driver (after --)")
    a = ap.parse_args(argv)
    trees = {}
    for item in a.tree:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_dir():
            ap.error(f"--tree {item!r}: expected LABEL=DIR with an existing directory")
        trees[label] = Path(path).resolve()
    if not a.driver.is_file():
        ap.error(f"--driver {str(a.driver)!r}: no such file")
    try:
        got = compare(a.driver.resolve(), trees, rounds=a.rounds, args=a.driver_args, timeout_s=a.timeout_s)
    except ValueError as exc:
        ap.error(str(exc))
    from paperclub.bench import Report

    old, new = trees
    columns = ["case", f"{old}_ms", f"{new}_ms", "new_vs_old", f"{old}_peer_ms", f"{new}_peer_ms",
               "peer_drift", "check_rel", "check_noise"]  # fmt: skip
    labels = {label: (p / "COMMIT").read_text().strip() if (p / "COMMIT").exists() else str(p)
              for label, p in trees.items()}  # fmt: skip
    report = Report(
        package=a.package,
        title=a.title or f"before/after ({old} -> {new}), {a.driver.name}",
        columns=columns,
        peer="the driver's peer, timed in the same process (its drift between the trees is the noise floor)",
        notes=f"trees: {json.dumps(labels)}; {a.rounds} rounds per tree, separate processes, order alternating; "
        "median per tree; new_vs_old > 1 is slower after",
        measure_ceilings=False,
    )
    for row in got["rows"]:
        report.add(**{c: row.get(c) for c in columns})
    report.write(tag=a.tag, out_dir=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
