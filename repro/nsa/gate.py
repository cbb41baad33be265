"""The gate (yuan2025nsa §3.2, Eq. 5): o = g_cmp o_cmp + g_slc o_slc + g_win o_win, the three branch
outputs mixed by the per-head sigmoid gates (computed from the input by the layer, ``layer.NSA``).

:func:`gated_sum_fused` does it in one Triton kernel: one read of each branch's output and the gates
and one write, summed in fp32 and rounded once, where the five PyTorch ops (three products, two sums
over [B, T, HQ, D] tensors) also read and write four intermediates. ``Switches.fused_gate`` chooses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.nsa.common import check_gates, interpreting
from repro.nsa.config import Switches


@triton.jit
def _gate_sum_kernel(G, A, B, C, O, ROWS, D: tl.constexpr, BR: tl.constexpr):
    # Eq. 5 for BR rows (a row: one query head at one position): o = g0 a + g1 b + g2 c with the
    # row's three gates G [ROWS, 3], summed in fp32 and rounded once (one read of each branch's
    # output and one write, where the five PyTorch ops read and write four intermediates as well)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < ROWS
    r64 = rows.to(tl.int64)
    off = r64[:, None] * D + tl.arange(0, D)[None, :]
    g0 = tl.load(G + r64 * 3, mask=ok, other=0.0).to(tl.float32)[:, None]
    g1 = tl.load(G + r64 * 3 + 1, mask=ok, other=0.0).to(tl.float32)[:, None]
    g2 = tl.load(G + r64 * 3 + 2, mask=ok, other=0.0).to(tl.float32)[:, None]
    a = tl.load(A + off, mask=ok[:, None], other=0.0).to(tl.float32)
    b = tl.load(B + off, mask=ok[:, None], other=0.0).to(tl.float32)
    c = tl.load(C + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(O + off, (g0 * a + g1 * b + g2 * c).to(O.dtype.element_ty), mask=ok[:, None])


def gated_sum(
    gates: torch.Tensor,
    o_cmp: torch.Tensor,
    o_slc: torch.Tensor,
    o_win: torch.Tensor,
    switches: Switches | None = None,
) -> torch.Tensor:
    """Eq. 5: ``g_cmp o_cmp + g_slc o_slc + g_win o_win`` with gates [B, T, HQ, 3] and outputs
    [B, T, HQ, D]: the fused kernel (``Switches.fused_gate``, D a power of two), else five PyTorch ops
    in the outputs' dtype."""
    d = o_cmp.shape[-1]
    if (switches or Switches()).fused_gate and d > 0 and not d & (d - 1):
        return gated_sum_fused(gates, o_cmp, o_slc, o_win)
    g = gates.to(o_cmp.dtype)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


def gated_sum_fused(
    gates: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor
) -> torch.Tensor:
    """Eq. 5's gated sum in one Triton kernel (fp32 sum, one rounding to the outputs' dtype);
    differentiable in the gates and the three outputs (the backward in PyTorch). Shapes as
    :func:`gated_sum`; D a power of two."""
    check_gates("gated_sum_fused", gates, (*o_cmp.shape[:-1], 3), "[B, T, HQ, 3]")
    for name, x in (("o_slc", o_slc), ("o_win", o_win)):
        if x.shape != o_cmp.shape or x.dtype != o_cmp.dtype:
            raise ValueError(
                f"gated_sum_fused: {name} must match o_cmp ({tuple(o_cmp.shape)}, {o_cmp.dtype}), "
                f"got {tuple(x.shape)}, {x.dtype}"
            )
    d = o_cmp.shape[-1]
    if d & (d - 1):
        raise ValueError(f"gated_sum_fused: head dim {d} is not a power of two")
    return _GatedSum.apply(gates, o_cmp, o_slc, o_win)


class _GatedSum(torch.autograd.Function):
    """The fused gated sum; its backward in PyTorch (three products and three row sums)."""

    @staticmethod
    def forward(ctx, gates, a, b, c):
        gates, a, b, c = (x.contiguous() for x in (gates, a, b, c))
        o = torch.empty_like(a)
        rows, d = a.numel() // a.shape[-1], a.shape[-1]
        br = 16 if interpreting() else max(1, 2048 // d)  # 2048 elements a program: 16 per thread
        _gate_sum_kernel[(triton.cdiv(rows, br),)](gates, a, b, c, o, rows, D=d, BR=br, num_warps=4)
        ctx.save_for_backward(gates, a, b, c)
        return o

    @staticmethod
    def backward(ctx, do):
        gates, a, b, c = ctx.saved_tensors
        g = gates.to(do.dtype)
        grads = [g[..., i : i + 1] * do for i in range(3)]
        dg = torch.stack(gate_grads(do, (a, b, c)), -1).to(gates.dtype)
        return (dg, *grads)


def gate_grads(do: torch.Tensor, outputs) -> list[torch.Tensor]:
    """dL/dg for each branch output x: rowsum(dO * x) in fp32, [B, T, HQ]. dO is converted to fp32
    once and each x promoted inside its product (exactly, as ``x.float()`` would): the same bits as
    ``(do.float() * x.float()).sum(-1)``, with five launches and five [B, T, HQ, D] fp32 temporaries
    fewer (``test_gate_grads_are_the_fp32_formula``)."""
    do32 = do.float()
    return [(do32 * x).sum(-1) for x in outputs]
