"""Run the peer kernels on a CPU: one process per rank under ``TRITON_INTERPRET=1``.

Host shared memory stands in for GPU peer memory: every rank's staging buffer and flags are CPU
tensors in shared memory, mapped into every worker, and a worker passes the kernels the same
element offsets to its peers' buffers that :class:`~nanoparallel.cuda.CudaPeerBackend` passes on a
GPU. The interpreter runs the programs of a grid one after another, in index order, in every worker
at once, so program ``b`` of each rank meets program ``b`` of the others at the flag barriers just
as on GPUs. This is how the tests exercise the real kernels, barriers included, without a GPU.

That default hides what a GPU does and the interpreter does not: all programs of a launch run at
once, in no fixed order, and a rank starts its next call while its peers are still in the last one.
A :class:`Schedule` puts that back: ``resident`` programs of a rank run at once (threads, each with
its own ``tl.program_id``), dispatched in index order, reversed, or shuffled per rank, a new one as
soon as one ends (the GPU's block scheduler, with ``resident`` standing for what fits on the SMs);
``run_launcher`` with ``calls`` runs several calls per rank back to back with no host barrier
between them, and ``skew_s`` makes chosen ranks late for each call, so a fast rank is one call ahead.

    with EmulatedPeers(world_size=3) as peers:
        peers.run("all_reduce.one_shot_all_reduce_kernel", grid, per_rank_args, symmetric={"buf": (bufs, "D")})
        peers.run("broadcast.ring_broadcast_kernel", ...)  # "file.kernel": a kernel of nanoparallel.cuda.broadcast
        peers.run("lab.diagnose.peer_copy_kernel", ...)    # a lab probe: nanoparallel.cuda.lab.diagnose
"""

from __future__ import annotations

import importlib
import inspect
import os
import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from paperclub.triton_compat import patch_interpreter


@dataclass(frozen=True)
class Schedule:
    """How the programs of one launch run on each rank (see the module docstring).

    ``resident``: programs of a rank running at once (1: the interpreter's own loop, one after
    another); ``order``: the order they are dispatched in, "index", "reversed", or "shuffled"
    (a permutation per rank and launch, from ``seed``)."""

    resident: int = 1
    order: str = "index"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.order not in ("index", "reversed", "shuffled"):
            raise ValueError(f"Schedule: order must be 'index', 'reversed' or 'shuffled', got {self.order!r}")
        if self.resident < 1:
            raise ValueError(f"Schedule: resident must be at least 1, got {self.resident}")

    def programs(self, grid: int, rank: int, launch: int) -> list[int]:
        """The program ids of a grid in dispatch order on ``rank``."""
        ids = list(range(grid))
        if self.order == "reversed":
            ids.reverse()
        elif self.order == "shuffled":
            random.Random(hash((self.seed, rank, launch))).shuffle(ids)
        return ids


SEQUENTIAL = Schedule()
_program = threading.local()


def _thread_local_program_ids() -> None:
    """Make the interpreter's program id per thread (it is one attribute of one global builder)."""
    from triton.runtime import interpreter as interp

    cls = type(interp.interpreter_builder)
    if getattr(cls, "_nanoparallel_per_thread", False):
        return

    def get(self):
        return getattr(_program, "idx", None) or self.__dict__.get("_shared_grid_idx")

    def set_(self, value):
        if getattr(_program, "idx", None) is None:  # the interpreter's own loop, on the calling thread
            self.__dict__["_shared_grid_idx"] = value
        else:
            _program.idx = value

    cls.grid_idx = property(get, set_)
    atomic_rmw = cls.create_atomic_rmw

    def polite_atomic_rmw(self, *args, **kwargs):
        # a program spinning on a flag would keep the GIL from the one that is to set it: every
        # atomic of a program thread first lets the others run (the waits poll through atomics)
        if getattr(_program, "idx", None) is not None:
            time.sleep(0)
        return atomic_rmw(self, *args, **kwargs)

    cls.create_atomic_rmw = polite_atomic_rmw
    cls._nanoparallel_per_thread = True


