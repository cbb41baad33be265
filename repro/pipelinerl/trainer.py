"""The trainer: batches of finished samples -> truncated-IS policy-gradient steps -> weight broadcast.

:func:`rl_step` is one optimizer step on one batch, with :mod:`reference`'s objective.
:func:`trainer_loop` is the thread around it: it takes whole groups (all ``attempts`` samples of a
prompt) off the shared queue in the order they completed, drops any group with a token older than
``max_lag`` samples (so every token it trains on respects the bound), steps, and broadcasts the new
weights to the actors through ``torch.distributed`` (rank 0 is the trainer). Groups the actors
aborted as doomed (``actor.abort_doomed``) arrive with truncated members and leave by the same
stale-group path; a truncated sample is never trained on.

Versions are counted in samples, as the released code counts them: the weights after ``k`` steps
of ``B`` samples have version ``k * B``, and a token of version ``v`` used when the trainer has
trained on ``P`` samples has lag ``P - v`` (piche2025pipelinerl, in-flight weight updates).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from repro.pipelinerl.actor import Sample, Shared, broadcast_options
from repro.pipelinerl.model import Policy, flat_weights
from repro.pipelinerl.reference import (
    effective_sample_size,
    group_advantages,
    importance_weights,
    token_logprobs,
    truncated_is_loss,
)
from repro.pipelinerl.task import PAD


def collate(samples: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad prompt + completion: tokens ``[B, T]``, then ``[B, T-1]`` behaviour log-probs, versions, mask.

    Position ``t`` of the ``[B, T-1]`` tensors is the prediction of ``tokens[:, t+1]``."""
    T = max(len(s.prompt) + len(s.tokens) for s in samples)
    tok_rows, lp_rows, ver_rows, mask_rows = [], [], [], []
    for s in samples:  # padded Python rows, then one tensor per field (few calls holding the GIL)
        p, n = len(s.prompt), len(s.tokens)
        pad = T - p - n
        tok_rows.append(s.prompt + s.tokens + [PAD] * pad)
        lp_rows.append([0.0] * (p - 1) + s.logprobs + [0.0] * pad)
        ver_rows.append([0] * (p - 1) + s.versions + [0] * pad)
        mask_rows.append([False] * (p - 1) + [True] * n + [False] * pad)
    tokens = torch.tensor(tok_rows, dtype=torch.long)
    blp = torch.tensor(lp_rows, dtype=torch.float32)
    vers = torch.tensor(ver_rows, dtype=torch.long)
    mask = torch.tensor(mask_rows, dtype=torch.bool)
    return tokens.to(device), blp.to(device), vers.to(device), mask.to(device)


