"""Failure behaviour: mismatched calls, dead and hung ranks. Each finishes within its bound.

Every scenario spawns a fresh world (a failed communicator is unusable and a dead rank is gone).
"""

from __future__ import annotations

import time

import pytest

from nanoparallel import testing as T
from nanoparallel.launch import World


def run_scenario(world: World, scenario: str, timeout_s: float) -> dict:
    world.submit(T.fault_case, scenario, timeout_s)
    return world.collect(timeout=timeout_s * 4 + 30)


@pytest.mark.claim("nanoparallel/fault-mismatch", section="Fault tolerance")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scenario", ["mismatch-count", "mismatch-op", "mismatch-dtype", "mismatch-split", "invalid-args"]
)
def test_mismatch_raises_on_every_rank(worlds, scenario):
    """Disagreeing arguments: every rank raises MismatchError (the bad rank: its ValueError/TypeError),
    well before the timeout, naming what differs."""
    timeout_s = 30.0
    res = run_scenario(worlds(3), scenario, timeout_s)  # each scenario builds its own communicator
    for r, (kind, payload) in res.items():
        assert kind == "ok", f"rank {r}: worker {kind}"
        seen = payload[0]
        assert seen["error"] is not None, f"rank {r}: no error for {scenario}"
        assert seen["seconds"] < timeout_s / 3, f"rank {r}: took {seen['seconds']:.1f}s"
        if scenario == "invalid-args" and r == 0:
            assert seen["error"] == "TypeError" and "dtype" in seen["message"]
        else:
            assert seen["error"] == "MismatchError", f"rank {r}: {seen}"
            assert "differs" in seen["message"]


@pytest.mark.claim("nanoparallel/fault-dead-peer", section="Fault tolerance")
@pytest.mark.timeout(120)
def test_dead_rank_detected_quickly():
    """A rank that exits mid-job: the survivors raise PeerFailureError naming it, in well under the
    timeout (the liveness check polls /proc and the peers' abort words while waiting)."""
    timeout_s = 60.0
    t0 = time.monotonic()
    with World(3) as world:  # a fresh world: one of its workers dies
        res = run_scenario(world, "dead-rank", timeout_s)
    assert res[2][0] == "dead"
    for r in (0, 1):
        kind, payload = res[r]
        seen = payload[0]
        assert seen["error"] == "PeerFailureError", f"rank {r}: {seen}"
        assert "rank 2" in seen["message"]
        assert seen["seconds"] < 5.0, f"rank {r} needed {seen['seconds']:.1f}s to notice"
    assert time.monotonic() - t0 < 60


@pytest.mark.claim("nanoparallel/fault-timeout", section="Fault tolerance")
@pytest.mark.timeout(60)
def test_hung_rank_times_out_with_context(worlds):
    """A rank that is alive but never arrives: the others raise a TimeoutError after timeout_s that
    names the rank, the peer, the operation and the step."""
    timeout_s = 2.0
    res = run_scenario(worlds(3), "hung-rank", timeout_s)
    for r in (0, 2):
        seen = res[r][1][0]
        assert seen["error"] in ("CommTimeoutError", "PeerFailureError"), f"rank {r}: {seen}"
        assert seen["seconds"] < timeout_s + 3.0
    first = [res[r][1][0] for r in (0, 2) if res[r][1][0]["error"] == "CommTimeoutError"]
    assert first, "nobody timed out"
    msg = first[0]["message"]
    assert "all_reduce" in msg and "rank 1" in msg and "timed out" in msg and "sequence" in msg
    assert res[1][1][0]["error"] is not None  # the late rank finds its peers gone


@pytest.mark.claim("nanoparallel/fault-dead-peer", section="Fault tolerance")
@pytest.mark.timeout(120)
def test_frozen_rank_on_another_host_detected_by_heartbeat():
    """Ranks on different hosts (simulated): a rank that freezes (SIGSTOP: its sockets stay open,
    its pid stays alive) stops its store heartbeat, and the others raise PeerFailureError naming it
    within a few heartbeats, long before the 60 s timeout."""
    timeout_s = 60.0
    with World(3) as world:
        world.submit(T.fault_case, "stopped-rank-hosts", timeout_s)
        try:
            res = world.collect(timeout=40, ranks=[0, 1])
        finally:
            world.procs[2].kill()
    messages = []
    for r in (0, 1):
        kind, payload = res[r]
        assert kind == "ok", f"rank {r}: {kind} {payload}"
        seen = payload[0]
        assert seen["error"] == "PeerFailureError", f"rank {r}: {seen}"
        assert seen["seconds"] < 10.0, f"rank {r} needed {seen['seconds']:.1f}s"
        messages.append(seen["message"])
    # the first to notice names the silent rank; the other may instead see that one's abort
    assert any("rank 2 sent no heartbeat" in m for m in messages), messages
