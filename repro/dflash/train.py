"""Training: the target on the standard library's source, the DFlash drafter on the frozen target's
features, and the two baselines: the EAGLE-3-style drafter (:func:`train_eagle`) and the
autoregressive drafter.

``python -m repro.dflash.train [--config tiny|gpu] [--out DIR] [--seed 0]`` trains all three and
saves them (``target.pt``, ``dflash.pt``, ``ar.pt``, a few MB each in the gpu config) with a progress
line per model. ``tiny`` trains on a CPU in seconds (tests, walkthrough); ``gpu`` is the bench's.

DFlash training (chen2026dflash, "Training"): a batch of text windows goes through the frozen target
once, which gives the hidden states of its feature layers; ``n_anchors`` anchor positions are drawn
per window; each anchor starts a block ``[x_a, MASK, ...]`` whose masked positions must predict
``x_{a+1} ..`` from the anchor, the target features of positions ``< a`` and the rest of the block.
All blocks of a window go through the drafter in one pass under :func:`model.training_mask`. Block
lengths are drawn per anchor in ``[min_block, max_block]`` so that one drafter serves every block
size. The cross-entropy at block position k (1-based among the masked ones) is weighted by
``exp(-(k - 1) / loss_decay)``: acceptance stops at the first wrong token, so early positions count more.

EAGLE-style training (li2025eagle3 §3.2, ``eagle.py``): training-time test over ``ttt_steps`` steps on
the same windows as DFlash, in the same order; step s is weighted as DFlash's block position s + 1.
``train_all`` trains target, DFlash and AR drafters (the walkthrough's three); the bench adds the
EAGLE one with :func:`train_eagle`, for DFlash's step count.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from repro.dflash.data import Corpus, load_corpus, random_windows
from repro.dflash.eagle import EagleConfig, EagleDrafter
from repro.dflash.model import DFlashDrafter, DrafterConfig, Target, TargetConfig


@dataclass
class TrainConfig:
    """Everything one training run needs; ``CONFIGS`` holds the named ones."""

    target: TargetConfig
    drafter: DrafterConfig
    ar: TargetConfig
    corpus_bytes: int | None
    seq_len: int = 256
    batch: int = 32
    target_steps: int = 1000
    drafter_steps: int = 600
    ar_steps: int = 600
    lr: float = 2e-3
    warmup: int = 50
    n_anchors: int = 16
    min_block: int = 4
    loss_decay: float = 7.0  # chen2026dflash's decay for 16-token blocks
    # both drafters learn the target's next-token distribution (soft labels from the frozen target,
    # teacher-forced on corpus text) instead of the corpus bytes: verification accepts what the
    # target predicts, which the paper gets by training on target-generated text
    distill: bool = False
    seconds: dict = field(default_factory=dict)  # optional wall-clock cap per model
    # the EAGLE-3-style baseline (eagle.py): trained by train_eagle on the same windows as DFlash
    eagle: EagleConfig = field(default_factory=EagleConfig)


CONFIGS = {
    # CPU, seconds: tests and the walkthrough
    "tiny": TrainConfig(
        target=TargetConfig(d_model=48, n_layers=3, n_heads=4, max_len=512),
        drafter=DrafterConfig(n_layers=1, n_features=2, max_block=8),
        eagle=EagleConfig(n_layers=1, n_features=2, ttt_steps=4),
        ar=TargetConfig(d_model=48, n_layers=1, n_heads=4, max_len=512),
        corpus_bytes=300_000,
        seq_len=96,
        batch=8,
        target_steps=200,
        drafter_steps=120,
        ar_steps=120,
        lr=3e-3,
        warmup=20,
        n_anchors=12,
        min_block=2,
        loss_decay=4.0,
    ),
    # one H100, a couple of minutes in all (bench.py caps each model's wall time from --budget-s)
    "gpu": TrainConfig(
        # a deep, narrow target: at this size a forward costs its kernel launches, so depth sets the
        # target's cost and the drafter (2 layers) stays small beside it, as with 36-layer targets
        target=TargetConfig(d_model=256, n_layers=12, n_heads=4, max_len=1024),
        drafter=DrafterConfig(n_layers=2, n_features=3, max_block=16),
        eagle=EagleConfig(n_layers=1, n_features=3, ttt_steps=5),  # EAGLE-3: one layer, 5 TTT steps
        ar=TargetConfig(d_model=256, n_layers=1, n_heads=4, max_len=1024),
        corpus_bytes=None,
        seq_len=256,
        batch=64,
        target_steps=2500,
        drafter_steps=4000,  # both drafters get the same wall-clock cap in the bench: time, not steps, binds
        ar_steps=4000,
        lr=2e-3,
        warmup=100,
        n_anchors=96,  # 96 blocks of 16 per 256-byte window: more targets per (costly) target forward
        min_block=4,
        loss_decay=7.0,
        distill=True,
    ),
}


class Progress:
    """A one-line progress display (tqdm is not required)."""

    def __init__(self, name: str, total: int, stream=sys.stderr, every: int = 10):
        self.name, self.total, self.stream, self.every = name, total, stream, every
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float | None = None) -> None:
        if step % self.every and step != self.total:
            return
        el = time.perf_counter() - self.t0
        width = 24
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        msg = f"\r{self.name:>7} [{bar}] {step}/{self.total} {el:6.1f}s" + (
            f" loss {loss:.3f}" if loss else ""
        )
        self.stream.write(msg)
        self.stream.flush()

    def close(self, note: str = "") -> None:
        self.stream.write(f"  {note}\n")
        self.stream.flush()


def _lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@dataclass
class TrainLog:
    """What a training run did: steps done (a wall-clock cap may stop early), seconds, last losses."""

    steps: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    loss: dict = field(default_factory=dict)


def _loop(name, params, loss_fn, steps, lr, warmup, max_seconds, log: TrainLog, show: bool) -> None:
    """AdamW with warmup and cosine decay over ``steps``. With ``max_seconds``, the step count is cut
    after 30 steps to what the time left allows (from the speed of steps 10-30), so that the learning
    rate still decays to its floor within the cap (the count then depends on the machine's speed)."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    bar = Progress(name, steps) if show else None
    t0 = time.perf_counter()
    step = last = 0
    t10 = None
    while step < steps:
        step += 1
        for g in opt.param_groups:
            g["lr"] = _lr(step - 1, steps, lr, warmup)
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == steps:
            last = float(loss.detach())  # syncs the device, so the clock below is honest
            if bar:
                bar.update(step, last)
            if step == 10:
                t10 = time.perf_counter()
            if max_seconds and step == 30 and t10 is not None:
                per_step = (time.perf_counter() - t10) / 20
                fit = 30 + int(0.95 * (max_seconds - (time.perf_counter() - t0)) / per_step)
                steps = max(30, min(steps, fit))
                if bar:
                    bar.total = steps
        if max_seconds and time.perf_counter() - t0 > 1.1 * max_seconds:  # a safety stop
            break
    last = float(loss.detach())
    log.steps[name], log.seconds[name], log.loss[name] = (
        step,
        round(time.perf_counter() - t0, 1),
        round(last, 4),
    )
    if bar:
        bar.close(f"{step} steps, {log.seconds[name]}s, loss {last:.3f}")


def train_lm(
    cfg: TargetConfig, tc: TrainConfig, corpus: Corpus, steps: int, device, seed: int, log: TrainLog,
    name: str = "target", show: bool = True, max_seconds: float | None = None, teacher: Target | None = None,
) -> Target:  # fmt: skip
    """Next-token cross-entropy on random windows of the training text (the target and the AR
    drafter); with a ``teacher``, cross-entropy against the teacher's next-token distribution."""
    torch.manual_seed(seed)
    model = Target(cfg).to(device)
    gen = torch.Generator().manual_seed(seed)

    def loss_fn():
        x = random_windows(corpus.train, tc.batch, tc.seq_len + 1, gen).to(device)
        with _autocast(model.device):
            logits, _ = model(x[:, :-1])
        logits = _fp32(logits).reshape(-1, cfg.vocab_size)
        if teacher is None:
            return F.cross_entropy(logits, x[:, 1:].reshape(-1))
        with torch.no_grad(), _autocast(model.device):
            t_logits, _ = teacher(x[:, :-1])
        return F.cross_entropy(logits, torch.softmax(_fp32(t_logits).reshape(-1, cfg.vocab_size), -1))

    model.train()
    _loop(name, list(model.parameters()), loss_fn, steps, tc.lr, tc.warmup, max_seconds, log, show)
    return model.eval().requires_grad_(False)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 (under autocast) -> fp32; fp32 and fp64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def position_weights(block_size: int, loss_decay: float, device=None) -> torch.Tensor:
    """Loss weight of each block position ``[block_size]``: 0 for the anchor (position 0), then
    ``exp(-(k - 1) / loss_decay)`` for masked position k = 1 .. block_size - 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / loss_decay)
    w[0] = 0.0
    return w


def sample_anchors(
    batch: int, seq_len: int, n_anchors: int, block: int, min_block: int, gen: torch.Generator
):
    """Anchor positions ``[batch, n_anchors]`` (distinct, in ``[1, seq_len - block]``, so each block
    has at least one context position and fits) and block lengths in ``[min_block, block]``."""
    hi = seq_len - block  # the largest anchor
    if hi < n_anchors:
        raise ValueError(
            f"sample_anchors: seq_len={seq_len} too short for {n_anchors} anchors of block {block}"
        )
    anchors = torch.stack([torch.randperm(hi, generator=gen)[:n_anchors] + 1 for _ in range(batch)])
    sizes = torch.randint(min_block, block + 1, (batch, n_anchors), generator=gen)
    return anchors, sizes


def drafter_loss(
    drafter: DFlashDrafter, ids: torch.Tensor, anchors: torch.Tensor, sizes: torch.Tensor, block: int,
    loss_decay: float, distill: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Weighted block cross-entropy of the drafter on windows ``ids [b, T]`` (target frozen).

    Labels: the bytes ``x_{a+k}``, or with ``distill`` the target's distribution for them (its
    logits at position ``a + k - 1``, from the same forward that gives the features)."""
    target = drafter.target
    with torch.no_grad(), _autocast(ids.device):
        t_logits, feats = target(ids, feature_layers=drafter.feature_layers)
    with _autocast(ids.device):
        logits = drafter.forward_train(feats, ids, anchors, sizes, block)  # [b, m, B, V]
    offs = torch.arange(block, device=ids.device)
    pos = (anchors[:, :, None] + offs).clamp_max(ids.shape[1] - 1)
    labels = ids.gather(1, pos.flatten(1)).view_as(pos)  # label of block position k: x_{a + k}
    w = position_weights(block, loss_decay, ids.device)[None, None, :] * (
        offs[None, None, :] < sizes[..., None]
    )
    logits = _fp32(logits).flatten(0, 2)
    if distill:
        prev = (pos - 1).clamp_min(0).flatten(1)  # the target's prediction of x_{a+k} sits at a+k-1
        soft = torch.softmax(
            _fp32(t_logits).gather(1, prev[..., None].expand(-1, -1, t_logits.shape[-1])), -1
        )
        nll = F.cross_entropy(logits, soft.flatten(0, 1), reduction="none").view_as(w)
    else:
        nll = F.cross_entropy(logits, labels.flatten(), reduction="none").view_as(w)
    return (nll * w).sum() / w.sum()


def train_drafter(
    target: Target, tc: TrainConfig, corpus: Corpus, steps: int, device, seed: int, log: TrainLog,
    show: bool = True, max_seconds: float | None = None,
) -> DFlashDrafter:  # fmt: skip
    """Train a :class:`DFlashDrafter` on the frozen target (anchors in corpus windows)."""
    torch.manual_seed(seed + 1)
    target.eval().requires_grad_(False)  # frozen: its shared embedding and head get no gradients
    drafter = DFlashDrafter(target, tc.drafter).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    block = tc.drafter.max_block

    def loss_fn():
        ids = random_windows(corpus.train, tc.batch, tc.seq_len, gen).to(device)
        anchors, sizes = sample_anchors(tc.batch, tc.seq_len, tc.n_anchors, block, tc.min_block, gen)
        return drafter_loss(
            drafter, ids, anchors.to(device), sizes.to(device), block, tc.loss_decay, tc.distill
        )

    drafter.train()
    _loop("dflash", list(drafter.parameters()), loss_fn, steps, tc.lr, tc.warmup, max_seconds, log, show)
    return drafter.eval().requires_grad_(False)


def eagle_loss(
    drafter: EagleDrafter,
    ids: torch.Tensor,
    loss_decay: float,
    distill: bool = False,
    steps: int | None = None,
) -> torch.Tensor:
    """Training-time-test loss of the EAGLE-style drafter on windows ``ids [b, T]`` (target frozen).

    Step s's prediction at pair position j is of ``x_{j+2}`` (its (s+1)-th draft token when j is the
    anchor's pair minus s); weighted by ``exp(-s / loss_decay)``, the weight DFlash gives its block
    position s + 1, so that both drafters are trained to the same profile over draft positions.
    Labels: the bytes, or with ``distill`` the target's distribution of ``x_{j+2}`` (its logits at
    position j + 1)."""
    target = drafter.target
    with torch.no_grad(), _autocast(ids.device):
        t_logits, feats = target(ids, feature_layers=drafter.feature_layers)
    with _autocast(ids.device):
        logits = drafter.forward_train(feats, ids, steps)  # [S, b, T - 1, V]
    S, b, N, V = logits.shape
    logits = _fp32(logits)
    j = torch.arange(N, device=ids.device)
    s = torch.arange(S, device=ids.device)
    # a chain of s drafter outputs behind it (j >= s) and a label inside the window (j + 2 < T)
    valid = (j[None, :] >= s[:, None]) & (j[None, :] <= N - 2)
    decay = torch.exp(-s.to(logits.dtype) / loss_decay)
    w = (decay[:, None] * valid)[:, None, :].expand(S, b, N)
    if distill:
        soft = torch.softmax(_fp32(t_logits[:, 1:]), -1)  # row j: the target's distribution of x_{j+2}
        nll = F.cross_entropy(logits.reshape(-1, V), soft.expand(S, b, N, V).reshape(-1, V), reduction="none")
    else:
        labels = ids[:, 2:].clone()
        labels = torch.cat([labels, labels[:, -1:]], 1)  # pad row N - 1 (weight 0)
        nll = F.cross_entropy(logits.reshape(-1, V), labels.expand(S, b, N).reshape(-1), reduction="none")
    nll = nll.view(S, b, N)
    return (nll * w).sum() / w.sum()


def train_eagle(
    target: Target, tc: TrainConfig, corpus: Corpus, steps: int, device, seed: int, log: TrainLog,
    show: bool = True, max_seconds: float | None = None,
) -> EagleDrafter:  # fmt: skip
    """Train an :class:`EagleDrafter` on the frozen target with training-time test: the same windows
    in the same order as :func:`train_drafter` (the same generator, stepped alike), the same
    learning-rate schedule, position weights and labels."""
    torch.manual_seed(seed + 3)
    target.eval().requires_grad_(False)
    drafter = EagleDrafter(target, tc.eagle).to(device)
    gen = torch.Generator().manual_seed(seed + 1)  # train_drafter's: the same windows
    block = tc.drafter.max_block

    def loss_fn():
        ids = random_windows(corpus.train, tc.batch, tc.seq_len, gen).to(device)
        sample_anchors(
            tc.batch, tc.seq_len, tc.n_anchors, block, tc.min_block, gen
        )  # keep the stream in step
        return eagle_loss(drafter, ids, tc.loss_decay, tc.distill)

    drafter.train()
    _loop("eagle", list(drafter.parameters()), loss_fn, steps, tc.lr, tc.warmup, max_seconds, log, show)
    return drafter.eval().requires_grad_(False)


def train_all(
    config: str | TrainConfig = "tiny", device: str | torch.device | None = None, seed: int = 0,
    corpus: Corpus | None = None, show: bool = True, seconds: dict | None = None,
) -> tuple[Target, DFlashDrafter, Target, Corpus, TrainLog]:  # fmt: skip
    """Train target, DFlash drafter and autoregressive drafter. ``seconds``: optional wall-clock caps
    per model (keys target, dflash, ar). Returns (target, drafter, ar_drafter, corpus, log)."""
    tc = CONFIGS[config] if isinstance(config, str) else config
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus = corpus or load_corpus(tc.corpus_bytes)
    caps = {**tc.seconds, **(seconds or {})}
    log = TrainLog()
    target = train_lm(
        tc.target, tc, corpus, tc.target_steps, dev, seed, log, "target", show, caps.get("target")
    )
    drafter = train_drafter(target, tc, corpus, tc.drafter_steps, dev, seed, log, show, caps.get("dflash"))
    teacher = target if tc.distill else None
    ar = train_lm(tc.ar, tc, corpus, tc.ar_steps, dev, seed + 2, log, "ar", show, caps.get("ar"), teacher)
    return target, drafter, ar, corpus, log


def save(out: Path, target: Target, drafter: DFlashDrafter, ar: Target) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"config": asdict(target.cfg), "state": target.state_dict()}, out / "target.pt")
    torch.save({"config": asdict(drafter.cfg), "state": drafter.state_dict()}, out / "dflash.pt")
    torch.save({"config": asdict(ar.cfg), "state": ar.state_dict()}, out / "ar.pt")


