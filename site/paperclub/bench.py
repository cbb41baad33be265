"""The shared benchmark harness: time a function, describe the machine, write a result file.

Every ``python -m repro.<name>.bench`` (and ``python -m nanoparallel.bench``) builds a
:class:`Report`, adds rows, declares plots, and calls :meth:`Report.write`, which prints a
markdown table and writes ``<package>/results/<device-slug>[-<tag>].json``::

    {"schema": 1, "package": "kda", "title": ..., "date": ISO-8601, "device": "NVIDIA H100 80GB HBM3",
     "device_count": 1, "environment": {"python", "torch", "triton", "cuda", "packages": {...}},
     "ceilings": {"matmul_bf16_tflops": ..., "copy_tbps": ...}, "peer": "flash-linear-attention 0.6.0",
     "columns": [...], "rows": [{column: value}], "plots": [...], "notes": "..."}

The site renders every such file into a table and matplotlib plots on the paper's page and the
benchmarks page. Speed targets are read off these files, never asserted in tests.

What every ``bench.py`` needs lives here once, so that a reproduction's bench keeps only its shapes,
candidates and FLOP counts:

* **Timing**: :func:`time_ms` (one candidate), :func:`measure` (check each :class:`Candidate` once,
  then time those that passed in interleaved rounds; :class:`Measured` gives the row columns
  ``ms, ms_min, ms_max, check``), :func:`failed_candidate` (one known not to run: its row says why),
  :func:`kernel_times` (torch.profiler, for reading).
* **Command line**: :func:`bench_parser` declares the options every bench takes and
  :func:`parse_bench_args` checks them::

      --out DIR          where the result JSON goes (default <package>/results/)
      --budget-s S       wall-clock budget of the run, from the process's start (default: the bench's)
      --quick            a smoke run: fewer shapes
      --only NAME        only these steps / candidates / modes (repeatable, or comma-separated; fnmatch
                         patterns); :func:`select` applies it and refuses a name that matches nothing
      --set NAME=VALUE   change a field of the bench's config (repeatable; VALUE a Python literal, else
                         a string); :func:`apply_settings` builds the changed frozen config
      --tag TAG          suffix of the result file, <device>-<tag>.json
      --rounds N         interleaved rounds of :func:`measure` (default: the bench's)

  ``parse_bench_args`` returns the argparse namespace with ``settings`` (dict), ``only`` (tuple) and
  ``budget`` (a :class:`Budget` counted from the process's start) added.
* **Budget and step plan**: :class:`Budget` (``elapsed``, ``left``, ``allows(predicted)``, ``part``),
  :class:`Step` and :class:`Plan`: steps most important first; a step starts only when its predicted
  cost (scaled from the last finished step of its ``kind``: its check part, which holds the first
  compile, plus its timing part times ``(size / size0) ** exponent``; else ``first_cost`` times the
  first step's) fits the budget; :meth:`Plan.notes` names the steps not measured::

      plan = Plan([Step("fwd S=4k", kind="fwd", size=4096, exponent=2), ...], args.budget)
      for step in plan:                       # skips, and records, steps that would overrun
          t0 = time.monotonic(); ...check...; t1 = time.monotonic(); ...time...
          plan.record(step, check_s=t1 - t0, time_s=time.monotonic() - t1)
      report.notes += plan.notes()

* **Sweeps**: :func:`variants` (a frozen config and its one-at-a-time changes, the default first),
  :func:`describe_changes`, and :func:`sweep`: every config built into a :class:`Candidate` (a build
  that raises is that row's failed check), peers beside them, all checked and then timed in the same
  interleaved rounds; one row per name with ``vs_baseline`` = the baseline's ms over the row's
  (above 1: faster than the baseline). Columns: :data:`SWEEP_COLUMNS`. Sweeps build configs, they
  never patch modules.
* **Results**: :class:`Report` (rows, plots, ``write``), :func:`quiet_write` (save without printing,
  so that a run killed by its timeout keeps its rows), :func:`load_results`.
* **Driving a run**: :func:`run_plan` (a :class:`Plan`'s loop: each step built, checked, timed, its rows
  added, a failed step one row saying why, the report rewritten after every step by
  :func:`write_progress`, its notes naming the steps not measured and not reached), :func:`only_steps`
  (``--only`` on a plan), :func:`run_paced` (a simpler pacing for items of one kind: each runs while the
  budget allows 1.2 x the longest so far), :func:`logger` (lines stamped with the run's seconds),
  :func:`ratio`, and :func:`sdpa_causal` (full causal attention through one SDPA backend, v zero-padded
  where the backend takes one head size: an attention bench's baseline).
* **Attention benches** (SDPA's backends as reference and peer): :func:`sdpa` (one backend by name),
  :class:`AttentionInputs` (leaves, SDPA's copies, dO; the cuDNN reference and FA2 yardstick, each
  candidate checked once for all its passes, candidates and SDPA peers timed), :func:`sdpa_reference`
  (an output to check forwards against), :func:`grads_of` / :func:`grad_errors` (output and gradients
  against a reference), :func:`reference_tolerance` (3x a second backend's distance, no reference
  where two disagree), :func:`check_each`, :func:`time_alone`, :func:`add_measured_rows` (TFLOP/s and
  the ratio to a base row), :func:`within_budget` (items while the budget keeps a reserve) and
  :func:`plot_tflops_by_length`.

Nsight Compute (discovery, running, parsing) and the offline sm_90a compile report live in
:mod:`paperclub.lab`: tools for the lab folders, never imported by a fast path.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime as _dt
import fnmatch
import functools
import importlib.metadata
import io
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paperclub import ROOT
from paperclub.claims import GPU_CHECKS_NAME, GPU_RESULTS_NAME, RESULTS_NAME

SCHEMA = 1


def package_dir(package: str) -> Path:
    """``nanoparallel/`` for the collective library, ``repro/<package>/`` for a reproduction."""
    if package == "nanoparallel":
        return ROOT / "nanoparallel"
    d = ROOT / "repro" / package
    if not d.is_dir():
        raise ValueError(f"benchmark package '{package}': there is no folder repro/{package}/")
    return d


def versions(packages: Iterable[str] = ()) -> dict[str, str]:
    """Installed versions of the named distributions (``'not installed'`` when absent)."""
    out = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def environment(packages: Iterable[str] = ()) -> dict:
    """Device, count and the versions that matter for a measurement."""
    import torch

    env: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "packages": versions(packages),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = "not installed"
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["device_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(0)
        env["sm_count"] = props.multi_processor_count
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    else:
        env["device"] = f"CPU {platform.processor() or platform.machine()}"
        env["device_count"] = 1
        env["cuda"] = None
    return env


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return slug or "unknown-device"


def time_ms(fn: Callable[[], object], *, warmup: int = 10, rep: int = 50) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    On CUDA, device events around each call (through ``triton.testing.do_bench`` when available,
    which also flushes L2 between calls); on CPU, ``perf_counter`` around each call.
    """
    import torch

    if torch.cuda.is_available():
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        except ImportError:
            pass
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(rep // 5, 10)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    for _ in range(max(1, warmup // 10)):
        fn()
    times = []
    for _ in range(max(3, rep // 10)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_times(fn: Callable[[], object], *, reps: int = 3, warmup: int = 1) -> list[tuple[str, float, int]]:
    """Where ``fn()``'s GPU time goes: ``(kernel, ms per call, launches per call)`` for every kernel
    with device time, most expensive first, from ``torch.profiler`` over ``reps`` calls after
    ``warmup`` calls (which also compile). For reading, not for the numbers a benchmark reports:
    the profiler adds its own overhead, and nothing here is checked or interleaved."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.key, e.device_time_total / reps / 1000, e.count // reps)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])


@dataclass
class Candidate:
    """One thing to time, with the check that its result is right at the shape being timed.

    ``check`` runs once before any timing and raises (``AssertionError`` or any error, with a message)
    when the candidate's output is wrong there; such a candidate is not timed.
    """

    fn: Callable[[], object]
    check: Callable[[], object] | None = None


def failed_candidate(error: BaseException | str) -> Candidate:
    """A :class:`Candidate` known not to run (its check failed before, at the shape; its build raised):
    its check raises ``error`` (a message: an ``AssertionError`` with it), so that :func:`measure` gives
    its row that error as a failed check and never times it."""

    def check() -> None:
        raise AssertionError(error) if isinstance(error, str) else error

    return Candidate(fn=lambda: None, check=check)


@dataclass
class Measured:
    """What :func:`measure` found for one candidate: its check, and median and range over rounds."""

    ok: bool
    error: str = ""
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    rounds: list[float] = field(default_factory=list)

    def row(self) -> dict:
        """The columns every benchmark table carries: ``ms``, ``ms_min``, ``ms_max``, ``check``."""
        return {
            "ms": self.median_ms,
            "ms_min": self.min_ms,
            "ms_max": self.max_ms,
            "check": "ok" if self.ok else f"failed: {self.error}",
        }


def measure(
    candidates: dict[str, Candidate | Callable[[], object]],
    *,
    rounds: int = 5,
    warmup: int = 10,
    rep: int = 30,
    timer: Callable[..., float] | None = None,
) -> dict[str, Measured]:
    """Check every candidate once, then time the ones that passed in interleaved rounds.

    Each round times every candidate once, in turn (``time_ms``: median of ``rep`` calls), so that a
    drift of the machine (clocks, temperature, a neighbour) reaches every candidate alike; the result
    keeps the median over rounds and their range. A candidate whose check raised is not timed: its
    ``error`` holds the message, its times stay ``None``. A candidate that raises while being timed
    is recorded the same way and dropped from the later rounds.
    """
    if rounds < 1:
        raise ValueError(f"measure: rounds must be >= 1, got {rounds}")
    timer = timer or time_ms
    out: dict[str, Measured] = {}
    live: dict[str, Callable[[], object]] = {}
    for name, cand in candidates.items():
        if not isinstance(cand, Candidate):
            if not callable(cand):
                raise TypeError(f"measure: candidate '{name}' is neither a Candidate nor callable")
            cand = Candidate(fn=cand)
        try:
            if cand.check is not None:
                cand.check()
        except Exception as exc:  # the check's failure is the result for this row
            out[name] = Measured(ok=False, error=_one_line(exc))
            continue
        out[name] = Measured(ok=True)
        live[name] = cand.fn
    for _ in range(rounds):
        for name, fn in list(live.items()):
            try:
                out[name].rounds.append(float(timer(fn, warmup=warmup, rep=rep)))
            except Exception as exc:
                out[name] = Measured(ok=False, error="while timing: " + _one_line(exc))
                del live[name]
    for name in live:
        m = out[name]
        m.median_ms = statistics.median(m.rounds)
        m.min_ms, m.max_ms = min(m.rounds), max(m.rounds)
    return out


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ceilings() -> dict[str, float]:
    """The machine's measured ceilings: bf16 matmul TFLOP/s and device copy TB/s (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=50, rep=200)
    src = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), warmup=20, rep=100)
    return {
        "matmul_bf16_tflops": round(2 * n**3 / (ms * 1e-3) / 1e12, 1),
        "copy_tbps": round(2 * src.numel() * 4 / (copy_ms * 1e-3) / 1e12, 2),
    }


@dataclass
class Plot:
    """One plot the site draws from the rows: ``y`` against ``x``, one line per ``series`` value.

    ``where`` keeps only rows whose columns equal the given values; ``facet`` draws one plot per
    value of that column.
    """

    title: str
    x: str
    y: str
    series: str
    where: dict = field(default_factory=dict)
    facet: str | None = None
    logx: bool = False
    logy: bool = False


def drawn_rows(plot: Mapping, rows: Iterable) -> list[dict]:
    """The rows a plot (a :class:`Plot`'s fields) draws: those its ``where`` selects with numbers in
    its ``x`` and ``y`` columns."""
    where = plot.get("where") or {}
    return [
        r
        for r in rows
        if isinstance(r, dict)
        and all(r.get(k) == v for k, v in where.items())
        and all(isinstance(r.get(plot[k]), int | float) for k in ("x", "y"))
    ]


@dataclass
class Report:
    """A benchmark's result table for one machine; ``write`` prints it and saves the JSON (with the
    plots that draw something: a run cut to some sections or lengths declares no empty plot)."""

    package: str
    title: str
    columns: Sequence[str]
    peer: str = ""
    notes: str = ""
    packages: Sequence[str] = ()
    rows: list[dict] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    measure_ceilings: bool = True
    #: ceilings the rows were already computed against (a bench that reports a percentage of the
    #: machine's ceiling measures it before its rows): stored as they are, so that the file's
    #: percentages can be recomputed from it; None measures them when the report is written
    ceilings_used: dict[str, float] | None = None

    def add(self, **row) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise ValueError(f"Report.add: columns {sorted(unknown)} are not among {list(self.columns)}")
        self.rows.append({c: row.get(c) for c in self.columns})

    def plot(self, **kwargs) -> None:
        p = Plot(**kwargs)
        for col in (p.x, p.y, p.series, *p.where, *([p.facet] if p.facet else [])):
            if col not in self.columns:
                raise ValueError(f"Report.plot: column '{col}' is not among {list(self.columns)}")
        self.plots.append(p)

    def table(self) -> str:
        return markdown_table(self.columns, self.rows)

    def write(self, *, tag: str = "", out_dir: Path | None = None, env: dict | None = None) -> Path:
        env = env or environment(self.packages)
        doc = {
            "schema": SCHEMA,
            "package": self.package,
            "title": self.title,
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "device": env.get("device"),
            "device_count": env.get("device_count", 1),
            "environment": env,
            "ceilings": (
                dict(self.ceilings_used)
                if self.ceilings_used is not None
                else (ceilings() if self.measure_ceilings else {})
            ),
            "peer": self.peer,
            "columns": list(self.columns),
            "rows": self.rows,
            "plots": [p.__dict__ for p in self.plots if drawn_rows(p.__dict__, self.rows)],
            "notes": self.notes,
            "command": " ".join(sys.argv),
        }
        name = device_slug(doc["device"] or "unknown") + (f"-{tag}" if tag else "") + ".json"
        target = (out_dir or package_dir(self.package) / "results") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"\n## {self.title} on {doc['device']}\n")
        if doc["ceilings"]:
            print(f"ceilings: {doc['ceilings']}\n")
        print(self.table())
        print(f"\nwrote {target}")
        return target


