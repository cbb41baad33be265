"""kda/varlen-equals-separate: packed variable-length batches (``cu_seqlens``) and head sizes the
kernels are not written for (zero-padded inside ``chunk_kda``), against the recurrence run on each
sequence alone.

Tolerances as test_chunk.py: the Triton path in fp32 against the fp64 recurrence, 1e-4 for outputs,
states and gradients (fp32 rounding over chunks of 64 and the triangular inverse).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close, sanitizing
from repro.kda import chunk_kda, recurrent_kda

CLAIM = "kda/varlen-equals-separate"
SECTION = "§3 (arXiv v2)"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed_case(seed, lengths, H, group, K, V, g_max):
    gen = torch.Generator().manual_seed(seed)
    T, HV, f64 = sum(lengths), H * group, torch.float64
    q = torch.randn(1, T, H, K, generator=gen, dtype=f64)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=f64)
    g = -g_max * torch.rand(1, T, HV, K, generator=gen, dtype=f64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=f64)
    h0 = torch.randn(len(lengths), HV, K, V, generator=gen, dtype=f64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k, v, g, beta, h0], cu


def check_packed(inputs, cu, dtype=torch.float32, tol=1e-4):
    """chunk_kda on the packed batch == the fp64 recurrence on each sequence alone (o, final states,
    and the gradients of a loss over both)."""
    ours = [
        x.to(DEVICE, dtype if i < 3 else torch.float32).requires_grad_(True) for i, x in enumerate(inputs)
    ]
    ref = [x.to(DEVICE).requires_grad_(True) for x in inputs]
    o, hT = chunk_kda(*ours[:5], initial_state=ours[5], output_final_state=True, cu_seqlens=cu.to(DEVICE))
    if sanitizing():  # the compute-sanitizer pass: our kernels' memory accesses only
        torch.autograd.backward([o, hT], [torch.ones_like(o), torch.ones_like(hT)])
        return
    outs, states = [], []
    for i in range(len(cu) - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        oi, hi = recurrent_kda(
            *(x[:, s:e] for x in ref[:5]), initial_state=ref[5][i : i + 1], output_final_state=True
        )
        outs.append(oi)
        states.append(hi)
    o_ref, h_ref = torch.cat(outs, 1), torch.cat(states, 0)
    assert_rel_close(o.double(), o_ref, tol, "o (packed)")
    assert_rel_close(hT.double(), h_ref, tol, "final states (packed)")
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    dh = torch.randn(h_ref.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    torch.autograd.backward([o_ref, h_ref], [do, dh])
    torch.autograd.backward([o, hT], [do.to(o.dtype), dh.float()])
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], ours, ref, strict=True):
        assert_rel_close(a.grad.double(), b.grad, tol, f"d{name} (packed)")


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    # 16 and 32 are kernel sizes; 12 and 20 are zero-padded to 16 and 32 inside chunk_kda
    K=st.sampled_from([12, 16, 20]),
    V=st.sampled_from([16, 20]),
    group=st.sampled_from([1, 2]),
    g_max=st.sampled_from([0.05, 2.0]),
)
def test_packed_sequences_equal_each_alone(seed, lengths, K, V, group, g_max):
    inputs, cu = packed_case(seed, lengths, H=1, group=group, K=K, V=V, g_max=g_max)
    check_packed(inputs, cu)


@pytest.mark.claim(CLAIM, section=SECTION)
def test_sequences_over_several_chunks():
    """Sequences longer than a chunk, one of a single token, one ending on a chunk boundary, in the
    chunk-aligned layout (state kernels per sequence). The padded batch [N, longest], a second
    layout here, left chunk_kda in issue #40 (2.2x fla's varlen time on an H100)."""
    inputs, cu = packed_case(3, [70, 1, 128, 5], H=1, group=2, K=16, V=16, g_max=0.5)
    check_packed(inputs, cu)


def test_chunk_aligned_layout_puts_each_sequence_on_a_chunk_boundary():
    from repro.kda.chunk import BT, _chunk_aligned_layout

    dest, offsets, rows = _chunk_aligned_layout([70, 1, 128, 5], "cpu")
    assert offsets.tolist() == [0, 2, 3, 5, 6] and rows == 6 * BT
    starts = [0, 70, 71, 199]
    assert [int(dest[s]) for s in starts] == [BT * c for c in (0, 2, 3, 5)]
    assert dest.unique().numel() == dest.numel() == 204 and int(dest.max()) < rows


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize(
    "lengths,K,dtype,tol",
    [
        # flash-linear-attention's test_chunk_varlen offsets (0, 256, 500, 1000) and (0, 15, 100, 300,
        # 1200, 2000), at K = V = 128 and at their head size 100 (padded to 128); fp16 at fla's
        # dq tolerance for o and every gradient (0.008; fla's fp16 inputs against an fp32 reference)
        ([256, 244, 500], 128, torch.float16, 8e-3),
        ([15, 85, 200, 900, 800], 100, torch.float16, 8e-3),
        ([63, 64, 65, 1], 64, torch.float32, 1e-4),
        ([300, 1000], 128, torch.bfloat16, 3e-2),
    ],
)
def test_packed_sequences_on_gpu(lengths, K, dtype, tol):
    inputs, cu = packed_case(0, lengths, H=2, group=1, K=K, V=K, g_max=0.5)
    check_packed(inputs, cu, dtype=dtype, tol=tol)


def test_packed_errors():
    inputs, cu = packed_case(0, [3, 5], H=1, group=1, K=16, V=16, g_max=1.0)
    q, k, v, g, beta, h0 = (x.float() for x in inputs)
    with pytest.raises(ValueError, match="one state per sequence"):
        chunk_kda(q, k, v, g, beta, initial_state=h0[:1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="start at 0 and end at T=8"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="strictly increasing"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 3, 8]))
    with pytest.raises(ValueError, match="int32 or int64"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="B=1"):
        chunk_kda(*(torch.cat([x, x]) for x in (q, k, v, g, beta)), cu_seqlens=cu)
    big = torch.zeros(1, 8, 1, 512)
    with pytest.raises(ValueError, match="key head dim 512.*at most 256"):
        chunk_kda(big, big, v, torch.zeros(1, 8, 1, 512), beta)
