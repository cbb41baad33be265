"""Shared fixtures: one small pre-trained policy for the whole session, one intra-op thread.

On a loaded 2-core machine PyTorch's intra-op thread pool spins against the actor and trainer
threads (a 40 ms step becomes 1.5 s), so the tests run every op on one thread."""

from __future__ import annotations

import pytest
import torch

from repro.pipelinerl.model import TINY_MODEL, Policy, flat_weights, pretrain
from repro.pipelinerl.task import TINY_TASK

torch.set_num_threads(1)

# the tests' task and policy (the lab's too): defined in the product modules
TASK = TINY_TASK
MODEL = TINY_MODEL


@pytest.fixture(scope="session")
def pretrained() -> torch.Tensor:
    """Flat weights of a tiny policy pre-trained a little (non-zero, imperfect reward)."""
    torch.manual_seed(0)
    model = Policy(MODEL)
    pretrain(model, TASK, steps=60, batch=32, lr=1e-2, noise=0.2, seed=0)
    return flat_weights(model)
