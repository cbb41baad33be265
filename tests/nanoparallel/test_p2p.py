"""Point-to-point send/recv through the Communicator."""

from __future__ import annotations

import pytest
import torch

from nanoparallel import testing as T


def ring_pass(ctx, key, count, dtype, seed):
    comm = T.comm_for(ctx, key)
    r, n = ctx["rank"], ctx["world_size"]
    x = T.make_input(seed, r, count, dtype)
    got = torch.empty_like(x)
    # even ranks send first, odd receive first: no cycle of waits even with tiny buffers
    if r % 2 == 0:
        comm.send(x, (r + 1) % n)
        comm.recv(got, (r - 1) % n)
    else:
        comm.recv(got, (r - 1) % n)
        comm.send(x, (r + 1) % n)
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", ["shm-simple", "shm-ll", "torch"])
def test_send_recv_ring(worlds, key):
    world = worlds(4)
    for count, dtype, seed in [(0, torch.float32, 1), (1, torch.int64, 2), (1001, torch.bfloat16, 3)]:
        outs = world.run(ring_pass, key, count, dtype, seed)
        for r in range(4):
            assert torch.equal(outs[r], T.make_input(seed, (r - 1) % 4, count, dtype))


@pytest.mark.timeout(60)
def test_all_reduce_out_of_place(worlds):
    world = worlds(2)
    res = world.run(T.out_of_place, "shm-simple", 1000, 7)
    ref = T.make_input(7, 0, 1000, torch.float32) + T.make_input(7, 1, 1000, torch.float32)
    for y, _x, untouched in res:
        assert untouched, "all_reduce(out=...) modified its input"
        assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
