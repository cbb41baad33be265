"""The backend: staging buffers in symmetric memory, flags, argument checks, launches, errors.

:class:`CudaPeerBackend` is what ``Communicator(transport="cuda")`` hands CUDA tensors to. Each rank
allocates its staging buffers and flags in torch's symmetric memory
(``torch.distributed._symmetric_memory``): that maps every rank's buffer into every rank's
address space over NVLink, and that is all we take from it. Moving and reducing data, and the
barriers between ranks, are our Triton kernels, one file per collective (``all_reduce.py``,
``reduce_scatter.py``, ``all_gather.py``, ``broadcast.py``, ``all_to_all.py``; what they share,
the barriers included, in ``primitives.py``): loads from peers' buffers, a reduction in
registers, stores, and epoch flags written with release atomics and polled with acquire loads at
system scope. NVLink multicast (NVLS) is never used: the package's ``__init__.py`` forces the
environment switches off before anything initialises, and no kernel issues multimem instructions.

The data path of every call:

* copy the caller's tensor into this rank's staging buffer (inside the kernel, no extra launch);
* barrier with the same-numbered program on every peer;
* read what is needed straight from the peers' staging buffers (one-shot, two-shot, ring, direct),
  or store it into theirs (the pipelined kernels, the ring broadcast, the all-gather
  ``push_pipelined``, the all-to-all ``push``), or let the copy engine pull it (``copy_engine``:
  ``Tensor.copy_`` from a peer's buffer).

What ``algorithm="auto"`` picks is :mod:`nanoparallel.cuda.policy` (tables per world size in
``auto_tables.py``, made from GPU runs by :mod:`nanoparallel.cuda.lab.tuning`).

Two staging buffers alternate between calls, which is why no call needs a closing barrier (see
``primitives.py``). All work goes on the current CUDA stream; callers must use one stream for all
collectives of a backend.

Faults: every barrier spins a bounded number of times (``timeout_s``); when a peer never arrives
the kernel records it in an error word. :meth:`barrier` and :meth:`close` synchronise and raise
:class:`~nanoparallel.errors.CommTimeoutError` if any call since the last check timed out;
``check_errors=True`` checks after every call (one host synchronisation each).

The collectives are functions of the backend in their own files, bound here as its methods
(``CudaPeerBackend.all_reduce`` is ``all_reduce.all_reduce``): no extra call on the host path,
which is what small messages are bound by.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from triton import knobs

from nanoparallel.cuda.all_gather import all_gather as _all_gather
from nanoparallel.cuda.all_reduce import all_reduce as _all_reduce
from nanoparallel.cuda.all_to_all import COPY_ENGINE_PIECES, SplitCache
from nanoparallel.cuda.all_to_all import all_to_all as _all_to_all
from nanoparallel.cuda.broadcast import broadcast as _broadcast
from nanoparallel.cuda.partition import NUM_WARPS, STEP_BYTES, _pow2, split_work
from nanoparallel.cuda.policy import Policy, policy_for
from nanoparallel.cuda.primitives import ERR_SPLITS, ERR_TIMEOUT, OP_CODES, barrier_kernel
from nanoparallel.cuda.reduce_scatter import reduce_scatter as _reduce_scatter
from nanoparallel.errors import CommAbortedError, CommTimeoutError, MismatchError

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": (
        "one_shot",
        "one_shot_push",
        "one_shot_pipelined",
        "two_shot",
        "ring",
        "two_shot_pipelined",
    ),
    "all_gather": ("direct", "copy_engine", "pairwise", "push_pipelined"),
    "reduce_scatter": ("direct", "ring", "pipelined"),
    "broadcast": ("direct", "copy_engine", "ring"),
    "all_to_all": ("direct", "push", "push_pipelined", "copy_engine", "pairwise"),
}
# written for issue #35 and not yet checked on a GPU: named calls only, in no table of "auto", and
# timed by a GPU run only after its check passed (check.may_time). The ring broadcast, the all-gathers
# pairwise and push_pipelined and the all-to-all pairwise left this list after they passed their
# GPU check on 4 and on 2 H100s and were timed (2026-11-28, nanoparallel/results/gpu-plan-2026-11-28/);
# two_shot_pipelined left it after its check passed on 2 H200s (232 cases) and on 4 H200s (464 cases,
# 2026-11-28 14:21, nanoparallel/results/gpu-plan-2026-11-28-x4-h200/) and was timed there. Empty now:
# the next new kernel goes here until a GPU run has checked it.
NEW_ALGORITHMS: dict[str, tuple[str, ...]] = {}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
REDUCE_OPS = tuple(OP_CODES)

# programs per SM at most. Program b of a rank waits for program b of each peer and for nothing else,
# so a grid larger than what fits at once still completes when every GPU starts its programs in
# index order, as CUDA's block scheduler does (not a documented promise); started in different
# orders on different ranks, with fewer resident than the grid, it would wait until timeout_s
# (tests/nanoparallel/test_cuda_bandwidth_kernels_interpret.py runs both schedules). Two programs
# of 256 threads fit an SM where a kernel needs at most 128 registers per thread: most kernels, but
# not two_shot_pipelined in 16-bit types at 4 ranks (182-244) nor the pipelined all-to-all in 16-bit
# types (186 at 2 ranks, 252-255 and spilling at 4): `python -m nanoparallel.cuda.lab.registers`, offline
# sm_90a, 2026-11-28. Their 264-program grids run in two waves; the all-to-all pairwise passed its
# GPU check that way (bf16 cases included) on 4 and 2 H100s.
PROGRAMS_PER_SM = 2
MIN_STAGING_BYTES = 16 << 20
SPINS_PER_S = 5e6
# "auto": tables per world size in nanoparallel/cuda/auto_tables.py (generated from the GPU runs by
# nanoparallel.cuda.lab.tuning, which says how; read by CudaPeerBackend.policy). What the measurements
# behind them found, and why, is on site/pages/nanoparallel/one-shot-two-shot.md and index.md.
# Steps of a pipelined algorithm without a table there:
PIPELINE_STEPS = 4


class _Symmetric:
    """One symmetric allocation: local tensor, peer element offsets, copy-engine views of peers."""

    def __init__(self, nbytes: int, device: torch.device, group) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.nbytes = nbytes
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.local, group)
        self.ptrs = [int(p) for p in self.handle.buffer_ptrs]
        self.rank = int(self.handle.rank)
        # buffer_ptrs may be the bases of pool segments rather than this tensor's address; the
        # tensor sits at the same offset in every rank's segment, so differences are what count
        self.offset = self.local.data_ptr() - self.ptrs[self.rank]
        self._peer_views: list[torch.Tensor] | None = None
        self._deltas: dict[torch.dtype, tuple[int, ...]] = {}
        self._views: dict[torch.dtype, torch.Tensor] = {}

    def deltas(self, dtype: torch.dtype) -> tuple[int, ...]:
        """Peer p's buffer is at ``local.view(dtype) + deltas[p]`` (in elements)."""
        if dtype not in self._deltas:
            self._deltas[dtype] = self._compute_deltas(dtype)
        return self._deltas[dtype]

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._views:
            self._views[dtype] = self.local.view(dtype)
        return self._views[dtype]

    def _compute_deltas(self, dtype: torch.dtype) -> tuple[int, ...]:
        size = torch.empty(0, dtype=dtype).element_size()
        me = self.ptrs[self.rank]
        out = []
        for p in self.ptrs:
            if (p - me) % size:
                raise RuntimeError(f"symmetric buffers are not {size}-byte aligned relative to each other")
            out.append((p - me) // size)
        return tuple(out)

    def peer(self, p: int) -> torch.Tensor:
        """A uint8 tensor on this device that aliases rank p's buffer (for the copy engine)."""
        if self._peer_views is None:
            self._peer_views = [
                self.handle.get_buffer(r, [self.nbytes], torch.uint8, self.offset)
                for r in range(len(self.ptrs))
            ]
        return self._peer_views[p]


class _Launcher:
    """Launches Triton kernels, skipping the JIT's per-call argument binding after the first call.

    Small collectives are bound by host time (the GPU work is a few microseconds), so the path
    from Python to the launch matters. The first call with a given specialisation goes through
    ``kernel[grid](...)``, which compiles; later calls with the same key call the compiled
    kernel's launcher directly. The key holds everything Triton specialises on: constexpr values,
    each tensor's dtype and 16-byte alignment, each integer's ``== 1`` and ``% 16 == 0`` and its
    width (except for ``do_not_specialize`` arguments), and tuples of integers by value.
    """

    def __init__(self, device_index: int, fast: bool = True) -> None:
        self.device_index = device_index
        self.fast = fast
        self._compiled: dict = {}
        self._kinds: dict = {}

    def _param_kinds(self, kernel) -> tuple[str, ...]:
        kinds = self._kinds.get(kernel)
        if kinds is None:
            kinds = tuple(
                "c" if p.is_constexpr else ("n" if p.do_not_specialize else "s") for p in kernel.params
            )
            self._kinds[kernel] = kinds
        return kinds

    def __call__(self, kernel, grid: int, args: tuple, num_warps: int = NUM_WARPS) -> None:
        key = [kernel, num_warps]
        for kind, a in zip(self._param_kinds(kernel), args, strict=True):
            if kind == "c" or isinstance(a, tuple):
                key.append(a)
            elif isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            elif kind == "n":
                key.append(-(2**31) <= a < 2**31)
            else:
                key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
        key = tuple(key)
        compiled = self._compiled.get(key) if self.fast else None
        if compiled is None:
            compiled = kernel[(grid,)](*args, num_warps=num_warps)
            if hasattr(compiled, "packed_metadata"):  # not under the interpreter
                self._compiled[key] = compiled
            return
        try:
            compiled.run(
                grid, 1, 1, torch._C._cuda_getCurrentRawStream(self.device_index), compiled.function,
                compiled.packed_metadata, None, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                *args,
            )  # fmt: skip
        except Exception as exc:  # a Triton whose launcher differs: fall back to the JIT path for good
            warnings.warn(
                f"nanoparallel.cuda: direct launch failed ({exc!r}); using kernel[grid](...)", stacklevel=2
            )
            self.fast = False
            kernel[(grid,)](*args, num_warps=num_warps)


class CudaPeerBackend:
    """Collectives among ``world_size`` processes, one GPU each, on one host.

    Args:
        rank, world_size: this process's rank and the number of ranks.
        store: a ``torch.distributed.Store`` shared by all ranks (bootstrap only).
        device: this rank's GPU (``torch.device('cuda', i)`` or an index); distinct per rank.
        timeout_s: how long a barrier waits for a peer before giving up (approximate: counted in
            polls, about 5 million a second on an H200).
        staging_bytes: upper bound of one staging buffer; larger all-reduce, all-gather,
            reduce-scatter and broadcast calls are cut into pieces of this size.
        check_errors: synchronise after every call and raise at once on a timeout or split mismatch.
        fast_launch: call compiled kernels' launchers directly after the first call (see _Launcher).

    Knobs a measurement may change between calls (the same value on every rank):
        policy: what "auto" picks, and the steps and programs of the pipelined algorithms
            (:class:`~nanoparallel.cuda.policy.Policy`; default: the committed tables of the nearest
            measured world size, nanoparallel/cuda/auto_tables.py).
        programs: programs per kernel launch (None, the default: the policy's, else
            ``max_programs``, 2 per SM).
        pipeline_steps: steps (barriers, or signals) per call of every pipelined algorithm (None,
            the default: by size from the policy, PIPELINE_STEPS where it has no table).
        copy_engine_pieces: pieces per segment of the all-to-all copy engine.
        cache_splits: look validated all-to-all splits up in a cache (False: the per-call
            validation and pinned-table copy of before, kept to measure the difference).
    """

    ALGORITHMS = ALGORITHMS

    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        device: torch.device | int | str,
        timeout_s: float = 60.0,
        *,
        staging_bytes: int = 1 << 30,
        check_errors: bool = False,
        fast_launch: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaPeerBackend: CUDA is not available")
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"CudaPeerBackend: world_size must be a positive int, got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"CudaPeerBackend: rank must be in [0, {world_size}), got {rank!r}")
        if world_size > 8:
            raise ValueError(f"CudaPeerBackend: world_size is at most 8 (one host), got {world_size}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaPeerBackend: device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self.check_errors = check_errors
        self.staging_cap = int(staging_bytes)
        self.closed: str | None = None
        # polls per second of a barrier's acquire load, measured on H200 (a 2e6-poll limit expired
        # after 0.41 s); capped to stay an int32, about 7 minutes
        self.max_spins = int(min(max(self.timeout_s, 0.001) * SPINS_PER_S, 2**31 - 1))
        props = torch.cuda.get_device_properties(self.device)
        self.sm_count = props.multi_processor_count
        self.max_programs = PROGRAMS_PER_SM * self.sm_count
        self.programs: int | None = None
        self.pipeline_steps: int | None = None
        self.policy: Policy = policy_for(world_size)
        self.copy_engine_pieces = COPY_ENGINE_PIECES
        self.cache_splits = True
        self._split_cache = SplitCache(world_size, self.device)
        self._meta_tables: list[torch.Tensor | None] = [None, None]  # what each meta buffer holds
        self._side: torch.cuda.Stream | None = None
        self.epoch = 0
        self.parity = 0
        self._launch = _Launcher(self.device.index, fast_launch)
        self._bootstrap(store)
        from torch.distributed import _symmetric_memory as symm_mem

        try:  # keep NVSHMEM (and its own NVLS use) out of it: plain CUDA driver mappings only
            symm_mem.set_backend("CUDA")
        except Exception:
            pass
        self._flags = _Symmetric(4 * self.max_programs * world_size, self.device, self.group)
        self._flags.local.zero_()
        self._meta = [_Symmetric(8 * 2 * world_size, self.device, self.group) for _ in range(2)]
        # per-call headers of the issue-#35 kernels (element count, tag; primitives._check_headers), one
        # per staging buffer: alternating with it, a header is rewritten only when the buffer is
        self._headers = [_Symmetric(64, self.device, self.group) for _ in range(2)]
        self._err = torch.zeros(1, dtype=torch.int32, device=self.device)
        # what every kernel takes for its barriers: my flags, offsets to the peers' flags, error word
        self._sync = (self._flags.view(torch.int32), self._flags.deltas(torch.int32), self._err)
        self._staging: list[_Symmetric] = []
        self._retired: list[_Symmetric] = []  # kept alive until close: peers may still read them
        self._grow(MIN_STAGING_BYTES)
        torch.cuda.synchronize(self.device)
        # flags must be zero everywhere before the first signal
        dist.barrier(group=self.group)

    # -- set-up ------------------------------------------------------------------------------------
    def _bootstrap(self, store) -> None:
        """A gloo group over ``store``: symmetric memory exchanges its handles through it."""
        if self.world_size == 1:
            store = dist.HashStore() if store is None else store
        prefix = dist.PrefixStore("nanoparallel-cuda", store)
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise ValueError(
                    f"CudaPeerBackend: torch.distributed is initialised with rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but this backend was given rank {self.rank} of {self.world_size}"
                )
            self.group = dist.new_group(backend="gloo")
            self._owns_default = False
        else:
            dist.init_process_group(
                "gloo",
                store=prefix,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=600),
            )
            self.group = dist.group.WORLD
            self._owns_default = True
        try:  # torch < 2.12 wants the group registered for symmetric memory
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable_symm_mem_for_group(self.group.group_name)
        except ImportError:
            pass

    def _grow(self, nbytes: int) -> None:
        """Make both staging buffers at least ``nbytes`` (collective: every rank asks alike)."""
        if self._staging and self._staging[0].nbytes >= nbytes:
            return
        size = max(MIN_STAGING_BYTES, _pow2(nbytes))
        self._retired += self._staging
        self._staging = [_Symmetric(size, self.device, self.group) for _ in range(2)]

    def _next(self, nbytes: int, barriers: int) -> tuple[_Symmetric, int]:
        """The staging buffer for this call and the epoch its barriers start from."""
        self._grow(nbytes)
        buf = self._staging[self.parity]
        self.parity ^= 1
        epoch = self.epoch
        self.epoch += barriers
        return buf, epoch

    # -- checks ------------------------------------------------------------------------------------
    def _check_sharded(self, what: str, output: torch.Tensor, input: torch.Tensor, whole: str) -> None:
        """Both tensors valid, one dtype, and the one named ``whole`` world_size times the other."""
        self._check_tensor(what, "output", output)
        self._check_tensor(what, "input", input)
        if input.dtype != output.dtype:
            raise TypeError(f"{what}: input is {input.dtype} but output is {output.dtype}")
        big, small = (input, output) if whole == "input" else (output, input)
        part, m, W = ("output" if whole == "input" else "input"), small.numel(), self.world_size
        if big.numel() != W * m:
            raise ValueError(
                f"{what}: {whole} has {big.numel()} elements, expected world_size * {part}.numel() = "
                f"{W} * {m} = {W * m}"
            )

    def _check_tensor(self, what: str, name: str, t: torch.Tensor) -> None:
        if self.closed:
            raise CommAbortedError(f"nanoparallel rank {self.rank}: {what}: backend is {self.closed}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise ValueError(f"{what}: {name} is on {t.device}, expected {self.device}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{what}: {name} has dtype {t.dtype}, expected one of {[str(d) for d in DTYPES]}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
        if t.numel() >= 2**31:
            raise ValueError(f"{what}: {name} has {t.numel()} elements, at most 2**31 - 1 supported")

    def _algorithm(self, collective: str, algorithm: str, nbytes: int) -> str:
        names = ALGORITHMS[collective]
        if algorithm == "auto":
            return self.policy.algorithm(collective, nbytes) or names[0]
        if algorithm not in names:
            raise ValueError(f"{collective}: algorithm {algorithm!r} is not one of {names + ('auto',)}")
        return algorithm

    def _pipeline_steps(self, collective: str, nbytes: int, algorithm: str) -> int:
        """Steps per call of a pipelined algorithm: the ``pipeline_steps`` knob when set, else the
        policy's table (by size, except for the all-to-all: its ranks' sizes may differ, and every
        rank must take the same count), else PIPELINE_STEPS."""
        if self.pipeline_steps:
            return self.pipeline_steps
        steps = self.policy.knob("steps", collective, algorithm, nbytes)
        return int(steps) if steps else PIPELINE_STEPS

    def _programs(self, collective: str, algorithm: str, nbytes: int) -> int:
        """Grid of a launch: the ``programs`` knob when set, else the policy's programs per SM,
        else ``max_programs``; never more than ``max_programs`` (all programs must be resident)."""
        if self.programs:
            return min(self.programs, self.max_programs)
        per_sm = self.policy.knob("programs", collective, algorithm, nbytes)
        if per_sm:
            return max(1, min(self.max_programs, round(float(per_sm) * self.sm_count)))
        return self.max_programs

    def _header(self) -> _Symmetric:
        """The header buffer of the staging buffer that the last ``_next`` handed out."""
        return self._headers[self.parity ^ 1]

    def _op(self, what: str, op: str, dtype: torch.dtype) -> int:
        if op not in OP_CODES:
            raise ValueError(f"{what}: op {op!r} is not one of {REDUCE_OPS}")
        return OP_CODES[op]

    def _chunk(self, n: int, elem: int) -> tuple[int, int]:
        return split_work(n, min(self.programs or self.max_programs, self.max_programs), STEP_BYTES // elem)

    def _after(self, what: str) -> None:
        if self.check_errors:
            self.check(what)

    def check(self, what: str = "check") -> None:
        """Synchronise and raise if any kernel since the last check timed out or saw bad splits."""
        torch.cuda.synchronize(self.device)
        code = int(self._err.item())
        if code:
            self._err.zero_()
            if code & ERR_SPLITS:
                if code & ERR_TIMEOUT:  # barriers that did not match up: the flags are out of step
                    self.closed = "aborted after a mismatch"
                raise MismatchError(
                    f"nanoparallel rank {self.rank}: {what}: ranks disagree about a call: all_to_all splits "
                    "(some rank's input_splits[r] differs from rank r's output_splits for it), or the element "
                    "count, dtype, root or op of a collective"
                )
            if code & ERR_TIMEOUT:
                self.closed = "aborted after a timeout"
                raise CommTimeoutError(
                    f"nanoparallel rank {self.rank}: {what}: a peer did not reach a GPU barrier within "
                    f"~{self.timeout_s:g} s (a peer died, hung, or ranks called different collectives)"
                )

    # -- collectives: one file each, bound here as methods (the host path has no extra call) ---------
    all_reduce = _all_reduce
    reduce_scatter = _reduce_scatter
    all_gather = _all_gather
    broadcast = _broadcast
    all_to_all = _all_to_all

    def _barrier_kernel(self, epoch: int) -> None:
        self._launch(
            barrier_kernel, 1, (*self._sync, epoch, self.max_spins, self.rank, self.world_size), num_warps=1
        )

    def barrier(self) -> None:
        """All ranks meet on the GPU; then this rank's host waits for its GPU and checks for errors."""
        if self.closed:
            raise CommAbortedError(f"nanoparallel rank {self.rank}: barrier: backend is {self.closed}")
        if self.world_size > 1:
            _, epoch = self._next(0, 1)
            self._barrier_kernel(epoch)
        self.check("barrier")

    def close(self) -> None:
        """Wait for outstanding work, check it, and release the buffers once every rank is done."""
        if self.closed == "closed":
            return
        try:
            if not self.closed:
                self.check("close")
        finally:
            self.closed = "closed"
            torch.cuda.synchronize(self.device)
            try:
                dist.barrier(group=self.group)
            except Exception:
                pass
            self._staging, self._retired, self._meta = [], [], []
            if self._owns_default and dist.is_initialized():
                dist.destroy_process_group()
