"""Discrete-event simulator of actors and trainer in the three modes, with fitted time models.

The simulator runs the *same* bookkeeping as the real run (``actor.Shared.try_admit`` for
admission, ``trainer.take_batch`` for batching and the max_lag filter) with time instead of
compute: an engine step over ``b`` busy slots takes ``step_s + step_s_per_seq * b`` seconds, an
optimizer step ``train_s``, a weight broadcast ``broadcast_s`` (trainer side) and loading the
weights ``swap_s`` (actor side). Sequence lengths are drawn from a list of ``(prompt, completion)``
lengths, e.g. those a real run produced. :func:`fit_time_model` fits these constants to a real
run's logs. Actors and trainer sit on disjoint devices, as in piche2025pipelinerl: the question
the simulator answers is the paper's throughput comparison: samples per second and lag for given actor
counts and lags, beyond what one GPU can run.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field

from repro.pipelinerl.actor import Sample, Shared
from repro.pipelinerl.trainer import take_batch


@dataclass(frozen=True)
class TimeModel:
    """Seconds: engine step ``step_s + step_s_per_seq * busy``; ``train_s`` per optimizer step."""

    step_s: float = 1e-3
    step_s_per_seq: float = 0.0
    train_s: float = 5e-3
    broadcast_s: float = 0.0
    swap_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_s", "step_s_per_seq", "train_s", "broadcast_s", "swap_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"TimeModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.step_s + self.step_s_per_seq <= 0:
            raise ValueError("TimeModel: an engine step must take some time (step_s + step_s_per_seq > 0)")


@dataclass
class SimConfig:
    mode: str = "pipeline"
    max_lag: int = 8
    batch_size: int = 8
    attempts: int = 1
    actors: int = 1
    slots: int = 16
    steps: int = 50
    time: TimeModel = field(default_factory=TimeModel)
    lengths: list[tuple[int, int]] = field(default_factory=lambda: [(3, 2), (4, 4), (6, 8), (8, 16)])
    seed: int = 0

    def validate(self) -> None:
        from repro.pipelinerl.pipeline import MODES

        if self.mode not in MODES:
            raise ValueError(f"SimConfig.mode must be one of {MODES}, got '{self.mode}'")
        for name in ("batch_size", "attempts", "actors", "slots", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.attempts or self.max_lag < 0 or self.max_lag % self.attempts:
            raise ValueError(
                f"SimConfig: batch_size ({self.batch_size}) and max_lag ({self.max_lag}) must be "
                f"non-negative multiples of attempts ({self.attempts})"
            )
        if self.mode == "conventional" and self.max_lag % self.batch_size:
            raise ValueError(
                f"SimConfig.max_lag ({self.max_lag}) must be a multiple of batch_size ({self.batch_size}) "
                "in conventional mode"
            )
        if not self.lengths or any(p < 1 or n < 1 for p, n in self.lengths):
            raise ValueError("SimConfig.lengths must be a non-empty list of (prompt >= 1, completion >= 1)")


@dataclass
class SimResult:
    config: SimConfig
    used: list[dict]  # trained samples: index, versions, used_at
    trainer: list[tuple[float, float]]  # (start, end) of each optimizer step incl. broadcast
    actor_steps: list[list[tuple[float, float, int, int]]]  # per actor: (start, end, busy, version)
    summary: dict
    sequences: list[dict] = field(default_factory=list)  # every finished sample, for timelines


@dataclass
class _Seq:
    index: int
    prefill: int  # prompt steps left before the first completion token
    n: int  # completion tokens to generate
    versions: list[int] = field(default_factory=list)
    t_start: float = 0.0
    slot: int = 0
    times: list[float] = field(default_factory=list)  # when each completion token was sampled


def simulate(cfg: SimConfig) -> SimResult:
    """Run the event simulation until ``cfg.steps`` optimizer steps are done."""
    cfg.validate()
    tm = cfg.time
    rng = random.Random(cfg.seed)
    shared = Shared(mode=cfg.mode, batch_size=cfg.batch_size, max_lag=cfg.max_lag)
    group_len: dict[int, tuple[int, int]] = {}  # samples of one prompt share its length

    def lengths_of(index: int) -> tuple[int, int]:
        g = index // cfg.attempts
        if g not in group_len:
            group_len[g] = rng.choice(cfg.lengths)
        return group_len[g]

    version = [0] * cfg.actors  # weights each engine decodes with
    active: list[list[_Seq]] = [[] for _ in range(cfg.actors)]
    free: list[list[int]] = [list(range(cfg.slots)) for _ in range(cfg.actors)]
    sequences: list[dict] = []
    stepping = [False] * cfg.actors
    latest = 0  # newest weights the actors can take (after the broadcast)
    trained = 0
    trainer_busy = False
    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, actor)
    counter = 0
    used: list[dict] = []
    trainer_log: list[tuple[float, float]] = []
    actor_log: list[list[tuple[float, float, int, int]]] = [[] for _ in range(cfg.actors)]

    def push(t: float, kind: str, a: int = -1) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, a))

    def actor_tick(a: int, t: float) -> None:
        if stepping[a]:
            return
        idle = not active[a]
        swap = False
        if cfg.mode == "pipeline" or (idle and cfg.mode == "async"):
            swap = latest > version[a]
        elif idle and cfg.mode == "conventional":
            swap = latest > version[a] and latest >= shared.started
        if swap:
            version[a] = latest
        draining = cfg.mode == "async" and latest > version[a]
        while not draining and len(active[a]) < cfg.slots:
            index = shared.try_admit(version[a])
            if index is None:
                break
            p, n = lengths_of(index)
            active[a].append(_Seq(index, p - 1, n, t_start=t, slot=free[a].pop(0)))
        if not active[a]:
            return  # woken by the trainer
        dt = tm.step_s + tm.step_s_per_seq * len(active[a]) + (tm.swap_s if swap else 0.0)
        stepping[a] = True
        actor_log[a].append((t, t + dt, len(active[a]), version[a]))
        push(t + dt, "actor", a)

    def actor_step_end(a: int, t: float) -> None:
        stepping[a] = False
        still = []
        for s in active[a]:
            if s.prefill:
                s.prefill -= 1
                still.append(s)
                continue
            s.versions.append(version[a])
            s.times.append(t)
            if len(s.versions) == s.n:
                shared.finished.append(Sample(s.index, [], [], [], s.versions, 0.0, a, s.t_start, t))
                free[a].append(s.slot)
                sequences.append(
                    {"index": s.index, "actor": a, "slot": s.slot, "t_start": s.t_start, "t_end": t,
                     "times": s.times, "versions": s.versions}
                )  # fmt: skip
            else:
                still.append(s)
        active[a] = still
        trainer_try(t)
        actor_tick(a, t)

    def trainer_try(t: float) -> None:
        nonlocal trainer_busy
        if trainer_busy or len(trainer_log) >= cfg.steps:
            return
        batch, _ = take_batch(shared, cfg.attempts, trained, cfg.batch_size)
        for a in range(cfg.actors):  # consumed (or dropped) samples may open the admission window
            actor_tick(a, t)
        if batch is None:
            return
        for s in batch:
            used.append({"index": s.index, "versions": s.versions, "used_at": trained})
        trainer_busy = True
        # conventional: weights go out once per round of G steps, as in the real run
        sends = (
            cfg.mode != "conventional" or (trained + cfg.batch_size) % (shared.rounds * cfg.batch_size) == 0
        )
        dt = tm.train_s + (tm.broadcast_s if sends else 0.0)
        trainer_log.append((t, t + dt))
        push(t + dt, "trainer")

    def trainer_done(t: float) -> None:
        nonlocal trainer_busy, trained, latest
        trainer_busy = False
        trained += cfg.batch_size
        latest = trained
        trainer_try(t)
        for a in range(cfg.actors):
            actor_tick(a, t)

    for a in range(cfg.actors):
        actor_tick(a, 0.0)
    while len(trainer_log) < cfg.steps or trainer_busy:
        if not events:
            raise RuntimeError(
                f"simulate: stalled after {len(trainer_log)} of {cfg.steps} steps (no events left)"
            )
        t, _, kind, a = heapq.heappop(events)
        if kind == "actor":
            actor_step_end(a, t)
        else:
            trainer_done(t)
    return SimResult(
        cfg, used, trainer_log, actor_log, _summary(cfg, used, trainer_log, actor_log), sequences
    )


def _summary(cfg: SimConfig, used, trainer_log, actor_log) -> dict:
    end = trainer_log[-1][1]
    lags = [u["used_at"] - v for u in used for v in u["versions"]]
    busy = sum(min(e, end) - s for lg in actor_log for s, e, _, _ in lg if s < end)
    slot_busy = sum((min(e, end) - s) * b for lg in actor_log for s, e, b, _ in lg if s < end)
    train_busy = sum(e - s for s, e in trainer_log)
    return {
        "mode": cfg.mode,
        "seconds": end,
        "samples": len(used),
        "samples_per_s": len(used) / end,
        "lag_max": max(lags),
        "lag_mean": statistics.fmean(lags),
        "engine_busy": busy / (end * cfg.actors),
        "slot_utilisation": slot_busy / (end * cfg.actors * cfg.slots),
        "trainer_busy": train_busy / end,
    }


def fit_time_model(result) -> tuple[TimeModel, list[tuple[int, int]]]:
    """Fit :class:`TimeModel` to a real :class:`~repro.pipelinerl.pipeline.RunResult`.

    Engine step time: least squares of ``seconds = step_s + step_s_per_seq * busy`` over all
    logged engine steps (clamped at zero); train, broadcast (steps that sent weights) and swap:
    medians. Also returns the
    run's ``(prompt, completion)`` lengths for :attr:`SimConfig.lengths`."""
    pts = [(b, dt) for lg in result.actor_steps for _, dt, b in lg]
    if len(pts) < 2 or not result.steps:
        raise ValueError("fit_time_model: the run logged too few engine or trainer steps to fit")
    xs, ys = [float(b) for b, _ in pts], [dt for _, dt in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    vx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / vx if vx else 0.0
    slope = max(slope, 0.0)
    intercept = max(my - slope * mx, 0.0)
    if intercept + slope <= 0:
        intercept = statistics.median(ys)
    swaps = [s for lg in result.swaps for _, _, s in lg]
    tm = TimeModel(
        step_s=intercept,
        step_s_per_seq=slope,
        train_s=statistics.median(s["train_s"] for s in result.steps),
        broadcast_s=statistics.median(
            [s["broadcast_s"] for s in result.steps if s["broadcast_s"] > 0] or [0.0]
        ),
        swap_s=statistics.median(swaps) if swaps else 0.0,
    )
    lengths = [(u["prompt_len"], len(u["versions"])) for u in result.used]
    return tm, lengths
