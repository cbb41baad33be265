"""The kernels of issue #35 run on CPU (TRITON_INTERPRET=1), 3 and 4 processes standing in for GPUs.

Ring broadcast (``cuda/broadcast.py``), all-gather ``pairwise`` and ``push_pipelined``
(``cuda/all_gather.py``), all-reduce ``two_shot_pipelined`` (``cuda/all_reduce.py``) and the
all-to-all ``pairwise`` (``all_to_all.all_to_all_pipelined_kernel`` with ROTATE): each against a
float64 reference (or exact, for the data-moving ones) at odd sizes, every dtype, every root, and
step counts from 1 to more steps than a program has blocks. The faults every one of them must
surface on the ranks that did come: a rank that never launches (the others' waits expire and
set the timeout bit instead of hanging) and ranks that disagree on the element count (the header
check sets the mismatch bit on every rank).

Small BLOCK and a 4-program grid make every loop run several times, so the partition into
programs and steps, the part most likely to be wrong, is exercised.
"""

from __future__ import annotations

import ast

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanoparallel.cuda import pipeline_steps, slice_size, split_work
from nanoparallel.cuda.emulate import EmulatedPeers, Schedule
from nanoparallel.cuda.primitives import ERR_SPLITS, ERR_TIMEOUT, OP_CODES
from paperclub.testing import assert_rel_close

BLOCK = 16
MAX_PROGRAMS = 4
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SETTINGS = settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
sizes = st.one_of(st.sampled_from([1, 2, 13, 37, 64, 97]), st.integers(1, 200))
dtypes = st.sampled_from(DTYPES)
steps_ = st.integers(1, 5)


@pytest.fixture(scope="module", params=[3, 4], ids=["w3", "w4"])
def peers(request):
    with EmulatedPeers(request.param, max_programs=MAX_PROGRAMS) as p:
        yield p


