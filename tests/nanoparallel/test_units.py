"""Single-process tests: tree shapes, block splits, the LL flag protocol, the cost model, API errors."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import nanoparallel as npl
from nanoparallel import cost_model
from nanoparallel.algorithms.common import blocks
from nanoparallel.algorithms.tree import binomial_tree, double_binary_trees, tree_depth
from nanoparallel.transport.base import Recv, Send
from nanoparallel.transport.shm import ShmTransport


@pytest.mark.claim("nanoparallel/tree-log-depth", section="Tree AllReduce (arXiv 2507.04786v1)")
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 512))
def test_double_binary_tree_shape(n):
    """Both trees span all ranks with at most 2 children each, depth <= floor(log2 n); for even n
    no rank is interior in both trees (the property that lets the two trees share the links)."""
    trees = double_binary_trees(n)
    interior = []
    for parent, children in trees:
        roots = [r for r in range(n) if parent[r] is None]
        assert len(roots) == 1
        assert all(len(c) <= 2 for c in children)
        for r in range(n):
            for c in children[r]:
                assert parent[c] == r
        assert tree_depth(parent) <= max(int(math.log2(n)), 0)
        interior.append({r for r in range(n) if children[r]})
    if n % 2 == 0:
        assert not (interior[0] & interior[1]), f"ranks interior in both trees: {interior[0] & interior[1]}"
    bp, _ = binomial_tree(n, root=n // 2)
    assert tree_depth(bp) <= math.ceil(math.log2(n)) if n > 1 else True


@settings(max_examples=50, deadline=None)
@given(count=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_blocks_partition(count, parts):
    b = blocks(count, parts)
    assert b[0][0] == 0 and b[-1][1] == count
    assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1


def _pair(protocol: str, slot_bytes: int = 256, nslots: int = 2):
    store = dist.HashStore()
    out = [None, None]

    def make(r):
        out[r] = ShmTransport(
            r,
            2,
            store,
            "t",
            protocol=protocol,
            slot_bytes=slot_bytes,
            nslots=nslots,
            n_channels=1,
            timeout_s=5.0,
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.claim("nanoparallel/ll-protocol", section="Communication protocols: LL (arXiv 2507.04786v1)")
@settings(max_examples=25, deadline=None)
@given(nbytes=st.integers(1, 2000), seed=st.integers(0, 1000), torn=st.integers(0, 10_000))
def test_ll_flags_gate_every_line(nbytes, seed, torn):
    """LL: data travels as 8-byte lines of 4 data bytes + a 4-byte flag. A chunk is accepted only
    when every line carries the current step's flag: a torn write (one line still stale) is
    rejected, and the complete chunk is delivered intact. Half of every slot is flags."""
    a, b = _pair("ll")
    assert a.chunk_bytes == a.slot_bytes // 2
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    got = torch.zeros(nbytes, dtype=torch.uint8)
    send, recv = Send(1, data), Recv(0, got)
    for op in (send, recv):  # what run() sets up, for driving the primitives by hand
        op._bytes, op._next, op._nchunks = (
            op.data.view(torch.uint8) if op is send else got,
            [0],
            -(-nbytes // a.chunk_bytes),
        )
    for k in range(send._nchunks):
        assert a._try_send(1, 0, send, k)
        slot = b.inn[0][0].lines[k % b.nslots]
        lo = k * a.chunk_bytes
        nlines = -(-min(a.chunk_bytes, nbytes - lo) // 4)
        line = torn % nlines
        saved = slot[line].clone()
        slot[line, 1] = 0  # tear: this line's flag is stale
        assert not b._try_recv(0, 0, recv, k), "accepted a chunk with a stale line"
        slot[line] = saved
        assert b._try_recv(0, 0, recv, k)
    assert torch.equal(got, data)
    a.close()
    b.close()


@pytest.mark.claim(
    "nanoparallel/simple-protocol", section="Communication protocols: Simple (arXiv 2507.04786v1)"
)
@settings(max_examples=10, deadline=None)
@given(nbytes=st.integers(1, 3000), nslots=st.integers(1, 4))
def test_simple_flag_and_backpressure(nbytes, nslots):
    """Simple: the receiver sees nothing before the sender publishes the tail flag, and a sender
    never overwrites a slot the receiver has not released (at most nslots chunks in flight)."""
    a, b = _pair("simple", nslots=nslots)
    data = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    got = torch.zeros(nbytes, dtype=torch.uint8)
    send, recv = Send(1, data), Recv(0, got)
    n = -(-nbytes // a.chunk_bytes)
    for op, buf in ((send, data), (recv, got)):
        op._bytes, op._next, op._nchunks = buf, [0], n
    assert not b._try_recv(0, 0, recv, 0)
    sent = 0
    while sent < n and a._try_send(1, 0, send, sent):
        sent += 1
    assert sent == min(n, nslots), "sender ran past the free slots"
    for k in range(n):
        assert b._try_recv(0, 0, recv, k)
        if sent < n:
            assert a._try_send(1, 0, send, sent)
            sent += 1
    assert torch.equal(got, data)
    a.close()
    b.close()


@pytest.mark.claim("nanoparallel/auto-cost-model", section="Abstract (arXiv 2507.04786v1)")
@settings(max_examples=100, deadline=None)
@given(
    alpha=st.floats(1e-7, 1e-3),
    beta=st.floats(1e-12, 1e-8),
    gamma=st.floats(1e-12, 1e-8),
    n=st.integers(2, 64),
    nbytes=st.integers(0, 1 << 30),
)
def test_auto_picks_the_cheapest_prediction(alpha, beta, gamma, n, nbytes):
    """auto = argmin of the alpha-beta predictions; predictions grow with size; with a large alpha
    and a tiny message a logarithmic-latency algorithm wins over the ring once n is large."""
    prm = cost_model.Params(alpha, beta, gamma)
    names = npl.ALGORITHMS["all_reduce"]
    pick = cost_model.choose("all_reduce", names, n, nbytes, prm)
    times = {a: cost_model.predict("all_reduce", a, n, nbytes, prm) for a in names}
    assert times[pick] == min(times.values())
    for a in names:
        assert cost_model.predict("all_reduce", a, n, nbytes + 4096, prm) >= times[a]
    if n >= 16:
        tiny = cost_model.choose("all_reduce", names, n, 8, cost_model.Params(1e-3, 1e-12, 1e-12))
        assert tiny in ("tree", "rhd")


def test_fit_alpha_beta_recovers_a_line():
    sizes = [8, 1024, 1 << 16, 1 << 20, 1 << 22]
    a, b = cost_model.fit_alpha_beta(sizes, [3e-6 + s * 2e-10 for s in sizes])
    assert abs(a - 3e-6) / 3e-6 < 1e-6 and abs(b - 2e-10) / 2e-10 < 1e-6


def test_single_rank_world_and_bad_arguments():
    store = dist.HashStore()
    comm = npl.init(0, 1, store=store, transport="shm")
    x = torch.arange(10, dtype=torch.float32)
    for alg in npl.ALGORITHMS["all_reduce"]:
        assert torch.equal(comm.all_reduce(x.clone(), algorithm=alg), x)
    assert torch.equal(comm.all_reduce(torch.tensor([-3, 4]), op="avg"), torch.tensor([-3, 4]))
    out = torch.empty(10)
    comm.all_gather(out, x)
    assert torch.equal(out, x)
    comm.reduce_scatter(out, x)
    comm.broadcast(x, root=0)
    comm.reduce(x, root=0)
    comm.all_to_all(out, x)
    comm.barrier()
    with pytest.raises(ValueError, match="algorithm must be"):
        comm.all_reduce(x, algorithm="bogus")
    comm.close()
    comm = npl.init(0, 1, store=store, transport="shm")
    with pytest.raises(TypeError, match="dtype torch.complex64"):
        comm.all_reduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(npl.CommAbortedError):
        comm.all_reduce(x)  # the failed call aborted the communicator
    comm.close()
    comm = npl.init(0, 1, store=store)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4).t())
    comm.close()
    comm = npl.init(0, 1, store=store)
    with pytest.raises(ValueError, match="output has 3 elements"):
        comm.all_gather(torch.empty(3), torch.empty(2))
    comm.close()
    with pytest.raises(ValueError, match="rank must be"):
        npl.init(2, 2, store=store)
    with pytest.raises(ValueError, match="transport must be"):
        npl.init(0, 1, store=store, transport="mpi")


def test_cuda_transport_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError, match="cuda"):
        npl.init(0, 1, store=dist.HashStore(), transport="cuda", device="cpu")


def test_default_store_from_torchrun_environment(monkeypatch):
    """Without a store, init reads MASTER_ADDR / MASTER_PORT like torchrun sets them."""
    from nanoparallel.launch import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    comm = npl.init(0, 1)
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.ones(3))
    comm.close()
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        npl.init(0, 1)


@pytest.mark.timeout(120)
def test_calibration_is_cached_and_used(worlds, tmp_path):
    """calibrate() gives positive alpha/beta/gamma/delta, the same on every rank, and round-trips
    through the JSON cache."""
    from nanoparallel import testing as T

    path = tmp_path / "calibration.json"
    got = worlds(2).run(T.calibrate_task, str(path))
    assert got[0] == got[1], "ranks adopted different parameters"
    for k in ("alpha", "beta", "gamma", "delta"):
        assert got[0][k] > 0
    loaded = cost_model.load("shm-simple", path)
    assert loaded is not None and loaded.alpha == got[0]["alpha"]


@pytest.mark.timeout(120)
def test_spawn_ranks_collects_every_rank_and_stops_at_a_crash():
    """spawn_ranks (the GPU sweep's and diagnosis's launcher): one message per rank; a rank that
    reports a crash ends the run with its text instead of leaving the others waiting."""
    from nanoparallel.launch import spawn_ranks
    from nanoparallel.testing import spawn_echo

    out = spawn_ranks(2, spawn_echo, {}, 60, crashed=lambda m: m[2])
    assert sorted(out) == [(0, 2, None), (1, 2, None)]
    with pytest.raises(SystemExit, match="rank 1 crashed on purpose"):
        spawn_ranks(2, spawn_echo, {"crash": 1}, 60, crashed=lambda m: m[2])
