"""Claims of fang2024usp on spawned CPU process groups (gloo), sequence-parallel groups of 1-4 ranks.

The hypothesis examples are drawn here and evaluated by the session's 4 worker processes (conftest);
each result is compared with single-device attention in float64 (:mod:`repro.usp.reference`).

Tolerances: float64 shards against the float64 reference agree to rounding (~1e-15 measured), so
1e-10 leaves room for the LSE merge's exp/log without hiding a wrong block (which gives O(1)
errors). float32 shards: 2e-5, a few times the float32 rounding of the softmax and matmuls at these sizes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close
from repro.usp import positions, unshard
from repro.usp.cost import bytes_per_rank, ring_pairs
from repro.usp.reference import attention, causal_pairs
from repro.usp.tests import worker
from repro.usp.tests.sections import (
    BALANCE_SECTION,
    COMM_SECTION,
    DEEPSPEED_SECTION,
    GQA_SECTION,
    HYBRID_SECTION,
    PRACTICE_SECTION,
    RING_SECTION,
    ULYSSES_SECTION,
)
from repro.usp.tests.worker import Case

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOL = {"float64": 1e-10, "float32": 2e-5}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def cases(draw, ulysses=None, ring=None, backends=("math", "sdpa"), dtypes=("float64",), causal=None,
          layout=None, max_p=4, head_dims=(4, 8)):  # fmt: skip
    """A USP problem on at most ``max_p`` ranks; fixed degrees where given, drawn otherwise."""
    if ulysses is None and ring is None:
        p = draw(st.integers(1, max_p))
        pu = draw(st.sampled_from(_divisors(p)))
        pr = p // pu
    elif ring is None:
        pu = ulysses if isinstance(ulysses, int) else draw(ulysses)
        pr = 1
    else:
        pr = ring if isinstance(ring, int) else draw(ring)
        pu = 1
    p = pu * pr
    h = pu * draw(st.integers(1, 3))
    return Case(
        seed=draw(st.integers(0, 2**16)),
        B=draw(st.integers(1, 2)),
        S=2 * p * draw(st.integers(1, 3)),
        H=h,
        H_kv=draw(st.sampled_from(_divisors(h))),
        D=draw(st.sampled_from(head_dims)),
        ulysses=pu,
        ring=pr,
        causal=draw(st.booleans()) if causal is None else causal,
        layout=draw(st.sampled_from(["zigzag", "contiguous"])) if layout is None else layout,
        dtype=draw(st.sampled_from(dtypes)),
        backend=draw(st.sampled_from(backends)),
    )


def reference(case: Case) -> dict[str, torch.Tensor]:
    """Single-device output and gradients in float64."""
    q, k, v, do = (t.to(torch.float64) for t in worker.inputs(case))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, causal=case.causal)
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run(world, case: Case, task=worker.run_cases) -> list:
    """The case's per-rank results (None for ranks outside the SP domain)."""
    return [r[0] for r in world.run(task, [case], timeout=90)]


def check_exact(world, case: Case) -> list[dict]:
    """Run the case, check replica 0 against the reference and the other replicas against replica 0."""
    results = [r for r in run(world, case) if r is not None]
    replicas: dict[int, list] = {}
    for r in results:
        replicas.setdefault(r["replica"], []).append(r)
    rep0 = sorted(replicas.pop(0), key=lambda r: r["sp_rank"])
    assert [r["sp_rank"] for r in rep0] == list(range(case.P))
    ref = reference(case)
    for name, want in ref.items():
        got = unshard([r[name] for r in rep0], case.layout)
        assert got.dtype == worker.DTYPES[case.dtype]
        assert_rel_close(got, want, TOL[case.dtype], f"{name} ({case})")
    for other in replicas.values():  # data-parallel replicas of the SP group compute the same
        for a, b in zip(rep0, sorted(other, key=lambda r: r["sp_rank"]), strict=True):
            assert torch.equal(a["o"], b["o"]) and torch.equal(a["dq"], b["dq"])
    return rep0


@pytest.mark.claim("usp/ulysses-exact", section=ULYSSES_SECTION)
@settings(max_examples=12, **SETTINGS)
@given(case=cases(ulysses=st.integers(1, 4), dtypes=("float64", "float32")))
def test_ulysses_equals_single_device(world4, case):
    check_exact(world4, case)


@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@settings(max_examples=16, **SETTINGS)
@given(case=cases(ring=st.integers(1, 4), dtypes=("float64", "float32")))
def test_ring_equals_single_device(world4, case):
    check_exact(world4, case)


