"""Pipeline schedules and a simulator that times them: GPipe, 1F1B and the zero-bubble schedules.

A model cut into ``p`` stages processes a mini-batch as ``m`` micro-batches. Each stage runs passes one
at a time, in the order its schedule lists them:

* ``F i``: forward of micro-batch i (needs F i on the previous stage);
* ``BW i``: the whole backward of micro-batch i (needs BW i of the next stage, or the stage's own F i
  on the last stage); GPipe and 1F1B treat the backward as one pass;
* ``B i`` / ``W i``: the backward split in two (qi2024zero §2): B computes the gradient of the stage's
  input (the next one down the pipeline waits for it), W the gradient of its weights (nobody waits).

:func:`simulate` starts every pass as soon as its stage is free and its inputs are there (no
communication time), which is what the papers draw. It reports the makespan, each stage's busy and
idle time, and the peak number of micro-batches whose activations a stage holds. Bubble counts:

* GPipe (huang2018gpipe §2.3): all forwards, then all backwards. Every stage idles
  (p - 1)(T_F + T_BW) of a makespan (m + p - 1)(T_F + T_BW): the bubble fraction (p - 1)/(m + p - 1).
* 1F1B (harlap2018pipedream §3.2; flushed at the end of the mini-batch as in Megatron): the same
  bubble, but stage s holds at most p - s micro-batches instead of m.
* ZB-H1 and ZB-H2 (qi2024zero §2.1, §2.2), built here by :func:`zero_bubble`: B before F before W
  whenever a stage is free, at most ``limit(s)`` micro-batches between F and B on stage s (p - s: the
  1F1B count; 2p - 1 - s for ZB-H2). With T_F = T_B = T_W the bubble is (p - 1)(T_F + T_B - T_W), a
  third of 1F1B's (p - 1)(T_F + T_B + T_W), and ZB-H2 has none: every stage runs without a gap from its
  first pass to its last, stage s starting s T_F after stage 0, so iterations tile when the optimizer
  step's synchronisation is bypassed (§4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = [
    "Op",
    "Timeline",
    "Times",
    "bubble_fraction_gpipe",
    "gpipe",
    "one_f_one_b",
    "simulate",
    "zero_bubble",
    "zb_h1",
    "zb_h2",
]

KINDS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W" or "BW"
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


@dataclass(frozen=True)
class Times:
    """The duration of each pass (any positive numbers; ints or Fractions keep the counts exact)."""

    F: int | Fraction = 1
    B: int | Fraction = 1
    W: int | Fraction = 1

    def of(self, kind: str):
        return self.B + self.W if kind == "BW" else getattr(self, kind)


Schedule = list[list[Op]]  # per stage, the passes in the order it runs them


@dataclass
class Timeline:
    """When every pass of a schedule ran: ``start[s][op]``, ``end[s][op]``."""

    p: int
    m: int
    start: list[dict[Op, object]]
    end: list[dict[Op, object]]
    order: Schedule
    peak_in_flight: list[int] = field(default_factory=list)

    @property
    def makespan(self):
        return max(max(e.values()) for e in self.end)

    def busy(self, s: int):
        return sum(self.end[s][op] - self.start[s][op] for op in self.order[s])

    def idle(self, s: int):
        """Stage s's idle time within the makespan (the bubble of a synchronous step)."""
        return self.makespan - self.busy(s)

    def first_start(self, s: int):
        return self.start[s][self.order[s][0]]

    def span(self, s: int):
        """From stage s's first pass to its last."""
        return self.end[s][self.order[s][-1]] - self.first_start(s)

    def gaps(self, s: int):
        """Stage s's idle time between its first and its last pass."""
        return self.span(s) - self.busy(s)


def _validate(p: int, m: int, where: str) -> None:
    if not (isinstance(p, int) and p >= 1):
        raise ValueError(f"{where}: the number of stages p must be an int >= 1, got {p!r}")
    if not (isinstance(m, int) and m >= 1):
        raise ValueError(f"{where}: the number of micro-batches m must be an int >= 1, got {m!r}")


def _deps(op: Op, s: int, p: int) -> list[tuple[int, Op]]:
    """The passes (stage, op) that must finish before ``op`` can start on stage s."""
    i = op.micro
    if op.kind == "F":
        return [(s - 1, Op("F", i))] if s > 0 else []
    if op.kind in ("B", "BW"):
        out = [(s, Op("F", i))]
        if s < p - 1:
            # the next stage's input gradient: its B, or its whole backward in a BW schedule
            out.append((s + 1, Op(op.kind, i)))
        return out
    return [(s, Op("B", i))]  # W


