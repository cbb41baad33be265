"""Bad input is refused before any work, with a message naming the argument, its value and what is
expected (no process group needed: these checks run before any communication)."""

from __future__ import annotations

import pytest
import torch

from repro.parallelism.async_tp import all_gather_matmul
from repro.parallelism.megatron import shard_weights
from repro.parallelism.pipeline import micro_sizes
from repro.parallelism.reference import init_weights, reference_layer
from repro.parallelism.rsa import ring_self_attention
from repro.parallelism.sequence_parallel import shard_sequence
from repro.parallelism.zero import model_state_bytes, zero_init


def test_tensor_parallel_sizes():
    w = init_weights(12, seed=0)
    with pytest.raises(ValueError, match=r"heads a=3 is not divisible by the tensor-parallel size t=2"):
        shard_weights(w, heads=3, rank=0, t=2)
    with pytest.raises(ValueError, match=r"hidden size h=12 is not divisible by heads a=5"):
        shard_weights(w, heads=5, rank=0, t=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_weights(w, heads=4, rank=2, t=2)
    with pytest.raises(ValueError, match=r"h=12 is not divisible by heads a=5"):
        reference_layer(torch.zeros(2, 1, 12, dtype=torch.float64), w, heads=5)


def test_sequence_and_matmul_shapes():
    with pytest.raises(ValueError, match=r"sequence length s=5 is not divisible by t=2"):
        shard_sequence(torch.zeros(5, 1, 4), rank=0, t=2)
    with pytest.raises(ValueError, match=r"a's last dim 3 differs from w's first dim 4"):
        all_gather_matmul(torch.zeros(2, 3), torch.zeros(4, 5), None, decomposed=True)
    with pytest.raises(ValueError, match=r"must share one shape \[B, c, H, D\]"):
        ring_self_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 3, 1, 4), torch.zeros(1, 2, 1, 4), None)


def test_zero_arguments():
    with pytest.raises(ValueError, match=r"stage must be one of \(0, 1, 2, 3\), got 4"):
        zero_init(torch.zeros(6), stage=4, rank=0, n_d=2, low=torch.bfloat16, high=torch.float32)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 3"):
        zero_init(torch.zeros(6), stage=1, rank=3, n_d=2, low=torch.bfloat16, high=torch.float32)
    with pytest.raises(ValueError, match=r"full_params must be flat \[Psi\], got shape \(2, 3\)"):
        zero_init(torch.zeros(2, 3), stage=1, rank=0, n_d=2, low=torch.bfloat16, high=torch.float32)
    with pytest.raises(ValueError, match=r"psi=7 must be a multiple of n_d=2"):
        model_state_bytes(7, 2, 1)


def test_pipeline_arguments():
    with pytest.raises(ValueError, match=r"need 1 <= m <= batch, got m=5, batch=3"):
        micro_sizes(3, 5)
