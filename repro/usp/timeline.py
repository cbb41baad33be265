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

Each rank's clock is its own; every rank's picture starts at its first kernel of the step (the step
starts after a barrier, so the ranks start within a few microseconds of each other).
"""

from __future__ import annotations

import bisect
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KINDS", "Interval", "parse_trace", "profile_step", "summarize", "union_ms", "wave_rows"]

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


def wave_rows(intervals: list[Interval], *, max_pulses: int = 16) -> list[dict]:
    """Square-wave rows {lane, lane_index, t_ms, level} for the site's line plots: per lane
    (compute, all-to-all, ring P2P) the level is lane_index while idle and lane_index + 0.8 while busy,
    time from the step's first kernel. Gaps are merged (doubling the gap from 0.5% of the step) until
    a lane has at most ``max_pulses`` pulses, so the table stays small."""
    if not intervals:
        return []
    t0 = min(iv.start for iv in intervals)
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
