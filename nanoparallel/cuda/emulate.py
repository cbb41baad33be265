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
        if job[0] == "launcher":
            _run_launcher(rank, job[1:], results)
            continue
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


class _Sym:
    """One symmetric allocation of the emulator, as the launchers see a CudaPeerBackend's."""

    def __init__(self, tensors: Sequence[torch.Tensor], rank: int) -> None:
        self.tensors, self.rank = tensors, rank

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.tensors[self.rank].view(dtype)

    def deltas(self, dtype: torch.dtype) -> tuple[int, ...]:
        return _deltas([t.view(dtype) for t in self.tensors], self.rank)


class EmulatedBackend:
    """What the launchers of broadcast.py, all_gather.py and all_reduce.py use of a CudaPeerBackend,
    on the emulator's shared host buffers: so the launchers themselves (pieces, positional
    arguments, epochs, the header of each call) run under the interpreter, not only the kernels."""

    def __init__(self, rank, world_size, staging, headers, flags, err, epoch, staging_cap, programs, steps):
        self.rank, self.world_size, self.staging_cap = rank, world_size, staging_cap
        self.staging, self.headers, self.epoch, self.parity = staging, headers, epoch, 0
        self.programs, self.steps, self.max_spins = programs, steps, 2_000_000
        self._sync = (flags[rank], _deltas(flags, rank), err)

    def _programs(self, collective: str, algorithm: str, nbytes: int) -> int:
        return self.programs

    def _pipeline_steps(self, collective: str, nbytes: int, algorithm: str) -> int:
        return self.steps

    def _next(self, nbytes: int, barriers: int):
        if nbytes > self.staging[self.parity][0].numel():
            raise ValueError(f"a launch asked for {nbytes} staging bytes, more than the emulator's buffers")
        buf = _Sym(self.staging[self.parity], self.rank)
        self.parity ^= 1
        epoch, self.epoch = self.epoch, self.epoch + barriers
        return buf, epoch

    def _header(self) -> _Sym:
        return _Sym(self.headers[self.parity ^ 1], self.rank)

    def _launch(self, kernel, grid: int, args: tuple, num_warps: int = 8) -> None:
        kernel[(grid,)](*args)  # positionally, as CudaPeerBackend._launch passes them


def _run_launcher(rank: int, job: tuple, results) -> None:
    name, per_rank, shared, epoch, staging_cap, programs, steps = job
    try:
        module, attr = name.rsplit(".", 1)
        fn = getattr(importlib.import_module(f"nanoparallel.cuda.{module}"), attr)
        be = EmulatedBackend(rank, len(shared["flags"]), shared["staging"], shared["headers"], shared["flags"],
                             shared["err"][rank], epoch, staging_cap, programs, steps)  # fmt: skip
        fn(be, *per_rank[rank])
        results.put((rank, ("epoch", be.epoch)))
    except Exception as exc:
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
        self._raise_error_words(kernel)

    def run_launcher(
        self, name: str, per_rank: Sequence[tuple], staging_cap: int, programs: int, steps: int,
        staging_bytes: int = 1 << 20, timeout_s: float = 120.0,
    ) -> None:  # fmt: skip
        """Call launcher ``name`` ("broadcast.broadcast_ring") on every rank as ``fn(be, *per_rank[r])``
        with an :class:`EmulatedBackend`: two staging buffers of ``staging_bytes``, ``staging_cap``
        (small, so that messages go in pieces), a grid of at most ``programs`` and ``steps`` steps.
        Raises as :meth:`run` does."""
        W = self.world_size
        if not hasattr(self, "_staging") or self._staging[0][0].numel() != staging_bytes:
            self._staging = [[torch.zeros(staging_bytes, dtype=torch.uint8).share_memory_() for _ in range(W)]
                             for _ in range(2)]  # fmt: skip
            self._headers = [
                [torch.zeros(8, dtype=torch.int64).share_memory_() for _ in range(W)] for _ in range(2)
            ]
        shared = dict(staging=self._staging, headers=self._headers, flags=self.flags, err=self.err)
        for r in range(W):
            self._jobs[r].put(
                ("launcher", name, list(per_rank), shared, self.epoch, staging_cap, programs, steps)
            )
        errors, epochs = {}, set()
        for _ in range(W):
            try:
                rank, msg = self._results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"{name}: a worker did not answer within {timeout_s} s") from None
            if isinstance(msg, tuple):
                epochs.add(msg[1])
            else:
                errors[rank] = msg
        if errors:
            raise RuntimeError(f"{name} failed: {errors}")
        self.epoch = max(epochs)  # the same on every rank: each took the same launches
        self._raise_error_words(name)

    def _raise_error_words(self, kernel: str) -> None:
        bad = [r for r in range(self.world_size) if int(self.err[r].item())]
        if bad:
            codes = {r: int(self.err[r].item()) for r in bad}
            for r in bad:
                self.err[r].zero_()
            raise RuntimeError(f"{kernel}: error words set on ranks {codes}")
