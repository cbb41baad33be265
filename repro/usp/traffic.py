"""Bytes on the wire: what one forward and backward of USP sends per rank, four ways.

:func:`mode_comm` (a mode of :mod:`repro.usp.dist_bench`) runs every split of the world, MHA against
GQA, and records per rank the bytes repro.usp.comm counted, the formulas of :mod:`repro.usp.cost`,
and the NVLink data counters over the same region; it brackets the forward and the backward with
marker all-reduces of unusual sizes. After the run (NCCL writes its log a line at a time),
:func:`comm_report` reads NCCL's own log (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL,
NCCL_DEBUG_FILE) between the markers (:func:`nccl_sent_bytes`) and writes the Report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from paperclub.bench import Report
from repro.usp import count_bytes, shard, usp_attention
from repro.usp.cost import bytes_per_rank
from repro.usp.dist_harness import PACKAGES, Ctx, _env, _free, _grad, make_inputs, splits, time_ms

__all__ = ["comm_report", "mode_comm", "nccl_sent_bytes"]


_MARK_BASE = 7919  # all-reduce element counts that mark the measured region in NCCL's log


def _nvlink_tx_bytes(ctx: Ctx) -> int | None:
    """Bytes this GPU has sent over NVLink so far (the data counters of ``nvidia-smi nvlink -gt d``),
    or None where they cannot be read."""
    if not ctx.cuda:
        return None
    try:
        props = torch.cuda.get_device_properties(ctx.device)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        out = subprocess.run(["nvidia-smi", "nvlink", "-gt", "d", "-i", bus], capture_output=True, text=True,
                             timeout=20).stdout  # fmt: skip
        vals = [int(x) for x in re.findall(r"Data Tx:\s*(\d+)\s*KiB", out)]
        return sum(vals) * 1024 if vals else None
    except Exception:
        return None


def mode_comm(ctx: Ctx, args) -> None:
    """Bytes sent per rank by one forward and one backward, for every split of the world and for MHA
    (H_kv = H) against GQA: counted, the formulas, NVLink counters; NCCL's log is read afterwards."""
    S = args.comm_s or (1024 if ctx.smoke else 32768)
    records = []
    i = 0
    for pu, pr in splits(ctx, ctx.world):
        for h_kv in dict.fromkeys((ctx.H, ctx.H_kv)):
            if ctx.left() < 10:
                break
            full = make_inputs(ctx, 1, S, h_kv=h_kv)
            ug, rg = ctx.groups(pu, pr)
            q, k, v, do = (shard(t, ctx.world, ctx.rank, "zigzag").contiguous() for t in full)
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            fwd = lambda leaves=leaves, ug=ug, rg=rg: usp_attention(  # noqa: E731
                *leaves, causal=True, ulysses_group=ug, ring_group=rg, layout="zigzag"
            )
            _grad(fwd(), leaves, do)  # warm-up: lazy NCCL communicators are created outside the region
            ctx.sync()
            marks = [_MARK_BASE + 3 * i + j for j in range(3)]
            tx0 = _nvlink_tx_bytes(ctx)
            dist.all_reduce(torch.zeros(marks[0], device=ctx.device))
            with count_bytes() as sent_fwd:
                o = fwd()
                ctx.sync()
            dist.all_reduce(torch.zeros(marks[1], device=ctx.device))
            with count_bytes() as sent_bwd:
                _grad(o, leaves, do)
                ctx.sync()
            dist.all_reduce(torch.zeros(marks[2], device=ctx.device))
            ctx.sync()
            tx1 = _nvlink_tx_bytes(ctx)
            formula = bytes_per_rank(B=1, S=S, H=ctx.H, H_kv=h_kv, D=ctx.D, ulysses_degree=pu, ring_degree=pr,
                                     elem=full[0].element_size(), acc=4)  # fmt: skip
            ms = time_ms(ctx, lambda fwd=fwd, leaves=leaves, do=do: _grad(fwd(), leaves, do), 3)
            records.append(dict(
                split=f"{pu}x{pr}", ulysses=pu, ring=pr, H_kv=h_kv, S=S, marks=marks, rank=ctx.rank, pid=os.getpid(),
                counted_fwd=sum(sent_fwd.values()), counted_bwd=sum(sent_bwd.values()),
                counted=dict(sent_fwd) | {k2: v2 for k2, v2 in sent_bwd.items()},
                formula_fwd=formula["ulysses/fwd"] + formula["ring/fwd"], formula_bwd=formula["ulysses/bwd"] + formula["ring/bwd"],
                nvlink_tx=None if tx0 is None or tx1 is None else tx1 - tx0, ms=ms,
            ))  # fmt: skip
            i += 1
            del full, leaves
            _free(ctx)
    got = [None] * ctx.world
    dist.all_gather_object(got, records)
    if ctx.rank == 0:
        ctx.out.mkdir(parents=True, exist_ok=True)
        doc = {"world": ctx.world, "H": ctx.H, "D": ctx.D, "ranks": got,
               "nccl_debug_file": os.environ.get("NCCL_DEBUG_FILE"), "env": _env(ctx)}  # fmt: skip
        (ctx.out / f"comm-raw-{ctx.world}gpu.json").write_text(json.dumps(doc, indent=1, default=str))
        print(f"[comm] {len(records)} configurations per rank recorded", flush=True)


