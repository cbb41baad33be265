"""Benchmark: the three modes as real runs on one device, then the simulator's sweep.

``python -m repro.pipelinerl.bench --out DIR --budget-s N [--quick] [--task sort-long] [--seeds N]
[--no-abort-stale]``

1. Pre-train the policy once on noisy demonstrations (every mode starts from the same weights).
2. Correctness before timing, through ``paperclub.bench.measure``: the engine step is timed (CUDA
   graph and eager) only after the check that, at this model size and on this device, in-flight
   reloads of unchanged weights (lr = 0) leave every token and log-prob as generation without
   swaps gives, and that the cached engine matches cache-free generation; the trainer step is timed
   after the check that its importance-weighted gradient equals the on-policy gradient when the
   behaviour log-probs are the current ones.
3. Real runs of conventional, async and pipeline mode at the same ``max_lag``, each for the same
   wall-clock share of the budget: reward against wall-clock and against samples, samples/s, lag,
   ESS, engine utilisation, and where the trainer's time went (waiting for complete groups,
   training, broadcasting: per step and as shares of the run's wall-clock) and the actor's swaps.
   The version bookkeeping is asserted on each run's log (``check``). ``--seeds N`` repeats the
   three runs for seeds ``0..N-1`` (sampling streams; the pre-trained weights are shared), the
   mode order rotated by one per seed so that no mode always runs first; the notes give the
   pipeline / conventional and async / conventional samples/s ratio per seed, their mean and min.
   Every mode runs with the actors' early abort of doomed groups (``Config.abort_stale``, our
   addition) unless ``--no-abort-stale``; run rows count ``dropped`` samples and, of those,
   ``aborted`` ones (stopped before they finished).
4. The simulator, its time model fitted to the conventional run (engine step time against busy
   slots, train step, broadcast, swap) and the runs' sequence lengths: one row at the real
   configuration (simulated against measured), then a sweep over actor counts (one engine per
   device) and lags.

On a GPU the actor and trainer threads share it (see ``pipeline.py``); without one a tiny CPU
configuration runs. Rows carry ``kind``: engine | train | run | curve | sim; run and curve rows
carry the ``seed`` of their run (the plots show seed 0).
"""

from __future__ import annotations

import argparse
import time

import torch

from paperclub.bench import Budget, Candidate, Report, bench_parser, measure, parse_bench_args
from repro.pipelinerl.actor import Engine
from repro.pipelinerl.model import ModelConfig, Policy, flat_weights, load_flat_weights, pretrain
from repro.pipelinerl.pipeline import Config, RunResult, run
from repro.pipelinerl.reference import (
    check_version_log,
    generate_reference,
    on_policy_loss,
    token_logprobs,
    truncated_is_loss,
)
from repro.pipelinerl.sim import SimConfig, fit_time_model, simulate
from repro.pipelinerl.task import TASKS, TaskConfig, make_prompt, sampling_uniforms, sft_batch

COLUMNS = [
    "kind", "mode", "seed", "impl", "actors", "slots", "max_lag", "time_s", "samples", "reward",
    "reward_eq_samples", "samples_per_s", "tokens_per_s", "lag_mean", "lag_max", "ess",
    "engine_busy", "slot_utilisation", "dropped", "aborted", "ms_per_step", "trainer_wait_ms", "trainer_train_ms",
    "trainer_bcast_ms", "trainer_wait_share", "trainer_train_share", "trainer_bcast_share", "swap_s",
    "swap_share", "ms", "ms_min", "ms_max", "check",
]  # fmt: skip
MODES = ("conventional", "async", "pipeline")


def mode_order(seed: int) -> list[str]:
    """The order the real runs of ``seed`` go in: ``MODES`` rotated by ``seed`` (seed 0: as listed)."""
    k = seed % len(MODES)
    return [*MODES[k:], *MODES[:k]]


