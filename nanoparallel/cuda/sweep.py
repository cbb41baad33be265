"""GPU sweep (issues #6, #35): nanoparallel.cuda against NCCL, every collective, 8 B to 1 GiB.

    python -m nanoparallel.cuda.sweep --world-size 4 --min-bytes 16 --step 4 --tag cuda-x4 [--out DIR]

(16 B x 4^k up to 1 GiB, plus 8 B: the sizes include 64 KiB and 64 MiB, where the targets are set.)
One collective at the large sizes only (``--extra-bytes`` with no value drops the 8 B row)::

    python -m nanoparallel.cuda.sweep --world-size 2 --min-bytes 67108864 --step 4 --extra-bytes \\
        --collectives reduce_scatter --tag cuda-x2-rs --max-iters 50 --out DIR

``--pipeline-steps K`` fixes the steps of every pipelined variant (the backend's knob) for the timed
part; without it each takes the policy's steps. ``--tuning FILE`` replaces the policy's steps and
programs with those a diagnose run just measured (``nanoparallel.cuda.lab.tuning --tuning-out``).
``--checked FILE`` (``nanoparallel.cuda.check --groups ... --out``) holds back every new algorithm
that did not pass its check in this run.

One process per GPU. **Every implementation is checked at each size before it is timed**: one call
on seeded inputs, compared with NCCL's result of the same call (exact for the collectives that
move data, within 1e-5 of the magnitude of the operands for the sums); all ranks agree on the
outcome (an NCCL all-reduce of the failures), and an implementation that failed is not timed at
that size (its row says ``checked: false``, no time). A call that times out or raises leaves a new
backend for the rest. ``--check-all`` also runs :func:`nanoparallel.cuda.check.check_all` (quick)
first, as the earlier sweeps did.

Timing: all ranks meet (an NCCL barrier and a device synchronisation), then each rank records CUDA
events around ``iters`` back-to-back calls issued from Python, as a PyTorch program would issue them;
the time of a call is the elapsed time over ``iters``, and the slowest rank's time is reported.
``host_us`` is the Python time per call in the same loop: where it is close to ``time_us`` the
loop is bound by the host (launch overhead), not by the GPUs. No CUDA graphs on either side (our
flag epochs are launch arguments, so a replayed graph would reuse stale epochs). Bandwidth follows
nccl-tests' PERFORMANCE.md: ``algbw = bytes / time`` with ``bytes`` the per-rank message (all-gather:
the gathered output; reduce-scatter and all-to-all: the per-rank input) and ``busbw = algbw *
bus_factor`` (``nanoparallel.cost_model.bus_factor``).

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

from nanoparallel.cost_model import bus_factor  # noqa: E402
from nanoparallel.launch import spawn_ranks  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
SUM_TOL = 1e-5  # float32 sums of up to 8 ranks in another order than NCCL's: a few ulps of the magnitude


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


def time_calls(fn, iters: int, dev, group=None) -> tuple[float, float]:
    """(device time per call, host time per call) in microseconds, the slowest rank's: three
    warm-up calls, all ranks meet, then CUDA events around ``iters`` back-to-back calls."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    dist.barrier(group=group)
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
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0].item()), float(t[1].item())


