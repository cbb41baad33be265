"""Triton kernels of the dMoE (gale2022megablocks §5): block-sparse SDD and DSD over a
:class:`~repro.megablocks.topology.Topology`, DDS through DSD on transposed views, and a grouped
GEMM over variable-sized groups (the grouped path), each with its autograd Function.

Naming (§4.1, §5.1): the letters give output, left and right operand, S sparse, D dense.

* SDD ``C = mask(A @ B)``: one program per stored block; the COO row index finds the block's row (§5.1.3).
* DSD ``C = op(S) @ B``, ``op`` the identity or the transpose: one program per (column tile of C,
  block-row of op(S)), looping over that block-row's blocks. The transpose walks the transpose
  indices (``offsets_t``, ``column_indices_t``, ``block_offsets_t``) and reads each block with
  swapped strides: no copy of the values (§5.1.4).
* DDS ``C = A @ op(S)`` is ``(op(S)^T @ A^T)^T``: the DSD kernel on strided views, writing C through
  its transpose.

Every dense operand is passed with its strides, so ``x.t()`` costs nothing. Accumulation is fp32.
The grouped GEMM's forward / data-gradient kernel has a TMA variant for Hopper (``GPU_CONFIG["gmm_tma"]``,
on by default where the inputs allow it: :func:`_gmm_tma_kernel`), loading through tensor descriptors
instead of masked pointers; its weight gradient has one too (``GPU_CONFIG["gmm_wgrad_tma"]``, off by
default until run on a GPU: :func:`_gmm_wgrad_tma_kernel`).
Launch order: every kernel takes a 1-D grid in grouped order (``GPU_CONFIG["group_m"]``, see
:func:`_grouped_order`): ``group_m`` row tiles against all column tiles, so that a weight tile
read from HBM serves ``group_m`` row tiles from L2; SDD remaps its block index the same way when
nnz = block-rows x blocks per row (the dMoE's topology; the remap is a permutation of the blocks for
any topology, so other ones stay correct, in another order).
Kernels run on the GPU and, for tests, in Triton's CPU interpreter (small blocks).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from paperclub.triton_compat import interpreting, patch_interpreter
from repro.megablocks.topology import Topology

patch_interpreter()  # the index fix, and bf16 right under the CPU interpreter

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# GPU tile settings (the interpreter always takes the smallest tiles, to keep tests cheap).
# k_step: inner-product step, 64 keeps a 128 x 64 and a 64 x 128 bf16 tile per stage (32 KB) in
# shared memory; dense_n: the column tile of DSD/DDS and grouped-GEMM outputs; gmm_m: the grouped
# GEMM's row tile (a tile never crosses a group: smaller tiles waste less on small groups).
# group_m: the launch order (see _grouped_order): consecutive programs sweep group_m row tiles
# (block-rows) against every column tile, so that a column tile of the weight, once read from
# HBM, serves group_m row tiles from L2; 1 is the plain order (column tiles fastest), which
# re-reads an expert's whole weight once per row tile when it does not fit in L2 (8e-top2: 117 MB).
# Unlike the tile sizes it applies in the interpreter too, so the CPU tests cover the remapping.
# The bench's tuning rows time variants of these through kernel_config().
# Per path: the sparse kernels (SDD, DSD, DDS) take num_warps / num_stages and dense_n, the grouped
# GEMM and its weight gradient gmm_n / gmm_warps / gmm_stages. The H100 tuning run of 2026-11-25
# (13:45 UTC, results/*.json, rows tune:*) found each path's winner on both tuned shapes: sparse
# 4 warps, 4 stages (39.7 / 26.4 ms against 43.1 / 27.1 here); grouped 256-wide column tiles
# (36.2 / 21.4 ms against 39.7 / 22.3), which made the sparse path slower, hence the split. They
# are the defaults since the GPU run of 2026-11-25 16:05 UTC (18 GPU tests passed with them, 0
# compute-sanitizer errors).
# gmm_tma: the grouped GEMM's forward / data-gradient kernel with TMA loads (_gmm_tma_kernel, Hopper
# tensor descriptors) instead of masked pointer loads: False never; True (default since the H100 run
# of 2026-11-25 16:32 UTC: 33.0 / 16.2 ms against 35.8 / 17.0 for the pointer kernel at 8 / 64
# experts) where the inputs allow it (see _gmm_tma_unsupported), the pointer kernel otherwise (same
# values; fp32 always); "require" raises a ValueError naming the reason instead of falling back.
# gmm_wgrad_tma: the same three values for the weight gradient's kernel (_gmm_wgrad_tma_kernel against
# _gmm_wgrad_kernel; see _gmm_wgrad_tma_unsupported). False by default: equal to the pointer kernel on
# an H100 (2026-11-27, compute-sanitizer clean) but not yet timed against it.
# fused_glue: the layer's gather into expert order, its SwiGLU and its weighted scatter back as the
# fused kernels of repro/megablocks/glue.py (True) or as PyTorch indexing and elementwise ops (False,
# the earlier path; the torch._grouped_mm row of the bench keeps those). In the interpreter too.
GPU_CONFIG = {
    "k_step": 64, "dense_n": 128, "num_warps": 4, "num_stages": 4, "group_m": 8,
    "gmm_m": 128, "gmm_n": 256, "gmm_warps": 8, "gmm_stages": 3, "gmm_tma": True,
    "gmm_wgrad_tma": False, "fused_glue": True,
}  # fmt: skip


@contextlib.contextmanager
def kernel_config(**changes):
    """Temporarily change GPU_CONFIG entries (for tuning sweeps): ``with kernel_config(dense_n=256): ...``."""
    unknown = set(changes) - set(GPU_CONFIG)
    if unknown:
        raise ValueError(
            f"kernel_config: unknown settings {sorted(unknown)}, expected some of {sorted(GPU_CONFIG)}"
        )
    saved = dict(GPU_CONFIG)
    GPU_CONFIG.update(changes)
    try:
        yield
    finally:
        GPU_CONFIG.clear()
        GPU_CONFIG.update(saved)


def _k_step(block: int) -> int:
    return 16 if interpreting() else min(block, GPU_CONFIG["k_step"])


def _dense_n() -> int:
    return 16 if interpreting() else GPU_CONFIG["dense_n"]


def _group_m() -> int:
    g = GPU_CONFIG["group_m"]
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"GPU_CONFIG['group_m'] must be an int >= 1, got {g!r}")
    return g


def _check_programs(n: int, what: str) -> None:
    # a 1-D grid: CUDA allows up to 2**31 - 1 programs in its first dimension
    if n >= 2**31:
        raise ValueError(f"{n} programs for {what} exceed the 2**31 - 1 a launch allows: split the tokens")


def _launch_opts() -> dict:
    """Warps and pipeline stages of the sparse kernels (SDD, DSD, DDS)."""
    if interpreting():
        return {}
    return {"num_warps": GPU_CONFIG["num_warps"], "num_stages": GPU_CONFIG["num_stages"]}


def _gmm_launch_opts() -> dict:
    """Warps and pipeline stages of the grouped GEMM and its weight gradient."""
    if interpreting():
        return {}
    return {"num_warps": GPU_CONFIG["gmm_warps"], "num_stages": GPU_CONFIG["gmm_stages"]}


def _gmm_n() -> int:
    return 16 if interpreting() else GPU_CONFIG["gmm_n"]


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # fp32 operands: exact fp32 products (IEEE) rather than tf32, so fp32 matches the reference
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _grouped_order(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(m, n) of program ``pid`` (int64) over an ``num_m x num_n`` tile grid, in grouped order:
    the programs of a group cover GROUP_M consecutive row tiles (fewer in the last group) times
    all ``num_n`` column tiles, row tile fastest, so that programs running at the same time share
    column tiles of the right operand (and row tiles of the left one) in L2. A bijection of
    ``[0, num_m num_n)`` for every GROUP_M >= 1; GROUP_M = 1 gives ``m = pid // num_n``,
    ``n = pid % num_n`` (column tiles fastest)."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    local = pid - group * per_group
    return first_m + local % size_m, local // size_m


@triton.jit
def _sdd_kernel(
    A, B, C, row_indices, column_indices, K, num_rows, per_row,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C[p] = A[rows of block-row r] @ B[:, cols of block-col c] for the stored block p = (r, c).

    GROUP_M > 1 (the host passes it only when nnz = num_rows * per_row): p = i * per_row + j with
    (i, j) the grouped order of the program id over num_rows x per_row, a permutation of the
    blocks. When every block-row holds per_row blocks (the dMoE's topology), i is the block-row
    and j the block's place in it, so GROUP_M block-rows of A meet the same block-columns of B in
    L2; for other topologies it is just another order of the blocks, as correct as the identity.
    """
    pid = tl.program_id(0).to(tl.int64)
    if GROUP_M > 1:
        i, j = _grouped_order(pid, num_rows, per_row, GROUP_M)
        p = i * per_row + j
    else:
        p = pid
    r = tl.load(row_indices + p).to(tl.int64)
    c = tl.load(column_indices + p).to(tl.int64)
    rm = r * BLOCK + tl.arange(0, BLOCK)
    rn = c * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BK)
    a_ptrs = A + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        in_k = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_k[:, None], other=0.0)
        acc = _dot(a, b, acc, IEEE)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    i = tl.arange(0, BLOCK)
    tl.store(C + p * BLOCK * BLOCK + i[:, None] * BLOCK + i[None, :], acc.to(C.dtype.element_ty))


