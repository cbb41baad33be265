"""Actors and trainers in their own processes, one per GPU: the paper's placement, launched by torchrun.

``python3 -m torch.distributed.run --nproc-per-node N -m repro.pipelinerl.launch --trainers T ...``

Ranks ``0 .. T-1`` are trainers (data parallel, rank 0 leads), ranks ``T .. N-1`` actors, each on
its own GPU (``LOCAL_RANK``) with NCCL, or each a CPU process with gloo (``--device cpu``, what CI
runs: the same code, two or three processes and the toy model). One launch runs the modes given by
``--modes`` one after the other, for ``--time-per-mode`` seconds each, from the same initial weights.

What goes where (piche2025pipelinerl v1, Abstract and §1: generation and training run concurrently
on disjoint accelerators, the generation engine receives new weights during generation):

* **weights**, lead trainer -> actors: after every optimizer step (conventional mode: after every
  round of ``G`` steps) the lead trainer tells each actor ``WEIGHTS v`` over the control channel
  and broadcasts the flat fp32 weights over the ``weights`` group (NCCL on GPUs). The actor joins
  the broadcast at its next loop iteration, between two engine steps, on its own stream: in
  pipeline mode straight **into the engine's flat parameter buffer** (the in-flight update: the
  sequences in progress continue with the new weights on their old KV caches, and the CUDA graph,
  which reads that buffer, runs them); in async and conventional mode into a staging buffer, copied
  into the engine once it is idle (those modes change weights only between sequences). The engine
  never stops for the transfer beyond the stream ordering of one broadcast.
* **samples**, actor -> lead trainer: ``SAMPLES`` messages (``channel.py``) over a gloo group,
  tokens, behaviour log-probs, versions and rewards as tensors. A thread per actor on the lead
  trainer receives them into the queue that ``trainer.take_batch`` reads.
* **admission**: the lead trainer owns the sample counter. An actor reports how many whole groups
  it could start; the trainer grants index ranges (``GRANT first count version``), whole groups
  only, under the released code's rule: an index ``i`` may start under weights ``v`` when
  ``i < v + dropped + B + max_lag``, so a grant says the least version the actor must hold first.
  The window is split fairly among the actors that ask (``allocate_grants``). Groups never
  straddle actors, so an actor's early abort of doomed groups (``actor.abort_doomed``) needs no
  other actor.
* **data-parallel trainers** (``--trainers 2``): the lead splits each batch by whole groups and
  sends each trainer its share (``BATCH``); gradients are summed by one all-reduce per step over the
  trainers' group (``trainer.rl_step`` with ``group``).

Faults end the run, never hang it: every peer's death closes its gloo connections, and whichever
thread sees that (the lead trainer's receiver for that actor, an actor's or a trainer's inbox from
the lead trainer) prints ``pipelinerl launch: rank R (role): <peer> died ...`` naming the peer and
exits the process at once (``os._exit``, so that no NCCL call can block the exit); torchrun then
stops the others. ``--fault actor:K@S`` / ``trainer@S`` kill a process with SIGKILL after the
``S``-th optimizer step, for the fault tests.

Every sample is accounted for at the end of each mode: indices granted = trained + dropped + left
in the queue + in flight on an actor at the stop + granted but not started, each index exactly once
(``accounting`` in the results; a run whose accounting fails says so).

The lead trainer writes ``--out`` (JSON) after every mode: per mode the summary (samples/s, trained
completion tokens/s, reward, lag and ESS distributions, dropped samples), per-step curves, every
process's busy time, and the accounting.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as _dt
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from repro.pipelinerl import channel
from repro.pipelinerl.actor import Engine, Sample, Shared, abort_doomed
from repro.pipelinerl.channel import BATCH, BYE, GRANT, SAMPLES, STOP, WEIGHTS, Message
from repro.pipelinerl.model import ModelConfig, Policy, flat_weights, load_flat_weights
from repro.pipelinerl.pipeline import MODES, Config
from repro.pipelinerl.reference import check_version_log
from repro.pipelinerl.task import TASKS, TaskConfig
from repro.pipelinerl.trainer import rl_step, take_batch

# The tests' tiny task (lists of 1-4 digits): CI and the smoke run.
TINY = TaskConfig(min_items=1, max_items=4, skew=1.5)
TASK_CHOICES = {**TASKS, "tiny": TINY}


# ------------------------------------------------------------------------------------------ setup


@dataclass
class Ctx:
    """This process: its rank and role, the process groups, and how to fail."""

    rank: int
    world: int
    trainers: int
    device: torch.device
    groups: dict
    out: Path | None
    mode: str = ""
    closing: threading.Event = field(default_factory=threading.Event)
    accounting: dict = field(default_factory=dict)  # the lead trainer's counts so far (for a fatal record)

    @property
    def actors(self) -> int:
        return self.world - self.trainers

    @property
    def role(self) -> str:
        return "trainer" if self.rank < self.trainers else "actor"

    def name(self, rank: int | None = None) -> str:
        """'trainer 0 (rank 0)', 'actor 1 (rank 2)': how messages name a process."""
        r = self.rank if rank is None else rank
        if r < self.trainers:
            return f"trainer {r} (rank {r})"
        return f"actor {r - self.trainers} (rank {r})"

    def actor_rank(self, a: int) -> int:
        return self.trainers + a


_FATAL = threading.Lock()


def fatal(ctx: Ctx, message: str) -> None:
    """Report ``message`` naming this process, record it next to ``--out``, and exit at once.

    ``os._exit``: a thread that finds a peer dead must end the process even while the main thread is
    blocked in a collective or a CUDA synchronisation that the dead peer will never complete."""
    _FATAL.acquire()  # the first thread to fail reports; any other waits here until the exit
    text = f"pipelinerl launch: {ctx.name()}, mode {ctx.mode or '-'}: {message}"
    try:
        print(text, file=sys.stderr, flush=True)
        if ctx.out is not None:
            record = {"error": message, "rank": ctx.rank, "process": ctx.name(), "mode": ctx.mode,
                      "accounting": ctx.accounting, "time": _dt.datetime.now(_dt.UTC).isoformat()}  # fmt: skip
            path = ctx.out.with_name(f"{ctx.out.stem}.error-rank{ctx.rank}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    finally:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)


def guarded(ctx: Ctx, what: str, fn, *args) -> None:
    """Run ``fn(*args)`` in a thread; any exception is fatal (with ``what`` and the traceback)."""
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - every failure of a thread ends the process
        if ctx.closing.is_set() and isinstance(exc, RuntimeError):
            return  # a connection closed by a peer that finished first: the mode is over
        fatal(ctx, f"{what}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def setup(trainers: int, device_kind: str, timeout_s: float, out: Path | None) -> Ctx:
    """Join the torchrun job; build the process groups (every rank creates every group, in order)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not 1 <= trainers < world:
        raise SystemExit(f"launch: --trainers must be in 1..{world - 1} (world {world}), got {trainers}")
    timeout = _dt.timedelta(seconds=timeout_s)
    if device_kind == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise SystemExit(
                f"launch: rank {rank} needs GPU {local_rank}, only {torch.cuda.device_count()} are visible"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device)
        fast = "nccl"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        fast = "gloo"
    everyone = list(range(world))
    groups = {
        "ctrl": dist.new_group(everyone, backend="gloo", timeout=timeout),  # barriers between modes
        "up": dist.new_group(everyone, backend="gloo", timeout=timeout),  # to the lead trainer
        "down": dist.new_group(everyone, backend="gloo", timeout=timeout),  # from the lead trainer
        "weights": dist.new_group([0, *range(trainers, world)], backend=fast, timeout=timeout),
        "trainers": dist.new_group(list(range(trainers)), backend=fast, timeout=timeout),
    }
    return Ctx(rank=rank, world=world, trainers=trainers, device=device, groups=groups, out=out)


