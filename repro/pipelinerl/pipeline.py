"""One RL run in any of the three modes: actors and trainer as threads of one process.

Design (one machine, one GPU or none). The trainer is rank 0 and each actor rank ``1..A`` of a
gloo process group over an in-memory store; every rank lives in a thread of this process. Weights
travel by ``torch.distributed`` broadcast from the trainer after every optimizer step, through a
host buffer. Why threads and gloo rather than one process per role with NCCL:

* NCCL refuses two ranks on the same GPU, so on one GPU the transport must go through host memory
  anyway (the several-GPU runs, a separate issue, use NCCL with one process per GPU);
* the actor and the trainer then share one CUDA context (no duplicate model memory for contexts,
  no second start-up) and their kernels interleave on separate CUDA streams;
* the GIL is released inside every PyTorch kernel call, so the two loops overlap on the GPU; what
  they share is Python time between launches, which we measure (engine step times) rather than
  hide.

The broadcast is a real collective: the trainer blocks until every actor's receiver thread has
the weights, the in-flight-update pause of piche2025pipelinerl's in-flight update (the actor itself only stops
to issue the copy into its model). On a GPU the host side of both ends is pinned and persistent: the
trainer stages each payload with one device-to-host copy into one buffer, the receiver takes it
into one of two buffers, and the actor's swap is one asynchronous host-to-device copy into its
engine's flat parameter buffer (``WeightReceiver`` says why that never races).

``run(Config(...))`` returns a :class:`RunResult` with per-step curves (reward, throughput, lag,
ESS), every trained sample's token versions (for the lag claims) and the engines' step timings
(for fitting the simulator's time model).
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from repro.pipelinerl.actor import Engine, Shared, WeightReceiver, actor_loop
from repro.pipelinerl.model import ModelConfig, Policy, load_flat_weights, pretrain
from repro.pipelinerl.task import TaskConfig
from repro.pipelinerl.trainer import broadcast_stop, broadcast_weights, rl_step, take_batch

MODES = ("pipeline", "async", "conventional")


@dataclass
class Config:
    """Everything a run needs. Sizes in samples (sequences), as the released code counts them.

    ``batch_size`` B samples per optimizer step, in groups of ``attempts`` samples per prompt;
    ``max_lag``: the oldest token the trainer may use is ``max_lag`` samples behind its weights
    (conventional mode: rounds of ``G = max_lag / B + 1`` steps); ``slots``: sequences each actor
    decodes at once; ``is_cap``: the importance-weight truncation ``c``; ``abort_stale``: stop
    decoding a group as soon as one of its tokens is more than ``max_lag`` behind the actor's
    weights (``actor.abort_doomed``; ours, not the released code's; False: decode it to the end and
    let the trainer drop it, the released code's behaviour)."""

    mode: str = "pipeline"
    max_lag: int = 8
    batch_size: int = 8
    attempts: int = 4
    actors: int = 1
    slots: int = 16
    steps: int = 10
    lr: float = 1e-3
    is_cap: float = 1.2
    temperature: float = 1.0
    seed: int = 0
    device: str = "cpu"
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain_steps: int = 0
    pretrain_noise: float = 0.1
    time_budget_s: float | None = None
    cuda_graph: bool = True
    abort_stale: bool = True
    progress: bool = False
    init_weights: torch.Tensor | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Config.mode must be one of {MODES}, got '{self.mode}'")
        for name in ("batch_size", "attempts", "actors", "slots", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.attempts:
            raise ValueError(
                f"Config.batch_size ({self.batch_size}) must be a multiple of attempts ({self.attempts}): "
                "batches hold whole groups"
            )
        if self.max_lag < 0 or self.max_lag % self.attempts:
            raise ValueError(
                f"Config.max_lag must be a non-negative multiple of attempts ({self.attempts}), got {self.max_lag}"
            )
        if self.mode == "conventional" and self.max_lag % self.batch_size:
            raise ValueError(
                f"Config.max_lag ({self.max_lag}) must be a multiple of batch_size ({self.batch_size}) in "
                "conventional mode: a round of G steps has lag up to (G - 1) * batch_size"
            )
        if not isinstance(self.abort_stale, bool):
            raise ValueError(f"Config.abort_stale must be True or False, got {self.abort_stale!r}")
        if not self.is_cap > 0:
            raise ValueError(f"Config.is_cap must be > 0, got {self.is_cap}")
        if self.task.max_seq_len > self.model.max_len:
            raise ValueError(
                f"Config: the task needs {self.task.max_seq_len} positions, model.max_len is {self.model.max_len}"
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("init_weights")
        return d


@dataclass
class RunResult:
    config: Config
    steps: list[dict]
    used: list[dict]  # every trained sample: index, token versions, the trainer's samples at use
    actor_steps: list[list[tuple[float, float, int]]]  # per actor: (t, seconds, busy slots)
    swaps: list[list[tuple[float, int, float]]]  # per actor: (t, version, seconds)
    summary: dict
    # per actor: (t, version, samples) per early abort of doomed groups (actor.abort_doomed)
    aborts: list[list[tuple[float, int, int]]] = field(default_factory=list)

    def to_json(self) -> dict:
        """Curves and summary (not the per-sample logs): what ``train.py`` writes."""
        return {"config": self.config.to_dict(), "summary": self.summary, "curves": self.steps}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path


def make_groups(world: int) -> list:
    """One gloo process group per rank, ranks in threads of this process, over an in-memory store."""
    store = dist.HashStore()
    pgs: list = [None] * world
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            try:
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                pgs[rank] = dist.ProcessGroupGloo(store, rank, world, opts)
            except (AttributeError, TypeError):
                pgs[rank] = dist.ProcessGroupGloo(store, rank, world)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"make_groups: could not build the gloo groups: {errors[0]}") from errors[0]
    return pgs


def initial_model(config: Config) -> Policy:
    """The run's starting policy: ``init_weights`` if given, else seeded init (+ pre-training)."""
    torch.manual_seed(config.seed)
    model = Policy(config.model).to(config.device)
    if config.init_weights is not None:
        load_flat_weights(model, config.init_weights)
    elif config.pretrain_steps:
        pretrain(
            model, config.task, steps=config.pretrain_steps, noise=config.pretrain_noise,
            seed=config.seed, device=config.device,
        )  # fmt: skip
    return model


def run(config: Config) -> RunResult:
    """Train with actors and trainer concurrently in ``config.mode``; see the module docstring."""
    config.validate()
    device = torch.device(config.device)
    cuda = device.type == "cuda"
    model = initial_model(config)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, fused=cuda)  # one kernel per step on a GPU
    shared = Shared(
        mode=config.mode, batch_size=config.batch_size, max_lag=config.max_lag, abort_stale=config.abort_stale
    )
    numel = sum(p.numel() for p in model.parameters())
    pgs = make_groups(config.actors + 1)
    receivers = [WeightReceiver(pgs[a + 1], numel, pin=cuda).start() for a in range(config.actors)]
    host = torch.zeros(numel, pin_memory=True) if cuda else None  # the trainer's staging buffer
    engines = [
        Engine(
            copy.deepcopy(model).eval(),
            config.task,
            config.slots,
            seed=config.seed,
            temperature=config.temperature,
            attempts=config.attempts,
            actor_id=a,
        )  # fmt: skip
        for a in range(config.actors)
    ]
    logs = [{"steps": [], "swaps": [], "aborts": []} for _ in range(config.actors)]
    graphs, graph_error = False, ""
    if cuda and config.cuda_graph:  # one launch per engine step instead of ~100 (see Engine.capture)
        try:
            graphs = all(e.capture() for e in engines)
        except Exception as exc:  # run eager rather than not at all; the summary says why
            graph_error = f"{type(exc).__name__}: {exc}"[:300]
            for e in engines:
                e.graph = None
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.synchronize()
    threads = [
        threading.Thread(
            target=actor_loop,
            args=(shared, engines[a], receivers[a], logs[a]),
            kwargs={"stream": torch.cuda.Stream(device) if cuda else None},
            daemon=True,
            name=f"actor-{a}",
        )
        for a in range(config.actors)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    steps: list[dict] = []
    used: list[dict] = []
    trained = 0
    dropped_total = 0
    aborted_total = 0  # of the dropped, samples the actors had aborted (truncated)
    gen_tokens = 0
    stream = torch.cuda.Stream(device) if cuda else None
    try:
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            broadcast_weights(pgs[0], model, 0, host)
            for k in range(config.steps):
                if config.time_budget_s is not None and time.perf_counter() - t0 > config.time_budget_s:
                    break
                tw = time.perf_counter()
                with shared.cond:
                    while True:
                        if shared.error is not None:
                            raise RuntimeError(f"an actor failed: {shared.error!r}") from shared.error
                        batch, dropped = take_batch(shared, config.attempts, trained, config.batch_size)
                        dropped_total += len(dropped)
                        aborted_total += sum(s.truncated for s in dropped)
                        if batch is not None:
                            break
                        shared.cond.wait(timeout=0.05)
                    started = shared.started
                wait_s = time.perf_counter() - tw
                lags = [trained - v for s in batch for v in s.versions]
                for s in batch:
                    used.append(
                        {
                            "index": s.index, "versions": s.versions, "used_at": trained,
                            "reward": s.reward, "prompt_len": len(s.prompt),
                            "tokens": s.tokens, "logprobs": s.logprobs,
                        }
                    )  # fmt: skip
                    gen_tokens += len(s.tokens)
                ts = time.perf_counter()
                stats = rl_step(
                    model, opt, batch, attempts=config.attempts, is_cap=config.is_cap,
                    temperature=config.temperature,
                )  # fmt: skip
                if cuda:
                    torch.cuda.current_stream().synchronize()
                train_s = time.perf_counter() - ts
                trained += config.batch_size
                bcast_s = 0.0
                if config.mode != "conventional" or trained % (shared.rounds * config.batch_size) == 0:
                    bcast_s = broadcast_weights(pgs[0], model, trained, host)  # conventional: once per round
                now = time.perf_counter() - t0
                steps.append(
                    {
                        "step": k + 1, "time_s": now, "samples": trained, "started": started,
                        "dropped": dropped_total, "aborted": aborted_total, "samples_per_s": trained / now, **stats,
                        "lag_max": max(lags), "lag_mean": sum(lags) / len(lags),
                        "wait_s": wait_s, "train_s": train_s, "broadcast_s": bcast_s,
                    }
                )  # fmt: skip
                if config.progress:
                    _progress(config, steps[-1])
    finally:
        shared.stop.set()
        with shared.cond:
            shared.cond.notify_all()
        broadcast_stop(pgs[0])
        for t in threads:
            t.join(timeout=30)
    if config.progress:
        print()
    elapsed = time.perf_counter() - t0
    summary = _summary(config, steps, used, logs, elapsed, dropped_total, aborted_total, gen_tokens)
    summary["cuda_graph"] = graphs
    if graph_error:
        summary["cuda_graph_error"] = graph_error
    return RunResult(
        config=config,
        steps=steps,
        used=used,
        actor_steps=[lg["steps"] for lg in logs],
        swaps=[lg["swaps"] for lg in logs],
        summary=summary,
        aborts=[lg["aborts"] for lg in logs],
    )


def _progress(config: Config, row: dict) -> None:
    print(
        f"\r[{config.mode}] step {row['step']}/{config.steps} samples {row['samples']} "
        f"reward {row['reward']:.3f} ESS {row['ess']:.3f} lag max {row['lag_max']} "
        f"{row['samples_per_s']:.1f} samples/s  ",
        end="",
        flush=True,
    )


def _summary(config, steps, used, logs, elapsed, dropped, aborted, gen_tokens) -> dict:
    versions = [v for u in used for v in u["versions"]]
    lags = [u["used_at"] - v for u in used for v in u["versions"]]
    busy_s = sum(dt for lg in logs for _, dt, _ in lg["steps"])
    slot_s = sum(dt * b for lg in logs for _, dt, b in lg["steps"])
    span = steps[-1]["time_s"] if steps else elapsed
    return {
        "mode": config.mode,
        "steps": len(steps),
        "samples": len(used),
        "dropped": dropped,
        "aborted": aborted,  # of the dropped: stopped early by the actors (abort_stale)
        "seconds": span,
        "samples_per_s": len(used) / span if steps else 0.0,
        "tokens_per_s": gen_tokens / span if steps else 0.0,
        "reward_first": steps[0]["reward"] if steps else None,
        "reward_last": sum(s["reward"] for s in steps[-5:]) / max(1, len(steps[-5:])) if steps else None,
        "reward_mean": sum(u["reward"] for u in used) / max(1, len(used)),
        "ess_mean": sum(s["ess"] for s in steps) / max(1, len(steps)),
        "lag_max": max(lags) if lags else 0,
        "lag_mean": sum(lags) / max(1, len(lags)),
        "mixed_version_samples": sum(len(set(u["versions"])) > 1 for u in used),
        "engine_busy": busy_s / (span * config.actors) if steps else 0.0,
        "slot_utilisation": slot_s / (span * config.actors * config.slots) if steps else 0.0,
        "max_version": max(versions) if versions else 0,
        "swaps": sum(len(lg["swaps"]) for lg in logs),
    }