def markdown_table(columns: Sequence[str], rows: Sequence[dict]) -> str:
    def fmt(v) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            if v != v:  # NaN
                return "n/a"
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def load_results(package: str, directory: Path | None = None) -> list[dict]:
    """Every benchmark result file of a package (the claims records and GPU checks excluded), newest
    first; ``directory`` reads another folder than ``<package>/results`` (a test's)."""
    d = directory if directory is not None else package_dir(package) / "results"
    docs = []
    if d.is_dir():
        for f in sorted(d.glob("*.json")):
            if f.name in (RESULTS_NAME, GPU_RESULTS_NAME, GPU_CHECKS_NAME):
                continue
            doc = json.loads(f.read_text(encoding="utf-8"))
            if doc.get("schema") == SCHEMA:
                doc["_file"] = str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)
                docs.append(doc)
    return sorted(docs, key=lambda d: d.get("date", ""), reverse=True)


def quiet_write(report: Report, *, tag: str = "", out_dir: Path | None = None) -> Path:
    """``report.write`` without printing the table: a run that saves after every shape keeps its rows
    when its timeout kills it, and its log stays readable."""
    with contextlib.redirect_stdout(io.StringIO()):
        return report.write(tag=tag, out_dir=out_dir)


def error_text(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line (whitespace collapsed), cut to ``limit`` characters: for notes and
    ``check`` cells."""
    msg = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The command line every bench takes
# ---------------------------------------------------------------------------------------------


def bench_parser(
    description: str | None,
    *,
    budget_s: float | None = None,
    rounds: int | None = 3,
    quick_help: str = "",
    only: bool = True,
    settings: bool = True,
    tag: bool = True,
    out: Path | None = None,
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the options every bench takes (see the module docstring): ``--out``
    (default ``out``; None: ``<package>/results``),
    ``--budget-s`` (default ``budget_s``: None is no limit), ``--quick``, ``--rounds`` (default
    ``rounds``; None: the bench picks its rounds itself, no option), and ``--only``, ``--set``,
    ``--tag`` unless the bench says it has no use for them (``only=False`` ...: then argparse refuses
    them rather than the bench ignoring them). A bench adds
    its own options to it, then calls :func:`parse_bench_args`."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_argument_group("common to every bench (paperclub.bench)")
    g.add_argument(
        "--out",
        type=Path,
        default=out,
        help=f"directory for the result JSON (default {'<package>/results' if out is None else out})",
    )
    g.add_argument(
        "--budget-s",
        type=float,
        default=budget_s,
        help="wall-clock budget from the process's start: work predicted to end after it is not started, "
        f"and named in the notes (default {'none' if budget_s is None else f'{budget_s:g}'})",
    )
    g.add_argument("--quick", action="store_true", help=quick_help or "a smoke run: fewer shapes")
    if only:
        g.add_argument(
            "--only",
            action="append",
            default=[],
            metavar="NAME[,NAME]",
            help="only these steps / candidates (fnmatch patterns; repeatable)",
        )
    if settings:
        g.add_argument(
            "--set",
            dest="set_",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="change a field of the bench's config (VALUE a Python literal, else a string; repeatable)",
        )
    if tag:
        g.add_argument("--tag", default="", help="suffix of the result file: <device>-<tag>.json")
    if rounds is not None:
        g.add_argument(
            "--rounds", type=int, default=rounds, help=f"interleaved timing rounds (default {rounds})"
        )
    else:
        ap.set_defaults(rounds=None)
    # options a bench has no use for still read as empty in parse_bench_args
    ap.set_defaults(
        **{
            name: empty
            for name, empty, on in (("only", [], only), ("set_", [], settings), ("tag", "", tag))
            if not on
        }
    )
    return ap


def parse_settings(pairs: Sequence[str], flag: str = "--set") -> dict[str, Any]:
    """``NAME=VALUE`` strings as ``{NAME: value}``: the value parsed as a Python literal (``True``,
    ``64``, ``'fused'``, ``(1, 2)``), else kept as the string. A pair without ``=`` or with an empty
    name is an error naming it."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise ValueError(f"{flag} {pair!r}: expected NAME=VALUE with NAME an identifier")
        try:
            settings[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            settings[name] = text.strip()
    return settings


def parse_bench_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse and check the common options (a bad value ends the program with argparse's usage message).

    Adds to the namespace: ``settings`` (``--set`` as a dict, :func:`parse_settings`), ``only`` (the
    ``--only`` names, commas split) and ``budget`` (a :class:`Budget` of ``--budget-s`` counted from
    the process's start, as the job that kills the run counts)."""
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.tag):
        parser.error(f"--tag {args.tag!r}: letters, digits, '.', '_' and '-' only (it names a file)")
    try:
        args.settings = parse_settings(args.set_)
    except ValueError as exc:
        parser.error(str(exc))
    args.only = tuple(n.strip() for part in args.only for n in part.split(",") if n.strip())
    args.budget = Budget.from_process_start(args.budget_s)
    return args


def select(names: Iterable[str], only: Sequence[str], what: str = "candidate") -> list[str]:
    """The ``names`` that match a pattern of ``only`` (all of them when ``only`` is empty), in their
    order. A pattern that matches no name is an error listing the known names: a typo must not run
    an empty bench."""
    names = list(names)
    if not only:
        return names
    unmatched = [p for p in only if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"--only {', '.join(unmatched)}: no {what} of that name; known: {', '.join(names)}")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in only)]


def apply_settings(config: Any, settings: Mapping[str, Any]) -> Any:
    """``dataclasses.replace(config, **settings)`` for a (frozen) dataclass config, after checking each
    name is a field and each value has the field's type (an int where a bool is expected, or a string
    where a number is, is refused; None is taken where the field's default is None). The error names
    the setting, the value and the fields known."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"apply_settings: expected a dataclass instance, got {type(config).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name, value in settings.items():
        if name not in fields:
            raise ValueError(
                f"--set {name}: not a field of {type(config).__name__}; known: {', '.join(fields)}"
            )
        current = getattr(config, name)
        if current is None:  # an optional field left at None ("pick the default"): any value
            continue
        want = type(current)
        if value is None:
            ok = fields[name].default is None
        elif want is bool:
            ok = isinstance(value, bool)
        elif want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif want is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, want)
        if not ok:
            raise ValueError(
                f"--set {name}={value!r}: expected a {want.__name__} (the field is {current!r} now)"
            )
    return dataclasses.replace(config, **settings)


# ---------------------------------------------------------------------------------------------
# The time budget and the step plan
# ---------------------------------------------------------------------------------------------


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so that a budget counts Python's and torch's
    start-up as the job that kills the run does; 0 where that cannot be read."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


class Budget:
    """A wall-clock budget of ``seconds`` (None: no limit), already ``spent`` seconds in when made.

    ``elapsed()`` counts from ``spent``; ``left()`` is what remains (``inf`` without a limit);
    ``allows(predicted_s, reserve_s)`` says whether work predicted to take that long (None: unknown,
    allowed while time is left) still ends ``reserve_s`` before the limit; ``part(fraction)`` is a
    budget for a first phase that ends at that fraction of the whole (measured from the same start).
    ``clock`` is for tests."""

    def __init__(
        self, seconds: float | None, *, spent: float = 0.0, clock: Callable[[], float] = time.monotonic
    ):
        if seconds is not None and not seconds > 0:
            raise ValueError(f"Budget: seconds must be positive or None, got {seconds}")
        self.seconds = seconds
        self._clock = clock
        self._t0 = clock() - spent

    @classmethod
    def from_process_start(cls, seconds: float | None, **kw) -> Budget:
        """A budget counted from the process's start (:func:`process_age`)."""
        return cls(seconds, spent=process_age(), **kw)

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, predicted_s: float | None = None, reserve_s: float = 0.0) -> bool:
        left = self.left() - reserve_s
        return left > 0 and (predicted_s is None or predicted_s <= left)

    def part(self, fraction: float) -> Budget:
        if not 0 < fraction <= 1:
            raise ValueError(f"Budget.part: fraction must be in (0, 1], got {fraction}")
        sub = Budget(None, clock=self._clock)
        sub._t0 = self._t0
        sub.seconds = None if self.seconds is None else self.seconds * fraction
        return sub

    def describe(self) -> str:
        return "no limit" if self.seconds is None else f"{self.seconds:g} s"


