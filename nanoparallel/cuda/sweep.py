"""GPU sweep (issue #6): nanoparallel.cuda against NCCL, every collective, 8 B to 1 GB.

    python -m nanoparallel.cuda.sweep --world-size 2 --min-bytes 16 --step 4 --tag cuda-x2 [--out DIR]

(16 B x 4^k up to 1 GiB, plus 8 B: the sizes include 64 KiB and 64 MiB, where issue #6 sets targets.)
One collective at the large sizes only (``--extra-bytes`` with no value drops the 8 B row)::

    python -m nanoparallel.cuda.sweep --world-size 2 --min-bytes 67108864 --step 4 --extra-bytes \
        --collectives reduce_scatter --tag cuda-x2-rs --quick-check --max-iters 50 --out DIR

``--pipeline-steps K`` fixes the steps of every pipelined variant (the backend's knob) for the timed
part; without it each takes its size-based default.

One process per GPU. Every rank first runs :func:`nanoparallel.cuda.check.check_all` (every
collective, algorithm, dtype and awkward size against a float64 reference), then times, for each
collective and size, NCCL through ``torch.distributed`` and each of our algorithms plus ``auto``.

Timing: all ranks meet (an NCCL barrier and a device synchronisation), then each rank records CUDA
events around ``iters`` back-to-back calls issued from Python, as a PyTorch program would issue them;
the time of a call is the elapsed time over ``iters``, and the slowest rank's time is reported.
``host_us`` is the Python time per call in the same loop: where it is close to ``time_us`` the
loop is bound by the host (launch overhead), not by the GPUs.
No CUDA graphs on either side (our flag epochs are launch arguments, so a replayed graph would
reuse stale epochs). Bandwidth follows nccl-tests' PERFORMANCE.md: ``algbw = bytes / time`` with
``bytes`` the per-rank message (all-gather: the gathered output; reduce-scatter and all-to-all: the
per-rank input) and ``busbw = algbw * factor``, factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, reduce-scatter and all-to-all, 1 for broadcast.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, set here and by nanoparallel.cuda before anything initialises).
"""

from __future__ import annotations

import argparse
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import datetime  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from nanoparallel.launch import spawn_ranks  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def busbw_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    return (n - 1) / n


def sizes(min_bytes: int, max_bytes: int, step: int) -> list[int]:
    out, b = [], min_bytes
    while b <= max_bytes:
        out.append(b)
        b *= step
    return out


