"""Two-shot all-reduce by pushing, with both halves in one pipeline (``two_shot_pipelined``).

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

from nanoparallel.cuda.kernels import (
    _acc_type,
    _check_headers,
    _combine,
    _mean,
    _meet,
    _publish_header,
    _step,
)

TWO_SHOT_PIPELINED_TAG = 4 << 12


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
    from nanoparallel.cuda import STEP_BYTES, pipeline_steps, slice_size, split_work

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