class Outbox:
    """One thread that sends every message of this process on one group, in the order queued."""

    def __init__(self, ctx: Ctx, group):
        self.ctx, self.group = ctx, group
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=guarded, args=(ctx, "sending", self._loop), daemon=True)
        self.thread.start()

    def put(self, dst: int, msg: Message) -> None:
        with self.cond:
            self.queue.append((dst, msg))
            self.cond.notify()

    def close(self, timeout: float) -> None:
        with self.cond:
            self.queue.append(None)
            self.cond.notify()
        self.thread.join(timeout)
        if self.thread.is_alive():
            fatal(self.ctx, f"the sending thread did not finish within {timeout:.0f} s")

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                item = self.queue.popleft()
            if item is None:
                return
            dst, msg = item
            try:
                channel.send(msg, dst, self.group)
            except RuntimeError as exc:
                if self.ctx.closing.is_set():
                    return
                fatal(self.ctx, f"{self.ctx.name(dst)} died or its connection failed (sending it "
                                f"{channel.KIND_NAMES[msg.kind]}): {exc}")  # fmt: skip


def load_initial(path: str | None, cfg: Config) -> torch.Tensor | None:
    """Flat weights saved by ``plan.py pretrain`` (checked against ``cfg.model``), or None."""
    if not path:
        return None
    blob = torch.load(path, map_location="cpu", weights_only=False)
    model = ModelConfig(**blob["model"])
    if model != cfg.model:
        raise SystemExit(f"launch: --weights {path} holds a {model}, the run needs {cfg.model}")
    return blob["weights"]


def build_model(cfg: Config, device: torch.device) -> Policy:
    torch.manual_seed(cfg.seed)
    model = Policy(cfg.model)
    if cfg.init_weights is not None:
        load_flat_weights(model, cfg.init_weights)
    return model.to(device)


# --------------------------------------------------------------------------------- lead trainer