def _iters(nbytes: int, max_iters: int = 100) -> int:
    # about 0.5 GB moved per measurement, between 10 and 100 calls (values double per sum call;
    # 100 doublings keep random float32 data finite)
    return int(min(max_iters, max(10, 5e8 // max(nbytes, 1))))


def time_calls(fn, iters: int, dev) -> tuple[float, float]:
    """(device time per call, host time per call) in microseconds, the slowest rank's: three
    warm-up calls, all ranks meet, then CUDA events around ``iters`` back-to-back calls."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    h0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - h0) / iters
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters * 1e3, host * 1e6], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0].item()), float(t[1].item())


def _impls(coll: str, x: torch.Tensor, be, world: int) -> dict:
    """NCCL's call and each of our algorithms for one collective on the message ``x`` ([count])."""
    import torch.distributed as dist

    from nanoparallel.cuda import ALGORITHMS

    algos = ALGORITHMS[coll] + ("auto",)
    if coll == "all_reduce":
        impls = {"nccl": lambda: dist.all_reduce(x)}
        impls.update({a: (lambda a=a: be.all_reduce(x, "sum", a)) for a in algos})
    elif coll == "broadcast":
        impls = {"nccl": lambda: dist.broadcast(x, src=0)}
        impls.update({a: (lambda a=a: be.broadcast(x, 0, a)) for a in algos})
    elif coll == "all_gather":
        inp, out = x[: x.numel() // world], torch.empty_like(x)
        impls = {"nccl": lambda: dist.all_gather_into_tensor(out, inp)}
        impls.update({a: (lambda a=a: be.all_gather(out, inp, a)) for a in algos})
    elif coll == "reduce_scatter":
        out = torch.empty(x.numel() // world, device=x.device, dtype=x.dtype)
        impls = {"nccl": lambda: dist.reduce_scatter_tensor(out, x)}
        impls.update({a: (lambda a=a: be.reduce_scatter(out, x, "sum", a)) for a in algos})
    else:
        out = torch.empty_like(x)
        impls = {"nccl": lambda: dist.all_to_all_single(out, x)}
        impls.update({a: (lambda a=a: be.all_to_all(out, x, algorithm=a)) for a in algos})
    return impls


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    try:
        _rank_body(rank, world, port, args, results)
    except BaseException as exc:  # tell the parent at once, which then stops every rank
        import traceback

        results.put((rank, -1, [f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"], 0.0, []))
        raise


def join_world(rank: int, world: int, port: int):
    """In a rank process of a GPU job: this rank's device, NCCL's process group (the peer being
    timed) and our backend, both on one TCPStore hosted by rank 0. Returns (backend, device)."""
    import torch.distributed as dist

    from nanoparallel.cuda import CudaPeerBackend

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300)
    )
    dist.init_process_group(
        "nccl", store=dist.PrefixStore("nccl", store), rank=rank, world_size=world, device_id=dev
    )
    be = CudaPeerBackend(rank, world, store, dev, timeout_s=60)
    return be, dev


def _rank_body(rank: int, world: int, port: int, args, results) -> None:
    import torch.distributed as dist

    from nanoparallel.cuda.check import check_all

    be, dev = join_world(rank, world, port)
    t0 = time.perf_counter()
    if args.skip_check:
        cases, failures = 0, []
    elif args.quick_check:  # fewer dtypes and sizes, hence fewer kernels to compile (device time)
        cases, failures = check_all(
            be, seed=args.seed, sizes=(0, 1, 31, 4099), dtypes=(torch.float32, torch.bfloat16, torch.int32)
        )
    else:
        cases, failures = check_all(be, seed=args.seed)
    check_s = time.perf_counter() - t0
    be.pipeline_steps = args.pipeline_steps  # after the check, which turns and restores the knob

    def timed(fn, nbytes: int) -> tuple[float, float]:
        return time_calls(fn, _iters(nbytes, args.max_iters), dev)

    rows = []
    nccl_ms: dict = {}
    for coll in args.collectives:
        for nbytes in sorted(set(sizes(args.min_bytes, args.max_bytes, args.step)) | set(args.extra_bytes)):
            dtype = torch.float32
            count = max(nbytes // 4, 1)
            count = -(-count // world) * world  # divisible where the collective needs it
            nb = count * 4
            g = torch.Generator(device=dev).manual_seed(args.seed + rank)
            x = torch.randn(count, device=dev, generator=g, dtype=dtype)
            impls = _impls(coll, x, be, world)
            for impl, fn in impls.items():
                us, host_us = timed(fn, nb)
                algbw = nb / (us * 1e-6) / 1e9
                busbw = algbw * busbw_factor(coll, world)
                if impl == "nccl":
                    nccl_ms[(coll, nb)] = us
                rows.append(
                    dict(
                        collective=coll,
                        impl="nccl" if impl == "nccl" else "nanoparallel",
                        algorithm="nccl" if impl == "nccl" else impl,
                        bytes=nb,
                        count=count,
                        dtype="float32",
                        time_us=round(us, 2),
                        host_us=round(host_us, 2),
                        algbw_GBps=round(algbw, 2),
                        busbw_GBps=round(busbw, 2),
                        speedup_vs_nccl=round(nccl_ms[(coll, nb)] / us, 3),
                    )
                )
            if rank == 0:
                last = [r for r in rows if r["bytes"] == nb and r["collective"] == coll]
                print(
                    f"{coll:15s} {nb:>11d} B  "
                    + "  ".join(
                        f"{r['algorithm']}={r['time_us']:.1f}us/{r['busbw_GBps']:.0f}GB/s" for r in last
                    ),
                    flush=True,
                )
        if rank == 0 and rows:
            _report(rows, world, cases, failures, partial=True, steps=args.pipeline_steps).write(
                tag=args.tag, out_dir=args.out
            )
    be.barrier()
    be.close()
    dist.destroy_process_group()
    results.put((rank, cases, failures, check_s, rows))


def _report(
    rows: list[dict], world: int, cases: int, failures: list[str], partial: bool, steps: int | None = None
):
    """The Report of the rows so far (``partial``: written after each collective, no ceilings;
    ``steps``: the --pipeline-steps the timed calls ran with, None for the size-based defaults)."""
    from nanoparallel.cuda import ALGORITHMS
    from paperclub.bench import Report

    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    report = Report(
        package="nanoparallel",
        title=f"GPU collectives on {world} GPUs: nanoparallel.cuda (peer memory, Triton) vs NCCL",
        peer=f"NCCL {nccl} (torch.distributed, NVLS off)",
        columns=list(rows[0]),
        packages=["torch", "triton"],
        measure_ceilings=not partial,
        notes=(
            ("PARTIAL (written after each collective; the run did not finish). " if partial else "")
            + f"Correctness in the same job: {cases - len(failures)} of {cases} checks passed on rank 0"
            + ("" if partial else " and the other ranks")
            + f" ({'no failures' if not failures else '; '.join(failures[:5])}); algorithms {dict(ALGORITHMS)}. "
            "Time per call: CUDA events around back-to-back calls issued from Python, slowest rank. "
            "busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all), "
            "1 (broadcast), as in nccl-tests. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1. "
            + (
                f"Pipelined variants timed at {steps} steps."
                if steps
                else "Pipelined variants timed at their default steps (AUTO_ALL_REDUCE_STEPS, "
                "AUTO_REDUCE_SCATTER_STEPS, PIPELINE_STEPS)."
            )
        ),
    )
    for r in rows:
        report.add(**r)
    report.plot(
        title="bus bandwidth", x="bytes", y="busbw_GBps", series="algorithm", facet="collective", logx=True
    )
    report.plot(
        title="time per call",
        x="bytes",
        y="time_us",
        series="algorithm",
        facet="collective",
        logx=True,
        logy=True,
    )
    return report


def check_world_size(world: int) -> None:
    if world < 2 or world > torch.cuda.device_count():
        raise SystemExit(
            f"--world-size must be between 2 and the {torch.cuda.device_count()} GPUs here, got {world}"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--extra-bytes", type=int, nargs="*", default=[8], help="sizes measured besides the steps")
    p.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pipeline-steps", type=int, default=None, help="steps of every pipelined variant (default: by size)"
    )
    p.add_argument("--max-iters", type=int, default=100, help="timed calls per measurement at small sizes")
    p.add_argument("--skip-check", action="store_true", help="skip the correctness check (not for results)")
    p.add_argument(
        "--quick-check", action="store_true", help="check float32, bfloat16, int32 at sizes 0, 1, 31, 4099"
    )
    p.add_argument("--tag", default="cuda")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the JSON (default nanoparallel/results)"
    )
    args = p.parse_args(argv)
    world = args.world_size
    check_world_size(world)
    # a crashed rank reports -1 checks and its traceback
    out = spawn_ranks(world, _rank_main, args, 1800, lambda got: got[2][0] if got[1] == -1 else None)
    out.sort(key=lambda r: r[0])
    cases = sum(o[1] for o in out)
    failures = [f for o in out for f in o[2]]
    rows = out[0][4]

    report = _report(rows, world, cases, failures, partial=False, steps=args.pipeline_steps)
    report.write(tag=args.tag, out_dir=args.out)
    if failures:
        print(f"\n{len(failures)} correctness failures:\n" + "\n".join(failures[:40]))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
