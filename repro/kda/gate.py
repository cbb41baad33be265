"""The forget gate's log-decay ``g`` (``alpha = exp(g)``, kimiteam2025kimilinear §3): the range the
Triton kernels compute exactly, and chunk_kda's check of it.

The kernels factor ``exp(G_r - G_c)`` inside a chunk as ``exp(G_r - G_a) exp(G_a - G_c)`` around
an anchor row, in fp32: a per-token log-decay below -10 overflows those factors (g = -12 already
gives inf on the CPU interpreter; fla's test case with gate_logit_normalizer 0.1, g down to about
-40, gave inf on an H100). flash-linear-attention accepts such gates; we refuse them rather than
return inf. The gate's parameterisation (the model's low-rank projection and its activation) is a
layer's business, not the operator's: chunk_kda takes the log-decay itself, as fla's chunk_kda does.
"""

from __future__ import annotations

import torch

G_MIN = -10.0


class DecayCheck:
    """chunk_kda's range check of g without a pass or a stall of its own: the intra-chunk kernel
    adds the number of out-of-range log-decays to ``count``; right after that launch ``counted``
    queues a copy of the count to pinned host memory and records an event; ``raise_if_bad``, called
    once every forward kernel is queued, waits for that event only (the GPU goes on with the rest
    of the forward meanwhile) and raises :func:`check_decay_range`'s error (exact min and max) if
    any value was out of range. The outputs of such a call are never returned.

    Why not ``torch.aminmax`` over g before the kernels: that first form (a reduction, then a
    device-to-host copy) cost 0.31 ms of 1.29 ms in the forward at B=8, T=2048 and 0.57 of 5.0 ms at
    T=64k on an H100 (bench --tune, 2026-11-25, results/nvidia-h100-80gb-hbm3-tune-decay-check.json):
    a pass over g and a synchronisation that left the GPU idle while the host launched the forward's
    kernels. ``KDAConfig.check_decay_range = False`` skips the check where the gates are bounded
    by construction."""

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

    def raise_if_bad(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            n_bad = int(self._host[0])
        else:
            n_bad = int(self.count[0])
        if n_bad:
            check_decay_range(self.g, self.fn)  # raises, naming the range found
            raise ValueError(f"{self.fn}: {n_bad} log-decays of g outside [{G_MIN:g}, 0] or NaN")


def check_decay_range(g: torch.Tensor, fn: str) -> None:
    """Raise unless every log-decay is in ``[G_MIN, 0]`` (NaN fails too). One reduction and one
    device-to-host copy per call: microseconds beside the kernels, but a synchronisation."""
    if g.numel() == 0:
        return
    lo, hi = torch.aminmax(g.detach())
    lo, hi = float(lo), float(hi)
    if not (lo >= G_MIN and hi <= 0.0):
        raise ValueError(
            f"{fn}: g (log-decay, g.shape {tuple(g.shape)}) must lie in [{G_MIN:g}, 0] per token and channel "
            f"for the Triton kernels (alpha = exp(g) in [4.5e-5, 1]); got min {lo:.4g}, max {hi:.4g}. "
            "Clamp stronger decays (alpha < 4.5e-5 forgets within a token anyway), or use recurrent_kda"
        )