@dataclass(frozen=True)
class Step:
    """One unit of a bench's plan: candidates built, checked, timed and written together.

    ``kind`` groups steps whose cost scales from one another (e.g. "fwd" at each length); ``size``
    is what the cost grows with (a length, a batch) as ``size ** exponent``; ``first_cost`` is the
    predicted cost, as a multiple of the first finished step's, of a step whose kind has not run
    yet (None: unknown, so it starts while time is left). ``data`` carries what the bench needs to
    run the step."""

    name: str
    kind: str = ""
    size: float = 1.0
    exponent: float = 1.0
    first_cost: float | None = None
    data: Any = None


class Plan:
    """The steps of a bench in order of importance, run while the budget allows (see the module
    docstring). Iterating yields the steps to run; a step predicted to end past the budget (less
    ``reserve_s``, kept for writing the report) is skipped and recorded in ``skipped``. The caller
    reports each finished step's cost with :meth:`record`; ``log`` gets one line per decision."""

    def __init__(
        self,
        steps: Iterable[Step],
        budget: Budget,
        *,
        reserve_s: float = 0.0,
        log: Callable[[str], None] = print,
    ):
        self.steps = list(steps)
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"Plan: step names must be unique, got {names}")
        self.budget, self.reserve_s, self.log = budget, reserve_s, log
        self.skipped: list[Step] = []
        self.finished: list[Step] = []
        self._runs: dict[str, list[tuple[float, float, float]]] = {}
        self._first: float | None = None

    def predict(self, step: Step) -> float | None:
        """Seconds ``step`` should take (None when nothing it can scale from has run). From the last
        finished step of its kind: its check part (unscaled after the first, which held the kernels'
        compile, scaled like the size after that) plus its timing part times ``(size / size0) **
        exponent``; else ``first_cost`` times the first finished step's total."""
        runs = self._runs.get(step.kind)
        if runs:
            size0, check_s, time_s = runs[-1]
            r = step.size / size0 if size0 else 1.0
            check = check_s if len(runs) == 1 else check_s * r
            return check + time_s * r**step.exponent
        if self._first is None or step.first_cost is None:
            return None
        return step.first_cost * self._first

    def record(self, step: Step, check_s: float, time_s: float) -> None:
        """``step`` finished: ``check_s`` seconds of building and checking (compiles included),
        ``time_s`` of timing."""
        self._runs.setdefault(step.kind, []).append((step.size, check_s, time_s))
        if self._first is None:
            self._first = check_s + time_s
        self.finished.append(step)

    def __iter__(self) -> Iterator[Step]:
        for i, step in enumerate(self.steps):
            pred = self.predict(step)
            if not self.budget.allows(pred, self.reserve_s):
                self.log(
                    f"step {i + 1}/{len(self.steps)} {step.name}: not started, {self.budget.elapsed():.0f} s "
                    f"spent + {'?' if pred is None else f'{pred:.0f}'} s predicted > budget {self.budget.describe()}"
                )
                self.skipped.append(step)
                continue
            self.log(
                f"step {i + 1}/{len(self.steps)} {step.name}: starting (predicted "
                + (f"{pred:.0f} s)" if pred is not None else "unknown)")
            )
            yield step

    def pending(self) -> list[Step]:
        """Steps neither finished nor skipped (the rest of the plan while it runs)."""
        return [s for s in self.steps if s not in self.finished and s not in self.skipped]

    def notes(self) -> str:
        """One sentence naming the steps the budget left out ("" when none)."""
        if not self.skipped:
            return ""
        return f"Not measured (time budget of {self.budget.describe()}): {', '.join(s.name for s in self.skipped)}."


