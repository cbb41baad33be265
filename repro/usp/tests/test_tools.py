"""The multi-GPU benchmark's code paths on the CPU world (gloo, 4 ranks, tiny sizes), and its parsers
(profiler timeline, NCCL log) on hand-made inputs whose answers are known."""

from __future__ import annotations

import json

import pytest
import torch

from repro.usp import timeline
from repro.usp.dist_bench import main as dist_bench_main
from repro.usp.tests import worker
from repro.usp.traffic import nccl_sent_bytes


def _trace(events):
    return {"traceEvents": events}


def _kernel(name, ts, dur, corr):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr, "stream": 7},
    }


def _launch(ts, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 1, "tid": tid,
            "args": {"correlation": corr}}  # fmt: skip


def _range(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_timeline_files_kernels_by_the_range_that_launched_them():
    """An attention kernel 0-100 us; a ring transfer launched in usp:ring running 20-60 us (hidden);
    an all-to-all 100-130 us with nothing beside it (exposed); a merge kernel 130-140 us."""
    events = [
        _range("usp:ring", 0, 5), _launch(1, 1), _kernel("ncclDevKernel_SendRecv", 20, 40, 1),
        _range("usp:attention", 5, 5), _launch(6, 2), _kernel("cudnn_sdpa_fwd_sm90", 0, 100, 2),
        _range("usp:all-to-all", 10, 5), _launch(11, 3), _kernel("ncclDevKernel_SendRecv", 100, 30, 3),
        _range("usp:merge", 15, 5), _launch(16, 4), _kernel("vectorized_elementwise_kernel", 130, 10, 4),
        _launch(17, 5), _kernel("ncclDevKernel_AllReduce", 140, 2, 5),  # no usp: range: comm (other)
    ]  # fmt: skip
    ivs = timeline.parse_trace(_trace(events))
    kinds = {iv.start: iv.kind for iv in ivs}
    assert kinds == {
        0: "attention",
        20: "ring P2P",
        100: "all-to-all",
        130: "other compute",
        140: "comm (other)",
    }
    s = timeline.summarize(ivs)
    assert s["step_ms"] == pytest.approx(0.142)
    assert s["ring_ms"] == pytest.approx(0.040) and s["all_to_all_ms"] == pytest.approx(0.030)
    assert s["compute_ms"] == pytest.approx(0.110)
    assert s["exposed_comm_ms"] == pytest.approx(0.032)  # the all-to-all and the all-reduce, not the ring
    assert s["overlap_pct"] == pytest.approx(100 * (1 - 0.032 / 0.072))
    assert s["idle_ms"] == pytest.approx(0.0)
    rows = timeline.wave_rows(ivs)
    assert {r["lane"] for r in rows} == {"compute", "all-to-all", "ring P2P"}
    assert all(r["level"] in (r["lane_index"], r["lane_index"] + 0.8) for r in rows)


def test_timeline_waves_stay_small():
    """A thousand short kernels with short gaps become at most max_pulses pulses per lane."""
    ivs = [timeline.Interval("attention", "k", 10.0 * i, 10.0 * i + 7) for i in range(1000)]
    rows = timeline.wave_rows(ivs, max_pulses=16)
    assert 0 < len(rows) <= 3 * (2 + 4 * 16)


def test_timeline_aligns_the_ranks_on_the_hosts_clock():
    """Rank 0 starts at 0 us and waits in an all-to-all until rank 1, which started at 900 us, joins:
    both ranks' rows start at 900 us; rank 0's early compute is dropped, its wait cut to begin there;
    the picture's time counts from 900 us on both ranks."""
    iv = timeline.Interval
    rank0 = [iv("attention", "a", 0, 100), iv("all-to-all", "n", 100, 1000), iv("attention", "a", 1000, 1500)]
    rank1 = [iv("all-to-all", "n", 900, 1000), iv("attention", "a", 1000, 1500)]
    start, (cut0, cut1) = timeline.aligned([rank0, rank1])
    assert start == 900
    assert cut0 == [iv("all-to-all", "n", 900, 1000), iv("attention", "a", 1000, 1500)] and cut1 == rank1
    summary, waves = timeline.config_rows([rank0, rank1])
    assert [s["step_ms"] for s in summary] == pytest.approx([0.6, 0.6])
    assert [s["exposed_comm_ms"] for s in summary] == pytest.approx([0.1, 0.1])
    assert min(w["t_ms"] for w in waves) == 0 and max(w["t_ms"] for w in waves) == pytest.approx(0.6)


def test_timeline_capture_runs_on_cpu(tmp_path):
    """profile_step writes a readable trace (on CPU it has no device intervals)."""
    path = timeline.profile_step(lambda: torch.ones(4) * 2, tmp_path / "t.json.gz", warmup=1)
    doc = timeline.load_trace(path)
    assert "traceEvents" in doc
    assert timeline.summarize(timeline.parse_trace(doc)) == {"step_ms": 0.0} or torch.cuda.is_available()


NCCL_LOG = """\
host:1:1 [0] NCCL INFO ncclCommInitRankConfig comm 0xaaa rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 1000 commId 0x1 - Init COMPLETE
host:1:1 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x1 count 100 datatype 7 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x1 count 7919 datatype 7 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO Send: opCount 2 sendbuff 0x1 recvbuff 0x0 count 1000 datatype 9 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO Send: opCount 2 sendbuff 0x1 recvbuff 0x0 count 1000 datatype 9 op 0 root 1 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO Recv: opCount 2 sendbuff 0x0 recvbuff 0x1 count 1000 datatype 9 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO AllReduce: opCount 3 sendbuff 0x1 recvbuff 0x1 count 7920 datatype 7 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO Send: opCount 4 sendbuff 0x1 recvbuff 0x0 count 10 datatype 7 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO AllToAll: opCount 5 sendbuff 0x1 recvbuff 0x2 count 8 datatype 9 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO AllReduce: opCount 6 sendbuff 0x1 recvbuff 0x1 count 7921 datatype 7 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
host:1:1 [0] NCCL INFO Send: opCount 7 sendbuff 0x1 recvbuff 0x0 count 5000 datatype 9 op 0 root 0 comm 0xaaa [nranks=2] stream 0x1
"""


def test_nccl_log_counts_sends_to_others_between_the_markers():
    """Forward: one bf16 Send of 1000 to rank 0 (2000 bytes); the Send to itself (rank 1) and the Recv
    are not traffic. Backward: a float Send of 10 (40 bytes) and an all-to-all of 8 bf16 per peer to
    one other rank (16 bytes). Outside the markers nothing counts."""
    got = nccl_sent_bytes(NCCL_LOG.splitlines(), [7919, 7920, 7921])
    assert got["fwd"] == 2000 and got["bwd"] == 56
    assert nccl_sent_bytes(NCCL_LOG.splitlines(), [1, 2, 3])["fwd"] is None  # markers not found: no number


def test_dist_bench_modes_on_the_cpu_world(world4, tmp_path):
    """The sweep, dpsp and comm modes of the multi-GPU benchmark on 4 gloo ranks (1-, 2- and 4-rank
    replicas; one round, one call: the code paths, not the times): each configuration passes its check
    against one-device attention and is timed; the comm mode's counted bytes equal the formulas; the
    summaries build from the results. (The timeline and peers modes ran in the CPU run of the plan
    itself; their parsers are tested above.)"""
    from repro.usp.ingest import ingest

    out = str(tmp_path)
    extra = "--s-per-gpu 16 --strong 64 --dpsp-s 32 --comm-s 32 --rounds 1 --max-reps 1".split()
    (docs, *_) = world4.run(worker.run_dist_bench, "sweep,dpsp,comm", out, extra, timeout=300)
    sweep = next(d for n, d in docs.items() if n.endswith("-sweep-4gpu.json"))
    rows = sweep["rows"]
    assert {r["gpus"] for r in rows} == {1, 2, 4}
    assert {(r["ulysses"], r["ring"]) for r in rows if r["gpus"] == 4} >= {(1, 4), (2, 2), (4, 1)}
    assert all(r["check"] == "ok" and r["ms"] > 0 for r in rows), [r for r in rows if r["check"] != "ok"]
    assert any(r["layout"] == "contiguous" for r in rows) and any(r["head_groups"] == 2 for r in rows)
    dpsp = next(d for n, d in docs.items() if n.endswith("-dpsp-4gpu.json"))
    assert all(r["check"] == "ok" for r in dpsp["rows"])
    raw = json.loads((tmp_path / "comm-raw-4gpu.json").read_text())
    for recs in raw["ranks"]:
        for rec in recs:
            assert rec["counted_fwd"] == rec["formula_fwd"] and rec["counted_bwd"] == rec["formula_bwd"]
    assert {rec["H_kv"] for rec in raw["ranks"][0]} == {8, 4}
    names = {p.name for p in ingest(tmp_path)}
    assert any(n.endswith("weak-scaling-4gpu.json") for n in names)
    assert any(n.endswith("strong-scaling-4gpu.json") for n in names)


def test_dist_bench_refuses_bad_modes():
    with pytest.raises(SystemExit, match=r"unknown mode\(s\) \['sweeep'\]"):
        dist_bench_main(["--mode", "sweeep", "--device", "cpu"])
