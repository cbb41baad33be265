"""ZeRO-DP (rajbhandari2019zero §5): data parallelism without replicated model states.

Mixed-precision Adam keeps, per parameter, a 16-bit weight and a 16-bit gradient (2 + 2 bytes) and
K = 12 bytes of optimizer state (fp32 master weight, momentum, variance): 16 Psi bytes for Psi
parameters (§3.1), on every one of the N_d data-parallel ranks. ZeRO partitions them instead, each rank
owning 1/N_d of the flat parameter vector (§5, Fig. 1):

=================  ===============================  ==========================
stage              what is partitioned              model states per rank
=================  ===============================  ==========================
0 (plain DP)       nothing                          (2 + 2 + K) Psi
1 (P_os)           optimizer states                 2 Psi + 2 Psi + K Psi / N_d
2 (P_os+g)         + gradients                      2 Psi + (2 + K) Psi / N_d
3 (P_os+g+p)       + parameters                     (2 + 2 + K) Psi / N_d
=================  ===============================  ==========================

One step, as written here on a flat buffer (Psi padded to a multiple of N_d, as DeepSpeed pads):
stage 3 all-gathers the 16-bit parameters for the forward and backward and drops them after;
gradients are averaged by a reduce-scatter, so each rank receives the mean gradient of its own
partition (§5.2; stage 1 still keeps its whole local gradient, 2 Psi); each rank runs Adam on its
partition of the fp32 states; stages 1 and 2 all-gather the updated 16-bit parameters (§5.1). The
collectives are nanoparallel's (:mod:`nanoparallel`), the reference data parallelism all-reduces with
torch.distributed. The update is the same as plain data parallelism's: only where the numbers live
and the order of the reduction's additions differ (§7: the communication volume of stages 1 and 2 is
DP's 2 Psi, stage 3's 3 Psi).

:meth:`ZeroRank.held_bytes` counts the model states a rank holds between steps (the tensors it keeps,
byte for byte), which is what the paper's formulas describe; the temporaries of a step (the gathered
parameters of stage 3, the full gradient before the reduce-scatter of stage 2) are not model states the
rank keeps, and the paper's bucketed implementation bounds them by a bucket (§5.2, §6.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["STAGES", "ZeroRank", "adam_update", "model_state_bytes", "zero_init", "zero_step"]

STAGES = (0, 1, 2, 3)


def model_state_bytes(psi: int, n_d: int, stage: int, low_bytes: int = 2, k: int = 12) -> int:
    """The paper's per-rank model-state memory (§5, Fig. 1), in bytes, for ``psi`` parameters (a
    multiple of ``n_d``), ``low_bytes`` per 16-bit weight and gradient and ``k`` bytes of optimizer
    state per parameter (12 for mixed-precision Adam)."""
    if stage not in STAGES:
        raise ValueError(f"model_state_bytes: stage must be one of {STAGES}, got {stage!r}")
    if psi % n_d:
        raise ValueError(f"model_state_bytes: psi={psi} must be a multiple of n_d={n_d} (pad it)")
    weights, grads, states = low_bytes * psi, low_bytes * psi, k * psi
    if stage == 0:
        return weights + grads + states
    if stage == 1:
        return weights + grads + states // n_d
    if stage == 2:
        return weights + (grads + states) // n_d
    return (weights + grads + states) // n_d


@dataclass
class ZeroRank:
    """The model states one data-parallel rank keeps between steps (flat, padded to ``padded``)."""

    stage: int
    rank: int
    n_d: int
    numel: int  # Psi, the model's parameters
    padded: int  # Psi rounded up to a multiple of n_d
    params: torch.Tensor  # 16-bit weights: all [padded] (stages 0-2) or this rank's [padded / n_d] (3)
    grads: torch.Tensor  # 16-bit gradients: all [padded] (stages 0-1) or this rank's partition (2-3)
    master: torch.Tensor  # fp32 weights: all (stage 0) or this rank's partition (1-3)
    exp_avg: torch.Tensor  # Adam's first moment, same extent as master
    exp_avg_sq: torch.Tensor  # Adam's second moment, same extent as master
    step: int = 0

    @property
    def part(self) -> slice:
        n = self.padded // self.n_d
        return slice(self.rank * n, (self.rank + 1) * n)

    def held_bytes(self) -> int:
        """Bytes of the model states this rank holds (each tensor's own storage, counted once)."""
        tensors = (self.params, self.grads, self.master, self.exp_avg, self.exp_avg_sq)
        return sum(t.untyped_storage().nbytes() for t in tensors)


def zero_init(
    full_params: torch.Tensor, stage: int, rank: int, n_d: int, low: torch.dtype, high: torch.dtype
) -> ZeroRank:
    """Rank ``rank``'s model states for flat initial weights ``full_params`` [Psi] (the same on every
    rank), 16-bit copies in ``low``, optimizer states in ``high``."""
    if stage not in STAGES:
        raise ValueError(f"zero_init: stage must be one of {STAGES}, got {stage!r}")
    if not 0 <= rank < n_d:
        raise ValueError(f"zero_init: rank must be in [0, {n_d}), got {rank}")
    if full_params.dim() != 1:
        raise ValueError(f"zero_init: full_params must be flat [Psi], got shape {tuple(full_params.shape)}")
    psi = full_params.numel()
    padded = math.ceil(psi / n_d) * n_d
    flat = torch.zeros(padded, dtype=high)
    flat[:psi] = full_params.to(high)
    n = padded // n_d
    mine = flat[rank * n : (rank + 1) * n]
    states = flat.clone() if stage == 0 else mine.clone()
    return ZeroRank(
        stage=stage,
        rank=rank,
        n_d=n_d,
        numel=psi,
        padded=padded,
        params=(mine if stage == 3 else flat).to(low).clone(),
        grads=torch.zeros(n if stage >= 2 else padded, dtype=low),
        master=states,
        exp_avg=torch.zeros_like(states),
        exp_avg_sq=torch.zeros_like(states),
    )


def adam_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> None:
    """One Adam step in place (elementwise, so a partition updates exactly like the whole)."""
    b1, b2 = betas
    exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    m_hat = exp_avg / (1 - b1**step)
    v_hat = exp_avg_sq / (1 - b2**step)
    master.sub_(lr * m_hat / (v_hat.sqrt() + eps))


def zero_step(
    state: ZeroRank,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    comm=None,
    dp_group=None,
    lr: float = 1e-3,
) -> float:
    """One training step of ZeRO stage ``state.stage`` on this rank's micro-batch; returns its loss.

    ``loss_fn(params [Psi]) -> loss`` is this rank's loss (its own data). Stages 1-3 communicate
    through ``comm``, a nanoparallel Communicator of the N_d ranks; stage 0 (plain data parallelism)
    all-reduces the gradients through the torch process group ``dp_group``."""
    s = state
    low, high = s.params.dtype, s.master.dtype
    if s.stage == 3:  # the only moment the whole 16-bit model exists on this rank
        full = torch.empty(s.padded, dtype=low)
        comm.all_gather(full, s.params)
    else:
        full = s.params
    p = full[: s.numel].detach().requires_grad_(True)
    loss = loss_fn(p)
    (g,) = torch.autograd.grad(loss, p)
    local = torch.zeros(s.padded, dtype=low)
    local[: s.numel] = g
    del full, p
    s.step += 1
    if s.stage == 0:
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(local, group=dp_group)
            local /= dist.get_world_size(dp_group)
        s.grads.copy_(local)
        grad = s.grads.to(high)
    elif s.stage == 1:
        s.grads.copy_(local)  # P_os keeps the whole gradient...
        mean = torch.empty(s.padded // s.n_d, dtype=low)
        comm.reduce_scatter(mean, s.grads, op="avg")  # ...but only its partition's mean is needed
        grad = mean.to(high)
    else:
        comm.reduce_scatter(s.grads, local, op="avg")  # P_g: only the partition is kept
        grad = s.grads.to(high)
    del local
    adam_update(s.master, s.exp_avg, s.exp_avg_sq, grad, s.step, lr)
    if s.stage == 0 or s.stage == 3:
        s.params.copy_(s.master.to(low))
    else:
        comm.all_gather(s.params, s.master.to(low).contiguous())
    return float(loss.detach())
