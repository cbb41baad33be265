"""nccl-tests style sweep: every collective, algorithm and transport, side by side with the peer.

    python -m nanoparallel.bench --world-size 2 --min-bytes 8 --max-bytes 64M
    python -m nanoparallel.bench --device cuda --world-size 2       # the GPU backend vs NCCL

One row per (collective, implementation, algorithm, size), with nccl-tests' columns:
``time_us`` is the slowest rank's mean time per call, the best of 3 timed loops in each of
``--passes`` sweeps (the machine may be shared, and other jobs only ever add time); ``algbw = size / time``; ``busbw = algbw *
factor`` with nccl-tests' factors (all-reduce 2(n-1)/n; all-gather, reduce-scatter and all-to-all
(n-1)/n; broadcast 1), so that busbw is comparable to the link bandwidth whatever n is. ``size``
is the per-rank buffer for all-reduce, broadcast and all-to-all, the gathered output for
all-gather and the input for reduce-scatter. ``error`` is the largest absolute difference from
the exact result (inputs are small integers, so every dtype sums exactly). ``predicted_us`` is
the alpha-beta model's prediction (cost_model.py) with alpha, beta, gamma calibrated at the start
of the run. Peer on CPU: gloo through torch.distributed; on CUDA: NCCL through torch.distributed.
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.distributed as dist

COLUMNS = [
    "collective",
    "impl",
    "algorithm",
    "chosen",
    "variant",
    "size_bytes",
    "count",
    "dtype",
    "time_us",
    "algbw_GBps",
    "busbw_GBps",
    "error",
    "predicted_us",
    "size_class",
]


def parse_bytes(s: str) -> int:
    s = s.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def sizes(lo: int, hi: int) -> list[int]:
    """Powers of 4 from ``lo`` to ``hi``, plus 16 MiB and ``hi`` (the sizes the targets name)."""
    out, s = set(), lo
    while s <= hi:
        out.add(s)
        s *= 4
    out |= {x for x in (16 << 20, hi) if lo <= x <= hi}
    return sorted(out)


REPEATS = 3


def _iters(nbytes: int) -> int:
    return int(min(max((16 << 20) // max(nbytes, 1), 2), 20))


def _pattern(rank: int, count: int, dtype) -> torch.Tensor:
    return ((torch.arange(count) % 7 + 1) * (rank + 1)).to(dtype)


def _expected(collective: str, n: int, rank: int, count: int, dtype) -> torch.Tensor:
    base = (torch.arange(count) % 7 + 1).to(torch.float64)
    if collective == "all_reduce":
        return base * (n * (n + 1) // 2)
    if collective == "broadcast":
        return base * 1  # root 0
    if collective == "all_gather":
        m = count // n
        return torch.cat([(torch.arange(m) % 7 + 1).double() * (r + 1) for r in range(n)])
    if collective == "reduce_scatter":
        return base[rank * (count // n) : (rank + 1) * (count // n)] * (n * (n + 1) // 2)
    if collective == "all_to_all":
        m = count // n
        return torch.cat(
            [((torch.arange(count) % 7 + 1).double() * (r + 1))[rank * m : (rank + 1) * m] for r in range(n)]
        )
    raise ValueError(collective)


def _call(collective: str, impl: str, comm, algorithm: str, x: torch.Tensor, out: torch.Tensor | None):
    if impl == "peer":
        if collective == "all_reduce":
            dist.all_reduce(x)
        elif collective == "broadcast":
            dist.broadcast(x, 0)
        elif collective == "all_gather":
            dist.all_gather_into_tensor(out, x)
        elif collective == "reduce_scatter":
            dist.reduce_scatter_tensor(out, x)
        elif collective == "all_to_all":
            dist.all_to_all_single(out, x)
        return
    if collective == "all_reduce":
        comm.all_reduce(x, algorithm=algorithm)
    elif collective == "broadcast":
        comm.broadcast(x, 0, algorithm=algorithm)
    elif collective == "all_gather":
        comm.all_gather(out, x, algorithm=algorithm)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(out, x, algorithm=algorithm)
    elif collective == "all_to_all":
        comm.all_to_all(out, x)


def _buffers(collective: str, n: int, rank: int, nbytes: int, dtype, device):
    es = torch.empty(0, dtype=dtype).element_size()
    count = max(nbytes // es, 1)
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(count - count % n, n)
    if collective == "all_gather":
        x = _pattern(rank, count // n, dtype).to(device)
        return count, x, torch.empty(count, dtype=dtype, device=device)
    x = _pattern(rank, count, dtype).to(device)
    if collective == "reduce_scatter":
        return count, x, torch.empty(count // n, dtype=dtype, device=device)
    if collective == "all_to_all":
        return count, x, torch.empty(count, dtype=dtype, device=device)
    return count, x, None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_worker(ctx: dict, plan: list[dict], device: str, calibrate: bool, passes: int = 2) -> dict:
    """Run the plan ``passes`` times on this rank (keeping each row's best time, since other jobs
    on a shared machine only ever add time); returns per-row times, errors and calibrated parameters."""
    import nanoparallel as npl
    from nanoparallel import cost_model

    rank, n, store = ctx["rank"], ctx["world_size"], ctx["store"]
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            store=dist.PrefixStore("peer", store),
            rank=rank,
            world_size=n,
            device_id=dev if dev.type == "cuda" else None,
        )
    comms, params = {}, {}
    for impl in sorted({p["impl"] for p in plan} - {"peer"}):
        if impl == "cuda":
            comms[impl] = npl.init(rank, n, store=store, transport="cuda", device=dev, name=f"bench-{impl}")
            continue
        transport, _, protocol = impl.partition("-")
        comms[impl] = npl.init(
            rank,
            n,
            store=store,
            transport=transport,
            protocol=protocol or "simple",
            name=f"bench-{impl}",
            timeout_s=120.0,
        )
    best: list[dict] = []
    for _ in range(passes):
        for impl, comm in comms.items():
            if calibrate and n > 1 and impl != "cuda":
                prm = cost_model.calibrate(comm)
                old = params.get(impl)
                for k in ("alpha", "beta", "gamma", "delta"):  # best of the passes, like the timings
                    if old is not None:
                        setattr(prm, k, min(getattr(prm, k), old[k]))
                comm.params = prm
                if rank == 0:
                    cost_model.save(comm.transport.name, prm)
            params[impl] = comm.params.__dict__
        rows = _run_plan(plan, comms, rank, n, store, dev)
        best = (
            rows
            if not best
            else [a if a["seconds"] <= b["seconds"] else b for a, b in zip(best, rows, strict=True)]
        )
    for c in comms.values():
        c.close()
    return {"rows": best, "params": params}


def _run_plan(plan, comms, rank, n, store, dev) -> list[dict]:
    import nanoparallel as npl

    rows = []
    for p in plan:
        comm = comms.get(p["impl"])
        dtype = getattr(torch, p["dtype"])
        count, x, out = _buffers(p["collective"], n, rank, p["size_bytes"], dtype, dev)
        try:
            # correctness first, on fresh inputs
            _call(p["collective"], p["impl"], comm, p["algorithm"], x, out)
            _sync(dev)
            got = (out if out is not None else x).double().cpu()
            exp = _expected(p["collective"], n, rank, count, dtype)
            if p["collective"] == "broadcast":
                exp = _pattern(0, count, dtype).double()
            error = float((got - exp).abs().max()) if got.numel() else 0.0
            chosen = comm.last_algorithm if comm is not None else ""
            iters = _iters(p["size_bytes"])
            for _ in range(2):
                _call(p["collective"], p["impl"], comm, p["algorithm"], x, out)
            _sync(dev)
            seconds = float("inf")
            for _ in range(REPEATS):  # best of a few: the machine is shared, other jobs only add time
                if comm is not None:
                    comm.barrier()
                else:
                    dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    _call(p["collective"], p["impl"], comm, p["algorithm"], x, out)
                _sync(dev)
                seconds = min(seconds, (time.perf_counter() - t0) / iters)
        except Exception as exc:  # e.g. a collective gloo does not implement: record, keep going
            seconds, error, chosen = float("nan"), float("nan"), f"unsupported: {type(exc).__name__}"
            if comm is not None and comm._closed:
                comms[p["impl"]] = comm = npl.init(
                    rank,
                    n,
                    store=store,
                    transport=comm.transport.name.split("-")[0],
                    name=f"bench-{p['impl']}-{len(rows)}",
                )
        rows.append({"seconds": seconds, "error": error, "count": count, "chosen": chosen})
    return rows


def build_plan(device: str, sizes_: list[int], collectives: list[str]) -> list[dict]:
    from nanoparallel.algorithms import ALGORITHMS

    plan = []
    for collective in collectives:
        for size in sizes_:
            if device == "cuda":
                from nanoparallel.cuda import ALGORITHMS as CUDA_ALGORITHMS

                impls = [("cuda", a) for a in ("auto", *CUDA_ALGORITHMS.get(collective, ()))] + [
                    ("peer", "nccl")
                ]
            else:
                algs = ("auto", *ALGORITHMS[collective])
                impls = [("shm-simple", a) for a in algs] + [("peer", "gloo")]
                if size <= 256 << 10:
                    impls += [("shm-ll", a) for a in algs]
                if size <= 1 << 20 and collective == "all_reduce":
                    impls += [("torch", "ring"), ("torch", "auto")]
            for impl, alg in impls:
                plan.append(
                    {
                        "collective": collective,
                        "impl": impl,
                        "algorithm": alg,
                        "size_bytes": size,
                        "dtype": "float32",
                    }
                )
    return plan


def main(argv=None) -> None:
    from paperclub.bench import bench_parser, parse_bench_args

    ap = bench_parser(
        __doc__.split("\n")[0], rounds=None, quick_help="a smoke run: one pass, sizes up to 1 MiB", only=False,
        settings=False,
    )  # fmt: skip
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all")
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--passes", type=int, default=2, help="sweep this many times, keep each row's best")
    args = parse_bench_args(ap, argv)
    if args.quick:
        args.passes = 1

    from nanoparallel import cost_model
    from nanoparallel.launch import World
    from paperclub.bench import Report

    n = args.world_size
    max_bytes = min(parse_bytes(args.max_bytes), 1 << 20) if args.quick else parse_bytes(args.max_bytes)
    sizes_ = sizes(parse_bytes(args.min_bytes), max_bytes)
    plan = build_plan(args.device, sizes_, args.collectives.split(","))
    t0 = time.time()
    with World(n) as world:
        # --budget-s: the sweep must end within it (its ranks are stopped at it); no limit: an hour
        timeout = 3600 if args.budget_s is None else args.budget.left()
        results = world.run(
            bench_worker, plan, args.device, not args.no_calibrate, args.passes, timeout=timeout
        )
    peer = "NCCL (torch.distributed)" if args.device == "cuda" else f"gloo (torch {torch.__version__})"
    report = Report(
        package="nanoparallel",
        title=f"nanoparallel collectives vs {peer.split(' ')[0]}, {n} ranks ({args.device})",
        columns=COLUMNS,
        peer=peer,
        notes="",
        measure_ceilings=args.device == "cuda",
    )
    params = {k: cost_model.Params(**v) for k, v in results[0]["params"].items()}
    for i, p in enumerate(plan):
        seconds = max(r["rows"][i]["seconds"] for r in results)
        error = max(r["rows"][i]["error"] for r in results)
        row = results[0]["rows"][i]
        size = p["size_bytes"]
        algbw = size / seconds / 1e9 if seconds == seconds else float("nan")
        pred = None
        if p["impl"] in params:
            alg = row["chosen"] if p["algorithm"] == "auto" else p["algorithm"]
            try:
                pred = round(cost_model.predict(p["collective"], alg, n, size, params[p["impl"]]) * 1e6, 2)
            except ValueError:
                pred = None
        impl = p["impl"] if p["impl"] != "peer" else p["algorithm"]
        report.add(
            collective=p["collective"],
            impl=impl,
            algorithm=p["algorithm"],
            chosen=row["chosen"],
            variant=f"{impl}/{p['algorithm']}" if p["impl"] != "peer" else impl,
            size_bytes=size,
            count=row["count"],
            dtype=p["dtype"],
            time_us=round(seconds * 1e6, 2),
            algbw_GBps=round(algbw, 4),
            busbw_GBps=round(algbw * cost_model.bus_factor(p["collective"], n), 4),
            error=error,
            predicted_us=pred,
            size_class="small" if size <= 64 << 10 else "large",
        )
    fit = _fit_quality(report.rows)
    report.notes = (
        f"{n} ranks on one host, 1 torch thread per rank, float32, best of {args.passes} sweeps x 3 timed loops. "
        "Cost-model parameters (seconds): "
        + json.dumps(
            {
                k: {"alpha": v.alpha, "beta": v.beta, "gamma": v.gamma, "delta": v.delta}
                for k, v in params.items()
            }
        )
        + f". Model fit: {fit}. Sweep took {time.time() - t0:.0f}s. The machine is shared: other jobs may "
        "have run at the same time, so treat single points with care."
    )
    for collective in args.collectives.split(","):
        report.plot(
            title=f"{collective}: bus bandwidth",
            x="size_bytes",
            y="busbw_GBps",
            series="variant",
            where={"collective": collective, "size_class": "large"},
            logx=True,
        )
    report.plot(
        title="all_reduce: latency, small messages",
        x="size_bytes",
        y="time_us",
        series="variant",
        where={"collective": "all_reduce", "size_class": "small"},
        logx=True,
        logy=True,
    )
    report.write(tag=args.tag or f"{args.device}-x{n}", out_dir=args.out)


def _fit_quality(rows: list[dict]) -> str:
    """Median and worst |log(predicted / measured)| over our rows, as factors."""
    ratios = [
        abs(math.log(r["predicted_us"] / r["time_us"]))
        for r in rows
        if r["predicted_us"] and r["time_us"] and r["time_us"] == r["time_us"] and r["time_us"] > 0
    ]
    if not ratios:
        return "no predictions"
    ratios.sort()
    med, worst = math.exp(ratios[len(ratios) // 2]), math.exp(ratios[-1])
    within2 = sum(x < math.log(2) for x in ratios) / len(ratios)
    return f"median factor {med:.2f}, worst {worst:.1f}, {within2:.0%} of predictions within 2x"


if __name__ == "__main__":
    main()
