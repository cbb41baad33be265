"""GPU collectives on one host through peer memory, with our own Triton kernels and flag barriers.

:class:`CudaPeerBackend` is what ``Communicator(transport="cuda")`` hands CUDA tensors to. Each rank
allocates its staging buffers and flags in torch's symmetric memory
(``torch.distributed._symmetric_memory``): that maps every rank's buffer into every rank's
address space over NVLink, and that is all we take from it. Moving and reducing data, and the
barriers between ranks, are the kernels in :mod:`nanoparallel.cuda.kernels`: loads from peers'
buffers, a reduction in registers, stores, and epoch flags written with release atomics and
polled with acquire loads at system scope. NVLink multicast (NVLS) is never used: the environment
switches below are forced on before anything initialises, and no kernel issues multimem
instructions.

The data path of every call:

* copy the caller's tensor into this rank's staging buffer (inside the kernel, no extra launch);
* barrier with the same-numbered program on every peer;
* read what is needed straight from the peers' staging buffers (one-shot, two-shot, ring, direct),
  or store it into theirs (the pipelined kernels; the ring broadcast of ``broadcast.py``, the
  all-gathers of ``all_gather.py`` and the all-reduce of ``all_reduce.py``, one file each), or let
  the copy engine pull it (``copy_engine``: ``Tensor.copy_`` from a peer's buffer).

What ``algorithm="auto"`` picks is :mod:`nanoparallel.cuda.policy` (tables per world size in
``auto_tables.py``, made from GPU runs by :mod:`nanoparallel.cuda.tuning`).

Two staging buffers alternate between calls, which is why no call needs a closing barrier (see
``kernels.py``). All work goes on the current CUDA stream; callers must use one stream for all
collectives of a backend.

Faults: every barrier spins a bounded number of times (``timeout_s``); when a peer never arrives
the kernel records it in an error word. :meth:`barrier` and :meth:`close` synchronise and raise
:class:`~nanoparallel.errors.CommTimeoutError` if any call since the last check timed out;
``check_errors=True`` checks after every call (one host synchronisation each).
"""

from __future__ import annotations

import os

# Never NVLink multicast (NVLS): forced, not defaulted, and before torch touches NCCL or symmetric memory.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from triton import knobs  # noqa: E402

from nanoparallel.cuda import kernels as K  # noqa: E402
from nanoparallel.cuda.all_gather import all_gather_new  # noqa: E402
from nanoparallel.cuda.all_reduce import all_reduce_two_shot_pipelined  # noqa: E402
from nanoparallel.cuda.broadcast import broadcast_ring  # noqa: E402
from nanoparallel.cuda.policy import Policy, pick, policy_for  # noqa: E402, F401
from nanoparallel.errors import CommAbortedError, CommTimeoutError, MismatchError  # noqa: E402

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
# two_shot_pipelined's check did not finish there (site/pages/nanoparallel/index.md says why).
NEW_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("two_shot_pipelined",),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
REDUCE_OPS = tuple(K.OP_CODES)

