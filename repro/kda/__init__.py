"""Kimi Delta Attention (kimiteam2025kimilinear): reference recurrence, chunkwise PyTorch, Triton kernels.

Public API, in flash-linear-attention's conventions (``[B, T, H, D]`` layout, log-space gates):

* :func:`chunk_kda` (q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
  cu_seqlens=None, *, config=None): the chunkwise-parallel Triton kernels, differentiable; the
  kernel choices are one frozen :class:`KDAConfig`.
* :func:`recurrent_kda`, same arguments: the token-by-token recurrence (PyTorch, fp32/fp64).
* :func:`decode_step` (q, k, v, g, beta, state, scale=None): one token with a Triton kernel,
  updating the fp32 state in place.
* :func:`chunk_kda_torch`: the chunkwise form in readable PyTorch (any chunk size).

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with HV a multiple of H (value head j
reads key head ``j // (HV // H)``); g ``[B, T, HV, K]`` log-decay (``alpha = exp(g)``);
beta ``[B, T, HV]``; states ``[B, HV, K, V]``. Outputs ``o [B, T, HV, V]`` and the final state.
"""

from __future__ import annotations

import torch

from paperclub.triton_compat import patch_interpreter
from repro.kda.chunk import chunk_kda
from repro.kda.chunk_torch import chunk_kda_torch, ut_transform
from repro.kda.config import KDAConfig
from repro.kda.decode import decode_step
from repro.kda.reference import kda_recurrence

patch_interpreter()  # bf16 (and run-time loop bounds) right under the CPU interpreter

__all__ = ["KDAConfig", "chunk_kda", "chunk_kda_torch", "decode_step", "recurrent_kda", "ut_transform"]


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA token by token (the reference recurrence of §3); arguments as :func:`chunk_kda`.

    Returns o ``[B, T, HV, V]`` in v's dtype and the final state ``[B, HV, K, V]`` (fp32, or
    fp64 for fp64 inputs) or None.
    """
    return kda_recurrence(q, k, v, g, beta, scale, initial_state, output_final_state)
