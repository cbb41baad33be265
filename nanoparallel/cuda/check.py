"""Correctness check of every GPU collective and algorithm, run by every rank at once.

Every rank can regenerate every other rank's input from the seed (rank r's input for case k is
drawn from ``seed + 1000 k + r``), so each rank computes the float64 reference for the whole group
locally and compares its own output with it: no second communication path is trusted. Used by the
GPU tests and by the sweep, so a benchmark run on a machine also proves the numbers are of correct
collectives.

``python -m nanoparallel.cuda.check --world-size 2`` runs it on every GPU of the group (exit 1 on
any failure); after the collectives it turns the backend's knobs (pipeline steps, copy-engine
pieces, programs, uncached splits) at sizes where they change the partition: the pipelined
all-reduce, reduce-scatter and all-to-all at 1, 3 and 16 steps.

Tolerances (Frobenius error against float64): float32 1e-6 per reduction step; bf16 1e-2 and
fp16 2e-3 per step (one rounding of a float32 sum); integers exact. The ring rounds its partial
sums once per step, so its tolerance is multiplied by the number of ranks. A sum's error is taken
relative to the reduction of the operands' magnitudes (the sum, or mean, of |x_r| per element:
what a floating-point sum's error bound scales with), not to the result: where the ranks' values
cancel, a correctly rounded ring would fail a bound relative to the small result. On 4 H100s
(2026-11-27) the sweep's check failed that way on a bf16 ring average of one element per rank
(7.7e-2 of the result, above 4e-2).
"""

from __future__ import annotations

import itertools

import torch

from nanoparallel.cuda import ALGORITHMS

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SIZES = (0, 1, 2, 3, 31, 1021, 4099, 65537, (1 << 20) + 7)
BIG_DTYPES = (torch.float32, torch.bfloat16)  # the largest size only for these, to keep it quick
# every op on one float and one integer type; the others with the ops whose rounding differs
OPS = {
    torch.float32: ("sum", "max", "min", "avg"),
    torch.bfloat16: ("sum", "avg"),
    torch.float16: ("sum", "max"),
    torch.int32: ("sum", "max", "min", "avg"),
    torch.int64: ("sum",),
}