@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@settings(max_examples=3, **SETTINGS)
@given(case=cases(ring=st.integers(2, 3), backends=("fa4",), dtypes=("float32",), head_dims=(16,)))
def test_ring_with_fa4_kernel(world4, case):
    """repro.fa4's Triton forward/backward as the ring's local attention (Triton interpreter on CPU)."""
    check_exact(world4, case)


@pytest.mark.claim("usp/usp-exact", section=HYBRID_SECTION)
@settings(max_examples=25, **SETTINGS)
@given(case=cases(dtypes=("float64", "float32")))
def test_usp_equals_single_device(world4, case):
    check_exact(world4, case)


@pytest.mark.claim("usp/usp-exact", section=HYBRID_SECTION)
@settings(max_examples=6, **SETTINGS)
@given(case=cases(ulysses=2, causal=True), pr=st.just(2), data=st.data())
def test_usp_2x2_more_ranks_than_heads(world4, case, pr, data):
    """P = 4 ranks with H = 2 or 4 heads and as few as 1 K/V head: past Ulysses' head limit."""
    h = data.draw(st.sampled_from([2, 4]))
    case = Case(**{**case.__dict__, "ring": pr, "H": h, "H_kv": data.draw(st.sampled_from(_divisors(h))),
                   "S": 8 * data.draw(st.integers(1, 2))})  # fmt: skip
    check_exact(world4, case)


@pytest.mark.claim("usp/reduces-to-ulysses-and-ring", section=HYBRID_SECTION)
@settings(max_examples=10, **SETTINGS)
@given(
    case=st.one_of(cases(ulysses=st.integers(1, 4)), cases(ring=st.integers(2, 4))),
)
def test_usp_reduces_to_ulysses_and_ring(world4, case):
    for res in run(world4, case, worker.run_reductions):
        if res is None:
            continue
        usp, plain = res["usp"], res["plain"]
        for name in ("o", "dq", "dk", "dv"):
            assert torch.equal(usp[name], plain[name]), f"{name} differs from plain {case}"
        assert usp["bytes"] == plain["bytes"]
        kinds = {key.split("/")[0] for key, n in usp["bytes"].items() if n > 0}
        if case.ring == 1:
            assert kinds <= {"ulysses"}, f"P_r = 1 must only all-to-all, sent {usp['bytes']}"
        else:
            assert kinds == {"ring"}, f"P_u = 1 must only use the ring, sent {usp['bytes']}"


