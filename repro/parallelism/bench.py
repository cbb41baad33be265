"""Benchmark of the async-TP decomposition (wang2023overlap) on GPUs:
``python -m repro.parallelism.bench --out DIR --budget-s N [--quick]``.

Run as one process, it spawns one rank per visible GPU (at least 2; NCCL, NVLink multicast off); under
``torchrun --nproc-per-node G -m repro.parallelism.bench`` it uses torchrun's ranks. For the two pairs
of sequence-parallel tensor parallelism, at Llama-like shapes (tokens s = seq x batch, hidden h, MLP
4h, bf16), per rank:

* all-gather + matmul: A_shard [s/G, h] gathered to [s, h], times the column-parallel W [h, 4h/G];
* matmul + reduce-scatter: A [s, 4h/G] times the row-parallel W [4h/G, h], reduce-scattered to [s/G, h].

Candidates, each checked against ``plain`` at the shape before it is timed (bf16: 2e-2 relative, the
rounding of the bf16 outputs and of the reduction's order):

* ``plain``: the collective (NCCL), then the matmul (or the other way round);
* ``decomposed (ours)``: :mod:`repro.parallelism.async_tp`, G ring steps whose NCCL send/recv run on
  NCCL's stream while the partial matmul runs on the compute stream;
* ``torch symm_mem``: PyTorch's async-TP ops ``torch.ops.symm_mem.fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter`` (symmetric memory, copy-engine transfers);
* ``matmul only`` and ``collective only``: the two parts alone, the floor of a perfect overlap being
  max of the two.

Every rank times the same fixed number of calls (no per-rank adaptive repeat counts: a collective
called a different number of times on two ranks hangs); rank 0 reports. ``ms`` is read from a
torch.profiler timeline (:func:`timeline_timer`): each call starts after a CPU barrier, and its time is
the span from its first kernel's start to its last kernel's end on any stream, so work that a CUDA
event on the calling stream would not wait for (NCCL's stream, the copy engines) is counted and the
ranks' start-up skew is not. ``ms_events`` keeps the CUDA-event time on the calling stream beside it
(:func:`fixed_timer`), as a cross-check. ``overlap`` = (collective only + matmul only - candidate) /
min(collective only, matmul only): 1 when the shorter part is hidden entirely, 0 when nothing is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paperclub.bench import Budget, Candidate, Measured, Report, bench_parser, measure, parse_bench_args
from paperclub.testing import assert_rel_close

COLUMNS = [
    "op",
    "impl",
    "G",
    "s",
    "h",
    "ms",
    "ms_min",
    "ms_max",
    "ms_events",
    "check",
    "tflops_per_gpu",
    "overlap",
    "note",
]
TOL = 2e-2
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def fixed_timer(fn, *, warmup: int, rep: int) -> float:
    """Median ms of ``rep`` calls after ``warmup``: the same counts on every rank, a barrier before the
    timed calls so that ranks start together (CUDA events on GPUs, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(rep):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


_CPU_GROUP = None  # a gloo group over the same ranks: barriers that put no kernel on the timeline


def _cpu_barrier() -> None:
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    dist.barrier(group=_CPU_GROUP)


def call_spans_ms(events, n_calls: int, label: str = "bench:call") -> list[float]:
    """Each timed call's device span from a profiler's events: the calls are the host ranges named
    ``label``, the device work of call i is every CUDA event (kernel, copy, set) that starts between
    the start of host range i and the start of range i + 1 (calls are separated by a synchronize and
    a CPU barrier, so nothing else runs there), and its span is the last end minus the first start.
    ``events``: (name, is_device, start_us, end_us) tuples."""
    starts = sorted(s for name, dev, s, _ in events if not dev and name == label)
    if len(starts) != n_calls:
        raise RuntimeError(f"call_spans_ms: found {len(starts)} '{label}' ranges, expected {n_calls}")
    bounds = starts + [float("inf")]
    spans = []
    for i in range(n_calls):
        work = [(s, e) for _, dev, s, e in events if dev and bounds[i] <= s < bounds[i + 1]]
        if not work:
            raise RuntimeError(f"call_spans_ms: call {i} put no work on the device")
        spans.append((max(e for _, e in work) - min(s for s, _ in work)) / 1e3)
    return spans


def timeline_timer(fn, *, warmup: int, rep: int) -> float:
    """Median ms of ``rep`` calls read from a torch.profiler timeline (see the module docstring); the
    same counts on every rank. On a CPU (no device timeline) it falls back to :func:`fixed_timer`."""
    if not torch.cuda.is_available():
        return fixed_timer(fn, warmup=warmup, rep=rep)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rep):
            _cpu_barrier()
            with record_function("bench:call"):
                fn()
            torch.cuda.synchronize()
    events = [
        (e.name, e.device_type == DeviceType.CUDA, e.time_range.start, e.time_range.end)
        for e in prof.events()
    ]
    spans = sorted(call_spans_ms(events, rep))
    return spans[len(spans) // 2]


def _torch_ops(group):
    """PyTorch's async-TP ops for ``group``, or the reason they cannot run here."""
    try:
        import warnings

        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        with warnings.catch_warnings():  # deprecated (no longer needed) in newer torch, required in older
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(name)
        ops = torch.ops.symm_mem
        return ops, name, None
    except Exception as exc:  # noqa: BLE001 - any failure is a row's note, not a crash
        return None, None, f"{type(exc).__name__}: {exc}"


def bench_shape(report: Report, *, s: int, h: int, device: str, dtype, rounds: int, rep: int) -> None:
    from repro.parallelism import async_tp
    from repro.parallelism.comm import all_gather, reduce_scatter

    group = dist.group.WORLD
    g, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    f_l = 4 * h // g
    a_shard = torch.randn(s // g, h, device=device, dtype=dtype, generator=gen)
    w_col = torch.randn(h, f_l, device=device, dtype=dtype, generator=gen) * h**-0.5
    a_row = torch.randn(s, f_l, device=device, dtype=dtype, generator=gen)
    w_row = torch.randn(f_l, h, device=device, dtype=dtype, generator=gen) * f_l**-0.5
    gathered = torch.empty(s, h, device=device, dtype=dtype)  # the matmul-only operands
    partial = torch.empty(s, h, device=device, dtype=dtype)
    flops = 2.0 * s * h * f_l  # per rank, either pair
    ops, group_name, why = _torch_ops(group) if device == "cuda" else (None, None, "CUDA only")

    def checked(fn, want):
        return Candidate(fn, lambda: assert_rel_close(fn().float(), want.float(), TOL))

    plain_ag = lambda: all_gather(a_shard, group, "fwd") @ w_col
    plain_rs = lambda: reduce_scatter(a_row @ w_row, group, "fwd")
    want_ag, want_rs = plain_ag(), plain_rs()
    pairs = {
        "all-gather + matmul": {
            "plain": Candidate(plain_ag),
            "decomposed (ours)": checked(
                lambda: async_tp.all_gather_matmul(a_shard, w_col, group, decomposed=True)[1], want_ag
            ),
            "matmul only": Candidate(lambda: gathered @ w_col),
            "collective only": Candidate(lambda: all_gather(a_shard, group, "fwd")),
        },
        "matmul + reduce-scatter": {
            "plain": Candidate(plain_rs),
            "decomposed (ours)": checked(
                lambda: async_tp.matmul_reduce_scatter(a_row, w_row, group, decomposed=True), want_rs
            ),
            "matmul only": Candidate(lambda: a_row @ w_row),
            "collective only": Candidate(lambda: reduce_scatter(partial, group, "fwd")),
        },
    }
    if ops is not None:
        pairs["all-gather + matmul"]["torch symm_mem"] = checked(
            lambda: ops.fused_all_gather_matmul(a_shard, [w_col], 0, group_name, return_A=False)[1][0],
            want_ag,
        )
        pairs["matmul + reduce-scatter"]["torch symm_mem"] = checked(
            lambda: ops.fused_matmul_reduce_scatter(a_row, w_row, "sum", 0, group_name), want_rs
        )
    for op, candidates in pairs.items():
        measured, events_ms = _measure_agreed(candidates, rounds=rounds, rep=rep)
        parts = [measured[k].median_ms for k in ("matmul only", "collective only")]
        if rank != 0:
            continue
        for impl, m in measured.items():
            overlap = None
            if m.median_ms is not None and None not in parts and "only" not in impl:
                overlap = (sum(parts) - m.median_ms) / min(parts)
            tflops = None if m.median_ms is None or "only" in impl else flops / (m.median_ms * 1e-3) / 1e12
            report.add(
                op=op, impl=impl, G=g, s=s, h=h, **m.row(), ms_events=events_ms.get(impl),
                tflops_per_gpu=tflops, overlap=overlap,
            )  # fmt: skip
        if ops is None:
            report.add(op=op, impl="torch symm_mem", G=g, s=s, h=h, check="not run", note=why)


def _measure_agreed(
    candidates: dict[str, Candidate], *, rounds: int, rep: int
) -> tuple[dict[str, Measured], dict[str, float | None]]:
    """Every rank checks every candidate, the ranks agree (one all-reduce) on those that passed
    everywhere, and only those are timed, with the same fixed counts on every rank: a candidate timed on
    some ranks only would leave the others waiting in its collectives. Returns the timeline times and
    the CUDA-event cross-check (one round) of the timed ones."""
    errors: dict[str, str] = {}
    for name, cand in candidates.items():
        try:
            if cand.check is not None:
                cand.check()
        except Exception as exc:  # noqa: BLE001 - the check's failure is the row's result
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    flags = torch.tensor([0.0 if n in errors else 1.0 for n in candidates])
    if torch.cuda.is_available():
        flags = flags.cuda()
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    live = {n: Candidate(c.fn) for (n, c), ok in zip(candidates.items(), flags.tolist(), strict=True) if ok}
    out = measure(live, rounds=rounds, warmup=3, rep=rep, timer=timeline_timer)
    events = measure(live, rounds=1, warmup=3, rep=rep, timer=fixed_timer)  # the cross-check
    for name in candidates:
        if name not in live:
            out[name] = Measured(ok=False, error=errors.get(name, "its check failed on another rank"))
    return {name: out[name] for name in candidates}, {n: events[n].median_ms for n in live}


def run(args, out_dir: Path | None) -> Report | None:
    """The sweep on the initialised world; returns the report on rank 0."""
    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    report = Report(
        package="parallelism",
        title="Async TP: decomposed all-gather + matmul and matmul + reduce-scatter",
        peer=f"torch {torch.__version__} symm_mem fused ops",
        columns=COLUMNS,
        measure_ceilings=device == "cuda",
        notes=(
            "bf16, one rank per GPU, NCCL with NVLink multicast off. ms: median over rounds of the median of "
            "fixed repeat counts, each call's span on the profiler's timeline (first kernel start to last "
            "kernel end, any stream); ms_events: CUDA events on the calling stream, one round; overlap = (collective only + matmul only - impl) / min(the two)."
        ),
    )
    if device == "cuda":
        shapes = [(8192, 4096)] if args.quick else [(8192, 4096), (16384, 4096), (8192, 8192), (16384, 8192)]
        rounds, rep = 3, 20
    else:
        shapes, rounds, rep = [(64, 32)], 1, 2
    budget = Budget(args.budget_s).part(0.7)  # from here, as each rank counts it
    for s, h in shapes:
        if not budget.allows():
            report.notes += f" Stopped at the budget before s={s}, h={h}."
            break
        bench_shape(report, s=s, h=h, device=device, dtype=dtype, rounds=rounds, rep=rep)
    return report if dist.get_rank() == 0 else None


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    """One spawned rank (nanoparallel.launch.spawn_ranks): join the world, run, report."""
    try:
        os.environ.update(MULTICAST_OFF)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
        )
        if args.device == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo")
        report = run(args, None)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, report.rows if report else None, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        results.put((rank, None, f"rank {rank}: {type(exc).__name__}: {exc}"))


def main(argv=None) -> None:
    ap = bench_parser(
        __doc__.splitlines()[0],
        budget_s=300.0,
        rounds=None,
        quick_help="one shape",
        only=False,
        settings=False,
        tag=False,
    )
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu for a smoke run of the code paths")
    ap.add_argument(
        "--ranks", type=int, default=None, help="ranks to spawn (default: every visible GPU; cpu: 2)"
    )
    args = parse_bench_args(ap, argv)
    os.environ.update(MULTICAST_OFF)
    if "WORLD_SIZE" in os.environ:  # under torchrun
        if args.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
        report = run(args, args.out)
        if report is not None:
            report.write(out_dir=args.out, tag=f"{dist.get_world_size()}gpu")
        dist.destroy_process_group()
        return
    from nanoparallel.launch import spawn_ranks

    ranks = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if ranks < 2:
        print(f"repro.parallelism.bench: needs at least 2 GPUs (visible: {ranks}); nothing to time")
        return
    messages = spawn_ranks(
        ranks, _rank_main, args, timeout_s=max(args.budget_s, 120.0), crashed=lambda m: m[2]
    )
    rows = next(m[1] for m in messages if m[0] == 0)
    report = Report(
        package="parallelism",
        title="Async TP: decomposed all-gather + matmul and matmul + reduce-scatter",
        peer=f"torch {torch.__version__} symm_mem fused ops",
        columns=COLUMNS,
        measure_ceilings=args.device == "cuda",
        notes="bf16, one rank per GPU (spawned), NCCL with NVLink multicast off; see the module docstring.",
        rows=rows,
    )
    report.write(out_dir=args.out, tag=f"{ranks}gpu" if args.device == "cuda" else "cpu-smoke")


if __name__ == "__main__":
    main()