def allocate_grants(
    asks: list[int], room: int, attempts: int, start: int
) -> tuple[list[tuple[int, int]], int]:
    """Split ``room`` admissible sample indices among actors asking for ``asks[a]`` each.

    Whole groups only (multiples of ``attempts``). First every actor, visited in turn from ``start``,
    gets at most a fair share (``room`` spread over all actors, rounded up to whole groups), so that a
    conventional round of ``G B`` samples goes out as 64 + 64 + 64 to three idle actors, not 128 + 64
    + 0; then whatever is left goes to whoever still asks, in the same order. Returns ``[(actor,
    count), ...]`` in grant order (an actor may appear twice) and where the next call starts: one past
    the first actor served, so that the remainder of an uneven split moves round the actors.

    (Until 28 November 2026 the order was recomputed from a start that moved inside the loop, so with
    three actors all asking, one was never visited in the first pass and got nothing: the 1+3
    conventional run on four H100s left actor 1 idle for the whole mode.)"""
    n_actors = len(asks)
    if n_actors == 0 or room <= 0:
        return [], start
    order = [(start + k) % n_actors for k in range(n_actors)]  # fixed for the call
    share = -(-room // (n_actors * attempts)) * attempts
    left = list(asks)
    grants: list[tuple[int, int]] = []
    for cap in (share, None):
        for a in order:
            n = min(left[a], room) if cap is None else min(left[a], room, cap)
            n -= n % attempts
            if n <= 0:
                continue
            grants.append((a, n))
            left[a] -= n
            room -= n
    nxt = (grants[0][0] + 1) % n_actors if grants else start
    return grants, nxt


@dataclass
class ActorBook:
    """What the lead trainer knows of one actor."""

    want: int = 0  # whole-group slots it reported free beyond its grants
    seen: int = 0  # samples granted to it that it had received when it reported ``want``
    granted: int = 0  # samples granted to it so far
    received: int = 0  # samples (finished or aborted) received from it
    messages: int = 0  # SAMPLES messages received from it
    handling_s: float = 0.0  # the lead's receiving thread's time on them after each arrives (unpack, grant)
    bye: dict | None = None


def lead_trainer(ctx: Ctx, cfg: Config, fault: tuple[str, int, int] | None, stall_s: float) -> dict:
    """Run one mode as the lead trainer (rank 0); return the mode's result record."""
    cuda = ctx.device.type == "cuda"
    model = build_model(cfg, ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cuda)
    B, A, T = cfg.batch_size, ctx.actors, ctx.trainers
    shared = Shared(mode=cfg.mode, batch_size=B, max_lag=cfg.max_lag, abort_stale=cfg.abort_stale)
    round_size = shared.rounds * B
    books = [ActorBook() for _ in range(A)]
    state = {"latest": -1, "next": 0, "stopped": False}  # newest weights published; rotation of grants
    out = Outbox(ctx, ctx.groups["down"])

    def grant_locked() -> None:
        """Hand out the admission window to actors that asked, whole groups (under shared.lock)."""
        if state["latest"] < 0 or state["stopped"]:
            return  # nothing to grant before the first weights; nothing after the STOP (no one listens)
        limit = state["latest"] + shared.dropped + B + cfg.max_lag
        # each actor's ask: the free slots it last reported, less what was granted since that report
        asks = [bk.want - (bk.granted - bk.seen) for bk in books]
        grants, state["next"] = allocate_grants(asks, limit - shared.started, cfg.attempts, state["next"])
        for a, n in grants:
            first = shared.started
            shared.started += n
            books[a].granted += n
            needed = max(0, first + n - shared.dropped - B - cfg.max_lag)
            out.put(ctx.actor_rank(a), Message(GRANT, [first, n, needed]))

    def snapshot_locked() -> dict:
        return {"started": shared.started, "consumed": shared.consumed, "dropped": shared.dropped,
                "queued": len(shared.finished), "trained": trained,
                "per_actor": [{"granted": b.granted, "received": b.received} for b in books]}  # fmt: skip

    def receive(a: int) -> None:
        src = ctx.actor_rank(a)
        while True:
            try:
                msg = channel.recv(src, ctx.groups["up"])
            except RuntimeError as exc:
                with shared.lock:
                    ctx.accounting = snapshot_locked()
                fatal(ctx, f"{ctx.name(src)} died or its connection failed while the trainer waited for its "
                           f"samples: {exc}")  # fmt: skip
            if msg.kind == BYE:
                books[a].bye = channel.unpack_json(msg.ints)
                return
            if msg.kind != SAMPLES:
                raise RuntimeError(f"unexpected {channel.KIND_NAMES[msg.kind]} from {ctx.name(src)}")
            th = time.perf_counter()
            samples = channel.unpack_samples(msg.ints, msg.floats)
            with shared.cond:
                books[a].messages += 1
                books[a].received += len(samples)
                books[a].want, books[a].seen = msg.args[0], msg.args[1]
                shared.finished.extend(samples)  # what Shared.put does, under the lock held here
                shared.aborted += sum(s.truncated for s in samples)
                grant_locked()
                shared.cond.notify_all()
            books[a].handling_s += time.perf_counter() - th

    followers: dict[int, dict] = {}

    def watch(j: int) -> None:
        """A trainer's only message is its goodbye; waiting for it is how its death is seen at once."""
        try:
            msg = channel.recv(j, ctx.groups["up"])
        except RuntimeError as exc:
            fatal(ctx, f"{ctx.name(j)} died or its connection failed: {exc}")
        if msg.kind != BYE:
            raise RuntimeError(f"expected BYE from {ctx.name(j)}, got {channel.KIND_NAMES[msg.kind]}")
        followers[j] = channel.unpack_json(msg.ints)

    trained = gen_tokens = dropped_total = aborted_total = mixed = 0
    # what the stale drop throws away: completion tokens already generated (aborted samples: up to the
    # abort), and the prompt lengths (the task's draw, not the policy's) of dropped and trained samples
    dropped_tokens = dropped_prompt = trained_prompt = 0
    threads = [
        threading.Thread(target=guarded, args=(ctx, f"receiving from {ctx.name(ctx.actor_rank(a))}", receive, a),
                         daemon=True, name=f"receiver of {ctx.name(ctx.actor_rank(a))}")
        for a in range(A)
    ] + [threading.Thread(target=guarded, args=(ctx, f"watching {ctx.name(j)}", watch, j), daemon=True,
                          name=f"watcher of {ctx.name(j)}")
         for j in range(1, T)]  # fmt: skip
    for t in threads:
        t.start()

    last_sent: list[torch.Tensor] = []  # keeps the broadcast's source alive until the next one

    def publish(version: int) -> float:
        t = time.perf_counter()
        for a in range(A):
            out.put(ctx.actor_rank(a), Message(WEIGHTS, [version]))
        flat = flat_weights(model)
        dist.broadcast(flat, src=0, group=ctx.groups["weights"])
        last_sent[:] = [flat]
        with shared.cond:
            state["latest"] = version
            grant_locked()
        return time.perf_counter() - t

    steps: list[dict] = []
    lag_hist: collections.Counter = collections.Counter()  # lag in optimizer steps -> tokens
    used_indices: list[int] = []
    version_error: str | None = None  # the first violation of the version bookkeeping, if any
    dropped_indices: list[int] = []
    busy_s = 0.0
    t0 = time.perf_counter()
    busy_s += publish(0)
    last_progress = time.perf_counter()
    for k in range(cfg.steps):
        if cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s:
            break
        tw = time.perf_counter()
        with shared.cond:
            while True:
                batch, dropped = take_batch(shared, cfg.attempts, trained, B)
                if dropped:
                    dropped_total += len(dropped)
                    aborted_total += sum(s.truncated for s in dropped)
                    dropped_indices += [s.index for s in dropped]
                    dropped_tokens += sum(len(s.tokens) for s in dropped)
                    dropped_prompt += sum(len(s.prompt) for s in dropped)
                    grant_locked()  # the window moved
                if batch is not None:
                    break
                if time.perf_counter() - last_progress > stall_s:
                    ctx.accounting = snapshot_locked()
                    fatal(ctx, f"no batch for {stall_s:.0f} s (step {k}, {len(shared.finished)} samples queued, "
                               f"started {shared.started}): the actors stopped sending")  # fmt: skip
                shared.cond.wait(timeout=0.05)
        wait_s = time.perf_counter() - tw
        ts = time.perf_counter()
        groups_ = [batch[i : i + cfg.attempts] for i in range(0, len(batch), cfg.attempts)]
        parts = [[s for g in groups_[j::T] for s in g] for j in range(T)]  # whole groups each
        for j in range(1, T):
            ints, floats = channel.pack_samples(parts[j])
            out.put(j, Message(BATCH, [trained], ints, floats))
        stats = rl_step(
            model, opt, parts[0], attempts=cfg.attempts, is_cap=cfg.is_cap, temperature=cfg.temperature,
            world_batch=B if T > 1 else None, group=ctx.groups["trainers"] if T > 1 else None,
        )  # fmt: skip
        if cuda:
            torch.cuda.current_stream().synchronize()
        train_s = time.perf_counter() - ts
        if version_error is None:
            try:
                check_version_log(
                    [{"index": s.index, "versions": s.versions, "used_at": trained} for s in batch],
                    cfg.max_lag, cfg.mode, B,
                )  # fmt: skip
            except AssertionError as exc:
                version_error = f"step {k + 1}: {exc}"
        lags = [trained - v for s in batch for v in s.versions]
        for lag in lags:
            lag_hist[lag // B] += 1
        gen_tokens += sum(len(s.tokens) for s in batch)  # trained completion tokens: the throughput measure
        trained_prompt += sum(len(s.prompt) for s in batch)
        mixed += sum(len(set(s.versions)) > 1 for s in batch)
        used_indices += [s.index for s in batch]
        reward = sum(s.reward for s in batch) / len(batch)
        trained += B
        bcast_s = 0.0
        if cfg.mode != "conventional" or trained % round_size == 0:
            bcast_s = publish(trained)
        busy_s += train_s + bcast_s
        now = time.perf_counter() - t0
        last_progress = time.perf_counter()
        steps.append({"step": k + 1, "time_s": now, "samples": trained, "tokens": gen_tokens, "reward": reward,
                      "ess": stats["ess"], "clipped": stats["clipped"], "loss": stats["loss"],
                      "lag_mean": sum(lags) / len(lags), "lag_max": max(lags), "dropped": dropped_total,
                      "wait_s": wait_s, "train_s": train_s, "broadcast_s": bcast_s})  # fmt: skip
        if fault is not None and fault[0] == "trainer" and k + 1 >= fault[2]:
            print(f"pipelinerl launch: fault injection: killing {ctx.name()} after step {k + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    span = steps[-1]["time_s"] if steps else time.perf_counter() - t0
    window = time.perf_counter() - t0

    # stop everyone, collect the actors' and trainers' last words
    ctx.closing.set()
    with shared.lock:  # no grant may follow the STOP: the actor's listener stops at it
        state["stopped"] = True
        for a in range(A):
            out.put(ctx.actor_rank(a), Message(STOP))
    for j in range(1, T):
        out.put(j, Message(STOP))
    for t in threads:
        t.join(stall_s)
        if t.is_alive():
            fatal(ctx, f"{t.name}: no goodbye within {stall_s:.0f} s of the stop")
    out.close(stall_s)
    if cuda:  # every actor joined the last broadcast before saying goodbye: it has completed
        torch.cuda.synchronize()
    ctx.closing.clear()

    with shared.lock:
        queued = [s.index for s in shared.finished]
        accounting = account(shared.started, books, used_indices, dropped_indices, queued)
    # the receiving threads share the lead's interpreter with its optimizer steps (issue #34: the step
    # is slower in pipeline and async mode): how many messages they handled and for how long
    busy = [
        {
            "rank": 0,
            "role": "trainer",
            "busy_s": busy_s,
            "window_s": window,
            "busy": busy_s / window,
            "messages_received": sum(b.messages for b in books),
            "receiver_handling_s": sum(b.handling_s for b in books),
        }
    ]
    busy += [{"rank": j, "role": "trainer", **followers[j]["busy"]} for j in sorted(followers)]
    busy += [
        {"rank": ctx.actor_rank(a), "role": "actor", **(b.bye or {}).get("busy", {})}
        for a, b in enumerate(books)
    ]
    n_tok = sum(lag_hist.values())
    ess = sorted(s["ess"] for s in steps)
    return {
        "mode": cfg.mode,
        "summary": {
            "steps": len(steps),
            "seconds": span,
            "samples": trained,
            "tokens": gen_tokens,
            "samples_per_s": trained / span if steps else 0.0,
            "tokens_per_s": gen_tokens / span if steps else 0.0,
            "dropped": dropped_total,
            "aborted": aborted_total,
            "dropped_fraction": dropped_total / max(1, dropped_total + trained),
            "dropped_tokens": dropped_tokens,
            "prompt_len_trained": trained_prompt / max(1, trained),
            "prompt_len_dropped": dropped_prompt / dropped_total if dropped_total else None,
            "reward_first": steps[0]["reward"] if steps else None,
            "reward_last": _mean([s["reward"] for s in steps[-max(1, len(steps) // 5) :]]),
            "lag_mean": sum(k_ * B * c for k_, c in lag_hist.items()) / max(1, n_tok),
            "lag_max": max((s["lag_max"] for s in steps), default=0),
            "ess_mean": _mean(ess),
            "ess_p10": _quantile(ess, 0.1),
            "ess_p50": _quantile(ess, 0.5),
            "ess_p90": _quantile(ess, 0.9),
            "trainer_wait_share": sum(s["wait_s"] for s in steps) / max(span, 1e-9),
            "mixed_version_samples": mixed,
            "replicas_equal": all(f["weights"] == weights_digest(model) for f in followers.values()),
        },  # fmt: skip
        "lag_hist": {str(k_): c / max(1, n_tok) for k_, c in sorted(lag_hist.items())},
        "steps": [{k_: _round(v) for k_, v in s.items()} for s in steps],
        "busy": busy,
        "accounting": accounting,
        "version_check": version_error or "ok",
    }


def weights_digest(model: Policy) -> list[float]:
    """Two sums of the weights in float64: equal on data-parallel trainers that stayed in step."""
    w = flat_weights(model).double()
    return [float(w.sum()), float(w.abs().sum())]


def account(
    started: int, books: list[ActorBook], used: list[int], dropped: list[int], queued: list[int]
) -> dict:
    """Every index granted is trained, dropped, queued, in flight at the stop, or granted unstarted:
    exactly one of these, once. Returns the counts, per actor what it was granted, sent (received
    here) and started, and ``ok`` (with the problems when not)."""
    problems = []
    places: dict[str, list[int]] = {"trained": used, "dropped": dropped, "queued": queued, "in_flight": [],
                                    "unstarted": []}  # fmt: skip
    for a, b in enumerate(books):
        bye = b.bye or {}
        places["in_flight"] += bye.get("in_flight", [])
        places["unstarted"] += bye.get("unstarted", [])
        if b.bye is None:
            problems.append(f"actor {a}: no goodbye record")
            continue
        if bye["received_grants"] != b.granted:
            problems.append(f"actor {a}: granted {b.granted}, it received {bye['received_grants']}")
        if bye["sent"] != b.received:
            problems.append(f"actor {a}: sent {bye['sent']} samples, the trainer received {b.received}")
        if bye["started"] != bye["sent"] + len(bye["in_flight"]):
            problems.append(f"actor {a}: started {bye['started']} != sent {bye['sent']} + in flight "
                            f"{len(bye['in_flight'])}")  # fmt: skip
    seen: collections.Counter = collections.Counter()
    for idx in places.values():
        seen.update(idx)
    twice = sorted(i for i, c in seen.items() if c > 1)
    lost = sorted(set(range(started)) - set(seen))
    extra = sorted(i for i in seen if not 0 <= i < started)
    if twice:
        problems.append(f"counted more than once: {twice[:10]}")
    if lost:
        problems.append(f"lost: {lost[:10]}")
    if extra:
        problems.append(f"never granted: {extra[:10]}")
    per_actor = [{"granted": b.granted, "received": b.received, "started": (b.bye or {}).get("started")}
                 for b in books]  # fmt: skip
    return {"started": started, **{k: len(v) for k, v in places.items()}, "per_actor": per_actor,
            "ok": not problems, "problems": problems}  # fmt: skip


# ----------------------------------------------------------------------------- other trainers


def follower_trainer(ctx: Ctx, cfg: Config) -> None:
    """A data-parallel trainer: steps on the share of each batch the lead sends, until STOP."""
    model = build_model(cfg, ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=ctx.device.type == "cuda")
    busy_s, t0 = 0.0, time.perf_counter()
    while True:
        try:
            msg = channel.recv(0, ctx.groups["down"])
        except RuntimeError as exc:
            fatal(ctx, f"{ctx.name(0)} died or its connection failed: {exc}")
        if msg.kind == STOP:
            break
        if msg.kind != BATCH:
            raise RuntimeError(f"unexpected {channel.KIND_NAMES[msg.kind]} from the lead trainer")
        ts = time.perf_counter()
        rl_step(
            model, opt, channel.unpack_samples(msg.ints, msg.floats), attempts=cfg.attempts, is_cap=cfg.is_cap,
            temperature=cfg.temperature, world_batch=cfg.batch_size, group=ctx.groups["trainers"],
        )  # fmt: skip
        if ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        busy_s += time.perf_counter() - ts
    window = time.perf_counter() - t0
    record = {
        "busy": {"busy_s": busy_s, "window_s": window, "busy": busy_s / window},
        "weights": weights_digest(model),
    }
    channel.send(Message(BYE, ints=channel.pack_json(record)), 0, ctx.groups["up"])


# ------------------------------------------------------------------------------------------ actor


class ActorOutbox:
    """The actor's sending thread: coalesces finished samples and the latest ``want`` into one
    ``SAMPLES`` message, sends a bare ``want`` update after a second of silence, then ``BYE``."""

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.cond = threading.Condition()
        self.samples: list[Sample] = []
        self.want = (0, 0)
        self.dirty = False
        self.bye: dict | None = None
        self.sent = 0
        self.messages = 0  # SAMPLES messages sent (bare want updates included)
        self.thread = threading.Thread(target=guarded, args=(ctx, "sending samples", self._loop), daemon=True)
        self.thread.start()

    def post(self, samples: list[Sample], want: int, seen: int) -> None:
        with self.cond:
            self.samples += samples
            if samples or (want, seen) != self.want:
                self.want, self.dirty = (want, seen), True
                self.cond.notify()

    def close(self, record: dict, timeout: float) -> None:
        with self.cond:
            self.bye = record
            self.cond.notify()
        self.thread.join(timeout)
        if self.thread.is_alive():
            fatal(self.ctx, f"the sending thread did not finish within {timeout:.0f} s")

    def _loop(self) -> None:
        up = self.ctx.groups["up"]
        while True:
            with self.cond:
                if not self.dirty and self.bye is None:
                    self.cond.wait(timeout=1.0)  # heartbeat: a bare want update every second
                samples, self.samples = self.samples, []
                want, seen = self.want
                self.dirty = False
                bye = self.bye
            try:
                if samples or bye is None:
                    ints, floats = channel.pack_samples(samples)
                    channel.send(Message(SAMPLES, [want, seen], ints, floats), 0, up)
                    self.sent += len(samples)
                    self.messages += 1
                if bye is not None:
                    bye["busy"]["messages"] = self.messages
                    channel.send(Message(BYE, ints=channel.pack_json({**bye, "sent": self.sent})), 0, up)
                    return
            except RuntimeError as exc:
                fatal(self.ctx, f"{self.ctx.name(0)} died or its connection failed (sending samples): {exc}")


def actor(ctx: Ctx, cfg: Config, fault: tuple[str, int, int] | None, stall_s: float) -> None:
    """Run one mode as actor ``rank - trainers`` until the lead trainer says STOP."""
    a = ctx.rank - ctx.trainers
    cuda = ctx.device.type == "cuda"
    stream = torch.cuda.Stream(ctx.device) if cuda else None
    model = build_model(cfg, ctx.device).eval()
    engine = Engine(model, cfg.task, cfg.slots, seed=cfg.seed, temperature=cfg.temperature, attempts=cfg.attempts,
                    actor_id=a)  # fmt: skip
    graph_error = ""
    if cuda and cfg.cuda_graph:
        try:
            engine.capture(capture_error_mode="thread_local")
        except Exception as exc:  # eager rather than not at all; the record says why
            graph_error = f"{type(exc).__name__}: {exc}"[:300]
            engine.graph = None
        torch.cuda.synchronize()
    staging = torch.empty_like(engine.flat) if cfg.mode != "pipeline" else None
    local = Shared(mode=cfg.mode, batch_size=cfg.batch_size, max_lag=cfg.max_lag, abort_stale=cfg.abort_stale)
    inbox: collections.deque = collections.deque()  # ("weights", v) | ("stop",), in arrival order
    grants: collections.deque = collections.deque()  # [first, count, version needed]
    lock, wake = threading.Lock(), threading.Event()
    received = [0]  # samples granted to this actor, received so far

    def listen() -> None:
        while True:
            try:
                msg = channel.recv(0, ctx.groups["down"])
            except RuntimeError as exc:
                fatal(ctx, f"{ctx.name(0)} died or its connection failed: {exc}")
            with lock:
                if msg.kind == GRANT:
                    grants.append(msg.args[:3])
                    received[0] += msg.args[1]
                elif msg.kind == WEIGHTS:
                    inbox.append(("weights", msg.args[0]))
                elif msg.kind == STOP:
                    inbox.append(("stop",))
                else:
                    raise RuntimeError(f"unexpected {channel.KIND_NAMES[msg.kind]} from the lead trainer")
            wake.set()
            if msg.kind == STOP:
                return

    listener = threading.Thread(
        target=guarded, args=(ctx, "listening to the lead trainer", listen), daemon=True
    )
    listener.start()
    outbox = ActorOutbox(ctx)
    started = swaps = n_steps = 0
    busy_s = slot_s = 0.0
    # the actor's loop time outside engine steps (issue #34: host time between steps): waiting with no
    # sequence to decode, and joining broadcasts (with the swap into the engine); the rest of the window
    # is the loop's own host work (grants, messages, aborts) and waiting for the interpreter
    idle_s = bcast_s = 0.0
    pending_version = -1  # staged weights not yet in the engine (async, conventional)
    stopping = False
    fault_version = fault[2] * cfg.batch_size if fault is not None and fault[:2] == ("actor", a) else None
    t_first = None
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), torch.no_grad():
        t_wait = time.perf_counter()
        while not stopping:
            swapped = False
            while True:  # join every broadcast announced so far, in order
                with lock:
                    item = inbox.popleft() if inbox else None
                if item is None:
                    break
                if item[0] == "stop":
                    stopping = True
                    break
                version = item[1]
                target = engine.flat if cfg.mode == "pipeline" else staging
                tb = time.perf_counter()
                dist.broadcast(target, src=0, group=ctx.groups["weights"])
                if t_first is not None:  # the window opens at the first weights
                    bcast_s += time.perf_counter() - tb
                if cfg.mode == "pipeline":
                    engine.mark_loaded(version)  # in flight: the next step decodes with them
                    swaps, swapped = swaps + 1, True
                else:
                    pending_version = version
                if t_first is None:
                    t_first = time.perf_counter()
            if stopping:
                break
            if t_first is None:  # before the first weights: nothing to do
                if time.perf_counter() - t_wait > stall_s:
                    fatal(ctx, f"no weights from {ctx.name(0)} within {stall_s:.0f} s")
                wake.wait(0.01)
                wake.clear()
                continue
            if pending_version > engine.version and engine.n_active == 0:
                tb = time.perf_counter()
                engine.flat.copy_(staging)  # between sequences: async and conventional mode
                bcast_s += time.perf_counter() - tb
                engine.mark_loaded(pending_version)
                swaps, swapped = swaps + 1, True
            if fault_version is not None and engine.version >= fault_version:
                print(f"pipelinerl launch: fault injection: killing {ctx.name()} at weights {engine.version}",
                      flush=True)  # fmt: skip
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            handed: list[Sample] = []
            if cfg.abort_stale and swapped:
                handed = abort_doomed(local, engine)
            draining = cfg.mode == "async" and pending_version > engine.version
            with lock:
                while (
                    grants
                    and not draining
                    and grants[0][2] <= engine.version
                    and grants[0][1] <= len(engine.free)
                ):
                    first, count, _ = grants.popleft()
                    engine.add_many(list(range(first, first + count)))
                    started += count
                pending = sum(g[1] for g in grants)
                seen = received[0]
            want = 0 if draining else max(0, len(engine.free) - pending)
            want -= want % cfg.attempts
            outbox.post(handed, want, seen)
            if engine.n_active == 0:
                ti = time.perf_counter()
                wake.wait(0.0005)
                wake.clear()
                idle_s += time.perf_counter() - ti
                continue
            t = time.perf_counter()
            busy = engine.n_active
            done = engine.step()
            dt = time.perf_counter() - t
            busy_s += dt
            slot_s += dt * busy
            n_steps += 1
            if done:
                outbox.post(done, want, seen)
        in_flight = [engine.meta[s][0] for s in engine.active_slots()]
        engine.abort(engine.active_slots())  # stopped mid-sequence: counted, not sent
        if cuda:
            torch.cuda.current_stream().synchronize()
    window = time.perf_counter() - (t_first or time.perf_counter())
    listener.join(stall_s)
    with lock:
        unstarted = [i for first, count, _ in grants for i in range(first, first + count)]
    record = {
        "started": started, "in_flight": in_flight, "unstarted": unstarted, "received_grants": received[0],
        "busy": {"busy_s": busy_s, "window_s": window, "busy": busy_s / window if window > 0 else 0.0,
                 "steps": n_steps, "swaps": swaps, "slot_utilisation": slot_s / (window * cfg.slots) if window else 0.0,
                 "ms_per_step": 1e3 * busy_s / max(1, n_steps), "cuda_graph": engine.graph is not None,
                 "cuda_graph_error": graph_error, "idle_s": idle_s, "broadcast_s": bcast_s,
                 "host_s": max(0.0, window - busy_s - idle_s - bcast_s),
                 "host_ms_per_step": 1e3 * max(0.0, window - busy_s - idle_s - bcast_s) / max(1, n_steps)},
    }  # fmt: skip
    outbox.close(record, stall_s)


def _round(v):
    """Floats to 5 significant digits (the per-step records of a long run stay small)."""
    return float(f"{v:.5g}") if isinstance(v, float) else v


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------------------------------- main


def run_role(ctx: Ctx, cfg: Config, fault, stall_s: float) -> dict | None:
    """This process's part of one mode: the lead trainer's result record, else None."""
    if ctx.rank == 0:
        return lead_trainer(ctx, cfg, fault, stall_s)
    if ctx.rank < ctx.trainers:
        follower_trainer(ctx, cfg)
    else:
        actor(ctx, cfg, fault, stall_s)
    return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run ... -m repro.pipelinerl.launch",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--trainers", type=int, default=1, help="ranks 0..T-1 train (data parallel), the rest act")
    p.add_argument(
        "--modes", default="conventional,async,pipeline", help="comma-separated, run in this order"
    )
    p.add_argument("--name", default="", help="placement label for the results (default T+A)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--task", choices=sorted(TASK_CHOICES), default="tiny")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--attempts", type=int, default=2)
    p.add_argument("--max-lag", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--is-cap", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10**9, help="optimizer steps per mode (or --time-per-mode)")
    p.add_argument("--time-per-mode", type=float, default=None, help="seconds of training per mode")
    p.add_argument("--weights", default=None, help="initial weights saved by plan.py pretrain")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--abort-stale", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--fault", default=None, help="actor:K@S or trainer@S: SIGKILL that process after step S")
    p.add_argument("--stall-s", type=float, default=60.0, help="no progress for this long is an error")
    p.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    p.add_argument("--out", default=None, help="results JSON (written by rank 0 after every mode)")
    return p.parse_args(argv)


def parse_fault(text: str | None) -> tuple[str, int, int] | None:
    """'actor:1@5' -> ('actor', 1, 5); 'trainer@3' -> ('trainer', 0, 3)."""
    if not text:
        return None
    try:
        who, step = text.split("@")
        role, _, idx = who.partition(":")
        fault = (role, int(idx or 0), int(step))
    except ValueError:
        fault = ("?", 0, 0)
    if fault[0] not in ("actor", "trainer") or fault[2] < 1 or (fault[0] == "trainer" and fault[1] != 0):
        raise SystemExit(f"launch: --fault must be actor:K@S or trainer@S with S >= 1, got '{text}'")
    return fault


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"launch: --modes must name modes among {MODES}, got '{m}'")
    fault = parse_fault(args.fault)
    device_kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    if device_kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    task = TASK_CHOICES[args.task]
    out = Path(args.out) if args.out else None
    ctx = setup(args.trainers, device_kind, args.timeout_s, out)
    if fault is not None and fault[0] == "actor" and not 0 <= fault[1] < ctx.actors:
        raise SystemExit(f"launch: --fault names actor {fault[1]}, there are {ctx.actors}")
    if args.batch_size % (args.trainers * args.attempts):
        raise SystemExit(
            f"launch: --batch-size ({args.batch_size}) must be a multiple of trainers x attempts "
            f"({args.trainers} x {args.attempts}): each trainer takes whole groups"
        )
    if args.slots < args.attempts:
        raise SystemExit(f"launch: --slots ({args.slots}) must hold a whole group ({args.attempts})")
    base = dict(
        max_lag=args.max_lag, batch_size=args.batch_size, attempts=args.attempts, actors=ctx.actors,
        slots=args.slots, steps=args.steps, lr=args.lr, is_cap=args.is_cap, seed=args.seed, device=device_kind,
        task=task, model=ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                                     max_len=task.max_seq_len),
        time_budget_s=args.time_per_mode, cuda_graph=not args.no_cuda_graph, abort_stale=args.abort_stale,
    )  # fmt: skip
    name = args.name or f"{args.trainers}+{ctx.actors}"
    doc: dict = {}
    if ctx.rank == 0:
        from paperclub.bench import environment

        env = environment()
        doc = {
            "placement": name, "trainers": args.trainers, "actors": ctx.actors, "world": ctx.world,
            "backend": "nccl" if device_kind == "cuda" else "gloo",
            "device": env.get("device") if device_kind == "cuda" else "cpu", "environment": env,
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "time_per_mode": args.time_per_mode, "fault": args.fault, "modes": {},
        }  # fmt: skip
    init = None
    for mode in modes:
        cfg = Config(mode=mode, **base)
        cfg.validate()
        if init is None:
            init = load_initial(args.weights, cfg)
        cfg.init_weights = init
        ctx.mode = mode
        try:
            result = run_role(ctx, cfg, fault, args.stall_s)
        except Exception as exc:
            # A peer's death usually shows here too (a collective fails); give the thread that names
            # the dead peer a moment to report it first.
            time.sleep(1.0)
            fatal(ctx, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        if ctx.rank == 0:
            doc["config"] = cfg.to_dict() | {"mode": None}
            doc["modes"][mode] = result
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
            sm, acc = result["summary"], result["accounting"]
            print(f"[{name} {mode}] {sm['samples']} samples in {sm['seconds']:.1f} s: {sm['samples_per_s']:.0f} "
                  f"samples/s, {sm['tokens_per_s']:.0f} tokens/s, dropped {sm['dropped']}, lag mean "
                  f"{sm['lag_mean']:.1f}, ESS {sm['ess_mean'] or 0:.3f}; busy "
                  + ", ".join(f"{b['role']}@{b['rank']} {b['busy']:.2f}" for b in result["busy"])
                  + f"; accounting {'ok' if acc['ok'] else 'FAILED ' + '; '.join(acc['problems'])}"
                  + f"; versions {result['version_check']}",
                  flush=True)  # fmt: skip
        ctx.mode = ""
        try:
            dist.monitored_barrier(group=ctx.groups["ctrl"], timeout=_dt.timedelta(seconds=args.stall_s))
        except RuntimeError as exc:
            fatal(ctx, f"the barrier after mode {mode} failed: {exc}")
    if ctx.rank == 0:
        bad = {k: {"accounting": m["accounting"], "versions": m["version_check"]} for k, m in doc["modes"].items()
               if not m["accounting"]["ok"] or m["version_check"] != "ok"}  # fmt: skip
        if bad:
            fatal(ctx, "the sample accounting or the version bookkeeping failed: " + json.dumps(bad))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: a clean exit cannot hang on it


if __name__ == "__main__":
    main()
