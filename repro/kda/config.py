"""The kernel choices of chunk_kda as one frozen object: passed to chunk_kda, saved for its backward.

Nothing else chooses a code path: no module setting read at call time, no environment variable
(except Triton's own ``TRITON_INTERPRET``: its CPU interpreter cannot run inline PTX, so the ftz
exponentials are on exactly when the kernels are compiled for a GPU). Sweeps and tests build
configs, ``dataclasses.replace(KDAConfig(), wy_warps=4)``; the defaults are the tuned values, whose
reasons and measurements sit beside each stage's launcher (intra_chunk.py, wy_ut.py,
inter_chunk.py, output.py, backward_inter_chunk.py, backward_intra_chunk.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from repro.kda.backward_inter_chunk import STATE_BWD_STAGES, STATE_BWD_WARPS
from repro.kda.backward_intra_chunk import (
    DQK_BK,
    DQK_BV,
    DQK_STAGES,
    DQK_WARPS,
    MAT_BK,
    MAT_BV,
    MAT_STAGES,
    MAT_WARPS,
)
from repro.kda.inter_chunk import STATE_FWD_STAGES, STATE_FWD_WARPS
from repro.kda.intra_chunk import INTRA_BK, INTRA_STAGES, INTRA_WARPS
from repro.kda.output import OUT_BV, OUT_WARPS
from repro.kda.wy_ut import WY_BK, WY_BV, WY_WARPS

# The products of the fp32 intra-chunk and state algebra for 16-bit inputs: "tf32" (tensor cores,
# 10-bit mantissa), "tf32x3" (three tf32 products, about fp32 accuracy) or "ieee" (fp32 FMA, slow);
# fp32 inputs always take "ieee" (the tests compare them with fp64 at ~1e-5). Measured on an H100
# (2026-11-25, fla's test_chunk inputs, RMS error against fp64, ours / fla 0.6.0's on the same
# inputs, results/nvidia-h100-80gb-hbm3-gpu-matrix.jsonl): with tf32 everywhere, bf16 errors equal
# fla's (the inputs' 2^-8 rounding dominates), but fp16 ones were 4-13x fla's once the gates are
# mild (normaliser 10: the chunk's triangular solve is ill-conditioned and amplifies the products'
# rounding), e.g. dh0 8.2e-3 vs 1.0e-3 and the final state 6.0e-3 vs 4.5e-4, over fla's
# tolerances. fp16's inputs round at 2^-11, as tf32 does: its products need more than tf32; bf16's
# do not.
DOT_PRECISIONS = ("tf32", "tf32x3", "ieee")
_POWERS_OF_TWO = (16, 32, 64, 128)
_WARPS = (1, 2, 4, 8, 16)
_BOOLS = ("check_decay_range", "clamp_decay_first", "large_head_state")
# blocks that may be None: the launcher's rule (value blocks) or the one-tile state (key blocks)
_OPTIONAL_BLOCKS = ("state_fwd_bv", "state_fwd_bk", "state_bwd_bv", "state_bwd_bk")

# The state recurrences' launches at kernel key size 256 (head sizes 129-256) for bf16 inputs,
# where ``large_head_state`` is on and a pass's four state fields are at their defaults: [K, BV] held
# as key tiles (inter_chunk.kda_state_fwd_split_kernel, backward_inter_chunk.kda_state_bwd_split_kernel).
# On an H200 (2026-11-29, lab/tuning.py tune --head-size 256 --only 'state-*', B = 8, T = 2k, H = 16,
# K = V = 256, bf16, 3 interleaved rounds, results/nvidia-h200-tune-d256-state.json) against the
# one-tile kernels: forward 2.165 ms against 2.463 (tiles of 64 keys, value block 32, 4 warps, 2
# stages; the other five forward candidates 2.32-2.62 ms), forward + backward 11.34 ms against 12.87
# (backward tiles of 128 keys, value block 32, 8 warps, 2 stages; at 1 stage 12.04, the 64-key
# candidates 12.73-12.74). bf16 only: fp16's products are tf32x3 (dot_prec_fp16), with which the
# two-stage split backward needs 275,456 bytes of shared memory, over Hopper's 232,448 (Triton's
# OutOfResources on an H200, fla's D = 256 fp16 cases, 2026-11-29); fp16 and fp32 (the tests' exact
# path) keep the one-tile kernels, and so does bf16 with dot_prec_bf16 other than tf32. Beside fla 0.6.0 (B = 2, T = 8k, H = 16, K = V = 256, bf16, same
# rounds, results/nvidia-h200-gates-d256.json): forward 2.167 against 1.966 ms (0.91x fla's speed,
# was 0.80x), forward + backward 11.05 against 10.68 ms (0.97x, was 0.83x).
LARGE_HEAD_STATE_FWD = dict(state_fwd_bk=64, state_fwd_bv=32, state_fwd_warps=4, state_fwd_stages=2)
LARGE_HEAD_STATE_BWD = dict(state_bwd_bk=128, state_bwd_bv=32, state_bwd_warps=8, state_bwd_stages=2)


@dataclass(frozen=True)
class KDAConfig:
    """Kernel choices of :func:`repro.kda.chunk_kda` (defaults: the tuned values).

    check_decay_range: count the log-decays outside ``[-10, 0]`` in the intra-chunk kernel
        (gate.DecayCheck): any above 0 or NaN are refused, any below -10 are clamped to -10 and the
        forward runs again (error bound in gate.py); False where the gates are in ``[-10, 0]`` by
        construction (nothing counted, nothing clamped: below -10 the kernels overflow).
    clamp_decay_first: clamp g to ``>= -10`` before the kernels (one elementwise pass over g)
        rather than on demand (a second forward when the count finds any below -10): for gates
        known to go below -10.
    dot_prec_bf16, dot_prec_fp16: precision of the fp32 products for bf16 / fp16 inputs, one of
        DOT_PRECISIONS.
    intra_bk, intra_warps, intra_stages: the intra-chunk kernel's key block, warps, pipelining.
    wy_bk, wy_bv, wy_warps: the WY kernel's key and value blocks and warps.
    state_fwd_bv: the forward state recurrence's value block (None: by the number of programs,
        inter_chunk.state_block_v); state_fwd_warps its warps.
    state_fwd_bk: how the forward state recurrence holds its ``[K, BV]`` block: None (default) as
        one tile (inter_chunk.kda_state_fwd_kernel); 16 to 128 as ``K / bk`` tiles of ``bk`` key
        rows, at most 4 (inter_chunk.kda_state_fwd_split_kernel; issue #42, 64 at K = 256 as
        fla), whose chunk loop has state_fwd_stages pipeline stages (unused by the one-tile kernel).
    out_bv, out_warps: the output kernel's value block and warps.
    state_bwd_bv, state_bwd_warps: the same for the state backward (at value block 16 it always
        takes 4 warps: backward_inter_chunk.STATE_BWD_WARPS_BV16); state_bwd_bk, state_bwd_stages
        its layout as state_fwd_bk's (None: one tile, backward_inter_chunk.kda_state_bwd_fused_kernel;
        else backward_inter_chunk.kda_state_bwd_split_kernel).
    large_head_state: at kernel key size 256 (head sizes 129-256) with bf16 inputs and their default
        tf32 products, a pass
        whose four state fields (``state_fwd_*``, or ``state_bwd_*``) are all at their defaults runs
        the split launch tuned there (LARGE_HEAD_STATE_FWD / _BWD, with the measurement); fields set
        by the caller are used as given. False: the fields as they are at every size (the one-tile
        kernels at their defaults). See :meth:`for_launch`.
    bwd_mat_bk, bwd_mat_bv, bwd_mat_warps, bwd_mat_stages: the backward's [BT, BT] gradient
        kernel; bwd_dqk_bk, bwd_dqk_bv, bwd_dqk_warps, bwd_dqk_stages: its per-channel kernel.
    Blocks are 16, 32, 64 or 128 (taken as min(block, head size)).
    """

    check_decay_range: bool = True
    clamp_decay_first: bool = False
    dot_prec_bf16: str = "tf32"
    dot_prec_fp16: str = "tf32x3"
    intra_bk: int = INTRA_BK
    intra_warps: int = INTRA_WARPS
    intra_stages: int = INTRA_STAGES
    wy_bk: int = WY_BK
    wy_bv: int = WY_BV
    wy_warps: int = WY_WARPS
    state_fwd_bv: int | None = None
    state_fwd_warps: int = STATE_FWD_WARPS
    state_fwd_bk: int | None = None
    state_fwd_stages: int = STATE_FWD_STAGES
    out_bv: int = OUT_BV
    out_warps: int = OUT_WARPS
    state_bwd_bv: int | None = None
    state_bwd_warps: int = STATE_BWD_WARPS
    state_bwd_bk: int | None = None
    state_bwd_stages: int = STATE_BWD_STAGES
    large_head_state: bool = True
    bwd_mat_bk: int = MAT_BK
    bwd_mat_bv: int = MAT_BV
    bwd_mat_warps: int = MAT_WARPS
    bwd_mat_stages: int = MAT_STAGES
    bwd_dqk_bk: int = DQK_BK
    bwd_dqk_bv: int = DQK_BV
    bwd_dqk_warps: int = DQK_WARPS
    bwd_dqk_stages: int = DQK_STAGES

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("dot_prec"):
                ok, expected = value in DOT_PRECISIONS, f"one of {', '.join(map(repr, DOT_PRECISIONS))}"
            elif f.name in _BOOLS:
                ok, expected = isinstance(value, bool), "True or False"
            elif f.name.endswith("warps"):
                ok, expected = value in _WARPS, f"one of {_WARPS}"
            elif f.name.endswith("stages"):
                ok, expected = isinstance(value, int) and 1 <= value <= 8, "an int from 1 to 8"
            else:  # blocks
                allowed = _POWERS_OF_TWO if f.name not in _OPTIONAL_BLOCKS else (None, *_POWERS_OF_TWO)
                ok, expected = value in allowed, f"one of {allowed}"
            if not ok or (isinstance(value, bool) and f.name not in _BOOLS):
                raise ValueError(f"KDAConfig.{f.name} = {value!r}: expected {expected}")

    def dot_precision(self, dtype: torch.dtype) -> str:
        """The ``tl.dot`` input precision of the fp32 algebra for inputs of ``dtype``."""
        if dtype == torch.float32:
            return "ieee"
        return self.dot_prec_fp16 if dtype == torch.float16 else self.dot_prec_bf16

    def for_launch(self, key_size: int, dtype: torch.dtype) -> KDAConfig:
        """The config the launches run at kernel key head size ``key_size`` and input ``dtype``: this
        one, with ``large_head_state``'s split state launches where they apply."""
        if not self.large_head_state or key_size <= 128 or dtype != torch.bfloat16:
            return self
        if self.dot_prec_bf16 != "tf32":  # tf32x3 / ieee products: the fp16 case's shared memory
            return self
        changes = {}
        for tuned in (LARGE_HEAD_STATE_FWD, LARGE_HEAD_STATE_BWD):
            if all(getattr(self, name) == getattr(DEFAULT, name) for name in tuned):
                changes.update(tuned)
        return replace(self, **changes) if changes else self


DEFAULT = KDAConfig()