# ---------------------------------------------------------------------------------------------
# Sweeps: configs x interleaved rounds -> rows against the baseline config
# ---------------------------------------------------------------------------------------------

#: The columns :func:`sweep` fills in each row.
SWEEP_COLUMNS = ["config", "changes", "ms", "ms_min", "ms_max", "check", "vs_baseline"]


def variants(
    base: Any, changes: Mapping[str, Mapping[str, Any]], *, baseline: str = "default"
) -> dict[str, Any]:
    """``{baseline: base, name: apply_settings(base, change), ...}``: a sweep's configs, each one
    change (of one or several fields) against the base config. A change naming an unknown field, or
    a value of the wrong type, is an error naming it (:func:`apply_settings`)."""
    if baseline in changes:
        raise ValueError(f"variants: {baseline!r} names the base config; use another name for a change")
    return {baseline: base, **{name: apply_settings(base, dict(ch)) for name, ch in changes.items()}}


def describe_changes(config: Any, base: Any) -> str:
    """The fields in which ``config`` differs from ``base`` as ``name=value, ...`` ("" when equal):
    what a sweep row says it changed. Both are dataclasses of one type, or dicts."""
    a = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    b = dataclasses.asdict(base) if dataclasses.is_dataclass(base) else dict(base)
    return ", ".join(f"{k}={v!r}" for k, v in a.items() if k not in b or b[k] != v)


