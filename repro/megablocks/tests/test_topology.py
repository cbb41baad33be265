"""megablocks/padding-and-transpose: padding per expert below one block; the topology and its
transpose indices describe the same blocks. Pure index arithmetic: exact equalities."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.megablocks import moe_topology, permute, topology_from_mask
from repro.megablocks.tests.strategies import ROUTINGS, make_routing

CLAIM = "megablocks/padding-and-transpose"
SECTION = "§5.1.3, §5.1.4 (arXiv v1)"


@st.composite
def routings(draw):
    E = draw(st.integers(1, 16))
    k = draw(st.integers(1, min(E, 4)))
    T = draw(st.integers(1, 300))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    _, indices = make_routing(gen, T, E, k, draw(st.sampled_from(ROUTINGS)))
    return indices, E, draw(st.sampled_from([16, 32, 64, 128]))


def _check_transpose(topo):
    """The CSR listing and the transpose listing hold the same (row, column) -> data slot map,
    the transpose ordered column by column, rows ascending inside a column."""
    rows, cols = topo.row_indices.long(), topo.column_indices.long()
    csr = {(int(r), int(c)): p for p, (r, c) in enumerate(zip(rows, cols, strict=True))}
    # row offsets agree with the COO row index
    for r in range(topo.block_rows):
        s, e = int(topo.offsets[r]), int(topo.offsets[r + 1])
        assert (rows[s:e] == r).all()
    transposed = {}
    for c in range(topo.block_cols):
        s, e = int(topo.offsets_t[c]), int(topo.offsets_t[c + 1])
        rows_c = topo.column_indices_t[s:e].long()
        assert (rows_c[1:] > rows_c[:-1]).all(), "rows inside a transposed column must ascend"
        for r, p in zip(rows_c, topo.block_offsets_t[s:e].long(), strict=True):
            transposed[(int(r), c)] = int(p)
    assert transposed == csr


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=40, deadline=None)
@given(problem=routings(), ffn_blocks=st.integers(1, 3))
def test_padding_below_one_block_and_transpose_agrees(problem, ffn_blocks):
    indices, E, b = problem
    perm = permute(indices, E, b)
    counts = torch.bincount(indices.reshape(-1), minlength=E)
    assert torch.equal(perm.counts, counts)
    pad = perm.padded_counts - counts
    assert ((pad >= 0) & (pad <= b - 1)).all(), f"padding {pad.tolist()} outside [0, {b - 1}]"
    assert (perm.padded_counts % b == 0).all()
    assert perm.padded_rows - indices.numel() <= E * (b - 1)
    # every assignment lands on its own row inside its expert's padded range
    assert perm.dest.unique().numel() == indices.numel()
    ends = torch.cumsum(perm.padded_counts, 0)
    expert = indices.reshape(-1)[perm.order]
    assert ((perm.dest >= ends[expert] - perm.padded_counts[expert]) & (perm.dest < ends[expert])).all()

    topo = moe_topology(perm.padded_counts, ffn_blocks * b, b)
    assert topo.shape == (perm.padded_rows, E * ffn_blocks * b)
    _check_transpose(topo)
    # the pattern is block-diagonal: block-row r holds exactly its expert's f/b columns
    row_expert = torch.repeat_interleave(torch.arange(E), perm.padded_counts // b)
    assert torch.equal(topo.column_indices.long() // ffn_blocks, row_expert[topo.row_indices.long()])


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=30, deadline=None)
@given(R=st.integers(1, 6), C=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), p=st.floats(0.0, 1.0))
def test_transpose_indices_for_any_pattern(R, C, seed, p):
    mask = torch.rand(R, C, generator=torch.Generator().manual_seed(seed)) < p
    topo = topology_from_mask(mask, 16)
    assert topo.nnz == int(mask.sum())
    assert torch.equal(topo.mask(), mask)
    _check_transpose(topo)
