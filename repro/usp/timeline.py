"""Where a USP step's time goes: a per-rank timeline of one forward + backward from torch.profiler.

:func:`profile_step` runs a step under ``torch.profiler`` (CPU and CUDA activity) and writes the
Chrome trace; :func:`parse_trace` turns a trace into the device intervals of that step, each filed
into one kind:

* ``attention`` / ``other compute``: the local attention kernels, and every other kernel (merges,
  casts, the copies that pack and unpack the all-to-all buffers);
* ``all-to-all`` / ``ring P2P``: NCCL kernels, told apart by the :func:`repro.usp.comm.mark` range
  (``usp:all-to-all``, ``usp:ring``) around the host call that launched them (matched through the
  profiler's correlation ids); ``comm (other)`` for NCCL work outside those ranges.

:func:`summarize` gives the numbers that say whether the transfers hide: the busy time of each kind
(union of its intervals), the communication time during which no compute kernel ran (``exposed``),
and the idle time. :func:`wave_rows` turns the intervals into rows the site can draw as a square
wave per kind (a logic-analyser picture: high while busy), with short gaps merged so that each kind
has a bounded number of pulses.

The ranks of one host share its clock, so their traces line up: :func:`aligned` cuts every rank's
intervals to the moment the last rank started its step, and the pictures of all ranks share that
origin. (The step starts after a barrier, but a rank whose profiler starts slowly starts late; the
others then wait in their first collective. The profiler is started once before the barrier for
that reason: on 4 H100s on 2026-11-28, without it, the first profiled configuration's ranks started
up to 980 ms apart, the later ones within 2.5 ms.) :func:`config_rows` gives one configuration's
summary and picture rows from the ranks' intervals; ``python -m repro.usp.timeline`` rebuilds the
timeline results from a run's traces.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KINDS",
    "Interval",
    "aligned",
    "config_rows",
    "parse_trace",
    "picture_plot",
    "profile_step",
    "rebuild",
    "summarize",
    "trace_slug",
    "union_ms",
    "wave_rows",
]

KINDS = ("attention", "other compute", "all-to-all", "ring P2P", "comm (other)")
COMPUTE = ("attention", "other compute")
COMM = ("all-to-all", "ring P2P", "comm (other)")
LANES = {"compute": COMPUTE, "all-to-all": ("all-to-all",), "ring P2P": ("ring P2P", "comm (other)")}
_ATTENTION_NAMES = ("fmha", "flash", "attention", "attn", "sdpa", "cudnn", "_fwd_kernel", "_bwd_")


@dataclass(frozen=True)
class Interval:
    """One device activity: kind (one of :data:`KINDS`), kernel name, start and end in microseconds."""

    kind: str
    name: str
    start: float
    end: float


def profile_step(step, path: Path, *, warmup: int = 2, sync=None, barrier=None) -> Path:
    """Run ``step()`` ``warmup`` times, then once under torch.profiler; write the Chrome trace to
    ``path`` (gzip-compressed when it ends in .gz) and return it. ``sync``/``barrier`` (callables)
    bracket the profiled step so that it holds nothing else."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # the profiler's first start (CUPTI on a GPU) takes up to a second, and not the same on every rank:
    # pay it here, before the barrier, not inside the profiled step
    with profile(activities=activities):
        if sync:
            sync()
    if sync:
        sync()
    if barrier:
        barrier()
    with profile(activities=activities) as prof:
        step()
        if sync:
            sync()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_suffix("") if path.suffix == ".gz" else path
    prof.export_chrome_trace(str(raw))
    if raw != path:
        with open(raw, "rb") as f, gzip.open(path, "wb") as g:
            g.write(f.read())
        raw.unlink()
    return path