@pytest.mark.claim("usp/zigzag-balanced", section=BALANCE_SECTION)
@settings(max_examples=8, **SETTINGS)
@given(case=cases(causal=True, layout="zigzag"), p=st.integers(2, 4), data=st.data())
def test_zigzag_balances_causal_work(world4, case, p, data):
    pu = data.draw(st.sampled_from([d for d in _divisors(p) if d < p]))  # ring degree >= 2
    base = {**case.__dict__, "ulysses": pu, "ring": p // pu, "H": pu, "H_kv": pu, "S": 2 * p * 2, "B": 1}
    total = causal_pairs(torch.arange(base["S"]), torch.arange(base["S"]))
    counts = {}
    for layout in ("zigzag", "contiguous"):
        c = Case(**{**base, "layout": layout})
        per_ring_rank = {}
        for r in run(world4, c):
            if r is not None and r["replica"] == 0:
                per_ring_rank.setdefault(r["sp_rank"] // pu, set()).add(r["pairs"])
        # every Ulysses rank of a ring rank does that ring rank's work (on its own heads)
        assert all(len(v) == 1 for v in per_ring_rank.values())
        counts[layout] = [per_ring_rank[i].pop() for i in range(c.ring)]
        assert counts[layout] == ring_pairs(layout, True, c.ring, c.S // c.ring)
        assert sum(counts[layout]) == total, "each unmasked pair must be computed exactly once"
    assert len(set(counts["zigzag"])) == 1, f"zigzag unbalanced: {counts['zigzag']}"
    assert counts["contiguous"] == sorted(counts["contiguous"]) and len(set(counts["contiguous"])) == len(
        counts["contiguous"]
    ), f"contiguous should grow with the ring rank: {counts['contiguous']}"


@pytest.mark.claim("usp/zigzag-faster", section=BALANCE_SECTION)
@settings(max_examples=4, **SETTINGS)
@given(case=cases(causal=True, layout="zigzag"), p=st.integers(2, 4), data=st.data())
def test_zigzag_and_contiguous_rows_compare_like_with_like(world4, case, p, data):
    """usp/zigzag-faster is measured by the benchmark (its zigzag and contiguous rows of one split, in
    the same rounds); what a test can check is that those rows differ in the layout alone: for any
    split with a ring, both layouts compute single-device attention and its gradients, every rank
    sends the same bytes, and the ranks compute the same unmasked pairs in all. So the time between
    them is how the work is spread (usp/zigzag-balanced), not more or less work or traffic."""
    pu = data.draw(st.sampled_from([d for d in _divisors(p) if d < p]))  # ring degree >= 2
    base = {**case.__dict__, "ulysses": pu, "ring": p // pu, "H": pu * (1 + case.H % 2), "H_kv": pu}
    base["S"] = 2 * p * data.draw(st.integers(1, 2))
    got = {}
    for layout in ("zigzag", "contiguous"):
        c = Case(**{**base, "layout": layout})
        check_exact(world4, c)
        got[layout] = {
            r["sp_rank"]: (r["bytes"], r["pairs"]) for r in run(world4, c) if r and r["replica"] == 0
        }
    for rank, (sent, _) in got["zigzag"].items():
        assert sent == got["contiguous"][rank][0], f"rank {rank}: the layouts must send the same bytes"
    assert sum(n for _, n in got["zigzag"].values()) == sum(n for _, n in got["contiguous"].values())


@pytest.mark.claim("usp/dp-beats-sp-large-batch", section=PRACTICE_SECTION)
@settings(max_examples=4, **SETTINGS)
@given(case=cases(layout="zigzag", max_p=4), data=st.data())
def test_data_and_sequence_parallel_rows_compare_like_with_like(world4, case, data):
    """usp/dp-beats-sp-large-batch is measured by the benchmark (its dpsp rows: a global batch of
    sequences over the GPUs, data parallel against every SP split); what a test can check is that the
    rows compare like with like: with b sequences per rank whole (data parallel) or b P sequences over
    an SP group of P, both compute single-device attention and every rank does the same attention
    work (batch x heads x unmasked pairs), while data parallel sends nothing and SP the analysis'
    bytes, more than nothing. The measured difference is SP's communication and its smaller blocks."""
    if case.P == 1:
        case = Case(
            **{**case.__dict__, "ulysses": 2, "H": 2 * case.H, "H_kv": 2 * case.H_kv, "S": 4 * case.S}
        )
    b = data.draw(st.integers(1, 2))
    dp = Case(**{**case.__dict__, "ulysses": 1, "ring": 1, "B": b})
    sp = Case(**{**case.__dict__, "B": b * case.P})

    def work(c: Case, r: dict) -> int:
        return c.B * (c.H // c.ulysses) * r["pairs"]

    dp_ranks = check_exact(world4, dp)
    assert all(sum(r["bytes"].values()) == 0 for r in dp_ranks), "data parallel sends no activations"
    sp_ranks = check_exact(world4, sp)
    elem = torch.tensor([], dtype=worker.DTYPES[sp.dtype]).element_size()
    want = bytes_per_rank(
        B=sp.B, S=sp.S, H=sp.H, H_kv=sp.H_kv, D=sp.D, ulysses_degree=sp.ulysses, ring_degree=sp.ring,
        elem=elem, acc=max(elem, 4),
    )  # fmt: skip
    for r in sp_ranks:
        assert sum(r["bytes"].values()) == sum(want.values()) > 0
        assert work(sp, r) == work(dp, dp_ranks[0]), (sp, r["pairs"], dp_ranks[0]["pairs"])


@pytest.mark.claim("usp/comm-volume", section=COMM_SECTION)
@settings(max_examples=12, **SETTINGS)
@given(case=cases(dtypes=("float64", "float32")))
def test_bytes_match_the_analysis(world4, case):
    elem = torch.tensor([], dtype=worker.DTYPES[case.dtype]).element_size()
    want = bytes_per_rank(
        B=case.B, S=case.S, H=case.H, H_kv=case.H_kv, D=case.D, ulysses_degree=case.ulysses,
        ring_degree=case.ring, elem=elem, acc=max(elem, 4),
    )  # fmt: skip
    for r in run(world4, case):
        if r is not None:
            got = {key: r["bytes"].get(key, 0) for key in want}
            assert got == want, f"rank {r['sp_rank']} sent {got}, the analysis says {want} ({case})"


@pytest.mark.claim("usp/deepspeed-ulysses-volume", section=DEEPSPEED_SECTION)
@given(p=st.integers(2, 64), c=st.integers(1, 8), h=st.integers(1, 4))
@settings(max_examples=50, deadline=None)
def test_ulysses_volume_constant_when_n_and_p_grow_together(p, c, h):
    """DeepSpeed-Ulysses' 4Nh/P per link (M/P for each all-to-all of aggregate size M): with N = c P
    tokens, the bytes a rank sends in the forward, (P-1)/P of 4Nh/P (its own chunk stays), scaled
    back by P/(P-1), are the same for every P; the ring's per-rank bytes do not fall with P (here
    H = H_kv, so d = d_kv = H D)."""
    e = 2
    shape = dict(B=1, H=2 * p * h, H_kv=2 * p * h, D=8, elem=e, acc=4)
    per_p = []
    for n in (p, 2 * p):
        s_len = 2 * c * n * 8
        uly = bytes_per_rank(**shape, S=s_len, ulysses_degree=n, ring_degree=1)["ulysses/fwd"]
        nh_bytes = s_len * shape["H"] * shape["D"] * e
        assert uly * n * n == 4 * nh_bytes * (n - 1)  # (P-1)/P of 4 N h / P, exactly
        per_p.append(uly * n // (n - 1))
    assert per_p[0] == per_p[1], "4Nh/P must not change when N and P double together"
    ring = [
        bytes_per_rank(**shape, S=4 * c * p, ulysses_degree=1, ring_degree=n)["ring/fwd"] for n in (p, 2 * p)
    ]
    assert ring[0] <= ring[1], "the ring's per-rank traffic does not fall with P at fixed N"


@pytest.mark.claim("usp/deepspeed-ulysses-volume", section=DEEPSPEED_SECTION)
@settings(max_examples=6, **SETTINGS)
@given(case=cases(ulysses=st.sampled_from([2, 4]), dtypes=("float32",)), data=st.data())
def test_ulysses_sends_4nh_over_p_measured(world4, case, data):
    """Measured: with as many K/V heads as query heads (the analysis' setting), each rank of a pure
    Ulysses group of n sends (n-1)/n of 4 N h / n bytes forward, and the same backward."""
    case = Case(**{**case.__dict__, "H_kv": case.H})
    n = case.ulysses
    nh_bytes = case.B * case.S * case.H * case.D * 4
    for r in run(world4, case):
        if r is not None:
            assert r["bytes"].get("ulysses/fwd") * n * n == 4 * nh_bytes * (n - 1)
            assert r["bytes"].get("ulysses/bwd") == r["bytes"].get("ulysses/fwd")
            assert not any(k.startswith("ring") and v for k, v in r["bytes"].items())


@given(n=st.integers(1, 6), m=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]))
@settings(max_examples=30, deadline=None)
def test_shards_partition_the_sequence(n, m, layout):
    x = torch.arange(2 * n * m)[None, :, None]
    parts = [positions(x.shape[1], n, r, layout) for r in range(n)]
    assert sorted(torch.cat(parts).tolist()) == list(range(x.shape[1]))
    from repro.usp import shard

    assert torch.equal(unshard([shard(x, n, r, layout) for r in range(n)], layout), x)


@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@settings(max_examples=15, deadline=None)
@given(case=cases(ring=st.integers(1, 8), max_p=8))
def test_emulated_ring_equals_single_device(case):
    """Rings of up to 8 ranks emulated in one process (the same steps, plans and merges; what the
    benchmark times on one GPU)."""
    from repro.usp import shard
    from repro.usp.local import get_backend
    from repro.usp.ring import emulated_ring_attention

    full = worker.inputs(case)
    q, k, v, do = (torch.stack([shard(t, case.ring, r, case.layout) for r in range(case.ring)]) for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = emulated_ring_attention(
        q, k, v, causal=case.causal, scale=case.D**-0.5, layout=case.layout, backend=get_backend(case.backend)
    )
    o.backward(do)
    for name, got, want in zip(
        ("o", "dq", "dk", "dv"), (o.detach(), q.grad, k.grad, v.grad), reference(case).values(), strict=True
    ):
        assert_rel_close(unshard(list(got), case.layout), want, TOL[case.dtype], f"{name} ({case})")


def _header_bytes(kind: str, case: Case, n: int) -> int:
    """The bytes nanoparallel's transport adds for its own headers: (8 + 2n) int64 per message, to each
    peer before an all-to-all, once per send."""
    from repro.usp.ulysses import head_groups_for

    one = (8 + 2 * n) * 8
    if kind == "ulysses":
        groups = head_groups_for(case.head_groups, case.H_kv if case.H_kv % n == 0 else n, n)
        return 4 * groups * (n - 1) * one  # all-to-alls: in and out, forward and backward, per head group
    return ((n - 1) + (n - 1) + n) * one  # ring shifts: K/V forward, K/V backward, dK/dV backward


@pytest.mark.claim("usp/comm-volume", section=COMM_SECTION)
@settings(max_examples=6, **SETTINGS)
@given(case=st.one_of(cases(ulysses=4), cases(ring=4)), head_groups=st.integers(1, 2))
def test_bytes_match_an_independent_counter(world4, case, head_groups):
    """Ulysses or Ring over all 4 ranks through nanoparallel (our collectives library, shared memory)
    instead of gloo: the same results, and the payload its transport counted (its own counter, headers
    taken out) equals what repro.usp.comm counted and the formulas."""
    kind = "ulysses" if case.ulysses == 4 else "ring"
    case = Case(**{**case.__dict__, "head_groups": head_groups})
    results = sorted(world4.run(worker.run_nanoparallel, case, kind, timeout=90), key=lambda r: r["sp_rank"])
    ref = reference(case)
    for name, want in ref.items():
        assert_rel_close(unshard([r[name] for r in results], case.layout), want, TOL[case.dtype], name)
    elem = torch.tensor([], dtype=worker.DTYPES[case.dtype]).element_size()
    want = bytes_per_rank(
        B=case.B, S=case.S, H=case.H, H_kv=case.H_kv, D=case.D, ulysses_degree=case.ulysses,
        ring_degree=case.ring, elem=elem, acc=max(elem, 4),
    )  # fmt: skip
    for r in results:
        counted = sum(r["bytes"].values())
        assert counted == sum(want.values()), (r["bytes"], want)
        assert r["transport_bytes"] - _header_bytes(kind, case, 4) == counted


@pytest.mark.claim("usp/ulysses-exact", section=ULYSSES_SECTION)
@settings(max_examples=8, **SETTINGS)
@given(case=cases(ulysses=st.integers(2, 4), dtypes=("float64", "float32")), head_groups=st.integers(2, 4))
def test_ulysses_head_group_pipeline_exact(world4, case, head_groups):
    """The pipelined Ulysses (each rank's heads in groups whose all-to-alls overlap the other groups'
    attention) computes the same outputs and gradients, and sends the same bytes, as one group."""
    check_exact(world4, Case(**{**case.__dict__, "head_groups": head_groups}))
    with_groups = run(world4, Case(**{**case.__dict__, "head_groups": head_groups}))
    without = run(world4, case)
    for a, b in zip(with_groups, without, strict=True):
        if a is not None:
            assert a["bytes"] == b["bytes"]


@pytest.mark.claim("usp/gqa-cuts-comm", section=GQA_SECTION)
@settings(max_examples=6, **SETTINGS)
@given(case=cases(), data=st.data())
def test_gqa_cuts_the_traffic(world4, case, data):
    """With fewer K/V heads than query heads every rank sends fewer bytes, measured, than with as many
    (MHA); strictly fewer whenever the K/V heads sent, lcm(H_kv, P_u), are fewer than H, and never more."""
    h_kv = data.draw(st.sampled_from([d for d in _divisors(case.H) if d < case.H] or [case.H]))
    gqa = Case(**{**case.__dict__, "H_kv": h_kv})
    mha = Case(**{**case.__dict__, "H_kv": case.H})
    sent_gqa = [sum(r["bytes"].values()) for r in run(world4, gqa) if r is not None]
    sent_mha = [sum(r["bytes"].values()) for r in run(world4, mha) if r is not None]
    import math

    fewer = math.lcm(h_kv, case.ulysses) < case.H if h_kv % case.ulysses else h_kv < case.H
    for g, m in zip(sent_gqa, sent_mha, strict=True):
        assert g <= m
        if fewer and case.P > 1:
            assert g < m, (gqa, g, m)


@pytest.mark.claim("usp/ulysses-exact", section=ULYSSES_SECTION)
@settings(max_examples=4, **SETTINGS)
@given(case=cases(ulysses=4))
def test_ulysses_through_nanoparallel(world4, case):
    """The Ulysses all-to-all through nanoparallel (our collectives library, shared memory) instead of
    gloo: same results, same bytes counted."""
    results = sorted(
        world4.run(worker.run_nanoparallel, case, "ulysses", timeout=90), key=lambda r: r["sp_rank"]
    )
    ref = reference(case)
    for name, want in ref.items():
        assert_rel_close(unshard([r[name] for r in results], case.layout), want, TOL[case.dtype], name)
    elem = torch.tensor([], dtype=worker.DTYPES[case.dtype]).element_size()
    want = bytes_per_rank(
        B=case.B,
        S=case.S,
        H=case.H,
        H_kv=case.H_kv,
        D=case.D,
        ulysses_degree=4,
        ring_degree=1,
        elem=elem,
        acc=elem,
    )
    assert all(r["bytes"].get("ulysses/fwd") == want["ulysses/fwd"] for r in results)
