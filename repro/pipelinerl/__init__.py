"""PipelineRL (piche2025pipelinerl): in-flight weight updates for on-policy RL, a real small run and a simulator.

Public API:

* :func:`run` (:class:`Config`) -> :class:`RunResult`: actors (KV-cache engines taking new weights
  mid-sequence) and a trainer (truncated importance-weighted policy gradient, ESS) running
  concurrently in ``pipeline``, ``async`` or ``conventional`` mode, weights sent by
  ``torch.distributed`` broadcast. ``python -m repro.pipelinerl.train`` is its command line.
* ``python3 -m torch.distributed.run --nproc-per-node N -m repro.pipelinerl.launch --trainers T ...``
  (:mod:`launch`): the same modes with actors and trainers in their own processes, one per GPU (NCCL),
  or CPU processes with gloo; ``gpu_plan.sh`` runs the placements 1+1, 1+3 and 2+2 on a GPU machine
  and :mod:`plan` reports them beside the simulator's predictions.
* :func:`simulate` (:class:`SimConfig`) -> :class:`SimResult`: the discrete-event simulator of the
  same three modes, with time models fitted to real runs (:func:`fit_time_model`).
* :mod:`reference`: the objective, ESS, lags and cache-free generation in plain PyTorch.
"""

from __future__ import annotations

from repro.pipelinerl.model import ModelConfig, Policy
from repro.pipelinerl.pipeline import MODES, Config, RunResult, run
from repro.pipelinerl.sim import SimConfig, SimResult, TimeModel, fit_time_model, simulate
from repro.pipelinerl.task import TaskConfig

__all__ = [
    "MODES",
    "Config",
    "ModelConfig",
    "Policy",
    "RunResult",
    "SimConfig",
    "SimResult",
    "TaskConfig",
    "TimeModel",
    "fit_time_model",
    "run",
    "simulate",
]
