"""Worker-side tasks and references for the tests and the benchmark (importable by spawned workers).

Each rank's input is drawn from a seed and the rank, so the parent process can rebuild every
rank's input and compute the reference without any communication.
"""

from __future__ import annotations

import time

import torch

import nanoparallel as npl
from nanoparallel.errors import PeerFailureError

# Small slots on purpose in tests: tensors of a few hundred elements already span many chunks,
# channels and slot reuse (back-pressure), which is where pipelining bugs live.
TRANSPORTS = {
    "shm-simple": dict(transport="shm", protocol="simple", slot_bytes=256, nslots=2, n_channels=2),
    "shm-ll": dict(transport="shm", protocol="ll", slot_bytes=256, nslots=2, n_channels=2),
    "torch": dict(transport="torch", slot_bytes=256, n_channels=2),
}


def make_input(seed: int, rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(count, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int64).to(dtype)


def comm_for(ctx: dict, key: str, timeout_s: float = 20.0, **overrides) -> npl.Communicator:
    """The worker's communicator for ``key`` (created on first use by all ranks together)."""
    comms = ctx.setdefault("comms", {})
    if key not in comms:
        kwargs = dict(TRANSPORTS.get(key, {}))
        kwargs.update(overrides)
        comms[key] = npl.init(
            ctx["rank"], ctx["world_size"], store=ctx["store"], timeout_s=timeout_s, name=key, **kwargs
        )
    return comms[key]


def run_case(
    ctx: dict,
    key: str,
    collective: str,
    algorithm: str,
    dtype: torch.dtype,
    count: int,
    op: str,
    root: int,
    seed: int,
    repeat: int = 1,
) -> dict:
    """Run one collective on this rank's seeded input; return outputs (and bytes sent) for checking."""
    comm = comm_for(ctx, key)
    r, n = ctx["rank"], ctx["world_size"]
    outs = []
    sent = []
    for _ in range(repeat):
        x = make_input(seed, r, count, dtype)
        before = comm.transport.bytes_sent
        if collective == "all_reduce":
            comm.all_reduce(x, op=op, algorithm=algorithm)
            outs.append(x)
        elif collective == "reduce_scatter":
            out = torch.empty(count // n, dtype=dtype)
            comm.reduce_scatter(out, x, op=op, algorithm=algorithm)
            outs.append(out)
        elif collective == "all_gather":
            out = torch.empty(count * n, dtype=dtype)
            comm.all_gather(out, x, algorithm=algorithm)
            outs.append(out)
        elif collective == "broadcast":
            comm.broadcast(x, root=root, algorithm=algorithm)
            outs.append(x)
        elif collective == "reduce":
            keep = x.clone()
            comm.reduce(x, root=root, op=op)
            outs.append(x if r == root else torch.tensor(bool(torch.equal(x, keep))))
        else:
            raise ValueError(collective)
        sent.append(comm.transport.bytes_sent - before)
    return {"outs": outs, "sent": sent, "algorithm": comm.last_algorithm}


def run_all_to_all(
    ctx: dict, key: str, splits: list[list[int]], row: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """``splits[src][dst]`` rows go from src to dst."""
    comm = comm_for(ctx, key)
    r, n = ctx["rank"], ctx["world_size"]
    x = make_input(seed, r, sum(splits[r]) * row, dtype).view(-1, row)
    out = torch.empty(sum(splits[s][r] for s in range(n)), row, dtype=dtype)
    comm.all_to_all(out, x, output_splits=[splits[s][r] for s in range(n)], input_splits=splits[r])
    return out


def reference(collective: str, inputs: list[torch.Tensor], op: str, root: int) -> list[torch.Tensor]:
    """What each rank should hold, computed in float64 (int64 for integers) from all inputs."""
    n = len(inputs)
    wide = torch.float64 if inputs[0].dtype.is_floating_point else torch.int64
    stack = torch.stack([x.to(wide) for x in inputs])
    if collective in ("all_reduce", "reduce_scatter", "reduce"):
        if op in ("sum", "avg"):
            red = stack.sum(0)
            if op == "avg":
                red = red / n if wide == torch.float64 else torch.div(red, n, rounding_mode="floor")
        elif op == "max":
            red = stack.max(0).values
        else:
            red = stack.min(0).values
        if collective == "all_reduce":
            return [red] * n
        if collective == "reduce":
            return [red if r == root else None for r in range(n)]
        m = red.numel() // n
        return [red[r * m : (r + 1) * m] for r in range(n)]
    if collective == "all_gather":
        return [stack.reshape(-1)] * n
    if collective == "broadcast":
        return [stack[root]] * n
    raise ValueError(collective)


# -- fault scenarios (tests/nanoparallel/test_faults.py) --------------------------------------


def fault_case(ctx: dict, scenario: str, timeout_s: float) -> dict:
    """Run one failure scenario; return what this rank saw and how long it took to see it."""
    r = ctx["rank"]
    if scenario == "stopped-rank-hosts":
        import os

        os.environ["NANOPARALLEL_HOSTNAME"] = f"host{r}"  # every rank "elsewhere": store heartbeats
        comm = comm_for(ctx, f"faults-{scenario}", timeout_s=timeout_s, transport="auto", slot_bytes=4096)
        assert not comm.liveness.same_host and comm.transport.name == "torch"
    else:
        comm = comm_for(
            ctx, f"faults-{scenario}", timeout_s=timeout_s, transport="shm", slot_bytes=4096, nslots=2
        )
    t0 = time.monotonic()
    try:
        # inside the try: a rank that dies right after its barrier may be seen dead by a peer
        # still finishing the same barrier
        comm.barrier()
        if scenario == "mismatch-count":
            comm.all_reduce(torch.ones(100 + (r == 1)))
        elif scenario == "mismatch-op":
            if r == 0:
                comm.broadcast(torch.ones(10), root=0)
            else:
                comm.all_reduce(torch.ones(10))
        elif scenario == "mismatch-dtype":
            comm.all_reduce(torch.ones(10, dtype=torch.float32 if r else torch.bfloat16))
        elif scenario == "mismatch-split":
            n = ctx["world_size"]
            splits = [1] * n
            out_splits = [1] * n
            if r == 0:
                splits = [2] + [1] * (n - 1)  # sends 2 rows to itself, fine locally...
                out_splits = [2] + [1] * (n - 1)
            if r == 1:
                out_splits = [2] + [1] * (n - 2) + [0] if n > 2 else [2, 0]
            comm.all_to_all(
                torch.empty(sum(out_splits), 3),
                torch.ones(sum(splits), 3),
                output_splits=out_splits,
                input_splits=splits,
            )
        elif scenario == "invalid-args":
            comm.all_reduce(torch.ones(10) if r else torch.ones(10, dtype=torch.complex64))
        elif scenario == "dead-rank":
            if r == ctx["world_size"] - 1:
                import os

                os._exit(1)
            comm.all_reduce(torch.ones(1 << 16))
        elif scenario == "stopped-rank-hosts":
            if r == ctx["world_size"] - 1:
                import os
                import signal

                os.kill(os.getpid(), signal.SIGSTOP)  # frozen: pid alive, sockets open, no heartbeat
            comm.all_reduce(torch.ones(1 << 12))
        elif scenario == "hung-rank":
            if r == 1:
                # alive but absent: stay out of the collective until a peer gives up on this rank
                # (its abort word says so), however long that takes on a loaded machine; the cap
                # only stops a hang if nobody ever gives up
                give_up = time.monotonic() + 20 * timeout_s
                while time.monotonic() < give_up:
                    try:
                        comm.liveness.check("hung-rank scenario")
                    except PeerFailureError:
                        break
                    time.sleep(0.05)
            comm.all_reduce(torch.ones(1 << 12))  # rank 1 arrives late: its peers are gone
        else:
            raise ValueError(scenario)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    return {"error": None, "message": "", "seconds": time.monotonic() - t0}


def calibrate_task(ctx: dict, path: str) -> dict:
    """Calibrate the cost model over shared memory (small sizes) and cache it at ``path``."""
    from pathlib import Path

    from nanoparallel import cost_model

    comm = comm_for(ctx, "calibrate", transport="shm")
    prm = cost_model.calibrate(comm, sizes=(8, 1 << 12, 1 << 16, 1 << 20), reps=3)
    if ctx["rank"] == 0:
        cost_model.save("shm-simple", prm, Path(path))
    comm.barrier()
    return prm.__dict__


def out_of_place(ctx: dict, key: str, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """all_reduce(x, out=y): y gets the sum, x stays as it was."""
    comm = comm_for(ctx, key)
    x = make_input(seed, ctx["rank"], count, torch.float32)
    keep = x.clone()
    y = torch.empty_like(x)
    ret = comm.all_reduce(x, out=y)
    return y, x, bool(torch.equal(x, keep)) and ret is y


def spawn_echo(rank: int, world: int, port: int, args, results) -> None:
    """A target for :func:`nanoparallel.launch.spawn_ranks`: reports (rank, world, args); rank
    ``args["crash"]`` (if given) reports a crash instead, the way the GPU jobs' ranks do."""
    if rank == args.get("crash"):
        results.put((rank, None, f"rank {rank} crashed on purpose"))
        return
    results.put((rank, world, None))


class GlooStandIn:
    """The CudaPeerBackend API over gloo, for checking the GPU sweep's per-shape check on CPUs:
    algorithm "right" does each collective as torch.distributed does, "reordered" sums in float64
    first (other rounding, within tolerance), "wrong" spoils the result on rank 1 only."""

    closed = None

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def check(self, what: str = "") -> None:
        pass

    def _spoil(self, t: torch.Tensor, algorithm: str) -> None:
        if algorithm == "wrong" and self.rank == 1 and t.numel():
            t.view(-1)[-1] += 1

    def all_reduce(self, t, op="sum", algorithm="right"):
        import torch.distributed as dist

        if algorithm == "reordered":
            wide = t.double()
            dist.all_reduce(wide)
            t.copy_(wide)
        else:
            dist.all_reduce(t)
        self._spoil(t, algorithm)

    def broadcast(self, t, root=0, algorithm="right"):
        import torch.distributed as dist

        dist.broadcast(t, src=root)
        self._spoil(t, algorithm)

    def all_gather(self, out, inp, algorithm="right"):
        import torch.distributed as dist

        dist.all_gather_into_tensor(out, inp)
        self._spoil(out, algorithm)

    def reduce_scatter(self, out, inp, op="sum", algorithm="right"):
        import torch.distributed as dist

        dist.reduce_scatter_tensor(out, inp)
        self._spoil(out, algorithm)

    def all_to_all(self, out, inp, algorithm="right"):
        import torch.distributed as dist

        dist.all_to_all_single(out, inp)
        self._spoil(out, algorithm)


def sweep_check_task(rank: int, world: int, port: int, args, results) -> None:
    """A spawn_ranks target: the sweep's Case.check of every collective over gloo ranks with
    GlooStandIn; reports {(collective, algorithm): problem or None} from this rank."""
    import datetime

    import torch.distributed as dist

    from nanoparallel.cuda.sweep import COLLECTIVES, Case

    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        got = {}
        for coll in COLLECTIVES:
            x = torch.randn(world * 37, generator=torch.Generator().manual_seed(rank))
            case = Case(coll, x, world, rank)
            case.pristine = x.clone()
            case.be = GlooStandIn(rank)
            for algo in ("right", "reordered", "wrong"):
                if algo == "reordered" and coll not in ("all_reduce",):
                    continue
                got[(coll, algo)] = case.check(algo)
        dist.destroy_process_group()
        results.put((rank, got, None))
    except BaseException as exc:
        import traceback

        results.put((rank, None, f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"))
