"""Run the peer kernels on a CPU: one process per rank under ``TRITON_INTERPRET=1``.

Host shared memory stands in for GPU peer memory: every rank's staging buffer and flags are CPU
tensors in shared memory, mapped into every worker, and a worker passes the kernels the same
element offsets to its peers' buffers that :class:`~nanoparallel.cuda.CudaPeerBackend` passes on a
GPU. The interpreter runs the programs of a grid one after another, in index order, in every worker
at once, so program ``b`` of each rank meets program ``b`` of the others at the flag barriers just
as on GPUs. This is how the tests exercise the real kernels, barriers included, without a GPU.

    with EmulatedPeers(world_size=3) as peers:
        peers.run("one_shot_all_reduce_kernel", grid, per_rank_args, symmetric={"buf": (bufs, "D")})
        peers.run("broadcast.ring_broadcast_kernel", ...)  # a kernel of nanoparallel.cuda.broadcast
"""

from __future__ import annotations

import importlib
import os
import queue
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp

from paperclub.triton_compat import patch_interpreter


def _deltas(tensors: Sequence[torch.Tensor], rank: int) -> tuple[int, ...]:
    me = tensors[rank].data_ptr()
    size = tensors[rank].element_size()
    return tuple((t.data_ptr() - me) // size for t in tensors)


def _worker(rank: int, jobs, results) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    patch_interpreter()  # run-time loop bounds and scalar truth, and bf16 right, under the interpreter
    from nanoparallel.cuda import kernels as K

    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            name, grid, args, symmetric = job
            args = dict(args)
            for arg, (tensors, delta_arg) in symmetric.items():
                args[arg] = tensors[rank]
                args[delta_arg] = _deltas(tensors, rank)
            if "." in name:  # "broadcast.ring_broadcast_kernel": a kernel of nanoparallel.cuda.broadcast
                module, attr = name.rsplit(".", 1)
                kernel = getattr(importlib.import_module(f"nanoparallel.cuda.{module}"), attr)
            else:
                kernel = getattr(K, name)
            kernel[(grid,)](**args)
            results.put((rank, None))
        except Exception as exc:  # report, do not die: the parent raises with the message
            results.put((rank, f"{type(exc).__name__}: {exc}"))


class EmulatedPeers:
    """``world_size`` worker processes that launch kernels together on shared host tensors."""

    def __init__(self, world_size: int, max_programs: int = 16) -> None:
        self.world_size = world_size
        self.max_programs = max_programs
        self.epoch = 0
        self.flags = [
            torch.zeros(max_programs * world_size, dtype=torch.int32).share_memory_()
            for _ in range(world_size)
        ]
        self.err = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(world_size)]
        self._ctx = mp.get_context("spawn")
        self._jobs = [self._ctx.Queue() for _ in range(world_size)]
        self._results = self._ctx.Queue()
        self._procs = []

    def __enter__(self) -> EmulatedPeers:
        # the kernels are decorated when nanoparallel.cuda is imported, which a spawned worker does
        # before _worker runs: the variable must already be in the environment it inherits
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            for r in range(self.world_size):
                p = self._ctx.Process(target=_worker, args=(r, self._jobs[r], self._results), daemon=True)
                p.start()
                self._procs.append(p)
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
        return self

    def __exit__(self, *exc) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def shared(self, make) -> list[torch.Tensor]:
        """One shared-memory tensor per rank, ``make(rank)`` giving its contents."""
        return [make(r).contiguous().share_memory_() for r in range(self.world_size)]

    def run(
        self,
        kernel: str,
        grid: int,
        per_rank: Sequence[dict],
        symmetric: dict,
        barriers: int,
        max_spins: int = 2_000_000,
        timeout_s: float = 120.0,
    ) -> None:
        """Launch ``kernel`` on every rank; ``per_rank[r]`` holds rank r's own arguments.

        ``symmetric`` maps an argument to (one tensor per rank, name of its offsets argument); the
        flags are added here. Raises with every rank's message if any rank failed or timed out.
        """
        if grid > self.max_programs:
            raise ValueError(f"grid {grid} exceeds the {self.max_programs} programs the flags were sized for")
        symmetric = {"flags": (self.flags, "F"), **symmetric}
        for r in range(self.world_size):
            args = dict(per_rank[r], err=self.err[r], epoch=self.epoch, max_spins=max_spins)
            self._jobs[r].put((kernel, grid, args, symmetric))
        self.epoch += barriers
        errors = {}
        for _ in range(self.world_size):
            try:
                rank, msg = self._results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"{kernel}: a worker did not answer within {timeout_s} s") from None
            if msg:
                errors[rank] = msg
        if errors:
            raise RuntimeError(f"{kernel} failed: {errors}")
        bad = [r for r in range(self.world_size) if int(self.err[r].item())]
        if bad:
            codes = {r: int(self.err[r].item()) for r in bad}
            for r in bad:
                self.err[r].zero_()
            raise RuntimeError(f"{kernel}: error words set on ranks {codes}")