def _launch(kernel, grid: int, args: tuple, kwargs: dict, schedule: Schedule, rank: int, launch: int) -> None:
    """``kernel[(grid,)](*args, **kwargs)`` with the programs run as ``schedule`` says."""
    if schedule.resident == 1 and schedule.order == "index":
        kernel[(grid,)](*args, **kwargs)
        return
    from triton.runtime import interpreter as interp

    _thread_local_program_ids()
    order = schedule.programs(grid, rank, launch)

    class Concurrent(interp.GridExecutor):
        """Triton's GridExecutor.__call__ (3.6) with its loop over programs replaced by threads."""

        def __call__(self, *args_dev, **kw):
            argspec = inspect.getfullargspec(self.fn)
            kw = {k: v for k, v in kw.items() if k in argspec.args}
            args_hst, kwargs_hst = self._init_args_hst(args_dev, kw)
            patch_lang = interp._patch_lang
            patch_scope = patch_lang(self.fn)
            # every call of a device function patches triton.language again; from several threads at
            # once that swaps methods under a running program (seen: Tensor.__index__ without
            # paperclub's fix). Patched once here, the nested calls leave it alone.
            interp._patch_lang = lambda fn: _NO_PATCH
            try:
                bound = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
                bound = {n: a if n in self.constexprs else interp._implicit_cvt(a) for n, a in bound.items()}
                interp.interpreter_builder.set_grid_dim(grid, 1, 1)
                _run_threads(self.fn, bound, order, schedule.resident)
            finally:
                interp._patch_lang = patch_lang
                patch_scope.restore()
            self._restore_args_dev(args_dev, args_hst, kw, kwargs_hst)

    Concurrent(kernel.rewrite(), kernel.arg_names, (grid,), kernel.pre_run_hooks)(*args, **kwargs)


class _NoPatch:
    def restore(self) -> None:
        pass


_NO_PATCH = _NoPatch()


