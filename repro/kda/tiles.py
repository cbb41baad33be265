"""What every KDA Triton kernel shares: the chunk and sub-block sizes, block pointers into the
``[B, T, heads, D]`` layout, the head offsets of a program, and the fast exponential.

Block sizes: ``BT`` (chunk) is 64, the largest whose ``[BT, BT]`` fp32 matrices and ``[BT, K]``
tiles fit in registers next to a ``[K, BV]`` state tile for K = 128; ``SUB``, the rows of a
sub-block, is 16, the smallest M ``tl.dot`` takes. The intra-chunk kernels split a chunk into
four column strips of ``SUB`` (``BT = 4 SUB``), and the UT transform's repeated squaring needs
both as powers of two (``LOG_SUB``, ``LOG_NB``).
"""

from __future__ import annotations

import triton
import triton.language as tl

BT = 64  # chunk size of the Triton path
SUB = 16  # rows per sub-block of the intra-chunk matrices
LOG_SUB, LOG_NB = SUB.bit_length() - 1, (BT // SUB).bit_length() - 1  # 16 = 2^4, 64 / 16 = 2^2
if BT != 4 * SUB:
    raise ImportError(
        f"repro.kda.tiles: the kernels read a chunk as four strips: BT = 4 * SUB, got {BT}, {SUB}"
    )


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)


@triton.jit
def _tile(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Block pointer to rows ``r0 .. r0+BR`` and columns ``c0 .. c0+BC`` of an ``[R, C]`` matrix
    with unit column stride: one token-major head of a ``[B, T, heads, D]`` tensor, or a state.
    Loads through it with ``boundary_check=(0,)`` zero the rows past R (the padded tail chunk)."""
    return tl.make_block_ptr(base, (R, C), (row_stride, 1), (r0, c0), (BR, BC), (1, 0))


@triton.jit
def _tile_t(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """The same block as :func:`_tile`, transposed: a ``[BC, BR]`` tile (check dimension 1)."""
    return tl.make_block_ptr(base, (C, R), (1, row_stride), (c0, r0), (BC, BR), (0, 1))


@triton.jit
def _load_rows(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Load the :func:`_tile` block, rows past R as zeros."""
    return tl.load(_tile(base, R, row_stride, C, r0, c0, BR, BC), boundary_check=(0,), padding_option="zero")


@triton.jit
def _load_rows_t(base, R, row_stride, C: tl.constexpr, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Load the :func:`_tile_t` block (``[BC, BR]``), rows of the matrix past R as zero columns."""
    return tl.load(
        _tile_t(base, R, row_stride, C, r0, c0, BR, BC), boundary_check=(1,), padding_option="zero"
    )


@triton.jit
def _state_tile(
    base, i_k: tl.constexpr, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    """Block pointer to key rows ``i_k BK ..`` and value columns ``i_v BV ..`` of the ``[K, V]``
    state at ``base`` (row-major): tile ``i_k`` of a state split into key tiles of ``BK`` rows."""
    return tl.make_block_ptr(base, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """``exp(x)``; ``FAST`` (GPU only: inline PTX, which Triton's CPU interpreter cannot run) as one
    ``ex2.approx.ftz`` of ``x log2(e)``: results below 2^-126 flush to zero instead of going through
    the denormal fix-up that tl.exp adds around each ex2 (a compare and two multiplies, 14% of the
    forward intra-chunk kernel's instructions on an H100). The launchers pass ``FAST = not
    interpreting()``: a capability, not a choice (H100, bench.py --tune --try, 2026-11-23: forward
    1.071 -> 1.002 ms at B=8, T=2048; in the backward's per-channel kernel forward + backward
    5.406 -> 5.288; results/nvidia-h100-80gb-hbm3-tuning.json)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;",
            "=r,r",
            [x * 1.4426950408889634],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        return tl.exp(x)


@triton.jit
def _head_bases(i_bh, T, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """For the program axis ``i_bh = b * HV + hv``: ``b``, ``hv`` and where row 0 of the program's
    heads starts in each layout: ``q_base`` in q and k (``[B, T, H, K]``, key head
    ``hv // (HV / H)``: more value heads than key heads), ``k_base`` in ``[B, T, HV, K]`` (g, G, W,
    KD, QG, KB), ``v_base`` in ``[B, T, HV, V]`` and ``c_base`` in ``[B, T, HV, BT]`` (A_qk, T)."""
    b = i_bh // HV
    hv = i_bh % HV
    hk = hv // (HV // H)
    row = b * T * HV + hv
    return b, hv, (b * T * H + hk) * K, row * K, row * V, row * BT