def draw(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def headers(peers) -> dict:
    return {"hdr": (peers.shared(lambda r: torch.zeros(8, dtype=torch.int64)), "H")}


def partition(n: int, steps: int) -> dict:
    """chunk, grid, sub and steps as the launchers compute them (split_work, pipeline_steps)."""
    chunk, grid = split_work(n, MAX_PROGRAMS, BLOCK)
    sub, steps = pipeline_steps(chunk, steps, BLOCK)
    return dict(chunk=chunk, grid=grid, sub=sub, steps=steps)


# -- the four launches, as the backend makes them ----------------------------------------------


def run_broadcast(peers, xs, n: int, root: int, steps: int, sizes=None, **kw) -> None:
    W = len(xs)
    bufs = peers.shared(lambda r: torch.full((max(n, 1),), 7, dtype=xs[0].dtype))
    parts = [partition((sizes or [n] * W)[r], steps) for r in range(W)]
    per_rank = [
        dict(tensor=xs[r], n=(sizes or [n] * W)[r], chunk=parts[r]["chunk"], sub=parts[r]["sub"],
             steps=parts[r]["steps"], root=root, tag=root, RANK=r, W=W, BLOCK=BLOCK)
        for r in range(peers.world_size)
    ]  # fmt: skip
    peers.run("broadcast.ring_broadcast_kernel", parts[0]["grid"], per_rank,
              {"buf": (bufs, "D"), **headers(peers)}, barriers=parts[0]["steps"] + 1, **kw)  # fmt: skip


def run_all_gather(peers, xs, outs, m: int, ld: int, push: bool, steps: int, sizes=None, **kw) -> None:
    W = len(xs)
    S = -(-m // 64) * 64
    bufs = peers.shared(lambda r: torch.full((W * S if push else m,), 7, dtype=xs[0].dtype))
    ms = sizes or [m] * W
    parts = [partition(ms[r], steps) for r in range(W)]
    per_rank = []
    for r in range(peers.world_size):
        args = dict(
            inp=xs[r], out=outs[r], m=ms[r], ld=ld, chunk=parts[r]["chunk"], tag=1, RANK=r, W=W, BLOCK=BLOCK
        )
        if push:
            args.update(S=S, sub=parts[r]["sub"], steps=parts[r]["steps"])
        per_rank.append(args)
    kernel = "all_gather.all_gather_push_kernel" if push else "all_gather.all_gather_pairwise_kernel"
    barriers = parts[0]["steps"] if push else 1
    peers.run(
        kernel, parts[0]["grid"], per_rank, {"buf": (bufs, "D"), **headers(peers)}, barriers=barriers, **kw
    )


def run_two_shot_pipelined(peers, xs, n: int, op: str, steps: int, sizes=None, **kw) -> int:
    W = len(xs)
    ns = sizes or [n] * W
    S = [slice_size(v, W) for v in ns]
    bufs = peers.shared(lambda r: torch.full((2 * W * max(S),), 7, dtype=xs[0].dtype))
    parts = [partition(S[r], steps) for r in range(W)]
    per_rank = [
        dict(inp=xs[r], out=xs[r], n=ns[r], S=S[r], chunk=parts[r]["chunk"], sub=parts[r]["sub"],
             steps=parts[r]["steps"], tag=OP_CODES[op], OP=OP_CODES[op], RANK=r, W=W, BLOCK=BLOCK)
        for r in range(peers.world_size)
    ]  # fmt: skip
    peers.run("all_reduce.two_shot_pipelined_all_reduce_kernel", parts[0]["grid"], per_rank,
              {"buf": (bufs, "D"), **headers(peers)}, barriers=parts[0]["steps"] + 1, **kw)  # fmt: skip
    return parts[0]["steps"]


def reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    s = torch.stack([x.to(torch.float64) for x in xs])
    if op == "sum":
        return s.sum(0)
    if op == "avg":
        return s.mean(0) if xs[0].dtype.is_floating_point else torch.floor(s.sum(0) / len(xs))
    return s.max(0).values if op == "max" else s.min(0).values


# -- correctness -------------------------------------------------------------------------------


@SETTINGS
@given(n=sizes, dtype=dtypes, root=st.integers(0, 3), steps=steps_, seed=st.integers(0, 10**6))
@example(n=200, dtype=torch.float32, root=1, steps=5, seed=1)  # 4 programs x 64 elements, steps of 16
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_ring_broadcast(peers, n, dtype, root, steps, seed):
    W = peers.world_size
    root %= W
    inputs = [draw(n, dtype, seed * 10 + r) for r in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone())
    run_broadcast(peers, xs, n, root, steps)
    for r in range(W):
        assert torch.equal(xs[r], inputs[root]), f"ring broadcast from {root}: rank {r} differs"


@SETTINGS
@given(
    m=sizes,
    dtype=dtypes,
    push=st.booleans(),
    steps=steps_,
    pad=st.integers(0, 20),
    seed=st.integers(0, 10**6),
)
@example(m=200, dtype=torch.bfloat16, push=True, steps=3, pad=0, seed=2)
@example(m=97, dtype=torch.int64, push=False, steps=1, pad=5, seed=3)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_all_gather_pairwise_and_push(peers, m, dtype, push, steps, pad, seed):
    # ld = m + pad: the row stride of a piece of a larger message (the launcher's piece loop)
    W = peers.world_size
    ld = m + pad
    inputs = [draw(m, dtype, seed * 10 + r) for r in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone())
    outs = peers.shared(lambda r: torch.full((W * ld,), 7, dtype=dtype))
    run_all_gather(peers, xs, outs, m, ld, push, steps)
    for r in range(W):
        got = outs[r].view(W, ld)
        for p in range(W):
            assert torch.equal(got[p, :m], inputs[p]), f"rank {r}: block {p} is not rank {p}'s input"
        assert (got[:, m:] == 7).all(), f"rank {r} wrote past m in a row"
        assert torch.equal(xs[r], inputs[r]), "all-gather modified its input"


@SETTINGS
@given(n=sizes, dtype=dtypes, op=st.sampled_from(["sum", "max", "min", "avg"]), steps=steps_,
       seed=st.integers(0, 10**6))  # fmt: skip
@example(n=200, dtype=torch.float32, op="sum", steps=4, seed=1)
@example(n=97, dtype=torch.int32, op="avg", steps=5, seed=2)
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_two_shot_pipelined_all_reduce(peers, n, dtype, op, steps, seed):
    W = peers.world_size
    inputs = [draw(n, dtype, seed * 10 + r) for r in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone())
    run_two_shot_pipelined(peers, xs, n, op, steps)
    ref = reduce_ref(inputs, op)
    for r in range(W):
        if dtype.is_floating_point:
            assert_rel_close(xs[r], ref, TOL[dtype], f"two_shot_pipelined {op} rank {r}")
        else:
            assert torch.equal(xs[r].to(torch.float64), ref), f"rank {r}: integer result differs"
        assert torch.equal(xs[r], xs[0]), "ranks disagree: a shard was gathered from the wrong owner"
    # the owner adds the ranks in order 0..W-1, as two_shot does: the same bits
    ys = peers.shared(lambda r: inputs[r].clone())
    S = slice_size(n, W)
    bufs = peers.shared(lambda r: torch.full((W * S,), 7, dtype=dtype))
    chunk, grid = split_work(S, MAX_PROGRAMS, BLOCK)
    per_rank = [dict(inp=ys[r], out=ys[r], n=n, S=S, chunk=chunk, OP=OP_CODES[op], RANK=r, W=W, BLOCK=BLOCK,
                     GATHER=True) for r in range(W)]  # fmt: skip
    peers.run("all_reduce.two_shot_all_reduce_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=2)
    assert torch.equal(xs[0], ys[0]), "two_shot_pipelined and two_shot differ in bits"


@SETTINGS
@given(counts=st.lists(st.integers(0, 150), min_size=16, max_size=16), dtype=dtypes, steps=st.integers(1, 4),
       seed=st.integers(0, 10**6))  # fmt: skip
@example(counts=[150, 131, 7, 64, 0, 192, 5, 17, 160, 33, 1, 128, 80, 16, 48, 99], dtype=torch.float32, steps=3,
         seed=3)  # fmt: skip
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_all_to_all_pairwise(peers, counts, dtype, steps, seed):
    W = peers.world_size
    c = [counts[s * 4 : s * 4 + W] for s in range(W)]  # c[s][d]: elements rank s sends to rank d
    slot = 160
    inputs = [draw(max(sum(c[s]), 1), dtype, seed * 10 + s)[: sum(c[s])] for s in range(W)]
    totals = [sum(c[s][d] for s in range(W)) for d in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone() if inputs[r].numel() else torch.zeros(1, dtype=dtype))
    outs = peers.shared(lambda r: torch.full((max(totals[r], 1),), 7, dtype=dtype))
    bufs = peers.shared(lambda r: torch.full((W * slot,), 7, dtype=dtype))
    metas = peers.shared(lambda r: torch.tensor(c[r] + [c[s][r] for s in range(W)], dtype=torch.int64))
    per_rank = [dict(inp=xs[r], out=outs[r], slot=slot, steps=steps, RANK=r, W=W, BLOCK=BLOCK, ROTATE=True)
                for r in range(W)]  # fmt: skip
    peers.run("all_to_all.all_to_all_pipelined_kernel", MAX_PROGRAMS, per_rank, {"buf": (bufs, "D"), "meta": (metas, "M")},
              barriers=steps)  # fmt: skip
    for d in range(W):
        expected = torch.cat([inputs[s][sum(c[s][:d]) : sum(c[s][: d + 1])] for s in range(W)])
        assert torch.equal(outs[d][: totals[d]], expected), (
            f"all-to-all pairwise: rank {d} received wrong data"
        )


# -- faults: a rank that never comes, ranks that disagree on the size ---------------------------


def launch(kind: str, peers, world: int, n: int, sizes=None, **kw) -> None:
    dtype = torch.float32
    inputs = [draw(n, dtype, r) for r in range(world)]
    xs = peers.shared(lambda r: inputs[r].clone())
    if kind == "broadcast_ring":
        run_broadcast(peers, xs, n, 0, 3, sizes=sizes, **kw)
    elif kind in ("all_gather_pairwise", "all_gather_push"):
        outs = peers.shared(lambda r: torch.zeros(world * n))
        run_all_gather(peers, xs, outs, n, n, kind.endswith("push"), 3, sizes=sizes, **kw)
    else:
        run_two_shot_pipelined(peers, xs, n, "sum", 3, sizes=sizes, **kw)


KINDS = ["broadcast_ring", "all_gather_pairwise", "all_gather_push", "two_shot_pipelined"]


@pytest.mark.parametrize("kind", KINDS)
def test_size_mismatch_raises_on_every_rank(peers, kind):
    W = peers.world_size
    sizes = [100] * W
    sizes[W - 1] = 90  # one rank calls with fewer elements
    try:
        with pytest.raises(RuntimeError, match="error words set on ranks") as info:
            launch(kind, peers, W, 100, sizes=sizes, max_spins=20_000)
    finally:
        peers.epoch += 1000  # past any flag a rank that took other steps may have left ahead
    codes = ast.literal_eval(str(info.value).split("ranks ")[1])  # {rank: error word}
    assert set(codes) == set(range(W)), f"{kind}: only ranks {sorted(codes)} noticed"
    assert all(code & ERR_SPLITS for code in codes.values()), f"{kind}: {codes} lack the mismatch bit"


def test_a_rank_that_never_comes_times_out_on_the_others():
    # three ranks of four launch: every wait gives up after max_spins and says so; the later waits
    # of the same call give up at once (the timeout bit is set), so the call ends in one timeout
    # (every kernel waits through the same two helpers, primitives._wait_for and _meet: the chain's
    # signal and the all-peer barrier stand for all four)
    W = 4
    with EmulatedPeers(W - 1, max_programs=MAX_PROGRAMS) as three:
        for kind in ("broadcast_ring", "all_gather_push"):
            three.flags = [torch.zeros(MAX_PROGRAMS * W, dtype=torch.int32).share_memory_() for _ in range(W)]
            with pytest.raises(RuntimeError, match="error words set on ranks") as info:
                launch(kind, _FourOfThree(three, W), W, 100, max_spins=300)
            codes = ast.literal_eval(str(info.value).split("ranks ")[1])
            assert set(codes) == {0, 1, 2}, f"{kind}: only ranks {sorted(codes)} noticed"
            assert all(code & ERR_TIMEOUT for code in codes.values()), f"{kind}: {codes}"


class _FourOfThree:
    """EmulatedPeers of W - 1 workers seen as a world of W whose last rank never launches: shared
    tensors for all W ranks, per-rank arguments for the W - 1 that run."""

    def __init__(self, peers: EmulatedPeers, world: int) -> None:
        self._peers, self.world = peers, world

    @property
    def world_size(self) -> int:
        return self._peers.world_size

    def shared(self, make) -> list[torch.Tensor]:
        return [make(r).contiguous().share_memory_() for r in range(self.world)]

    def run(self, kernel, grid, per_rank, symmetric, barriers, **kw):
        self._peers.run(kernel, grid, per_rank[: self.world_size], {"flags": (self._peers.flags, "F"), **symmetric},
                        barriers, **kw)  # fmt: skip


def test_link_probe_moves_what_each_pattern_says(peers):
    # diagnose's raw-copy probe: writes land in slot `rank` of each peer's buffer, reads fill
    # local[p*n:] from peer p's slot for `rank`; ranks idle in a pattern touch nothing
    from nanoparallel.cuda.lab.diagnose import PATTERNS, peers_of

    W, n, block = peers.world_size, 40, BLOCK
    chunk, grid = split_work(n, MAX_PROGRAMS, block)
    for pattern in PATTERNS:
        for read in (False, True):
            locals_ = peers.shared(lambda r: torch.arange(W * n, dtype=torch.float32) + 1000 * r)
            bufs = peers.shared(lambda r: torch.arange(W * n, dtype=torch.float32) - 1000 * (r + 1))
            before_l, before_b = [t.clone() for t in locals_], [t.clone() for t in bufs]
            per_rank = [
                dict(local=locals_[r], n=n, chunk=chunk, PEERS=sum(1 << p for p in peers_of(pattern, r, W)), READ=read,
                     RANK=r, W=W, BLOCK=block)
                for r in range(W)
            ]  # fmt: skip
            peers.run("lab.diagnose.link_probe_kernel", grid, per_rank, {"buf": (bufs, "D")}, barriers=0)
            for r in range(W):
                for p in range(W):
                    active = p in peers_of(pattern, r, W)
                    if read:  # my local block p holds peer p's slot r
                        want = (
                            before_b[p][r * n : (r + 1) * n] if active else before_l[r][p * n : (p + 1) * n]
                        )
                        assert torch.equal(locals_[r][p * n : (p + 1) * n], want), (pattern, r, p)
                    else:  # peer p's slot r holds my first n elements
                        want = before_l[r][:n] if active else before_b[p][r * n : (r + 1) * n]
                        assert torch.equal(bufs[p][r * n : (r + 1) * n], want), (pattern, r, p)


def test_launchers_cut_pieces_and_pass_their_arguments_in_order(peers):
    # the launchers themselves (not only the kernels) on an emulated backend whose staging_cap of
    # 4 KiB cuts 2500 elements into pieces of 1024 (f32) or 2048 (bf16): the piece loop, the row
    # stride of the all-gathers' output, the positional arguments, the epochs, the headers
    W = peers.world_size
    n = 2500
    inputs = [draw(n, torch.float32, 50 + r) for r in range(W)]
    xs = peers.shared(lambda r: inputs[r].clone())
    peers.run_launcher("broadcast.broadcast_ring", [(xs[r], 1) for r in range(W)], 4096, 4, 3)
    assert all(torch.equal(xs[r], inputs[1]) for r in range(W)), "ring broadcast in pieces"
    for algo in ("pairwise", "push_pipelined"):
        halves = [draw(n, torch.bfloat16, 60 + r) for r in range(W)]
        ins = peers.shared(lambda r, h=halves: h[r].clone())
        outs = peers.shared(lambda r: torch.full((W * n,), 7, dtype=torch.bfloat16))
        peers.run_launcher(
            "all_gather.all_gather_new", [(outs[r], ins[r], algo) for r in range(W)], 4096, 4, 2
        )
        assert all(torch.equal(outs[r], torch.cat(halves)) for r in range(W)), f"all-gather {algo} in pieces"
    ys = peers.shared(lambda r: inputs[r].clone())
    peers.run_launcher("all_reduce.all_reduce_two_shot_pipelined", [(ys[r], OP_CODES["sum"]) for r in range(W)],
                       1 << 20, 4, 3)  # fmt: skip
    ref = reduce_ref(inputs, "sum")
    for r in range(W):
        assert_rel_close(ys[r], ref, TOL[torch.float32], f"two_shot_pipelined launcher rank {r}")


# -- as a GPU runs them: every program at once, in any order, and calls back to back ------------
# The sequential interpreter runs program b of every rank at the same moment and finishes a call on
# every rank before the next: a kernel whose program waits for another program of its own launch,
# or that overwrites a buffer a slow peer still reads, passes there and hangs or corrupts on a GPU.
# emulate.Schedule runs the programs as threads instead (all resident, started in a different order
# on every rank, or fewer resident than the grid, dispatched in index order as a GPU's block
# scheduler does), and run_launcher(calls=...) runs calls back to back with a late rank.

CONCURRENT = (Schedule(resident=MAX_PROGRAMS, order="shuffled", seed=7), Schedule(resident=2, order="index"))


@pytest.fixture(scope="module")
def four():
    with EmulatedPeers(4, max_programs=MAX_PROGRAMS) as p:
        yield p


@pytest.mark.parametrize("schedule", CONCURRENT, ids=["all-resident-shuffled", "two-resident-in-order"])
def test_new_kernels_with_programs_running_at_once(four, schedule):
    W, n = 4, 200  # 4 programs of 64 elements, steps of 16 (BLOCK): every loop runs several times
    inputs = [draw(n, torch.float32, 70 + r) for r in range(W)]
    xs = four.shared(lambda r: inputs[r].clone())
    run_two_shot_pipelined(four, xs, n, "sum", 3, schedule=schedule)
    ref = reduce_ref(inputs, "sum")
    for r in range(W):
        assert_rel_close(xs[r], ref, TOL[torch.float32], f"two_shot_pipelined rank {r} ({schedule})")
    xs = four.shared(lambda r: inputs[r].clone())
    run_broadcast(four, xs, n, 2, 3, schedule=schedule)
    assert all(torch.equal(xs[r], inputs[2]) for r in range(W)), f"ring broadcast ({schedule})"
    xs = four.shared(lambda r: inputs[r].clone())
    outs = four.shared(lambda r: torch.full((W * n,), 7.0))
    run_all_gather(four, xs, outs, n, n, True, 3, schedule=schedule)
    assert all(torch.equal(outs[r], torch.cat(inputs)) for r in range(W)), f"push all-gather ({schedule})"


def test_two_shot_pipelined_calls_back_to_back_with_a_late_rank(four):
    # four calls per rank without a host barrier between them (staging buffers and headers
    # alternate, so calls 0 and 2 share a buffer), sizes that change the grid and the steps, every
    # program at once; rank 0 starts each call late, so the others run a call ahead of it
    W = 4
    sizes = [2500, 97, 1800, 2500]  # pieces of 1024 (4 KiB staging cap): 3, 1, 2, 3 launches
    inputs = [[draw(n, torch.float32, 100 * c + r) for r in range(W)] for c, n in enumerate(sizes)]
    ys = [four.shared(lambda r, c=c: inputs[c][r].clone()) for c in range(len(sizes))]
    calls = [[(ys[c][r], OP_CODES["sum"]) for r in range(W)] for c in range(len(sizes))]
    four.run_launcher("all_reduce.all_reduce_two_shot_pipelined", calls[0], 8192, MAX_PROGRAMS, 3,
                      schedule=CONCURRENT[0], calls=calls, skew_s={0: 0.3})  # fmt: skip
    for c in range(len(sizes)):
        ref = reduce_ref(inputs[c], "sum")
        for r in range(W):
            assert_rel_close(ys[c][r], ref, TOL[torch.float32], f"call {c} rank {r}")


def test_the_barriers_need_every_program_resident_or_the_same_order(four):
    # what the backend's grid rule protects: with one resident program per rank and a different
    # dispatch order on each rank, program b of one rank waits for program b of a peer that is not
    # running; the waits expire and say so (on a GPU, the same launch would hang until timeout_s)
    W, schedule = 4, Schedule(resident=1, order="shuffled", seed=3)
    assert len({tuple(schedule.programs(MAX_PROGRAMS, r, 1)) for r in range(W)}) > 1
    inputs = [draw(200, torch.float32, r) for r in range(W)]
    xs = four.shared(lambda r: inputs[r].clone())
    try:
        with pytest.raises(RuntimeError, match="error words set on ranks") as info:
            run_two_shot_pipelined(four, xs, 200, "sum", 3, max_spins=1000, schedule=schedule)
    finally:
        four.epoch += 1000  # past any flag a rank left ahead
    codes = ast.literal_eval(str(info.value).split("ranks ")[1])
    assert any(code & ERR_TIMEOUT for code in codes.values()), codes