class Case:
    """One collective at one size: the input, NCCL's call, ours, and how to check ours.

    ``nccl()`` and ``ours(algorithm)`` are the timed calls (they reuse their buffers); ``check(be,
    algorithm)`` runs ours once on fresh copies and returns None or what is wrong, comparing with
    NCCL's result of the same call (made once, on first use)."""

    def __init__(self, coll: str, x: torch.Tensor, world: int, rank: int) -> None:
        import torch.distributed as dist

        self.coll, self.x, self.world, self.rank = coll, x, world, rank
        self.be = None
        n = x.numel()
        self._ref = None
        if coll == "all_gather":
            self.inp, self.out = x[: n // world], torch.empty_like(x)
        elif coll == "reduce_scatter":
            self.inp, self.out = x, torch.empty(n // world, device=x.device, dtype=x.dtype)
        elif coll == "all_to_all":
            self.inp, self.out = x, torch.empty_like(x)
        else:
            self.inp = self.out = x
        self._dist = dist

    def nccl(self) -> None:
        dist = self._dist
        if self.coll == "all_reduce":
            dist.all_reduce(self.x)
        elif self.coll == "broadcast":
            dist.broadcast(self.x, src=0)
        elif self.coll == "all_gather":
            dist.all_gather_into_tensor(self.out, self.inp)
        elif self.coll == "reduce_scatter":
            dist.reduce_scatter_tensor(self.out, self.inp)
        else:
            dist.all_to_all_single(self.out, self.inp)

    def ours(self, algorithm: str) -> None:
        be, c = self.be, self.coll
        if c == "all_reduce":
            be.all_reduce(self.x, "sum", algorithm)
        elif c == "broadcast":
            be.broadcast(self.x, 0, algorithm)
        elif c == "all_gather":
            be.all_gather(self.out, self.inp, algorithm)
        elif c == "reduce_scatter":
            be.reduce_scatter(self.out, self.inp, "sum", algorithm)
        else:
            be.all_to_all(self.out, self.inp, algorithm=algorithm)

    def _run_once(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn(out, inp)`` on a fresh copy of the input ``x``; returns the output."""
        c, world = self.coll, self.world
        if c in ("all_reduce", "broadcast"):
            y = x.clone()
            fn(y, y)
            return y
        inp = x[: x.numel() // world] if c == "all_gather" else x
        out = torch.empty(
            x.numel() // world if c == "reduce_scatter" else x.numel(), device=x.device, dtype=x.dtype
        )
        fn(out, inp.clone())
        return out

    def reference(self):
        """NCCL's result on the pristine input, and for the sums the same sum of |x| (the scale)."""
        if self._ref is None:
            dist, c, x0 = self._dist, self.coll, self.pristine
            calls = {
                "all_reduce": lambda out, inp: dist.all_reduce(out),
                "broadcast": lambda out, inp: dist.broadcast(out, src=0),
                "all_gather": lambda out, inp: dist.all_gather_into_tensor(out, inp),
                "reduce_scatter": lambda out, inp: dist.reduce_scatter_tensor(out, inp),
                "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp),
            }
            ref = self._run_once(calls[c], x0)
            scale = self._run_once(calls[c], x0.abs()) if c in ("all_reduce", "reduce_scatter") else None
            self._ref = (ref, scale)
        return self._ref

    def check(self, algorithm: str) -> str | None:
        ref, scale = self.reference()
        be = self.be
        calls = {
            "all_reduce": lambda out, inp: be.all_reduce(out, "sum", algorithm),
            "broadcast": lambda out, inp: be.broadcast(out, 0, algorithm),
            "all_gather": lambda out, inp: be.all_gather(out, inp, algorithm),
            "reduce_scatter": lambda out, inp: be.reduce_scatter(out, inp, "sum", algorithm),
            "all_to_all": lambda out, inp: be.all_to_all(out, inp, algorithm=algorithm),
        }
        got = self._run_once(calls[self.coll], self.pristine)
        be.check(f"{self.coll} {algorithm} check")
        if scale is None:
            return None if torch.equal(got, ref) else "differs from NCCL's result"
        err = (got.double() - ref.double()).norm().item() / max(scale.double().norm().item(), 1e-30)
        return None if err <= SUM_TOL else f"relative error {err:.2e} against NCCL's result > {SUM_TOL:g}"


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    try:
        _rank_body(rank, world, port, args, results)
    except BaseException as exc:  # tell the parent at once, which then stops every rank
        import traceback

        results.put((rank, -1, [f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"], 0.0, []))
        raise


def join_world(rank: int, world: int, port: int, timeout_s: float = 20):
    """In a rank process of a GPU job: this rank's device, NCCL's process group (the peer being
    timed) and our backend, both on one TCPStore hosted by rank 0. Returns (backend, device); the
    store is ``backend.store`` (for :func:`fresh_backend`)."""
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
    be = CudaPeerBackend(rank, world, dist.PrefixStore("be-0", store), dev, timeout_s=timeout_s)
    be.store, be.generation = store, 0
    return be, dev


def rebuild_needed(be, dev) -> bool:
    """After a failed check: whether any rank's backend is unusable (a timeout aborted it, or its
    error word still holds one). Collective (an NCCL all-reduce), so all ranks rebuild together."""
    import torch.distributed as dist

    try:
        be.check("after a failed check")
    except Exception:
        pass
    flag = torch.tensor([1.0 if be.closed else 0.0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def fresh_backend(old):
    """A new backend (new buffers and flags) on every rank, after a call left ``old`` unusable."""
    import torch.distributed as dist

    from nanoparallel.cuda import CudaPeerBackend

    try:
        old.close()
    except Exception:
        pass
    gen = old.generation + 1
    be = CudaPeerBackend(
        old.rank,
        old.world_size,
        dist.PrefixStore(f"be-{gen}", old.store),
        old.device,
        timeout_s=old.timeout_s,
    )
    be.store, be.generation = old.store, gen
    be.policy, be.pipeline_steps = old.policy, old.pipeline_steps
    return be


def apply_tuning(be, path) -> dict:
    """Replace the backend's steps and programs tables by those of a ``--tuning-out`` file."""
    from dataclasses import replace

    from nanoparallel.cuda.lab.tuning import load_tuning

    got = load_tuning(path, be.world_size) if path else {}
    if got:
        be.policy = replace(
            be.policy,
            steps={**be.policy.steps, **got.get("steps", {})},
            programs_per_sm={**be.policy.programs_per_sm, **got.get("programs_per_sm", {})},
        )
    return got


def _rank_body(rank: int, world: int, port: int, args, results) -> None:
    import torch.distributed as dist

    from nanoparallel.cuda import ALGORITHMS
    from nanoparallel.cuda.check import check_all, checked_algorithms, may_time

    be, dev = join_world(rank, world, port)
    t0 = time.perf_counter()
    cases, failures = 0, []
    if args.check_all:  # fewer dtypes and sizes, hence fewer kernels to compile (device time)
        cases, failures = check_all(
            be, seed=args.seed, sizes=(0, 1, 31, 4099), dtypes=(torch.float32, torch.bfloat16, torch.int32)
        )
    check_s = time.perf_counter() - t0
    tuned = apply_tuning(be, args.tuning)
    be.pipeline_steps = args.pipeline_steps
    checked = checked_algorithms(args.checked)
    rows: list[dict] = []
    shape_checks = [0, 0]  # checked, failed
    for coll in args.collectives:
        for nbytes in sorted(set(sizes(args.min_bytes, args.max_bytes, args.step)) | set(args.extra_bytes)):
            count = max(nbytes // 4, 1)
            count = -(-count // world) * world  # divisible where the collective needs it
            nb = count * 4
            g = torch.Generator(device=dev).manual_seed(args.seed + rank)
            x = torch.randn(count, device=dev, generator=g)
            case = Case(coll, x, world, rank)
            case.pristine = x.clone()
            algos = [a for a in ALGORITHMS[coll] + ("auto",) if may_time(checked, coll, a)]
            nccl_us = None
            for impl in ["nccl", *algos]:
                ok, problem = True, None
                if impl != "nccl":
                    case.be = be
                    try:
                        problem = case.check(impl)
                    except Exception as exc:  # a timeout, a mismatch, a launch error
                        problem = f"{type(exc).__name__}: {str(exc)[:200]}"
                    bad = torch.tensor([1.0 if problem else 0.0], device=dev)
                    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                    ok = not bad.item()
                    shape_checks[0] += 1
                    if not ok:
                        shape_checks[1] += 1
                        failures.append(
                            f"rank {rank}: {coll} {impl} {nb} B: {problem or 'failed on another rank'}"
                        )
                        if rebuild_needed(be, dev):
                            be = fresh_backend(be)
                        case.be = be
                row = dict(collective=coll, impl="nccl" if impl == "nccl" else "nanoparallel",
                           algorithm=impl, chosen=be._algorithm(coll, "auto", nb) if impl == "auto" else impl,
                           bytes=nb, count=count, dtype="float32", checked=None if impl == "nccl" else ok)  # fmt: skip
                if ok:
                    fn = case.nccl if impl == "nccl" else (lambda a=impl, c=case: c.ours(a))
                    us, host_us = time_calls(fn, _iters(nb, args.max_iters), dev)
                    algbw = nb / (us * 1e-6) / 1e9
                    if impl == "nccl":
                        nccl_us = us
                    row.update(time_us=round(us, 2), host_us=round(host_us, 2), algbw_GBps=round(algbw, 2),
                               busbw_GBps=round(algbw * bus_factor(coll, world), 2),
                               speedup_vs_nccl=round(nccl_us / us, 3) if nccl_us else None)  # fmt: skip
                rows.append(row)
            if rank == 0:
                last = [r for r in rows if r["bytes"] == nb and r["collective"] == coll]
                print(f"{coll:15s} {nb:>11d} B  " + "  ".join(
                    f"{r['algorithm']}={r['time_us']:.1f}us/{r['busbw_GBps']:.0f}GB/s" if r.get("time_us")
                    else f"{r['algorithm']}=FAILED" for r in last), flush=True)  # fmt: skip
            del case, x
        if rank == 0 and rows:
            _report(
                rows, world, cases, failures, shape_checks, partial=True, args=args, be=be, tuned=tuned
            ).write(tag=args.tag, out_dir=args.out)
    be.barrier()
    be.close()
    dist.destroy_process_group()
    results.put((rank, cases, failures, check_s, rows, shape_checks, tuned))


COLUMNS = ["collective", "impl", "algorithm", "chosen", "bytes", "count", "dtype", "checked", "time_us",
           "host_us", "algbw_GBps", "busbw_GBps", "speedup_vs_nccl"]  # fmt: skip


def _report(rows, world, cases, failures, shape_checks, partial, args, be=None, tuned=None):
    """The Report of the rows so far (``partial``: written after each collective, no ceilings)."""
    from nanoparallel.cuda import ALGORITHMS
    from paperclub.bench import Report

    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    policy = be.policy if be is not None else None
    report = Report(
        package="nanoparallel",
        title=f"GPU collectives on {world} GPUs: nanoparallel.cuda (peer memory, Triton) vs NCCL",
        peer=f"NCCL {nccl} (torch.distributed, NVLS off)",
        columns=COLUMNS,
        packages=["torch", "triton"],
        measure_ceilings=not partial,
        notes=(
            ("PARTIAL (written after each collective; the run did not finish). " if partial else "")
            + f"Every implementation checked at each timed size against NCCL's result before it was timed: "
            f"{shape_checks[0] - shape_checks[1]} of {shape_checks[0]} (implementation, size) checks passed"
            + (f" ({'; '.join(failures[:5])})" if failures else "")
            + (f"; check_all (quick) first: {cases - len(failures)} of {cases} cases" if cases else "")
            + f". Algorithms {dict(ALGORITHMS)}. "
            "Time per call: CUDA events around back-to-back calls issued from Python, slowest rank. "
            "busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all), "
            "1 (broadcast), as in nccl-tests (nanoparallel.cost_model.bus_factor). NCCL_NVLS_ENABLE=0, "
            "TORCH_SYMM_MEM_DISABLE_MULTICAST=1. "
            + (
                f"Pipelined variants timed at {args.pipeline_steps} steps. "
                if args.pipeline_steps
                else "Pipelined variants timed at the policy's steps. "
            )
            + (f"Steps and programs from the diagnose run of this job: {tuned}. " if tuned else "")
            + (
                f"'auto' as committed when this ran: {dict(policy.algorithms)} ({policy.source})."
                if policy
                else ""
            )
        ),
    )
    for r in rows:
        report.add(**{c: r.get(c) for c in COLUMNS})
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
        "--pipeline-steps",
        type=int,
        default=None,
        help="steps of every pipelined variant (default: the policy's)",
    )
    p.add_argument("--max-iters", type=int, default=100, help="timed calls per measurement at small sizes")
    p.add_argument("--check-all", action="store_true", help="run check_all (quick) before the sweep")
    p.add_argument(
        "--checked", default=None, help="check --groups summary: time only new algorithms that passed"
    )
    p.add_argument("--tuning", default=None, help="steps and programs from tuning --tuning-out")
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
    cases = out[0][1]
    failures = [f for o in out for f in o[2]]
    rows, shape_checks, tuned = out[0][4], out[0][5], out[0][6]
    report = _report(rows, world, cases, failures, shape_checks, partial=False, args=args, tuned=tuned)
    report.notes += f" 'auto' as committed when this ran: {_policy_note(world)}"
    report.write(tag=args.tag, out_dir=args.out)
    if failures:
        print(f"\n{len(failures)} correctness failures:\n" + "\n".join(failures[:40]))
        raise SystemExit(1)


def _policy_note(world: int) -> str:
    from nanoparallel.cuda.policy import policy_for

    pol = policy_for(world)
    return f"{dict(pol.algorithms)} ({pol.source})."


if __name__ == "__main__":
    main()
