"""Run a pipeline schedule for real: one stage per rank, activations and gradients sent point to point.

The model is a chain of p stages (each ``tanh(x W_s + b_s)``, the last followed by a squared-error
loss). Rank s runs its stage's passes in the order :mod:`repro.parallelism.pipeline_schedule` gives:

* ``F i``: receive micro-batch i's activation from rank s - 1 (rank 0 reads its input), run the stage,
  send the output to rank s + 1 (the last rank computes the micro-batch's loss);
* ``BW i``: receive the output gradient, back-propagate through the stage (weight gradients
  accumulate), send the input gradient to rank s - 1;
* ``B i`` then ``W i`` (qi2024zero §2): B computes only the input gradient and sends it at once;
  W, later, computes the weight gradients from the output gradient B kept.

Sends are non-blocking and receives blocking, so a schedule that :func:`~repro.parallelism.
pipeline_schedule.simulate` accepts cannot deadlock. The loss is the mean over the whole mini-batch,
so the accumulated gradients are those of the unpipelined model on the mini-batch (huang2018gpipe §2.2:
synchronous mini-batch gradient descent, whatever the number of stages and micro-batches).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from repro.parallelism.pipeline_schedule import Op

__all__ = ["chain_loss", "micro_sizes", "run_stage", "split_micro", "stage_forward"]


def stage_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One stage: x [n, h] -> tanh(x W + b) [n, h]."""
    return torch.tanh(x @ w + b)


def chain_loss(
    x: torch.Tensor, target: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The unpipelined model's loss on a whole mini-batch: mean squared error of the chain's output."""
    for w, b in weights:
        x = stage_forward(x, w, b)
    return ((x - target) ** 2).sum() / x.shape[0]


def run_stage(
    ops: list[Op],
    w: torch.Tensor,
    b: torch.Tensor,
    *,
    stage: int,
    stages: int,
    micro_inputs: list[torch.Tensor] | None,
    micro_targets: list[torch.Tensor] | None,
    batch: int,
    hidden: int,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Run this rank's passes; returns (dW, db, the summed loss on the last stage else 0).

    Rank s of the default process group is stage s. ``micro_inputs`` (stage 0) and ``micro_targets``
    (last stage) hold the micro-batches [n_i, hidden]; ``batch`` is the mini-batch size (the loss is
    its mean)."""
    if not 0 <= stage < stages:
        raise ValueError(f"run_stage: stage must be in [0, {stages}), got {stage}")
    first, last = stage == 0, stage == stages - 1
    w, b = w.detach().requires_grad_(True), b.detach().requires_grad_(True)
    dw, db = torch.zeros_like(w), torch.zeros_like(b)
    saved: dict[int, tuple] = {}  # micro-batch -> (input, output or loss)
    grads_out: dict[int, torch.Tensor | None] = {}  # micro-batch -> output gradient kept for W
    sends: list = []
    total_loss = 0.0

    sizes = micro_sizes(batch, len({op.micro for op in ops}))
    for op in ops:
        i = op.micro
        if op.kind == "F":
            if first:
                x = micro_inputs[i]
            else:
                x = torch.empty(sizes[i], hidden, dtype=w.dtype)
                dist.recv(x, src=stage - 1)
                x.requires_grad_(True)
            y = stage_forward(x, w, b)
            if last:
                y = ((y - micro_targets[i]) ** 2).sum() / batch
                total_loss += float(y.detach())
            else:
                sends.append(dist.isend(y.detach().contiguous(), dst=stage + 1))
            saved[i] = (x, y)
            continue
        x, y = saved[i]
        if op.kind in ("BW", "B"):
            if last:
                dy = None  # the loss is a scalar: its gradient is 1
            else:
                dy = torch.empty(sizes[i], hidden, dtype=w.dtype)
                dist.recv(dy, src=stage + 1)
        if op.kind == "BW":
            wanted = [w, b] + ([] if first else [x])
            grads = torch.autograd.grad(y, wanted, dy)
            dw += grads[0]
            db += grads[1]
            if not first:
                sends.append(dist.isend(grads[2].contiguous(), dst=stage - 1))
            del saved[i]
        elif op.kind == "B":
            if not first:  # the input gradient only: the previous stage is waiting for it
                (dx,) = torch.autograd.grad(y, [x], dy, retain_graph=True)
                sends.append(dist.isend(dx.contiguous(), dst=stage - 1))
            grads_out[i] = dy
        elif op.kind == "W":  # the weight gradient, whenever the stage has time for it
            gw, gb = torch.autograd.grad(y, [w, b], grads_out.pop(i))
            dw += gw
            db += gb
            del saved[i]
        else:
            raise ValueError(f"run_stage: unknown pass kind {op.kind!r}")
    for req in sends:
        req.wait()
    return dw, db, total_loss


def micro_sizes(batch: int, m: int) -> list[int]:
    """Micro-batch sizes: ``batch`` split into m nearly equal parts (the larger ones first)."""
    if not 1 <= m <= batch:
        raise ValueError(f"micro_sizes: need 1 <= m <= batch, got m={m}, batch={batch}")
    return [batch // m + (1 if i < batch % m else 0) for i in range(m)]


def split_micro(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    """x [batch, ...] -> m micro-batches along dim 0, sized as :func:`micro_sizes`."""
    return list(torch.split(x, micro_sizes(x.shape[0], m)))