_NCCL_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
_COLL = re.compile(
    r"(\w+): opCount \S+ sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) op -?\d+ (?:root|peer) (-?\d+) "
    r"comm (0x[0-9a-f]+)(?:.*?\[nranks=(\d+)\])?"
)
_INIT = re.compile(r"comm (0x[0-9a-f]+) rank (\d+) nranks (\d+)", re.IGNORECASE)


def nccl_sent_bytes(lines: list[str], marks: list[int]) -> dict:
    """Bytes NCCL was asked to send to other ranks between the marker all-reduces of ``marks``
    (three counts: begin, between forward and backward, end), from an NCCL_DEBUG=INFO
    (NCCL_DEBUG_SUBSYS=INIT,COLL) log: Send calls to a peer other than the caller's own rank in that
    communicator, and AllToAll calls ((nranks - 1) x count elements). Returns fwd, bwd and the op
    names seen; None values where the markers are missing."""
    my_rank: dict[str, int] = {}
    phase, sent, ops = None, {"fwd": 0, "bwd": 0}, set()
    found = set()
    for line in lines:
        m = _INIT.search(line)
        if m and "opCount" not in line:
            my_rank[m.group(1)] = int(m.group(2))
            continue
        m = _COLL.search(line)
        if not m:
            continue
        op, count, dtype, root, comm_ptr = (
            m.group(1),
            int(m.group(2)),
            int(m.group(3)),
            int(m.group(4)),
            m.group(5),
        )
        nranks = int(m.group(6)) if m.group(6) else 0
        if op == "AllReduce" and count in marks:
            j = marks.index(count)
            found.add(j)
            phase = ("fwd", "bwd", None)[j]
            continue
        if phase is None:
            continue
        nbytes = count * _NCCL_SIZES.get(dtype, 0)
        if op == "Send" and root != my_rank.get(comm_ptr, -1):
            sent[phase] += nbytes
            ops.add(op)
        elif op.lower() == "alltoall":
            sent[phase] += nbytes * (nranks - 1)
            ops.add(op)
        elif op not in ("Recv", "AllReduce", "Broadcast", "AllGather", "ReduceScatter", "Send"):
            ops.add(op)
    if found != {0, 1, 2}:
        return {"fwd": None, "bwd": None, "ops": sorted(ops)}
    return {**sent, "ops": sorted(ops)}


def comm_report(out: Path, log_dir: Path | None) -> None:
    """After the comm run: the Report of bytes per rank, ours against the formulas, NCCL's log and
    the NVLink counters."""
    raw = sorted(out.glob("comm-raw-*gpu.json"))
    if not raw:
        print("[comm-report] no comm-raw file", flush=True)
        return
    doc = json.loads(raw[-1].read_text())
    logs = {}
    if log_dir is not None:
        for f in Path(log_dir).glob("nccl*"):
            m = re.search(r"\.(\d+)(?:\.log)?$", f.name)
            if m:
                logs[int(m.group(1))] = f.read_text(errors="replace").splitlines()
    report = Report(
        package="usp", title="USP communication volume per rank: counted, the formulas, NCCL, NVLink",
        columns=["split", "ulysses", "ring", "H", "H_kv", "S", "D", "rank", "pass", "counted_bytes", "formula_bytes",
                 "nccl_bytes", "nvlink_tx_bytes", "ms", "note"],
        measure_ceilings=False, packages=PACKAGES,
        notes=("One causal zigzag forward and backward, bf16 (fp32 dK/dV accumulators on the ring), world "
               f"{doc['world']}. counted: what repro.usp.comm sent (its count_bytes); formula: "
               "repro.usp.cost.bytes_per_rank; nccl: the Send calls to other ranks that NCCL logged "
               "(NCCL_DEBUG=INFO, COLL) between marker all-reduces, count x datatype size; nvlink: this GPU's "
               "NVLink data Tx counters over the same region (nvidia-smi nvlink -gt d; includes the markers and "
               "protocol overhead; empty where unreadable); ms: one fwd+bwd step (3 calls, slowest rank)."),
    )  # fmt: skip
    for recs in doc["ranks"]:
        for rec in recs:
            nccl = (
                nccl_sent_bytes(logs.get(rec["pid"], []), rec["marks"])
                if logs
                else {"fwd": None, "bwd": None, "ops": []}
            )
            for passes in ("fwd", "bwd"):
                report.add(split=rec["split"], ulysses=rec["ulysses"], ring=rec["ring"], H=doc["H"], H_kv=rec["H_kv"],
                           S=rec["S"], D=doc["D"], rank=rec["rank"], **{"pass": passes},
                           counted_bytes=rec[f"counted_{passes}"], formula_bytes=rec[f"formula_{passes}"],
                           nccl_bytes=nccl[passes], nvlink_tx_bytes=rec["nvlink_tx"] if passes == "fwd" else None,
                           ms=rec["ms"], note=("nvlink over fwd+bwd; " if passes == "fwd" and rec["nvlink_tx"] else "")
                           + ("NCCL ops: " + ",".join(nccl["ops"]) if nccl["ops"] else ""))  # fmt: skip
    env = doc.get("env") or None
    report.write(out_dir=out, tag=f"comm-{doc['world']}gpu", env=env)
