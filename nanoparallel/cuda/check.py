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


def check_all(backend, seed: int = 0, sizes=SIZES, dtypes=DTYPES) -> tuple[int, list[str]]:
    """Run every collective x algorithm x dtype x size on ``backend``; return (cases, failures)."""
    rank, W, dev = backend.rank, backend.world_size, backend.device
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
            xs = inputs(n, dtype)
            t = xs[rank].to(dev)
            ring = _resolves_to_ring(backend, "all_reduce", algo, t.numel() * t.element_size())
            backend.all_reduce(t, op=op, algorithm=algo)
            report(
                f"all_reduce {algo} {op} {dtype} n={n}",
                _close(t, reduce_ref(xs, op), dtype, W if ring else 1, magnitude(xs, op)),
            )
        for algo, op in itertools.product(ALGORITHMS["reduce_scatter"] + ("auto",), ops):
            k += 1
            xs = inputs(W * n, dtype)
            out = poison(n, dtype, dev)
            backend.reduce_scatter(out, xs[rank].to(dev), op=op, algorithm=algo)
            ref = reduce_ref(xs, op)[rank * n : (rank + 1) * n]
            scale = magnitude(xs, op)[rank * n : (rank + 1) * n]
            ring = _resolves_to_ring(
                backend, "reduce_scatter", algo, xs[rank].numel() * xs[rank].element_size()
            )
            report(
                f"reduce_scatter {algo} {op} {dtype} m={n}",
                _close(out, ref, dtype, W if ring else 1, scale),
            )
        for algo in ALGORITHMS["all_gather"] + ("auto",):
            k += 1
            xs = inputs(n, dtype)
            out = poison(W * n, dtype, dev)
            backend.all_gather(out, xs[rank].to(dev), algorithm=algo)
            ok = torch.equal(out.cpu(), torch.cat(xs))
            report(
                f"all_gather {algo} {dtype} m={n}", None if ok else "output is not the inputs in rank order"
            )
        for algo, root in itertools.product(ALGORITHMS["broadcast"] + ("auto",), range(W)):
            k += 1
            xs = inputs(n, dtype)
            t = xs[rank].to(dev)
            backend.broadcast(t, root=root, algorithm=algo)
            ok = torch.equal(t.cpu(), xs[root])
            report(
                f"broadcast {algo} root={root} {dtype} n={n}",
                None if ok else "differs from the root's tensor",
            )
        # uneven all-to-all: counts[s][d] elements from s to d, drawn from the seed on every rank
        k += 1
        g = torch.Generator().manual_seed(seed + 1000 * k)
        counts = torch.randint(0, max(n, 1) + 1, (W, W), generator=g).tolist()
        if n == 0:
            counts = [[0] * W for _ in range(W)]
        xs = [draw(sum(counts[s]), dtype, seed + 1000 * k + s) for s in range(W)]
        recv = [counts[s][rank] for s in range(W)]
        expected = torch.cat([xs[s][sum(counts[s][:rank]) : sum(counts[s][: rank + 1])] for s in range(W)])
        for algo in ALGORITHMS["all_to_all"] + ("auto",):
            out = poison(sum(recv), dtype, dev)
            backend.all_to_all(
                out, xs[rank].to(dev), output_splits=recv, input_splits=counts[rank], algorithm=algo
            )
            ok = torch.equal(out.cpu(), expected)
            report(f"all_to_all {algo} {dtype} counts={counts}", None if ok else "received the wrong data")
    _check_knobs(backend, seed + 1000 * (k + 1), report)
    backend.barrier()
    return cases, failures


def _check_knobs(backend, seed: int, report) -> int:
    """The knobs a measurement turns (steps, pieces, programs, uncached splits), at sizes where
    they change the partition, float32 only; restores every knob. Returns the next seed."""
    rank, W, dev = backend.rank, backend.world_size, backend.device
    saved = (backend.pipeline_steps, backend.copy_engine_pieces, backend.programs, backend.cache_splits)
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
                xs = [draw(n, torch.float32, seed + r) for r in range(W)]
                for algo in ("one_shot_push", "one_shot_pipelined"):
                    t = xs[rank].to(dev)
                    backend.all_reduce(t, op="sum", algorithm=algo)
                    report(
                        f"all_reduce {algo} sum n={n} {knobs}",
                        _close(t, reduce_ref(xs, "sum"), torch.float32, 1, magnitude(xs, "sum")),
                    )
                # reduce-scatter: m = n per rank, so 65537 leaves the last program and step short
                zs = [draw(W * n, torch.float32, seed + 200 + r) for r in range(W)]
                out = poison(n, torch.float32, dev)
                backend.reduce_scatter(out, zs[rank].to(dev), op="sum", algorithm="pipelined")
                report(
                    f"reduce_scatter pipelined sum m={n} {knobs}",
                    _close(
                        out,
                        reduce_ref(zs, "sum")[rank * n : (rank + 1) * n],
                        torch.float32,
                        1,
                        magnitude(zs, "sum")[rank * n : (rank + 1) * n],
                    ),
                )
                g = torch.Generator().manual_seed(seed)
                counts = torch.randint(0, n + 1, (W, W), generator=g).tolist()
                ys = [draw(sum(counts[s]), torch.float32, seed + 100 + s) for s in range(W)]
                recv = [counts[s][rank] for s in range(W)]
                expected = torch.cat(
                    [ys[s][sum(counts[s][:rank]) : sum(counts[s][: rank + 1])] for s in range(W)]
                )
                for algo in ALGORITHMS["all_to_all"]:
                    out = poison(sum(recv), torch.float32, dev)
                    backend.all_to_all(out, ys[rank].to(dev), recv, counts[rank], algorithm=algo)
                    ok = torch.equal(out.cpu(), expected)
                    report(f"all_to_all {algo} n~{n} {knobs}", None if ok else "received the wrong data")
    finally:
        backend.pipeline_steps, backend.copy_engine_pieces, backend.programs, backend.cache_splits = saved
    return seed


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
    args = p.parse_args(argv)
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
