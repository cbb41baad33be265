"""Run functions on a small world of worker processes (spawned once, reused many times).

Tests and the benchmark need n processes that keep their communicators between calls: spawning
and importing torch costs seconds per process on a small machine, so a :class:`World` keeps its
workers and sends them tasks. The parent hosts the TCPStore, so the store outlives any worker
(which the dead-rank tests rely on).

    with World(4) as w:
        results = w.run(my_module.task, arg1, arg2)   # task(ctx, arg1, arg2) on every rank

``ctx`` is a per-worker dict: ``rank``, ``world_size``, ``store`` and whatever tasks keep in it.
Task functions must be importable (module level) because they travel by pickle.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(world: int, target, args, timeout_s: float, crashed=lambda message: None) -> list:
    """Run ``target(rank, world, port, args, results)`` once in each of ``world`` fresh spawned
    processes (for jobs that own their devices, unlike :class:`World`'s reusable workers) and return
    the one message each puts on ``results``, in arrival order. ``port`` is free for a store or a
    process group. ``crashed(message)`` gives the error text of a rank that failed, else None: the
    others would wait for it forever, so the run stops at once with that text (SystemExit), as it
    does when no message comes within ``timeout_s``. Every process is joined, and killed if it does
    not end."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, args, results)) for r in range(world)]
    for pr in procs:
        pr.start()
    out: list = []
    try:
        while len(out) < world:
            try:
                message = results.get(timeout=timeout_s)
            except queue.Empty:
                raise SystemExit(
                    f"spawn_ranks: {world - len(out)} of {world} ranks sent nothing in {timeout_s} s"
                ) from None
            error = crashed(message)
            if error:
                raise SystemExit(error)
            out.append(message)
    finally:
        for pr in procs:
            pr.join(timeout=30 if len(out) == world else 1)
            if pr.is_alive():
                pr.kill()
    return out


class TaskError(RuntimeError):
    """A task raised on a worker; ``kind`` is the exception's class name."""

    def __init__(self, rank: int, kind: str, message: str, tb: str):
        super().__init__(f"rank {rank}: {kind}: {message}\n{tb}")
        self.rank, self.kind, self.message = rank, kind, message


def _worker(rank: int, world_size: int, port: int, inbox, outbox, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, False, timedelta(seconds=120))
    ctx = {"rank": rank, "world_size": world_size, "store": store}
    outbox.put(("ready", rank, None))
    while True:
        item = inbox.get()
        if item is None:
            break
        fn, args, kwargs = item
        t0 = time.perf_counter()
        try:
            result = fn(ctx, *args, **kwargs)
            outbox.put(("ok", rank, (result, time.perf_counter() - t0)))
        except BaseException as exc:  # report everything: the parent decides what is expected
            outbox.put(
                (
                    "error",
                    rank,
                    (type(exc).__name__, str(exc), traceback.format_exc(), time.perf_counter() - t0),
                )
            )
    for comm in ctx.get("comms", {}).values():
        try:
            comm.close()
        except Exception:
            pass


class World:
    """``n`` spawned worker processes; ``run`` executes a task on all of them."""

    def __init__(self, n: int, *, threads: int = 1, start_timeout: float = 120.0):
        import torch.distributed as dist

        self.n = n
        ctx = mp.get_context("spawn")
        self.port = free_port()
        self.store = dist.TCPStore(
            "127.0.0.1", self.port, n + 1, True, timedelta(seconds=120), wait_for_workers=False
        )
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, n, self.port, self.inboxes[r], self.outbox, threads), daemon=True
            )
            for r in range(n)
        ]
        for p in self.procs:
            p.start()
        ready = 0
        deadline = time.monotonic() + start_timeout
        while ready < n:
            kind, rank, _ = self.outbox.get(timeout=max(deadline - time.monotonic(), 0.1))
            ready += kind == "ready"

    def submit(self, fn, *args, **kwargs) -> None:
        for q in self.inboxes:
            q.put((fn, args, kwargs))

    def collect(self, timeout: float = 120.0, ranks=None) -> dict[int, tuple]:
        """``{rank: ("ok", (result, seconds)) | ("error", (kind, msg, tb, seconds)) | ("dead", None)}``."""
        want = set(range(self.n) if ranks is None else ranks)
        out: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while want - set(out):
            try:
                kind, rank, payload = self.outbox.get(timeout=0.2)
                out[rank] = (kind, payload)
            except queue.Empty:
                for r in want - set(out):
                    if not self.procs[r].is_alive():
                        out[r] = ("dead", None)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"World.collect: ranks {sorted(want - set(out))} gave no answer in {timeout}s"
                    ) from None
        return out

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; the results in rank order, or TaskError."""
        self.submit(fn, *args, **kwargs)
        res = self.collect(timeout)
        # report the root cause: a rank's own failure before the peers that saw it abort
        order = sorted(
            range(self.n), key=lambda r: res[r][0] == "error" and res[r][1][0] == "PeerFailureError"
        )
        for r in order:
            kind, payload = res[r]
            if kind == "error":
                raise TaskError(r, payload[0], payload[1], payload[2])
            if kind == "dead":
                raise TaskError(r, "dead", "worker process died", "")
        return [res[r][1][0] for r in range(self.n)]

    def close(self) -> None:
        for q, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