def trainer_cols(res: RunResult) -> dict:
    """Where a run's wall-clock went, from its per-step records and the actors' swap log.

    ``ms_per_step``: the run's span over its steps; ``trainer_{wait,train,bcast}_ms``: the mean per
    step of waiting for a batch of complete groups, the optimizer step (synchronised on a GPU) and
    the weight broadcast (0 on the steps of a conventional round that do not broadcast);
    ``trainer_*_share``: their totals over the span (what is left is the trainer's bookkeeping
    between them and the first broadcast); ``swap_s``: the actors' total pause to take new weights,
    ``swap_share`` the same over span x actors."""
    steps, span = res.steps, res.summary["seconds"]
    if not steps or not span > 0:
        return {}
    n = len(steps)
    tot = {k: sum(r[k] for r in steps) for k in ("wait_s", "train_s", "broadcast_s")}
    swap = sum(dt for lg in res.swaps for _, _, dt in lg)
    return {
        "ms_per_step": 1e3 * span / n,
        "trainer_wait_ms": 1e3 * tot["wait_s"] / n,
        "trainer_train_ms": 1e3 * tot["train_s"] / n,
        "trainer_bcast_ms": 1e3 * tot["broadcast_s"] / n,
        "trainer_wait_share": tot["wait_s"] / span,
        "trainer_train_share": tot["train_s"] / span,
        "trainer_bcast_share": tot["broadcast_s"] / span,
        "swap_s": swap,
        "swap_share": swap / (span * res.config.actors),
    }


def settings(cuda: bool, quick: bool, task_name: str = "sort") -> dict:
    """Sizes for the device: a GPU run that fills an H100's engine step, or a tiny CPU run.

    ``task_name``: ``sort`` (the default) or ``sort-long`` (heavy-tailed list lengths, see
    ``task.TASKS``; on the CPU a scaled-down version of it)."""
    if task_name not in TASKS:
        raise ValueError(f"settings: task must be one of {sorted(TASKS)}, got '{task_name}'")
    if cuda:
        task = TASKS[task_name]
        return dict(
            task=task,
            model=ModelConfig(d_model=256, n_layers=4, n_heads=4, max_len=task.max_seq_len),
            slots=128, batch_size=64, attempts=8, max_lag=128, lr=2e-4, pretrain_steps=3000,
            pretrain_batch=256, pretrain_lr=2e-3, device="cuda",
        )  # fmt: skip
    task = TaskConfig(min_items=1, max_items=6, skew=2.0)
    if task_name == "sort-long":
        task = TaskConfig(min_items=1, max_items=24, dist="lognormal", median=4.0, sigma=1.0)
    return dict(
        task=task,
        model=ModelConfig(d_model=32, n_layers=2, n_heads=2, max_len=task.max_seq_len),
        slots=16, batch_size=8, attempts=4, max_lag=16, lr=1e-3, pretrain_steps=60 if quick else 150,
        pretrain_batch=64, pretrain_lr=1e-2, device="cpu",
    )  # fmt: skip


def drive(engine: Engine, n: int, swaps: dict | None = None) -> dict:
    """Generate samples ``0..n-1`` with ``engine``; ``swaps[step] = (weights, version)``."""
    out, nxt, step = {}, 0, 0
    swaps = swaps or {}
    while len(out) < n:
        if step in swaps:
            engine.load_weights(*swaps[step])
        k = min(len(engine.free), n - nxt)
        engine.add_many(list(range(nxt, nxt + k)))
        nxt += k
        for s in engine.step():
            out[s.index] = s
        step += 1
    return out