def load(out: Path, device="cpu") -> tuple[Target, DFlashDrafter, Target]:
    """Load what :func:`save` wrote."""
    t = torch.load(out / "target.pt", map_location=device)
    target = Target(TargetConfig(**t["config"])).to(device)
    target.load_state_dict(t["state"])
    d = torch.load(out / "dflash.pt", map_location=device)
    dcfg = d["config"]
    if dcfg.get("feature_layers") is not None:
        dcfg["feature_layers"] = tuple(dcfg["feature_layers"])
    drafter = DFlashDrafter(target, DrafterConfig(**dcfg)).to(device)
    drafter.load_state_dict(d["state"])
    a = torch.load(out / "ar.pt", map_location=device)
    ar = Target(TargetConfig(**a["config"])).to(device)
    ar.load_state_dict(a["state"])
    return target.eval(), drafter.eval(), ar.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--out", type=Path, default=Path("dflash-checkpoints"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-steps", type=int, default=None, help="cap every model's steps (smoke runs)")
    args = ap.parse_args(argv)
    tc = CONFIGS[args.config]
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise SystemExit(f"--max-steps must be >= 1, got {args.max_steps}")
        cap = args.max_steps
        tc = replace(tc, target_steps=min(tc.target_steps, cap), drafter_steps=min(tc.drafter_steps, cap),
                     ar_steps=min(tc.ar_steps, cap), warmup=min(tc.warmup, cap))  # fmt: skip
    corpus = load_corpus(tc.corpus_bytes)
    print(f"corpus: {corpus.describe()}", file=sys.stderr)
    target, drafter, ar, _, log = train_all(tc, args.device, args.seed, corpus)
    save(args.out, target, drafter, ar)
    print(f"saved to {args.out}: steps {log.steps}, seconds {log.seconds}, loss {log.loss}")


if __name__ == "__main__":
    main()
