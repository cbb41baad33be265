"""The toy-scale orderings behind claims.yaml and tests/test_orderings.py, one JSON line per seed.

``python -m repro.dflash.lab.toy_orderings [seed=0] [t=300] [d=150] [anch=24] [L=64] [models=kv2,in2,kv1,eagle,eagle1]``

Trains, on one CPU thread, the tiny target (``train.CONFIGS["tiny"]`` with ``t`` steps, windows of
``L`` bytes) and then each named drafter for ``d`` steps on the same windows, and prints the greedy
acceptance length tau at block sizes 4 and 8 (24 held-out prompts of 32 bytes, 48 new tokens):

* ``kv1``, ``kv2``, ``kv3``: DFlash drafters of 1, 2, 3 layers with KV injection (the paper's);
* ``in2``, ``in3``: 2 and 3 layers with input fusion (chen2026dflash §5.5.5's ablation);
* ``eagle``: the EAGLE-3-style drafter with training-time test (4 steps); ``eagle1``: without it.

Not imported by anything; the numbers it printed are quoted where they are used.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from repro.dflash import DrafterConfig, speculative_generate
from repro.dflash.bench import heldout_prompts
from repro.dflash.data import load_corpus
from repro.dflash.train import CONFIGS, TrainLog, train_drafter, train_eagle, train_lm


def main(argv: list[str]) -> dict:
    args = dict(a.split("=", 1) for a in argv)
    seed, t_steps, d_steps = int(args.get("seed", 0)), int(args.get("t", 300)), int(args.get("d", 150))
    tc = dataclasses.replace(
        CONFIGS["tiny"], target_steps=t_steps, drafter_steps=d_steps, n_anchors=int(args.get("anch", 24)),
        seq_len=int(args.get("L", 64)),
    )  # fmt: skip
    torch.set_num_threads(1)
    corpus = load_corpus(tc.corpus_bytes)
    log = TrainLog()
    target = train_lm(tc.target, tc, corpus, tc.target_steps, "cpu", seed, log, "target", False)
    prompts = heldout_prompts(corpus.heldout, 24, 32, seed)

    def dflash(**kw):
        cfg = dataclasses.replace(tc, drafter=DrafterConfig(n_features=2, max_block=8, **kw))
        return train_drafter(target, cfg, corpus, d_steps, "cpu", seed, log, False)

    def eagle(steps):
        cfg = dataclasses.replace(tc, eagle=dataclasses.replace(tc.eagle, ttt_steps=steps))
        return train_eagle(target, cfg, corpus, d_steps, "cpu", seed, log, False)

    builders = {
        "kv1": lambda: dflash(n_layers=1),
        "kv2": lambda: dflash(n_layers=2),
        "kv3": lambda: dflash(n_layers=3),
        "in2": lambda: dflash(n_layers=2, injection="input"),
        "in3": lambda: dflash(n_layers=3, injection="input"),
        "eagle": lambda: eagle(tc.eagle.ttt_steps),
        "eagle1": lambda: eagle(1),
    }
    out = {"seed": seed, "target_loss": log.loss["target"]}
    for name in args.get("models", "kv2,in2,kv1,eagle,eagle1").split(","):
        t0 = time.process_time()
        model = builders[name]()
        out[name] = {"train_cpu_s": round(time.process_time() - t0, 1)}
        for block in (4, 8):
            acc = [
                a
                for p in prompts
                for a in speculative_generate(target, model, p, 48, block_size=block).accepted
            ]
            out[name][f"tau{block}"] = round(sum(a + 1 for a in acc) / len(acc), 3)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