def _run_threads(fn, bound: dict, order: list[int], resident: int) -> None:
    """Program ``b`` of ``order`` as a thread with its own program id, at most ``resident`` at once,
    each started when a slot frees (in dispatch order, as a GPU's block scheduler)."""
    slots = threading.Semaphore(resident)
    errors: list[BaseException] = []

    def program(b: int) -> None:
        _program.idx = (b, 0, 0)
        try:
            fn(**bound)
        except BaseException as exc:  # the launch raises it after every program has ended
            errors.append(exc)
        finally:
            _program.idx = None
            slots.release()

    threads = []
    for b in order:
        slots.acquire()
        t = threading.Thread(target=program, args=(b,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _deltas(tensors: Sequence[torch.Tensor], rank: int) -> tuple[int, ...]:
    me = tensors[rank].data_ptr()
    size = tensors[rank].element_size()
    return tuple((t.data_ptr() - me) // size for t in tensors)


def _worker(rank: int, jobs, results) -> None:
    import sys

    os.environ["TRITON_INTERPRET"] = "1"
    patch_interpreter()  # run-time loop bounds and scalar truth, and bf16 right, under the interpreter
    sys.setswitchinterval(1e-3)  # concurrent programs: a spinning thread yields the GIL sooner
    launches = 0
    while True:
        job = jobs.get()
        if job is None:
            return
        if job[0] == "launcher":
            _run_launcher(rank, job[1:], results)
            continue
        launches += 1
        try:
            name, grid, args, symmetric, schedule = job
            args = dict(args)
            for arg, (tensors, delta_arg) in symmetric.items():
                args[arg] = tensors[rank]
                args[delta_arg] = _deltas(tensors, rank)
            # "broadcast.ring_broadcast_kernel": a kernel of nanoparallel.cuda.broadcast
            module, _, attr = name.rpartition(".")
            if not module:
                raise ValueError(
                    f"kernel {name!r}: expected 'module.kernel', e.g. 'all_reduce.ring_all_reduce_kernel'"
                )
            kernel = getattr(importlib.import_module(f"nanoparallel.cuda.{module}"), attr)
            _launch(kernel, grid, (), args, schedule, rank, launches)
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

    def __init__(self, rank, world_size, staging, headers, flags, err, epoch, staging_cap, programs, steps,
                 schedule: Schedule = SEQUENTIAL):  # fmt: skip
        self.rank, self.world_size, self.staging_cap = rank, world_size, staging_cap
        self.staging, self.headers, self.epoch, self.parity = staging, headers, epoch, 0
        self.programs, self.steps, self.max_spins = programs, steps, 2_000_000
        self._sync = (flags[rank], _deltas(flags, rank), err)
        self.schedule, self.launches = schedule, 0

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
        self.launches += 1  # positionally, as CudaPeerBackend._launch passes them
        _launch(kernel, grid, args, {}, self.schedule, self.rank, self.launches)


def _run_launcher(rank: int, job: tuple, results) -> None:
    name, calls, shared, epoch, staging_cap, programs, steps, schedule, skew_s = job
    try:
        module, attr = name.rsplit(".", 1)
        fn = getattr(importlib.import_module(f"nanoparallel.cuda.{module}"), attr)
        be = EmulatedBackend(rank, len(shared["flags"]), shared["staging"], shared["headers"], shared["flags"],
                             shared["err"][rank], epoch, staging_cap, programs, steps, schedule)  # fmt: skip
        for per_rank in calls:  # back to back: no host barrier with the peers between calls
            time.sleep(skew_s.get(rank, 0.0))
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
        schedule: Schedule = SEQUENTIAL,
    ) -> None:
        """Launch ``kernel`` on every rank; ``per_rank[r]`` holds rank r's own arguments.

        ``symmetric`` maps an argument to (one tensor per rank, name of its offsets argument); the
        flags are added here; ``schedule`` says how each rank runs the programs. Raises with every
        rank's message if any rank failed or timed out.
        """
        if grid > self.max_programs:
            raise ValueError(f"grid {grid} exceeds the {self.max_programs} programs the flags were sized for")
        symmetric = {"flags": (self.flags, "F"), **symmetric}
        for r in range(self.world_size):
            args = dict(per_rank[r], err=self.err[r], epoch=self.epoch, max_spins=max_spins)
            self._jobs[r].put((kernel, grid, args, symmetric, schedule))
        self.epoch += barriers
        errors = {}
        for _ in range(self.world_size):
            try:
                rank, msg = self._results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"{kernel}: a worker did not answer within {timeout_s} s"
                    + (f" (the others said: {errors})" if errors else "")
                ) from None
            if msg:
                errors[rank] = msg
        if errors:
            raise RuntimeError(f"{kernel} failed: {errors}")
        self._raise_error_words(kernel)

    def run_launcher(
        self, name: str, per_rank: Sequence[tuple], staging_cap: int, programs: int, steps: int,
        staging_bytes: int = 1 << 20, timeout_s: float = 120.0, schedule: Schedule = SEQUENTIAL,
        calls: Sequence[Sequence[tuple]] | None = None, skew_s: dict[int, float] | None = None,
    ) -> None:  # fmt: skip
        """Call launcher ``name`` ("broadcast.broadcast_ring") on every rank as ``fn(be, *per_rank[r])``
        with an :class:`EmulatedBackend`: two staging buffers of ``staging_bytes``, ``staging_cap``
        (small, so that messages go in pieces), a grid of at most ``programs`` and ``steps`` steps,
        the programs run as ``schedule`` says. ``calls`` (a list of ``per_rank``s) instead makes
        every rank call it once per entry, back to back, each call after a sleep of ``skew_s[rank]``
        seconds (a late rank). Raises as :meth:`run` does."""
        W = self.world_size
        if not hasattr(self, "_staging") or self._staging[0][0].numel() != staging_bytes:
            self._staging = [[torch.zeros(staging_bytes, dtype=torch.uint8).share_memory_() for _ in range(W)]
                             for _ in range(2)]  # fmt: skip
            self._headers = [
                [torch.zeros(8, dtype=torch.int64).share_memory_() for _ in range(W)] for _ in range(2)
            ]
        shared = dict(staging=self._staging, headers=self._headers, flags=self.flags, err=self.err)
        calls = [list(c) for c in calls] if calls is not None else [list(per_rank)]
        for r in range(W):
            self._jobs[r].put(
                (
                    "launcher",
                    name,
                    calls,
                    shared,
                    self.epoch,
                    staging_cap,
                    programs,
                    steps,
                    schedule,
                    skew_s or {},
                )
            )
        errors, epochs = {}, set()
        for _ in range(W):
            try:
                rank, msg = self._results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"{name}: a worker did not answer within {timeout_s} s"
                    + (f" (the others said: {errors})" if errors else "")
                ) from None
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