def sweep(
    configs: Mapping[str, Any],
    build: Callable[[Any], Candidate | Callable[[], object]],
    *,
    baseline: str | None = None,
    peers: Mapping[str, Candidate | Callable[[], object]] | None = None,
    rounds: int = 3,
    warmup: int = 10,
    rep: int = 30,
    timer: Callable[..., float] | None = None,
) -> list[dict]:
    """Time ``configs`` (name -> config) against one another and the ``peers``, in interleaved rounds.

    Each config is turned into a :class:`Candidate` by ``build(config)``; a build that raises becomes
    that config's failed check (the error is the row's ``check``), so one config that does not compile
    does not stop the sweep. Every candidate and peer is then checked once and timed in ``rounds``
    interleaved rounds (:func:`measure`). Returns one row per name, configs first then peers, with the
    columns :data:`SWEEP_COLUMNS`: ``changes`` against the baseline config (peers: ""), and
    ``vs_baseline``, the baseline's median ms over the row's (above 1: faster than the baseline;
    None where either was not timed). ``baseline`` defaults to the first config (a name among the
    configs or the peers)."""
    peers = dict(peers or {})
    if not configs and not peers:
        raise ValueError("sweep: nothing to time (no configs, no peers)")
    clash = set(configs) & set(peers)
    if clash:
        raise ValueError(f"sweep: names used by both a config and a peer: {sorted(clash)}")
    baseline = baseline if baseline is not None else next(iter(configs or peers))
    if baseline not in configs and baseline not in peers:
        raise ValueError(f"sweep: baseline {baseline!r} is neither a config nor a peer")
    cands: dict[str, Candidate | Callable[[], object]] = {}
    for name, cfg in configs.items():
        try:
            cands[name] = build(cfg)
        except Exception as exc:  # the build's failure is this row's result
            cands[name] = failed_candidate(exc)
    cands.update(peers)
    res = measure(cands, rounds=rounds, warmup=warmup, rep=rep, timer=timer)
    base_ms = res[baseline].median_ms
    base_cfg = configs.get(baseline)
    rows = []
    for name, m in res.items():
        ms = m.median_ms
        changes = ""
        if name in configs and base_cfg is not None and name != baseline:
            changes = describe_changes(configs[name], base_cfg)
        rows.append(
            {
                "config": name,
                "changes": changes,
                **m.row(),
                "vs_baseline": base_ms / ms if base_ms and ms else None,
            }
        )
    return rows


def measure_logged(
    candidates: Mapping[str, Candidate | Callable[[], object]],
    label: str,
    log: Callable[[str], None] = print,
    **kw,
) -> tuple[dict[str, Measured], float]:
    """:func:`measure` (``kw``: its ``rounds``, ``warmup``, ``rep``, ``timer``) with a line to ``log``
    for each check (started; passed or failed, and in how long), each timing and, at the end, each
    candidate's median or failed check, every line starting ``label: ``: a run that its timeout kills
    shows where it was. Returns the results and the seconds the checks took (the first calls, which
    compile), the part of a step that :meth:`Plan.record` counts apart from the timing."""
    timer = kw.pop("timer", None) or time_ms
    spent = [0.0]
    names: dict[int, str] = {}
    logged: dict[str, Candidate] = {}
    for name, cand in candidates.items():
        if not isinstance(cand, Candidate):
            if not callable(cand):
                raise TypeError(f"measure_logged: candidate '{name}' is neither a Candidate nor callable")
            cand = Candidate(fn=cand)

        def check(name=name, check=cand.check):
            log(f"{label}: {name}: checking (its first call compiles its kernels)")
            t0 = time.perf_counter()
            try:
                check()
            except Exception as exc:
                took = time.perf_counter() - t0
                log(f"{label}: {name}: check FAILED after {took:.1f} s: {error_text(exc, 200)}")
                raise
            finally:
                spent[0] += time.perf_counter() - t0
            log(f"{label}: {name}: check ok ({time.perf_counter() - t0:.1f} s)")

        fn = lambda f=cand.fn: f()  # noqa: E731 (a closure of its own, so that the timer can name it)
        names[id(fn)] = name
        logged[name] = Candidate(fn=fn, check=check if cand.check else None)

    def timed(fn, warmup, rep):
        ms = timer(fn, warmup=warmup, rep=rep)
        log(f"{label}: timed {names[id(fn)]}: {ms:.3f} ms")
        return ms

    res = measure(logged, timer=timed, **kw)
    for name, m in res.items():
        log(f"{label}: {name}: " + (f"{m.median_ms:.3f} ms" if m.median_ms is not None else m.row()["check"]))
    return res, spent[0]


