"""What NCCL chose, and what its other choices would have given: the peer's side of the diagnosis.

    python -m nanoparallel.cuda.lab.nccl_info --world-size 4 --out DIR

hu2025demystifying describes how NCCL picks an algorithm (ring, tree) and a protocol (Simple, LL,
LL128) per call from a cost model, and how many channels (CUDA blocks, each with its own buffers)
it runs. This asks NCCL, on the machine at hand, at 64 MiB, 256 MiB and 1 GiB:

* ``default``: NCCL as the sweep times it; the algorithm, protocol and channels it picked are read
  from its own log (``NCCL_DEBUG=INFO``, subsystem ``TUNING``: one line per call on rank 0, "...
  Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..23}");
* the same collectives with the choice pinned (``NCCL_ALGO``, ``NCCL_PROTO``, read when a
  communicator is created): ring with Simple, LL128 and LL for every collective that has a ring
  (all-reduce, all-gather, reduce-scatter, broadcast), tree with Simple and LL128 for all-reduce.

Each variant is its own NCCL communicator (``new_group``) created after its environment is set; a
first all-reduce of a size used nowhere else marks, in the log, where its lines begin. Logging
costs NCCL a little time per call (a line written per call on rank 0), so these times are only
compared among themselves; the sweep times NCCL without it. The all-to-all (send/recv, no
algorithm to pin) appears in the default variant only. NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0``). Writes ``<out>/<device>-cuda-x<W>-nccl.json`` and rank 0's log as
``<out>/nccl-debug-x<W>.log``.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from nanoparallel.cost_model import bus_factor  # noqa: E402

SIZES = (64 << 20, 256 << 20, 1 << 30)
RING = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# (name, NCCL_ALGO, NCCL_PROTO, collectives)
VARIANTS = (
    ("default", None, None, (*RING, "all_to_all")),
    ("ring/simple", "Ring", "Simple", RING),
    ("ring/ll128", "Ring", "LL128", RING),
    ("ring/ll", "Ring", "LL", RING),
    ("tree/simple", "Tree", "Simple", ("all_reduce",)),
    ("tree/ll128", "Tree", "LL128", ("all_reduce",)),
)
COLUMNS = ["variant", "collective", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "vs_default", "nccl_algo",
           "nccl_proto", "nccl_channels"]  # fmt: skip
NAMES = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
         "Broadcast": "broadcast"}  # fmt: skip
TUNING = re.compile(
    r"(AllReduce|AllGather|ReduceScatter|Broadcast|\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)"
    r"(?: channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\})?"
)


def marker_elements(index: int) -> int:
    """Elements of the all-reduce that opens variant ``index`` (a byte count no row uses)."""
    return 1000 + index


def parse_log(lines: list[str]) -> tuple[dict, dict]:
    """From rank 0's NCCL log: {(variant, collective, bytes): (algo, proto, channels)} and
    {variant: [init lines about channels and the environment]}. Lines are attributed to the
    variant whose marker all-reduce came last before them."""
    choices: dict = {}
    init: dict = {}
    pending: list[str] = []
    current = None
    markers = {marker_elements(i) * 4: name for i, (name, *_) in enumerate(VARIANTS)}
    for line in lines:
        m = TUNING.search(line)
        if m:
            func, nbytes = m.group(1), int(m.group(2))
            if func == "AllReduce" and nbytes in markers:
                current = markers[nbytes]
                init[current] = pending
                pending = []
                continue
            if current is not None and func in NAMES:
                lo, hi = m.group(5), m.group(6)
                channels = int(hi) - int(lo) + 1 if lo is not None else None
                choices.setdefault((current, NAMES[func], nbytes), (m.group(3), m.group(4), channels))
        elif "channels" in line or "set by environment" in line or "nRanks" in line:
            pending.append(line.split("NCCL INFO", 1)[-1].strip())
    return choices, init


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    try:
        results.put((rank, _rank_body(rank, world, port, args), None))
    except BaseException as exc:
        import traceback

        results.put((rank, None, f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"))
        raise


def _rank_body(rank: int, world: int, port: int, args) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from nanoparallel.cuda.sweep import Case, time_calls

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300)
    )
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)
    rows = []
    for index, (name, algo, proto, collectives) in enumerate(VARIANTS):
        for key, value in (("NCCL_ALGO", algo), ("NCCL_PROTO", proto)):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        group = dist.new_group(backend="nccl")  # its communicator is made at its first call, below
        marker = torch.ones(marker_elements(index), device=dev)
        dist.all_reduce(marker, group=group)
        torch.cuda.synchronize()
        for coll in collectives:
            if coll not in args.collectives:
                continue
            for nbytes in args.sizes:
                count = nbytes // 4 // world * world
                x = torch.randn(count, device=dev)
                case = Case(coll, x, world, rank)
                fn = _in_group(case, group)
                iters = int(min(50, max(6, 2e9 // nbytes)))
                us, host_us = time_calls(fn, iters, dev, group=group)
                algbw = count * 4 / (us * 1e-6) / 1e9
                rows.append(dict(variant=name, collective=coll, bytes=count * 4, time_us=round(us, 2),
                                 algbw_GBps=round(algbw, 2), busbw_GBps=round(algbw * bus_factor(coll, world), 2)))  # fmt: skip
                if rank == 0:
                    print(f"{name:12s} {coll:15s} {count * 4:>11d} B  {us:9.1f} us", flush=True)
                del case, x
        torch.cuda.synchronize()
    for key in ("NCCL_ALGO", "NCCL_PROTO"):
        os.environ.pop(key, None)
    dist.barrier()
    dist.destroy_process_group()
    return {"rows": rows, "pid": os.getpid()}


def _in_group(case, group):
    """``case.nccl`` on ``group`` instead of the default group."""
    import torch.distributed as dist

    c = case.coll
    if c == "all_reduce":
        return lambda: dist.all_reduce(case.x, group=group)
    if c == "broadcast":
        return lambda: dist.broadcast(case.x, src=0, group=group)
    if c == "all_gather":
        return lambda: dist.all_gather_into_tensor(case.out, case.inp, group=group)
    if c == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(case.out, case.inp, group=group)
    return lambda: dist.all_to_all_single(case.out, case.inp, group=group)


def finish(rows: list[dict], choices: dict) -> list[dict]:
    """vs_default (busbw over the default variant's at the same collective and size) and what
    NCCL's log says it ran."""
    default = {(r["collective"], r["bytes"]): r["busbw_GBps"] for r in rows if r["variant"] == "default"}
    for r in rows:
        ref = default.get((r["collective"], r["bytes"]))
        r["vs_default"] = round(r["busbw_GBps"] / ref, 3) if ref else None
        got = choices.get((r["variant"], r["collective"], r["bytes"]))
        if got:
            r["nccl_algo"], r["nccl_proto"], r["nccl_channels"] = got
    return rows


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--out", type=Path, default=Path("nanoparallel/results"))
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--collectives", nargs="+", default=[*RING, "all_to_all"])
    p.add_argument("--tag", default=None, help="default cuda-x<W>-nccl")
    args = p.parse_args(argv)
    from nanoparallel.cuda.sweep import check_world_size
    from nanoparallel.launch import spawn_ranks
    from paperclub.bench import Report

    world = args.world_size
    check_world_size(world)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "nccl-debug"
    logs.mkdir(exist_ok=True)
    # read by NCCL when it first initialises, in the spawned ranks (which inherit the environment)
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,TUNING",
                      NCCL_DEBUG_FILE=str(logs / "nccl.%h.%p.log"))  # fmt: skip
    out = {rank: got for rank, got, _ in spawn_ranks(world, _rank_main, args, 900, lambda m: m[2])}
    for key in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        os.environ.pop(key, None)
    first = out[0]
    found = sorted(logs.glob(f"nccl.*.{first['pid']}.log"))  # NCCL cuts the host name at its first dot
    log = found[0] if found else None
    lines = log.read_text(errors="replace").splitlines() if log else []
    choices, init = parse_log(lines)
    if log:
        shutil.copy(log, args.out / f"nccl-debug-x{world}.log")
    shutil.rmtree(logs, ignore_errors=True)
    rows = finish(first["rows"], choices)
    default_init = "; ".join(init.get("default", [])[:6])
    rep = Report(
        package="nanoparallel",
        title=f"What NCCL chose on {world} GPUs, and its pinned algorithms and protocols",
        peer=f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} (torch.distributed, NVLS off)",
        columns=COLUMNS,
        packages=["torch"],
        measure_ceilings=False,
        notes=(
            "nanoparallel.cuda.lab.nccl_info. Each variant is its own communicator, created with NCCL_ALGO / "
            "NCCL_PROTO as named (default: unset); nccl_algo, nccl_proto, nccl_channels are what NCCL's log "
            "(NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=TUNING, rank 0) says it ran. Logging is on for every variant, "
            "so compare these times among themselves, not with the sweep's. busbw with nccl-tests' factors. "
            f"{len(choices)} (variant, collective, size) choices read from {len(lines)} log lines. "
            f"Default communicator's init: {default_init or 'no INIT lines found'}."
        ),
    )
    for r in rows:
        rep.add(**{c: r.get(c) for c in COLUMNS})
    rep.plot(title="NCCL busbw by pinned algorithm/protocol", x="bytes", y="busbw_GBps", series="variant",
             facet="collective", logx=True)  # fmt: skip
    rep.write(tag=args.tag or f"cuda-x{world}-nccl", out_dir=args.out)


if __name__ == "__main__":
    main()
