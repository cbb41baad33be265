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
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class Report:
    """A benchmark's result table for one machine; ``write`` prints it and saves the JSON."""

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
            "plots": [p.__dict__ for p in self.plots],
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


def load_results(package: str) -> list[dict]:
    """Every benchmark result file of a package (the claims records and GPU checks excluded), newest first."""
    d = package_dir(package) / "results"
    docs = []
    if d.is_dir():
        for f in sorted(d.glob("*.json")):
            if f.name in (RESULTS_NAME, GPU_RESULTS_NAME, GPU_CHECKS_NAME):
                continue
            doc = json.loads(f.read_text(encoding="utf-8"))
            if doc.get("schema") == SCHEMA:
                doc["_file"] = str(f.relative_to(ROOT))
                docs.append(doc)
    return sorted(docs, key=lambda d: d.get("date", ""), reverse=True)
