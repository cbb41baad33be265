"""Every collective, algorithm and CPU transport against a reference built from all ranks' inputs.

Inputs are drawn from (seed, rank), so the test process rebuilds every rank's input and computes
the reference in float64 / int64. Tolerances: exact for integers and for max/min (no rounding);
for sums the result is rounded once per addition in the tensor's dtype, so the error relative to
the float64 reference is a few ulps times log-ish depth: 1e-5 for float32/float64, 2e-2 for
bfloat16 (8 bits of mantissa), 4e-3 for float16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoparallel import testing as T
from nanoparallel.algorithms import ALGORITHMS
from paperclub.testing import assert_rel_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# 0, 1, primes, and sizes spanning many 256-byte chunks (so several channels and slot reuse)
COUNTS = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 13, 61, 257, 1021]), st.integers(0, 3000))
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
WORLD_EXAMPLES = {1: 8, 2: 40, 3: 40, 4: 30, 6: 8, 8: 10}


def run_and_check(world, key, collective, algorithm, dtype, count, op, root, seed) -> list[dict]:
    n = world.n
    res = world.run(T.run_case, key, collective, algorithm, dtype, count, op, root, seed)
    inputs = [T.make_input(seed, r, count, dtype) for r in range(n)]
    refs = T.reference(collective, inputs, op, root)
    for r in range(n):
        out = res[r]["outs"][0]
        if collective == "reduce" and r != root:
            assert bool(out), f"rank {r}: reduce changed a non-root tensor"
            continue
        ref = refs[r]
        if dtype.is_floating_point and op in ("sum", "avg"):
            assert_rel_close(out, ref, TOL[dtype], f"{collective}/{res[r]['algorithm']}/{key} rank {r}")
        else:
            assert torch.equal(out.to(ref.dtype), ref), (
                f"{collective}/{res[r]['algorithm']}/{key} rank {r}: differs"
            )
    return res


@pytest.mark.claim(
    "nanoparallel/collectives-correct", section="Abstract; Collective algorithms (arXiv 2507.04786v1)"
)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", ["shm-simple", "shm-ll", "torch"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])  # 6: recursive halving folds two extra ranks
def test_all_reduce_every_algorithm(worlds, n, key):
    """all_reduce equals the reference on every rank, for every algorithm, and all ranks agree bitwise."""
    world = worlds(n)

    @settings(
        max_examples=WORLD_EXAMPLES[n] if key != "torch" else max(WORLD_EXAMPLES[n] // 2, 2), **SETTINGS
    )
    @given(
        algorithm=st.sampled_from(("auto", *ALGORITHMS["all_reduce"])),
        dtype=st.sampled_from(DTYPES),
        op=st.sampled_from(["sum", "max", "min", "avg"]),
        count=COUNTS,
        seed=st.integers(0, 2**16),
    )
    def prop(algorithm, dtype, op, count, seed):
        res = run_and_check(world, key, "all_reduce", algorithm, dtype, count, op, 0, seed)
        first = res[0]["outs"][0]
        for r in range(1, n):
            assert torch.equal(res[r]["outs"][0].view(torch.uint8), first.view(torch.uint8)), (
                f"rank {r} != rank 0"
            )

    prop()


@pytest.mark.claim(
    "nanoparallel/collectives-correct", section="Abstract; Collective algorithms (arXiv 2507.04786v1)"
)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", ["shm-simple", "shm-ll", "torch"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_other_collectives(worlds, n, key):
    """reduce_scatter, all_gather, broadcast and reduce, every algorithm, any root."""
    world = worlds(n)
    cases = [
        (c, a)
        for c in ("reduce_scatter", "all_gather", "broadcast", "reduce")
        for a in ("auto", *ALGORITHMS[c])
    ]

    @settings(
        max_examples=WORLD_EXAMPLES[n] + 2 if key != "torch" else max(WORLD_EXAMPLES[n] // 2, 2), **SETTINGS
    )
    @given(
        case=st.sampled_from(cases),
        dtype=st.sampled_from(DTYPES),
        op=st.sampled_from(["sum", "max", "min", "avg"]),
        count=COUNTS,
        root=st.integers(0, n - 1),
        seed=st.integers(0, 2**16),
    )
    def prop(case, dtype, op, count, root, seed):
        collective, algorithm = case
        if collective == "reduce_scatter":
            count -= count % n  # input must be world_size * output
        run_and_check(world, key, collective, algorithm, dtype, count, op, root, seed)

    prop()


@pytest.mark.claim("nanoparallel/deterministic-runs", section="Abstract (arXiv 2505.14065v1)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_bitwise_deterministic(worlds, n):
    """The same inputs give the same bits twice, for every algorithm (fixed reduction order)."""
    world = worlds(n)

    @settings(max_examples=12, **SETTINGS)
    @given(
        algorithm=st.sampled_from(ALGORITHMS["all_reduce"]),
        key=st.sampled_from(["shm-simple", "shm-ll"]),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        count=st.integers(1, 3000),
        seed=st.integers(0, 2**16),
    )
    def prop(algorithm, key, dtype, count, seed):
        res = world.run(T.run_case, key, "all_reduce", algorithm, dtype, count, "sum", 0, seed, 2)
        for r in range(n):
            a, b = res[r]["outs"]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
                f"rank {r}: two runs of {algorithm} differ"
            )

    prop()


@pytest.mark.claim("nanoparallel/ring-traffic", section="Ring AllReduce (arXiv 2507.04786v1)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_moves_2_n_minus_1_over_n(worlds, n):
    """Ring all-reduce: each rank sends exactly 2(n-1)/n of the buffer (bytes counted in the transport),
    reduce-scatter and all-gather each (n-1)/n."""
    world = worlds(n)
    hdr = (n - 1) * (8 + 2 * n) * 8  # the header exchange before every collective

    @settings(max_examples=8, **SETTINGS)
    @given(
        blocks=st.integers(0, 200),
        key=st.sampled_from(["shm-simple", "shm-ll", "torch"]),
        seed=st.integers(0, 99),
    )
    def prop(blocks, key, seed):
        count = blocks * n
        nbytes = count * 4
        res = world.run(T.run_case, key, "all_reduce", "ring", torch.float32, count, "sum", 0, seed)
        for r in range(n):
            assert res[r]["sent"][0] - hdr == 2 * (n - 1) * nbytes // n
        res = world.run(T.run_case, key, "reduce_scatter", "ring", torch.float32, count, "sum", 0, seed)
        for r in range(n):
            assert res[r]["sent"][0] - hdr == (n - 1) * nbytes // n
        res = world.run(T.run_case, key, "all_gather", "ring", torch.float32, count // n, "sum", 0, seed)
        for r in range(n):
            assert res[r]["sent"][0] - hdr == (n - 1) * nbytes // n

    prop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_uneven(worlds, n):
    """all_to_all with arbitrary (also zero) split counts delivers row blocks in rank order."""
    world = worlds(n)

    @settings(max_examples=12, **SETTINGS)
    @given(
        splits=st.lists(st.lists(st.integers(0, 40), min_size=n, max_size=n), min_size=n, max_size=n),
        row=st.integers(1, 5),
        dtype=st.sampled_from(DTYPES),
        key=st.sampled_from(["shm-simple", "shm-ll", "torch"]),
        seed=st.integers(0, 2**16),
    )
    def prop(splits, row, dtype, key, seed):
        outs = world.run(T.run_all_to_all, key, splits, row, dtype, seed)
        inputs = [T.make_input(seed, s, sum(splits[s]) * row, dtype).view(-1, row) for s in range(n)]
        for r in range(n):
            parts = []
            for s in range(n):
                start = sum(splits[s][:r])
                parts.append(inputs[s][start : start + splits[s][r]])
            assert torch.equal(outs[r], torch.cat(parts)), f"rank {r}: all_to_all output differs"

    prop()