# 8 KiB per program per step: 8 warps x 32 threads x 32 bytes, two 16-byte vectors per thread
STEP_BYTES = 8192
NUM_WARPS = 8
# programs per SM at most. Program b of a rank waits for program b of each peer and for nothing else,
# so a grid larger than what fits at once still completes when every GPU starts its programs in
# index order, as CUDA's block scheduler does (not a documented promise); started in different
# orders on different ranks, with fewer resident than the grid, it would wait until timeout_s
# (tests/nanoparallel/test_cuda_bandwidth_kernels_interpret.py runs both schedules). Two programs
# of 256 threads fit an SM where a kernel needs at most 128 registers per thread: most kernels, but
# not two_shot_pipelined in 16-bit types at 4 ranks (182-244) nor the pipelined all-to-all in 16-bit
# types (186 at 2 ranks, 252-255 and spilling at 4): `python -m nanoparallel.cuda.registers`, offline
# sm_90a, 2026-11-28. Their 264-program grids run in two waves; the all-to-all pairwise passed its
# GPU check that way (bf16 cases included) on 4 and 2 H100s.
PROGRAMS_PER_SM = 2
MIN_STAGING_BYTES = 16 << 20
SPINS_PER_S = 5e6
# "auto": tables per world size in nanoparallel/cuda/auto_tables.py (generated from the GPU runs by
# nanoparallel.cuda.tuning, which says how; read by CudaPeerBackend.policy). What the measurements
# behind them found, and why, is on site/pages/nanoparallel/one-shot-two-shot.md and index.md.
# Steps of a pipelined algorithm without a table there:
PIPELINE_STEPS = 4
# the all-to-all copy engine cuts every segment into this many pieces, one barrier each, so the
# drain of piece c (a local copy, on a second stream) overlaps the NVLink copies of piece c + 1.
# Measured: 4 pieces best at 1 GiB (1535 us against 1665 at 1 and 1679 at 8), within 2% of 1 piece
# at 256 MiB; each piece costs about 55 us of host time (120 us per call at 1 piece, 290 at 4).
COPY_ENGINE_PIECES = 4
# validated split tables kept per backend (a MoE layer cycles through a few; more is a misuse)
SPLIT_CACHE_ENTRIES = 64


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def split_work(n: int, max_programs: int, step: int) -> tuple[int, int]:
    """(elements per program, programs) for n elements: a multiple of ``step`` each, few programs
    for small n (each program costs a barrier round trip), at most ``max_programs`` for large n."""
    chunk = _round_up(max(-(-n // max_programs), 1), step)
    return chunk, max(1, -(-n // chunk))


def slice_size(n: int, world_size: int) -> int:
    """Elements each rank owns in two-shot and ring all-reduce: 64-element (256-byte) aligned."""
    return _round_up(-(-n // world_size), 64)


def ring_barriers(world_size: int, gather: bool) -> int:
    """Barriers in one ring call: after the copy-in, between reduce steps, between copy steps."""
    return 2 * world_size - 2 if gather else world_size - 1


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pipeline_steps(chunk: int, steps: int, block: int) -> tuple[int, int]:
    """(elements per step, steps) for a program range of ``chunk`` elements cut into at most
    ``steps`` steps of whole ``block``s; fewer steps when the range is short."""
    sub = _round_up(max(-(-chunk // max(steps, 1)), 1), block)
    return sub, max(1, -(-chunk // sub))


def copy_engine_pieces(splits, me: int, c: int, pieces: int) -> list[tuple[int, int, int]]:
    """Piece c of each segment for the all-to-all copy engine: (peer, start, end) in elements from
    the segment's start, non-empty pieces only. ``splits``: my input_splits (pieces I send) or my
    output_splits (pieces I receive). A sender and its receiver cut the same count the same way;
    pieces start at multiples of 64 elements (256-byte aligned copies for 4-byte types)."""
    out = []
    for p, count in enumerate(splits):
        size = _round_up(max(-(-count // pieces), 1), 64)
        start, end = min(c * size, count), min((c + 1) * size, count)
        if end > start:
            out.append((p, start, end))
    return out


def check_splits(what: str, name: str, splits, total: int, world_size: int) -> list[int]:
    """Split counts (rows) as a list of ints, or ValueError saying what is wrong with them."""
    W = world_size
    if splits is None:
        if total % W:
            raise ValueError(f"{what}: {name} not given and {total} rows do not split evenly over {W} ranks")
        return [total // W] * W
    splits = [int(s) for s in splits]
    if len(splits) != W or any(s < 0 for s in splits):
        raise ValueError(f"{what}: {name} must be {W} non-negative counts, got {splits}")
    if sum(splits) != total:
        raise ValueError(f"{what}: {name} sums to {sum(splits)} but the tensor has {total} rows")
    return splits


class SplitPlan(NamedTuple):
    """One all-to-all's validated splits, in elements, and what the kernels and copies need."""

    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    input_offsets: tuple[int, ...]
    output_offsets: tuple[int, ...]
    largest: int  # the largest split, sent or received: must fit a per-sender slot for push
    table: torch.Tensor | None  # int64 [input_splits, output_splits] on the device; None: uncached


def _key(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return tuple(splits.tolist())
    return tuple(splits)


def _offsets(splits: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += s
    return tuple(out)


class SplitCache:
    """Validated all-to-all split tables and their device copies, keyed by the splits as given.

    Validating the splits and copying the table to the GPU through a fresh pinned host tensor were
    what the all-to-all path did on every call beyond the other collectives' (34-51 us per small
    call against their 14-16 us on 2 x H200). A model calls all-to-all with few distinct splits, so
    both are done once per distinct (rows, splits) and looked up afterwards (a tuple hash).
    """

    def __init__(self, world_size: int, device: torch.device, max_entries: int = SPLIT_CACHE_ENTRIES) -> None:
        self.world_size = world_size
        self.device = device
        self.max_entries = max_entries
        self._plans: dict = {}
        self.misses = 0

    def plan(self, rows_in: int, rows_out: int, row: int, input_splits, output_splits, cache: bool = True):
        """The SplitPlan of a call; ``cache=False`` validates afresh and leaves ``table`` None."""
        key = (rows_in, rows_out, row, _key(input_splits), _key(output_splits)) if cache else None
        got = self._plans.get(key) if cache else None
        if got is not None:
            return got
        self.misses += 1
        W = self.world_size
        ins = tuple(s * row for s in check_splits("all_to_all", "input_splits", input_splits, rows_in, W))
        outs = tuple(s * row for s in check_splits("all_to_all", "output_splits", output_splits, rows_out, W))
        table = torch.tensor(ins + outs, dtype=torch.int64, device=self.device) if cache else None
        got = SplitPlan(ins, outs, _offsets(ins), _offsets(outs), max(ins + outs), table)
        if cache:
            if len(self._plans) >= self.max_entries:
                self._plans.clear()  # splits that change every call: keep memory bounded
            self._plans[key] = got
        return got


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
            (:class:`~nanoparallel.cuda.tuning.Policy`; default: the committed tables of the nearest
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
        # per-call headers of the issue-#35 kernels (element count, tag; kernels._check_headers), one
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
        if op not in K.OP_CODES:
            raise ValueError(f"{what}: op {op!r} is not one of {REDUCE_OPS}")
        return K.OP_CODES[op]

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
            if code & K.ERR_SPLITS:
                if code & K.ERR_TIMEOUT:  # barriers that did not match up: the flags are out of step
                    self.closed = "aborted after a mismatch"
                raise MismatchError(
                    f"nanoparallel rank {self.rank}: {what}: ranks disagree about a call: all_to_all splits "
                    "(some rank's input_splits[r] differs from rank r's output_splits for it), or the element "
                    "count, dtype, root or op of a collective"
                )
            if code & K.ERR_TIMEOUT:
                self.closed = "aborted after a timeout"
                raise CommTimeoutError(
                    f"nanoparallel rank {self.rank}: {what}: a peer did not reach a GPU barrier within "
                    f"~{self.timeout_s:g} s (a peer died, hung, or ranks called different collectives)"
                )

    # -- collectives ---------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto") -> torch.Tensor:
        """In place: tensor <- op over ranks of tensor. tensor: [...], same shape on every rank."""
        what = "all_reduce"
        self._check_tensor(what, "tensor", tensor)
        code = self._op(what, op, tensor.dtype)
        elem = tensor.element_size()
        algorithm = self._algorithm(what, algorithm, tensor.numel() * elem)
        n = tensor.numel()
        if n == 0 or self.world_size == 1:
            return tensor  # with one rank every op (avg too) leaves the tensor as it is
        # two_shot_pipelined stages every element twice (reduce-scatter slots and gather slots)
        cap = self.staging_cap // (2 if algorithm == "two_shot_pipelined" else 1)
        piece = max(cap // elem // 1024 * 1024, 1024)
        if n <= piece:  # the common case: no reshaping, the kernel indexes the contiguous storage
            self._all_reduce_piece(tensor, code, algorithm)
        else:
            flat = tensor.view(-1)
            for start in range(0, n, piece):
                self._all_reduce_piece(flat[start : start + piece], code, algorithm)
        self._after(what)
        return tensor

    def _all_reduce_piece(self, x: torch.Tensor, code: int, algorithm: str) -> None:
        n, elem, W = x.numel(), x.element_size(), self.world_size
        if algorithm == "one_shot":
            buf, epoch = self._next(n * elem, 1)
            chunk, grid = self._chunk(n, elem)
            self._launch(K.one_shot_all_reduce_kernel, grid, (
                x, x, buf.view(x.dtype), buf.deltas(x.dtype), *self._sync, n, chunk, epoch, self.max_spins,
                code, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
            return
        if algorithm == "one_shot_pipelined":
            steps = self._pipeline_steps("all_reduce", n * elem, algorithm)
            self._launch_pipelined(K.one_shot_pipelined_all_reduce_kernel, x, x, n, code, steps)
            return
        if algorithm == "two_shot_pipelined":
            all_reduce_two_shot_pipelined(self, x, code)
            return
        if algorithm == "one_shot_push":
            S = _round_up(n, 64)  # slot stride, 256-byte aligned
            buf, epoch = self._next(W * S * elem, 1)
            chunk, grid = self._chunk(n, elem)
            self._launch(K.one_shot_push_all_reduce_kernel, grid, (
                x, x, buf.view(x.dtype), buf.deltas(x.dtype), *self._sync, n, S, chunk, epoch, self.max_spins,
                code, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
            return
        S = slice_size(n, W)
        chunk, grid = self._chunk(S, elem)
        kernel = K.two_shot_all_reduce_kernel if algorithm == "two_shot" else K.ring_all_reduce_kernel
        barriers = 2 if algorithm == "two_shot" else ring_barriers(W, True)
        buf, epoch = self._next(W * S * elem, barriers)
        self._launch(kernel, grid, (
            x, x, buf.view(x.dtype), buf.deltas(x.dtype), *self._sync, n, S, chunk, epoch, self.max_spins,
            code, self.rank, W, STEP_BYTES // elem, True,
        ))  # fmt: skip

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", algorithm: str = "auto"
    ) -> torch.Tensor:
        """output <- slice ``rank`` of op over ranks of input. input: [W*m], output: [m]."""
        what = "reduce_scatter"
        self._check_sharded(what, output, input, "input")
        W = self.world_size
        code = self._op(what, op, input.dtype)
        elem = input.element_size()
        algorithm = self._algorithm(what, algorithm, input.numel() * elem)
        m = output.numel()
        if m == 0:
            return output
        if W == 1:
            output.view(-1).copy_(input.view(-1))
            return output
        piece = max(self.staging_cap // elem // W // 1024 * 1024, 1024)
        if algorithm == "pipelined":
            steps = self._pipeline_steps(what, input.numel() * elem, algorithm)
            inp, out = input.view(W, m), output.view(-1)
            for start in range(0, m, piece):
                k = min(piece, m - start)
                src = inp[:, start : start + k]
                src = src if src.is_contiguous() else src.contiguous()  # [W, k]: slice stride k
                # src [W*k] (slice p at p*k), dst [k]
                self._launch_pipelined(
                    K.reduce_scatter_pipelined_kernel, src, out[start : start + k], k, code, steps
                )
            self._after(what)
            return output
        kernel = K.two_shot_all_reduce_kernel if algorithm == "direct" else K.ring_all_reduce_kernel
        barriers = 1 if algorithm == "direct" else ring_barriers(W, False)
        if m <= piece:  # the common case: hand the tensors over as they are (host time matters)
            buf, epoch = self._next(W * m * elem, barriers)
            chunk, grid = self._chunk(m, elem)
            self._launch(kernel, grid, (
                input, output, buf.view(input.dtype), buf.deltas(input.dtype), *self._sync, W * m, m, chunk, epoch,
                self.max_spins, code, self.rank, W, STEP_BYTES // elem, False,
            ))  # fmt: skip
            self._after(what)
            return output
        inp, out = input.view(W, m), output.view(-1)
        for start in range(0, m, piece):
            k = min(piece, m - start)
            # the kernel wants the W slices of this piece side by side: [W, k] contiguous
            src = inp[:, start : start + k]
            src = src if src.is_contiguous() else src.contiguous()
            dst = out[start : start + k]
            buf, epoch = self._next(W * k * elem, barriers)
            chunk, grid = self._chunk(k, elem)
            self._launch(kernel, grid, (
                src, dst, buf.view(input.dtype), buf.deltas(input.dtype), *self._sync, W * k, k, chunk, epoch,
                self.max_spins, code, self.rank, W, STEP_BYTES // elem, False,
            ))  # fmt: skip
        self._after(what)
        return output

    def _launch_pipelined(
        self, kernel, src: torch.Tensor, dst: torch.Tensor, n: int, code: int, steps: int
    ) -> None:
        """One launch of a pipelined kernel (the one-shot all-reduce, the reduce-scatter), which
        take the same arguments: n elements per rank's slot, W slots of S >= n elements staged,
        each program's chunk in ``steps`` barriers (fewer when the chunk is short)."""
        W, elem = self.world_size, src.element_size()
        S = _round_up(n, 64)  # slot stride, 256-byte aligned
        chunk, grid = self._chunk(n, elem)
        sub, steps = pipeline_steps(chunk, steps, STEP_BYTES // elem)
        buf, epoch = self._next(W * S * elem, steps)
        self._launch(kernel, grid, (
            src, dst, buf.view(src.dtype), buf.deltas(src.dtype), *self._sync, n, S, chunk, sub, steps, epoch,
            self.max_spins, code, self.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto") -> torch.Tensor:
        """output[p*m:(p+1)*m] <- input of rank p. input: [m], output: [W*m]."""
        what = "all_gather"
        self._check_sharded(what, output, input, "output")
        W = self.world_size
        elem = input.element_size()
        algorithm = self._algorithm(what, algorithm, output.numel() * elem)
        m = input.numel()
        if m == 0:
            return output
        if algorithm in ("pairwise", "push_pipelined"):
            all_gather_new(self, output, input, algorithm)
            self._after(what)
            return output
        piece = max(self.staging_cap // elem // 1024 * 1024, 1024)
        if m <= piece and algorithm == "direct":  # the common case, without reshaping
            buf, epoch = self._next(m * elem, 1)
            chunk, grid = self._chunk(m, elem)
            self._launch(K.all_gather_kernel, grid, (
                input, output, buf.view(input.dtype), buf.deltas(input.dtype), *self._sync, m, chunk, epoch,
                self.max_spins, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
            self._after(what)
            return output
        inp, out = input.view(-1), output.view(W, m)
        for start in range(0, m, piece):
            k = min(piece, m - start)
            src = inp[start : start + k]
            buf, epoch = self._next(k * elem, 1)
            if algorithm == "copy_engine":
                buf.view(input.dtype)[:k].copy_(src)
                self._barrier_kernel(epoch)
                # peers in rotated order (rank + i in round i): in rank order every rank would
                # first copy from rank 0, whose NVLink egress then serves W - 1 readers at once
                for i in range(W):
                    p = (self.rank + i) % W
                    view = src if p == self.rank else buf.peer(p).view(input.dtype)[:k]
                    out[p, start : start + k].copy_(view)
                continue
            dst = out[:, start : start + k]
            if not dst.is_contiguous():
                # a piece of a [W, m] output is W strided rows; gather into a contiguous [W, k] first
                tmp = torch.empty(W, k, dtype=input.dtype, device=self.device)
            else:
                tmp = dst
            chunk, grid = self._chunk(k, elem)
            self._launch(K.all_gather_kernel, grid, (
                src, tmp, buf.view(input.dtype), buf.deltas(input.dtype), *self._sync, k, chunk, epoch,
                self.max_spins, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
            if tmp is not dst:
                dst.copy_(tmp)
        self._after(what)
        return output

    def broadcast(self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto") -> torch.Tensor:
        """In place: tensor <- tensor of rank ``root``. tensor: [...], same shape on every rank."""
        what = "broadcast"
        self._check_tensor(what, "tensor", tensor)
        W = self.world_size
        if not (isinstance(root, int) and 0 <= root < W):
            raise ValueError(f"{what}: root must be in [0, {W}), got {root!r}")
        elem = tensor.element_size()
        algorithm = self._algorithm(what, algorithm, tensor.numel() * elem)
        n = tensor.numel()
        if n == 0 or W == 1:
            return tensor
        if algorithm == "ring":
            broadcast_ring(self, tensor, root)
            self._after(what)
            return tensor
        piece = max(self.staging_cap // elem // 1024 * 1024, 1024)
        if n <= piece and algorithm == "direct":  # the common case, without reshaping
            buf, epoch = self._next(n * elem, 1)
            chunk, grid = self._chunk(n, elem)
            self._launch(K.broadcast_kernel, grid, (
                tensor, buf.view(tensor.dtype), buf.deltas(tensor.dtype), *self._sync, n, chunk, root, epoch,
                self.max_spins, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
            self._after(what)
            return tensor
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), piece):
            seg = flat[start : start + piece]
            n = seg.numel()
            buf, epoch = self._next(n * elem, 1)
            if algorithm == "copy_engine":
                if self.rank == root:
                    buf.view(tensor.dtype)[:n].copy_(seg)
                self._barrier_kernel(epoch)
                if self.rank != root:
                    seg.copy_(buf.peer(root).view(tensor.dtype)[:n])
                continue
            chunk, grid = self._chunk(n, elem)
            self._launch(K.broadcast_kernel, grid, (
                seg, buf.view(tensor.dtype), buf.deltas(tensor.dtype), *self._sync, n, chunk, root, epoch,
                self.max_spins, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
        self._after(what)
        return tensor

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        algorithm: str = "auto",
    ) -> torch.Tensor:
        """Rank r sends rows input[sum(input_splits[:p]) : ...+input_splits[p]] to rank p.

        input: [sum(input_splits), ...], output: [sum(output_splits), ...]: splits count rows (the
        first dimension, as ``torch.distributed.all_to_all_single``), even when None; the trailing
        dimensions must agree. output_splits[p] must equal rank p's input_splits[r]; a mismatch is
        reported by the next check (or at once with ``check_errors``).
        """
        what = "all_to_all"
        self._check_tensor(what, "output", output)
        self._check_tensor(what, "input", input)
        W = self.world_size
        if input.dtype != output.dtype:
            raise TypeError(f"{what}: input is {input.dtype} but output is {output.dtype}")
        if input.dim() != output.dim() or tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise ValueError(
                f"{what}: input {tuple(input.shape)} and output {tuple(output.shape)} must agree beyond dimension 0"
            )
        row = 1
        for d in input.shape[1:]:
            row *= d
        rows_in = input.shape[0] if input.dim() else 1
        rows_out = output.shape[0] if output.dim() else 1
        plan = self._split_cache.plan(rows_in, rows_out, row, input_splits, output_splits, self.cache_splits)
        requested = algorithm
        elem = input.element_size()
        algorithm = self._algorithm(what, algorithm, input.numel() * elem)
        if W == 1:
            output.view(-1).copy_(input.view(-1))
            return output
        if input.numel() * elem > self.staging_cap:
            raise ValueError(
                f"{what}: input is {input.numel() * elem} bytes, more than staging_bytes={self.staging_cap}; "
                "raise staging_bytes when creating the backend"
            )
        slot = self.staging_cap // elem // W // 64 * 64  # push: one slot per sender in every buffer
        if algorithm != "direct" and plan.largest > slot:
            if requested != "auto":
                raise ValueError(
                    f"{what}: algorithm {algorithm!r} gives each sender {slot} elements in a peer's buffer, "
                    f"but a split has {plan.largest}; use 'direct' or raise staging_bytes"
                )
            algorithm = "direct"  # a split too large for the per-sender slot
        steps = self._pipeline_steps(what, input.numel() * elem, algorithm)
        if algorithm in ("push_pipelined", "pairwise"):
            barriers = steps
        elif algorithm == "copy_engine":
            barriers = self.copy_engine_pieces
        else:
            barriers = 1
        # ranks send different amounts, but growing is collective: every rank takes the whole cap
        # on its first all_to_all, so all of them grow at the same call
        buf, epoch = self._next(self.staging_cap, barriers)
        meta_index = self.parity ^ 1  # the parity _next just used
        meta = self._meta[meta_index]
        if plan.table is None:  # uncached: a pinned host tensor per call, queued without a sync
            table = torch.tensor(plan.input_splits + plan.output_splits, dtype=torch.int64).pin_memory()
            meta.view(torch.int64).copy_(table, non_blocking=True)
            self._meta_tables[meta_index] = None
        elif self._meta_tables[meta_index] is not plan.table:
            # peers read this table after the barrier; it is rewritten only when the splits change
            meta.view(torch.int64).copy_(plan.table)
            self._meta_tables[meta_index] = plan.table
        if algorithm == "copy_engine":
            self._all_to_all_copy_engine(input, output, plan, buf, meta, epoch, slot)
            self._after(what)
            return output
        args = (input, output, buf.view(input.dtype), buf.deltas(input.dtype), meta.view(torch.int64),
                meta.deltas(torch.int64), *self._sync)  # fmt: skip
        grid = self._programs(what, algorithm, 0)  # the same on every rank: not from the sizes
        if algorithm in ("push_pipelined", "pairwise"):
            self._launch(K.all_to_all_pipelined_kernel, grid, (
                *args, slot, steps, epoch, self.max_spins, self.rank, W, STEP_BYTES // elem, algorithm == "pairwise",
            ))  # fmt: skip
        elif algorithm == "push":
            self._launch(K.all_to_all_push_kernel, grid, (
                *args, slot, epoch, self.max_spins, self.rank, W, STEP_BYTES // elem,
            ))  # fmt: skip
        else:
            self._launch(K.all_to_all_kernel, grid, (
                *args, epoch, self.max_spins, self.rank, W, _pow2(W), STEP_BYTES // elem,
            ))  # fmt: skip
        self._after(what)
        return output

    def _all_to_all_copy_engine(
        self, input: torch.Tensor, output: torch.Tensor, plan: SplitPlan, buf: _Symmetric, meta: _Symmetric,
        epoch: int, slot: int,
    ) -> None:  # fmt: skip
        """Segments for peers go by ``Tensor.copy_`` (the copy engine) into slot ``rank`` of each
        peer's buffer, piece by piece, with a barrier after each piece; the own segment and the
        drain of each received piece (slot to output, local memory) run on a second stream, so they
        overlap the NVLink copies of the next piece. The first barrier also compares split tables."""
        W, me, dtype = self.world_size, self.rank, input.dtype
        inp, out, local = input.view(-1), output.view(-1), buf.view(dtype)
        main = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(main)  # the input, the output and the split table are ready on main
        n_self = min(plan.input_splits[me], plan.output_splits[me])
        with torch.cuda.stream(side):
            i0, o0 = plan.input_offsets[me], plan.output_offsets[me]
            out[o0 : o0 + n_self].copy_(inp[i0 : i0 + n_self])
        peers = [buf.peer(p).view(dtype) if p != me else local for p in range(W)]
        pieces = self.copy_engine_pieces
        for c in range(pieces):
            # receivers in rotated order (rank + i first), as the pairwise kernel: in rank order
            # every rank would write to rank 0 first, whose NVLink ingress then takes W - 1 senders
            sends = copy_engine_pieces(plan.input_splits, me, c, pieces)
            for d, a, b in sorted(sends, key=lambda s: (s[0] - me) % W):
                if d != me:
                    off = plan.input_offsets[d]
                    peers[d][me * slot + a : me * slot + b].copy_(inp[off + a : off + b])
            if c == 0:
                self._launch(K.all_to_all_check_barrier_kernel, 1, (
                    meta.view(torch.int64), meta.deltas(torch.int64), *self._sync, epoch, self.max_spins, me, W,
                ), num_warps=1)  # fmt: skip
            else:
                self._barrier_kernel(epoch + c)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for p, a, b in copy_engine_pieces(plan.output_splits, me, c, pieces):
                    if p != me:
                        off = plan.output_offsets[p]
                        out[off + a : off + b].copy_(local[p * slot + a : p * slot + b])
        # the caller's stream goes on only after the drains: a peer overwrites these slots two calls
        # later, after a barrier this rank reaches only from the caller's stream
        main.wait_stream(side)

    def _barrier_kernel(self, epoch: int) -> None:
        self._launch(
            K.barrier_kernel, 1, (*self._sync, epoch, self.max_spins, self.rank, self.world_size), num_warps=1
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