def fwd_bwd(f: Callable[[], Any], leaves: Any, grad: Any = None) -> Callable[[], Any]:
    """A closure running ``f()`` and the backward of its output to ``leaves`` (a sequence of tensors,
    or a callable giving it at call time) on every call; it returns the gradients rather than
    accumulating ``.grad``. The cotangent is ``grad``, else one drawn (``randn_like``) on the first
    call and kept."""
    import torch

    state = {} if grad is None else {"do": grad}

    def run():
        o = f()
        if "do" not in state:
            state["do"] = torch.randn_like(o)
        ls = leaves() if callable(leaves) else leaves
        return torch.autograd.grad(o, ls, state["do"], allow_unused=True)

    return run


def bwd_only(f: Callable[[], Any], leaves: Any, grad: Any = None) -> Callable[[], Any]:
    """A closure timing the backward alone: ``f()`` runs once (on the first call), its output is kept,
    and every call runs its backward to ``leaves`` again (``retain_graph``); ``leaves`` and ``grad``
    as in :func:`fwd_bwd` (a drawn cotangent is drawn after that first forward)."""
    import torch

    state = {} if grad is None else {"do": grad}

    def run():
        if "o" not in state:
            state["o"] = f()
            if "do" not in state:
                state["do"] = torch.randn_like(state["o"])
        ls = leaves() if callable(leaves) else leaves
        return torch.autograd.grad(state["o"], ls, state["do"], retain_graph=True, allow_unused=True)

    return run


def timed_pass(
    pass_: str, f: Callable[[], Any], leaves: Any, grad: Any = None, *, inference: bool = False
) -> Callable[[], Any]:
    """What a row of pass ``pass_`` times: ``"fwd"`` ``f`` itself (building its autograd graph where
    ``leaves`` require grad, as training does; with ``inference``, under ``torch.no_grad``), ``"bwd"``
    the backward alone (:func:`bwd_only`), ``"fwd+bwd"`` both (:func:`fwd_bwd`); ``leaves`` and ``grad``
    as there."""
    if pass_ == "fwd" and inference:
        import torch

        def run():
            with torch.no_grad():
                return f()

        return run
    if pass_ == "fwd":
        return f
    if pass_ == "bwd":
        return bwd_only(f, leaves, grad)
    if pass_ == "fwd+bwd":
        return fwd_bwd(f, leaves, grad)
    raise ValueError(f"timed_pass: pass {pass_!r} is none of 'fwd', 'bwd', 'fwd+bwd'")


