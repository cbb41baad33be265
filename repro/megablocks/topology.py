"""Block-sparse topology (gale2022megablocks §4, §5.1.3-5.1.4): blocked CSR with a COO row index and the
transpose indices, plus the permute-and-pad step that turns a routing into that topology.

A sparse matrix of ``shape = (M, N)`` (both multiples of ``block_size`` b) stores ``nnz`` dense
``b x b`` blocks in ``data [nnz, b, b]``, in row-major block order. The metadata:

* ``offsets [M/b + 1]``: blocked CSR row offsets (blocks of block-row r are ``offsets[r]:offsets[r+1]``);
* ``column_indices [nnz]``: block-column of each block; ``row_indices [nnz]``: its block-row (the COO
  part, so that an SDD program finds its output block in O(1), §5.1.3);
* transpose indices (§5.1.4): ``offsets_t [N/b + 1]``, ``column_indices_t [nnz]`` (the block-row of
  each block, listed column by column) and ``block_offsets_t [nnz]`` (where that block lives in
  ``data``). Iterating the transpose reads the same ``data`` through this secondary index, so the
  backward's transposed products need no copy of the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZES = (16, 32, 64, 128)


def check_block_size(block_size: int) -> None:
    """Raise ValueError unless ``block_size`` is one the kernels support (16, 32, 64, 128)."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported: expected one of {BLOCK_SIZES}")


@dataclass(frozen=True)
class Topology:
    """Blocked-CSR + COO metadata of a block-sparse matrix, with transpose indices (int32 tensors)."""

    shape: tuple[int, int]
    block_size: int
    row_indices: torch.Tensor
    column_indices: torch.Tensor
    offsets: torch.Tensor
    column_indices_t: torch.Tensor
    offsets_t: torch.Tensor
    block_offsets_t: torch.Tensor

    @property
    def nnz(self) -> int:
        return self.row_indices.numel()

    @property
    def block_rows(self) -> int:
        return self.shape[0] // self.block_size

    @property
    def block_cols(self) -> int:
        return self.shape[1] // self.block_size

    def to_dense(self, data: torch.Tensor) -> torch.Tensor:
        """The ``[M, N]`` dense matrix whose stored blocks are ``data [nnz, b, b]`` (zeros elsewhere)."""
        b = self.block_size
        out = data.new_zeros(self.block_rows, self.block_cols, b, b)
        out[self.row_indices.long(), self.column_indices.long()] = data
        return out.permute(0, 2, 1, 3).reshape(self.shape)

    def mask(self) -> torch.Tensor:
        """Boolean ``[M/b, N/b]`` block mask."""
        m = torch.zeros(self.block_rows, self.block_cols, dtype=torch.bool, device=self.offsets.device)
        m[self.row_indices.long(), self.column_indices.long()] = True
        return m

    def blocks_of(self, dense: torch.Tensor) -> torch.Tensor:
        """The stored blocks ``[nnz, b, b]`` of a dense ``[M, N]`` matrix (what SDD computes)."""
        b = self.block_size
        tiles = dense.reshape(self.block_rows, b, self.block_cols, b).permute(0, 2, 1, 3)
        return tiles[self.row_indices.long(), self.column_indices.long()]


def _build(shape, block_size, row_indices, column_indices) -> Topology:
    """Topology from blocks listed in row-major order; derives CSR offsets and transpose indices."""
    device = row_indices.device
    R, C = shape[0] // block_size, shape[1] // block_size
    rows = row_indices.long()
    cols = column_indices.long()
    zero = torch.zeros(1, dtype=torch.long, device=device)
    offsets = torch.cat([zero, torch.cumsum(torch.bincount(rows, minlength=R), 0)])
    # §5.1.4: list the blocks column by column (rows ascending within a column); a stable sort of
    # the row-major list by column keeps that order
    order = torch.sort(cols, stable=True).indices
    offsets_t = torch.cat([zero, torch.cumsum(torch.bincount(cols, minlength=C), 0)])
    i32 = torch.int32
    return Topology(
        shape=(int(shape[0]), int(shape[1])),
        block_size=block_size,
        row_indices=rows.to(i32),
        column_indices=cols.to(i32),
        offsets=offsets.to(i32),
        column_indices_t=rows[order].to(i32),
        offsets_t=offsets_t.to(i32),
        block_offsets_t=order.to(i32),
    )


def topology_from_mask(mask: torch.Tensor, block_size: int) -> Topology:
    """Topology of the blocks where the boolean block mask ``[M/b, N/b]`` is True."""
    check_block_size(block_size)
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a 2-D bool block mask, got {mask.dtype} of shape {tuple(mask.shape)}")
    nz = mask.nonzero()  # row-major order
    shape = (mask.shape[0] * block_size, mask.shape[1] * block_size)
    return _build(shape, block_size, nz[:, 0], nz[:, 1])


def moe_topology(padded_counts: torch.Tensor, ffn_hidden_size: int, block_size: int) -> Topology:
    """The dMoE's block-diagonal topology (§4.1): expert e owns ``padded_counts[e] / b`` block-rows,
    each holding the ``f / b`` blocks of e's columns ``[e f, (e+1) f)`` of ``[W_1^(1) ... W_1^(E)]``.

    ``padded_counts [E]``: tokens per expert rounded up to the block size. Shape ``(sum, E f)``.
    """
    check_block_size(block_size)
    if ffn_hidden_size % block_size:
        raise ValueError(f"ffn_hidden_size={ffn_hidden_size} must be a multiple of block_size={block_size}")
    E = padded_counts.numel()
    blocks_per_row = ffn_hidden_size // block_size
    rows_per_expert = (padded_counts // block_size).long()
    block_rows = int(rows_per_expert.sum())
    device = padded_counts.device
    expert_of_row = torch.repeat_interleave(
        torch.arange(E, device=device), rows_per_expert, output_size=block_rows
    )
    row_indices = torch.arange(block_rows, device=device).repeat_interleave(blocks_per_row)
    column_indices = (
        expert_of_row[:, None] * blocks_per_row + torch.arange(blocks_per_row, device=device)
    ).reshape(-1)
    shape = (block_rows * block_size, E * ffn_hidden_size)
    return _build(shape, block_size, row_indices, column_indices)


@dataclass(frozen=True)
class Permutation:
    """How the ``T k`` (token, slot) assignments are sorted by expert (§2, §5.2).

    * ``order [T k]``: assignment ids (``t k + j``) sorted by expert, stably (token order kept);
    * ``counts [E]``: assignments per expert; ``padded_counts [E]``: rounded up to ``block_size``;
    * ``dest [T k]``: padded row of each sorted assignment (expert e's rows start at the sum of
      the padded counts before it); ``padded_rows``: total rows (the only host sync).
    """

    order: torch.Tensor
    counts: torch.Tensor
    padded_counts: torch.Tensor
    dest: torch.Tensor
    padded_rows: int
    top_k: int

    @property
    def token(self) -> torch.Tensor:
        """Token of each sorted assignment, ``[T k]``."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")


def permute(indices: torch.Tensor, num_experts: int, block_size: int) -> Permutation:
    """Sort the router's choices ``indices [T, k]`` by expert and pad each expert's group to a
    multiple of ``block_size`` (``block_size=1``: no padding, the grouped-GEMM layout)."""
    T, k = indices.shape
    flat = indices.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    expert = flat[order]
    rank = torch.arange(T * k, device=indices.device) - starts[expert]
    dest = padded_starts[expert] + rank
    return Permutation(
        order=order,
        counts=counts,
        padded_counts=padded,
        dest=dest,
        padded_rows=int(padded.sum()),
        top_k=k,
    )