@triton.jit
def _dsd_kernel(
    S, B, C, offsets, indices, block_offsets, N, block_rows, num_n,
    stride_bk, stride_bn, stride_cm, stride_cn,
    TRANS: tl.constexpr, S_SM: tl.constexpr, S_SK: tl.constexpr,
    BLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C[block-row r, column tile n] = sum over the blocks (r, kb) of op(S): op(S)[r, kb] @ B[kb, n].

    TRANS = 0: op(S) = S, blocks of block-row r are data[offsets[r]:offsets[r+1]], kb = column index.
    TRANS = 1: op(S) = S^T, block-row r of S^T is block-column r of S: the transpose indices list
    its blocks (block_offsets -> data, indices = their block-rows in S = kb); each block is read
    with swapped strides.
    """
    # 1-D grid in grouped order: GROUP_M block-rows of S against every column tile of B, so that a
    # column tile of B (an expert's weight in the dMoE) is read once per GROUP_M block-rows and a
    # block-row of S once per group, both from L2 otherwise (GROUP_M = 1: column tiles fastest)
    r, n = _grouped_order(tl.program_id(0).to(tl.int64), block_rows, num_n, GROUP_M)
    n = n.to(tl.int32)  # < num_n: the column offsets stay 32-bit, as with a 2-D grid
    start = tl.load(offsets + r)
    end = tl.load(offsets + r + 1)
    rm = tl.arange(0, BLOCK)
    rn = n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    in_n = rn < N
    # op(S)[m, k] = data[blk, m, k] (strides BLOCK, 1) or, for the transpose, data[blk, k, m] (1, BLOCK)
    s_off = rm[:, None] * S_SM + rk[None, :] * S_SK
    acc = tl.zeros((BLOCK, BN), dtype=tl.float32)
    SUB: tl.constexpr = BLOCK // BK
    # one flat loop over (block, sub-step) so that the compiler pipelines the loads across blocks
    for t in range(start * SUB, end * SUB):
        i = t // SUB
        sub = t % SUB
        if TRANS:
            blk = tl.load(block_offsets + i).to(tl.int64)
        else:
            blk = i.to(tl.int64)
        kb = tl.load(indices + i).to(tl.int64)
        s = tl.load(S + blk * BLOCK * BLOCK + sub * (BK * S_SK) + s_off)
        krow = kb * BLOCK + sub * BK + rk
        b = tl.load(B + krow[:, None] * stride_bk + rn[None, :] * stride_bn, mask=in_n[None, :], other=0.0)
        acc = _dot(s, b, acc, IEEE)
    rows = r * BLOCK + rm
    c_ptrs = C + rows[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=in_n[None, :])


def _check_dense(name: str, x: torch.Tensor, dim: int = 2) -> None:
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}: expected one of {_DTYPES}")


def _sdd(a: torch.Tensor, b: torch.Tensor, topo: Topology) -> torch.Tensor:
    M, N = topo.shape
    if a.shape[0] != M or b.shape[1] != N or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"sdd: a {tuple(a.shape)} @ b {tuple(b.shape)} does not give the topology's shape {topo.shape}"
        )
    bs = topo.block_size
    out = torch.empty(topo.nnz, bs, bs, device=a.device, dtype=a.dtype)
    if topo.nnz == 0:
        return out
    _check_programs(topo.nnz, "the blocks of an SDD")
    # the grouped order needs nnz = rows x per_row (no device sync to check more: any such
    # factorisation gives a permutation of the blocks, the intended one for the dMoE's topology)
    rows = topo.block_rows
    group_m = _group_m() if rows and topo.nnz % rows == 0 else 1
    _sdd_kernel[(topo.nnz,)](
        a, b, out, topo.row_indices, topo.column_indices, a.shape[1], rows, topo.nnz // max(rows, 1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BLOCK=bs, BK=_k_step(bs), IEEE=a.dtype == torch.float32, GROUP_M=group_m, **_launch_opts(),
    )  # fmt: skip
    return out


def _dsd_into(data: torch.Tensor, topo: Topology, b: torch.Tensor, out: torch.Tensor, trans: bool) -> None:
    """out [rows of op(S), N] = op(S) @ b, out possibly a strided (transposed) view."""
    bs = topo.block_size
    offsets, indices = (
        (topo.offsets_t, topo.column_indices_t) if trans else (topo.offsets, topo.column_indices)
    )
    block_rows = offsets.numel() - 1
    N = b.shape[1]
    if block_rows == 0 or N == 0:
        return
    BN = bs if interpreting() else GPU_CONFIG["dense_n"]
    num_n = triton.cdiv(N, BN)
    _check_programs(block_rows * num_n, "a DSD")
    _dsd_kernel[(block_rows * num_n,)](
        data, b, out, offsets, indices, topo.block_offsets_t, N, block_rows, num_n,
        b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        TRANS=trans, S_SM=1 if trans else bs, S_SK=bs if trans else 1, BLOCK=bs, BN=BN, BK=_k_step(bs), IEEE=data.dtype == torch.float32,
        GROUP_M=_group_m(), **_launch_opts(),
    )  # fmt: skip


def _dsd(data: torch.Tensor, b: torch.Tensor, topo: Topology, trans: bool) -> torch.Tensor:
    M, K = topo.shape[::-1] if trans else topo.shape
    if b.shape[0] != K:
        raise ValueError(
            f"dsd: the sparse operand{'^T' if trans else ''} has {K} columns but b has {b.shape[0]} rows"
        )
    out = torch.empty(M, b.shape[1], device=b.device, dtype=b.dtype)
    _dsd_into(data, topo, b, out, trans)
    return out


def _check_dds(a: torch.Tensor, topo: Topology, trans: bool) -> None:
    K = topo.shape[1] if trans else topo.shape[0]
    if a.shape[1] != K:
        raise ValueError(
            f"dds: a has {a.shape[1]} columns but the sparse operand{'^T' if trans else ''} has {K} rows"
        )


def _dds(a: torch.Tensor, data: torch.Tensor, topo: Topology, trans: bool) -> torch.Tensor:
    _check_dds(a, topo, trans)
    N = topo.shape[0] if trans else topo.shape[1]
    # A @ op(S) = (op(S)^T @ A^T)^T: the DSD kernel with the other orientation, into a contiguous
    # out^T (coalesced stores); the result is its transposed view, as the weight gradient of
    # x @ w.t() wants it (w's gradient is then contiguous)
    out_t = torch.empty(N, a.shape[0], device=a.device, dtype=a.dtype)
    _dsd_into(data, topo, a.t(), out_t, not trans)
    return out_t.t()


class _SDD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, topo):
        ctx.topo = topo
        ctx.save_for_backward(a, b)
        return _sdd(a, b, topo)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        topo = ctx.topo
        g = g.contiguous()
        da = _dsd(g, b.t(), topo, False) if ctx.needs_input_grad[0] else None  # G @ B^T
        db = _dds(a.t(), g, topo, False) if ctx.needs_input_grad[1] else None  # A^T @ G
        return da, db, None


class _DSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, b, topo, trans):
        ctx.topo, ctx.trans = topo, trans
        ctx.save_for_backward(data, b)
        return _dsd(data, b, topo, trans)

    @staticmethod
    def backward(ctx, g):
        data, b = ctx.saved_tensors
        topo, trans = ctx.topo, ctx.trans
        dd = db = None
        if ctx.needs_input_grad[0]:  # mask(G B^T), or for op = transpose mask(B G^T)
            dd = _sdd(b, g.t(), topo) if trans else _sdd(g, b.t(), topo)
        if ctx.needs_input_grad[1]:  # op(S)^T @ G
            db = _dsd(data, g, topo, not trans)
        return dd, db, None, None


def _check_data(data: torch.Tensor, topo: Topology) -> None:
    bs = topo.block_size
    if data.shape != (topo.nnz, bs, bs) or not data.is_contiguous():
        raise ValueError(
            f"sparse data must be contiguous of shape (nnz, b, b) = {(topo.nnz, bs, bs)}, got {tuple(data.shape)}"
        )


def sdd(a: torch.Tensor, b: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Sparse = dense @ dense, restricted to ``topo``: ``a [M, K] @ b [K, N]`` -> blocks ``[nnz, b, b]``.

    ``(M, N)`` must be ``topo.shape``. Differentiable in ``a`` and ``b``.
    """
    _check_dense("a", a)
    _check_dense("b", b)
    return _SDD.apply(a, b, topo)


def dsd(data: torch.Tensor, b: torch.Tensor, topo: Topology, *, transpose: bool = False) -> torch.Tensor:
    """Dense = sparse @ dense: ``S [M, K] @ b [K, N]`` -> ``[M, N]``, ``S`` given by ``data [nnz, b, b]``
    on ``topo``; ``transpose=True`` computes ``S^T @ b`` through the transpose indices."""
    _check_data(data, topo)
    _check_dense("b", b)
    return _DSD.apply(data, b, topo, transpose)


def dds(a: torch.Tensor, data: torch.Tensor, topo: Topology, *, transpose: bool = False) -> torch.Tensor:
    """Dense = dense @ sparse: ``a [M, K] @ S [K, N]`` -> ``[M, N]`` (``transpose=True``: ``a @ S^T``)."""
    _check_dense("a", a)
    _check_data(data, topo)
    _check_dds(a, topo, transpose)
    # (op(S)^T @ a^T)^T: the DSD Function on the transposed views, as _dds computes it; autograd
    # differentiates through the two transposes, so DSD's backward is DDS's (the same kernel calls)
    return _DSD.apply(data, a.t(), topo, not transpose).t()


# ---------------------------------------------------------------------------------------------
# Grouped GEMM over variable-sized groups: rows [starts[g], ends[g]) of X times W[g]. No padding:
# a row tile never crosses a group boundary, the schedule lists (group, first row) per tile.


@triton.jit
def _gmm_kernel(
    X, W, Y, tile_group, tile_row, ends, N, K, num_tiles, num_n,
    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_ym, stride_yn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Y[rows of tile, n-tile] = X[rows of tile] @ W[g] for the tile's group g."""
    # 1-D grid in grouped order: GROUP_M row tiles against every n-tile, so that a column tile of
    # W[g] serves GROUP_M row tiles from L2 (a group of tiles may span two experts: still correct)
    t, n = _grouped_order(tl.program_id(0).to(tl.int64), num_tiles, num_n, GROUP_M)
    n = n.to(tl.int32)
    g = tl.load(tile_group + t).to(tl.int64)
    row0 = tl.load(tile_row + t).to(tl.int64)
    end = tl.load(ends + g).to(tl.int64)
    rm = row0 + tl.arange(0, BM)
    rn = n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    in_m = rm < end
    in_n = rn < N
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = W + g * stride_wg + rk[:, None] * stride_wk + rn[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        in_k = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        acc = _dot(x, w, acc, IEEE)
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


# The TMA variant (GPU_CONFIG["gmm_tma"]). Host-side descriptors (triton.tools.tensor_descriptor.
# TensorDescriptor, kernel arguments): Triton 3.6 supports them on sm_90 (its launcher encodes a
# CUtensorMap per launch) and in the CPU interpreter, and they need no scratch memory; device-side
# tl.make_tensor_descriptor (also in 3.6) needs triton.set_allocator, a process-wide setting, and
# each program would write its descriptors to global memory before using them. W's descriptor is
# 3-D: its K tail zero-fills within w[g], where a 2-D [G K, N] view would read w[g + 1]'s first rows
# (then multiplied by x's zero-filled columns: harmless for finite weights, NaN for infinite ones).
# Offline for sm_90a (python -m repro.megablocks.tests.sm90_gmm; bf16, 8 warps, 3 stages, BM 128,
# BK 64), registers / spill bytes for w [G, K, N] and for the transposed view, pointer vs TMA kernel:
# BN 128: 115 / 0 and 219 / 0 vs 92 / 0 and 92 / 0; BN 256: 209 / 0 and 255 / 328 vs 191 / 0 and
# 197 / 0 (shared memory about equal: 96 KB at BN 128, 144 KB at BN 256, but the pointer kernel's
# transposed view takes 64 / 80 KB). Both layouts feed wgmma from shared memory. Not yet run on a GPU.
@triton.jit
def _gmm_tma_kernel(
    X, W, Y, tile_group, tile_row, ends, N, K, num_tiles, num_n, stride_ym, stride_yn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, W_T: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """_gmm_kernel with TMA loads: X is a tensor descriptor of x [M, K] (block [BM, BK]); W one of
    w [G, K, N] (block [1, BK, BN]) or, W_T, of w's memory order [G, N, K] (block [1, BN, BK]: the
    dMoE's transposed W1 views, read as stored and transposed in shared memory for the dot).

    No load masks: the descriptors zero-fill past each dimension's end (rows past M, columns past
    K, and, the descriptor being 3-D, W's rows past K within group g and columns past N), and rows
    of the tile past its group's end are real rows of the next group, loaded but never stored: the
    store is masked to the group's rows as in _gmm_kernel. Offsets are int32 (TMA coordinates)."""
    t, n = _grouped_order(tl.program_id(0).to(tl.int64), num_tiles, num_n, GROUP_M)
    n = n.to(tl.int32)
    g = tl.load(tile_group + t)
    row0 = tl.load(tile_row + t)
    end = tl.load(ends + g)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = X.load([row0, k0])
        if W_T:
            w = W.load([g, n * BN, k0]).reshape(BN, BK).T
        else:
            w = W.load([g, k0, n * BN]).reshape(BK, BN)
        acc = tl.dot(x, w, acc)
    rm = row0.to(tl.int64) + tl.arange(0, BM)
    rn = n * BN + tl.arange(0, BN)
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(rm < end)[:, None] & (rn < N)[None, :])


@triton.jit
def _wgrad_tile(starts, ends, num_kt, num_n, GROUP_M: tl.constexpr):
    """This program's (group, k-tile, n-tile) of a weight gradient and the group's rows [start, end)."""
    pid = tl.program_id(0).to(tl.int64)
    per_g = num_kt * num_n
    g = pid // per_g
    kt, n = _grouped_order(pid - g * per_g, num_kt, num_n, GROUP_M)
    return g, kt.to(tl.int32), n.to(tl.int32), tl.load(starts + g), tl.load(ends + g)


@triton.jit
def _gmm_wgrad_kernel(
    X, G, DW, starts, ends, K, N, num_kt, num_n,
    stride_xm, stride_xk, stride_gm, stride_gn, stride_dg, stride_dk, stride_dn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """DW[g, k-tile, n-tile] = X[rows of g]^T @ G[rows of g]: a reduction over the group's rows."""
    # 1-D grid, group by group; within a group (num_kt x num_n tiles) the grouped order: GROUP_M
    # k-tiles (slices of the group's X) against every n-tile (slices of its G), so that programs
    # running together share both from L2 (GROUP_M = 1: n fastest, then k, as a 3-D grid would)
    g, kt, n, start, end = _wgrad_tile(starts, ends, num_kt, num_n, GROUP_M)
    rk = kt * BK + tl.arange(0, BK)
    rn = n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    in_k = rk < K
    in_n = rn < N
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(start, end, BM):
        rows = (m0 + rm).to(tl.int64)
        in_m = rows < end
        xt = tl.load(
            X + rows[None, :] * stride_xm + rk[:, None] * stride_xk,
            mask=in_k[:, None] & in_m[None, :],
            other=0.0,
        )
        gg = tl.load(
            G + rows[:, None] * stride_gm + rn[None, :] * stride_gn,
            mask=in_m[:, None] & in_n[None, :],
            other=0.0,
        )
        acc = _dot(xt, gg, acc, IEEE)
    d_ptrs = DW + g * stride_dg + rk[:, None] * stride_dk + rn[None, :] * stride_dn
    tl.store(d_ptrs, acc.to(DW.dtype.element_ty), mask=in_k[:, None] & in_n[None, :])


# The weight gradient's TMA variant (GPU_CONFIG["gmm_wgrad_tma"]), host-side descriptors as above.
# Its reduction runs over a group's rows [start, end) in steps of BM from start, so a box of BM rows
# can reach past end into group g + 1's rows: real data, not zero-filled (TMA fills only past the
# tensor's last row, M). The kernel zeroes those rows of X's tile in registers (tl.where against end)
# and leaves G's tile as loaded. One operand suffices: every term of DW[g][k, n] = sum_m X[m, k] G[m, n]
# has a factor from each operand in the same row m, so a zero row of X makes each term of a foreign
# row 0 * G[m, n] = 0 (exactly, and the fp32 accumulator unchanged), for finite G; a non-finite value in
# group g + 1's rows of G would give NaN here (0 * inf), where the pointer kernel, masking both, gives
# none (the forward's W note above has the same caveat). X rather than G: X^T is the dot's left
# operand, which wgmma takes from registers (ldmatrix from the TMA tile, then the select), whereas a
# masked G, the right operand, is written back to shared memory for wgmma.
# Offline for sm_90a (python -m repro.megablocks.tests.sm90_gmm; bf16, 8 warps, 3 stages, a [128, BN]
# tile of DW, 64 rows per step), registers / spill bytes / shared memory, pointer vs TMA kernel:
# BN 128: 106 / 0 / 96 KB vs 121 / 0 / 88 KB; BN 256: 173 / 0 / 144 KB vs 180 / 0 / 136 KB (masking G
# instead: 95 / 0 / 96 KB and 187 / 0 / 144 KB). Not yet run on a GPU, hence off by default.
@triton.jit
def _gmm_wgrad_tma_kernel(
    X, G, DW, starts, ends, K, N, num_kt, num_n, stride_dg, stride_dk, stride_dn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """_gmm_wgrad_kernel with TMA loads: X a tensor descriptor of x [M, K] (block [BM, BK], read as
    stored and transposed for the dot, as the forward's W_T), G one of g [M, N] (block [BM, BN]).
    Zero fill covers columns past K and N and rows past M; rows past the group's end are zeroed in
    X's tile (see above). TMA coordinates are int32; the store's offsets int64, as in the pointer kernel."""
    g, kt, n, start, end = _wgrad_tile(starts, ends, num_kt, num_n, GROUP_M)
    rm = tl.arange(0, BM)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(start, end, BM):
        x = X.load([m0, kt * BK])
        x = tl.where(((m0 + rm) < end)[:, None], x, tl.zeros_like(x))
        gg = G.load([m0, n * BN])
        acc = tl.dot(x.T, gg, acc)
    rk = kt.to(tl.int64) * BK + tl.arange(0, BK)
    rn = n.to(tl.int64) * BN + tl.arange(0, BN)
    d_ptrs = DW + g * stride_dg + rk[:, None] * stride_dk + rn[None, :] * stride_dn
    tl.store(d_ptrs, acc.to(DW.dtype.element_ty), mask=(rk < K)[:, None] & (rn < N)[None, :])


def _gmm_tiles(counts: torch.Tensor):
    """Tile schedule: tile_group, tile_row [tiles], starts/ends [G]; host sync only for the count."""
    BM = 16 if interpreting() else GPU_CONFIG["gmm_m"]
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    tiles = (counts + BM - 1) // BM
    tile_ends = torch.cumsum(tiles, 0)
    n_tiles = int(tile_ends[-1]) if counts.numel() else 0
    t = torch.arange(n_tiles, device=counts.device)
    tile_group = torch.searchsorted(tile_ends, t, right=True)
    tile_row = starts[tile_group] + (t - (tile_ends - tiles)[tile_group]) * BM
    i32 = torch.int32
    return BM, tile_group.to(i32), tile_row.to(i32), starts.to(i32), ends.to(i32)


def _tma_target_unsupported(x: torch.Tensor) -> str | None:
    """Why x's dtype or device rules out the TMA kernels, or None."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} (TMA path: bf16 or fp16)"
    if not interpreting():
        if x.device.type != "cuda":
            return f"device {x.device} (TMA path: CUDA)"
        major, minor = torch.cuda.get_device_capability(x.device)
        if major < 9:
            return f"GPU sm_{major}{minor} (TMA path: sm_90 or newer)"
    return None


def _gmm_tma_unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why _gmm_tma_kernel cannot take ``x [M, K] @ w [G, K, N]``, or None if it can. TMA needs a
    Hopper GPU (sm_90+; the CPU interpreter emulates it), a 16-byte aligned base, 16-byte aligned
    strides but the last and a contiguous last dimension: x row-major, w [G, K, N] with N or K
    contiguous (the dMoE's weights and their transposed views); every dimension non-empty. fp32 is
    left to the pointer kernel (its IEEE fp32 products are not what TMA tiles are for)."""
    reason = _tma_target_unsupported(x)
    if reason is not None:
        return reason
    if min(x.shape) == 0 or min(w.shape) == 0:
        return f"an empty dimension (x {tuple(x.shape)}, w {tuple(w.shape)})"
    size = x.element_size()
    if x.stride(1) != 1:
        return f"x strides {x.stride()} (TMA path: x's last dimension contiguous)"
    if w.stride(2) == 1:
        outer = (w.stride(0), w.stride(1))
    elif w.stride(1) == 1:
        outer = (w.stride(0), w.stride(2))
    else:
        return f"w strides {w.stride()} (TMA path: w's K or N dimension contiguous)"
    if any(s * size % 16 for s in (x.stride(0), *outer)):
        return f"strides x {x.stride()}, w {w.stride()} (TMA path: 16-byte multiples but the last)"
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return "a base address not 16-byte aligned (TMA path)"
    return None


def _gmm_wgrad_tma_unsupported(x: torch.Tensor, g: torch.Tensor) -> str | None:
    """Why _gmm_wgrad_tma_kernel cannot take ``x [M, K]^T @ g [M, N]`` (per group), or None if it can:
    as :func:`_gmm_tma_unsupported`, both operands row-major (last dimension contiguous, 16-byte
    aligned base and row stride), of one dtype, every dimension non-empty."""
    reason = _tma_target_unsupported(x)
    if reason is not None:
        return reason
    if g.dtype != x.dtype:
        return f"dtypes x {x.dtype}, g {g.dtype} (TMA path: one dtype)"
    if min(x.shape) == 0 or min(g.shape) == 0:
        return f"an empty dimension (x {tuple(x.shape)}, g {tuple(g.shape)})"
    if x.stride(1) != 1 or g.stride(1) != 1:
        return f"strides x {x.stride()}, g {g.stride()} (TMA path: both last dimensions contiguous)"
    if (x.stride(0) * x.element_size()) % 16 or (g.stride(0) * g.element_size()) % 16:
        return f"strides x {x.stride()}, g {g.stride()} (TMA path: 16-byte multiples but the last)"
    if x.data_ptr() % 16 or g.data_ptr() % 16:
        return "a base address not 16-byte aligned (TMA path)"
    return None


def _use_tma(setting: str, caller: str, unsupported) -> bool:
    """GPU_CONFIG[setting] (False, True or "require") applied to ``unsupported()``, the reason the
    TMA kernel cannot take this call's inputs (None if it can)."""
    mode = GPU_CONFIG[setting]
    if mode is False:
        return False
    if mode is not True and mode != "require":
        raise ValueError(f"GPU_CONFIG['{setting}'] must be False, True or 'require', got {mode!r}")
    reason = unsupported()
    if reason is not None and mode == "require":
        raise ValueError(
            f"{caller}: GPU_CONFIG['{setting}'] = 'require' but the TMA kernel cannot take {reason}"
        )
    return reason is None


def _use_gmm_tma(x: torch.Tensor, w: torch.Tensor) -> bool:
    return _use_tma("gmm_tma", "gmm", lambda: _gmm_tma_unsupported(x, w))


def _gmm(x: torch.Tensor, w: torch.Tensor, sched) -> torch.Tensor:
    BM, tile_group, tile_row, _, ends = sched
    K, N = w.shape[1], w.shape[2]
    y = torch.empty(x.shape[0], N, device=x.device, dtype=x.dtype)
    if tile_group.numel() == 0 or N == 0:
        return y
    BN = _gmm_n()
    num_tiles, num_n = tile_group.numel(), triton.cdiv(N, BN)
    _check_programs(num_tiles * num_n, "a grouped GEMM")
    if _use_gmm_tma(x, w):
        BK = _k_step(128)
        w_t = w.stride(2) != 1  # then w.stride(1) == 1 (_gmm_tma_unsupported): describe [G, N, K]
        w_desc = (
            TensorDescriptor(w, [w.shape[0], N, K], [w.stride(0), w.stride(2), 1], [1, BN, BK])
            if w_t
            else TensorDescriptor(w, list(w.shape), list(w.stride()), [1, BK, BN])
        )
        _gmm_tma_kernel[(num_tiles * num_n,)](
            TensorDescriptor(x, list(x.shape), list(x.stride()), [BM, BK]), w_desc, y,
            tile_group, tile_row, ends, N, K, num_tiles, num_n, y.stride(0), y.stride(1),
            BM=BM, BN=BN, BK=BK, W_T=w_t, GROUP_M=_group_m(), **_gmm_launch_opts(),
        )  # fmt: skip
        return y
    _gmm_kernel[(num_tiles * num_n,)](
        x, w, y, tile_group, tile_row, ends, N, K, num_tiles, num_n,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        BM=BM, BN=BN, BK=_k_step(128), IEEE=x.dtype == torch.float32, GROUP_M=_group_m(), **_gmm_launch_opts(),
    )  # fmt: skip
    return y


def _gmm_wgrad(x: torch.Tensor, g: torch.Tensor, sched, num_groups: int) -> torch.Tensor:
    BM, _, _, starts, ends = sched
    K, N = x.shape[1], g.shape[1]
    dw = torch.empty(num_groups, K, N, device=x.device, dtype=x.dtype)
    BN = _gmm_n()
    BK = 16 if interpreting() else 128  # the weight gradient's row tile (its K dim is the reduction)
    num_kt, num_n = triton.cdiv(K, BK), triton.cdiv(N, BN)
    if num_groups * num_kt * num_n == 0:
        return dw
    _check_programs(num_groups * num_kt * num_n, "a grouped weight gradient")
    BM_step = _k_step(128)  # rows of the reduction per step
    if _use_tma("gmm_wgrad_tma", "gmm weight gradient", lambda: _gmm_wgrad_tma_unsupported(x, g)):
        _gmm_wgrad_tma_kernel[(num_groups * num_kt * num_n,)](
            TensorDescriptor(x, list(x.shape), list(x.stride()), [BM_step, BK]),
            TensorDescriptor(g, list(g.shape), list(g.stride()), [BM_step, BN]),
            dw, starts, ends, K, N, num_kt, num_n, dw.stride(0), dw.stride(1), dw.stride(2),
            BM=BM_step, BN=BN, BK=BK, GROUP_M=_group_m(), **_gmm_launch_opts(),
        )  # fmt: skip
        return dw
    _gmm_wgrad_kernel[(num_groups * num_kt * num_n,)](
        x, g, dw, starts, ends, K, N, num_kt, num_n,
        x.stride(0), x.stride(1), g.stride(0), g.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        BM=BM_step, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, GROUP_M=_group_m(), **_gmm_launch_opts(),
    )  # fmt: skip
    return dw


class _GMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, sched):
        ctx.sched = sched
        ctx.save_for_backward(x, w)
        return _gmm(x, w, sched)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _gmm(g, w.transpose(1, 2), ctx.sched) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if w.stride(1) == 1 and w.stride(2) != 1:
                # w is a transposed view (the dMoE's W1 [E, f, d] read as [E, d, f]): compute
                # dw^T = G^T X, contiguous in w's own memory order, so no copy follows
                dw = _gmm_wgrad(g, x, ctx.sched, w.shape[0]).transpose(1, 2)
            else:
                dw = _gmm_wgrad(x, g, ctx.sched, w.shape[0])
        return dx, dw, None


def grouped_schedule(counts: torch.Tensor):
    """The tile schedule of :func:`gmm` for consecutive groups of ``counts [G]`` rows (build it once
    and pass it to several :func:`gmm` calls over the same groups)."""
    return _gmm_tiles(counts)


def gmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, schedule=None) -> torch.Tensor:
    """Grouped matmul: ``x [M, K]`` with rows grouped consecutively by ``counts [G]`` (sum M), times
    ``w [G, K, N]`` (any strides) -> ``[M, N]``; row block g uses ``w[g]``. Differentiable in x and w.
    """
    _check_dense("x", x)
    _check_dense("w", w, dim=3)
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"gmm: x has {x.shape[1]} columns but w is {tuple(w.shape)} (expected [G, {x.shape[1]}, N])"
        )
    if counts.numel() != w.shape[0]:
        raise ValueError(f"gmm: counts has {counts.numel()} groups but w has {w.shape[0]}")
    sched = schedule if schedule is not None else _gmm_tiles(counts)
    return _GMM.apply(x, w, sched)
