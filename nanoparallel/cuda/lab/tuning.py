"""The script that makes ``auto``'s tables (:mod:`nanoparallel.cuda.policy`) from measurements.

After a GPU run, one command turns its result files into new tables and a summary report::

    python -m nanoparallel.cuda.lab.tuning \\
        --sweep nanoparallel/results/<device>-cuda-x2.json nanoparallel/results/<device>-cuda-x4.json \\
        --diagnose nanoparallel/results/<device>-cuda-x4-diagnose.json \\
        --write nanoparallel/cuda/auto_tables.py --summary nanoparallel/results --pins

* algorithms (from each sweep): walking up the sizes, the fastest of our checked algorithms at a
  size becomes the choice from that size on, unless the current choice is within ``MARGIN`` of it
  (3% or 2 us: the host noise at small sizes), so noise does not flip the table back and forth.
  Bounds are measured sizes: a choice starts at the smallest size where it was measured to win.
* steps and programs (from a diagnose file): at each size the diagnose swept, the fastest
  (steps, programs) of each pipelined algorithm; below the smallest swept size the table keeps
  its previous first row. The all-to-all gets one value for all sizes (the one with the smallest
  sum of time over best): its ranks may hold different sizes but must cut their calls alike.
* ``--summary``: one Report of NCCL against ``auto`` (as the new tables choose) for every world
  size side by side, the table and plot the site shows (``<device>-cuda-summary.json``).
* ``--pins``: the choices at the sizes ``tests/nanoparallel/test_cuda_policy.py`` pins, to paste
  there, so that a change of policy shows in a test's diff.

A GPU run can also hand the steps and programs it just measured to the next step of the same run
without touching the committed tables: ``--diagnose FILE --tuning-out tuning.json``, then
``python -m nanoparallel.cuda.sweep --tuning tuning.json``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from nanoparallel.cuda.policy import SIZE_INDEPENDENT, Policy, Table, pick, policies, policy_for  # noqa: F401

MARGIN = 0.03
MARGIN_US = 2.0
# the sizes the policy tests pin (bytes as each collective counts them)
PIN_SIZES = (8, 64 << 10, 16 << 20, 64 << 20, 256 << 20, 1 << 30)


# -- making tables from measurements ------------------------------------------------------------


def algorithm_tables(
    rows: list[dict], margin: float = MARGIN, margin_us: float = MARGIN_US
) -> dict[str, Table]:
    """Per collective, (from bytes, algorithm) rows from one sweep's rows (``nanoparallel.cuda.sweep``).

    Only our algorithms' rows with a time count, never ``auto`` (it is what is being made) and never
    a row whose check failed (``checked`` False)."""
    times: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("impl") != "nanoparallel" or r.get("algorithm") in (None, "auto", "nccl"):
            continue
        if r.get("checked") is False or not r.get("time_us"):
            continue
        times[r["collective"]][int(r["bytes"])][r["algorithm"]] = float(r["time_us"])
    tables = {}
    for coll, by_size in times.items():
        table: list[tuple[int, str]] = []
        current = None
        for nbytes in sorted(by_size):
            at = by_size[nbytes]
            best = min(sorted(at), key=at.get)
            if current is not None and current in at and at[current] <= at[best] * (1 + margin) + margin_us:
                continue
            current = best
            table.append((0 if not table else nbytes, best))
        tables[coll] = tuple(table)
    return tables


def knob_tables(rows: list[dict], sm_count: int, base: Policy | None = None) -> tuple[dict, dict]:
    """(steps, programs_per_sm) tables from a diagnose file's rows (``nanoparallel.cuda.lab.diagnose``):
    rows whose ``section`` is a collective and whose ``variant`` an algorithm timed at several
    (steps, programs). ``base`` gives each table's first row (the choice below the swept sizes)."""
    configs: dict[str, dict[int, dict[tuple, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if not r.get("time_us") or r.get("variant", "").startswith("nccl") or r.get("tunable") is not True:
            continue
        key = f"{r['section']}/{r['variant']}"
        configs[key][int(r["bytes"])][(r.get("steps"), r.get("programs"))] = float(r["time_us"])
    steps_t: dict[str, Table] = {}
    programs_t: dict[str, Table] = {}
    for key, by_size in configs.items():
        coll = key.split("/")[0]
        if not any(len(at) > 1 for at in by_size.values()):
            continue
        if coll in SIZE_INDEPENDENT:  # one config for every size: the smallest sum of time / best
            common = set.intersection(*(set(at) for at in by_size.values()))
            cfg = min(
                sorted(common, key=str),
                key=lambda c: sum(at[c] / min(at.values()) for at in by_size.values()),
            )
            chosen = {0: cfg}
        else:
            chosen = {nbytes: min(sorted(at, key=str), key=at.get) for nbytes, at in sorted(by_size.items())}
        for kind, index, out in (("steps", 0, steps_t), ("programs", 1, programs_t)):
            old = base.knob(kind, coll, key.split("/")[1], 0) if base else None
            rows_ = [] if old is None or coll in SIZE_INDEPENDENT else [(0, old)]
            for nbytes, cfg in chosen.items():
                value = cfg[index]
                if value is None:
                    continue
                if kind == "programs":
                    value = round(value / sm_count, 3)
                if rows_ and rows_[-1][1] == value:
                    continue
                rows_.append((0 if not rows_ else nbytes, value))
            if rows_:
                out[key] = tuple(rows_)
    return steps_t, programs_t


def _load(path) -> dict:
    return json.loads(Path(path).read_text())


def world_of(doc: dict) -> int:
    """The rank count of a result file: its tag (``cuda-x4``) or title ('on 4 GPUs')."""
    import re

    found = re.search(r"on (\d+) GPUs", doc.get("title", ""))
    if not found:
        raise ValueError(f"cannot tell the world size of a result titled {doc.get('title')!r}")
    return int(found.group(1))


def build(sweeps: list[dict], diagnoses: list[dict], base: Mapping[int, Policy]) -> dict[int, Policy]:
    """New policies: algorithms from each sweep, steps and programs from each diagnose, on top of
    ``base`` (what is not measured stays as it was)."""
    out = dict(base)
    for doc in sweeps:
        w = world_of(doc)
        old = out.get(w) or policy_for(w, base)
        algos = {**old.algorithms, **algorithm_tables(doc["rows"])}
        src = f"{doc['device']} x{w} sweep {doc['date'][:10]}"
        out[w] = Policy(algos, old.steps, old.programs_per_sm, _join(old.source, src, w in base))
    for doc in diagnoses:
        w = world_of(doc)
        old = out.get(w) or policy_for(w, base)
        sm = int(doc.get("environment", {}).get("sm_count") or 132)
        steps, programs = knob_tables(doc["rows"], sm, old)
        src = f"{doc['device']} x{w} diagnose {doc['date'][:10]}"
        out[w] = Policy(
            old.algorithms,
            {**old.steps, **steps},
            {**old.programs_per_sm, **programs},
            _join(old.source, src, True),
        )
    return out


def _join(old: str, new: str, keep: bool) -> str:
    return f"{old}; {new}" if keep and old else new


def module_text(table: Mapping[int, Policy], command: str) -> str:
    """The source of nanoparallel/cuda/auto_tables.py for ``table``."""

    def rows(t: Mapping[str, Table]) -> list[str]:
        out = []
        for key in sorted(t):
            cells = [f"({_bytes(bound)}, {_lit(value)})" for bound, value in t[key]]
            if len(cells) == 1:
                out.append(f"            {_lit(key)}: ({cells[0]},),")
                continue
            out += [
                f"            {_lit(key)}: (",
                *(f"                {c}," for c in cells),
                "            ),",
            ]
        return out

    lines = [
        '"""What ``algorithm="auto"`` picks, per measured world size. Generated: do not edit by hand.',
        "",
        "Made by ``nanoparallel.cuda.lab.tuning`` (its docstring says how) with:",
        f"    {command}",
        "Each table is ((from this many bytes, choice), ...); ``source`` names the measurements.",
        '"""',
        "",
        "POLICIES = {",
    ]
    for w in sorted(table):
        p = table[w]
        lines += [f"    {w}: {{", f'        "source": {_lit(p.source)},']
        for name in ("algorithms", "steps", "programs_per_sm"):
            body = rows(getattr(p, name))
            lines += [f'        "{name}": {{', *body, "        },"] if body else [f'        "{name}": {{}},']
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _lit(v) -> str:
    """A value as ruff would format it (double-quoted strings)."""
    return json.dumps(v) if isinstance(v, str) else repr(v)


def _bytes(n: int) -> str:
    """A byte bound as the source writes it: 64 << 20 rather than 67108864."""
    for shift in (30, 20, 10):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift} << {shift}"
    return str(n)


def pins(table: Mapping[int, Policy]) -> tuple[dict, dict]:
    """({(world, collective, bytes): algorithm}, {(world, "collective/algorithm", bytes): steps}) at
    PIN_SIZES from 64 MiB, for the policy tests."""
    algos, steps = {}, {}
    for w in sorted(table):
        for coll in sorted(table[w].algorithms):
            for nbytes in PIN_SIZES:
                algos[(w, coll, nbytes)] = table[w].algorithm(coll, nbytes)
        for key in sorted(table[w].steps):
            coll, algo = key.split("/")
            for nbytes in PIN_SIZES[3:]:
                steps[(w, key, nbytes)] = table[w].knob("steps", coll, algo, nbytes)
    return algos, steps


def pins_text(table: Mapping[int, Policy]) -> str:
    """``pins`` as the source of the two dicts in tests/nanoparallel/test_cuda_policy.py."""
    algos, steps = pins(table)
    lines = ["PINS = {"]
    lines += [f"    ({w}, {_lit(c)}, {_bytes(n)}): {_lit(a)}," for (w, c, n), a in algos.items()]
    lines += ["}", "STEP_PINS = {"]
    lines += [f"    ({w}, {_lit(k)}, {_bytes(n)}): {v!r}," for (w, k, n), v in steps.items()]
    return "\n".join(lines + ["}"])


def summary_report(sweeps: list[dict], table: Mapping[int, Policy]):
    """A Report with, per world size, collective and size: NCCL's time and busbw beside ``auto``'s
    as ``table`` now chooses (that algorithm's row of the same sweep), and their ratio."""
    from paperclub.bench import Report

    first = sweeps[0]
    rep = Report(
        package="nanoparallel",
        title="nanoparallel.cuda auto against NCCL on "
        + " and ".join(f"{world_of(d)}" for d in sweeps)
        + " GPUs",
        peer=first.get("peer", "NCCL"),
        columns=[
            "gpus",
            "collective",
            "bytes",
            "auto",
            "time_us",
            "nccl_time_us",
            "busbw_GBps",
            "nccl_busbw_GBps",
            "busbw_vs_nccl",
            "speedup_vs_nccl",
        ],  # fmt: skip
        packages=["torch", "triton"],
        measure_ceilings=False,
        notes=(
            "Made by nanoparallel.cuda.lab.tuning --summary from the sweeps "
            + ", ".join(f"{d['device']} x{world_of(d)} of {d['date'][:10]}" for d in sweeps)
            + ": per size, the row of the algorithm that auto now picks (nanoparallel/cuda/auto_tables.py), "
            "beside NCCL in the same sweep. busbw with nccl-tests' factors (nanoparallel.cost_model.bus_factor); "
            "busbw_vs_nccl above 1: we move more bytes per second, speedup_vs_nccl above 1: we are faster."
        ),
    )
    for doc in sweeps:
        w = world_of(doc)
        pol = policy_for(w, table)
        nccl = {(r["collective"], r["bytes"]): r for r in doc["rows"] if r.get("algorithm") == "nccl"}
        ours = {
            (r["collective"], r["bytes"], r["algorithm"]): r
            for r in doc["rows"]
            if r.get("impl") == "nanoparallel"
        }
        for (coll, nbytes), ref in sorted(nccl.items()):
            algo = pol.algorithm(coll, nbytes)
            row = ours.get((coll, nbytes, algo))
            if not row or not row.get("time_us") or not ref.get("time_us"):
                continue
            rep.add(
                gpus=w, collective=coll, bytes=nbytes, auto=algo, time_us=row["time_us"],
                nccl_time_us=ref["time_us"], busbw_GBps=row["busbw_GBps"], nccl_busbw_GBps=ref["busbw_GBps"],
                busbw_vs_nccl=round(row["busbw_GBps"] / ref["busbw_GBps"], 3) if ref["busbw_GBps"] else None,
                speedup_vs_nccl=round(ref["time_us"] / row["time_us"], 3),
            )  # fmt: skip
    rep.plot(title="busbw of auto over NCCL's", x="bytes", y="busbw_vs_nccl", series="gpus",
             facet="collective", logx=True)  # fmt: skip
    rep.plot(title="time per call, auto", x="bytes", y="time_us", series="gpus", facet="collective",
             logx=True, logy=True)  # fmt: skip
    return rep


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", nargs="*", default=[], help="sweep result files (one per world size)")
    p.add_argument("--diagnose", nargs="*", default=[], help="diagnose result files")
    p.add_argument("--write", type=Path, help="write the new tables here (nanoparallel/cuda/auto_tables.py)")
    p.add_argument("--tuning-out", type=Path, help="write steps and programs as JSON for sweep --tuning")
    p.add_argument("--summary", type=Path, help="folder for the summary report of the sweeps")
    p.add_argument("--pins", action="store_true", help="print the choices the policy tests pin")
    args = p.parse_args(argv)
    base = policies()
    sweeps = [_load(f) for f in args.sweep]
    diagnoses = [_load(f) for f in args.diagnose]
    new = build(sweeps, diagnoses, base)
    if args.tuning_out:
        tuning = {str(w): {"steps": dict(new[w].steps), "programs_per_sm": dict(new[w].programs_per_sm)}
                  for w in {world_of(d) for d in diagnoses}}  # fmt: skip
        args.tuning_out.write_text(json.dumps(tuning, indent=1))
        print(f"wrote {args.tuning_out}")
    if args.write:
        command = "python -m nanoparallel.cuda.lab.tuning " + " ".join(
            [f"--sweep {Path(f).name}" for f in args.sweep]
            + [f"--diagnose {Path(f).name}" for f in args.diagnose]
        )
        args.write.write_text(module_text(new, command))
        print(f"wrote {args.write}")
    if args.summary and sweeps:
        # the sweeps' machine, not this one: the summary is written where the tables are made
        summary_report(sweeps, new).write(
            tag="cuda-summary", out_dir=args.summary, env=sweeps[-1]["environment"]
        )
    if args.pins:
        print(pins_text(new))


def load_tuning(path, world_size: int) -> dict:
    """The steps and programs of ``--tuning-out`` for one world size ({} if it has none)."""
    doc = _load(path)
    return doc.get(str(world_size), {})


if __name__ == "__main__":
    main()
