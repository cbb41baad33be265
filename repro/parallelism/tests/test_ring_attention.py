"""Claims of the session on Ring Attention and the work it builds on: li2021sequence (Ring Self-Attention),
liu2023blockwise (blockwise attention and feedforward) and liu2023ring (Ring Attention).

Ring Attention is repro/usp's ring (:func:`repro.usp.ring.ring_attention`, and the one-process
:func:`repro.usp.ring.emulated_ring_attention`), exercised here under this paper's claims; Ring
Self-Attention is :mod:`repro.parallelism.rsa`. Rings of 1-4 ranks of the session's gloo world, float64
against single-device attention (repro.usp.reference), tolerance common.TOL64 (the online softmax's
exp/log merges round differently from one softmax, ~1e-15).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.parallelism.tests import worker
from repro.parallelism.tests.common import SETTINGS, TOL64
from repro.parallelism.tests.worker import RingCase


@st.composite
def ring_cases(draw, ns=(1, 2, 3, 4)) -> RingCase:
    n = draw(st.sampled_from(ns))
    return RingCase(
        seed=draw(st.integers(0, 2**16)),
        B=draw(st.integers(1, 2)),
        c=2 * draw(st.integers(1, 3)),  # even: the zigzag layout splits each block in two chunks
        H=draw(st.integers(1, 2)),
        D=draw(st.sampled_from([2, 4])),
        n=n,
        causal=draw(st.booleans()),
    )


def full_attention(case: RingCase) -> dict[str, torch.Tensor]:
    from repro.usp.reference import attention

    q, k, v, do = (t.clone().requires_grad_(i < 3) for i, t in enumerate(worker.ring_inputs(case)))
    o = attention(q, k, v, causal=case.causal, scale=case.D**-0.5)
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.claim("parallelism/ring-exact", section="Ring Attention, the method (arXiv v4)")
@settings(max_examples=8, **SETTINGS)
@given(case=ring_cases())
def test_ring_attention_equals_full_attention(world4, case):
    """Output and gradients of every rank's block, put back in sequence order, equal full attention."""
    from repro.usp.layout import unshard

    results = sorted(
        (r for r in world4.run(worker.run_ring, case, timeout=90) if r is not None), key=lambda r: r["rank"]
    )
    assert len(results) == case.n
    for name, want in full_attention(case).items():
        got = unshard([r[name] for r in results], "zigzag")
        assert_rel_close(got, want, TOL64, f"{name} ({case})")


@pytest.mark.claim("parallelism/ring-memory-per-device", section="Memory requirement, Table 1 (arXiv v4)")
@settings(max_examples=6, **SETTINGS)
@given(case=ring_cases(), data=st.data())
def test_ring_memory_depends_on_the_block_only(world4, case, data):
    """What a device's autograd graph keeps is its Q, K, V and output blocks [B, c, H, D] and the
    log-sum-exp [B, H, c], in bytes exactly, for rings of any size: the same on 1 and on 4 devices for
    a block of c tokens, although the sequence is 4 times longer."""
    elem = 8  # float64
    want = (4 * case.B * case.c * case.H * case.D + case.B * case.H * case.c) * elem
    for n in sorted({case.n, data.draw(st.sampled_from([1, 2, 3, 4]))}):
        other = RingCase(**{**case.__dict__, "n": n})
        for r in world4.run(worker.run_ring, other, timeout=90):
            if r is not None:
                assert r["saved"] == want, f"rank {r['rank']} of {n}: {r['saved']} != {want} ({other})"


@pytest.mark.claim("parallelism/rsa-exact", section="Ring Self-Attention (arXiv v3)")
@settings(max_examples=6, **SETTINGS)
@given(case=ring_cases())
def test_ring_self_attention_equals_full_attention(world4, case):
    """Two rings (keys, then values) over contiguous blocks: the rank's rows of full attention."""
    case = RingCase(**{**case.__dict__, "causal": False})  # the paper's RSA is bidirectional (BERT)
    results = [r for r in world4.run(worker.run_rsa, case, timeout=90) if r is not None]
    want = full_attention(case)["o"]
    assert_rel_close(torch.cat([r["o"] for r in results], dim=1), want, TOL64, f"RSA output ({case})")
    for r in results:
        assert r["counts"] == ({"ring_shift/fwd": 2 * (case.n - 1)} if case.n > 1 else {})


@pytest.mark.claim(
    "parallelism/bpt-blockwise-exact", section="Blockwise Parallel Transformer, the method (arXiv v3)"
)
@settings(max_examples=10, deadline=None)
@given(case=ring_cases(ns=(1, 2, 3, 4, 6)), hidden=st.integers(1, 8))
def test_blockwise_attention_and_feedforward_equal_the_whole_layer(case, hidden):
    """Blockwise attention (every query block against every key/value block, partial results merged by
    their log-sum-exp: repro.usp's ring emulated in one process) and the feedforward network run block by
    block over the query blocks: outputs and gradients equal the whole layer's."""
    from repro.usp.layout import shard, unshard
    from repro.usp.local import get_backend
    from repro.usp.ring import emulated_ring_attention

    full = worker.ring_inputs(case)
    q, k, v, do = (torch.stack([shard(t, case.n, r, "zigzag") for r in range(case.n)]) for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = emulated_ring_attention(
        q, k, v, causal=case.causal, scale=case.D**-0.5, layout="zigzag", backend=get_backend("math")
    )
    gen = torch.Generator().manual_seed(case.seed + 7)
    d = case.H * case.D
    w1 = torch.randn(d, hidden, generator=gen, dtype=torch.float64).requires_grad_(True)
    w2 = torch.randn(hidden, d, generator=gen, dtype=torch.float64).requires_grad_(True)
    blocks = [F.gelu(o[r].flatten(-2) @ w1) @ w2 for r in range(case.n)]  # the FFN, one block at a time
    y = unshard(blocks, "zigzag")
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(dy)
    blockwise = {"y": y.detach(), "dq": unshard(list(q.grad), "zigzag"), "dw1": w1.grad.clone()}

    from repro.usp.reference import attention

    qf, kf, vf = (t.clone().requires_grad_(True) for t in full[:3])
    w1.grad = None
    y_ref = F.gelu(attention(qf, kf, vf, causal=case.causal, scale=case.D**-0.5).flatten(-2) @ w1) @ w2
    y_ref.backward(dy)
    for name, got, want in (
        ("y", blockwise["y"], y_ref.detach()),
        ("dq", blockwise["dq"], qf.grad),
        ("dw1", blockwise["dw1"], w1.grad),
    ):
        assert_rel_close(got, want, TOL64, f"{name} ({case})")