def simulate(schedule: Schedule, times: Times) -> Timeline:
    """Run a schedule (per stage, its passes in order) with the given pass times; no communication
    time. Raises ValueError naming the stage and pass when the schedule is incomplete or can never
    finish (a pass waits for one listed after it, directly or through other stages)."""
    p = len(schedule)
    if p == 0:
        raise ValueError("simulate: the schedule has no stages")
    m = 1 + max((op.micro for stage in schedule for op in stage), default=-1)
    split = any(op.kind in ("B", "W") for stage in schedule for op in stage)
    kinds = ("F", "B", "W") if split else ("F", "BW")
    for s, stage in enumerate(schedule):
        want = sorted((k, i) for k in kinds for i in range(m))
        got = sorted((op.kind, op.micro) for op in stage)
        if got != want:
            raise ValueError(
                f"simulate: stage {s} must run each of {'/'.join(kinds)} once for micro-batches 0..{m - 1}; "
                f"it lists {' '.join(map(str, stage))}"
            )
    start: list[dict] = [{} for _ in range(p)]
    end: list[dict] = [{} for _ in range(p)]
    nxt = [0] * p
    free = [0] * p
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                op = schedule[s][nxt[s]]
                deps = _deps(op, s, p)
                if any(d not in end[ds] for ds, d in deps):
                    break
                t0 = max([free[s], *(end[ds][d] for ds, d in deps)])
                start[s][op], end[s][op] = t0, t0 + times.of(op.kind)
                free[s] = end[s][op]
                nxt[s] += 1
                progressed = True
    stuck = [s for s in range(p) if nxt[s] < len(schedule[s])]
    if stuck:
        s = stuck[0]
        raise ValueError(
            f"simulate: the schedule deadlocks; stage {s} waits forever at {schedule[s][nxt[s]]}"
        )
    tl = Timeline(p, m, start, end, schedule)
    tl.peak_in_flight = [_peak_in_flight(tl, s) for s in range(p)]
    return tl


def _peak_in_flight(tl: Timeline, s: int) -> int:
    """The most micro-batches stage s holds activations for at once: from its F's start until its
    backward (BW, or B: the weight gradient's inputs, which W still needs, are counted apart by the
    paper and are smaller) ends."""
    events = []
    for op in tl.order[s]:
        if op.kind == "F":
            events.append((tl.start[s][op], 1))
        elif op.kind in ("B", "BW"):
            events.append((tl.end[s][op], -1))
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # a release at t before an F at t
        level += delta
        peak = max(peak, level)
    return peak


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every micro-batch's forward, then every backward (huang2018gpipe §2.2, Fig. 2c)."""
    _validate(p, m, "gpipe")
    return [[Op("F", i) for i in range(m)] + [Op("BW", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: stage s runs p - 1 - s warm-up forwards, then alternates one forward and one backward,
    then drains the backwards (harlap2018pipedream §3.2, with a flush at the end of the mini-batch)."""
    _validate(p, m, "one_f_one_b")
    out = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i), Op("BW", i)]
        ops += [Op("BW", i) for i in range(m - warm, m)]
        out.append(ops)
    return out


def zero_bubble(p: int, m: int, limit: Callable[[int], int], times: Times = Times()) -> Schedule:  # noqa: B008
    """A schedule with the backward split into B and W, built by running the pipeline: whenever a
    stage is free it starts a B if one is ready, else an F if fewer than ``limit(s)`` micro-batches sit
    between their F and their B on it, else the oldest W still owed (qi2024zero §2)."""
    _validate(p, m, "zero_bubble")
    done: dict[tuple[int, Op], object] = {}
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    free = [0] * p
    order: Schedule = [[] for _ in range(p)]
    now = 0
    while any(nw[s] < m for s in range(p)):
        started = False
        for s in range(p):
            if free[s] > now:
                continue
            choice = None
            i = nb[s]
            if i < nf[s] and done.get((s, Op("F", i)), now + 1) <= now:
                if s == p - 1 or done.get((s + 1, Op("B", i)), now + 1) <= now:
                    choice = Op("B", i)
            if choice is None and nf[s] < m and nf[s] - nb[s] < limit(s):
                i = nf[s]
                if s == 0 or done.get((s - 1, Op("F", i)), now + 1) <= now:
                    choice = Op("F", i)
            if choice is None and nw[s] < nb[s]:
                choice = Op("W", nw[s])
            if choice is None:
                continue
            counter = {"F": nf, "B": nb, "W": nw}[choice.kind]
            counter[s] += 1
            free[s] = done[(s, choice)] = now + times.of(choice.kind)
            order[s].append(choice)
            started = True
        if not started:
            later = [t for t in list(free) + list(done.values()) if t > now]
            if not later:
                raise ValueError(f"zero_bubble: no stage can start a pass at time {now} (limit too small?)")
            now = min(later)
    return order


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's memory (at most p - s micro-batches between F and B on stage s), W filling the
    bubbles (qi2024zero §2.1)."""
    return zero_bubble(p, m, lambda s: p - s)


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2: more warm-up forwards (up to 2p - 1 - s on stage s) so no stage ever waits, given
    m >= 2p - 1 micro-batches (qi2024zero §2.2)."""
    return zero_bubble(p, m, lambda s: 2 * p - 1 - s)


def bubble_fraction_gpipe(p: int, m: int) -> Fraction:
    """GPipe's bubble fraction (p - 1)/(m + p - 1) (huang2018gpipe §2.3)."""
    _validate(p, m, "bubble_fraction_gpipe")
    return Fraction(p - 1, m + p - 1)
