"""The GPU peer kernels, run on CPU: three processes under TRITON_INTERPRET=1 stand in for 3 GPUs.

Each rank's staging buffer and flags are shared host memory (nanoparallel.cuda.emulate), so these
tests run the real kernels with their real flag barriers: every program of every rank copies in,
signals, waits, and reads its peers' buffers. Inputs are drawn per rank from a seed; the reference
is computed in float64 from all ranks' inputs. Tolerances: float32 sums of 3 values are within a
few ulps (1e-6); bf16/fp16 results are rounded once from a float32 sum in one-shot and two-shot
(2^-8 relative, so 1e-2), and once per ring step; integer results are exact.

Small BLOCK and chunk values make every kernel loop run several times and spread work over
several programs, so the partitioning (the part most likely to be wrong) is exercised.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanoparallel.cuda import copy_engine_pieces, pipeline_steps, ring_barriers, slice_size, split_work
from nanoparallel.cuda.emulate import EmulatedPeers
from nanoparallel.cuda.primitives import OP_CODES
from paperclub.testing import assert_rel_close

W = 3
BLOCK = 16  # elements per step: tiny, so loops iterate
MAX_PROGRAMS = 4
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.int32: 0.0, torch.int64: 0.0}
SETTINGS = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

sizes = st.one_of(st.sampled_from([1, 2, 13, 37, 64, 97]), st.integers(1, 200))
float_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
all_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])


@pytest.fixture(scope="module")
def peers():
    with EmulatedPeers(W, max_programs=MAX_PROGRAMS) as p:
        yield p


def draw_inputs(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    out = []
    for r in range(W):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        if dtype.is_floating_point:
            x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        else:
            x = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)
        out.append(x)
    return out


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([x.to(torch.float64) for x in inputs])
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.mean(0) if inputs[0].dtype.is_floating_point else torch.floor(stack.sum(0) / len(inputs))
    if op == "max":
        return stack.max(0).values
    return stack.min(0).values


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str, steps: int = 1) -> None:
    if dtype.is_floating_point:
        assert_rel_close(out, ref, TOL[dtype] * steps, name)
    else:
        assert torch.equal(out.to(torch.float64), ref), (
            f"{name}: integer result differs from the exact reference"
        )


@SETTINGS
@given(
    n=sizes, dtype=all_dtypes, op=st.sampled_from(["sum", "max", "min", "avg"]), seed=st.integers(0, 10**6)
)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_one_shot_all_reduce(peers, n, dtype, op, seed):
    inputs = draw_inputs(n, dtype, seed)
    xs = peers.shared(lambda r: inputs[r].clone())
    bufs = peers.shared(lambda r: torch.full((n,), 7, dtype=dtype))  # poisoned: must be overwritten
    chunk, grid = split_work(n, MAX_PROGRAMS, BLOCK)
    per_rank = [
        dict(inp=xs[r], out=xs[r], n=n, chunk=chunk, OP=OP_CODES[op], RANK=r, W=W, BLOCK=BLOCK)
        for r in range(W)
    ]
    peers.run("all_reduce.one_shot_all_reduce_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=1)
    ref = reference(inputs, op)
    for r in range(W):
        check(xs[r], ref, dtype, f"one-shot {op} rank {r}")
        # every rank reduces in the same order, so the results agree bit for bit
        assert torch.equal(xs[r], xs[0]), "ranks disagree"


@SETTINGS
@given(
    n=sizes, dtype=all_dtypes, op=st.sampled_from(["sum", "max", "min", "avg"]), seed=st.integers(0, 10**6)
)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_one_shot_push_all_reduce(peers, n, dtype, op, seed):
    inputs = draw_inputs(n, dtype, seed)
    S = -(-n // 64) * 64
    xs = peers.shared(lambda r: inputs[r].clone())
    bufs = peers.shared(lambda r: torch.full((W * S,), 7, dtype=dtype))
    chunk, grid = split_work(n, MAX_PROGRAMS, BLOCK)
    per_rank = [
        dict(inp=xs[r], out=xs[r], n=n, S=S, chunk=chunk, OP=OP_CODES[op], RANK=r, W=W, BLOCK=BLOCK)
        for r in range(W)
    ]
    peers.run("all_reduce.one_shot_push_all_reduce_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=1)
    ref = reference(inputs, op)
    for r in range(W):
        check(xs[r], ref, dtype, f"one-shot push {op} rank {r}")
        assert torch.equal(xs[r], xs[0]), "ranks disagree"


def launch_two_shot(peers, xs, outs, bufs, n: int, S: int, op: str, ring: bool, gather: bool) -> str:
    """Run the two-shot (or ring) kernel on every emulated rank; ``gather=False`` stops after the
    reduce-scatter half. Returns the kernel's name for messages."""
    chunk, grid = split_work(S, MAX_PROGRAMS, BLOCK)
    per_rank = [
        dict(
            inp=xs[r],
            out=outs[r],
            n=n,
            S=S,
            chunk=chunk,
            OP=OP_CODES[op],
            RANK=r,
            W=W,
            BLOCK=BLOCK,
            GATHER=gather,
        )
        for r in range(W)
    ]
    kernel = "all_reduce.ring_all_reduce_kernel" if ring else "all_reduce.two_shot_all_reduce_kernel"
    barriers = ring_barriers(W, gather) if ring else (2 if gather else 1)
    peers.run(kernel, grid, per_rank, {"buf": (bufs, "D")}, barriers=barriers)
    return kernel