def load_trace(path: Path) -> dict:
    """A Chrome trace file (plain or .gz) as a dict."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _kind(name: str, label: str | None) -> str:
    if "nccl" in name.lower():
        if label == "usp:all-to-all":
            return "all-to-all"
        if label == "usp:ring":
            return "ring P2P"
        return "comm (other)"
    if label in ("usp:attention", "usp:attention-backward"):
        return "attention"
    lower = name.lower()
    if label is None and any(k in lower for k in _ATTENTION_NAMES):
        return "attention"
    return "other compute"


def parse_trace(doc: dict) -> list[Interval]:
    """The device intervals of a profiled step, each with its kind (see the module docstring).

    A GPU event (``cat`` kernel, gpu_memcpy or gpu_memset) is matched to the host call that launched
    it by its ``correlation`` id, and filed under the innermost ``usp:`` range on that host thread
    that contains the call."""
    events = doc.get("traceEvents", doc if isinstance(doc, list) else [])
    gpu, launches, ranges = [], {}, {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        args = e.get("args") or {}
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = (e.get("pid"), e.get("tid"), float(e["ts"]))
        elif cat == "user_annotation" and str(e.get("name", "")).startswith("usp:"):
            ranges.setdefault((e.get("pid"), e.get("tid")), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"])
            )
    starts = {}
    for key, rs in ranges.items():
        rs.sort()
        starts[key] = [r[0] for r in rs]
    out = []
    for e in gpu:
        label = None
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is not None:
            pid, tid, ts = launch
            rs = ranges.get((pid, tid), [])
            i = bisect.bisect_right(starts.get((pid, tid), []), ts)
            best = None
            for a, b, name in rs[:i]:  # the innermost (latest-starting) range that contains the call
                if a <= ts <= b and (best is None or a >= best[0]):
                    best = (a, name)
            label = best[1] if best else None
        start = float(e["ts"])
        out.append(
            Interval(
                _kind(str(e.get("name", "")), label),
                str(e.get("name", "")),
                start,
                start + float(e.get("dur", 0)),
            )
        )
    return sorted(out, key=lambda iv: iv.start)


def _merge(spans: list[tuple[float, float]], gap: float = 0.0) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_ms(intervals: list[Interval], kinds) -> float:
    """Milliseconds during which at least one interval of ``kinds`` runs."""
    return sum(b - a for a, b in _merge([(iv.start, iv.end) for iv in intervals if iv.kind in kinds])) / 1e3


def _minus(spans, holes) -> float:
    """Total length of ``spans`` not covered by ``holes`` (both merged, sorted), microseconds."""
    total, j = 0.0, 0
    for a, b in spans:
        cur = a
        while j < len(holes) and holes[j][1] <= cur:
            j += 1
        k = j
        while k < len(holes) and holes[k][0] < b:
            if holes[k][0] > cur:
                total += holes[k][0] - cur
            cur = max(cur, holes[k][1])
            k += 1
        if cur < b:
            total += b - cur
    return total


def summarize(intervals: list[Interval]) -> dict[str, float]:
    """Per-rank numbers of one step, in ms: ``step`` (first start to last end), busy time of each kind
    and of ``compute`` / ``comm``, ``exposed_comm`` (communication while no compute kernel runs),
    ``overlap_pct`` (share of the communication time hidden behind compute), ``idle``."""
    if not intervals:
        return {"step_ms": 0.0}
    t0, t1 = min(iv.start for iv in intervals), max(iv.end for iv in intervals)
    comp = _merge([(iv.start, iv.end) for iv in intervals if iv.kind in COMPUTE])
    com = _merge([(iv.start, iv.end) for iv in intervals if iv.kind in COMM])
    busy = _merge([(iv.start, iv.end) for iv in intervals])
    comm_ms = sum(b - a for a, b in com) / 1e3
    exposed = _minus(com, comp) / 1e3
    out = {
        "step_ms": (t1 - t0) / 1e3,
        "compute_ms": sum(b - a for a, b in comp) / 1e3,
        "attention_ms": union_ms(intervals, ("attention",)),
        "other_compute_ms": union_ms(intervals, ("other compute",)),
        "all_to_all_ms": union_ms(intervals, ("all-to-all",)),
        "ring_ms": union_ms(intervals, ("ring P2P",)),
        "comm_other_ms": union_ms(intervals, ("comm (other)",)),
        "comm_ms": comm_ms,
        "exposed_comm_ms": exposed,
        "overlap_pct": 100.0 * (1 - exposed / comm_ms) if comm_ms > 0 else None,
        "idle_ms": (t1 - t0 - sum(b - a for a, b in busy)) / 1e3,
    }
    return out


def wave_rows(intervals: list[Interval], *, max_pulses: int = 16, origin: float | None = None) -> list[dict]:
    """Square-wave rows {lane, lane_index, t_ms, level} for the site's line plots: per lane
    (compute, all-to-all, ring P2P) the level is lane_index while idle and lane_index + 0.8 while busy,
    time from ``origin`` (microseconds on the trace's clock; default the step's first kernel). Gaps
    are merged (doubling the gap from 0.5% of the step) until a lane has at most ``max_pulses``
    pulses, so the table stays small."""
    if not intervals:
        return []
    t0 = min(iv.start for iv in intervals) if origin is None else origin
    t1 = max(iv.end for iv in intervals)
    rows = []
    for i, (lane, kinds) in enumerate(LANES.items()):
        spans = _merge([(iv.start, iv.end) for iv in intervals if iv.kind in kinds])
        gap = 0.005 * (t1 - t0)
        while len(spans) > max_pulses:
            spans = _merge(spans, gap)
            gap *= 2
        pts = [(0.0, i)]
        for a, b in spans:
            pts += [
                ((a - t0) / 1e3, i),
                ((a - t0) / 1e3, i + 0.8),
                ((b - t0) / 1e3, i + 0.8),
                ((b - t0) / 1e3, i),
            ]
        pts.append(((t1 - t0) / 1e3, i))
        rows += [{"lane": lane, "lane_index": i, "t_ms": t, "level": y} for t, y in pts]
    return rows


def aligned(per_rank: list[list[Interval]]) -> tuple[float, list[list[Interval]]]:
    """(start, the ranks' intervals from ``start`` on): ``start`` is the latest of the ranks' first
    kernels (the traces of one host share its clock); an interval that began earlier (a rank waiting
    in its first collective for the late one) is cut to begin there, one that ended earlier dropped."""
    firsts = [min(iv.start for iv in ivs) for ivs in per_rank if ivs]
    if not firsts:
        return 0.0, [list(ivs) for ivs in per_rank]
    start = max(firsts)
    cut = [
        [
            iv if iv.start >= start else Interval(iv.kind, iv.name, start, iv.end)
            for iv in ivs
            if iv.end > start
        ]
        for ivs in per_rank
    ]
    return start, cut


def config_rows(per_rank: list[list[Interval]]) -> tuple[list[dict], list[dict]]:
    """One configuration's rows from every rank's intervals (index = rank), after :func:`aligned`:
    the summary per rank ({rank, kernels, **summarize}) and the picture's square waves per rank
    ({rank, **wave_rows}, time from the common start)."""
    start, cut = aligned(per_rank)
    summary, waves = [], []
    for rank, ivs in enumerate(cut):
        summary.append({"rank": rank, "kernels": len(ivs), **summarize(ivs)})
        waves += [{"rank": rank, **w} for w in wave_rows(ivs, origin=start)]
    return summary, waves


def trace_slug(config: str) -> str:
    """The file name stem of a configuration's traces (``usp 2x2 causal S=64k`` -> ``usp-2x2-causal-s-64k``)."""
    return re.sub(r"[^a-z0-9]+", "-", config.lower()).strip("-")


def picture_plot(config: str) -> dict:
    """The site's plot of one configuration's square waves: a figure per rank, a line per lane."""
    return {"title": f"timeline: {config}", "x": "t_ms", "y": "level", "series": "lane",
            "where": {"config": config}, "facet": "rank", "logx": False, "logy": False}  # fmt: skip


def rebuild(
    traces: Path, summary_file: Path, picture_file: Path, world: int, pictured: list[str] | None = None
) -> None:
    """Recompute the rows of a run's timeline summary and picture (Report JSON files, rewritten in
    place, their date, device and versions kept) from its traces ``<slug>-rank<r>.json.gz``, with the
    ranks aligned (:func:`aligned`); the configurations are the summary's, the picture's those it
    holds or ``pictured`` (then its plots are redrawn for them)."""
    summary_doc = json.loads(summary_file.read_text(encoding="utf-8"))
    picture_doc = json.loads(picture_file.read_text(encoding="utf-8"))
    configs = list(dict.fromkeys(r["config"] for r in summary_doc["rows"]))
    if pictured:
        unknown = [c for c in pictured if c not in configs]
        if unknown:
            raise ValueError(
                f"rebuild: pictured configurations {unknown} are not in {summary_file}: {configs}"
            )
        picture_doc["plots"] = [picture_plot(c) for c in pictured]
    else:
        pictured = list(dict.fromkeys(r["config"] for r in picture_doc["rows"]))
    summary_rows, picture_rows = [], []
    for config in configs:
        per_rank = [
            parse_trace(load_trace(traces / f"{trace_slug(config)}-rank{r}.json.gz")) for r in range(world)
        ]
        summary, waves = config_rows(per_rank)
        summary_rows += [{"config": config, **row} for row in summary]
        if config in pictured:
            picture_rows += [{"config": config, **row} for row in waves]
    note = (
        " Rows rebuilt from the run's traces by python -m repro.usp.timeline: each rank's intervals from "
        "the moment every rank had started its step (one host, one clock), the picture's time from there."
    )
    for doc, rows, path in (
        (summary_doc, summary_rows, summary_file),
        (picture_doc, picture_rows, picture_file),
    ):
        doc["rows"] = rows
        doc["notes"] = doc.get("notes", "").replace(" Time from the rank's first kernel.", "")
        if note not in doc["notes"]:
            doc["notes"] = doc.get("notes", "") + note
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        description="Rebuild a run's timeline results from its traces (ranks aligned)."
    )
    ap.add_argument("traces", type=Path, help="the folder of <slug>-rank<r>.json.gz traces")
    ap.add_argument("summary", type=Path, help="the timeline summary Report (…-timeline-<G>gpu.json)")
    ap.add_argument("picture", type=Path, help="the timeline picture Report (…-timeline-picture-<G>gpu.json)")
    ap.add_argument("--world", type=int, required=True, help="ranks of the run")
    ap.add_argument("--picture-config", action="append", default=None, metavar="CONFIG",
                    help="a configuration to draw (repeatable; default: those the picture holds)")  # fmt: skip
    args = ap.parse_args(argv)
    rebuild(args.traces, args.summary, args.picture, args.world, args.picture_config)
    print(f"rebuilt {args.summary} and {args.picture}")


if __name__ == "__main__":
    main()
