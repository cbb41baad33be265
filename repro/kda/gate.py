"""The forget gate's log-decay ``g`` (``alpha = exp(g)``, kimiteam2025kimilinear §3): the range the
Triton kernels compute exactly, and how chunk_kda takes every ``g <= 0`` beyond it.

The kernels factor ``exp(G_r - G_c)`` inside a chunk as ``exp(G_r - G_a) exp(G_a - G_c)`` around
an anchor row, in fp32: a per-token log-decay below ``G_MIN = -10`` can overflow those factors
(g = -12 already gave inf on the CPU interpreter; fla's test case with gate_logit_normalizer 0.1, g
down to about -40, gave inf on an H100). Such a decay forgets within the token: chunk_kda clamps it
to ``G_MIN`` (:func:`clamp_decay`) instead of refusing it, with the error bound below. The gate's
parameterisation (the model's low-rank projection and its activation) is a layer's business, not
the operator's: chunk_kda takes the log-decay itself, as fla's chunk_kda does.

**The clamp's error bound.** Let ``c = -G_MIN = 10``. Clamping replaces a decay factor
``alpha_{t,j} = exp(g_{t,j}) < e^{-c}`` by ``e^{-c}``: it changes that factor by less than
``e^{-c} = 4.54e-5``, and only where the exact recurrence already keeps less than ``e^{-c}`` of
channel j's memory. Write the step as ``S_t = M_t S_{t-1} + beta_t k_t v_t^T`` with
``M_t = (I - beta_t k_t k_t^T) Diag(alpha_t)``; for ``beta_t in [0, 1]`` and ``||k_t||_2 = 1``
(KDA L2-normalises k) ``||I - beta_t k_t k_t^T||_2 <= 1`` and ``||Diag(alpha_t)||_2 <= 1``, so every
step is non-expansive. The clamped state ``S'`` then differs from the exact one by

    E_t = S'_t - S_t = M'_t E_{t-1} + (I - beta_t k_t k_t^T)(Diag(alpha'_t) - Diag(alpha_t)) S_{t-1},
    ||E_t||_F <= ||E_{t-1}||_F + e^{-c} ||P_t S_{t-1}||_F,

with ``P_t`` the projection on the channels clamped at token t. Hence, for every t,

    ||S'_t - S_t||_F <= e^{-c} sum_{s <= t} ||P_s S_{s-1}||_F,
    ||o'_t - o_t||_2 <= scale ||q_t||_2 e^{-c} sum_{s <= t} ||P_s S_{s-1}||_F,

where ``S`` is the exact (unclamped) state: each clamped decay adds at most ``e^{-c}`` of the
memory it was about to erase. (In practice a channel clamped at every token keeps its error near
``e^{-c} ||S||``: each clamp also decays the earlier error by ``e^{-c}``; the sum is the guarantee.)
The gradient of the clamped entries of g is zero (``torch.clamp``'s); the exact one is
``alpha dL/dalpha``, smaller than ``e^{-c} |dL/dalpha|``. ``e^{-10}`` is below the unit roundoff of
bf16 (``2^-8``) and fp16 (``2^-11``): for 16-bit inputs the clamp is invisible beside the inputs'
own rounding. For fp32 inputs it is not (``2^-24``): a stated, bounded approximation there (use
:func:`~repro.kda.recurrent_kda` for exact fp32 with decays below -10).
tests/test_decay_clamp.py checks the bound against the unclamped recurrence in fp64.
"""

from __future__ import annotations

import torch

G_MIN = -10.0


class DecayCheck:
    """chunk_kda's range check of g without a pass or a stall of its own: the intra-chunk kernel
    adds the number of out-of-range log-decays to ``count``; right after that launch ``counted``
    queues a copy of the count to pinned host memory and records an event; ``out_of_range``, called
    once every forward kernel is queued, waits for that event only (the GPU goes on with the rest
    of the forward meanwhile) and says whether any value was out of range. If so, chunk_kda
    refuses what it cannot take (``g > 0`` or NaN: :func:`check_decay_sign`'s error, naming the
    range found) and runs the forward again on :func:`clamp_decay`'s g; the outputs of the first
    forward are never returned. Inputs inside ``[G_MIN, 0]`` cost nothing more than the count: no
    kernel changed for the clamp (the compiled code is main's, lab/ptx_snapshot.py).

    Why not ``torch.aminmax`` over g before the kernels: that first form (a reduction, then a
    device-to-host copy) cost 0.31 ms of 1.29 ms in the forward at B=8, T=2048 and 0.57 of 5.0 ms at
    T=64k on an H100 (bench --tune, 2026-11-25, results/nvidia-h100-80gb-hbm3-tune-decay-check.json):
    a pass over g and a synchronisation that left the GPU idle while the host launched the forward's
    kernels. ``KDAConfig.check_decay_range = False`` skips the count (and so the clamp) where the gates
    are bounded by construction; ``KDAConfig.clamp_decay_first = True`` clamps before the kernels
    (one elementwise pass over g) where they are known to go below G_MIN, instead of a second
    forward."""

    def __init__(self, g: torch.Tensor, fn: str):
        self.g, self.fn = g, fn
        self.count = torch.zeros(1, dtype=torch.int32, device=g.device)
        self._host: torch.Tensor | None = None
        self._event = None

    def counted(self) -> None:
        if self.count.is_cuda:
            self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._host.copy_(self.count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def out_of_range(self) -> int:
        """How many log-decays the kernel counted outside ``[G_MIN, 0]`` (or NaN); waits for the
        count only."""
        if self._event is not None:
            self._event.synchronize()
            return int(self._host[0])
        return int(self.count[0])


def clamp_decay(g: torch.Tensor) -> torch.Tensor:
    """``max(g, G_MIN)``: the log-decays the kernels compute exactly; the identity on
    ``[G_MIN, 0]`` (the error bound of the clamp is in the module docstring). Differentiable: the
    clamped entries get a zero gradient."""
    return g.clamp(min=G_MIN)


def check_decay_sign(g: torch.Tensor, fn: str) -> None:
    """Raise unless every log-decay is ``<= 0`` (NaN fails too): a log-decay above 0 grows the
    state (``alpha > 1``), which KDA's gate never gives. One reduction and one device-to-host copy,
    run only when the kernel's count found something out of range."""
    if g.numel() == 0:
        return
    lo, hi = torch.aminmax(g.detach())
    lo, hi = float(lo), float(hi)
    if not hi <= 0.0 or lo != lo:
        raise ValueError(
            f"{fn}: g (log-decay, g.shape {tuple(g.shape)}) must be <= 0 per token and channel "
            f"(alpha = exp(g) in [0, 1]; below {G_MIN:g} it is clamped to {G_MIN:g}, error bound in "
            f"repro/kda/gate.py); got min {lo:.4g}, max {hi:.4g}"
        )