def draw(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    s = torch.stack([x.to(torch.float64) for x in xs])
    if op == "sum":
        return s.sum(0)
    if op == "avg":
        # integers: floor of the mean, like torch.div(..., rounding_mode="floor")
        return s.mean(0) if xs[0].dtype.is_floating_point else torch.floor(s.sum(0) / len(xs))
    return s.max(0).values if op == "max" else s.min(0).values


def magnitude(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The scale a reduction's rounding error is measured against: the reduction of |x_r| for sum
    and avg (floating-point summation error is bounded by a multiple of sum |x_r|), the result's
    own magnitude for max and min (exact: no rounding)."""
    if op in ("sum", "avg"):
        return reduce_ref([x.to(torch.float64).abs() for x in xs], op)
    return reduce_ref(xs, op).abs()


def _close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, steps: int, scale: torch.Tensor | None = None
) -> str | None:
    """None if ``out`` is ``ref`` within the dtype's tolerance times ``steps``, the error relative to
    ``scale`` (default: ``ref`` itself); else what is wrong."""
    out = out.detach().cpu().to(torch.float64)
    if not dtype.is_floating_point:
        return None if torch.equal(out, ref) else "integer result differs from the exact reference"
    if not torch.isfinite(out).all():
        return "non-finite values in the output (unwritten or poisoned elements)"
    denom = (ref if scale is None else scale).norm().item()
    err = (out - ref).norm().item() / (denom if denom else 1.0)
    tol = TOL[dtype] * steps
    return None if err <= tol else f"relative error {err:.3e} > {tol:.1e}"


def _resolves_to_ring(backend, collective: str, algorithm: str, nbytes: int) -> bool:
    """Whether the call runs the ring (its tolerance is per step): named, or what "auto" picks."""
    if algorithm == "auto" and hasattr(backend, "_algorithm"):
        algorithm = backend._algorithm(collective, "auto", nbytes)
    return algorithm == "ring"


def poison(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer full of a value no correct result has: NaN, or a huge integer."""
    if dtype.is_floating_point:
        return torch.full((n,), float("nan"), dtype=dtype, device=device)
    return torch.full((n,), torch.iinfo(dtype).max, dtype=dtype, device=device)


def case_all_reduce(backend, algo: str, op: str, xs: list[torch.Tensor]) -> str | None:
    """One all-reduce of the inputs ``xs`` (one per rank) with ``algo``: None, or what is wrong."""
    rank, W, dtype = backend.rank, backend.world_size, xs[0].dtype
    t = xs[rank].to(backend.device, copy=True)
    ring = _resolves_to_ring(backend, "all_reduce", algo, t.numel() * t.element_size())
    backend.all_reduce(t, op=op, algorithm=algo)
    return _close(t, reduce_ref(xs, op), dtype, W if ring else 1, magnitude(xs, op))


def case_reduce_scatter(backend, algo: str, op: str, xs: list[torch.Tensor]) -> str | None:
    """One reduce-scatter of ``xs`` (each [W*n])."""
    rank, W, dtype = backend.rank, backend.world_size, xs[0].dtype
    n = xs[0].numel() // W
    out = poison(n, dtype, backend.device)
    backend.reduce_scatter(out, xs[rank].to(backend.device), op=op, algorithm=algo)
    ref = reduce_ref(xs, op)[rank * n : (rank + 1) * n]
    scale = magnitude(xs, op)[rank * n : (rank + 1) * n]
    ring = _resolves_to_ring(backend, "reduce_scatter", algo, xs[rank].numel() * xs[rank].element_size())
    return _close(out, ref, dtype, W if ring else 1, scale)


def case_all_gather(backend, algo: str, xs: list[torch.Tensor]) -> str | None:
    rank, W = backend.rank, backend.world_size
    out = poison(W * xs[0].numel(), xs[0].dtype, backend.device)
    backend.all_gather(out, xs[rank].to(backend.device), algorithm=algo)
    return None if torch.equal(out.cpu(), torch.cat(xs)) else "output is not the inputs in rank order"


def case_broadcast(backend, algo: str, root: int, xs: list[torch.Tensor]) -> str | None:
    t = xs[backend.rank].to(backend.device)
    backend.broadcast(t, root=root, algorithm=algo)
    return None if torch.equal(t.cpu(), xs[root]) else "differs from the root's tensor"


def a2a_inputs(n: int, dtype: torch.dtype, W: int, seed: int) -> tuple[list, list]:
    """(counts[s][d], inputs[s]) of an uneven all-to-all drawn from ``seed`` on every rank alike."""
    g = torch.Generator().manual_seed(seed)
    counts = (
        torch.randint(0, max(n, 1) + 1, (W, W), generator=g).tolist() if n else [[0] * W for _ in range(W)]
    )
    return counts, [draw(sum(counts[s]), dtype, seed + s) for s in range(W)]


def case_all_to_all(backend, algo: str, counts: list, xs: list[torch.Tensor]) -> str | None:
    rank, W = backend.rank, backend.world_size
    recv = [counts[s][rank] for s in range(W)]
    expected = torch.cat([xs[s][sum(counts[s][:rank]) : sum(counts[s][: rank + 1])] for s in range(W)])
    out = poison(sum(recv), xs[0].dtype, backend.device)
    backend.all_to_all(
        out, xs[rank].to(backend.device), output_splits=recv, input_splits=counts[rank], algorithm=algo
    )
    return None if torch.equal(out.cpu(), expected) else "received the wrong data"


def check_all(backend, seed: int = 0, sizes=SIZES, dtypes=DTYPES) -> tuple[int, list[str]]:
    """Run every collective x algorithm x dtype x size on ``backend``; return (cases, failures)."""
    rank, W = backend.rank, backend.world_size
    failures: list[str] = []
    cases = 0
    k = 0

    def inputs(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [draw(n, dtype, seed + 1000 * k + r) for r in range(W)]

    def report(what: str, problem: str | None) -> None:
        nonlocal cases
        cases += 1
        if problem:
            failures.append(f"rank {rank}: {what}: {problem}")

    for n, dtype in itertools.product(sizes, dtypes):
        if n > 100_000 and dtype not in BIG_DTYPES:
            continue
        ops = OPS[dtype]
        for algo, op in itertools.product(ALGORITHMS["all_reduce"] + ("auto",), ops):
            k += 1
            report(
                f"all_reduce {algo} {op} {dtype} n={n}", case_all_reduce(backend, algo, op, inputs(n, dtype))
            )
        for algo, op in itertools.product(ALGORITHMS["reduce_scatter"] + ("auto",), ops):
            k += 1
            xs = inputs(W * n, dtype)
            report(f"reduce_scatter {algo} {op} {dtype} m={n}", case_reduce_scatter(backend, algo, op, xs))
        for algo in ALGORITHMS["all_gather"] + ("auto",):
            k += 1
            report(f"all_gather {algo} {dtype} m={n}", case_all_gather(backend, algo, inputs(n, dtype)))
        for algo, root in itertools.product(ALGORITHMS["broadcast"] + ("auto",), range(W)):
            k += 1
            xs = inputs(n, dtype)
            report(f"broadcast {algo} root={root} {dtype} n={n}", case_broadcast(backend, algo, root, xs))
        # uneven all-to-all: counts[s][d] elements from s to d, drawn from the seed on every rank
        k += 1
        counts, xs = a2a_inputs(n, dtype, W, seed + 1000 * k)
        for algo in ALGORITHMS["all_to_all"] + ("auto",):
            report(f"all_to_all {algo} {dtype} counts={counts}", case_all_to_all(backend, algo, counts, xs))
    _check_knobs(backend, seed + 1000 * (k + 1), report)
    backend.barrier()
    return cases, failures


# the algorithms whose partition the knobs change (steps, copy-engine pieces, programs)
KNOBBED = {
    "all_reduce": ("one_shot_push", "one_shot_pipelined", "two_shot_pipelined"),
    "reduce_scatter": ("pipelined",),
    "all_gather": ("pairwise", "push_pipelined"),
    "broadcast": ("ring",),
    "all_to_all": ALGORITHMS["all_to_all"],
}


def _check_knobs(backend, seed: int, report, only: tuple[str, str] | None = None) -> int:
    """The knobs a measurement turns (steps, pieces, programs, uncached splits), at sizes where
    they change the partition, float32 only; restores every knob. ``only``: one (collective,
    algorithm). Returns the next seed."""
    W = backend.world_size
    saved = (backend.pipeline_steps, backend.copy_engine_pieces, backend.programs, backend.cache_splits)
    f32 = torch.float32
    try:
        for steps, pieces, programs, cached in (
            (1, 1, 7, False),
            (3, 3, backend.max_programs, True),
            (16, 5, 3, True),
        ):
            backend.pipeline_steps, backend.copy_engine_pieces = steps, pieces
            backend.programs, backend.cache_splits = programs, cached
            knobs = f"steps={steps} pieces={pieces} programs={programs} cached={cached}"
            for n in (65537, (1 << 20) + 7):
                seed += 1
                for coll, algos in KNOBBED.items():
                    for algo in algos:
                        if only and (coll, algo) != only:
                            continue
                        what = f"{coll} {algo} n={n} {knobs}"
                        if coll == "all_reduce":
                            xs = [draw(n, f32, seed + r) for r in range(W)]
                            report(what, case_all_reduce(backend, algo, "sum", xs))
                        elif coll == "reduce_scatter":
                            # m = n per rank, so 65537 leaves the last program and step short
                            zs = [draw(W * n, f32, seed + 200 + r) for r in range(W)]
                            report(what, case_reduce_scatter(backend, algo, "sum", zs))
                        elif coll == "all_gather":
                            report(
                                what,
                                case_all_gather(
                                    backend, algo, [draw(n, f32, seed + 300 + r) for r in range(W)]
                                ),
                            )
                        elif coll == "broadcast":
                            xs = [draw(n, f32, seed + 400 + r) for r in range(W)]
                            report(what, case_broadcast(backend, algo, (seed + 1) % W, xs))
                        else:
                            counts, ys = a2a_inputs(n, f32, W, seed + 100)
                            report(what, case_all_to_all(backend, algo, counts, ys))
    finally:
        backend.pipeline_steps, backend.copy_engine_pieces, backend.programs, backend.cache_splits = saved
    return seed


# -- one group at a time, failing fast (the GPU plan of issue #35: nanoparallel/cuda/gpu_plan.sh) --

# the new algorithms in the order the plan checks them: what the bandwidth targets most depend on
# first, so that a budget that runs out leaves the least important unchecked
NEW_GROUPS = (
    "broadcast/ring",
    "all_gather/push_pipelined",
    "all_gather/pairwise",
    "all_to_all/pairwise",
    "all_reduce/two_shot_pipelined",
)
STATUS = ("passed", "failed", "mismatch", "timeout", "error")  # worse to the right


def check_algorithm(
    backend, collective: str, algorithm: str, seed: int = 0, sizes=SIZES, dtypes=DTYPES, progress=None
):  # fmt: skip
    """Every case of one algorithm (or "auto") of one collective: each dtype and size, every op and
    root, then the knobs at sizes where they change the partition. After each call the backend
    synchronises and checks its error word, so a timeout or mismatch raises at the call that caused
    it (CommTimeoutError, MismatchError) and the caller can stop there. ``progress(what)``, if
    given, is told each case that passed that check (where a stuck rank stopped: the next one).
    Returns (cases, failures)."""
    rank, W = backend.rank, backend.world_size
    failures: list[str] = []
    cases = 0

    def report(what: str, problem: str | None) -> None:
        nonlocal cases
        backend.check(what)
        cases += 1
        if progress is not None:
            progress(what)
        if problem:
            failures.append(f"rank {rank}: {what}: {problem}")

    k = 0
    for n, dtype in itertools.product(sizes, dtypes):
        if n > 100_000 and dtype not in BIG_DTYPES:
            continue
        k += 1
        base = seed + 1000 * k
        what = f"{collective} {algorithm} {dtype} n={n}"
        if collective == "all_reduce":
            for op in OPS[dtype]:
                xs = [draw(n, dtype, base + r) for r in range(W)]
                report(f"{what} {op}", case_all_reduce(backend, algorithm, op, xs))
        elif collective == "reduce_scatter":
            for op in OPS[dtype]:
                xs = [draw(W * n, dtype, base + r) for r in range(W)]
                report(f"{what} {op}", case_reduce_scatter(backend, algorithm, op, xs))
        elif collective == "all_gather":
            report(what, case_all_gather(backend, algorithm, [draw(n, dtype, base + r) for r in range(W)]))
        elif collective == "broadcast":
            for root in range(W):
                xs = [draw(n, dtype, base + 10 * root + r) for r in range(W)]
                report(f"{what} root={root}", case_broadcast(backend, algorithm, root, xs))
        else:
            counts, xs = a2a_inputs(n, dtype, W, base)
            report(f"{what} counts={counts}", case_all_to_all(backend, algorithm, counts, xs))
    if algorithm in KNOBBED.get(collective, ()):
        _check_knobs(backend, seed + 1000 * (k + 1), report, only=(collective, algorithm))
    return cases, failures


def check_faults(backend, groups) -> tuple[int, list[str]]:
    """The faults the new kernels must surface, on GPUs: ranks that disagree on a call's size raise
    MismatchError (every rank for the kernels with a header; the receiver of the disagreeing split
    for the all-to-all), and a call no peer joins raises CommTimeoutError instead of hanging. Sizes
    are picked so that all ranks cut the call into the same programs and steps (the header, not a
    timeout, must catch it). The lonely call leaves rank 1's backend aborted: the caller rebuilds."""
    import time

    import torch.distributed as dist

    from nanoparallel.errors import CommTimeoutError

    rank, W, dev = backend.rank, backend.world_size, backend.device
    failures: list[str] = []
    cases = 0

    def all_agree(flag: bool) -> bool:  # whether any rank says so (every rank takes the same branch)
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=backend.group)
        return bool(t[0])

    for group in groups:
        coll, algo = group.split("/")
        n = 4000 if rank == W - 1 else 4096  # one rank disagrees; same grid and steps for all
        x = torch.ones(n, device=dev)
        raised = None
        try:
            if coll == "broadcast":
                backend.broadcast(x, 0, algo)
            elif coll == "all_gather":
                backend.all_gather(torch.empty(W * n, device=dev), x, algo)
            elif coll == "all_reduce":
                backend.all_reduce(x, "sum", algo)
            else:  # rank W-1 says it sends one more row to rank 0 than rank 0 expects
                splits = [4] * W
                send = list(splits)
                if rank == W - 1:
                    send[0] += 1
                out = torch.empty(4 * W, device=dev)
                backend.all_to_all(out, torch.ones(sum(send), device=dev), splits, send, algo)
            backend.check(f"{group} with mismatched sizes")
        except Exception as exc:  # every rank must reach the agreement below, whatever happened
            raised = type(exc).__name__
        cases += 1
        must = coll != "all_to_all" or rank == 0
        if must and raised != "MismatchError":
            failures.append(f"rank {rank}: {group}: ranks disagree on the size, but it raised {raised}")
        if all_agree(bool(backend.closed)):
            return cases, failures  # the caller rebuilds; the lonely call needs a working backend
    cases += 1
    if rank == 1:  # a ring broadcast only rank 1 calls: its waits must expire and check() raise
        backend.timeout_s, backend.max_spins = 2.0, 10_000_000
        t0 = time.perf_counter()
        try:
            backend.broadcast(torch.ones(4096, device=dev), 1, "ring")
            backend.check("lonely ring broadcast")
            failures.append(f"rank {rank}: a ring broadcast no peer joined did not time out")
        except CommTimeoutError:
            if time.perf_counter() - t0 > 60:
                failures.append(
                    f"rank {rank}: the lonely call took {time.perf_counter() - t0:.0f} s to raise"
                )
        except Exception as exc:
            failures.append(f"rank {rank}: the lonely call raised {type(exc).__name__}: {exc}")
    dist.barrier(group=backend.group)
    return cases, failures


def _group_rank_main(rank: int, world: int, port: int, args, results) -> None:
    """One rank of ``run_groups``: each group in turn, a message to the parent after each, and a
    fresh backend (new symmetric buffers and flags) whenever a group left the old one unusable."""
    import datetime
    import time
    import traceback

    import torch.distributed as dist

    from nanoparallel.cuda import CudaPeerBackend

    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    # a default group that outlives the backends: each backend then takes a gloo group of its own
    # (a new name each time, so symmetric memory never meets a stale registration of a group name)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    generation = 0

    def fresh():
        nonlocal generation
        generation += 1
        prefixed = dist.PrefixStore(f"check-{generation}", store)
        return CudaPeerBackend(rank, world, prefixed, torch.device("cuda", rank), timeout_s=args.timeout_s)

    be = fresh()
    passed = set(args.passed)  # the faults are tried on the new algorithms that passed their check
    for group in args.groups:
        results.put(("start", rank, group))
        t0 = time.perf_counter()
        status, cases, failures = "passed", 0, []

        def progress(what: str, group=group, t0=t0) -> None:  # a heartbeat per case: where a rank is
            results.put(("case", rank, group, what, round(time.perf_counter() - t0, 1)))

        try:
            if group == "faults":
                cases, failures = check_faults(be, [g for g in NEW_GROUPS if g in passed])
            elif group == "old-quick":  # the full check, sampled: 3 dtypes, small sizes
                cases, failures = check_all(
                    be, sizes=(0, 1, 31, 4099), dtypes=(torch.float32, torch.bfloat16, torch.int32)
                )
            else:
                coll, algo = group.split("/")
                cases, failures = check_algorithm(be, coll, algo, progress=progress)
            status = "failed" if failures else "passed"
        except Exception as exc:
            kind = type(exc).__name__
            status = {"CommTimeoutError": "timeout", "MismatchError": "mismatch"}.get(kind, "error")
            failures.append(f"rank {rank}: {group}: {kind}: {exc}\n{traceback.format_exc()[-1500:]}")
        # what this rank saw, before the agreement below: a peer that never reaches it (stuck in a
        # kernel, or killed by the budget) must not take this rank's message with it (on 2 H100s,
        # 2026-11-28, a rank that had left two_shot_pipelined died in that agreement, its reason lost)
        results.put(("saw", rank, group, status, failures[:3], round(time.perf_counter() - t0, 1)))
        # every rank learns the worst status, so all of them rebuild together
        worst = torch.tensor([STATUS.index(status)], dtype=torch.int32)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        worst_status = STATUS[int(worst[0])]
        results.put(("done", rank, group, status, cases, failures[:20], round(time.perf_counter() - t0, 1)))
        if worst_status == "passed":
            passed.add(group)
        if worst_status in ("timeout", "error", "mismatch") or be.closed or group == "faults":
            try:
                be.close()
            except Exception:
                pass
            be = fresh()
    be.close()
    dist.destroy_process_group()
    results.put(("end", rank, None))


def run_groups(world: int, groups: list[str], budget_s: float, timeout_s: float, out_path=None) -> dict:
    """Check ``groups`` ("collective/algorithm", "faults", "old-quick") on ``world`` GPUs, one at a
    time, within ``budget_s``. A rank that crashes (a CUDA error ends its context) or a group that
    makes no progress for ``timeout_s`` * 6 s stops that group as "crashed"/"hung"; the ranks are
    started again for the groups left. After each group the summary is written to ``out_path``:
    {"world", "groups": {group: {"status", "cases", "failures", "seconds"}}, "passed": [...]}; a
    group that did not finish also gets "ranks": per rank the last case it passed ("last_case",
    seconds into the group) and what it saw if it left the group ("saw": status, first failures),
    so a stall says which rank stopped where."""
    import argparse
    import json
    import queue
    import time

    import torch.multiprocessing as mp

    from nanoparallel.launch import free_port
    from paperclub.bench import Budget

    budget = Budget(budget_s)
    summary: dict = {"world": world, "groups": {}, "passed": []}

    def save() -> None:
        summary["passed"] = [g for g, r in summary["groups"].items() if r["status"] == "passed"]
        if out_path:
            with open(out_path, "w") as f:
                json.dump(summary, f, indent=1)

    remaining = list(groups)
    while remaining and budget.allows(reserve_s=15):
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        args = argparse.Namespace(groups=list(remaining), timeout_s=timeout_s, passed=list(summary["passed"]))
        port = free_port()
        procs = [
            ctx.Process(target=_group_rank_main, args=(r, world, port, args, results)) for r in range(world)
        ]
        for pr in procs:
            pr.start()
        done: dict[str, list] = {}
        current, ended, stalled = None, 0, None
        ranks: dict[int, dict] = {}  # of the current group: last case passed, what a rank saw
        last = time.monotonic()
        try:
            while ended < world:
                left = budget.left()
                if left <= 0:
                    stalled = "budget"
                    break
                try:
                    msg = results.get(timeout=min(1.0, left))
                except queue.Empty:
                    dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
                    if dead:
                        stalled = f"crashed (rank {dead[0]} exited with {procs[dead[0]].exitcode})"
                        break
                    if time.monotonic() - last > max(6 * timeout_s, 90):
                        stalled = "hung"
                        break
                    continue
                last = time.monotonic()
                kind, rank, group = msg[0], msg[1], msg[2]
                if kind == "start":
                    if group != current:  # each rank says so: keep what the first ones sent since
                        current, ranks = group, {}
                    print(f"[{time.strftime('%X')}] rank {rank}: {group}", flush=True) if rank == 0 else None
                elif kind == "case":
                    ranks.setdefault(rank, {})["last_case"] = [msg[3], msg[4]]
                elif kind == "saw":
                    ranks.setdefault(rank, {})["saw"] = {
                        "status": msg[3],
                        "failures": msg[4],
                        "seconds": msg[5],
                    }
                    if msg[3] != "passed":
                        first = msg[4][0].splitlines()[0] if msg[4] else ""
                        print(f"  rank {rank} left {group} after {msg[5]} s: {msg[3]} {first}", flush=True)
                elif kind == "done":
                    done.setdefault(group, []).append(msg)
                    if len(done[group]) == world:
                        statuses = [m[3] for m in done[group]]
                        summary["groups"][group] = {
                            "status": max(statuses, key=STATUS.index),
                            "cases": sum(m[4] for m in done[group]),
                            "failures": [f for m in done[group] for f in m[5]][:40],
                            "seconds": max(m[6] for m in done[group]),
                        }
                        remaining.remove(group)
                        save()
                        r = summary["groups"][group]
                        print(f"  {group}: {r['status']}, {r['cases']} cases, {r['seconds']} s", flush=True)
                        for f in r["failures"][:5]:
                            print("    " + f.splitlines()[0], flush=True)
                elif kind == "end":
                    ended += 1
        finally:
            for pr in procs:
                pr.join(timeout=20 if ended == world else 1)
                if pr.is_alive():
                    pr.kill()
        if stalled and current in remaining:
            summary["groups"][current] = {"status": stalled if stalled != "budget" else "not finished", "cases": 0,
                                          "failures": [], "seconds": None, "ranks": ranks}  # fmt: skip
            for r in range(world):
                got = ranks.get(r, {})
                print(f"  {current} {summary['groups'][current]['status']}: rank {r} last passed "
                      f"{got.get('last_case', 'no case')}, then {got.get('saw', {}).get('status', 'still in it')}",
                      flush=True)  # fmt: skip
            remaining.remove(current)
            save()
        elif stalled and current is None:  # the ranks failed before the first group: no retry helps
            summary["startup"] = stalled
            break
        if stalled == "budget":
            break
    for group in remaining:
        why = f"not run (start-up {summary['startup']})" if "startup" in summary else "not run (budget)"
        summary["groups"][group] = {"status": why, "cases": 0, "failures": [], "seconds": None}
    save()
    return summary


def checked_algorithms(path) -> set[tuple[str, str]] | None:
    """The (collective, algorithm) pairs a ``run_groups`` summary says passed; None without a file
    (then nothing is held back). A new algorithm not in the set is not timed by sweep and diagnose."""
    import json
    from pathlib import Path

    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return set()
    return {tuple(g.split("/")) for g in json.loads(p.read_text()).get("passed", []) if "/" in g}


def may_time(checked: set | None, collective: str, algorithm: str) -> bool:
    """Whether a benchmark may time this algorithm: every one without a checked-list, the old ones
    always (checked in earlier runs, and again at each timed shape), a new one only if it passed."""
    from nanoparallel.cuda import NEW_ALGORITHMS

    if checked is None or algorithm not in NEW_ALGORITHMS.get(collective, ()):
        return True
    return (collective, algorithm) in checked


def _rank_main(rank: int, world: int, port: int, quick: bool, results) -> None:
    import datetime

    import torch.distributed as dist

    from nanoparallel.cuda import CudaPeerBackend

    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
        )
        backend = CudaPeerBackend(rank, world, store, torch.device("cuda", rank), timeout_s=30)
        if quick:
            cases, failures = check_all(
                backend, sizes=(0, 1, 31, 4099), dtypes=(torch.float32, torch.bfloat16, torch.int32)
            )
        else:
            cases, failures = check_all(backend)
        backend.close()
        results.put((rank, cases, failures))
    except BaseException as exc:  # tell the parent, which stops the others
        import traceback

        results.put((rank, -1, [f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"]))


def main(argv=None) -> None:
    """``python -m nanoparallel.cuda.check --world-size 2``: every rank runs check_all; exit 1 on
    any failure."""
    import argparse
    import socket
    import time

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description="correctness check of every nanoparallel.cuda collective")
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--quick", action="store_true", help="float32, bfloat16, int32 at sizes 0, 1, 31, 4099")
    p.add_argument(
        "--groups", nargs="+", default=None,
        help="check these one at a time, failing fast: collective/algorithm, 'new' (issue #35's "
        "algorithms), 'faults', 'old-quick' (the full check, sampled)",
    )  # fmt: skip
    p.add_argument(
        "--budget-s", type=float, default=600, help="with --groups: stop starting groups after this"
    )
    p.add_argument("--timeout-s", type=float, default=10, help="with --groups: the backend's barrier timeout")
    p.add_argument("--out", default=None, help="with --groups: the JSON summary (sweep/diagnose --checked)")
    args = p.parse_args(argv)
    if args.groups:
        # "new" expands to NEW_GROUPS; a group named twice runs once, where it was first named
        groups = list(
            dict.fromkeys(g for name in args.groups for g in (NEW_GROUPS if name == "new" else (name,)))
        )
        summary = run_groups(args.world_size, groups, args.budget_s, args.timeout_s, args.out)
        bad = {g: r["status"] for g, r in summary["groups"].items() if r["status"] != "passed"}
        print(f"passed: {summary['passed']}" + (f"; not passed: {bad}" if bad else ""))
        raise SystemExit(1 if bad else 0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    t0 = time.perf_counter()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.world_size, port, args.quick, results))
        for r in range(args.world_size)
    ]
    for pr in procs:
        pr.start()
    out = []
    try:
        while len(out) < args.world_size:
            got = results.get(timeout=900)
            out.append(got)
            if got[1] == -1:
                break
    finally:
        for pr in procs:
            pr.join(timeout=30 if len(out) == args.world_size else 1)
            if pr.is_alive():
                pr.kill()
    failures = [f for o in out for f in o[2]]
    cases = sum(max(o[1], 0) for o in out)
    print(
        f"{cases - len(failures)} of {cases} checks passed on {args.world_size} GPUs in {time.perf_counter() - t0:.0f} s"
    )
    for f in failures[:60]:
        print(f)
    if failures or len(out) < args.world_size:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