def sdpa_causal(
    name: str, backend: Any, qt: Any, kt: Any, vt: Any, notes: list[str]
) -> tuple[Callable, Callable]:
    """(f, leaves) of full causal attention through one SDPA backend (``name`` for the notes) on
    [B, H, T, D] tensors, the baseline of an attention bench; leaves a callable (the v a backward
    differentiates is the one the forward used). The flash backend takes one head size for q, k and v:
    with Dv < Dk, v is zero-padded to Dk (a leaf of its own, made here, outside the timing) and the
    output sliced back to Dv; another backend pads only if it refuses Dv != Dk on its first call (the
    check's), which ``notes`` then says."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dk, dv = qt.shape[-1], vt.shape[-1]
    state = {"pad": dv != dk and backend == SDPBackend.FLASH_ATTENTION}
    vt_pad = torch.nn.functional.pad(vt.detach(), (0, dk - dv)).requires_grad_() if dv != dk else vt
    if state["pad"]:
        notes.append(f"{name}: v zero-padded from Dv = {dv} to Dk = {dk} (the backend takes one head size).")

    def f():
        v = vt_pad if state["pad"] else vt
        try:
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, v, is_causal=True)
        except RuntimeError as exc:
            if state["pad"] or dv == dk:
                raise
            state["pad"] = True
            notes.append(f"{name}: v zero-padded from Dv = {dv} to Dk = {dk} ({error_text(exc, 120)}).")
            return f()
        return o[..., :dv] if state["pad"] else o

    return f, lambda: (qt, kt, vt_pad if state["pad"] else vt)


# ---------------------------------------------------------------------------------------------
# Driving a run: a log with the run's clock, the plan's loop, a budget-paced loop, the report's notes
# ---------------------------------------------------------------------------------------------


def logger(name: str) -> Callable[[str], None]:
    """A log function printing ``[name  12.3 s] message`` (seconds since this call), flushed at once, so
    that a run killed by its timeout shows where it was."""
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{name} {time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    return log


def ratio(base_ms: float | None, ms: float | None) -> float | None:
    """``base_ms / ms`` (above 1: the row is faster than the base), None where either was not timed."""
    return base_ms / ms if base_ms and ms else None


def only_steps(steps: Sequence[Step], only: Sequence[str]) -> list[Step]:
    """The ``steps`` that ``--only`` names (:func:`select`: a pattern matching no step is an error)."""
    keep = select([s.name for s in steps], only, "step")
    return [s for s in steps if s.name in keep]


def write_progress(
    report: Report,
    plan: Plan,
    notes: Sequence[str],
    *,
    trailer: str = "",
    out_dir: Path | None = None,
    tag: str = "",
    final: bool = False,
    ceilings: bool = False,
) -> Path:
    """Save ``report`` with its notes: ``notes``, the steps the budget left out (:meth:`Plan.notes`),
    while the run goes on the steps not reached yet, and ``trailer`` (what the rows mean); quietly
    (:func:`quiet_write`) but for the ``final`` write, which prints the table (and measures the
    machine's ceilings where ``ceilings``)."""
    pending = [s.name for s in plan.pending()]
    parts = [*notes, plan.notes()]
    if pending and not final:
        parts.append(
            f"Not reached (the run was still going when this file was written): {', '.join(pending)}."
        )
    report.notes = " ".join([p for p in parts if p] + ([trailer] if trailer else []))
    if not final:
        return quiet_write(report, tag=tag, out_dir=out_dir)
    report.measure_ceilings = ceilings
    return report.write(tag=tag, out_dir=out_dir)


def run_plan(
    plan: Plan,
    run_step: Callable[[Step], float],
    report: Report,
    *,
    failed_row: Callable[[Step, str], dict],
    notes: Sequence[str] = (),
    trailer: str = "",
    out_dir: Path | None = None,
    tag: str = "",
    ceilings: Callable[[], bool] = lambda: False,
    after_step: Callable[[], object] = lambda: None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run ``plan``'s steps, writing the report after each (:func:`write_progress`, quietly), then once
    more, printed (with the ceilings where ``ceilings()`` says so after the last step).

    ``run_step(step)`` builds, checks and times one step, adds its rows to ``report`` and returns the
    seconds its building and checking took (the rest of its time is timing, for :meth:`Plan.record`).
    A step that raises (out of memory building its inputs, say) is logged and leaves one row,
    ``failed_row(step, "failed: <error>")``; the run goes on. ``after_step`` runs after every step
    (``torch.cuda.empty_cache``, say). ``notes`` may grow while the run goes (a list the steps add to)."""
    for step in plan:
        t_start = time.perf_counter()
        try:
            check_s = run_step(step)
        except Exception as exc:  # e.g. out of memory while building the inputs: record it, go on
            log(f"{step.name}: failed: {error_text(exc, 300)}")
            report.add(**failed_row(step, f"failed: {error_text(exc, 290)}"))
            plan.record(step, check_s=time.perf_counter() - t_start, time_s=0.0)
        else:
            total = time.perf_counter() - t_start
            plan.record(step, check_s=check_s, time_s=max(0.0, total - check_s))
            log(f"{step.name}: done in {total:.1f} s; writing the report")
        after_step()
        write_progress(report, plan, notes, trailer=trailer, out_dir=out_dir, tag=tag)
    path = write_progress(
        report, plan, notes, trailer=trailer, out_dir=out_dir, tag=tag, final=True, ceilings=ceilings()
    )
    log(f"finished; {len(plan.finished)} of {len(plan.steps)} steps run")
    return path


def run_paced(
    items: Iterable[tuple[str, Callable[[], object]]],
    budget: Budget,
    notes: list[str],
    *,
    longest: float = 0.0,
    margin: float = 1.2,
    reserve_s: float = 15.0,
    skip_note: Callable[[str], str] | None = None,
    error_note: Callable[[str, BaseException], str] | None = None,
    after_each: Callable[[], object] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Run each ``(name, fn)`` of ``items`` while ``budget`` allows ``margin`` times the longest item so
    far (``longest`` to start with) and ``reserve_s`` to spare (for the ceilings and the write): a
    simpler pacing than :class:`Plan`'s, for items of one kind and size. An item that does not fit is
    skipped with ``skip_note(name)`` in ``notes``; one that raises (out of memory, a failed build) adds
    ``error_note(name, exc)`` and the rest still run. ``after_each`` runs after every item that ran;
    each prints ``<name> done in <s> s``. Returns the longest item's seconds."""
    skip_note = skip_note or (lambda name: f"skipped {name}: budget {budget.describe()}")
    error_note = error_note or (lambda name, exc: f"{name}: {error_text(exc, 200)}")
    for name, fn in items:
        if not budget.allows(margin * longest, reserve_s):
            notes.append(skip_note(name))
            continue
        t0 = clock()
        try:
            fn()
        except Exception as exc:  # a result, not a crash: noted, the rest still runs
            notes.append(error_note(name, exc))
        after_each()
        longest = max(longest, clock() - t0)
        print(f"{name} done in {clock() - t0:.1f} s", flush=True)
    return longest


# ---------------------------------------------------------------------------------------------
# Attention benches: SDPA's backends as reference and peer, checks against a reference, the rows
# ---------------------------------------------------------------------------------------------


def sdpa(q: Any, k: Any, v: Any, causal: bool, backend: str, mask: Any = None) -> Callable[[], Any]:
    """SDPA on one backend, ``"cudnn"``, ``"flash2"`` or ``"efficient"`` (q, k, v [B, H, S, D]), causal
    or with a boolean ``mask`` (a window)."""
    import torch
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


def grads_of(out_fn: Callable[[], Any], leaves: Any, grad: Any, layout: str = "bshd") -> list:
    """Output and gradients to ``leaves`` of one call, as float32 [B, S, H, D]; ``grad`` is dO as
    [B, S, H, D], and ``layout="bhsd"`` says the call takes and gives [B, H, S, D] (SDPA's)."""
    import torch

    out = out_fn()
    grads = torch.autograd.grad(out, leaves, grad if layout == "bshd" else grad.transpose(1, 2))
    to = (lambda t: t.float()) if layout == "bshd" else (lambda t: t.transpose(1, 2).float())
    return [to(t) for t in (out, *grads)]


def grad_errors(
    out_fn: Callable[[], Any], leaves: Any, grad: Any, layout: str, ref: Sequence[Any]
) -> dict[str, float]:
    """Relative L2 errors of the output and dq, dk, dv of one call (:func:`grads_of`) against ``ref``."""
    from paperclub.testing import rel_error

    got = grads_of(out_fn, leaves, grad, layout)
    return {n: rel_error(a, r) for n, a, r in zip(("o", "dq", "dk", "dv"), got, ref, strict=True)}


@dataclass
class AttentionInputs:
    """One shape's inputs for the checked rows: the leaves q, k, v as [B, S, H, D], SDPA's [B, H, S, D]
    contiguous copies of the same values (leaves too), and dO (``grad``; ``grad_t``: SDPA's layout)."""

    leaves: list
    sdpa: list
    grad: Any

    @classmethod
    def of(cls, leaves: list) -> AttentionInputs:
        """From q, k, v: SDPA's copies made and dO drawn (``randn_like`` v)."""
        import torch

        copies = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
        return cls(leaves, copies, torch.randn_like(leaves[2]))

    @functools.cached_property
    def grad_t(self) -> Any:
        return self.grad.transpose(1, 2).contiguous()

    def sdpa_grads(self, causal: bool, backend: str, mask: Any = None) -> list:
        """Output and gradients of SDPA on ``backend``, as float32 [B, S, H, D] (:func:`grads_of`)."""
        return grads_of(sdpa(*self.sdpa, causal, backend, mask), self.sdpa, self.grad, "bhsd")

    def reference(self, causal: bool, agreement: float) -> tuple[list, float, float]:
        """cuDNN's output and gradients, FA2's (SDPA) largest distance from them, and the check's
        tolerance (:func:`reference_tolerance`, which raises when the two disagree by over ``agreement``)."""
        from paperclub.testing import rel_error

        ref, fa2 = self.sdpa_grads(causal, "cudnn"), self.sdpa_grads(causal, "flash2")
        fa2_err = max(rel_error(a, r) for a, r in zip(fa2, ref, strict=True))
        return ref, fa2_err, reference_tolerance(fa2_err, agreement)

    def first_references(self, causal: bool, backends: Sequence[str] = ("cudnn", "flash2", "efficient")):
        """(reference, yardstick): the output and gradients of the first of ``backends`` that runs at
        these head sizes and of the next one (None where fewer run)."""
        ref = None
        for be in backends:
            try:
                got = self.sdpa_grads(causal, be)
            except Exception:  # this backend does not take the head sizes
                continue
            if ref is not None:
                return ref, got
            ref = got
        return ref, None

    def check(self, fns: Mapping[str, Any], ref: Sequence[Any], tol: float) -> tuple[dict, dict]:
        """Each of ``fns`` (on :attr:`leaves`) checked once against ``ref`` (:func:`check_each`)."""
        return check_each(fns, lambda f: grad_errors(f, self.leaves, self.grad, "bshd", ref), tol)

    def candidates(self, fns: Mapping[str, Any], bad: Mapping[str, str], passes: str) -> dict[str, Candidate]:
        """``fns`` (on :attr:`leaves`) timed for ``passes`` (the forward as inference); one whose check
        failed (``bad``: the message) fails its check with it, so that its row says why, untimed."""
        return {
            name: failed_candidate(bad[name])
            if name in bad
            else Candidate(fn=timed_pass(passes, f, self.leaves, self.grad, inference=True))
            for name, f in fns.items()
        }

    def sdpa_candidates(
        self, causal: bool, passes: str, backends=("cudnn", "flash2"), mask: Any = None, suffix: str = ""
    ) -> dict[str, Candidate]:
        """SDPA on each of ``backends`` (with a boolean ``mask``: not causal) timed for ``passes``, as
        ``sdpa-<backend><suffix>``."""
        return {
            f"sdpa-{be}{suffix}": Candidate(
                fn=timed_pass(
                    passes, sdpa(*self.sdpa, causal, be, mask), self.sdpa, self.grad_t, inference=True
                )
            )
            for be in backends
        }


def sdpa_reference(qt: Any, kt: Any, vt: Any, causal: bool, backend: str = "cudnn") -> tuple[list, Any]:
    """SDPA's inputs ([B, H, S, D]) as [B, S, H, D] copies (a candidate on the same values) and
    ``backend``'s output on them, float32 [B, S, H, D], without gradients."""
    import torch

    same = [t.detach().transpose(1, 2).contiguous() for t in (qt, kt, vt)]
    with torch.no_grad():
        ref = sdpa(qt, kt, vt, causal, backend)().transpose(1, 2).float()
    return same, ref


def reference_tolerance(yardstick_err: float, agreement: float, *, floor: float = 2e-2) -> float:
    """A check's tolerance from a yardstick's distance to the reference (two SDPA backends): 3x it, at
    least ``floor``; a distance over ``agreement`` raises (no trustworthy reference at this shape: a
    tolerance of 3x it would pass anything)."""
    if not yardstick_err <= agreement:
        raise AssertionError(
            f"no reference: two SDPA backends' outputs and gradients differ by {yardstick_err:.1e} "
            f"(relative L2), more than {agreement:.0e}; neither can check ours at this shape"
        )
    return max(3 * yardstick_err, floor)


def check_each(
    fns: Mapping[str, Any], errors_of: Callable[[Any], dict[str, float]], tol: float, against: str = "cuDNN"
) -> tuple[dict, dict]:
    """Run and check each candidate once: (errors by name, failure message by name), one line printed for
    each. Not a ``Candidate.check``: one check serves every pass of a shape, and its errors go in the
    notes; a candidate that raises (fails to compile or run) has its error as the message."""
    errs: dict[str, dict[str, float]] = {}
    bad: dict[str, str] = {}
    for name, f in fns.items():
        try:
            errs[name] = errors_of(f)
            over = {n: f"{e:.1e}" for n, e in errs[name].items() if not e <= tol}
            if over:
                bad[name] = f"vs {against} over {tol:.1e}: {over}"
        except Exception as exc:  # fails to compile or run: its rows say why
            bad[name] = error_text(exc)
        print(
            f"  check {name}: {bad.get(name) or {n: f'{e:.1e}' for n, e in errs[name].items()}}", flush=True
        )
    return errs, bad


def time_alone(fn: Callable[[], Any], passes: str, leaves: Any = None) -> float:
    """Median ms of one candidate timed alone (:func:`time_ms`): the forward without an autograd graph,
    or forward + backward to ``leaves`` (a dO drawn once)."""
    import torch

    grad = None if passes == "fwd" else torch.randn_like(fn())
    return time_ms(timed_pass(passes, fn, leaves, grad, inference=True))


def add_measured_rows(
    report: Report,
    res: Mapping[str, Measured],
    work: float,
    per_name: Callable[[str], dict] = lambda name: {},
    *,
    base: str = "sdpa-cudnn",
    ratio_column: str = "vs_cudnn",
    **fixed,
) -> None:
    """One row per candidate :func:`measure` returned (printed): ``fixed`` columns, ``impl``, its times and
    check, ``tflops`` of ``work`` FLOPs, the ``base`` candidate's ms over its own in ``ratio_column``
    (> 1: faster) and ``per_name(name)``'s columns."""
    base_ms = res[base].median_ms
    for name, m in res.items():
        ms = m.median_ms
        tflops = work / (ms * 1e-3) / 1e12 if ms else None
        report.add(
            **fixed,
            impl=name,
            **m.row(),
            tflops=tflops,
            **{ratio_column: ratio(base_ms, ms)},
            **per_name(name),
        )
        print(report.rows[-1], flush=True)


def within_budget(
    items: Iterable[Any],
    budget: Budget,
    reserve_s: float,
    skipped: list[str],
    describe: Callable[[Any], str] = str,
) -> Iterator[Any]:
    """The ``items`` that start with at least ``reserve_s`` of ``budget`` left; the others are named
    (``describe``) in ``skipped``, for the notes."""
    for item in items:
        if budget.left() < reserve_s:
            skipped.append(describe(item))
            continue
        yield item


def plot_tflops_by_length(report: Report, panels: Iterable[tuple[str, dict]]) -> None:
    """A TFLOP/s plot by length ``S`` (one line per ``impl``) for each (title, where) of ``panels``, not
    causal then causal."""
    panels = list(panels)
    for causal in (False, True):
        for title, where in panels:
            where = {**where, "causal": causal}
            report.plot(
                title=f"{title} TFLOP/s, causal={causal}",
                where=where,
                x="S",
                y="tflops",
                series="impl",
                logx=True,
            )
