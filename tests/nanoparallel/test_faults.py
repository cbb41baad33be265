"""Failure behaviour: mismatched calls, dead, frozen and hung ranks.

Each test asserts the mechanism that caught the failure, never how many seconds it took (a loaded
2-core CI machine stretches every duration): the exception type tells which mechanism fired
(MismatchError: the header check before any data moves; PeerFailureError "is dead": the /proc
liveness check; "sent no heartbeat": the store heartbeat; CommTimeoutError: the timeout), and the
message must name the rank, the operation or the argument that differs. The only clocks are
generous guards against a hang (World.collect's timeout, pytest-timeout), far above what a
working mechanism needs and, where it matters, below the communicator's own timeout, so that a
broken detector cannot pass by timing out instead.

Every scenario runs on its own communicator (a failed one is aborted for good), and the scenarios
that kill or freeze a worker spawn a fresh world.
"""

from __future__ import annotations

import pytest

from nanoparallel import testing as T
from nanoparallel.launch import World

# What every rank's MismatchError must say, for each scenario (the header table is the same on
# every rank, so every rank names the same field and the same ranks).
MISMATCH_NAMES = {
    "mismatch-count": "element count differs: ranks [0, 2] have 100; ranks [1] have 101",
    "mismatch-op": "operation differs: ranks [0] have broadcast; ranks [1, 2] have all_reduce",
    "mismatch-dtype": "dtype differs: ranks [0] have bfloat16; ranks [1, 2] have float32",
    "mismatch-split": "all_to_all split differs: rank 0 sends 3 elements to rank 1, which expects 6",
    "invalid-args": "operation differs: ranks [0] have invalid arguments; ranks [1, 2] have all_reduce",
}


def run_scenario(world: World, scenario: str, timeout_s: float, guard_s: float, ranks=None) -> dict:
    """Run ``scenario`` on every rank; ``guard_s`` only stops a hang (it raises TimeoutError)."""
    world.submit(T.fault_case, scenario, timeout_s)
    return world.collect(timeout=guard_s, ranks=ranks)


def seen_by(res: dict, rank: int) -> dict:
    kind, payload = res[rank]
    assert kind == "ok", f"rank {rank}: the worker itself failed ({kind}): {payload}"
    return payload[0]


@pytest.mark.claim("nanoparallel/fault-mismatch", section="Abstract (arXiv 2505.14065v1)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", list(MISMATCH_NAMES))
def test_mismatch_raises_on_every_rank(worlds, scenario):
    """Disagreeing arguments: every rank raises MismatchError naming the field that differs and
    which ranks hold which value (the rank with invalid arguments: its own TypeError, and its peers
    a MismatchError naming it). A MismatchError can only come from the header check that precedes
    every collective, so the failure was caught there, not by the timeout (CommTimeoutError)."""
    res = run_scenario(worlds(3), scenario, timeout_s=30.0, guard_s=100.0)
    for r in range(3):
        seen = seen_by(res, r)
        if scenario == "invalid-args" and r == 0:
            assert seen["error"] == "TypeError", f"rank 0: {seen}"
            assert "dtype torch.complex64" in seen["message"], seen["message"]
            continue
        assert seen["error"] == "MismatchError", f"rank {r} under {scenario}: {seen}"
        assert seen["message"].startswith(f"nanoparallel rank {r}: "), seen["message"]
        assert MISMATCH_NAMES[scenario] in seen["message"], f"rank {r}: {seen['message']}"


