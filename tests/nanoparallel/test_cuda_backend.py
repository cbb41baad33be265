"""CudaPeerBackend on real GPUs: one process per GPU, every collective and algorithm checked.

Needs at least two CUDA GPUs on one host (symmetric memory maps distinct devices into each other);
skipped otherwise, with the reason. The checks themselves live in nanoparallel.cuda.check so the
GPU sweep runs the very same ones in its job.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs >= 2 CUDA GPUs on one host, found {N_GPUS}")


def _worker(rank: int, world: int, port: int, job: str, results) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    try:
        import torch.distributed as dist

        from nanoparallel.cuda import CudaPeerBackend
        from nanoparallel.cuda.check import check_all
        from nanoparallel.errors import CommTimeoutError

        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world,
            is_master=rank == 0,
            timeout=__import__("datetime").timedelta(seconds=120),
        )
        be = CudaPeerBackend(
            rank, world, store, torch.device("cuda", rank), timeout_s=20, staging_bytes=64 << 20
        )
        if job == "check":
            cases, failures = check_all(be, seed=1234)
            results.put((rank, cases, failures))
        elif job == "errors":
            problems = []
            t = torch.ones(8, device=f"cuda:{rank}")
            for call, pattern in [
                (lambda: be.all_reduce(t, op="prod"), "op 'prod'"),
                (lambda: be.all_reduce(t, algorithm="tree"), "algorithm 'tree'"),
                (lambda: be.all_reduce(t.cpu()), "expected cuda"),
                (lambda: be.all_gather(torch.empty(3, device=t.device), t), "expected world_size"),
                (lambda: be.reduce_scatter(torch.empty(3, device=t.device), t), "expected world_size"),
                (lambda: be.broadcast(t, root=world), "root must be in"),
                (lambda: be.all_to_all(t.clone(), t, input_splits=[9] + [0] * (world - 1)), "sums to 9"),
            ]:
                try:
                    call()
                    problems.append(f"no error for {pattern}")
                except (ValueError, TypeError) as exc:
                    if pattern not in str(exc):
                        problems.append(f"error for {pattern!r} says {exc}")
            be.barrier()
            # a collective only rank 1 calls: its GPU barrier must give up and barrier()/check() raise
            timed = None
            if rank == 1:
                be.timeout_s, be.max_spins = 2.0, 2_000_000
                t0 = time.perf_counter()
                be.all_reduce(t, algorithm="one_shot")
                try:
                    be.check("lonely all_reduce")
                    problems.append("a collective no peer joined did not time out")
                except CommTimeoutError:
                    timed = time.perf_counter() - t0
            results.put((rank, timed, problems))
        be.close()
    except Exception as exc:  # the parent reports it
        import traceback

        results.put((rank, None, [f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"]))


def _spawn(job: str, world: int) -> list[tuple]:
    """One process per GPU running ``job`` (nanoparallel.launch.spawn_ranks; a crashed rank reports
    its traceback as a failure instead of stopping the run); the reports in rank order."""
    from nanoparallel.launch import spawn_ranks

    try:
        out = spawn_ranks(world, _worker, job, timeout_s=540)
    except SystemExit as exc:
        pytest.fail(f"{job}: {exc}")
    return sorted(out, key=lambda r: r[0])


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.claim(
    "nanoparallel/p2p-kernels", section="Intra-node data transfer: P2P transport (arXiv 2507.04786v1)"
)
def test_every_collective_and_algorithm_on_gpus():
    world = min(N_GPUS, 8)
    out = _spawn("check", world)
    failures = [f for _, _, fs in out for f in fs]
    cases = [c for _, c, _ in out]
    assert not failures, f"{len(failures)} of {sum(c or 0 for c in cases)} checks failed:\n" + "\n".join(
        failures[:40]
    )
    assert all(c and c > 500 for c in cases), f"too few cases ran: {cases}"


@pytest.mark.gpu
@needs_two_gpus
def test_bad_arguments_and_lonely_collective_raise():
    out = _spawn("errors", min(N_GPUS, 8))
    problems = [p for _, _, ps in out for p in ps]
    assert not problems, "\n".join(problems)
    timed = out[1][1]
    print(f"lonely collective raised CommTimeoutError after {timed:.2f} s (timeout_s=2)")
    assert timed is not None and timed < 60