def engine_rows(report: Report, s: dict, weights: torch.Tensor, rounds: int) -> None:
    """Time one full engine step (graph / eager), each after its lr = 0 and reference checks."""
    dev = s["device"]
    task, slots = s["task"], s["slots"]

    def engine(graph: bool) -> Engine:
        m = Policy(s["model"]).to(dev).eval()
        load_flat_weights(m, weights)
        e = Engine(m, task, slots, seed=1, attempts=s["attempts"])
        if graph:
            e.capture()
        return e

    n = 2 * slots

    def check(graph: bool):
        def run_check() -> None:
            base = drive(engine(False), n)
            swaps = {k: (weights.clone(), k) for k in range(1, 4 * task.max_seq_len, 3)}
            mixed = drive(engine(graph), n, swaps)
            changed = sum(len(set(x.versions)) > 1 for x in mixed.values())
            assert changed > 0, "no swap fell inside a sequence"
            for i in base:
                assert mixed[i].tokens == base[i].tokens, f"lr=0 in-flight: sample {i} tokens differ"
                diff = max(abs(a - b) for a, b in zip(mixed[i].logprobs, base[i].logprobs, strict=True))
                assert diff <= 1e-5, f"lr=0 in-flight: sample {i} log-probs differ by {diff}"
            ref_model = Policy(s["model"]).to(dev).eval()
            load_flat_weights(ref_model, weights)
            for i in range(min(8, n)):
                prompt = make_prompt(task, 1, i // s["attempts"])
                toks, lps = generate_reference(
                    ref_model, prompt, sampling_uniforms(task, 1, i), task.max_new_tokens
                )
                assert toks == base[i].tokens, f"cached engine vs reference: sample {i} tokens differ"
                diff = max(abs(a - b) for a, b in zip(lps, base[i].logprobs, strict=True))
                assert diff <= 1e-3, f"cached engine vs reference: sample {i} log-probs differ by {diff}"

        return run_check

    def stepper(graph: bool):
        state: dict = {}  # the engine is built on the first call, after the check passed
        counter = iter(range(10**9))

        def fn() -> None:
            if "e" not in state:
                state["e"] = engine(graph)
            e = state["e"]
            e.add_many([next(counter) for _ in range(len(e.free))])
            e.step()

        return fn

    impls = {"eager": False}
    if dev == "cuda":
        impls = {"cuda-graph": True, "eager": False}
    res = measure(
        {name: Candidate(fn=stepper(g), check=check(g)) for name, g in impls.items()},
        rounds=rounds, warmup=5, rep=20,
    )  # fmt: skip
    for name, r in res.items():
        report.add(kind="engine", impl=name, slots=slots, **r.row())


def train_rows(report: Report, s: dict, weights: torch.Tensor, rounds: int) -> None:
    """Time one trainer forward+backward at batch B, after the IS == on-policy gradient check."""
    dev = s["device"]
    model = Policy(s["model"]).to(dev)
    load_flat_weights(model, weights)
    tokens, mask = sft_batch(s["task"], s["batch_size"], torch.Generator().manual_seed(2), noise=0.3)
    tokens, m = tokens.to(dev), mask[:, 1:].to(dev)
    adv = torch.randn(s["batch_size"], device=dev)

    def grads(is_loss: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(model, tokens)
        loss = (
            truncated_is_loss(logp, logp.detach(), adv, m, 1.2) if is_loss else on_policy_loss(logp, adv, m)
        )
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def check() -> None:
        g1, g0 = grads(True), grads(False)
        err = float((g1 - g0).norm() / g0.norm())
        assert err <= 1e-6, f"IS gradient with mu = pi differs from on-policy by {err:.2e}"  # same fp32 ops

    res = measure(
        {"truncated-IS": Candidate(fn=lambda: grads(True), check=check)}, rounds=rounds, warmup=3, rep=10
    )
    report.add(kind="train", impl="truncated-IS", samples=s["batch_size"], **res["truncated-IS"].row())


def real_runs(
    report: Report, s: dict, weights: torch.Tensor, per_mode: float, *, seeds: int = 1, steps: int = 10**6
) -> tuple[dict[int, dict[str, RunResult]], list[str]]:
    """The three modes for ``per_mode`` seconds each (or ``steps`` steps), for seeds ``0..seeds-1``
    in the order ``mode_order(seed)``; adds run and curve rows; returns ``{seed: {mode: result}}``
    and notes (CUDA graph failures)."""
    results: dict[int, dict[str, RunResult]] = {}
    run_notes: list[str] = []
    for seed in range(seeds):
        results[seed] = {}
        for mode in mode_order(seed):
            cfg = Config(
                mode=mode, max_lag=s["max_lag"], batch_size=s["batch_size"], attempts=s["attempts"],
                slots=s["slots"], steps=steps, lr=s["lr"], task=s["task"], model=s["model"], device=s["device"],
                init_weights=weights, time_budget_s=per_mode, seed=seed, abort_stale=s.get("abort_stale", True),
            )  # fmt: skip
            try:
                res = run(cfg)
            except Exception as exc:  # record and carry on with the other modes
                report.add(
                    kind="run", mode=mode, seed=seed, check=f"failed: {type(exc).__name__}: {exc}"[:300]
                )
                continue
            results[seed][mode] = res
            try:
                check_version_log(res.used, cfg.max_lag, mode, cfg.batch_size)
                verdict = "ok"
            except AssertionError as exc:
                verdict = f"failed: {exc}"[:300]
            sm = res.summary
            if sm.get("cuda_graph_error"):
                run_notes.append(
                    f"{mode}{f' seed {seed}' if seeds > 1 else ''}: CUDA graph capture failed, ran eager "
                    f"({sm['cuda_graph_error']})"
                )
            rw = [r["reward"] for r in res.steps]
            tail = rw[-max(1, len(rw) // 5) :]
            tc = trainer_cols(res)
            report.add(
                kind="run", mode=mode, seed=seed, impl="graph" if sm.get("cuda_graph") else "eager", actors=1,
                slots=cfg.slots, max_lag=cfg.max_lag, time_s=sm["seconds"], samples=sm["samples"],
                reward=mean(tail), samples_per_s=sm["samples_per_s"], tokens_per_s=sm["tokens_per_s"],
                lag_mean=sm["lag_mean"], lag_max=sm["lag_max"], ess=sm["ess_mean"], engine_busy=sm["engine_busy"],
                slot_utilisation=sm["slot_utilisation"], dropped=sm["dropped"], aborted=sm["aborted"], check=verdict,
                **tc,
            )  # fmt: skip
            stride = max(1, len(res.steps) // 60)  # at most about 60 points per curve
            width = max(stride, len(res.steps) // 15)  # trailing mean over about a fifteenth of the run
            for k in range(0, len(res.steps), stride):
                window = res.steps[max(0, k - width + 1) : k + 1]
                report.add(
                    kind="curve", mode=mode, seed=seed, max_lag=cfg.max_lag, time_s=res.steps[k]["time_s"],
                    samples=res.steps[k]["samples"], reward=mean([r["reward"] for r in window]),
                    samples_per_s=res.steps[k]["samples_per_s"], lag_mean=res.steps[k]["lag_mean"],
                    lag_max=res.steps[k]["lag_max"], ess=mean([r["ess"] for r in window]),
                )  # fmt: skip
            shares = (
                f"; trainer {tc['ms_per_step']:.1f} ms/step: wait {tc['trainer_wait_share']:.0%}, "
                f"train {tc['trainer_train_share']:.0%}, broadcast {tc['trainer_bcast_share']:.0%}; "
                f"engine busy {sm['engine_busy']:.0%}, swaps {tc['swap_s']:.2f} s"
                if tc
                else ""
            )
            print(
                f"{mode}{f' (seed {seed})' if seeds > 1 else ''}: {sm['samples']} samples in {sm['seconds']:.1f} s, "
                f"{sm['samples_per_s']:.1f} samples/s, dropped {sm['dropped']} (aborted {sm['aborted']}){shares}"
            )
        # reward at equal samples: each mode's mean reward over the same window of this seed's samples
        if results[seed]:
            s_min = min(r.summary["samples"] for r in results[seed].values())
            for row in report.rows:
                if row["kind"] == "run" and row["seed"] == seed and row["mode"] in results[seed]:
                    used = results[seed][row["mode"]].used
                    row["reward_eq_samples"] = mean([u["reward"] for u in used[int(0.75 * s_min) : s_min]])
    return results, run_notes


def ratio_notes(results: dict[int, dict[str, RunResult]]) -> list[str]:
    """Pipeline / conventional and async / conventional samples/s: one seed as before; several
    seeds per seed (3 places), their mean and min."""

    def ratios(mode: str) -> dict[int, float]:
        return {
            seed: rs[mode].summary["samples_per_s"] / rs["conventional"].summary["samples_per_s"]
            for seed, rs in results.items()
            if mode in rs and "conventional" in rs and rs["conventional"].summary["samples_per_s"] > 0
        }

    notes = []
    what = {"pipeline": "target 1.5", "async": "overlap alone"}
    if len(results) <= 1:
        for mode, fmt in (("pipeline", ".3f"), ("async", ".2f")):
            for r in ratios(mode).values():
                notes.append(f"real run: {mode} / conventional samples per second = {r:{fmt}} ({what[mode]})")
        return notes
    for mode in ("pipeline", "async"):
        r = ratios(mode)
        if not r:
            continue
        per = ", ".join(f"seed {k} {v:.3f}" for k, v in r.items())
        notes.append(
            f"real runs, {len(r)} of {len(results)} seeds (mode order rotated per seed): {mode} / conventional "
            f"samples per second {per}; mean {mean(list(r.values())):.3f}, min {min(r.values()):.3f} "
            f"({what[mode]})"
        )
    return notes


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(
        __doc__.splitlines()[0], budget_s=240.0, rounds=None, quick_help="shortest meaningful run (half the budget)",
        only=False, settings=False, tag=False,
    )  # fmt: skip
    ap.prog = "python -m repro.pipelinerl.bench"
    ap.add_argument(
        "--task", choices=sorted(TASKS), default="sort",
        help="sort (default) or sort-long: heavy-tailed list lengths; results file tagged with the task",
    )  # fmt: skip
    ap.add_argument(
        "--max-lag", type=int, default=None,
        help="max_lag in samples for all three real runs and the as-run simulation (default 2 B); "
        "a non-default value tags the results file (lag<N>)",
    )  # fmt: skip
    ap.add_argument(
        "--seeds", type=int, default=1,
        help="real runs for seeds 0..N-1 (mode order rotated per seed), the budget shared among them; "
        "the notes give the samples/s ratios per seed, their mean and min (default 1)",
    )  # fmt: skip
    ap.add_argument(
        "--abort-stale", action=argparse.BooleanOptionalAction, default=True,
        help="stop decoding a group once a token is more than max_lag behind the actor's weights (default on, "
        "every mode); --no-abort-stale: the released code's behaviour, results file tagged noabort",
    )  # fmt: skip
    args = parse_bench_args(ap, argv)
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    if args.max_lag is not None and args.max_lag < 0:
        raise SystemExit(f"--max-lag must be >= 0 samples, got {args.max_lag}")
    run_budget = Budget(args.budget_s * (0.5 if args.quick else 1.0))  # counted from here
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    budget = run_budget.seconds
    s = settings(cuda, args.quick, args.task)
    default_lag = s["max_lag"]
    if args.max_lag is not None:
        s["max_lag"] = args.max_lag
    s["abort_stale"] = args.abort_stale
    report = Report(
        package="pipelinerl",
        title="PipelineRL: conventional, async and pipeline RL on one device, and the simulator",
        columns=COLUMNS,
        peer="",
        packages=[],
    )

    # 1. pre-training, time-boxed
    torch.manual_seed(0)
    model = Policy(s["model"])
    pre = pretrain(
        model, s["task"], steps=s["pretrain_steps"], batch=s["pretrain_batch"], lr=s["pretrain_lr"], noise=0.1,
        seed=0, device=s["device"], time_budget_s=0.12 * budget,
    )  # fmt: skip
    weights = flat_weights(model)
    print(f"pre-trained {pre['steps']} steps in {pre['seconds']:.1f} s, loss {pre['loss']:.3f}")

    # 2. checks, then engine and trainer timings
    rounds = 2 if args.quick else 3
    engine_rows(report, s, weights, rounds)
    train_rows(report, s, weights, rounds)

    # 3. real runs, equal wall-clock each (and for every seed)
    sim_reserve = 0.12 * budget
    n_runs = len(MODES) * args.seeds
    per_mode = max(5.0, (run_budget.left() - sim_reserve) / n_runs - 3.0)
    results, run_notes = real_runs(report, s, weights, per_mode, seeds=args.seeds)

    # 4. simulator, fitted to the conventional run (of the first seed)
    notes = [
        f"device settings: {s['model']}, {s['task']}, slots {s['slots']}, B {s['batch_size']} samples "
        f"(groups of {s['attempts']}), max_lag {s['max_lag']} samples for every mode, "
        f"early abort of doomed groups {'on' if s['abort_stale'] else 'off'}, lr {s['lr']}, "
        f"truncation cap 1.2; pre-training {pre['steps']} steps ({pre['seconds']:.1f} s, loss {pre['loss']:.3f}); "
        f"{per_mode:.0f} s of wall-clock per mode"
        + (
            f" and seed, {args.seeds} seeds (mode order rotated per seed; the plots show seed 0)."
            if args.seeds > 1
            else "."
        )
    ]
    notes += run_notes
    first = next((rs for rs in results.values() if rs), {})  # the first seed with a run
    base = first.get("conventional") or next(iter(first.values()), None)
    if base is not None:
        try:
            tm, lengths = fit_time_model(base)
            of_seed = f", seed {base.config.seed}" if args.seeds > 1 else ""
            notes.append(f"fitted time model (from the {base.config.mode} run{of_seed}): {tm}")
            B, L = s["batch_size"], s["max_lag"]
            for mode in MODES:  # the real configuration, simulated
                sim = simulate(SimConfig(mode=mode, max_lag=L, batch_size=B, attempts=s["attempts"], slots=s["slots"],
                                         steps=60, time=tm, lengths=lengths, abort_stale=s["abort_stale"]))  # fmt: skip
                report.add(kind="sim", mode=mode, impl="as-run", actors=1, slots=s["slots"], max_lag=L,
                           **_sim_cols(sim.summary))  # fmt: skip
            actors = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16]
            lags = [0, B, 2 * B, 4 * B] if args.quick else [0, B, 2 * B, 4 * B, 8 * B]
            t_sim = time.perf_counter()
            sweep = [(a, lag) for a in actors for lag in lags]
            for a, lag in sweep:
                if not run_budget.allows() and time.perf_counter() - t_sim > 5:
                    notes.append(f"simulator sweep stopped at actors={a}, max_lag={lag}: budget spent")
                    break
                for mode in MODES:
                    sim = simulate(SimConfig(mode=mode, max_lag=lag, batch_size=B, attempts=s["attempts"],
                                             actors=a, slots=s["slots"], steps=40, time=tm, lengths=lengths,
                                             abort_stale=s["abort_stale"]))  # fmt: skip
                    report.add(kind="sim", mode=mode, impl="sweep", actors=a, slots=s["slots"], max_lag=lag,
                               **_sim_cols(sim.summary))  # fmt: skip
        except Exception as exc:  # the runs' rows are written whatever happens to the simulator
            notes.append(f"simulator skipped: {type(exc).__name__}: {exc}"[:300])
    notes += ratio_notes(results)
    for line in ratio_notes(results):
        print(line)
    report.notes = " ".join(notes)
    curves = {"kind": "curve"} if args.seeds == 1 else {"kind": "curve", "seed": 0}
    report.plot(title="reward against wall-clock", x="time_s", y="reward", series="mode", where=curves)
    report.plot(title="reward against samples", x="samples", y="reward", series="mode", where=curves)
    report.plot(title="token lag (mean, samples)", x="samples", y="lag_mean", series="mode", where=curves)
    report.plot(title="ESS", x="samples", y="ess", series="mode", where=curves)
    report.plot(
        title=f"simulated samples/s against actors (max_lag {2 * s['batch_size']})", x="actors", y="samples_per_s",
        series="mode", where={"kind": "sim", "impl": "sweep", "max_lag": 2 * s["batch_size"]}, logx=True,
    )  # fmt: skip
    report.plot(
        title="simulated samples/s against max_lag (1 actor)", x="max_lag", y="samples_per_s", series="mode",
        where={"kind": "sim", "impl": "sweep", "actors": 1},
    )  # fmt: skip
    report.plot(
        title="simulated mean lag against samples/s (every actor count and lag)", x="samples_per_s", y="lag_mean",
        series="mode", where={"kind": "sim", "impl": "sweep"},
    )  # fmt: skip
    tags = [
        *([] if args.task == "sort" else [args.task]),
        *([] if s["max_lag"] == default_lag else [f"lag{s['max_lag']}"]),
        *([] if s["abort_stale"] else ["noabort"]),
    ]
    report.write(tag="-".join(tags), out_dir=args.out)


def _sim_cols(sm: dict) -> dict:
    return {
        "time_s": sm["seconds"], "samples": sm["samples"], "samples_per_s": sm["samples_per_s"],
        "lag_mean": sm["lag_mean"], "lag_max": sm["lag_max"], "engine_busy": sm["engine_busy"],
        "slot_utilisation": sm["slot_utilisation"], "dropped": sm["dropped"], "aborted": sm["aborted"],
    }  # fmt: skip


if __name__ == "__main__":
    main()
