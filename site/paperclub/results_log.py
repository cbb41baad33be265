"""The results log of a reproduction: every committed run in its ``results/``, newest first, as one page.

A paper page says what the paper claims and what we measure now; how we got there (run 7, run 9, a
sweep that picked a default, a variant that was wrong) is the history of the result files. This
module writes that history from the files themselves, so it cannot drift from them:
:func:`results_log_page` gives, per benchmark result file (``paperclub.bench.Report`` JSON), its date,
device and count, the command that was run (paths made relative, ``--out`` left out), the versions,
and its headline rows: per candidate (the ``impl`` / ``config`` / ``kernel`` column) the range of the
file's headline measure (the first of :data:`HEADLINE_METRICS` the rows carry: ratios to the peer
first, then throughput, then time; per pass where the rows have one), how many of its rows failed
their check, and the count of each ``status`` a sweep recorded (faults among them). ``gpu-checks.json``
(the GPU job's test and sanitizer steps) adds one entry per check; other files (CSV exports) are
listed at the end. The site publishes it as ``repro/<name>/results-log.md``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from paperclub.bench import load_results, markdown_table, package_dir
from paperclub.claims import GPU_CHECKS_NAME, GPU_RESULTS_NAME, RESULTS_NAME

__all__ = ["HEADLINE_METRICS", "command_text", "entries", "headline", "results_log_page", "statuses"]

#: The column that names a row's candidate, first found wins.
SERIES_COLUMNS = ("impl", "config", "kernel", "variant", "algo", "collective")
#: The headline measure of a file, first column found with numbers wins: ratios to a peer or baseline
#: (above 1 is faster), then throughput, then time, then what correctness and counting files report.
HEADLINE_METRICS = (
    "vs_cudnn", "vs_baseline", "vs_fla", "speedup", "speedup_vs_full", "speedup_vs_nccl",
    "tflops", "busbw_gbps", "tokens_per_s", "ms", "fraction", "rel_err_vs_fa2", "tau",
)  # fmt: skip
#: At most this many candidates per entry (the rest are counted).
MAX_SERIES = 16


def command_text(command: str | None, package: str) -> str:
    """The run's command as a reader would type it: ``.../repro/<pkg>/bench.py ARGS`` becomes ``python -m
    repro.<pkg>.bench ARGS``, ``--out DIR`` is left out (a path on the machine that ran it)."""
    if not command or command.strip() in ("", "-"):
        return "(not recorded)"
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    out, skip = [], False
    for i, w in enumerate(words):
        if skip:
            skip = False
            continue
        if w == "--out":
            skip = True
            continue
        if w.startswith("--out="):
            continue
        m = re.search(r"(?:^|/)((?:repro/[a-z0-9_]+|nanoparallel)(?:/[A-Za-z0-9_]+)*)\.py$", w)
        if i == 0 and m:
            out.append("python -m " + m.group(1).replace("/", "."))
            continue
        out.append(w)
    return " ".join(out)


def _numbers(rows: list[dict], column: str) -> list[float]:
    vals = []
    for r in rows:
        v = r.get(column)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
            vals.append(float(v))
    return vals


def headline(doc: dict) -> tuple[str | None, str | None, list[dict]]:
    """(series column, metric, [{"name", "min", "max", "rows", "failed"}]) of a result file: per
    candidate (and per pass, where the rows have a ``pass`` column), the range of the metric over its
    rows and the number of its rows whose check failed."""
    rows, columns = doc.get("rows") or [], doc.get("columns") or []
    metric = next((c for c in HEADLINE_METRICS if c in columns and _numbers(rows, c)), None)
    series = next((c for c in SERIES_COLUMNS if c in columns), None)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        name = str(r.get(series)) if series else "all rows"
        if "pass" in columns and r.get("pass"):
            name += f" ({r['pass']})"
        groups.setdefault(name, []).append(r)
    out = []
    for name, rs in groups.items():
        vals = _numbers(rs, metric) if metric else []
        failed = sum(1 for r in rs if str(r.get("check") or "").startswith("failed"))
        out.append({"name": name, "min": min(vals, default=None), "max": max(vals, default=None),
                    "rows": len(rs), "failed": failed})  # fmt: skip
    return series, metric, out


def statuses(doc: dict) -> dict[str, int]:
    """How many rows have each value of a ``status`` column (a sweep that records faults), if any."""
    counts: dict[str, int] = {}
    if "status" in (doc.get("columns") or []):
        for r in doc.get("rows") or []:
            counts[str(r.get("status"))] = counts.get(str(r.get("status")), 0) + 1
    return counts


def _versions(doc: dict) -> str:
    env = doc.get("environment") or {}
    parts = [f"{k} {env[k]}" for k in ("torch", "triton", "cuda") if env.get(k)]
    parts += [
        f"{k} {v}"
        for k, v in (env.get("packages") or {}).items()
        if v and v != "not installed" and k not in ("torch", "triton")
    ]
    return ", ".join(parts)


def _gpu_checks(results: Path) -> list[dict]:
    path = results / GPU_CHECKS_NAME
    if not path.exists():
        return []
    checks = json.loads(path.read_text(encoding="utf-8")).get("checks", {})
    return [
        {"kind": "check", "date": c.get("date", ""), "device": c.get("device"), "name": name,
         "status": c.get("status"), "detail": c.get("detail", ""), "versions": c.get("versions") or {}}
        for name, c in checks.items()
    ]  # fmt: skip


def entries(package: str, results: Path | None = None) -> list[dict]:
    """The log's entries, newest first: one per benchmark result file (``kind`` "bench", the document
    with ``_file``) and one per GPU check (``kind`` "check")."""
    results = results or package_dir(package) / "results"
    docs = [{"kind": "bench", **d} for d in load_results(package, directory=results)]
    return sorted([*docs, *_gpu_checks(results)], key=lambda e: e.get("date") or "", reverse=True)


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"


def _bench_entry(doc: dict, package: str) -> list[str]:
    count = doc.get("device_count") or 1
    head = (
        f"### {str(doc.get('date', '?'))[:10]} · {doc.get('device', '?')}{f' x{count}' if count > 1 else ''}"
    )
    lines = [head, "", f"**{doc.get('title', '')}**", ""]
    lines.append(f"- file: `{Path(doc['_file']).name}` ({len(doc.get('rows') or [])} rows)")
    lines.append(f"- run: `{command_text(doc.get('command'), package)}`")
    if _versions(doc):
        lines.append(f"- versions: {_versions(doc)}")
    if doc.get("peer"):
        lines.append(f"- peer: {doc['peer']}")
    skipped = re.search(r"Not (?:measured|reached)[^.]*\.", doc.get("notes") or "")
    if skipped:
        lines.append(f"- {skipped.group(0)}")
    counts = statuses(doc)
    if counts:
        lines.append("- status: " + "; ".join(f"{k}: {n}" for k, n in counts.items()))
    lines.append("")
    series, metric, groups = headline(doc)
    if groups:
        shown = groups[:MAX_SERIES]
        label = series or "candidate"
        table_rows = [
            {label: g["name"], f"{metric} (min)": _fmt(g["min"]), f"{metric} (max)": _fmt(g["max"]),
             "rows": g["rows"], "check failed": g["failed"] or ""}
            for g in shown
        ]  # fmt: skip
        cols = [
            label,
            *([f"{metric} (min)", f"{metric} (max)"] if metric else []),
            "rows",
            "check failed",
        ]
        lines += [markdown_table(cols, table_rows), ""]
        if len(groups) > MAX_SERIES:
            lines += [f"and {len(groups) - MAX_SERIES} more candidates.", ""]
    return lines


def _check_entry(e: dict) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items())
    return [
        f"### {str(e['date'])[:10]} · {e.get('device', '?')}",
        "",
        f"**GPU job, {e['name']}: {e['status']}**",
        "",
        f"- {e['detail']}" + (f" ({versions})" if versions else ""),
        "",
    ]


def results_log_page(package: str, results: Path | None = None) -> str:
    """The markdown page of ``package``'s results log (see the module docstring)."""
    results = results or package_dir(package) / "results"
    where = f"repro/{package}" if package != "nanoparallel" else "nanoparallel"
    lines = [
        f"# Results log: `{where}`",
        "",
        f"Every run committed in `{where}/results/`, newest first, generated from the files: date, device, "
        "what was run, and per candidate the range of the file's headline measure (ratios above 1 are "
        "faster than the peer or baseline). The paper page says what we measure now; this page is how "
        "we got there. The full tables are on the reproduction's page.",
        "",
    ]
    found = entries(package, results)
    if not found:
        lines.append("No results have been committed yet.")
    for e in found:
        lines += _bench_entry(e, package) if e["kind"] == "bench" else _check_entry(e)
    known = {Path(e["_file"]).name for e in found if e["kind"] == "bench"}
    known |= {RESULTS_NAME, GPU_RESULTS_NAME, GPU_CHECKS_NAME}
    other = (
        sorted(p.name for p in results.glob("*") if p.is_file() and p.name not in known)
        if results.is_dir()
        else []
    )
    if other:
        lines += ["## Other files", "", *[f"- `{name}`" for name in other], ""]
    return "\n".join(lines).rstrip() + "\n"
