"""The GPU plan's steps other than the launches themselves (``gpu_plan.sh`` calls them), and the ingest.

``python -m repro.pipelinerl.plan <step> ...``:

* ``launch-args [--smoke]``: the sizes every launch of the plan uses, as ``launch.py`` flags (one
  source for the shell script; no torch import).
* ``pretrain --out DIR``: pre-train the policy on one GPU, time-boxed; ``DIR/weights.pt``.
* ``onegpu --dir DIR --time-per-mode S [--lr LR]``: the one-GPU runs: the three modes as threads of one process
  on one GPU (``pipeline.run``, the committed one-GPU setting), the simulator's time model fitted to
  the conventional run (``sim.fit_time_model``) and the trainer step on a half batch timed on the
  same GPU (for the two-trainer prediction); ``DIR/onegpu.json``. Nothing the simulator is given
  comes from a multi-GPU run.
* ``fault-record --case NAME --rc RC --seconds S --log FILE --expect TEXT --out FILE``: what one
  fault launch did (exit status, time, whether its log names the killed process).
* ``predict --dir DIR``: the simulator's predictions for the plan's placements from ``onegpu.json``
  alone (CPU; runs while the GPUs are busy).
* ``report --dir DIR``: one ``paperclub.bench`` Report from ``DIR``: the placements' runs beside the
  simulator's predictions for the same placements, the one-GPU runs, busy fractions, reward curves,
  lag distributions, faults; prints the summary table (``summary FILE`` prints it again).
* ``ingest FILE.tgz [--overwrite]``: unpack the plan's archive into the repository (only under
  ``repro/pipelinerl/results/``, never over a different existing file unless ``--overwrite``) and
  print the report's summary: the coordinator's whole job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import time
from pathlib import Path

# The plan's sizes. Full: the committed one-GPU benchmark's sort-long configuration (d_model 256, 4
# layers, 128 slots, B = 64 in groups of 8, max_lag 128 = 2 B), so that the one-GPU rows can be read
# beside results/nvidia-h100-80gb-hbm3-sort-long.json. Smoke: the tests' toy sizes.
SIZES = {
    "full": {"task": "sort-long", "d-model": 256, "layers": 4, "heads": 4, "slots": 128, "batch-size": 64,
             "attempts": 8, "max-lag": 128, "lr": 2e-4, "seed": 0},
    "smoke": {"task": "tiny", "d-model": 32, "layers": 2, "heads": 2, "slots": 16, "batch-size": 8,
              "attempts": 2, "max-lag": 8, "lr": 1e-3, "seed": 0},
}  # fmt: skip
PRETRAIN = {
    "full": {"steps": 4000, "batch": 256, "lr": 2e-3},
    "smoke": {"steps": 200, "batch": 64, "lr": 1e-2},
}
MODES = ("conventional", "async", "pipeline")
PLACEMENT_ORDER = ("1 GPU shared", "1+1", "1+2", "2+1", "1+3", "2+2")


def launch_args(smoke: bool) -> str:
    return " ".join(f"--{k} {v}" for k, v in SIZES["smoke" if smoke else "full"].items())


def _config(sizes: dict, mode: str, **kw):
    from repro.pipelinerl.launch import TASK_CHOICES
    from repro.pipelinerl.model import ModelConfig
    from repro.pipelinerl.pipeline import Config

    task = TASK_CHOICES[sizes["task"]]
    model = ModelConfig(d_model=sizes["d-model"], n_layers=sizes["layers"], n_heads=sizes["heads"],
                        max_len=task.max_seq_len)  # fmt: skip
    return Config(mode=mode, max_lag=sizes["max-lag"], batch_size=sizes["batch-size"], attempts=sizes["attempts"],
                  slots=sizes["slots"], lr=sizes["lr"], seed=sizes["seed"], task=task, model=model, **kw)  # fmt: skip


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------- pretrain


def pretrain_step(out: Path, smoke: bool, budget_s: float, stop_after: int | None = None) -> dict:
    """Pre-train for ``budget_s`` seconds, or ``stop_after`` optimizer steps if sooner.

    The learning-rate schedule is always the one of ``PRETRAIN``'s full step count, so stopping after
    ``k`` steps gives the weights a time-boxed run that made ``k`` steps gave (up to GPU
    nondeterminism), whatever the device's speed: the two-GPU plan starts from the four-GPU run's
    policy (201 steps on the H100s of 28 November 2026) on an H100 or an H200."""
    import torch

    from repro.pipelinerl.model import Policy, flat_weights, pretrain

    kind = "smoke" if smoke else "full"
    cfg = _config(SIZES[kind], "pipeline")
    torch.manual_seed(cfg.seed)
    model = Policy(cfg.model)
    p = PRETRAIN[kind]
    info = pretrain(model, cfg.task, steps=p["steps"], batch=p["batch"], lr=p["lr"], noise=0.1, seed=cfg.seed,
                    device=_device(), time_budget_s=budget_s, stop_after=stop_after)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    blob = {"weights": flat_weights(model).cpu(), "model": cfg.model.__dict__, "task": SIZES[kind]["task"],
            "pretrain": info}  # fmt: skip
    torch.save(blob, out / "weights.pt")
    print(
        f"pre-trained {info['steps']} steps in {info['seconds']:.1f} s, loss {info['loss']:.3f} -> {out / 'weights.pt'}"
    )
    return info


# --------------------------------------------------------------------------------------- one GPU


def _time_train_step(cfg, weights, samples: list, reps: int) -> float:
    """Median seconds of one ``trainer.rl_step`` on ``samples`` (synchronised), on a throwaway copy."""
    import torch

    from repro.pipelinerl.model import Policy, load_flat_weights
    from repro.pipelinerl.trainer import rl_step

    dev = cfg.device
    model = Policy(cfg.model).to(dev)
    load_flat_weights(model, weights)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, fused=dev == "cuda")
    times = []
    for i in range(reps + 3):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        rl_step(model, opt, samples, attempts=cfg.attempts, is_cap=cfg.is_cap)
        if dev == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def onegpu_step(dir_: Path, smoke: bool, per_mode: float, lr: float | None = None) -> dict:
    import torch

    from repro.pipelinerl.actor import Sample
    from repro.pipelinerl.pipeline import run
    from repro.pipelinerl.sim import fit_time_model
    from repro.pipelinerl.task import make_prompt

    kind = "smoke" if smoke else "full"
    sizes = SIZES[kind] if lr is None else {**SIZES[kind], "lr": lr}
    weights = torch.load(dir_ / "weights.pt", map_location="cpu", weights_only=False)["weights"]
    doc: dict = {"runs": {}, "device": None}
    results = {}
    for mode in MODES:
        cfg = _config(
            sizes, mode, steps=10**9, device=_device(), time_budget_s=per_mode, init_weights=weights
        )
        res = run(cfg)
        results[mode] = res
        sm = res.summary
        doc["runs"][mode] = {
            "summary": sm,
            "steps": [{k: r[k] for k in ("time_s", "samples", "reward", "ess", "lag_mean", "train_s", "broadcast_s")}
                      for r in res.steps],
            "busy": [  # the two threads share the one GPU: rank 0 the trainer thread, rank 1 the actor thread
                {"rank": 0, "role": "trainer", "window_s": sm["seconds"],
                 "busy": sum(r["train_s"] + r["broadcast_s"] for r in res.steps) / max(sm["seconds"], 1e-9)},
                {"rank": 1, "role": "actor", "window_s": sm["seconds"], "busy": sm["engine_busy"]},
            ],
            "tokens": sum(len(u["tokens"]) for u in res.used),
        }  # fmt: skip
        print(f"one GPU, {mode}: {sm['samples_per_s']:.0f} samples/s, {sm['tokens_per_s']:.0f} tokens/s, "
              f"dropped {sm['dropped']}, engine busy {sm['engine_busy']:.2f}", flush=True)  # fmt: skip
    conv = results["conventional"]
    tm, lengths = fit_time_model(conv)
    counts: dict[tuple[int, int], int] = {}
    for pc in lengths:
        counts[pc] = counts.get(pc, 0) + 1
    cfg = conv.config
    # the trainer step on a whole batch and on half of one (two trainers), from real samples
    used = conv.used[: cfg.batch_size]
    samples = [
        Sample(index=u["index"], prompt=make_prompt(cfg.task, cfg.seed, u["index"] // cfg.attempts), tokens=u["tokens"],
               logprobs=u["logprobs"], versions=u["versions"], reward=u["reward"])
        for u in used
    ]  # fmt: skip
    reps = 5 if smoke else 20
    full = _time_train_step(cfg, weights, samples, reps)
    half = _time_train_step(cfg, weights, samples[: cfg.batch_size // 2], reps)
    doc.update({
        "time_model": tm.__dict__, "lengths": [[p, c, n] for (p, c), n in sorted(counts.items())],
        "train_step_s": {"full": full, "half": half, "half_over_full": half / full}, "per_mode_s": per_mode,
        "config": cfg.to_dict() | {"mode": None},
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    })  # fmt: skip
    (dir_ / "onegpu.json").write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"fitted on the one-GPU conventional run: {tm}; trainer step {1e3 * full:.2f} ms (B), "
          f"{1e3 * half:.2f} ms (B/2)")  # fmt: skip
    return doc


# ---------------------------------------------------------------------------------------- faults


def fault_record(case: str, rc: int, seconds: float, log: Path, expect: str, out: Path) -> dict:
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    lines = [ln for ln in text.splitlines() if "pipelinerl launch:" in ln and "fault injection" not in ln]
    rec = {"case": case, "rc": rc, "seconds": seconds, "expect": expect, "named": expect in text,
           "first_report": lines[0][:400] if lines else "", "ok": rc != 0 and expect in text}  # fmt: skip
    out.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    print(f"fault {case}: exit {rc} after {seconds:.1f} s; names the dead process: {rec['named']}")
    return rec


# ---------------------------------------------------------------------------------------- report

COLUMNS = [
    "kind", "placement", "gpus", "trainers", "actors", "mode", "source", "label", "rank", "role", "time_s",
    "samples", "tokens", "tokens_per_sample", "samples_per_s", "tokens_per_s", "vs_conv_samples",
    "vs_conv_tokens", "reward", "reward_eq_samples", "lag", "fraction", "lag_mean", "lag_max", "ess", "ess_p10",
    "ess_p90", "dropped", "dropped_fraction", "dropped_token_fraction", "busy", "pred_samples_per_s",
    "pred_tokens_per_s", "measured_over_pred", "accounting", "check", "case", "seconds",
]  # fmt: skip


def _reward_eq(steps_by_mode: dict[str, list[dict]]) -> dict[str, float]:
    """Each mode's mean batch reward over the same window of trained samples [0.75 s, s], s the
    fewest samples any mode trained (as bench.py)."""
    s_min = min((st[-1]["samples"] for st in steps_by_mode.values() if st), default=0)
    out = {}
    for mode, st in steps_by_mode.items():
        w = [r["reward"] for r in st if 0.75 * s_min < r["samples"] <= s_min]
        out[mode] = sum(w) / len(w) if w else float("nan")
    return out


def _simulate(onegpu: dict, trainers: int, actors: int, mode: str, steps: int) -> dict:
    from repro.pipelinerl.sim import SimConfig, TimeModel, simulate

    tm = TimeModel(**onegpu["time_model"])
    if (
        trainers > 1
    ):  # the trainer step on B / trainers samples, as timed on one GPU (all-reduce not modelled)
        r = onegpu["train_step_s"]["half_over_full"] if trainers == 2 else 1.0 / trainers
        tm = TimeModel(**{**tm.__dict__, "train_s": tm.train_s * r})
    c = onegpu["config"]
    lengths = [(p, n) for p, n, k in onegpu["lengths"] for _ in range(k)]
    G = c["max_lag"] // c["batch_size"] + 1
    n_steps = max(G, steps // G * G)
    cfg = SimConfig(mode=mode, max_lag=c["max_lag"], batch_size=c["batch_size"], attempts=c["attempts"], actors=actors,
                    slots=c["slots"], steps=n_steps, time=tm, lengths=lengths, seed=0,
                    abort_stale=c["abort_stale"])  # fmt: skip
    return simulate(cfg).summary


PLAN_PLACEMENTS = {"1+1": (1, 1), "1+3": (1, 3), "2+2": (2, 2)}


def predict_step(dir_: Path, placements: list[str], sim_steps: int) -> dict:
    """The simulator's predictions for ``placements`` (``T+A``) from ``onegpu.json`` alone;
    ``DIR/predictions.json``. Run while the GPUs are busy with the launches (CPU only)."""
    onegpu = json.loads((dir_ / "onegpu.json").read_text())
    out: dict = {}
    for name in placements:
        T, A = (int(x) for x in name.split("+"))
        out[name] = {}
        for mode in MODES:
            t = time.perf_counter()
            out[name][mode] = _simulate(onegpu, T, A, mode, sim_steps)
            print(f"predicted {name} {mode}: {out[name][mode]['samples_per_s']:.0f} samples/s, "
                  f"{out[name][mode]['tokens_per_s']:.0f} tokens/s ({time.perf_counter() - t:.1f} s)", flush=True)  # fmt: skip
    (dir_ / "predictions.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return out


def report_step(dir_: Path, results_dir: Path | None, tag: str, sim_steps: int) -> Path:
    from paperclub.bench import Report, environment

    onegpu = json.loads((dir_ / "onegpu.json").read_text()) if (dir_ / "onegpu.json").exists() else None
    predicted = (
        json.loads((dir_ / "predictions.json").read_text()) if (dir_ / "predictions.json").exists() else {}
    )
    launches = [json.loads(p.read_text()) for p in sorted(dir_.glob("launch-*.json"))]
    faults = [json.loads(p.read_text()) for p in sorted(dir_.glob("fault-*.json"))]
    faults = [f for f in faults if "case" in f]  # records of fault-record, not a launch's own files
    title = "PipelineRL: actors and trainers on their own GPUs (torchrun, NCCL)"
    if launches:  # which launches: a two-GPU plan's report must not read as the four-GPU one's
        title += ": " + ", ".join(d["placement"] for d in launches)
    rep = Report(package="pipelinerl", title=title, columns=COLUMNS, peer="", measure_ceilings=False)
    notes: list[str] = []
    summary_rows: list[dict] = []
    env = environment()
    gpus_used = max([d["world"] for d in launches] or [1])
    env["device_count"] = gpus_used
    for d in launches:  # the device the launches ran on (the plan's host)
        if d.get("device") and d["device"] != "cpu":
            env["device"] = d["device"]

    def add_mode_rows(
        placement: str, gpus: int, T: int, A: int, modes: dict[str, dict], *, one_gpu: bool, variant: str = ""
    ) -> None:
        conv = modes.get("conventional", {}).get("summary")
        eq = _reward_eq({m: r["steps"] for m, r in modes.items()})
        for mode, r in modes.items():
            sm = r["summary"]
            row = dict(
                kind="run", placement=placement, gpus=gpus, trainers=T, actors=A, mode=mode,
                source="one GPU" if one_gpu else "measured", time_s=sm["seconds"], samples=sm["samples"],
                tokens=r.get("tokens", sm.get("tokens")), samples_per_s=sm["samples_per_s"],
                tokens_per_s=sm["tokens_per_s"], reward=sm.get("reward_last"), reward_eq_samples=eq.get(mode),
                lag_mean=sm["lag_mean"], lag_max=sm["lag_max"], ess=sm["ess_mean"], ess_p10=sm.get("ess_p10"),
                ess_p90=sm.get("ess_p90"), dropped=sm["dropped"],
                dropped_fraction=sm.get("dropped_fraction", sm["dropped"] / max(1, sm["dropped"] + sm["samples"])),
                accounting=("ok" if r["accounting"]["ok"] else "FAILED") if "accounting" in r else None,
                check=r.get("version_check"),
            )  # fmt: skip
            if row["tokens"]:  # trained completion tokens per trained sample: moves with the policy
                row["tokens_per_sample"] = row["tokens"] / max(1, sm["samples"])
            if sm.get("dropped_tokens") is not None and row["tokens"]:  # launches since 28 Nov 2026
                row["dropped_token_fraction"] = sm["dropped_tokens"] / (sm["dropped_tokens"] + row["tokens"])
            if conv and conv["samples_per_s"] > 0:
                row["vs_conv_samples"] = sm["samples_per_s"] / conv["samples_per_s"]
                row["vs_conv_tokens"] = sm["tokens_per_s"] / conv["tokens_per_s"]
            if onegpu is not None and not one_gpu:
                try:
                    pred = predicted.get(placement, {}).get(mode) or _simulate(onegpu, T, A, mode, sim_steps)
                    row.update(pred_samples_per_s=pred["samples_per_s"], pred_tokens_per_s=pred["tokens_per_s"],
                               measured_over_pred=sm["tokens_per_s"] / pred["tokens_per_s"])  # fmt: skip
                    rep.add(kind="sim", placement=placement, gpus=gpus, trainers=T, actors=A, mode=mode,
                            source="predicted", samples_per_s=pred["samples_per_s"], tokens_per_s=pred["tokens_per_s"],
                            lag_mean=pred["lag_mean"], dropped_fraction=pred["dropped_fraction"],
                            busy=pred["engine_busy"])  # fmt: skip
                    rep.add(kind="tput", placement=placement, actors=A, trainers=T, gpus=gpus, mode=mode,
                            source="predicted", label=f"{mode} predicted", tokens_per_s=pred["tokens_per_s"],
                            samples_per_s=pred["samples_per_s"])  # fmt: skip
                except Exception as exc:  # the measured rows stay
                    notes.append(
                        f"simulation of {placement} {mode} failed: {type(exc).__name__}: {exc}"[:300]
                    )
            rep.add(**row)
            summary_rows.append({**row, "variant": variant})
            if not one_gpu:
                # several launches of one placement (the two-GPU plan: lr 0 and seeds) are told apart by name
                label = f"{mode} measured" if placement in PLAN_PLACEMENTS else f"{mode}, {placement}"
                rep.add(kind="tput", placement=placement, actors=A, trainers=T, gpus=gpus, mode=mode, source="measured",
                        label=label, tokens_per_s=sm["tokens_per_s"],
                        samples_per_s=sm["samples_per_s"])  # fmt: skip
            steps = r["steps"]
            stride = max(1, len(steps) // 60)
            width = max(stride, len(steps) // 15)
            for k in range(0, len(steps), stride):
                win = steps[max(0, k - width + 1) : k + 1]
                rep.add(kind="curve", placement=placement, mode=mode, time_s=steps[k]["time_s"],
                        samples=steps[k]["samples"], reward=sum(x["reward"] for x in win) / len(win),
                        ess=sum(x["ess"] for x in win) / len(win), lag_mean=steps[k]["lag_mean"])  # fmt: skip
            for lag, frac in (r.get("lag_hist") or {}).items():
                rep.add(kind="lag", placement=placement, mode=mode, lag=int(lag), fraction=frac)
            for b in r.get("busy", []):
                rep.add(kind="busy", placement=placement, gpus=gpus, mode=mode, rank=b["rank"], role=b["role"],
                        busy=b.get("busy"), seconds=b.get("window_s"))  # fmt: skip

    if onegpu is not None:
        add_mode_rows("1 GPU shared", 1, 1, 1, onegpu["runs"], one_gpu=True)
        tm = onegpu["time_model"]
        notes.append(
            "Simulator fitted only on the one-GPU conventional run of this plan (threads on one GPU): engine step "
            f"{1e3 * tm['step_s']:.3f} ms + {1e6 * tm['step_s_per_seq']:.2f} us per busy slot, trainer step "
            f"{1e3 * tm['train_s']:.2f} ms, broadcast {1e3 * tm['broadcast_s']:.2f} ms (gloo through host memory: "
            f"the placements broadcast with NCCL), swap {1e3 * tm['swap_s']:.3f} ms; two trainers: the trainer step "
            f"on half a batch timed on one GPU ({onegpu['train_step_s']['half_over_full']:.2f} of a whole one), "
            "the gradient all-reduce not modelled."
        )
    for d in sorted(launches, key=lambda d: PLACEMENT_ORDER.index(d["placement"])
                    if d["placement"] in PLACEMENT_ORDER else 99):  # fmt: skip
        c = d.get("config", {})
        add_mode_rows(d["placement"], d["world"], d["trainers"], d["actors"], d["modes"], one_gpu=False,
                      variant=f"lr {c.get('lr')}, seed {c.get('seed')}")  # fmt: skip
    for f in faults:
        rep.add(kind="fault", case=f["case"], seconds=f["seconds"], check="ok" if f["ok"] else "FAILED",
                label=f["first_report"][:200])  # fmt: skip
    # headline sentences
    for row in summary_rows:
        if row["mode"] == "pipeline" and row.get("vs_conv_tokens") is not None:
            pred = ""
            conv_pred = next((r for r in rep.rows if r["kind"] == "sim" and r["placement"] == row["placement"]
                              and r["mode"] == "conventional"), None)  # fmt: skip
            if row.get("pred_tokens_per_s") and conv_pred:
                pred = (f" (simulator, fitted on one GPU: {row['pred_tokens_per_s'] / conv_pred['tokens_per_s']:.2f}x "
                        f"tokens/s; measured over predicted pipeline tokens/s {row['measured_over_pred']:.2f})")  # fmt: skip
            variant = f", {row['variant']}" if row.get("variant") else ""
            notes.append(
                f"{row['placement']} ({row['gpus']} GPU{'s' if row['gpus'] > 1 else ''}{variant}): pipeline / conventional "
                f"{row['vs_conv_tokens']:.2f}x trained tokens/s, {row['vs_conv_samples']:.2f}x samples/s, "
                f"dropped {100 * row['dropped_fraction']:.0f}%{pred}."
            )
    for f in faults:
        notes.append(
            f"fault {f['case']}: exit {f['rc']} after {f['seconds']:.1f} s, dead process named: {f['named']}."
        )
    bad = [r for r in summary_rows if r.get("accounting") == "FAILED" or (r.get("check") not in (None, "ok"))]
    notes.append("sample accounting and version bookkeeping: " + ("ok in every run." if not bad else
                 "FAILED in " + ", ".join(f"{r['placement']} {r['mode']}" for r in bad) + "."))  # fmt: skip
    if launches:
        c = launches[0].get("config", {})
        notes.insert(0, f"Each mode {launches[0].get('time_per_mode')} s of training per placement; "
                        f"model {c.get('model')}, task {c.get('task')}, slots {c.get('slots')}, B {c.get('batch_size')} "
                        f"in groups of {c.get('attempts')}, max_lag {c.get('max_lag')} for every mode, "
                        + ", ".join(sorted({f"lr {d['config'].get('lr')} seed {d['config'].get('seed')}"
                                            for d in launches if 'config' in d}))
                        + ". "
                        "Busy: the share of each process's wall-clock spent in synchronised GPU work (actor: engine "
                        "steps; trainer: optimizer steps and the weight broadcast), timed on the host.")  # fmt: skip
    rep.notes = " ".join(notes)
    rep.plot(title="trained tokens/s: measured and predicted (x = actors: 1+1, 2+2, 1+3)", x="actors",
             y="tokens_per_s", series="label", where={"kind": "tput"})  # fmt: skip
    rep.plot(title="GPU busy fraction per process (rank 0 = lead trainer)", x="rank", y="busy", series="mode",
             where={"kind": "busy"}, facet="placement")  # fmt: skip
    rep.plot(title="reward against wall-clock", x="time_s", y="reward", series="mode", where={"kind": "curve"},
             facet="placement")  # fmt: skip
    rep.plot(title="reward against trained samples", x="samples", y="reward", series="mode",
             where={"kind": "curve"}, facet="placement")  # fmt: skip
    rep.plot(title="token lag distribution (optimizer steps)", x="lag", y="fraction", series="mode",
             where={"kind": "lag"}, facet="placement")  # fmt: skip
    rep.plot(title="ESS against trained samples", x="samples", y="ess", series="mode", where={"kind": "curve"},
             facet="placement")  # fmt: skip
    path = rep.write(tag=tag, out_dir=results_dir, env=env)
    print()
    print_summary(rep.rows)
    return path


def print_summary(rows: list[dict]) -> None:
    """The short table the plan prints last: one line per placement and mode."""
    from paperclub.bench import markdown_table

    cols = ["placement", "mode", "samples_per_s", "tokens_per_s", "tokens_per_sample", "vs_conv_tokens",
            "pred_tokens_per_s", "reward_eq_samples", "lag_mean", "ess", "dropped_fraction", "accounting", "check"]  # fmt: skip
    runs = [r for r in rows if r["kind"] == "run"]
    print(markdown_table(cols, runs))
    busy = {}
    for r in rows:
        if r["kind"] == "busy":
            busy.setdefault((r["placement"], r["mode"]), []).append(
                f"{r['role'][0]}{r['rank']} {r['busy']:.2f}"
            )
    for (p, m), b in busy.items():
        print(f"busy {p} {m}: {', '.join(b)}")
    for r in rows:
        if r["kind"] == "fault":
            print(f"fault {r['case']}: {r['check']} after {r['seconds']:.1f} s: {r['label']}")


# ---------------------------------------------------------------------------------------- ingest


def ingest(tgz: Path, root: Path, overwrite: bool = False) -> None:
    """Unpack the plan's archive under ``root``; refuse anything outside ``repro/pipelinerl/results/``
    and, unless ``overwrite``, any file that would replace a different one already there (a later run
    must not replace an earlier run's committed results: each plan writes its own tag and raw folder)."""
    with tarfile.open(tgz) as tar:
        members = tar.getmembers()
        for m in members:
            inside = m.name.rstrip("/").startswith("repro/pipelinerl/results")
            if not inside or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                raise SystemExit(f"ingest: refusing {m.name}: only files under repro/pipelinerl/results/")
        clash = [
            m.name for m in members
            if m.isfile() and (root / m.name).is_file() and (root / m.name).read_bytes() != tar.extractfile(m).read()
        ]  # fmt: skip
        if clash and not overwrite:
            raise SystemExit(
                "ingest: refusing to replace existing results with different contents (pass --overwrite to "
                "replace them): " + ", ".join(clash)
            )
        tar.extractall(root, filter="data")
    reports = [m.name for m in members if "-placements" in m.name and m.name.endswith(".json")]
    print("unpacked:", *[m.name for m in members if m.isfile()], sep="\n  ")
    for name in reports:
        doc = json.loads((root / name).read_text())
        print(
            f"\n{name}: {doc['device']} x{doc['device_count']}, {doc['date']}, torch {doc['environment']['torch']}\n"
        )
        print(doc["notes"], "\n")
        print_summary(doc["rows"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m repro.pipelinerl.plan", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    a = sub.add_parser("launch-args")
    a.add_argument("--smoke", action="store_true")
    a = sub.add_parser("pretrain")
    a.add_argument("--out", required=True)
    a.add_argument("--smoke", action="store_true")
    a.add_argument("--budget-s", type=float, default=30.0)
    a.add_argument(
        "--stop-after", type=int, default=None, help="optimizer steps (the schedule stays the full one)"
    )
    a = sub.add_parser("onegpu")
    a.add_argument("--dir", required=True)
    a.add_argument("--smoke", action="store_true")
    a.add_argument("--time-per-mode", type=float, required=True)
    a.add_argument("--lr", type=float, default=None, help="instead of the plan's (0: a fixed policy)")
    a = sub.add_parser("fault-record")
    for name in ("--case", "--log", "--expect", "--out"):
        a.add_argument(name, required=True)
    a.add_argument("--rc", type=int, required=True)
    a.add_argument("--seconds", type=float, required=True)
    a = sub.add_parser("report")
    a.add_argument("--dir", required=True)
    a.add_argument("--results-dir", default=None, help="default repro/pipelinerl/results")
    a.add_argument("--tag", default="placements")
    a.add_argument("--sim-steps", type=int, default=60)
    a = sub.add_parser("predict")
    a.add_argument("--dir", required=True)
    a.add_argument("--placements", default=",".join(PLAN_PLACEMENTS))
    a.add_argument("--sim-steps", type=int, default=60)
    a = sub.add_parser("summary")
    a.add_argument("report")
    a = sub.add_parser("ingest")
    a.add_argument("tgz")
    a.add_argument("--root", default=".")
    a.add_argument("--overwrite", action="store_true", help="replace existing files with different contents")
    args = ap.parse_args(argv)
    if args.step == "launch-args":
        print(launch_args(args.smoke))
    elif args.step == "pretrain":
        pretrain_step(Path(args.out), args.smoke, args.budget_s, args.stop_after)
    elif args.step == "onegpu":
        onegpu_step(Path(args.dir), args.smoke, args.time_per_mode, args.lr)
    elif args.step == "fault-record":
        fault_record(args.case, args.rc, args.seconds, Path(args.log), args.expect, Path(args.out))
    elif args.step == "report":
        report_step(
            Path(args.dir), Path(args.results_dir) if args.results_dir else None, args.tag, args.sim_steps
        )
    elif args.step == "predict":
        predict_step(Path(args.dir), [p for p in args.placements.split(",") if p], args.sim_steps)
    elif args.step == "summary":
        doc = json.loads(Path(args.report).read_text())
        print(f"{doc['device']} x{doc['device_count']}, {doc['date']}")
        print_summary(doc["rows"])
    else:
        ingest(Path(args.tgz), Path(args.root), args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
