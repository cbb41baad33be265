"""Inference as an RNN: prefill with the chunk kernel, decode from the carried fixed-size state.

Tolerance 1e-4: fp32 kernels against the fp64 recurrence (see test_chunk.py for why).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.kda import chunk_kda, decode_step, recurrent_kda
from repro.kda.tests.strategies import HEAD_DIMS, KDACase, make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_DECODE = 16  # decode steps per example of test_prefill_then_decode_equals_recurrence


def _case(draw_args, H: int = 2):
    seed, T, K, V, group, with_h0 = draw_args
    return make_case(seed=seed, B=2, T=T, H=H, group=group, K=K, V=V, g_max=2.0, with_h0=with_h0)


case_args = st.tuples(
    st.integers(0, 2**31 - 1),
    st.integers(2, 80),
    st.sampled_from(HEAD_DIMS),
    st.sampled_from(HEAD_DIMS),
    st.sampled_from([1, 2]),
    st.booleans(),
)


@pytest.mark.claim("kda/prefill-then-decode", section="Abstract; Figure 1b; §3 (arXiv v2)")
@settings(max_examples=6, deadline=None)
@given(args=case_args, split=st.floats(0.0, 1.0))
def test_prefill_then_decode_equals_recurrence(args, split):
    """Prefill of 1 to 79 tokens (one or two chunks, partial or whole), then up to MAX_DECODE tokens
    one launch each: each step is the same launch at the same shape, the interpreter's time is per
    step, and 16 steps in a row already carry the state from step to step through the fp32 cache."""
    case = _case(args)
    T = case.q.shape[1]
    T1 = max(1, min(T - 1, int(split * T)))  # at least one prefill and one decode token
    T = min(T, T1 + MAX_DECODE)
    case = KDACase(*(x[:, :T] for x in (case.q, case.k, case.v, case.g, case.beta)), case.h0)
    o_ref, s_ref = recurrent_kda(
        case.q, case.k, case.v, case.g, case.beta, initial_state=case.h0, output_final_state=True
    )
    q, k, v, g, beta, h0 = (
        None if x is None else x.to(DEVICE, torch.float32) for x in case.tensors(torch.float64)
    )
    o_pre, state = chunk_kda(
        q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], beta[:, :T1], initial_state=h0, output_final_state=True
    )
    outs = [o_pre]
    state = state.contiguous()
    for t in range(T1, T):
        sl = slice(t, t + 1)
        outs.append(decode_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state))
    o = torch.cat(outs, dim=1)
    assert_rel_close(o.cpu(), o_ref, 1e-4, "prefill + decode outputs")
    assert_rel_close(state.cpu(), s_ref, 1e-4, "state after decoding")


@pytest.mark.claim("kda/constant-state", section="Abstract (arXiv v2)")
@settings(max_examples=5, deadline=None)
@given(args=case_args)
def test_state_size_does_not_grow_and_carries_everything(args):
    """The state has shape [B, HV, K, V] whatever T, and it is all the layer needs to continue:
    running the second half from the first half's state equals running the whole sequence.

    Seven chunk_kda forwards per example (the whole sequence, then each of three cuts as two runs),
    and the interpreter's time is one Python pass per program, B * HV per chunk: one key head (H = 1)
    halves it. Two batch rows and, with group = 2, two value heads sharing the key head still give
    every state offset (batch row, value head) a second value; T up to 80 still gives two chunks,
    the last one partial, and every cut a partial chunk on one side or both."""
    case = _case(args, H=1)
    T = case.q.shape[1]
    q, k, v, g, beta, h0 = (
        None if x is None else x.to(DEVICE, torch.float32) for x in case.tensors(torch.float64)
    )
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    o_full, s_full = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    sizes = set()
    for T1 in sorted({1, T // 2, T - 1}):
        o1, s1 = chunk_kda(
            q[:, :T1],
            k[:, :T1],
            v[:, :T1],
            g[:, :T1],
            beta[:, :T1],
            initial_state=h0,
            output_final_state=True,
        )
        o2, s2 = chunk_kda(
            q[:, T1:],
            k[:, T1:],
            v[:, T1:],
            g[:, T1:],
            beta[:, T1:],
            initial_state=s1,
            output_final_state=True,
        )
        sizes.update({tuple(s1.shape), tuple(s2.shape)})
        assert_rel_close(torch.cat([o1, o2], dim=1).cpu(), o_full.cpu(), 1e-4, f"outputs resumed at {T1}")
        assert_rel_close(s2.cpu(), s_full.cpu(), 1e-4, f"state resumed at {T1}")
    assert sizes == {(B, HV, K, V)}, f"state shapes {sizes} should all be {(B, HV, K, V)}"
