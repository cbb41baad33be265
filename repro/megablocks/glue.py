"""The dMoE's memory-bound steps around the expert GEMMs, as fused Triton kernels.

The paper's layer (gale2022megablocks §5.2) gathers each token's hidden state into its experts'
rows, runs the experts, and scatters the results back scaled by the router weights; megablocks
does the gather and the scatter with kernels of its own ("padded gather / scatter"). With PyTorch
indexing ops the same steps cost, on the benchmark's 64-expert shape, more than the difference
between the fastest expert GEMMs and ours (an ``index_add`` with atomics, separate multiplies, a
gather): the H100 profile of 2026-11-25 put about 5 ms of a 20 ms forward + backward there.

Each step here reads and writes every row once, with no atomics, given ``rows [T, k]``, the row of
the expert-sorted (padded) layout that holds assignment ``(t, j)`` (:func:`slot_rows`):

* :func:`expand` ``x [T, d] -> xs [P, d]``: ``xs[rows[t, j]] = x[t]``, padding rows zero.
  Backward: ``dx[t] = sum_j dxs[rows[t, j]]`` (a gather-sum in fp32, one program per token).
* :func:`combine` ``y [P, d], w [T, k] -> out [T, d]``: ``out[t] = sum_j w[t, j] y[rows[t, j]]``
  (fp32 accumulation). Backward: ``dy[rows[t, j]] = w[t, j] dout[t]`` and
  ``dw[t, j] = <dout[t], y[rows[t, j]]>``, both from one pass over ``dout[t]``.
* :func:`swiglu` ``silu(h1) * h3`` elementwise, forward and backward each one kernel computing in
  fp32 (one rounding of the result, where PyTorch's ``F.silu(h1) * h3`` rounds twice).

All run in Triton's CPU interpreter too (the tests); they take fp32, fp16 and bf16 inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paperclub.triton_compat import interpreting, patch_interpreter

patch_interpreter()

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _block_d(d: int) -> int:
    # the interpreter takes small blocks (several iterations of the d loop get tested); on the GPU
    # one program streams a row in 16-byte pieces per thread
    return 16 if interpreting() else min(1024, triton.next_power_of_2(d))


def _opts(num_warps: int = 4) -> dict:
    return {} if interpreting() else {"num_warps": num_warps}


def slot_rows(order: torch.Tensor, dest: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """``rows [T, k]``: the padded row of assignment ``(t, j)``, from a permutation's ``order``
    (assignment ids ``t k + j`` sorted by expert) and ``dest`` (padded row of each sorted one)."""
    rows = torch.empty(T * k, dtype=torch.int64, device=order.device)
    rows[order] = dest
    return rows.view(T, k)


def _check_rows(rows: torch.Tensor, T: int, what: str) -> None:
    if rows.dim() != 2 or rows.shape[0] != T or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{what}: rows must be an integer [T={T}, k] tensor, got {rows.dtype} {tuple(rows.shape)}"
        )


def _check_float(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in _DTYPES or t.dim() != dim:
        raise ValueError(
            f"{name} must be a {dim}-D float32/float16/bfloat16 tensor, got {t.dtype} {tuple(t.shape)}"
        )


# ------------------------------------------------------------------------------------- expand
@triton.jit
def _expand_kernel(x_ptr, rows_ptr, out_ptr, d, sx, so, K: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for d0 in range(0, d, BD):
        offs = d0 + tl.arange(0, BD)
        m = offs < d
        v = tl.load(x_ptr + t * sx + offs, mask=m)
        for j in tl.static_range(K):
            r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            tl.store(out_ptr + r * so + offs, v, mask=m)


def _expand(x: torch.Tensor, rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
    T, d = x.shape
    k = rows.shape[1]
    # rows not written by any assignment are padding: zero them (only where there are some)
    alloc = torch.zeros if padded_rows > T * k else torch.empty
    out = alloc(padded_rows, d, device=x.device, dtype=x.dtype)
    if T and d and k:
        _expand_kernel[(T,)](x, rows, out, d, x.stride(0), out.stride(0), K=k, BD=_block_d(d), **_opts())
    return out


def _gather_sum(g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    T, k = rows.shape
    d = g.shape[1]
    out = torch.empty(T, d, device=g.device, dtype=g.dtype)
    if T and d:
        if k == 0:
            return out.zero_()
        # dx[t] = sum_j dxs[rows[t, j]]: the combine with unit weights
        _combine_kernel[(T,)](
            g, rows, rows, out, d, g.stride(0), out.stride(0), K=k, BD=_block_d(d), WEIGHTED=False, **_opts()
        )
    return out


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, padded_rows):
        ctx.save_for_backward(rows)
        return _expand(x, rows, padded_rows)

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return _gather_sum(g.contiguous(), rows), None, None


def expand(x: torch.Tensor, rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """``xs [padded_rows, d]`` with ``xs[rows[t, j]] = x[t]`` and every other row zero; differentiable
    in ``x``. ``rows [T, k]`` must hold distinct rows below ``padded_rows`` (a permutation's)."""
    _check_float("expand: x", x, 2)
    _check_rows(rows, x.shape[0], "expand")
    if padded_rows < rows.numel():
        raise ValueError(f"expand: padded_rows={padded_rows} is fewer than the {rows.numel()} assignments")
    return _Expand.apply(x.contiguous(), rows.contiguous(), padded_rows)


# ------------------------------------------------------------------------------------ combine
@triton.jit
def _combine_kernel(
    y_ptr, rows_ptr, w_ptr, out_ptr, d, sy, so, K: tl.constexpr, BD: tl.constexpr, WEIGHTED: tl.constexpr
):
    """out[t] = sum_j w[t, j] y[rows[t, j]] (WEIGHTED; else the plain sum, expand's backward)."""
    t = tl.program_id(0).to(tl.int64)
    for d0 in range(0, d, BD):
        offs = d0 + tl.arange(0, BD)
        m = offs < d
        acc = tl.zeros([BD], dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            v = tl.load(y_ptr + r * sy + offs, mask=m).to(tl.float32)
            if WEIGHTED:
                v *= tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * so + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd_kernel(
    g_ptr, y_ptr, rows_ptr, w_ptr, dy_ptr, dw_ptr, d, sg, sy, sdy,
    K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, NEED_DW: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    dots = tl.zeros([KP], dtype=tl.float32)
    for d0 in range(0, d, BD):
        offs = d0 + tl.arange(0, BD)
        m = offs < d
        g = tl.load(g_ptr + t * sg + offs, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            wj = tl.load(w_ptr + t * K + j).to(tl.float32)
            tl.store(dy_ptr + r * sdy + offs, (wj * g).to(dy_ptr.dtype.element_ty), mask=m)
            if NEED_DW:
                yv = tl.load(y_ptr + r * sy + offs, mask=m, other=0.0).to(tl.float32)
                dots = tl.where(ks == j, dots + tl.sum(g * yv, axis=0), dots)
    if NEED_DW:
        tl.store(dw_ptr + t * K + ks, dots.to(dw_ptr.dtype.element_ty), mask=ks < K)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, w):
        T, k = rows.shape
        d = y.shape[1]
        out = torch.empty(T, d, device=y.device, dtype=y.dtype)
        if T and d:
            if k == 0:
                out.zero_()
            else:
                _combine_kernel[(T,)](
                    y,
                    rows,
                    w,
                    out,
                    d,
                    y.stride(0),
                    out.stride(0),
                    K=k,
                    BD=_block_d(d),
                    WEIGHTED=True,
                    **_opts(),
                )
        ctx.save_for_backward(y, rows, w)
        return out

    @staticmethod
    def backward(ctx, g):
        y, rows, w = ctx.saved_tensors
        g = g.contiguous()
        T, k = rows.shape
        d = y.shape[1]
        need_dw = ctx.needs_input_grad[2]
        alloc = torch.zeros if y.shape[0] > T * k else torch.empty  # padding rows get no gradient
        dy = alloc(y.shape, device=y.device, dtype=y.dtype)
        dw = torch.zeros(T, k, device=w.device, dtype=w.dtype) if need_dw else None
        if T and d and k:
            _combine_bwd_kernel[(T,)](
                g, y, rows, w, dy, dw if need_dw else w, d, g.stride(0), y.stride(0), dy.stride(0),
                K=k, KP=triton.next_power_of_2(k), BD=_block_d(d), NEED_DW=need_dw, **_opts(),
            )  # fmt: skip
        return dy, None, dw


def combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out [T, d]``, ``out[t] = sum_j weights[t, j] y[rows[t, j]]`` (fp32 accumulation);
    differentiable in ``y`` and ``weights``. ``rows [T, k]`` as for :func:`expand`."""
    _check_float("combine: y", y, 2)
    _check_rows(rows, weights.shape[0] if weights.dim() == 2 else -1, "combine")
    if weights.shape != rows.shape or weights.dtype not in _DTYPES:
        raise ValueError(
            f"combine: weights must be a float [T, k] tensor like rows {tuple(rows.shape)}, got "
            f"{weights.dtype} {tuple(weights.shape)}"
        )
    if y.shape[0] < rows.numel():
        raise ValueError(f"combine: y has {y.shape[0]} rows, fewer than the {rows.numel()} assignments")
    return _Combine.apply(y.contiguous(), rows.contiguous(), weights.contiguous())


# ------------------------------------------------------------------------------------- swiglu
@triton.jit
def _swiglu_fwd_kernel(h1_ptr, h3_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    h1 = tl.load(h1_ptr + offs, mask=m).to(tl.float32)
    h3 = tl.load(h3_ptr + offs, mask=m).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-h1))
    tl.store(a_ptr + offs, (h1 * s * h3).to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(h1_ptr, h3_ptr, g_ptr, d1_ptr, d3_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    h1 = tl.load(h1_ptr + offs, mask=m).to(tl.float32)
    h3 = tl.load(h3_ptr + offs, mask=m).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-h1))
    # d silu(h)/dh = s (1 + h (1 - s))
    tl.store(d1_ptr + offs, (g * h3 * s * (1.0 + h1 * (1.0 - s))).to(d1_ptr.dtype.element_ty), mask=m)
    tl.store(d3_ptr + offs, (g * h1 * s).to(d3_ptr.dtype.element_ty), mask=m)


def _elementwise_grid(n: int):
    block = 64 if interpreting() else 2048
    return block, (triton.cdiv(n, block),)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h1, h3):
        a = torch.empty_like(h1)
        n = h1.numel()
        if n:
            block, grid = _elementwise_grid(n)
            _swiglu_fwd_kernel[grid](h1, h3, a, n, BLOCK=block, **_opts(8))
        ctx.save_for_backward(h1, h3)
        return a

    @staticmethod
    def backward(ctx, g):
        h1, h3 = ctx.saved_tensors
        g = g.contiguous()
        d1, d3 = torch.empty_like(h1), torch.empty_like(h3)
        n = h1.numel()
        if n:
            block, grid = _elementwise_grid(n)
            _swiglu_bwd_kernel[grid](h1, h3, g, d1, d3, n, BLOCK=block, **_opts(8))
        return d1, d3


def swiglu(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    """``silu(h1) * h3`` (any shape, both alike), one fused kernel each way; differentiable in both."""
    if h1.shape != h3.shape or h1.dtype != h3.dtype or h1.dtype not in _DTYPES or h1.device != h3.device:
        raise ValueError(
            f"swiglu: h1 and h3 must be float tensors of one shape, dtype and device, got "
            f"{h1.dtype} {tuple(h1.shape)} and {h3.dtype} {tuple(h3.shape)}"
        )
    return _SwiGLU.apply(h1.contiguous(), h3.contiguous())