def rl_step(
    model: Policy,
    opt: torch.optim.Optimizer,
    samples: list[Sample],
    *,
    attempts: int,
    is_cap: float,
    temperature: float = 1.0,
    grad_clip: float = 1.0,
    world_batch: int | None = None,
    group=None,
) -> dict:
    """One optimizer step of the truncated-IS loss on ``samples`` (whole groups, in group order).

    Returns the batch's statistics: mean reward, loss, ESS of the untruncated weights, the
    fraction of truncated tokens, and the number of completion tokens.

    Data parallel (``launch.py``'s trainers on several GPUs): each trainer passes its share of the
    batch, ``world_batch`` the whole batch's size and ``group`` the trainers' process group. The loss
    is then this share's sum over sequences divided by ``world_batch``, the gradients are summed over
    the group before clipping (so every trainer clips and steps on the whole batch's gradient, and
    the weights stay identical), and the statistics are those of the whole batch (sums all-reduced).
    Every trainer of the group must call it the same number of times (two all-reduces a call)."""
    device = next(model.parameters()).device
    tokens, blp, _, mask = collate(samples, device)
    rewards = torch.tensor([s.reward for s in samples], device=device)
    adv = group_advantages(rewards, attempts)
    model.train()
    logp = token_logprobs(model, tokens, temperature)
    loss = truncated_is_loss(logp, blp, adv, mask, is_cap)
    if world_batch is not None:
        loss = loss * (len(samples) / world_batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if group is not None:
        all_reduce_grads(model, group)
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    rho = importance_weights(logp, blp)
    if group is None:
        return {
            "reward": float(rewards.mean()),
            "loss": float(loss.detach()),
            "ess": effective_sample_size(rho, mask),
            "clipped": float((rho[mask] > is_cap).float().mean()),
            "tokens": int(mask.sum()),
        }
    w = rho[mask].double()
    sums = torch.stack(
        [w.sum(), (w * w).sum(), torch.tensor(float(w.numel()), device=device, dtype=torch.float64),
         (w > is_cap).double().sum(), rewards.double().sum(), loss.detach().double()]
    )  # fmt: skip
    dist.all_reduce(sums, group=group)
    sw, sww, n, clipped, rsum, total_loss = sums.tolist()
    return {
        "reward": rsum / (world_batch or len(samples)),
        "loss": total_loss,
        "ess": sw * sw / (n * sww),
        "clipped": clipped / n,
        "tokens": int(n),
    }


def all_reduce_grads(model: Policy, group) -> None:
    """Sum every parameter's gradient over ``group`` (one all-reduce of one flat buffer)."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def broadcast_weights(pg, model: Policy, version: int, host: torch.Tensor | None = None) -> float:
    """Send ``model``'s weights as ``version`` to every actor; returns the seconds it took.

    ``host``: a persistent fp32 host buffer ``[N]`` to stage the payload in (pinned when the model is
    on a GPU): the weights are gathered into one vector on the device, copied into it with one
    device-to-host copy that overlaps the header's broadcast, and no host memory is allocated per
    step. Without it a fresh host vector is made each time. Either way the payload is a
    ``torch.distributed`` broadcast of a host tensor (gloo); it returns once the payload has been
    sent, so ``host`` may be rewritten by the next call."""
    t0 = time.perf_counter()
    ready = None
    if host is None:
        flat = flat_weights(model).cpu()
    else:
        n = sum(p.numel() for p in model.parameters())
        if host.device.type != "cpu" or host.dtype != torch.float32 or host.shape != (n,):
            raise ValueError(
                f"broadcast_weights: host must be a CPU float32 tensor of shape ({n},), got "
                f"{host.device.type} {host.dtype} {tuple(host.shape)}"
            )
        flat = host
        weights = flat_weights(model)  # on the model's device: one concatenation
        host.copy_(weights, non_blocking=weights.is_cuda)
        if weights.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
    pg.broadcast([torch.tensor([version, 0])], broadcast_options()).wait()
    if ready is not None:
        ready.synchronize()  # the device-to-host copy has landed before gloo reads the buffer
    pg.broadcast([flat], broadcast_options()).wait()
    return time.perf_counter() - t0


def broadcast_stop(pg) -> None:
    pg.broadcast([torch.tensor([-1, 1])], broadcast_options()).wait()


def _ready_groups(finished: list[Sample], attempts: int) -> OrderedDict:
    """Complete groups among the finished samples, in the order their last member finished."""
    groups: dict[int, list[Sample]] = {}
    order: list[int] = []
    for s in finished:
        g = groups.setdefault(s.index // attempts, [])
        g.append(s)
        if len(g) == attempts:
            order.append(s.index // attempts)
    return OrderedDict((k, sorted(groups[k], key=lambda s: s.index)) for k in order)


def take_batch(
    shared: Shared, attempts: int, trained: int, need: int
) -> tuple[list[Sample] | None, list[Sample]]:
    """Under ``shared.cond``: drop stale complete groups, then take ``need`` samples of fresh ones.

    A group is stale when one of its tokens has version below ``trained - max_lag``; stale groups
    leave the queue at once (they only get staler) and count as consumed, so the actors' admission
    window moves on. In conventional mode a round's ``G * B`` samples must all be there first.
    A group with a truncated (aborted) member must be stale: the actor aborted it only once its
    oldest token was more than ``max_lag`` behind weights the trainer had made; AssertionError
    otherwise. Returns ``(batch or None when not enough fresh samples are ready, dropped)``."""
    ready = _ready_groups(shared.finished, attempts)
    dropped: list[Sample] = []
    fresh: list[tuple[int, list[Sample]]] = []
    for key, group in ready.items():
        # truncated members may hold no token; the aborted group's doomed member holds the oldest
        oldest = min((v for s in group for v in s.versions), default=trained)
        if trained - oldest > shared.max_lag:
            dropped.extend(group)
        else:
            if any(s.truncated for s in group):  # explicit, not `assert`: must hold under python -O too
                raise AssertionError(
                    f"take_batch: group {key} holds truncated samples "
                    f"{[s.index for s in group if s.truncated]} but is fresh (oldest token {oldest}, "
                    f"trained {trained}, max_lag {shared.max_lag}): an aborted sample would be trained on"
                )
            fresh.append((key, group))
    available = sum(len(g) for _, g in fresh)
    enough = available >= need
    if shared.mode == "conventional" and trained % (shared.rounds * shared.batch_size) == 0:
        enough = available >= shared.rounds * shared.batch_size
    batch: list[Sample] = []
    taken = {s.index // attempts for s in dropped}
    if enough:
        for key, group in fresh:
            if len(batch) >= need:
                break
            batch.extend(group)
            taken.add(key)
    if taken:
        shared.finished = [s for s in shared.finished if s.index // attempts not in taken]
        shared.consumed += len(batch) + len(dropped)
        shared.dropped += len(dropped)
    return (batch if enough else None), dropped
