"""Reduce-scatter among the GPUs of one host: rank r ends with slice r of the op over all ranks' inputs.

The algorithms (``CudaPeerBackend.reduce_scatter(algorithm=...)``):

* ``direct`` and ``ring``: the all-reduce kernels ``two_shot`` and ``ring`` of ``all_reduce.py``
  stopped after their reduce half (``GATHER=False``);
* ``pipelined``: reduce-scatter by writing, in steps (the kernel below): program b pushes step
  c + 1 of slice p to peer p while it reduces step c from its slots, the same remote bytes and
  the same rank-order reduction as ``direct``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoparallel.cuda.all_reduce import (
    _launch_pipelined,
    _reduce_slots,
    ring_all_reduce_kernel,
    two_shot_all_reduce_kernel,
)
from nanoparallel.cuda.partition import STEP_BYTES, ring_barriers
from nanoparallel.cuda.primitives import _barrier, _step


@triton.jit
def _push_slices(inp, buf, D, S, m, lo, hi, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Slice p of inp, elements [lo, hi), into slot RANK of peer p's buffer, for every peer p:
    each peer gets only the slice it owns (reduce-scatter), my own slice is never staged."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        for p in tl.static_range(W):
            if p != RANK:
                x = tl.load(inp + p * m + offs, mask=mask)
                tl.store(buf + D[p] + RANK * S + offs, x, mask=mask)


@triton.jit(do_not_specialize=["epoch", "max_spins", "steps"])
def reduce_scatter_pipelined_kernel(
    inp, out, buf, D, flags, F, err, m, S, chunk, sub, steps, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Reduce-scatter by writing, in ``steps`` steps of ``sub`` elements per program, one barrier each.

    inp: [W*m], slice p = [p*m, (p+1)*m) is what rank p ends with; out: [m]; buf: W slots of S
    elements (S >= m; slot RANK unused: my own term is read from my slice of inp). The direct kernel
    (two_shot with GATHER=False) copies all W slices into its buffer, meets once, then reads; here
    program b pushes step c + 1 of slice p to peer p before it reduces step c from its slots
    (released by the barrier of step c), as one_shot_pipelined does for the all-reduce, so the
    NVLink stores of one step overlap the local reduction of the previous one. Same remote bytes,
    (W-1) m per rank, and the same rank-order reduction as the direct kernel (the same bits).
    ``steps`` is the same on every program and rank (barriers epoch+1 .. epoch+steps).
    """
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, m)
    f_lo, f_hi = _step(lo, hi, sub, 0)
    _push_slices(inp, buf, D, S, m, f_lo, f_hi, RANK, W, BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for c in range(steps):
        if c + 1 < steps:
            n_lo, n_hi = _step(lo, hi, sub, c + 1)
            _push_slices(inp, buf, D, S, m, n_lo, n_hi, RANK, W, BLOCK)
        s_lo, s_hi = _step(lo, hi, sub, c)
        _reduce_slots(inp + RANK * m, out, buf, S, s_lo, s_hi, OP, RANK, W, BLOCK)
        if c + 1 < steps:
            _barrier(flags, F, err, epoch + 2 + c, max_spins, RANK, W)


# -- the host side: CudaPeerBackend.reduce_scatter is ``reduce_scatter`` (bound in backend.py) -------


def reduce_scatter(
    be, output: torch.Tensor, input: torch.Tensor, op: str = "sum", algorithm: str = "auto"
) -> torch.Tensor:
    """output <- slice ``rank`` of op over ranks of input. input: [W*m], output: [m]."""
    what = "reduce_scatter"
    be._check_sharded(what, output, input, "input")
    W = be.world_size
    code = be._op(what, op, input.dtype)
    elem = input.element_size()
    algorithm = be._algorithm(what, algorithm, input.numel() * elem)
    m = output.numel()
    if m == 0:
        return output
    if W == 1:
        output.view(-1).copy_(input.view(-1))
        return output
    piece = max(be.staging_cap // elem // W // 1024 * 1024, 1024)
    if algorithm == "pipelined":
        steps = be._pipeline_steps(what, input.numel() * elem, algorithm)
        inp, out = input.view(W, m), output.view(-1)
        for start in range(0, m, piece):
            k = min(piece, m - start)
            src = inp[:, start : start + k]
            src = src if src.is_contiguous() else src.contiguous()  # [W, k]: slice stride k
            # src [W*k] (slice p at p*k), dst [k]
            _launch_pipelined(
                be, reduce_scatter_pipelined_kernel, src, out[start : start + k], k, code, steps
            )
        be._after(what)
        return output
    kernel = two_shot_all_reduce_kernel if algorithm == "direct" else ring_all_reduce_kernel
    barriers = 1 if algorithm == "direct" else ring_barriers(W, False)
    if m <= piece:  # the common case: hand the tensors over as they are (host time matters)
        buf, epoch = be._next(W * m * elem, barriers)
        chunk, grid = be._chunk(m, elem)
        be._launch(kernel, grid, (
            input, output, buf.view(input.dtype), buf.deltas(input.dtype), *be._sync, W * m, m, chunk, epoch,
            be.max_spins, code, be.rank, W, STEP_BYTES // elem, False,
        ))  # fmt: skip
        be._after(what)
        return output
    inp, out = input.view(W, m), output.view(-1)
    for start in range(0, m, piece):
        k = min(piece, m - start)
        # the kernel wants the W slices of this piece side by side: [W, k] contiguous
        src = inp[:, start : start + k]
        src = src if src.is_contiguous() else src.contiguous()
        dst = out[start : start + k]
        buf, epoch = be._next(W * k * elem, barriers)
        chunk, grid = be._chunk(k, elem)
        be._launch(kernel, grid, (
            src, dst, buf.view(input.dtype), buf.deltas(input.dtype), *be._sync, W * k, k, chunk, epoch,
            be.max_spins, code, be.rank, W, STEP_BYTES // elem, False,
        ))  # fmt: skip
    be._after(what)
    return output