@SETTINGS
@given(
    n=sizes,
    dtype=all_dtypes,
    op=st.sampled_from(["sum", "max", "avg"]),
    ring=st.booleans(),
    seed=st.integers(0, 10**6),
)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_two_shot_and_ring_all_reduce(peers, n, dtype, op, ring, seed):
    inputs = draw_inputs(n, dtype, seed)
    S = slice_size(n, W)
    xs = peers.shared(lambda r: inputs[r].clone())
    bufs = peers.shared(lambda r: torch.full((W * S,), 7, dtype=dtype))
    kernel = launch_two_shot(peers, xs, xs, bufs, n, S, op, ring, gather=True)
    ref = reference(inputs, op)
    for r in range(W):
        check(xs[r], ref, dtype, f"{kernel} {op} rank {r}", steps=W if ring else 1)
        assert torch.equal(xs[r], xs[0]), "ranks disagree: a chunk was gathered from the wrong owner"


@SETTINGS
@given(
    m=sizes,
    dtype=all_dtypes,
    op=st.sampled_from(["sum", "min", "avg"]),
    ring=st.booleans(),
    seed=st.integers(0, 10**6),
)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_reduce_scatter(peers, m, dtype, op, ring, seed):
    inputs = draw_inputs(W * m, dtype, seed)
    xs = peers.shared(lambda r: inputs[r].clone())
    outs = peers.shared(lambda r: torch.full((m,), 7, dtype=dtype))
    bufs = peers.shared(lambda r: torch.full((W * m,), 7, dtype=dtype))
    kernel = launch_two_shot(peers, xs, outs, bufs, W * m, m, op, ring, gather=False)
    ref = reference(inputs, op)
    for r in range(W):
        check(
            outs[r],
            ref[r * m : (r + 1) * m],
            dtype,
            f"reduce-scatter ({kernel}) {op} rank {r}",
            steps=W if ring else 1,
        )
        assert torch.equal(xs[r], inputs[r]), "reduce-scatter modified its input"


