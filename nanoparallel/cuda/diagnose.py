"""Why a GPU collective misses its target: measurements that separate the candidate causes.

    python -m nanoparallel.cuda.diagnose --world-size 2 --out DIR     # about 2 minutes on 2 H200
    python -m nanoparallel.cuda.diagnose --world-size 2 --dry-run     # the plan only, no GPU needed

The sweep (``nanoparallel.cuda.sweep``) says *that* all-to-all and large all-reduce fall short of
NCCL; this says *where the time goes*, in five sections, every rank measuring at once:

* ``nvlink``: raw bandwidth per direction between GPUs, every rank copying to (or from) the next
  one at the same time, as the collectives do. Our Triton copy (``peer_copy_kernel``, the inner
  loop of every kernel) reading the peer's memory and writing it, against the number of programs;
  the copy engine (``Tensor.copy_`` between a local tensor and the peer's mapped buffer) in both
  directions; NCCL send/recv; and a local copy of the same size (the drain that follows a barrier).
* ``all_to_all``: NCCL, direct, push, push_pipelined (steps), copy_engine (pieces).
* ``all_reduce``: NCCL, one_shot, one_shot_push (programs), one_shot_pipelined (steps, programs).
* ``host``: host and device time per call of small all-to-alls, with the split cache on and off
  (``cache_splits``), splits given and even; one_shot all-reduce beside them as the reference.
* ``host_parts``: the pieces of the uncached path timed alone on the host: validating the splits,
  making the pinned table, queueing its copy; and the cache look-up that replaces them.

Timing as in the sweep: all ranks meet, CUDA events around back-to-back calls issued from Python,
the slowest rank reported. ``GBps`` is bytes per second per direction for the raw copies and algbw
for collectives; ``busbw_GBps`` uses nccl-tests' factors; ``vs_nccl`` is busbw over the NCCL row of
the same section and size (send/recv for ``nvlink``). The JSON goes through paperclub's Report:
``<out>/<device>-cuda-x<W>-diagnose.json``.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

COLUMNS = [
    "section",
    "variant",
    "bytes",
    "programs",
    "steps",
    "time_us",
    "host_us",
    "GBps",
    "busbw_GBps",
    "vs_nccl",
]
SIZES = (64 << 20, 256 << 20, 1 << 30)
PROBE_BYTES = 256 << 20  # the size of the programs sweep of the raw copies
HOST_SIZES = (8, 4 << 10, 64 << 10)
PIPELINE_STEPS = (2, 4, 8, 16)
COPY_ENGINE_PIECES = (1, 4, 8)


def program_counts(sm_count: int) -> list[int]:
    """Grids for the raw-copy sweep: from 1/16 of the SMs to two programs per SM (the default)."""
    return sorted({max(1, sm_count // 16), max(1, sm_count // 8), max(1, sm_count // 4), max(1, sm_count // 2),
                   sm_count, 2 * sm_count})  # fmt: skip


def plan(world: int, sm_count: int, sizes=SIZES, host_sizes=HOST_SIZES) -> list[dict]:
    """Every measurement, in order: section, variant, bytes, programs (None: the default), steps
    (pipeline steps or copy-engine pieces; None: not applicable)."""
    full = 2 * sm_count
    cases = []

    def add(section, variant, nbytes, programs=None, steps=None):
        cases.append(dict(section=section, variant=variant, bytes=nbytes, programs=programs, steps=steps))

    for programs in program_counts(sm_count):
        for variant in ("triton_read", "triton_write"):
            add("nvlink", variant, PROBE_BYTES, programs)
    for nbytes in sizes:
        add("nvlink", "nccl_sendrecv", nbytes)
        for variant in ("triton_read", "triton_write"):
            if nbytes != PROBE_BYTES:
                add("nvlink", variant, nbytes, full)
        add("nvlink", "copy_engine_read", nbytes)
        add("nvlink", "copy_engine_write", nbytes)
    add("nvlink", "local_torch_copy", PROBE_BYTES)
    add("nvlink", "local_triton_copy", PROBE_BYTES, full)
    for nbytes in sizes:
        for variant in ("nccl", "direct", "push"):
            add("all_to_all", variant, nbytes)
        for steps in PIPELINE_STEPS[:3]:
            add("all_to_all", "push_pipelined", nbytes, steps=steps)
        for pieces in COPY_ENGINE_PIECES:
            add("all_to_all", "copy_engine", nbytes, steps=pieces)
    for nbytes in sizes:
        for variant in ("nccl", "one_shot"):
            add("all_reduce", variant, nbytes)
        for programs in (sm_count // 2, sm_count, full):
            add("all_reduce", "one_shot_push", nbytes, programs)
        for steps in PIPELINE_STEPS:
            add("all_reduce", "one_shot_pipelined", nbytes, full, steps)
        add("all_reduce", "one_shot_pipelined", nbytes, sm_count, 4)
    for nbytes in host_sizes:
        add("host", "nccl_all_to_all", nbytes)
        add("host", "all_to_all_uncached", nbytes)
        add("host", "all_to_all_cached", nbytes)
        add("host", "all_to_all_cached_even", nbytes)
        add("host", "all_reduce_one_shot", nbytes)
    for variant in ("validate_splits", "pinned_table", "pinned_table_copy", "cache_lookup"):
        add("host_parts", variant, 8 * 2 * world)
    return cases


def busbw_factor(section: str, variant: str, world: int) -> float:
    if section == "all_reduce":
        return 2 * (world - 1) / world
    if section == "all_to_all":
        return (world - 1) / world
    return 1.0


def finish(rows: list[dict], world: int) -> list[dict]:
    """Fill GBps, busbw_GBps and vs_nccl from time_us (rows without a time stay empty)."""
    nccl = {}
    for r in rows:
        t = r.get("time_us")
        if not t or r["section"] == "host_parts":
            continue
        r["GBps"] = round(r["bytes"] / (t * 1e-6) / 1e9, 2)
        r["busbw_GBps"] = round(r["GBps"] * busbw_factor(r["section"], r["variant"], world), 2)
        if r["variant"] in ("nccl", "nccl_sendrecv", "nccl_all_to_all"):
            nccl[(r["section"], r["bytes"])] = r["busbw_GBps"]
    for r in rows:
        ref = nccl.get((r["section"], r["bytes"]))
        if r.get("busbw_GBps") and ref:
            r["vs_nccl"] = round(r["busbw_GBps"] / ref, 3)
    return rows


def _iters(nbytes: int) -> int:
    return int(min(200, max(8, 2e9 // max(nbytes, 1))))


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    try:
        results.put((rank, _rank_body(rank, world, port, args), None))
    except BaseException as exc:  # tell the parent at once, which then stops every rank
        import traceback

        results.put((rank, None, f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"))
        raise


def _rank_body(rank: int, world: int, port: int, args) -> list[dict]:
    import torch.distributed as dist

    from nanoparallel.cuda import STEP_BYTES, check_splits
    from nanoparallel.cuda import kernels as K
    from nanoparallel.cuda.sweep import join_world

    be, dev = join_world(rank, world, port)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    largest = max(args.sizes)
    be._grow(largest)  # collective: every rank grows alike, before anything is timed
    buf = be._staging[0]
    f32 = torch.float32
    src = torch.randn(largest // 4, device=dev)
    dst = torch.empty_like(src)
    block = STEP_BYTES // 4

    def timed(fn, nbytes: int, iters: int | None = None) -> tuple[float, float]:
        from nanoparallel.cuda.sweep import time_calls

        return time_calls(fn, iters or _iters(nbytes), dev)

    def host_only(fn, reps: int = 2000) -> float:
        fn()
        h0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t = torch.tensor([(time.perf_counter() - h0) / reps * 1e6], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def triton_copy(n: int, programs: int, peer: int, read: bool):
        chunk = -(-max(-(-n // programs), 1) // block) * block
        grid = -(-n // chunk)
        args_ = (dst if read else src, buf.view(f32), buf.deltas(f32), n, chunk, peer, read, block)
        return lambda: be._launch(K.peer_copy_kernel, grid, args_)

    def collective(case: dict):
        section, variant, nbytes = case["section"], case["variant"], case["bytes"]
        n = max(nbytes // 4, world)
        n -= n % world
        x = src[:n]
        if section == "all_to_all" or variant == "nccl_all_to_all":
            out = dst[:n]
            if variant in ("nccl", "nccl_all_to_all"):
                return lambda: dist.all_to_all_single(out, x)
            if section == "host":
                rows = [n // world] * world
                splits = None if variant.endswith("even") else rows
                return lambda: be.all_to_all(out, x, splits, splits, "direct")
            return lambda: be.all_to_all(out, x, algorithm=variant)
        y = dst[:n]
        y.copy_(x)  # sums double the values each call; should they reach inf, the time is the same
        if variant == "nccl":
            return lambda: dist.all_reduce(y)
        algo = "one_shot" if section == "host" else variant
        return lambda: be.all_reduce(y, "sum", algo)

    def host_part(variant: str):
        splits = [1] * world
        table = torch.tensor(list(range(2 * world)), dtype=torch.int64).pin_memory()
        meta = be._meta[0].view(torch.int64)
        if variant == "validate_splits":
            return lambda: (
                check_splits("all_to_all", "input_splits", splits, world, world),
                check_splits("all_to_all", "output_splits", splits, world, world),
            )
        if variant == "pinned_table":
            return lambda: torch.tensor(splits + splits, dtype=torch.int64).pin_memory()
        if variant == "pinned_table_copy":
            return lambda: meta.copy_(table, non_blocking=True)
        return lambda: be._split_cache.plan(world, world, 1, splits, splits)

    def probe(variant: str, n: int, programs: int | None):
        """The call that one nvlink row times (None: not a raw copy)."""
        if variant in ("triton_read", "triton_write"):
            return triton_copy(n, programs, nxt, variant == "triton_read")
        if variant == "local_triton_copy":
            return triton_copy(n, programs, rank, True)
        if variant == "local_torch_copy":
            return lambda: dst[:n].copy_(src[:n])
        if variant == "copy_engine_read":
            peer_view = buf.peer(nxt).view(f32)[:n]
            return lambda: dst[:n].copy_(peer_view)
        if variant == "copy_engine_write":
            peer_view = buf.peer(nxt).view(f32)[:n]
            return lambda: peer_view.copy_(src[:n])
        if variant == "nccl_sendrecv":

            def sendrecv():
                ops = [dist.P2POp(dist.isend, src[:n], nxt), dist.P2POp(dist.irecv, dst[:n], prv)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            return sendrecv
        return None

    default_steps, default_pieces = be.pipeline_steps, be.copy_engine_pieces
    rows = []
    for case in args.plan:
        section, variant, nbytes, programs, steps = (
            case[k] for k in ("section", "variant", "bytes", "programs", "steps")
        )
        be.programs = programs or be.max_programs
        be.pipeline_steps = steps if variant.endswith("pipelined") else default_steps
        be.copy_engine_pieces = steps if variant == "copy_engine" else default_pieces
        be.cache_splits = variant != "all_to_all_uncached"
        row = dict(case)
        if section == "host_parts":
            row["host_us"] = round(host_only(host_part(variant)), 3)
            torch.cuda.synchronize()
            rows.append(row)
            continue
        fn = probe(variant, nbytes // 4, programs) if section == "nvlink" else collective(case)
        iters = 1000 if section == "host" else None
        row["time_us"], row["host_us"] = (round(v, 2) for v in timed(fn, nbytes, iters))
        rows.append(row)
        if rank == 0:
            print(f"{section:11s} {variant:24s} {nbytes:>11d} B  programs={programs} steps={steps}  "
                  f"{row['time_us']:.1f} us (host {row['host_us']:.1f})", flush=True)  # fmt: skip
    be.programs = be.max_programs
    be.barrier()
    be.close()
    dist.destroy_process_group()
    return rows


def report(rows: list[dict], world: int, dry_run: bool):
    from paperclub.bench import Report

    rep = Report(
        package="nanoparallel",
        title=f"Where the time goes: NVLink copies, all-to-all and all-reduce variants on {world} GPUs",
        peer="NCCL (torch.distributed, NVLS off)",
        columns=COLUMNS,
        packages=["torch", "triton"],
        measure_ceilings=False,
        notes=(
            ("DRY RUN: the plan only, no measurements. " if dry_run else "")
            + "nanoparallel.cuda.diagnose. nvlink: GBps per direction, all ranks copying to/from rank+1 at once; "
            "programs = grid of the Triton copy. all_to_all/all_reduce: GBps = algbw, busbw with nccl-tests' "
            "factors, steps = pipeline steps (push_pipelined, one_shot_pipelined) or copy-engine pieces. "
            "host: us per call of small all-to-alls, split cache on/off. host_parts: host us of each piece of "
            "the uncached path. CUDA events around back-to-back calls, slowest rank."
        ),
    )
    for r in rows:
        rep.add(**r)
    for plot in plots(max((r["programs"] or 0 for r in rows), default=0)):
        rep.plot(**plot)
    return rep


def plots(full: int) -> list[dict]:
    """What the site draws. Raw copies on a log scale: the local copy (about 1.7 TB/s) sits beside
    NVLink's few hundred GB/s. The variants as their busbw over NCCL's (the target is 0.9) against
    steps or pieces; rows without steps (NCCL, direct, push, one_shot) are in the table only, and
    the all-reduce keeps the full grid (``full`` programs) so the one half-grid row stays out."""
    return [
        dict(title="raw copy bandwidth per direction vs programs", x="programs", y="GBps", series="variant",
             where={"section": "nvlink", "bytes": PROBE_BYTES}, logy=True),
        dict(title="all-reduce one_shot_pipelined: busbw/NCCL vs steps", x="steps",
             y="vs_nccl", series="bytes",
             where={"section": "all_reduce", "variant": "one_shot_pipelined", "programs": full}, logx=True),
        dict(title="all-to-all: busbw/NCCL vs steps or pieces", x="steps",
             y="vs_nccl", series="variant", where={"section": "all_to_all"}, facet="bytes", logx=True),
    ]  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the JSON (default nanoparallel/results)"
    )
    p.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="bytes of the large-message rows"
    )
    p.add_argument("--tag", default=None, help="default cuda-x<W>-diagnose")
    p.add_argument("--dry-run", action="store_true", help="print and write the plan without measuring")
    p.add_argument("--sm-count", type=int, default=None, help="SMs per GPU for the plan (default: GPU 0's)")
    args = p.parse_args(argv)
    world = args.world_size
    tag = args.tag or f"cuda-x{world}-diagnose"
    sm = args.sm_count or (
        torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    )
    args.plan = plan(world, sm, sizes=tuple(args.sizes))
    if args.dry_run:
        rows = [dict(r) for r in args.plan]
        report(rows, world, dry_run=True).write(tag=tag + "-dry-run", out_dir=args.out)
        return
    from nanoparallel.cuda.sweep import check_world_size
    from nanoparallel.launch import spawn_ranks

    check_world_size(world)
    t0 = time.perf_counter()
    # each rank sends (rank, rows, error text or None)
    out = {rank: rows for rank, rows, _ in spawn_ranks(world, _rank_main, args, 900, lambda m: m[2])}
    rows = finish(out[0], world)
    report(rows, world, dry_run=False).write(tag=tag, out_dir=args.out)
    print(f"diagnose took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
