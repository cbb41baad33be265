"""FlashAttention-4's algorithmic ideas (zadouri2026flashattention4) in Triton and Gluon attention kernels
for Hopper.

    from repro.fa4 import attention
    out = attention(q, k, v, causal=True)                      # [B, S, H, D], bf16 / fp16, D 1..256
    out = attention(q, k, v, window=(1023, 0))                 # flash-attn's sliding window
    out = attention(q, k, v, lazy_rescale=False, soft_exp=2)   # ablation switches

The entry points and the dispatch are in :mod:`repro.fa4.api` (read it first); the kernels in one
file per stage: ``triton_fwd`` and ``gluon_fwd`` (forward), ``gluon_bwd``, ``triton_bwd_fused`` and
``triton_bwd`` (backward); ``reference`` is the ground truth; ``lab/`` holds the tuning, compile
reports and GPU diagnosis, never imported by the kernels.
"""

from repro.fa4.api import (
    TEST_HEAD_DIMS,  # noqa: F401 (repro.usp imports it from here)
    Switches,
    attention,
    attention_any_d,
    attention_backward,
    attention_forward,
    auto_backward,
    auto_forward,
    forward_with_counts,
)

__all__ = [
    "Switches",
    "attention",
    "attention_any_d",
    "attention_backward",
    "attention_forward",
    "auto_backward",
    "auto_forward",
    "forward_with_counts",
]
