"""How much the stale KV cache moves the behaviour log-probs after an in-flight swap, at toy scale.

``python -m repro.pipelinerl.lab.stale_kv``: pre-trains the tests' tiny policy, takes one real
optimizer step (``trainer.rl_step`` on a batch it generated, at a few learning rates), and for
sequences swapped from the old to the new weights part-way (the swap at position ``s``) compares,
over the tokens after the swap:

* ``stale``: the new weights on top of the keys and values the old weights computed for positions
  ``< s`` (what the engine samples from and records, ``reference.generate_stale_cache_reference``);
* ``recomputed``: the new weights with the cache recomputed (the alternative the paper rejects);
* ``old``: the old weights throughout (the policy change the importance weights already correct).

It prints, per seed, mean |stale - recomputed| over mean |old - recomputed|: the stale cache's
off-policyness relative to one step's. Numbers for the paper page; the tests assert only what holds
for every input (``tests/test_stale_kv.py``).
"""

from __future__ import annotations

import argparse
import copy

import torch

from repro.pipelinerl.model import Policy
from repro.pipelinerl.reference import generate_stale_cache_reference


def gaps(
    old: Policy, new: Policy, prompt: list[int], tokens: list[int], swap_at: int
) -> tuple[list[float], list[float]]:
    """Per token after the swap: |stale - recomputed| and |old - recomputed| log-prob differences.

    ``swap_at``: the first position processed by the new weights (an index into prompt + tokens,
    at most ``len(prompt) - 1 + len(tokens) - 1``)."""
    models = [old, new]
    P = len(prompt)

    def score(schedule):
        return generate_stale_cache_reference(models, schedule, prompt, None, len(tokens), forced=tokens)[1]

    stale = score(lambda t: int(t >= swap_at))
    recomputed = score(lambda t: 1)
    before = score(lambda t: 0)
    first = max(0, swap_at - (P - 1))  # the first completion token the new weights produce
    return (
        [abs(stale[j] - recomputed[j]) for j in range(first, len(tokens))],
        [abs(before[j] - recomputed[j]) for j in range(first, len(tokens))],
    )


def main(argv: list[str] | None = None) -> None:
    from repro.pipelinerl.actor import Engine
    from repro.pipelinerl.model import TINY_MODEL, pretrain
    from repro.pipelinerl.task import TINY_TASK
    from repro.pipelinerl.trainer import rl_step

    ap = argparse.ArgumentParser(
        prog="python -m repro.pipelinerl.lab.stale_kv", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-2])
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m0 = Policy(TINY_MODEL)
    pretrain(m0, TINY_TASK, steps=60, batch=32, lr=1e-2, noise=0.2, seed=0)
    m0.eval()
    for lr in args.lrs:
        ratios = []
        for seed in range(args.seeds):
            engine = Engine(copy.deepcopy(m0), TINY_TASK, 8, seed=seed, attempts=4)
            batch, nxt = {}, 0
            while len(batch) < 16:
                k = min(len(engine.free), 16 - nxt)
                engine.add_many(list(range(nxt, nxt + k)))
                nxt += k
                for s in engine.step():
                    batch[s.index] = s
            m1 = copy.deepcopy(m0).train()
            rl_step(
                m1,
                torch.optim.Adam(m1.parameters(), lr=lr),
                [batch[i] for i in range(16)],
                attempts=4,
                is_cap=1.2,
            )
            m1.eval()
            st, po = [], []
            for s in batch.values():
                P = len(s.prompt)
                for swap_at in range(1, P - 1 + len(s.tokens)):
                    a, b = gaps(m0, m1, s.prompt, s.tokens, swap_at)
                    st += a
                    po += b
            ratios.append(sum(st) / max(sum(po), 1e-12))
        print(f"lr {lr:g}: mean |stale - recomputed| / mean |old - recomputed| per seed: "
              + ", ".join(f"{r:.2f}" for r in ratios) + f" (min {min(ratios):.2f}, max {max(ratios):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
