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


@triton.jit
def _gate_branch_bwd(G, X, DX, DG, do, r64, off, ok, I: tl.constexpr):
    # branch I's two gradients for BR rows: dX = g_I dO (g_I rounded to dO's dtype first, as PyTorch's
    # product of the two does) and dL/dg_I = rowsum(dO * X) in fp32
    g = tl.load(G + r64 * 3 + I, mask=ok, other=0.0).to(DX.dtype.element_ty).to(tl.float32)
    tl.store(DX + off, (g[:, None] * do).to(DX.dtype.element_ty), mask=ok[:, None])
    x = tl.load(X + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DG + r64 * 3 + I, tl.sum(do * x, axis=1).to(DG.dtype.element_ty), mask=ok)


@triton.jit
def _gate_bwd_kernel(G, A, B, C, DO, DA, DB, DC, DG, ROWS, D: tl.constexpr, BR: tl.constexpr):
    # Eq. 5's backward for BR rows: one read of dO, the gates and each branch output, one write of each
    # gradient (the PyTorch formula reads dO four times and writes three [rows, D] fp32 temporaries)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < ROWS
    r64 = rows.to(tl.int64)
    off = r64[:, None] * D + tl.arange(0, D)[None, :]
    do = tl.load(DO + off, mask=ok[:, None], other=0.0).to(tl.float32)
    _gate_branch_bwd(G, A, DA, DG, do, r64, off, ok, 0)
    _gate_branch_bwd(G, B, DB, DG, do, r64, off, ok, 1)
    _gate_branch_bwd(G, C, DC, DG, do, r64, off, ok, 2)


def _rows_per_program(d: int) -> int:
    return 16 if interpreting() else max(1, 2048 // d)  # 2048 elements a program: 16 per thread


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
    differentiable in the gates and the three outputs (the backward one kernel too). Shapes as
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
    """The fused gated sum; its backward one Triton kernel too (:func:`gated_sum_backward`)."""

    @staticmethod
    def forward(ctx, gates, a, b, c):
        gates, a, b, c = (x.contiguous() for x in (gates, a, b, c))
        o = torch.empty_like(a)
        rows, d = a.numel() // a.shape[-1], a.shape[-1]
        br = _rows_per_program(d)
        _gate_sum_kernel[(triton.cdiv(rows, br),)](gates, a, b, c, o, rows, D=d, BR=br, num_warps=4)
        ctx.save_for_backward(gates, a, b, c)
        return o

    @staticmethod
    def backward(ctx, do):
        return gated_sum_backward(do, *ctx.saved_tensors)


def gated_sum_backward(do, gates, a, b, c) -> tuple[torch.Tensor, ...]:
    """Eq. 5's backward in one kernel: (d gates, d a, d b, d c) with d x_i = g_i dO in dO's dtype and
    d g_i = rowsum(dO * x_i) in fp32, then the gates' dtype. The branch gradients are bit for bit
    :func:`gated_sum_backward_torch`'s, the gates' its fp32 sums in another order
    (``test_gate_backward_kernel_equals_the_torch_formula``). At the paper's shape it is one read of
    dO, the gates and the three outputs and one write of each gradient: the PyTorch formula took 1.8 ms
    of the 16.5 ms backward at 8k on an H200 (``lab/breakdown.py --pass bwd``)."""
    do = do.contiguous()
    rows, d = do.numel() // do.shape[-1], do.shape[-1]
    da, db, dc = (torch.empty_like(do) for _ in range(3))
    dg = torch.empty_like(gates)
    br = _rows_per_program(d)
    _gate_bwd_kernel[(triton.cdiv(rows, br),)](
        gates, a, b, c, do, da, db, dc, dg, rows, D=d, BR=br, num_warps=4
    )
    return dg, da, db, dc


def gated_sum_backward_torch(do, gates, a, b, c) -> tuple[torch.Tensor, ...]:
    """The same gradients as PyTorch ops (three products and :func:`gate_grads`): the kernel's
    cross-check, and what the fused gate's backward ran before it."""
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
