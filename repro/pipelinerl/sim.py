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

``abort_stale`` (on by default, as in :class:`~repro.pipelinerl.pipeline.Config`) applies the real
actor's early abort with the same rule (``actor.doomed``) at the same points of the actor's loop:
after a weight swap, or when another engine found a group doomed, every sequence of a doomed group
stops and goes to the trainer truncated; members of a doomed group admitted later are handed over
empty. Off, the simulation is event for event what it was before the option existed.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from repro.pipelinerl.actor import Sample, Shared, doomed
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
    abort_stale: bool = True  # the actors' early abort of doomed groups (see the module docstring)

    def validate(self) -> None:
        from repro.pipelinerl.pipeline import MODES

        if self.mode not in MODES:
            raise ValueError(f"SimConfig.mode must be one of {MODES}, got '{self.mode}'")
        if not isinstance(self.abort_stale, bool):
            raise ValueError(f"SimConfig.abort_stale must be True or False, got {self.abort_stale!r}")
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
    sequences: list[dict] = field(default_factory=list)  # every finished or aborted sample, for timelines


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
    shared = Shared(
        mode=cfg.mode, batch_size=cfg.batch_size, max_lag=cfg.max_lag, abort_stale=cfg.abort_stale
    )
    round_size = shared.rounds * cfg.batch_size  # conventional: samples per round, G B
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
    dropped = 0
    aborted = 0  # of the dropped, samples the actors aborted (truncated)
    seen_doomed = [0] * cfg.actors  # len(shared.doomed) at each engine's last check
    A = cfg.attempts
    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, actor)
    counter = 0
    used: list[dict] = []
    trainer_log: list[tuple[float, float]] = []
    actor_log: list[list[tuple[float, float, int, int]]] = [[] for _ in range(cfg.actors)]

    def push(t: float, kind: str, a: int = -1) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, a))

    def abort_doomed(a: int, t: float) -> list[Sample]:
        """``actor.abort_doomed`` on engine ``a``: stop every sequence of a doomed group."""
        for s in active[a]:  # versions[0]: the oldest token (versions never decrease along a sequence)
            if doomed(s.versions[0] if s.versions else None, version[a], cfg.max_lag):
                shared.doomed.add(s.index // A)
        stop = [s for s in active[a] if s.index // A in shared.doomed]
        active[a] = [s for s in active[a] if s.index // A not in shared.doomed]
        for s in stop:
            free[a].append(s.slot)
            sequences.append(
                {"index": s.index, "actor": a, "slot": s.slot, "t_start": s.t_start, "t_end": t,
                 "times": s.times, "versions": s.versions, "aborted": True}
            )  # fmt: skip
        return [Sample(s.index, [], [], [], s.versions, 0.0, a, s.t_start, t, truncated=True) for s in stop]

    def actor_tick(a: int, t: float) -> None:
        if stepping[a]:
            return
        idle = not active[a]
        swap = False
        if cfg.mode == "pipeline" or (idle and cfg.mode == "async"):
            swap = latest > version[a]
        elif idle and cfg.mode == "conventional":  # the newest weights broadcast: the last round end
            swap = latest // round_size * round_size > version[a]
        if swap:
            version[a] = latest if cfg.mode != "conventional" else latest // round_size * round_size
        handed: list[Sample] = []  # the real actor's abort_doomed, then skip_doomed
        if cfg.abort_stale and (swap or len(shared.doomed) != seen_doomed[a]):
            seen_doomed[a] = len(shared.doomed)
            handed = abort_doomed(a, t)
        draining = cfg.mode == "async" and latest > version[a]
        admitted = []
        while not draining and len(admitted) < cfg.slots - len(active[a]):
            index = shared.try_admit(version[a])
            if index is None:
                break
            admitted.append(index)
        for index in admitted:
            if cfg.abort_stale and index // A in shared.doomed:  # a doomed group admitted in two parts
                handed.append(Sample(index, [], [], [], [], 0.0, a, t, t, truncated=True))
                continue
            p, n = lengths_of(index)
            active[a].append(_Seq(index, p - 1, n, t_start=t, slot=free[a].pop(0)))
        if handed:
            shared.finished.extend(handed)
            push(t, "wake")  # the real trainer is woken by the queue: it may drop the group now
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
                     "times": s.times, "versions": s.versions, "aborted": False}
                )  # fmt: skip
            else:
                still.append(s)
        active[a] = still
        trainer_try(t)
        actor_tick(a, t)

    def trainer_try(t: float) -> None:
        nonlocal trainer_busy, dropped, aborted
        if trainer_busy or len(trainer_log) >= cfg.steps:
            return
        batch, stale = take_batch(shared, cfg.attempts, trained, cfg.batch_size)
        dropped += len(stale)
        aborted += sum(s.truncated for s in stale)
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
        elif kind == "wake":
            trainer_try(t)
        else:
            trainer_done(t)
    summary = _summary(cfg, used, trainer_log, actor_log)
    summary["dropped"] = dropped
    summary["aborted"] = aborted
    summary["dropped_fraction"] = dropped / (dropped + len(used))
    return SimResult(cfg, used, trainer_log, actor_log, summary, sequences)


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
        "tokens_per_s": sum(len(u["versions"]) for u in used) / end,  # trained completion tokens
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


# The time model fitted to the conventional run of the quick H100 benchmark (25 November 2026,
# results/nvidia-h100-80gb-hbm3.json): d_model 256, 4 layers, 128 slots, B = 64.
H100_QUICK = TimeModel(
    step_s=7.119e-4, step_s_per_seq=1.579e-6, train_s=13.687e-3, broadcast_s=6.746e-3, swap_s=3.661e-3
)


def length_distribution(
    dist: str, mean: float, *, sigma: float = 1.0, prompt: int = 1, cap: int | None = None, n: int = 4096,
    seed: int = 0,
) -> list[tuple[int, int]]:  # fmt: skip
    """``n`` ``(prompt, completion)`` pairs for :attr:`SimConfig.lengths`, completions drawn from ``dist``.

    ``fixed``: every completion ``round(mean)`` tokens. ``lognormal``: ``exp(N(mu, sigma^2))`` with
    ``mu = ln(mean) - sigma^2 / 2`` (so the untruncated mean is ``mean``), rounded and clamped to
    ``[1, cap]``: the heavy tail of reasoning traces, whose longest sample in a batch is many times
    the mean. ``prompt`` tokens are fed one engine step each, as the real engine does."""
    if dist not in ("fixed", "lognormal"):
        raise ValueError(f"length_distribution: dist must be 'fixed' or 'lognormal', got '{dist}'")
    if mean < 1 or sigma < 0 or prompt < 1 or n < 1 or (cap is not None and cap < 1):
        raise ValueError(
            f"length_distribution: need mean >= 1, sigma >= 0, prompt >= 1, n >= 1, cap >= 1; got "
            f"mean={mean}, sigma={sigma}, prompt={prompt}, n={n}, cap={cap}"
        )
    if dist == "fixed":
        return [(prompt, round(mean))]
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    hi = cap if cap is not None else 10**9
    return [(prompt, min(hi, max(1, round(rng.lognormvariate(mu, sigma))))) for _ in range(n)]


def task_lengths(task, n: int = 4096, seed: int = 0) -> list[tuple[int, int]]:
    """The ``(prompt, completion)`` lengths the real task ``task`` (a ``TaskConfig``) produces when
    solved correctly: ``n`` problems drawn by :func:`~repro.pipelinerl.task.make_prompt`."""
    from repro.pipelinerl.task import make_prompt

    out = []
    for i in range(n):
        p = make_prompt(task, seed, i)
        out.append((len(p), len(p) - 1))  # the sorted items, then EOS
    return out


def engine_steps_per_sample(lengths: list[tuple[int, int]]) -> float:
    """Mean engine steps one sample occupies a slot: ``prompt - 1`` feeding steps, then its tokens."""
    return statistics.fmean(p - 1 + c for p, c in lengths)


def gen_train_ratio(cfg: SimConfig) -> float:
    """Generation cost per sample (one full engine, one actor) over training cost per sample:
    ``steps/sample * step time at full slots / slots`` over ``(train_s + broadcast_s) / B``."""
    tm = cfg.time
    gen = engine_steps_per_sample(cfg.lengths) * (tm.step_s + tm.step_s_per_seq * cfg.slots) / cfg.slots
    return gen / ((tm.train_s + tm.broadcast_s) / cfg.batch_size)


def fixed_length_gain_bound(cfg: SimConfig) -> float:
    """Upper bound on simulated pipeline / conventional samples/s when every sample has the same length.

    With ``L`` engine steps per sample, ``A`` actors of ``S`` slots, rounds of ``G B`` samples:

    * pipeline trains at most ``min(min(A S, G B) / (L t_min), B / (train_s + broadcast_s))``
      samples/s (its admission window holds ``B + max_lag = G B`` samples, on ``A S`` slots, at the
      fastest step time ``t_min``; the trainer broadcasts after every step and never waits);
    * a conventional round takes at most ``ceil(G B / (A S)) L t_max + swap_s + G train_s +
      broadcast_s`` (waves of equal sequences at the slowest step time, then the G steps; nothing
      overlaps), for ``G B`` samples.

    Their ratio is at most about 2 when generation and training take equal time, and tends to 1 when
    either dominates: with equal lengths the schedule can only overlap the two jobs. Exact for any
    number of steps that is a multiple of ``G`` (the simulation starts with empty engines)."""
    p, c = cfg.lengths[0]
    if any(x != (p, c) for x in cfg.lengths):
        raise ValueError("fixed_length_gain_bound: every entry of cfg.lengths must be the same")
    tm, A, S, B = cfg.time, cfg.actors, cfg.slots, cfg.batch_size
    G = cfg.max_lag // B + 1
    L = p - 1 + c
    t_min, t_max = tm.step_s + tm.step_s_per_seq, tm.step_s + tm.step_s_per_seq * S
    # at most G B samples in flight (the admission window), on at most A S slots
    pipe = min(min(A * S, G * B) / (L * t_min), B / (tm.train_s + tm.broadcast_s) if tm.train_s else math.inf)
    conv_round = math.ceil(G * B / (A * S)) * L * t_max + tm.swap_s + G * tm.train_s + tm.broadcast_s
    return pipe * conv_round / (G * B)


STUDY_LENGTHS = {
    # name: (dist, mean completion tokens, sigma, prompt tokens, cap)
    "fixed 16": ("fixed", 16, 0.0, 2, None),
    "lognormal 16, sigma 1": ("lognormal", 16, 1.0, 2, 512),
    "fixed 64": ("fixed", 64, 0.0, 2, None),
    "lognormal 64, sigma 1": ("lognormal", 64, 1.0, 2, 1024),
    "lognormal 64, sigma 1.5": ("lognormal", 64, 1.5, 2, 1024),
    "fixed 256": ("fixed", 256, 0.0, 2, None),
    "lognormal 256, sigma 1": ("lognormal", 256, 1.0, 2, 4096),
}


def study(
    lengths: dict[str, list[tuple[int, int]]],
    *,
    time: TimeModel = H100_QUICK,
    lags: tuple[int, ...] = (128, 512, 2048),
    actors: tuple[int, ...] = (1, 4),
    batch_size: int = 64,
    attempts: int = 8,
    slots: int = 128,
    steps: int = 60,
    seed: int = 0,
    abort_stale: bool = True,
) -> list[dict]:
    """Pipeline against conventional at equal ``max_lag`` over length distributions, lags, actors.

    One row per (lengths, max_lag, actors): both modes' samples/s and trained tokens/s, their
    ratios, pipeline's dropped fraction (and aborted samples) and mean lag, and the
    generation-to-training cost ratio."""
    rows = []
    for name, lens in lengths.items():
        for lag in lags:
            for a in actors:
                G = lag // batch_size + 1
                n_steps = max(G, steps // G * G)  # whole conventional rounds
                cfg = SimConfig(
                    mode="pipeline", max_lag=lag, batch_size=batch_size, attempts=attempts, actors=a, slots=slots,
                    steps=n_steps, time=time, lengths=lens, seed=seed, abort_stale=abort_stale,
                )  # fmt: skip
                pipe = simulate(cfg).summary
                conv = simulate(SimConfig(**{**cfg.__dict__, "mode": "conventional"})).summary
                rows.append(
                    {
                        "lengths": name, "max_lag": lag, "actors": a,
                        "steps_per_sample": engine_steps_per_sample(lens),
                        "gen_train": gen_train_ratio(cfg),
                        "conv_samples_per_s": conv["samples_per_s"], "pipe_samples_per_s": pipe["samples_per_s"],
                        "ratio": pipe["samples_per_s"] / conv["samples_per_s"],
                        "token_ratio": pipe["tokens_per_s"] / conv["tokens_per_s"],
                        "pipe_dropped": pipe["dropped_fraction"], "pipe_aborted": pipe["aborted"],
                        "pipe_lag_mean": pipe["lag_mean"],
                        "conv_lag_mean": conv["lag_mean"],
                    }
                )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m repro.pipelinerl.sim``: the length-distribution study as a markdown table."""
    ap = argparse.ArgumentParser(prog="python -m repro.pipelinerl.sim", description=main.__doc__)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per simulation")
    ap.add_argument("--lags", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--train-scale", type=float, default=1.0, help="multiply train_s and broadcast_s")
    ap.add_argument("--tasks", nargs="*", default=["sort", "sort-long"], help="real task presets to include")
    ap.add_argument(
        "--abort-stale", action=argparse.BooleanOptionalAction, default=True,
        help="the actors' early abort of doomed groups (default on)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    from repro.pipelinerl.task import TASKS

    tm = H100_QUICK
    tm = TimeModel(**{**tm.__dict__, "train_s": tm.train_s * args.train_scale,
                      "broadcast_s": tm.broadcast_s * args.train_scale})  # fmt: skip
    lengths = {f"task {t}": task_lengths(TASKS[t]) for t in args.tasks}
    for name, (dist, mean, sigma, prompt, cap) in STUDY_LENGTHS.items():
        lengths[name] = length_distribution(dist, mean, sigma=sigma, prompt=prompt, cap=cap)
    print(f"time model: {tm}")
    print("| lengths | steps/sample | gen/train | max_lag | actors | conv samples/s | pipe samples/s "
          "| pipe/conv samples/s | pipe/conv tokens/s | pipe dropped |")  # fmt: skip
    print("| --- " * 10 + "|", flush=True)
    rows = []
    for name, lens in lengths.items():  # row by row, as they come
        for r in study(
            {name: lens}, time=tm, lags=tuple(args.lags), actors=tuple(args.actors), steps=args.steps,
            abort_stale=args.abort_stale,
        ):  # fmt: skip
            rows.append(r)
            print(
                f"| {r['lengths']} | {r['steps_per_sample']:.1f} | {r['gen_train']:.2f} | {r['max_lag']} "
                f"| {r['actors']} | {r['conv_samples_per_s']:.0f} | {r['pipe_samples_per_s']:.0f} "
                f"| {r['ratio']:.2f}x | {r['token_ratio']:.2f}x | {100 * r['pipe_dropped']:.0f}% |",
                flush=True,
            )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
