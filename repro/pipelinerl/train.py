"""``python -m repro.pipelinerl.train --mode pipeline|async|conventional ...``: one run, curves to JSON.

Prints a progress line per optimizer step and writes ``--out`` (default
``pipelinerl-<mode>.json``): the config, a summary (samples/s, tokens/s, reward, ESS, lag, engine
utilisation, dropped and aborted samples) and per-step curves (reward, samples/s, lag max/mean, ESS, truncated fraction, wait
and train and broadcast seconds)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from repro.pipelinerl.model import ModelConfig
from repro.pipelinerl.pipeline import MODES, Config, run
from repro.pipelinerl.task import TASKS, TaskConfig


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m repro.pipelinerl.train", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="pipeline")
    p.add_argument("--max-lag", type=int, default=16, help="samples (a multiple of --attempts)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--attempts", type=int, default=4, help="samples per prompt (group baseline)")
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--slots", type=int, default=32, help="sequences decoded at once per actor")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--is-cap", type=float, default=1.2, help="importance-weight truncation c")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--task", choices=["sort", *[t for t in TASKS if t != "sort"]], default="sort",
        help="sort: lists of 1..--max-items digits, skewed short (default); sort-long: lognormal list lengths "
        f"with a heavy tail ({TASKS['sort-long']})",
    )  # fmt: skip
    p.add_argument("--max-items", type=int, default=None, help="longest list to sort (sort: default 8)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--pretrain-noise", type=float, default=0.1)
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument(
        "--abort-stale", action=argparse.BooleanOptionalAction, default=True,
        help="stop decoding a group as soon as one of its tokens is more than --max-lag behind the actor's "
        "weights (default on); --no-abort-stale decodes it to the end and lets the trainer drop it",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--out", default=None, help="JSON file (default pipelinerl-<mode>.json)")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    if args.task == "sort":
        task = TaskConfig(max_items=args.max_items or 8)
    else:
        task = TASKS[args.task]
        if args.max_items is not None:
            task = TaskConfig(**{**task.__dict__, "max_items": args.max_items})
    return Config(
        mode=args.mode, max_lag=args.max_lag, batch_size=args.batch_size, attempts=args.attempts,
        actors=args.actors, slots=args.slots, steps=args.steps, lr=args.lr, is_cap=args.is_cap,
        temperature=args.temperature, seed=args.seed, device=args.device, task=task,
        model=ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_len=task.max_seq_len),
        pretrain_steps=args.pretrain_steps, pretrain_noise=args.pretrain_noise,
        time_budget_s=args.time_budget_s, abort_stale=args.abort_stale, progress=not args.quiet,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    config = config_from(args)
    result = run(config)
    path = result.write(args.out or f"pipelinerl-{args.mode}.json")
    print(json.dumps(result.summary, indent=1))
    print(f"wrote {path}")
    return result.summary


if __name__ == "__main__":
    main(sys.argv[1:])
