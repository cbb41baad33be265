"""§3 of gale2022megablocks at toy scale: does dropping tokens cost model quality?

The paper trains 64-expert top-1 MoEs on The Pile with capacity factors 1, 1.5 and 2 and with
Tutel's dynamic capacity factor (no drops), and finds the dropless model's validation loss well
below the capacity-factor-1 model's at the same number of tokens (Figure 2). This module runs the
same comparison on a CPU in about a second per run: a one-layer language model on synthetic data,
trained for the same steps on the same batches from the same initialisation, once with the
capacity-factor MoE (:func:`~repro.megablocks.reference.capacity_moe`, which drops what overflows)
and once dropless (:func:`~repro.megablocks.reference.moe_dense`, the dMoE's function: the claim
``megablocks/dropless`` checks that our kernels compute it).

The data: next-token prediction from a two-token context ``(a, b)``, both drawn from a Zipf law over
the vocabulary (so some contexts are far more frequent than others, and a router that follows them
loads some experts more than others), the next token from a fixed random distribution per context.
The model: ``h = E_a[a] + E_b[b]``, ``y = h + MoE(h)``, ``logits = y U``; the MoE's experts are GELU
MLPs, the router is Switch's (top-1, the output scaled by the router's probability, so that the
router learns from the loss) with its load-balancing loss (as the paper's models have, §2.2). The
context's pair structure is only reachable through the MoE's nonlinearity, so a dropped token, which
only the residual carries on, is predicted from the two embeddings' sum alone.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from repro.megablocks.reference import capacity_moe, moe_dense


@dataclass(frozen=True)
class ToyConfig:
    """The toy language model and its training run (defaults: what the claim's test trains)."""

    vocab: int = 32
    hidden: int = 32  # d
    ffn: int = 64  # f, each expert's (and the dense model's) MLP width
    num_experts: int = 8
    tokens: int = 256  # tokens per batch: the capacity is ceil(cf * tokens / num_experts)
    steps: int = 300
    lr: float = 1e-2
    zipf: float = 1.0  # context tokens drawn with probability proportional to 1 / rank^zipf
    sharpness: float = 8.0  # next-token logits = sharpness * N(0, 1): a low-entropy target
    aux_loss: float = 0.01  # Switch's load-balancing loss weight
    val_tokens: int = 4096


@dataclass(frozen=True)
class ToyRun:
    """``val_loss``: mean cross-entropy (nats) on held-out tokens, the model as trained (a capacity
    model drops at evaluation too, batch by batch of ``tokens``); ``val_drop_rate``: the fraction of
    held-out tokens it dropped there (0 for the dropless and the dense model)."""

    val_loss: float
    val_drop_rate: float


def _task(seed: int, cfg: ToyConfig):
    gen = torch.Generator().manual_seed(1000 + seed)
    V = cfg.vocab
    p_context = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** cfg.zipf
    p_next = torch.softmax(cfg.sharpness * torch.randn(V, V, V, generator=gen, dtype=torch.float64), -1)

    def sample(n: int, g: torch.Generator):
        a = torch.multinomial(p_context, n, replacement=True, generator=g)
        b = torch.multinomial(p_context, n, replacement=True, generator=g)
        return a, b, torch.multinomial(p_next[a, b], 1, generator=g).squeeze(1)

    return sample, sample(cfg.val_tokens, gen)


def train_toy_lm(seed: int, capacity_factor: float | None, cfg: ToyConfig = ToyConfig()) -> ToyRun:
    """Train the toy model and return its validation loss.

    ``capacity_factor``: None trains the dropless MoE, a number the capacity-factor MoE with that
    factor (GShard / Switch, which drops the assignments over capacity). ``seed`` fixes the task, the
    initialisation and the batches, so two calls with the same seed differ only in the MoE layer.
    ``cfg.num_experts = 1`` with ``capacity_factor=None`` is the dense baseline (one MLP of width
    ``ffn``: the paper's Transformer whose FFN each expert copies)."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor}: expected None (dropless) or a positive number")
    if cfg.val_tokens % cfg.tokens:
        raise ValueError(f"val_tokens={cfg.val_tokens} must be a multiple of tokens={cfg.tokens}")
    threads = torch.get_num_threads()
    # tensors of a few thousand elements: a second thread only adds synchronisation (several times
    # slower on a loaded 2-core machine)
    torch.set_num_threads(1)
    try:
        return _train(seed, capacity_factor, cfg)
    finally:
        torch.set_num_threads(threads)


def _train(seed: int, capacity_factor: float | None, cfg: ToyConfig) -> ToyRun:
    sample, val = _task(seed, cfg)
    V, d, f, E = cfg.vocab, cfg.hidden, cfg.ffn, cfg.num_experts
    init = torch.Generator().manual_seed(seed)
    randn = lambda *shape, scale: (torch.randn(*shape, generator=init) * scale).requires_grad_()  # noqa: E731
    emb_a, emb_b = randn(V, d, scale=0.5), randn(V, d, scale=0.5)
    unembed = randn(d, V, scale=d**-0.5)
    router = randn(E, d, scale=0.1)
    w1, w2 = randn(E * f, d, scale=d**-0.5), randn(E * f, d, scale=f**-0.5)
    params = [emb_a, emb_b, unembed, router, w1, w2]
    opt = torch.optim.Adam(params, lr=cfg.lr)

    def loss_of(a, b, target, training: bool):
        h = emb_a[a] + emb_b[b]
        probs = torch.softmax(h @ router.t(), -1)
        weight, expert = torch.topk(probs, 1, dim=-1)  # Switch: scale by the router's probability
        if capacity_factor is None:
            y, kept = moe_dense(h, weight, expert, w1, w2, None, E, "mlp"), None
        else:
            y, kept = capacity_moe(h, weight, expert, w1, w2, None, E, capacity_factor, "mlp")
        loss = F.cross_entropy((h + y) @ unembed, target)
        if training and cfg.aux_loss:
            # Switch's load-balancing loss: E * sum_e (fraction routed to e) * (mean probability of e)
            routed = torch.bincount(expert[:, 0], minlength=E).float() / expert.shape[0]
            loss = loss + cfg.aux_loss * E * (routed * probs.mean(0)).sum()
        dropped = 0 if kept is None else int((~kept).sum())
        return loss, dropped

    batches = torch.Generator().manual_seed(2000 + seed)
    for _ in range(cfg.steps):
        loss, _ = loss_of(*sample(cfg.tokens, batches), training=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
    total, dropped = 0.0, 0
    with torch.no_grad():
        for i in range(0, cfg.val_tokens, cfg.tokens):
            loss, n = loss_of(*(t[i : i + cfg.tokens] for t in val), training=False)
            total, dropped = total + float(loss), dropped + n
    return ToyRun(val_loss=total / (cfg.val_tokens // cfg.tokens), val_drop_rate=dropped / cfg.val_tokens)


def main(argv=None) -> None:
    """``python -m repro.megablocks.toy_training --seeds 60``: the dense model, capacity factors 1 and
    2 and the dropless MoE on each seed; one line per seed, then the means the paper page quotes."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--seeds", type=int, default=60, help="seeds 0 .. N-1")
    args = ap.parse_args(argv)
    models = {
        "dense": (None, replace(ToyConfig(), num_experts=1)),
        "cf1": (1.0, ToyConfig()),
        "cf2": (2.0, ToyConfig()),
        "dropless": (None, ToyConfig()),
    }
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(f"# {now}, torch {torch.__version__}, {platform.machine()}; {ToyConfig()}")
    print("# seed " + " ".join(f"{m}_loss {m}_dropped" for m in models))
    runs: dict[str, list[ToyRun]] = {m: [] for m in models}
    for seed in range(args.seeds):
        for name, (cf, cfg) in models.items():
            runs[name].append(train_toy_lm(seed, cf, cfg))
        print(
            seed,
            " ".join(f"{runs[m][-1].val_loss:.4f} {runs[m][-1].val_drop_rate:.3f}" for m in models),
            flush=True,
        )
    loss = {m: [r.val_loss for r in rs] for m, rs in runs.items()}
    for name in models:
        below = [d - x for d, x in zip(loss["dense"], loss[name], strict=True)]
        dropped = [r.val_drop_rate for r in runs[name]]
        print(
            f"# {name}: loss {statistics.mean(loss[name]):.3f}, below dense {statistics.mean(below):.3f} "
            f"(lower in {sum(v > 0 for v in below)} of {args.seeds}), dropped {100 * statistics.mean(dropped):.1f}% "
            f"({100 * min(dropped):.0f}-{100 * max(dropped):.0f}%)"
        )
    for name in ("cf1", "cf2"):
        gap = [c - x for c, x in zip(loss[name], loss["dropless"], strict=True)]
        sd = statistics.stdev(gap) if len(gap) > 1 else 0.0
        print(
            f"# {name} minus dropless: mean {statistics.mean(gap):.3f}, sd {sd:.3f}, min {min(gap):.3f}, "
            f"dropless lower in {sum(v > 0 for v in gap)} of {args.seeds}"
        )


if __name__ == "__main__":
    main()