@SETTINGS
@given(m=sizes, dtype=all_dtypes, seed=st.integers(0, 10**6))
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_all_gather(peers, m, dtype, seed):
    inputs = draw_inputs(m, dtype, seed)
    xs = peers.shared(lambda r: inputs[r].clone())
    outs = peers.shared(lambda r: torch.full((W * m,), 7, dtype=dtype))
    bufs = peers.shared(lambda r: torch.full((m,), 7, dtype=dtype))
    chunk, grid = split_work(m, MAX_PROGRAMS, BLOCK)
    per_rank = [dict(inp=xs[r], out=outs[r], m=m, chunk=chunk, RANK=r, W=W, BLOCK=BLOCK) for r in range(W)]
    peers.run("all_gather.all_gather_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=1)
    expected = torch.cat(inputs)
    for r in range(W):
        assert torch.equal(outs[r], expected), (
            f"all-gather rank {r}: output is not the ranks' inputs in rank order"
        )


@SETTINGS
@given(n=sizes, dtype=all_dtypes, root=st.integers(0, W - 1), seed=st.integers(0, 10**6))
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_broadcast(peers, n, dtype, root, seed):
    inputs = draw_inputs(n, dtype, seed)
    xs = peers.shared(lambda r: inputs[r].clone())
    bufs = peers.shared(lambda r: torch.full((n,), 7, dtype=dtype))
    chunk, grid = split_work(n, MAX_PROGRAMS, BLOCK)
    per_rank = [dict(tensor=xs[r], n=n, chunk=chunk, root=root, RANK=r, W=W, BLOCK=BLOCK) for r in range(W)]
    peers.run("broadcast.broadcast_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=1)
    for r in range(W):
        assert torch.equal(xs[r], inputs[root]), f"broadcast from {root}: rank {r} differs"


@SETTINGS
@given(
    counts=st.lists(st.lists(st.integers(0, 40), min_size=W, max_size=W), min_size=W, max_size=W),
    dtype=all_dtypes,
    seed=st.integers(0, 10**6),
)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_all_to_all_uneven(peers, counts, dtype, seed):
    # counts[s][d]: elements rank s sends to rank d (zeros included)
    inputs = [draw_inputs(max(sum(counts[s]), 1), dtype, seed + s)[s][: sum(counts[s])] for s in range(W)]
    totals_out = [sum(counts[s][d] for s in range(W)) for d in range(W)]
    cap = max(max(sum(c) for c in counts), 1)
    xs = peers.shared(lambda r: inputs[r].clone() if inputs[r].numel() else torch.zeros(1, dtype=dtype))
    outs = peers.shared(lambda r: torch.full((max(totals_out[r], 1),), 7, dtype=dtype))
    bufs = peers.shared(lambda r: torch.full((cap,), 7, dtype=dtype))
    metas = peers.shared(
        lambda r: torch.tensor(
            [counts[r][d] for d in range(W)] + [counts[s][r] for s in range(W)], dtype=torch.int64
        )
    )
    per_rank = [dict(inp=xs[r], out=outs[r], RANK=r, W=W, WP2=4, BLOCK=BLOCK) for r in range(W)]
    peers.run(
        "all_to_all.all_to_all_kernel",
        MAX_PROGRAMS,
        per_rank,
        {"buf": (bufs, "D"), "meta": (metas, "M")},
        barriers=1,
    )
    for d in range(W):
        pieces = []
        for s in range(W):
            off = sum(counts[s][:d])
            pieces.append(inputs[s][off : off + counts[s][d]])
        expected = torch.cat(pieces)
        assert torch.equal(outs[d][: totals_out[d]], expected), (
            f"all-to-all: rank {d} received the wrong data"
        )


@SETTINGS
@given(
    counts=st.lists(st.lists(st.integers(0, 40), min_size=W, max_size=W), min_size=W, max_size=W),
    dtype=all_dtypes,
    seed=st.integers(0, 10**6),
)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_all_to_all_push_uneven(peers, counts, dtype, seed):
    slot = 48  # elements per sender in every rank's buffer: each split (<= 40) fits
    inputs = [draw_inputs(max(sum(counts[s]), 1), dtype, seed + s)[s][: sum(counts[s])] for s in range(W)]
    totals_out = [sum(counts[s][d] for s in range(W)) for d in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone() if inputs[r].numel() else torch.zeros(1, dtype=dtype))
    outs = peers.shared(lambda r: torch.full((max(totals_out[r], 1),), 7, dtype=dtype))
    bufs = peers.shared(lambda r: torch.full((W * slot,), 7, dtype=dtype))
    metas = peers.shared(
        lambda r: torch.tensor(
            [counts[r][d] for d in range(W)] + [counts[s][r] for s in range(W)], dtype=torch.int64
        )
    )
    per_rank = [dict(inp=xs[r], out=outs[r], slot=slot, RANK=r, W=W, BLOCK=BLOCK) for r in range(W)]
    peers.run(
        "all_to_all.all_to_all_push_kernel",
        MAX_PROGRAMS,
        per_rank,
        {"buf": (bufs, "D"), "meta": (metas, "M")},
        barriers=1,
    )
    for d in range(W):
        expected = torch.cat([inputs[s][sum(counts[s][:d]) : sum(counts[s][: d + 1])] for s in range(W)])
        assert torch.equal(outs[d][: totals_out[d]], expected), (
            f"all-to-all push: rank {d} received the wrong data"
        )


def launch_pipelined(peers, kernel: str, xs, outs, size: str, n: int, dtype, op: str, steps: int):
    """Run a pipelined kernel (the one-shot all-reduce, the reduce-scatter: the same arguments, as in
    all_reduce._launch_pipelined) with ``n`` elements per slot, passed as ``size``; the W
    staging slots of S >= n elements start as 7s. Returns the slots, S and the steps taken."""
    S = -(-n // 64) * 64
    bufs = peers.shared(lambda r: torch.full((W * S,), 7, dtype=dtype))
    chunk, grid = split_work(n, MAX_PROGRAMS, BLOCK)
    sub, steps = pipeline_steps(chunk, steps, BLOCK)
    per_rank = [
        dict(inp=xs[r], out=outs[r], **{size: n}, S=S, chunk=chunk, sub=sub, steps=steps, OP=OP_CODES[op],
             RANK=r, W=W, BLOCK=BLOCK)
        for r in range(W)
    ]  # fmt: skip
    peers.run(kernel, grid, per_rank, {"buf": (bufs, "D")}, barriers=steps)
    return bufs, S, steps


@SETTINGS
@given(
    n=sizes,
    dtype=all_dtypes,
    op=st.sampled_from(["sum", "max", "min", "avg"]),
    steps=st.integers(1, 5),
    seed=st.integers(0, 10**6),
)
@example(n=200, dtype=torch.float32, op="sum", steps=3, seed=1)  # 4 programs x 64, 3 steps of 32 or 16
@example(n=97, dtype=torch.int32, op="avg", steps=5, seed=2)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_one_shot_pipelined_all_reduce(peers, n, dtype, op, steps, seed):
    inputs = draw_inputs(n, dtype, seed)
    xs = peers.shared(lambda r: inputs[r].clone())
    bufs, S, steps = launch_pipelined(
        peers, "all_reduce.one_shot_pipelined_all_reduce_kernel", xs, xs, "n", n, dtype, op, steps
    )
    ref = reference(inputs, op)
    for r in range(W):
        check(xs[r], ref, dtype, f"one-shot pipelined ({steps} steps) {op} rank {r}")
        assert torch.equal(xs[r], xs[0]), "ranks disagree"
        # the own slot is never written: the rank's term comes straight from its input
        assert (bufs[r][r * S : r * S + n] == 7).all(), f"rank {r} wrote its own slot"


@SETTINGS
@given(
    m=sizes,
    dtype=all_dtypes,
    op=st.sampled_from(["sum", "max", "min", "avg"]),
    steps=st.integers(1, 5),
    seed=st.integers(0, 10**6),
)
# 4 programs x 64 elements in 4 steps of 16; the last program has 8 (one short step, three empty)
@example(m=200, dtype=torch.float32, op="sum", steps=4, seed=1)
# 4 programs x 32 in 2 steps of 16, the last program 1 element; integer floor mean
@example(m=97, dtype=torch.int32, op="avg", steps=5, seed=2)
# 3 programs x 48 in 3 steps of 16, the last program 34 (its third step short); bf16 widened sums
@example(m=130, dtype=torch.bfloat16, op="sum", steps=3, seed=3)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_reduce_scatter_pipelined(peers, m, dtype, op, steps, seed):
    inputs = draw_inputs(W * m, dtype, seed)
    xs = peers.shared(lambda r: inputs[r].clone())
    outs = peers.shared(lambda r: torch.full((m,), 7, dtype=dtype))
    bufs, S, steps = launch_pipelined(
        peers, "reduce_scatter.reduce_scatter_pipelined_kernel", xs, outs, "m", m, dtype, op, steps
    )
    ref = reference(inputs, op)
    for r in range(W):
        check(
            outs[r],
            ref[r * m : (r + 1) * m],
            dtype,
            f"reduce-scatter pipelined ({steps} steps) {op} rank {r}",
        )
        assert torch.equal(xs[r], inputs[r]), "reduce-scatter modified its input"
        assert (bufs[r][r * S : r * S + m] == 7).all(), f"rank {r} wrote its own slot"
        for q in range(W):
            if q != r:  # slot q of rank r holds rank q's slice r: what was pushed, where
                assert torch.equal(bufs[r][q * S : q * S + m], inputs[q][r * m : (r + 1) * m]), (
                    f"slot {q} of rank {r} does not hold rank {q}'s slice {r}"
                )
    # the same rank-order reduction as the direct kernel: the same bits
    direct = peers.shared(lambda r: torch.full((m,), 7, dtype=dtype))
    dbufs = peers.shared(lambda r: torch.full((W * m,), 7, dtype=dtype))
    launch_two_shot(peers, xs, direct, dbufs, W * m, m, op, ring=False, gather=False)
    for r in range(W):
        assert torch.equal(outs[r], direct[r]), (
            f"rank {r}: pipelined and direct reduce-scatter differ in bits"
        )


def test_reduce_scatter_pipelined_steps_partition():
    # the host's step split covers each program's range exactly, in whole blocks, for any step count
    for m in (1, 15, 97, 200, 4099, 65537):
        for steps in (1, 2, 3, 4, 16):
            chunk, grid = split_work(m, MAX_PROGRAMS, BLOCK)
            sub, got = pipeline_steps(chunk, steps, BLOCK)
            assert sub % BLOCK == 0 and 1 <= got <= steps
            assert got * sub >= chunk and (got - 1) * sub < chunk, (m, steps, sub, got)


def a2a_case(peers, counts, dtype, seed, slot):
    """Shared inputs, poisoned outputs and buffers, split tables, and the expected outputs."""
    inputs = [draw_inputs(max(sum(counts[s]), 1), dtype, seed + s)[s][: sum(counts[s])] for s in range(W)]
    totals_out = [sum(counts[s][d] for s in range(W)) for d in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone() if inputs[r].numel() else torch.zeros(1, dtype=dtype))
    outs = peers.shared(lambda r: torch.full((max(totals_out[r], 1),), 7, dtype=dtype))
    bufs = peers.shared(lambda r: torch.full((W * slot,), 7, dtype=dtype))
    metas = peers.shared(
        lambda r: torch.tensor(
            [counts[r][d] for d in range(W)] + [counts[s][r] for s in range(W)], dtype=torch.int64
        )
    )
    expected = [
        torch.cat([inputs[s][sum(counts[s][:d]) : sum(counts[s][: d + 1])] for s in range(W)])
        for d in range(W)
    ]
    return xs, outs, bufs, metas, expected, totals_out


@SETTINGS
@given(
    counts=st.lists(st.lists(st.integers(0, 200), min_size=W, max_size=W), min_size=W, max_size=W),
    dtype=all_dtypes,
    steps=st.integers(1, 4),
    seed=st.integers(0, 10**6),
)
# shares of 64 elements per program cut into 2 or 3 steps; splits not multiples of 16 included
@example(counts=[[200, 131, 7], [64, 192, 0], [5, 17, 160]], dtype=torch.float32, steps=3, seed=3)
@example(counts=[[190, 200, 33], [1, 150, 128], [0, 0, 199]], dtype=torch.bfloat16, steps=2, seed=4)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_all_to_all_pipelined_uneven(peers, counts, dtype, steps, seed):
    slot = 256
    xs, outs, bufs, metas, expected, totals_out = a2a_case(peers, counts, dtype, seed, slot)
    per_rank = [
        dict(inp=xs[r], out=outs[r], slot=slot, steps=steps, RANK=r, W=W, BLOCK=BLOCK) for r in range(W)
    ]
    peers.run(
        "all_to_all.all_to_all_pipelined_kernel",
        MAX_PROGRAMS,
        per_rank,
        {"buf": (bufs, "D"), "meta": (metas, "M")},
        barriers=steps,
    )
    for d in range(W):
        assert torch.equal(outs[d][: totals_out[d]], expected[d]), (
            f"all-to-all pipelined ({steps} steps): rank {d} received the wrong data"
        )
        # the own segment goes straight from input to output, never through slot d
        assert (bufs[d][d * slot : (d + 1) * slot] == 7).all(), f"rank {d} staged its own segment"


def test_all_to_all_copy_engine_schedule_in_emulation(peers):
    # the copy-engine path's host plan (pieces of every segment, slot offsets) and its barrier,
    # which compares split tables: each rank moves its pieces with tensor copies between barriers
    counts = [[5, 17, 0], [3, 33, 1], [40, 2, 9]]
    xs, outs, bufs, metas, expected, totals_out = a2a_case(peers, counts, torch.float32, 7, 48)
    for r in range(W):
        outs[r].fill_(7)
    pieces = 3
    for c in range(pieces):
        for s in range(W):
            for d, start, end in copy_engine_pieces(counts[s], s, c, pieces):
                in_off = sum(counts[s][:d])
                if d == s:  # own segment: input to output directly
                    out_off = sum(counts[q][s] for q in range(s))
                    outs[s][out_off + start : out_off + end] = xs[s][in_off + start : in_off + end]
                else:
                    bufs[d][s * 48 + start : s * 48 + end] = xs[s][in_off + start : in_off + end]
        per_rank = [dict(RANK=r, W=W) for r in range(W)]
        peers.run(
            "all_to_all.all_to_all_check_barrier_kernel", 1, per_rank, {"meta": (metas, "M")}, barriers=1
        )
        for d in range(W):
            recv = [counts[s][d] for s in range(W)]
            for s, start, end in copy_engine_pieces(recv, d, c, pieces):
                if s != d:
                    out_off = sum(recv[:s])
                    outs[d][out_off + start : out_off + end] = bufs[d][s * 48 + start : s * 48 + end]
    for d in range(W):
        assert torch.equal(outs[d][: totals_out[d]], expected[d]), f"rank {d}: pieces miss or overlap"


def test_all_to_all_check_barrier_reports_mismatch(peers):
    counts = [[2, 5, 1], [3, 3, 3], [1, 1, 1]]
    expect = [[counts[s][d] for s in range(W)] for d in range(W)]
    expect[2][1] = 4  # rank 2 expects 4 from rank 1, which sends 3
    metas = peers.shared(lambda r: torch.tensor(counts[r] + expect[r], dtype=torch.int64))
    per_rank = [dict(RANK=r, W=W) for r in range(W)]
    with pytest.raises(RuntimeError, match=r"error words set on ranks \{2: 2\}"):
        peers.run(
            "all_to_all.all_to_all_check_barrier_kernel", 1, per_rank, {"meta": (metas, "M")}, barriers=1
        )


@pytest.mark.parametrize("read", [True, False])
def test_peer_copy_kernel(peers, read):
    n = 100
    locals_ = peers.shared(lambda r: torch.arange(n, dtype=torch.float32) + 1000 * r)
    bufs = peers.shared(lambda r: torch.arange(128, dtype=torch.float32) - 500 * (r + 1))
    chunk, grid = split_work(n, MAX_PROGRAMS, BLOCK)
    per_rank = [
        dict(local=locals_[r], n=n, chunk=chunk, PEER=(r + 1) % W, READ=read, BLOCK=BLOCK) for r in range(W)
    ]
    peers.run("lab.diagnose.peer_copy_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=0)
    for r in range(W):
        nxt, prev = (r + 1) % W, (r - 1) % W
        if read:
            assert torch.equal(locals_[r], torch.arange(n, dtype=torch.float32) - 500 * (nxt + 1)), (
                f"rank {r} did not read rank {nxt}'s buffer"
            )
        else:
            assert torch.equal(bufs[r][:n], torch.arange(n, dtype=torch.float32) + 1000 * prev), (
                f"rank {r}'s buffer does not hold what rank {prev} wrote"
            )


def test_all_to_all_split_mismatch_is_reported(peers):
    # rank 0 says it sends 5 to rank 1, rank 1 expects 4: the kernel must flag it, not hide it
    counts = [[2, 5, 1], [3, 3, 3], [1, 1, 1]]
    expect = [[counts[s][d] for s in range(W)] for d in range(W)]
    expect[1][0] = 4
    xs = peers.shared(lambda r: torch.arange(sum(counts[r]), dtype=torch.float32))
    outs = peers.shared(lambda r: torch.zeros(sum(expect[r]), dtype=torch.float32))
    bufs = peers.shared(lambda r: torch.zeros(9, dtype=torch.float32))
    metas = peers.shared(lambda r: torch.tensor(counts[r] + expect[r], dtype=torch.int64))
    per_rank = [dict(inp=xs[r], out=outs[r], RANK=r, W=W, WP2=4, BLOCK=BLOCK) for r in range(W)]
    with pytest.raises(RuntimeError, match=r"error words set on ranks \{1: 2\}"):
        peers.run(
            "all_to_all.all_to_all_kernel",
            MAX_PROGRAMS,
            per_rank,
            {"buf": (bufs, "D"), "meta": (metas, "M")},
            barriers=1,
        )


def test_barrier_times_out_instead_of_hanging():
    # only two of three ranks arrive: the barrier must give up after max_spins and say so
    with EmulatedPeers(2, max_programs=1) as two:
        flags3 = [torch.zeros(3, dtype=torch.int32).share_memory_() for _ in range(3)]
        per_rank = [dict(RANK=r, W=3) for r in range(2)]
        with pytest.raises(RuntimeError, match="error words set"):
            two.run(
                "primitives.barrier_kernel", 1, per_rank, {"flags": (flags3, "F")}, barriers=1, max_spins=200
            )


def test_split_work_covers_every_element():
    for n in [1, 15, 16, 17, 1000, 4099]:
        for programs in [1, 3, 132]:
            chunk, grid = split_work(n, programs, 16)
            assert chunk % 16 == 0 and grid <= programs and grid * chunk >= n and (grid - 1) * chunk < n
