"""All-reduce among the GPUs of one host: every algorithm's kernel, and the backend's ``all_reduce``.

The algorithms (``CudaPeerBackend.all_reduce(algorithm=...)``; ``auto`` picks by size, policy.py):

* ``one_shot``: copy my input in, one barrier, read the same range from all W buffers and reduce;
* ``one_shot_push``: store my input into slot ``rank`` of every rank's buffer, one barrier, reduce
  the W slots from local memory; ``one_shot_pipelined``: the same in steps, one barrier each;
* ``two_shot``: reduce-scatter by reading, then all-gather by reading (two barriers);
* ``ring``: NCCL's ring, pulled from the left neighbour (2W - 2 barriers);
* ``two_shot_pipelined``: the two-shot all-reduce by pushing, with both halves in one pipeline
  (below).

``two_shot`` and ``ring`` with ``GATHER=False`` are the reduce-scatter's ``direct`` and ``ring``
(``reduce_scatter.py``). Every rank adds the W terms in rank order, so all ranks get the same bits.

``two_shot_pipelined``, why and how.

Where the others stand on 4 H100s (2026-11-27, busbw against NCCL's at 64 MiB-1 GiB): ``ring``
0.80-0.82x (it reads from its left neighbour, waits at 2W - 2 barriers, and every step is a read,
330 GB/s, not a store, 360); ``two_shot`` 0.57-0.66x (copy-in, then reads, then a second round of
reads, nothing overlapped); the reduce-scatter ``pipelined`` (pushes, steps) already reached
1.01x at 1 GiB. This kernel is that reduce-scatter followed, step by step, by an all-gather that
pushes too:

* shard q = elements [q S, (q + 1) S) of the message (S = n / W rounded up to 64) is reduced by
  rank q. In step c a rank stores step c of shard p into slot ``rank`` of rank p's buffer, for
  every peer p (all peers interleaved every 8 KiB), as the pipelined reduce-scatter does;
* after the barrier of step c the owner adds its W slots (its own term from its input, ranks in
  order 0..W-1, so every rank ends with the same bits as ``two_shot``), stores the result into its
  output and into gather slot ``rank`` of every peer's buffer;
* after the next barrier each rank copies the peers' reduced step c from its gather slots to its
  output, while the stores of step c + 1 are in flight.

One barrier per step, steps + 1 in all. Bytes per rank: 2 (W - 1)/W n stored over NVLink (the
ring's volume), local reads and writes on the side. Prediction with B = 360 GB/s of stores and S
steps: busbw = 2 (W-1)/W n / t = B S / (S + 1) = 339 GB/s at 16 steps, 0.95x NCCL's 355 at 1 GiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoparallel.cuda.partition import (
    STEP_BYTES,
    _round_up,
    pipeline_steps,
    ring_barriers,
    slice_size,
    split_work,
)
from nanoparallel.cuda.primitives import (
    _acc_type,
    _barrier,
    _check_headers,
    _combine,
    _copy,
    _mean,
    _meet,
    _publish_header,
    _reduce_peers,
    _step,
)

TWO_SHOT_PIPELINED_TAG = 4 << 12


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def one_shot_all_reduce_kernel(
    inp, out, buf, D, flags, F, err, n, chunk, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One barrier: copy my chunk in, meet, read that chunk from all W buffers and reduce.

    inp, out: [n] (may alias). Program b owns elements [b*chunk, (b+1)*chunk).
    Remote bytes read per rank: (W-1) n; every rank reduces everything.
    """
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    _copy(buf, inp, lo, hi, BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    _reduce_peers(out, buf, D, lo, hi, OP, W, BLOCK)


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def one_shot_push_all_reduce_kernel(
    inp, out, buf, D, flags, F, err, n, S, chunk, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One-shot by writing: my input goes into slot RANK of every rank's buffer, then each rank
    reduces its W slots from local memory.

    inp, out: [n] (may alias); buf: W slots of S elements. Same bytes over NVLink as the pull
    version, (W-1) n per rank, but as stores, which the sender need not wait for, and in the same
    pass that reads the input (no separate copy-in); the reduction then reads local memory only.
    """
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(inp + offs, mask=mask)
        for p in tl.static_range(W):
            tl.store(buf + D[p] + RANK * S + offs, x, mask=mask)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        acc = _acc_type(tl.load(buf + offs, mask=mask))
        for q in tl.static_range(1, W):
            acc = _combine(acc, _acc_type(tl.load(buf + q * S + offs, mask=mask)), OP)
        if OP == 3:
            acc = _mean(acc, W)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def two_shot_all_reduce_kernel(
    inp, out, buf, D, flags, F, err, n, S, chunk, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """Reduce-scatter by reading, then all-gather by reading: two barriers.

    inp: [n]; rank r owns slice r = [r*S, min((r+1)*S, n)); program b handles [b*chunk, (b+1)*chunk)
    of every slice. Phase 1 reduces my slice from all W buffers into my buffer (and ``out``);
    phase 2 (GATHER) reads every peer's reduced slice. With GATHER=False this is reduce-scatter and
    ``out`` is my slice only ([S]). Remote bytes read per rank: 2 (W-1)/W n, the ring's volume.
    """
    b0 = tl.program_id(0) * chunk
    b1 = tl.minimum(b0 + chunk, S)
    for r in tl.static_range(W):
        _copy(buf, inp, tl.minimum(r * S + b0, n), tl.minimum(r * S + b1, n), BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    lo = tl.minimum(RANK * S + b0, n)
    hi = tl.minimum(RANK * S + b1, n)
    if GATHER:
        # the reduced slice goes back into my own buffer, where peers read it in phase 2; only I
        # read this slice of my buffer in phase 1, so overwriting it is safe
        _reduce_peers(buf, buf, D, lo, hi, OP, W, BLOCK)
        _barrier(flags, F, err, epoch + 2, max_spins, RANK, W)
        for p in tl.static_range(W):
            _copy(out, buf + D[p], tl.minimum(p * S + b0, n), tl.minimum(p * S + b1, n), BLOCK)
    else:
        _reduce_peers(out - RANK * S, buf, D, lo, hi, OP, W, BLOCK)


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def ring_all_reduce_kernel(
    inp, out, buf, D, flags, F, err, n, S, chunk, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """NCCL's ring, pulled from the left neighbour: W-1 reduce steps, then W-1 copy steps.

    Chunk c is [c*S, min((c+1)*S, n)). In reduce step s rank r adds its own chunk
    (r - s - 2) mod W to the partial sum the left neighbour made of it one step earlier, so after
    W-1 steps rank r holds the full sum of chunk r. Copy step t takes chunk (r - 1 - t) mod W, just
    completed by the left neighbour. One barrier per step: 2W - 2 in all (the price of the ring on
    a machine where every GPU can read every other one directly).
    GATHER=False stops after the reduce steps (reduce-scatter; ``out`` is [S], my chunk).
    """
    b0 = tl.program_id(0) * chunk
    b1 = tl.minimum(b0 + chunk, S)
    LEFT: tl.constexpr = (RANK + W - 1) % W
    for q in tl.static_range(W):
        _copy(buf, inp, tl.minimum(q * S + b0, n), tl.minimum(q * S + b1, n), BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for s in tl.static_range(W - 1):
        c = (RANK - s - 2 + 2 * W) % W
        lo = tl.minimum(c * S + b0, n)
        hi = tl.minimum(c * S + b1, n)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            mine = _acc_type(tl.load(buf + offs, mask=mask))
            left = _acc_type(tl.load(buf + D[LEFT] + offs, mask=mask))
            acc = _combine(left, mine, OP)
            if s == W - 2:
                if OP == 3:
                    acc = _mean(acc, W)
                if GATHER:
                    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)
                else:
                    tl.store(out - RANK * S + offs, acc.to(out.dtype.element_ty), mask=mask)
            tl.store(buf + offs, acc.to(buf.dtype.element_ty), mask=mask)
        if GATHER or s < W - 2:
            _barrier(flags, F, err, epoch + 2 + s, max_spins, RANK, W)
    if GATHER:
        for t in tl.static_range(W - 1):
            c2 = (RANK - 1 - t + 2 * W) % W
            lo = tl.minimum(c2 * S + b0, n)
            hi = tl.minimum(c2 * S + b1, n)
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hi
                x = tl.load(buf + D[LEFT] + offs, mask=mask)
                tl.store(out + offs, x, mask=mask)
                if t < W - 2:
                    tl.store(buf + offs, x, mask=mask)
            if t < W - 2:
                _barrier(flags, F, err, epoch + 1 + W + t, max_spins, RANK, W)


# -- pipelined variants: one barrier per step, so the local half of step c overlaps step c+1 ------


@triton.jit
def _push_peers(inp, buf, D, S, lo, hi, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """inp[lo:hi] into slot RANK of every *peer's* buffer (my own slot is never written)."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(inp + offs, mask=mask)
        for p in tl.static_range(W):
            if p != RANK:
                tl.store(buf + D[p] + RANK * S + offs, x, mask=mask)


@triton.jit
def _reduce_slots(inp, out, buf, S, lo, hi, OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """out[lo:hi] = op over q of slot q, my own term read from inp; rank order, as one_shot_push."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        if RANK == 0:
            acc = _acc_type(tl.load(inp + offs, mask=mask))
        else:
            acc = _acc_type(tl.load(buf + offs, mask=mask))
        for q in tl.static_range(1, W):
            if q == RANK:
                acc = _combine(acc, _acc_type(tl.load(inp + offs, mask=mask)), OP)
            else:
                acc = _combine(acc, _acc_type(tl.load(buf + q * S + offs, mask=mask)), OP)
        if OP == 3:
            acc = _mean(acc, W)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["epoch", "max_spins", "steps"])
def one_shot_pipelined_all_reduce_kernel(
    inp, out, buf, D, flags, F, err, n, S, chunk, sub, steps, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """one_shot_push cut into ``steps`` steps of ``sub`` elements per program, one barrier each.

    inp, out: [n] (may alias); buf: W slots of S elements (slot RANK unused: my own term is read
    from inp, which saves writing and re-reading n elements of local memory). Program b pushes step
    c + 1 of its range to the peers before it reduces step c, whose data the barrier of step c has
    released, so the NVLink stores of one step are in flight while the reduction of the previous
    one reads local memory. ``steps`` is the same on every program and rank (barrier epochs
    epoch+1 .. epoch+steps); a program whose range is shorter meets the others with empty steps.
    """
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    f_lo, f_hi = _step(lo, hi, sub, 0)
    _push_peers(inp, buf, D, S, f_lo, f_hi, RANK, W, BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for c in range(steps):
        if c + 1 < steps:
            n_lo, n_hi = _step(lo, hi, sub, c + 1)
            _push_peers(inp, buf, D, S, n_lo, n_hi, RANK, W, BLOCK)
        s_lo, s_hi = _step(lo, hi, sub, c)
        _reduce_slots(inp, out, buf, S, s_lo, s_hi, OP, RANK, W, BLOCK)
        if c + 1 < steps:
            _barrier(flags, F, err, epoch + 2 + c, max_spins, RANK, W)


# -- two_shot_pipelined (see the module docstring) ----------------------------------------------------


@triton.jit
def _push_shards(inp, buf, D, S, n, lo, hi, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Elements [lo, hi) of shard p of inp into slot RANK of rank p's buffer, for every peer p."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        for i in tl.static_range(1, W):  # peer (RANK + i) mod W: rotated, so no rank is everyone's first
            mask = (offs < hi) & (((RANK + i) % W) * S + offs < n)
            x = tl.load(inp + ((RANK + i) % W) * S + offs, mask=mask)
            tl.store(buf + D[(RANK + i) % W] + RANK * S + offs, x, mask=mask)


@triton.jit
def _reduce_and_share(
    inp, out, buf, D, S, G, n, lo, hi, OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Elements [lo, hi) of my shard: op over the W slots in rank order (my own term from inp),
    stored into my output and into gather slot RANK of every peer's buffer."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = (offs < hi) & (RANK * S + offs < n)
        if RANK == 0:
            acc = _acc_type(tl.load(inp + offs, mask=mask))
        else:
            acc = _acc_type(tl.load(buf + offs, mask=mask))
        for q in tl.static_range(1, W):
            if q == RANK:
                acc = _combine(acc, _acc_type(tl.load(inp + RANK * S + offs, mask=mask)), OP)
            else:
                acc = _combine(acc, _acc_type(tl.load(buf + q * S + offs, mask=mask)), OP)
        if OP == 3:
            acc = _mean(acc, W)
        y = acc.to(out.dtype.element_ty)
        tl.store(out + RANK * S + offs, y, mask=mask)
        for i in tl.static_range(1, W):
            tl.store(buf + D[(RANK + i) % W] + G + RANK * S + offs, y, mask=mask)


@triton.jit
def _drain_shards(out, buf, S, G, n, lo, hi, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Elements [lo, hi) of every peer's reduced shard, from my gather slots to my output."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        for p in tl.static_range(W):
            if p != RANK:
                mask = (offs < hi) & (p * S + offs < n)
                tl.store(out + p * S + offs, tl.load(buf + G + p * S + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["tag", "steps", "epoch", "max_spins"])
def two_shot_pipelined_all_reduce_kernel(
    inp, out, buf, D, hdr, H, flags, F, err, n, S, chunk, sub, steps, tag, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """inp, out: [n] (may alias). buf: 2 W S elements: reduce-scatter slots [0, W S) (slot q: rank
    q's copy of my shard; slot RANK unused) and gather slots [W S, 2 W S) (slot q: rank q's reduced
    shard; slot RANK unused). Program b owns [b*chunk, (b+1)*chunk) of every shard, cut into
    ``steps`` steps of ``sub``. Epochs epoch+1 .. epoch+steps+1."""
    b0 = tl.program_id(0) * chunk
    b1 = tl.minimum(b0 + chunk, S)
    G = W * S
    _publish_header(hdr, n, tag)
    f_lo, f_hi = _step(b0, b1, sub, 0)
    _push_shards(inp, buf, D, S, n, f_lo, f_hi, RANK, W, BLOCK)
    _meet(flags, F, err, epoch + 1, max_spins, RANK, W)
    _check_headers(hdr, H, err, n, tag, RANK, W)
    for c in range(steps):
        if c + 1 < steps:
            n_lo, n_hi = _step(b0, b1, sub, c + 1)
            _push_shards(inp, buf, D, S, n, n_lo, n_hi, RANK, W, BLOCK)
        s_lo, s_hi = _step(b0, b1, sub, c)
        _reduce_and_share(inp, out, buf, D, S, G, n, s_lo, s_hi, OP, RANK, W, BLOCK)
        if c > 0:
            p_lo, p_hi = _step(b0, b1, sub, c - 1)
            _drain_shards(out, buf, S, G, n, p_lo, p_hi, RANK, W, BLOCK)
        _meet(flags, F, err, epoch + 2 + c, max_spins, RANK, W)
    l_lo, l_hi = _step(b0, b1, sub, steps - 1)
    _drain_shards(out, buf, S, G, n, l_lo, l_hi, RANK, W, BLOCK)


def all_reduce_two_shot_pipelined(be, x: torch.Tensor, code: int) -> None:
    """Launch the kernel on backend ``be`` for one piece ``x`` (contiguous, in place), which must
    fit twice in a staging buffer (the caller cuts pieces of staging_cap / 2 bytes)."""
    n, elem, W, dtype = x.numel(), x.element_size(), be.world_size, x.dtype
    block = STEP_BYTES // elem
    S = slice_size(n, W)
    chunk, grid = split_work(S, be._programs("all_reduce", "two_shot_pipelined", n * elem), block)
    sub, steps = pipeline_steps(
        chunk, be._pipeline_steps("all_reduce", n * elem, "two_shot_pipelined"), block
    )
    buf, epoch = be._next(2 * W * S * elem, steps + 1)
    hdr = be._header()
    tag = TWO_SHOT_PIPELINED_TAG + 16 * elem + code
    be._launch(two_shot_pipelined_all_reduce_kernel, grid, (
        x, x, buf.view(dtype), buf.deltas(dtype), hdr.view(torch.int64), hdr.deltas(torch.int64), *be._sync,
        n, S, chunk, sub, steps, tag, epoch, be.max_spins, code, be.rank, W, block,
    ))  # fmt: skip


# -- the host side: CudaPeerBackend.all_reduce is ``all_reduce`` (bound in backend.py) ---------------


def all_reduce(be, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto") -> torch.Tensor:
    """In place: tensor <- op over ranks of tensor. tensor: [...], same shape on every rank."""
    what = "all_reduce"
    be._check_tensor(what, "tensor", tensor)
    code = be._op(what, op, tensor.dtype)
    elem = tensor.element_size()
    algorithm = be._algorithm(what, algorithm, tensor.numel() * elem)
    n = tensor.numel()
    if n == 0 or be.world_size == 1:
        return tensor  # with one rank every op (avg too) leaves the tensor as it is
    # two_shot_pipelined stages every element twice (reduce-scatter slots and gather slots)
    cap = be.staging_cap // (2 if algorithm == "two_shot_pipelined" else 1)
    piece = max(cap // elem // 1024 * 1024, 1024)
    if n <= piece:  # the common case: no reshaping, the kernel indexes the contiguous storage
        _all_reduce_piece(be, tensor, code, algorithm)
    else:
        flat = tensor.view(-1)
        for start in range(0, n, piece):
            _all_reduce_piece(be, flat[start : start + piece], code, algorithm)
    be._after(what)
    return tensor


def _all_reduce_piece(be, x: torch.Tensor, code: int, algorithm: str) -> None:
    n, elem, W = x.numel(), x.element_size(), be.world_size
    if algorithm == "one_shot":
        buf, epoch = be._next(n * elem, 1)
        chunk, grid = be._chunk(n, elem)
        be._launch(one_shot_all_reduce_kernel, grid, (
            x, x, buf.view(x.dtype), buf.deltas(x.dtype), *be._sync, n, chunk, epoch, be.max_spins,
            code, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
        return
    if algorithm == "one_shot_pipelined":
        steps = be._pipeline_steps("all_reduce", n * elem, algorithm)
        _launch_pipelined(be, one_shot_pipelined_all_reduce_kernel, x, x, n, code, steps)
        return
    if algorithm == "two_shot_pipelined":
        all_reduce_two_shot_pipelined(be, x, code)
        return
    if algorithm == "one_shot_push":
        S = _round_up(n, 64)  # slot stride, 256-byte aligned
        buf, epoch = be._next(W * S * elem, 1)
        chunk, grid = be._chunk(n, elem)
        be._launch(one_shot_push_all_reduce_kernel, grid, (
            x, x, buf.view(x.dtype), buf.deltas(x.dtype), *be._sync, n, S, chunk, epoch, be.max_spins,
            code, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
        return
    S = slice_size(n, W)
    chunk, grid = be._chunk(S, elem)
    kernel = two_shot_all_reduce_kernel if algorithm == "two_shot" else ring_all_reduce_kernel
    barriers = 2 if algorithm == "two_shot" else ring_barriers(W, True)
    buf, epoch = be._next(W * S * elem, barriers)
    be._launch(kernel, grid, (
        x, x, buf.view(x.dtype), buf.deltas(x.dtype), *be._sync, n, S, chunk, epoch, be.max_spins,
        code, be.rank, W, STEP_BYTES // elem, True,
    ))  # fmt: skip


def _launch_pipelined(
    be, kernel, src: torch.Tensor, dst: torch.Tensor, n: int, code: int, steps: int
) -> None:
    """One launch of a pipelined kernel (the one-shot all-reduce, the reduce-scatter), which
    take the same arguments: n elements per rank's slot, W slots of S >= n elements staged,
    each program's chunk in ``steps`` barriers (fewer when the chunk is short)."""
    W, elem = be.world_size, src.element_size()
    S = _round_up(n, 64)  # slot stride, 256-byte aligned
    chunk, grid = be._chunk(n, elem)
    sub, steps = pipeline_steps(chunk, steps, STEP_BYTES // elem)
    buf, epoch = be._next(W * S * elem, steps)
    be._launch(kernel, grid, (
        src, dst, buf.view(src.dtype), buf.deltas(src.dtype), *be._sync, n, S, chunk, sub, steps, epoch,
        be.max_spins, code, be.rank, W, STEP_BYTES // elem,
    ))  # fmt: skip
