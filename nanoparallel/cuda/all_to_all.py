"""Uneven all-to-all among the GPUs of one host: the kernels, the split tables, the launcher.

The algorithms (``CudaPeerBackend.all_to_all(algorithm=...)``):

* ``direct``: every rank copies its input in and publishes its split table; after one barrier each
  rank reads its segment from every peer's buffer (``all_to_all_kernel``);
* ``push``: my segment for rank d goes into slot ``rank`` of d's buffer, one barrier, then each rank
  drains its slots from local memory (``all_to_all_push_kernel``);
* ``push_pipelined`` and ``pairwise``: ``push`` in steps, one barrier each, receivers in rank order
  or rotated (``all_to_all_pipelined_kernel``, ``ROTATE``);
* ``copy_engine``: ``Tensor.copy_`` into the peers' slots, piece by piece, drained on a second stream.

Splits count rows; a rank's output_splits[p] must equal rank p's input_splits[rank]: every kernel
compares the split tables and sets bit 2 of the error word on a mismatch (``MismatchError``).
:class:`SplitCache` validates a call's splits once per distinct splits and keeps their device copy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoparallel.cuda.partition import STEP_BYTES, _pow2, _round_up
from nanoparallel.cuda.primitives import _barrier, _copy

# the all-to-all copy engine cuts every segment into this many pieces, one barrier each, so the
# drain of piece c (a local copy, on a second stream) overlaps the NVLink copies of piece c + 1.
# Measured: 4 pieces best at 1 GiB (1535 us against 1665 at 1 and 1679 at 8), within 2% of 1 piece
# at 256 MiB; each piece costs about 55 us of host time (120 us per call at 1 piece, 290 at 4).
COPY_ENGINE_PIECES = 4
# validated split tables kept per backend (a MoE layer cycles through a few; more is a misuse)
SPLIT_CACHE_ENTRIES = 64


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


def all_to_all_algorithm(be, plan: SplitPlan, algorithm: str, nbytes: int, slot: int, even: bool) -> str:
    """The algorithm one all-to-all launches; a named one that cannot take a split of ``slot``
    elements raises.

    The ranks must launch the same algorithm or they exchange garbage, and a rank knows only its
    own splits: with uneven splits the ranks' sizes differ (on 2 x H200, 2026-11-28, rank 0
    sending 516 bytes took ``direct``, rank 1 sending 27 KB took ``push``, and rank 0 received the
    wrong data), and not even a rank whose own splits are all equal can tell that the others' are.
    So ``auto`` picks by size only for ``even`` calls (``input_splits`` and ``output_splits`` None,
    which every rank of the call must pass alike: then every rank has the same size and largest
    split); with splits given it takes ``direct``, which takes any split. A caller who wants
    another algorithm for uneven splits names it, the same on every rank."""
    requested = algorithm
    if algorithm == "auto" and not even:
        algorithm = "direct"
    algorithm = be._algorithm("all_to_all", algorithm, nbytes)
    if algorithm != "direct" and plan.largest > slot:
        if requested != "auto":
            raise ValueError(
                f"all_to_all: algorithm {algorithm!r} gives each sender {slot} elements in a peer's buffer, "
                f"but a split has {plan.largest}; use 'direct' or raise staging_bytes"
            )
        algorithm = "direct"  # a split too large for the per-sender slot (the same on every rank)
    return algorithm


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


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def all_to_all_kernel(
    inp, out, buf, D, meta, M, flags, F, err, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, WP2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Uneven all-to-all. meta (int64, symmetric): [input_splits (W), output_splits (W)].

    Each rank publishes its split table next to its data; after one barrier, rank r finds its
    segment in peer p's buffer at offset sum(p.input_splits[:r]) and length p.input_splits[r],
    which must equal r.output_splits[p] (else bit 2 of err is set and the shorter length is used).
    Program b copies in, and later reads, the same share of every segment (``_share``), so what a
    program reads was written by the same-numbered program of the sender, the one it met.
    """
    nprog = tl.num_programs(0)
    in_off = 0
    for d in tl.static_range(W):
        count = tl.load(meta + d)
        if (in_off % 16 == 0) & (count % 16 == 0):
            # splits in multiples of 16 elements (the common case): rebuild the values as x//16*16,
            # equal here, which the compiler can see are aligned, so it moves 16 bytes per access
            a_off = _a16(in_off)
            a_count = _a16(count)
            lo, hi = _share(a_count, a_count, nprog)
            _copy(buf + a_off, inp + a_off, _a16(lo), _a16(hi), BLOCK)
        else:
            lo, hi = _share(count, count, nprog)
            _copy(buf + in_off, inp + in_off, lo, hi, BLOCK)
        in_off += count
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    idx = tl.arange(0, WP2)
    out_off = 0
    for p in tl.static_range(W):
        peer_meta = meta + M[p]
        peer_splits = tl.load(peer_meta + idx, mask=idx < W, other=0)
        src_off = tl.sum(tl.where(idx < RANK, peer_splits, 0), axis=0)
        count = tl.load(peer_meta + RANK)
        expect = tl.load(meta + W + p)
        if count != expect:
            tl.atomic_or(err, 2)
        lo, hi = _share(count, tl.minimum(count, expect), nprog)
        if (src_off % 16 == 0) & (out_off % 16 == 0) & (count % 16 == 0) & (expect % 16 == 0):
            _copy(out + _a16(out_off), buf + D[p] + _a16(src_off), _a16(lo), _a16(hi), BLOCK)
        else:
            _copy(out + out_off, buf + D[p] + src_off, lo, hi, BLOCK)
        out_off += expect


