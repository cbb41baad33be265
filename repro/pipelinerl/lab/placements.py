"""Diagnosis of a GPU plan's placement runs (``gpu_plan.sh``), from its raw records.

``python -m repro.pipelinerl.lab.placements DIR [--out FILE]``: ``DIR`` holds the plan's raw files
(``launch-*.json``, ``onegpu.json``, ``predictions.json``; ``plan.py ingest`` unpacks them under
``results/placements-raw/``). Prints, and writes as JSON (``--out``), what the report's rows do not
show and the paper page's findings rest on:

* per placement and mode: trained completion tokens per trained sample (it moves with the policy
  from run to run, and every tokens/s ratio carries it), samples/s and tokens/s against the
  simulator's prediction, the trainer's time per optimizer step (waiting for a batch, the step, the
  broadcast), and per actor the engine step's time against the loop's time per step;
* conventional mode, one round of ``G`` optimizer steps: its wall-clock against the busiest actor's
  engine time and the trainer's time in it, and the simulated round (generation, then training);
  what neither the engine nor the trainer accounts for is host time the simulator has no term for;
* the batch reward's dependence on the batch's completion lengths (terciles of the steps by mean
  completion length), and the reward of the first steps, which every mode takes from the same
  initial weights.

Reads only; never imported by the reproduction's code. The digest of the four-H100 run of 28 November
2026 is ``results/placements-raw/digest.json``; that run's per-step records (2.6 MB) are not committed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run_digest(r: dict, pred: dict | None, G: int, B: int, slots: int) -> dict:
    """One mode of one placement (``launch.py``'s result record) with its prediction."""
    sm, st = r["summary"], r["steps"]
    n = len(st)
    out = {
        "samples_per_s": sm["samples_per_s"],
        "tokens_per_s": sm["tokens_per_s"],
        "tokens_per_sample": sm["tokens"] / max(1, sm["samples"]),
        "dropped_fraction": sm["dropped_fraction"],
        "dropped": sm["dropped"],
        "aborted": sm["aborted"],  # of the dropped: stopped by the actor as doomed
        "step_ms": {
            "wait_mean": 1e3 * _mean([s["wait_s"] for s in st]),
            "train_median": 1e3 * statistics.median(s["train_s"] for s in st),
            "broadcast_mean": 1e3 * _mean([s["broadcast_s"] for s in st]),
        },
        "trainers": [b["busy"] for b in r["busy"] if b["role"] == "trainer"],
        # the lead's receiving threads: messages handled per optimizer step and their time per step
        **(
            {
                "lead_receiving": {
                    "messages_per_step": r["busy"][0]["messages_received"] / max(1, n),
                    "handling_ms_per_step": 1e3 * r["busy"][0]["receiver_handling_s"] / max(1, n),
                }
            }
            if "receiver_handling_s" in r["busy"][0]
            else {}
        ),
        "actors": [
            {
                "rank": b["rank"],
                "busy": b["busy"],
                "engine_ms_per_step": b["ms_per_step"],
                "loop_ms_per_step": 1e3 * b["window_s"] / b["steps"] if b["steps"] else None,
                # slot_utilisation: busy slot-seconds over window x slots; per second of engine steps
                # that is the mean number of busy slots
                "mean_busy_slots": b["slot_utilisation"] * b["window_s"] * slots / b["busy_s"]
                if b["busy_s"]
                else 0.0,
                # launches since December 2026: the loop's time outside engine steps, split (idle: no
                # sequence to decode; broadcast: joining one and the swap; host: the rest), per step
                **(
                    {
                        "idle_ms_per_step": 1e3 * b["idle_s"] / max(1, b["steps"]),
                        "broadcast_ms_per_step": 1e3 * b["broadcast_s"] / max(1, b["steps"]),
                        "host_ms_per_step": b["host_ms_per_step"],
                        "messages_per_step": b.get("messages", 0) / max(1, b["steps"]),
                    }
                    if "host_ms_per_step" in b
                    else {}
                ),
            }
            for b in r["busy"]
            if b["role"] == "actor"
        ],
    }
    if pred:
        out["predicted"] = {
            k: pred[k] for k in ("samples_per_s", "tokens_per_s", "engine_busy", "trainer_busy")
        }
        out["predicted"]["tokens_per_sample"] = pred["tokens_per_s"] / pred["samples_per_s"]
        out["measured_over_predicted"] = {
            "samples_per_s": sm["samples_per_s"] / pred["samples_per_s"],
            "tokens_per_s": sm["tokens_per_s"] / pred["tokens_per_s"],
        }
    if r["mode"] == "conventional" and n >= G:
        rounds = n / G
        engine = max(b["busy_s"] for b in r["busy"] if b["role"] == "actor") / rounds
        trainer = sum(s["train_s"] + s["broadcast_s"] for s in st) / rounds
        period = sm["seconds"] / rounds
        out["round_ms"] = {
            "period": 1e3 * period,
            "busiest_engine": 1e3 * engine,
            "trainer": 1e3 * trainer,
            "unaccounted": 1e3 * (period - engine - trainer),
        }
        if pred:
            p_period = G * B / pred["samples_per_s"]
            # the simulated round is generation, then training: nothing else takes time
            p_trainer = pred["trainer_busy"] * p_period
            out["predicted"]["round_ms"] = {
                "period": 1e3 * p_period,
                "generation": 1e3 * (p_period - p_trainer),
                "trainer": 1e3 * p_trainer,
            }
    # the batch reward against the batch's mean completion length
    lengths, rewards, prev = [], [], 0
    for s in st:
        lengths.append((s["tokens"] - prev) / B)
        prev = s["tokens"]
        rewards.append(s["reward"])
    order = sorted(range(n), key=lambda i: lengths[i])
    third = n // 3
    terciles = [order[k * third : (k + 1) * third] for k in range(3)]
    out["reward"] = {
        "first_3_steps": _mean(rewards[:3]),
        "first_30_steps": _mean(rewards[:30]),
        "last_fifth": _mean(rewards[-max(1, n // 5) :]),
        "by_length_tercile": [
            {"mean_completion": _mean([lengths[i] for i in t]), "reward": _mean([rewards[i] for i in t])}
            for t in terciles
        ],
        "corr_length_reward": statistics.correlation(lengths, rewards) if n > 2 else None,
    }
    return out


def digest(dir_: Path) -> dict:
    pred = json.loads((dir_ / "predictions.json").read_text()) if (dir_ / "predictions.json").exists() else {}
    out: dict = {"placements": {}}
    for path in sorted(dir_.glob("launch-*.json")):
        d = json.loads(path.read_text())
        c = d["config"]
        G, B = c["max_lag"] // c["batch_size"] + 1, c["batch_size"]
        out["placements"][d["placement"]] = {
            "gpus": d["world"],
            "modes": {
                m: run_digest(r, pred.get(d["placement"], {}).get(m), G, B, c["slots"])
                for m, r in d["modes"].items()
            },
        }
        out.setdefault("device", d.get("device"))
        out.setdefault("date", d.get("date"))
        out.setdefault("time_per_mode_s", d.get("time_per_mode"))
    if (dir_ / "onegpu.json").exists():
        one = json.loads((dir_ / "onegpu.json").read_text())
        lengths = one["lengths"]
        k = sum(x[2] for x in lengths)
        out["simulator_input"] = {
            "time_model": one["time_model"],
            "train_step_s": one["train_step_s"],
            "mean_prompt": sum(p * n for p, _, n in lengths) / k,
            "mean_completion": sum(c * n for _, c, n in lengths) / k,
        }
    return out


def show(doc: dict) -> None:
    for name, pl in doc["placements"].items():
        for mode, r in pl["modes"].items():
            p = r.get("predicted", {})
            mop = r.get("measured_over_predicted", {})
            acts = ", ".join(
                f"a{a['rank']} {a['busy']:.2f} ({a['engine_ms_per_step']:.2f}/{a['loop_ms_per_step'] or 0:.2f} ms"
                + (
                    f"; idle {a['idle_ms_per_step']:.2f}, broadcast {a['broadcast_ms_per_step']:.2f}, host "
                    f"{a['host_ms_per_step']:.2f} ms, {a['messages_per_step']:.2f} messages per step"
                    if "host_ms_per_step" in a
                    else ""
                )
                + ")"
                for a in r["actors"]
            )
            print(
                f"{name:4} {mode:12} tok/sample {r['tokens_per_sample']:5.1f}"
                + (f" (sim {p.get('tokens_per_sample', 0):4.1f})" if p else "")
                + f" samples/s {r['samples_per_s']:5.0f}"
                + (f" x{mop.get('samples_per_s', 0):.2f} of sim" if p else "")
                + f", tokens/s {r['tokens_per_s']:6.0f}"
                + (f" x{mop.get('tokens_per_s', 0):.2f}" if p else "")
                + "; step ms wait "
                f"{r['step_ms']['wait_mean']:.1f} train {r['step_ms']['train_median']:.1f} bcast "
                f"{r['step_ms']['broadcast_mean']:.2f}; actors (busy, engine/loop ms per step) {acts}"
            )
            if "lead_receiving" in r:
                lr_ = r["lead_receiving"]
                print(
                    f"     lead's receiving threads: {lr_['messages_per_step']:.1f} messages, "
                    f"{lr_['handling_ms_per_step']:.2f} ms per optimizer step"
                )
            if "round_ms" in r:
                m, q = r["round_ms"], p.get("round_ms", {})
                print(
                    f"     round ms: period {m['period']:.0f} = engine {m['busiest_engine']:.0f} + trainer "
                    f"{m['trainer']:.0f} + unaccounted {m['unaccounted']:.0f}"
                    + (f"; simulated {q.get('period', 0):.0f} = generation {q.get('generation', 0):.0f} + trainer "
                       f"{q.get('trainer', 0):.0f}" if q else "")
                )  # fmt: skip
            rw = r["reward"]
            terc = " ".join(f"{t['mean_completion']:.0f}:{t['reward']:.3f}" for t in rw["by_length_tercile"])
            print(
                f"     reward first 3 steps {rw['first_3_steps']:.3f}, first 30 {rw['first_30_steps']:.3f}, "
                f"last fifth {rw['last_fifth']:.3f}; by batch length (tokens:reward) {terc}; "
                f"corr {rw['corr_length_reward']:.2f}"
            )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m repro.pipelinerl.lab.placements", description=__doc__.splitlines()[0]
    )
    ap.add_argument("dir", help="the plan's raw records (launch-*.json, onegpu.json, predictions.json)")
    ap.add_argument("--out", default=None, help="write the digest as JSON here")
    args = ap.parse_args(argv)
    doc = digest(Path(args.dir))
    show(doc)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


if __name__ == "__main__":
    main()