@pytest.mark.claim("nanoparallel/fault-dead-peer", section="Abstract (arXiv 2505.14065v1)")
@pytest.mark.timeout(120)
def test_dead_rank_detected_by_liveness():
    """A rank that exits mid-job: both survivors raise PeerFailureError, the first to notice saying
    that rank 2 (its pid) is dead, the /proc liveness check's verdict; the other says the same, or,
    if the first survivor's abort reached it before its own check of rank 2 (a race a loaded machine
    shows), that this survivor aborted its communicator on seeing a dead peer (FAULTS.md's third
    row). The communicators' timeout (60 s) is longer than the guard on the whole run (50 s), so a
    survivor that waited for its timeout instead would fail the test as a hang, and one that timed
    out would raise CommTimeoutError."""
    with World(3) as world:  # a fresh world: one of its workers dies
        res = run_scenario(world, "dead-rank", timeout_s=60.0, guard_s=50.0)
    assert res[2][0] == "dead", f"rank 2 should have exited: {res[2]}"
    named = []
    for r in (0, 1):
        seen = seen_by(res, r)
        assert seen["error"] == "PeerFailureError", f"rank {r}: {seen}"
        msg = seen["message"]
        assert msg.startswith(f"nanoparallel rank {r}: "), msg
        if "rank 2 (pid" in msg and msg.endswith("is dead"):
            named.append(r)
        else:
            assert f"rank {1 - r} aborted its communicator (saw a dead peer)" in msg, f"rank {r}: {msg}"
    assert named, "no survivor named rank 2 as dead"


@pytest.mark.claim("nanoparallel/fault-timeout", section="Abstract (arXiv 2505.14065v1)")
@pytest.mark.timeout(120)
def test_hung_rank_times_out_with_context(worlds):
    """A rank that is alive but never arrives (rank 1 waits, outside any collective, until a peer
    gives up): the first peer to give up raises CommTimeoutError naming itself, the operation, its
    sequence number and the rank it waited on, and not before timeout_s had passed without progress;
    the other peer raises CommTimeoutError too or PeerFailureError for the first one's abort; rank 1,
    arriving late, finds its peers gone and raises as well."""
    timeout_s = 5.0
    res = run_scenario(worlds(3), "hung-rank", timeout_s=timeout_s, guard_s=100.0)
    waiting = {r: seen_by(res, r) for r in (0, 2)}
    for r, seen in waiting.items():
        assert seen["error"] in ("CommTimeoutError", "PeerFailureError"), f"rank {r}: {seen}"
    timed_out = {r: s for r, s in waiting.items() if s["error"] == "CommTimeoutError"}
    assert timed_out, f"nobody timed out: {waiting}"
    for r, seen in timed_out.items():
        msg = seen["message"]
        assert msg.startswith(f"nanoparallel rank {r}: "), msg
        for part in ("all_reduce", "sequence", "timed out", "rank 1"):
            assert part in msg, f"rank {r}: {part!r} missing from {msg!r}"
        # a lower bound only: the timeout may not fire early; a loaded machine only makes it later
        assert seen["seconds"] >= timeout_s, f"rank {r} timed out early: {seen}"
    late = seen_by(res, 1)
    assert late["error"] == "PeerFailureError", f"rank 1: {late}"
    assert "aborted its communicator" in late["message"], late["message"]


@pytest.mark.claim("nanoparallel/fault-dead-peer", section="Abstract (arXiv 2505.14065v1)")
@pytest.mark.timeout(120)
def test_frozen_rank_on_another_host_detected_by_heartbeat():
    """Ranks on different hosts (simulated): a rank that freezes (SIGSTOP: its sockets stay open,
    its pid stays alive) stops its store heartbeat, and the others raise PeerFailureError; the first
    to notice names the silent rank 2 ("sent no heartbeat"), the other may instead report that one's
    abort. The communicators' timeout (300 s) is far beyond the guard (60 s): only the heartbeat can
    make this pass."""
    with World(3) as world:
        try:
            res = run_scenario(world, "stopped-rank-hosts", timeout_s=300.0, guard_s=60.0, ranks=[0, 1])
        finally:
            world.procs[2].kill()
    messages = []
    for r in (0, 1):
        seen = seen_by(res, r)
        assert seen["error"] == "PeerFailureError", f"rank {r}: {seen}"
        messages.append(seen["message"])
    assert any("rank 2 sent no heartbeat" in m for m in messages), messages
