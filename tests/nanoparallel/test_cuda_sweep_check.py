"""The GPU sweep checks every implementation at each timed size against NCCL's result of the same
call before it times it (nanoparallel.cuda.sweep.Case). Here the same code runs on gloo CPU ranks,
torch.distributed standing in for both NCCL and our backend (nanoparallel.testing.GlooStandIn), so
the wiring can be seen to catch a wrong result and to pass a right one rounded differently."""

from __future__ import annotations

import pytest

from nanoparallel.cuda.sweep import COLLECTIVES
from nanoparallel.launch import spawn_ranks
from nanoparallel.testing import sweep_check_task


@pytest.mark.timeout(180)
def test_sweep_check_passes_right_results_and_catches_a_wrong_one():
    out = spawn_ranks(2, sweep_check_task, None, 150, lambda m: m[2])
    for rank, got, _ in out:
        for coll in COLLECTIVES:
            assert got[(coll, "right")] is None, (rank, coll, got[(coll, "right")])
            # rank 1's result is spoiled in its last element; the others' are right
            assert (got[(coll, "wrong")] is not None) == (rank == 1), (rank, coll, got[(coll, "wrong")])
        assert got[("all_reduce", "reordered")] is None, "a sum rounded in another order must pass"