@triton.jit
def _push_segment(dst, inp, in_off, count, lo, hi, BLOCK: tl.constexpr):
    """Elements lo .. hi of the segment that starts at ``in_off`` of ``inp`` to the same places of
    ``dst`` (the segment's start), 16-byte accesses when offset and length allow (see _a16)."""
    if (in_off % 16 == 0) & (count % 16 == 0):
        a_off = _a16(in_off)
        _copy(dst - a_off, inp, a_off + _a16(lo), a_off + _a16(hi), BLOCK)
    else:
        _copy(dst - in_off, inp, in_off + lo, in_off + hi, BLOCK)


@triton.jit
def _drain_segment(out, src, out_off, count, expect, lo, hi, BLOCK: tl.constexpr):
    """Elements lo .. hi of a received segment (at ``src``) to ``out`` from ``out_off``, 16-byte
    accesses when the offset and both lengths allow (see _a16)."""
    if (out_off % 16 == 0) & (count % 16 == 0) & (expect % 16 == 0):
        _copy(out + _a16(out_off), src, _a16(lo), _a16(hi), BLOCK)
    else:
        _copy(out + out_off, src, lo, hi, BLOCK)


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def all_to_all_push_kernel(
    inp, out, buf, D, meta, M, flags, F, err, slot, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Uneven all-to-all by writing: my segment for rank d goes into slot RANK of d's buffer.

    buf: W slots of ``slot`` elements (the host checks every split fits). meta as in
    all_to_all_kernel. After one barrier each rank copies its W slots, from local memory, to
    ``out`` at the offsets its own output_splits give. The bytes cross NVLink as stores, in the
    same pass that reads the input: no separate copy-in.
    """
    nprog = tl.num_programs(0)
    in_off = 0
    for d in tl.static_range(W):
        count = tl.load(meta + d)
        lo, hi = _share(count, count, nprog)
        dst = buf + D[d] + RANK * slot
        _push_segment(dst, inp, in_off, count, lo, hi, BLOCK)
        in_off += count
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    out_off = 0
    for p in tl.static_range(W):
        count = tl.load(meta + M[p] + RANK)
        expect = tl.load(meta + W + p)
        if count != expect:
            tl.atomic_or(err, 2)
        lo, hi = _share(count, tl.minimum(count, expect), nprog)
        src = buf + p * slot
        _drain_segment(out, src, out_off, count, expect, lo, hi, BLOCK)
        out_off += expect


@triton.jit
def _a16(x):
    """x rounded down to a multiple of 16, for values known at run time to be multiples already.

    Not ``tl.multiple_of``: that annotates the op that computed x, so the promise would leak into
    the unaligned branch too (misaligned 16-byte accesses, seen on H200). ``x // 16 * 16`` is a new
    value that the alignment analysis can prove divisible by 16 on its own.
    """
    return (x // 16) * 16


@triton.jit
def _share(count, limit, nprog):
    """This program's [lo, hi) of a segment of ``count`` elements, clipped to ``limit``."""
    per = tl.cdiv(tl.cdiv(count, nprog), 16) * 16
    lo = tl.program_id(0) * per
    return tl.minimum(lo, limit), tl.minimum(lo + per, limit)


@triton.jit
def _a2a_step(count, limit, nprog, sub_of, c):
    """Step c of this program's share of a segment: the share as in ``_share``, cut into steps of
    ``cdiv(share, sub_of)`` elements rounded up to 16. Sender and receiver both derive it from the
    sender's count, so they agree; ``limit`` clips it to what the receiver expects."""
    per = tl.cdiv(tl.cdiv(count, nprog), 16) * 16
    sub = tl.cdiv(tl.cdiv(per, sub_of), 16) * 16
    lo = tl.program_id(0) * per + c * sub
    hi = tl.minimum(lo + sub, tl.program_id(0) * per + per)
    return tl.minimum(lo, limit), tl.minimum(hi, limit)


@triton.jit
def _a2a_push_to(inp, buf, D, meta, slot, nprog, steps, c, DST: tl.constexpr, RANK: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Step c of my segment for rank DST into slot RANK of its buffer (the segment starts at the
    sum of my input_splits before DST)."""
    in_off = 0
    for q in tl.static_range(DST):
        in_off += tl.load(meta + q)
    count = tl.load(meta + DST)
    lo, hi = _a2a_step(count, count, nprog, steps, c)
    _push_segment(buf + D[DST] + RANK * slot, inp, in_off, count, lo, hi, BLOCK)


@triton.jit
def _a2a_push(inp, buf, D, meta, slot, nprog, steps, c, RANK: tl.constexpr, W: tl.constexpr,
              BLOCK: tl.constexpr, ROTATE: tl.constexpr = False):  # fmt: skip
    """Step c of my segments for the peers, into slot RANK of each peer's buffer: peers in rank
    order, or with ROTATE rank RANK + i in round i (pairwise exchange: in every round each rank
    receives from exactly one other, where in rank order all of them first write to rank 0)."""
    if ROTATE:
        for i in tl.static_range(1, W):
            _a2a_push_to(inp, buf, D, meta, slot, nprog, steps, c, (RANK + i) % W, RANK, BLOCK)
    else:
        in_off = 0
        for d in tl.static_range(W):
            count = tl.load(meta + d)
            if d != RANK:
                lo, hi = _a2a_step(count, count, nprog, steps, c)
                dst = buf + D[d] + RANK * slot
                _push_segment(dst, inp, in_off, count, lo, hi, BLOCK)
            in_off += count


@triton.jit
def _a2a_drain(out, buf, meta, M, err, slot, nprog, steps, c, RANK: tl.constexpr, W: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    """Step c of the peers' segments, from my slots to ``out``, comparing split tables as it goes."""
    out_off = 0
    for p in tl.static_range(W):
        expect = tl.load(meta + W + p)
        if p != RANK:
            count = tl.load(meta + M[p] + RANK)
            if count != expect:
                tl.atomic_or(err, 2)
            lo, hi = _a2a_step(count, tl.minimum(count, expect), nprog, steps, c)
            src = buf + p * slot
            _drain_segment(out, src, out_off, count, expect, lo, hi, BLOCK)
        out_off += expect


@triton.jit(do_not_specialize=["epoch", "max_spins", "steps"])
def all_to_all_pipelined_kernel(
    inp, out, buf, D, meta, M, flags, F, err, slot, steps, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr = False,
):  # fmt: skip
    """all_to_all_push in ``steps`` steps with one barrier each, and the own segment copied
    straight from input to output (it never touches the staging buffer).

    Each program's share of every peer segment is cut into ``steps`` pieces; the program pushes
    piece c + 1 before draining piece c from its slots (released by the barrier of step c), so the
    local drain overlaps NVLink stores instead of following all of them. buf, meta as in
    all_to_all_push_kernel; barriers epoch+1 .. epoch+steps. ROTATE (the ``pairwise`` algorithm):
    rank RANK + i is written in round i instead of every rank writing to rank 0 first (issue #35:
    on 4 H100s the rank-order version reached 0.61-0.76x NCCL's busbw, 1.05x on 2 GPUs, where there
    is only one peer to write to).
    """
    nprog = tl.num_programs(0)
    # my own segment: input offset sum(input_splits[:RANK]), output offset sum(output_splits[:RANK])
    in_self = 0
    out_self = 0
    for q in tl.static_range(RANK):
        in_self += tl.load(meta + q)
        out_self += tl.load(meta + W + q)
    count = tl.load(meta + RANK)
    expect = tl.load(meta + W + RANK)
    if count != expect:
        tl.atomic_or(err, 2)
    lo, hi = _share(count, tl.minimum(count, expect), nprog)
    if (in_self % 16 == 0) & (out_self % 16 == 0) & (count % 16 == 0) & (expect % 16 == 0):
        a_in = _a16(in_self)
        _copy(out + _a16(out_self) - a_in, inp, a_in + _a16(lo), a_in + _a16(hi), BLOCK)
    else:
        _copy(out + out_self - in_self, inp, in_self + lo, in_self + hi, BLOCK)
    _a2a_push(inp, buf, D, meta, slot, nprog, steps, 0, RANK, W, BLOCK, ROTATE)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for c in range(steps):
        if c + 1 < steps:
            _a2a_push(inp, buf, D, meta, slot, nprog, steps, c + 1, RANK, W, BLOCK, ROTATE)
        _a2a_drain(out, buf, meta, M, err, slot, nprog, steps, c, RANK, W, BLOCK)
        if c + 1 < steps:
            _barrier(flags, F, err, epoch + 2 + c, max_spins, RANK, W)


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def all_to_all_check_barrier_kernel(
    meta, M, flags, F, err, epoch, max_spins, RANK: tl.constexpr, W: tl.constexpr
):  # fmt: skip
    """A bare barrier that then compares split tables (the copy-engine all-to-all's first barrier):
    bit 2 of err when peer p's input_splits[RANK] differs from my output_splits[p]."""
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for p in tl.static_range(W):
        if tl.load(meta + M[p] + RANK) != tl.load(meta + W + p):
            tl.atomic_or(err, 2)


# -- the host side: CudaPeerBackend.all_to_all is ``all_to_all`` (bound in backend.py) ---------------


def all_to_all(
    be,
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
    be._check_tensor(what, "output", output)
    be._check_tensor(what, "input", input)
    W = be.world_size
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
    plan = be._split_cache.plan(rows_in, rows_out, row, input_splits, output_splits, be.cache_splits)
    elem = input.element_size()
    slot = be.staging_cap // elem // W // 64 * 64  # push: one slot per sender in every buffer
    even = input_splits is None and output_splits is None
    algorithm = all_to_all_algorithm(be, plan, algorithm, input.numel() * elem, slot, even)
    if W == 1:
        output.view(-1).copy_(input.view(-1))
        return output
    if input.numel() * elem > be.staging_cap:
        raise ValueError(
            f"{what}: input is {input.numel() * elem} bytes, more than staging_bytes={be.staging_cap}; "
            "raise staging_bytes when creating the backend"
        )
    steps = be._pipeline_steps(what, input.numel() * elem, algorithm)
    if algorithm in ("push_pipelined", "pairwise"):
        barriers = steps
    elif algorithm == "copy_engine":
        barriers = be.copy_engine_pieces
    else:
        barriers = 1
    # ranks send different amounts, but growing is collective: every rank takes the whole cap
    # on its first all_to_all, so all of them grow at the same call
    buf, epoch = be._next(be.staging_cap, barriers)
    meta_index = be.parity ^ 1  # the parity _next just used
    meta = be._meta[meta_index]
    if plan.table is None:  # uncached: a pinned host tensor per call, queued without a sync
        table = torch.tensor(plan.input_splits + plan.output_splits, dtype=torch.int64).pin_memory()
        meta.view(torch.int64).copy_(table, non_blocking=True)
        be._meta_tables[meta_index] = None
    elif be._meta_tables[meta_index] is not plan.table:
        # peers read this table after the barrier; it is rewritten only when the splits change
        meta.view(torch.int64).copy_(plan.table)
        be._meta_tables[meta_index] = plan.table
    if algorithm == "copy_engine":
        _all_to_all_copy_engine(be, input, output, plan, buf, meta, epoch, slot)
        be._after(what)
        return output
    args = (input, output, buf.view(input.dtype), buf.deltas(input.dtype), meta.view(torch.int64),
            meta.deltas(torch.int64), *be._sync)  # fmt: skip
    grid = be._programs(what, algorithm, 0)  # the same on every rank: not from the sizes
    if algorithm in ("push_pipelined", "pairwise"):
        be._launch(all_to_all_pipelined_kernel, grid, (
            *args, slot, steps, epoch, be.max_spins, be.rank, W, STEP_BYTES // elem, algorithm == "pairwise",
        ))  # fmt: skip
    elif algorithm == "push":
        be._launch(all_to_all_push_kernel, grid, (
            *args, slot, epoch, be.max_spins, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
    else:
        be._launch(all_to_all_kernel, grid, (
            *args, epoch, be.max_spins, be.rank, W, _pow2(W), STEP_BYTES // elem,
        ))  # fmt: skip
    be._after(what)
    return output


def _all_to_all_copy_engine(
    be, input: torch.Tensor, output: torch.Tensor, plan: SplitPlan, buf, meta,
    epoch: int, slot: int,
) -> None:  # fmt: skip
    """Segments for peers go by ``Tensor.copy_`` (the copy engine) into slot ``rank`` of each
    peer's buffer, piece by piece, with a barrier after each piece; the own segment and the
    drain of each received piece (slot to output, local memory) run on a second stream, so they
    overlap the NVLink copies of the next piece. The first barrier also compares split tables."""
    W, me, dtype = be.world_size, be.rank, input.dtype
    inp, out, local = input.view(-1), output.view(-1), buf.view(dtype)
    main = torch.cuda.current_stream(be.device)
    if be._side is None:
        be._side = torch.cuda.Stream(be.device)
    side = be._side
    side.wait_stream(main)  # the input, the output and the split table are ready on main
    n_self = min(plan.input_splits[me], plan.output_splits[me])
    with torch.cuda.stream(side):
        i0, o0 = plan.input_offsets[me], plan.output_offsets[me]
        out[o0 : o0 + n_self].copy_(inp[i0 : i0 + n_self])
    peers = [buf.peer(p).view(dtype) if p != me else local for p in range(W)]
    pieces = be.copy_engine_pieces
    for c in range(pieces):
        # receivers in rotated order (rank + i first), as the pairwise kernel: in rank order
        # every rank would write to rank 0 first, whose NVLink ingress then takes W - 1 senders
        sends = copy_engine_pieces(plan.input_splits, me, c, pieces)
        for d, a, b in sorted(sends, key=lambda s: (s[0] - me) % W):
            if d != me:
                off = plan.input_offsets[d]
                peers[d][me * slot + a : me * slot + b].copy_(inp[off + a : off + b])
        if c == 0:
            be._launch(all_to_all_check_barrier_kernel, 1, (
                meta.view(torch.int64), meta.deltas(torch.int64), *be._sync, epoch, be.max_spins, me, W,
            ), num_warps=1)  # fmt: skip
        else:
            be._barrier_kernel(epoch + c)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for p, a, b in copy_engine_pieces(plan.output_splits, me, c, pieces):
                if p != me:
                    off = plan.output_offsets[p]
                    out[off + a : off + b].copy_(local[p * slot + a : p * slot + b])
    # the caller's stream goes on only after the drains: a peer overwrites these slots two calls
    # later, after a barrier this rank reaches only from the caller's stream
    main.wait_stream(side)
