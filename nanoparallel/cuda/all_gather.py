"""All-gather among the GPUs of one host: every algorithm's kernel, and the backend's ``all_gather``.

The algorithms (``CudaPeerBackend.all_gather(algorithm=...)``): ``direct`` (copy in, one barrier,
read every peer's buffer: ``all_gather_kernel``), ``copy_engine`` (the same reads as
``Tensor.copy_`` from peers' buffers, peers in rotated order), and the two that keep every NVLink
busy, reads in rotated order (``pairwise``) or pipelined pushes (``push_pipelined``).

Why the ``direct`` all-gather (``all_gather_kernel``) reached only 0.51-0.62x NCCL's bus
bandwidth on 4 H100s (2026-11-27): after its barrier every program reads peer 0's range, then peer
1's, then peer 2's, in rank order, and so does every rank. At any moment all readers pull from the
same GPU, whose egress (about 370 GB/s) is then split three ways, while the other GPUs' egress is
idle: 3 m bytes at about 123 GB/s where 330 GB/s is one reader's rate. The same order runs through
the copy-engine variant. Both kernels here remove that hot spot (``diagnose`` measures it alone:
the ``incast`` rows against ``ring`` and ``all_peers``):

* ``pairwise``: the direct kernel with the reads rotated, rank r reading rank (r + i) mod W in
  round i, so that in every round each GPU serves exactly one reader (the pairwise-exchange
  schedule of MPI's all-to-all). Bytes per rank: m copied in (local), (W - 1) m read over NVLink.
  Prediction with R = 330 GB/s (full-grid Triton read of one peer) and a local copy at 1.4 TB/s:
  busbw = (W-1) m / ((W-1) m / R + m / 1400) = 306 GB/s at W = 4, 0.94x NCCL's 324 at 1 GiB.
* ``push_pipelined``: every rank stores its input into slot ``rank`` of every peer's staging
  buffer, all peers interleaved every 8 KiB, in ``steps`` steps with one barrier each; a program
  copies step c out of its slots (local) while its stores of step c + 1 are in flight, and its own
  block goes straight from input to output. Stores do not wait for replies (360 GB/s against 330
  for reads) and nothing is copied in: busbw = B S / (S + 1) = 340 GB/s at 16 steps, 1.05x NCCL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoparallel.cuda.partition import STEP_BYTES, _round_up, pipeline_steps, split_work
from nanoparallel.cuda.primitives import _barrier, _check_headers, _copy, _meet, _publish_header, _step

PAIRWISE_TAG = 2 << 12
PUSH_TAG = 3 << 12


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def all_gather_kernel(
    inp, out, buf, D, flags, F, err, m, chunk, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[p*m:(p+1)*m] = inp of rank p. inp: [m], out: [W*m]; one barrier, (W-1) m bytes read."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, m)
    _copy(buf, inp, lo, hi, BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for p in tl.static_range(W):
        if p == RANK:
            _copy(out + p * m, inp, lo, hi, BLOCK)
        else:
            _copy(out + p * m, buf + D[p], lo, hi, BLOCK)


@triton.jit(do_not_specialize=["tag", "epoch", "max_spins"])
def all_gather_pairwise_kernel(
    inp, out, buf, D, hdr, H, flags, F, err, m, ld, chunk, tag, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[p*ld : p*ld + m] = inp of rank p. inp: [m]; out: W rows of stride ``ld`` >= m; buf: [m].
    One barrier; program b copies its range in, meets, then reads the same range of every peer,
    rank (RANK + i) mod W in round i."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, m)
    _publish_header(hdr, m, tag)
    _copy(buf, inp, lo, hi, BLOCK)
    _meet(flags, F, err, epoch + 1, max_spins, RANK, W)
    _check_headers(hdr, H, err, m, tag, RANK, W)
    for i in tl.static_range(1, W):  # peer (RANK + i) mod W, written inline: a constexpr
        _copy(out + ((RANK + i) % W) * ld, buf + D[(RANK + i) % W], lo, hi, BLOCK)  # cannot be reassigned
    _copy(out + RANK * ld, inp, lo, hi, BLOCK)


@triton.jit
def _push_to_peers(inp, buf, D, S, lo, hi, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """inp[lo:hi] into slot RANK of every peer's buffer, peers interleaved block by block."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(inp + offs, mask=mask)
        for i in tl.static_range(1, W):
            tl.store(buf + D[(RANK + i) % W] + RANK * S + offs, x, mask=mask)


@triton.jit(do_not_specialize=["tag", "steps", "epoch", "max_spins"])
def all_gather_push_kernel(
    inp, out, buf, D, hdr, H, flags, F, err, m, S, ld, chunk, sub, steps, tag, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[p*ld : p*ld + m] = inp of rank p. inp: [m]; out: W rows of stride ``ld``; buf: W slots of
    S >= m elements (slot RANK unused). Program b pushes step c + 1 of its range before it copies
    step c out of its slots, released by the barrier of step c. Epochs epoch+1 .. epoch+steps."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, m)
    _publish_header(hdr, m, tag)
    f_lo, f_hi = _step(lo, hi, sub, 0)
    _push_to_peers(inp, buf, D, S, f_lo, f_hi, RANK, W, BLOCK)
    _meet(flags, F, err, epoch + 1, max_spins, RANK, W)
    _check_headers(hdr, H, err, m, tag, RANK, W)
    for c in range(steps):
        if c + 1 < steps:
            n_lo, n_hi = _step(lo, hi, sub, c + 1)
            _push_to_peers(inp, buf, D, S, n_lo, n_hi, RANK, W, BLOCK)
        s_lo, s_hi = _step(lo, hi, sub, c)
        for p in tl.static_range(W):  # local copies: the order does not matter
            if p == RANK:
                _copy(out + RANK * ld, inp, s_lo, s_hi, BLOCK)
            else:
                _copy(out + p * ld, buf + p * S, s_lo, s_hi, BLOCK)
        if c + 1 < steps:
            _meet(flags, F, err, epoch + 2 + c, max_spins, RANK, W)


def all_gather_new(be, output: torch.Tensor, input: torch.Tensor, algorithm: str) -> torch.Tensor:
    """Launch ``pairwise`` or ``push_pipelined`` on backend ``be``: input [m] -> output [W*m].
    A message larger than the staging buffer goes in pieces of k elements per rank; the kernels
    write the [W, k] block of a piece with row stride m, so no temporary is needed."""
    W, elem, dtype = be.world_size, input.element_size(), input.dtype
    block = STEP_BYTES // elem
    m = input.numel()
    push = algorithm == "push_pipelined"
    tag = (PUSH_TAG if push else PAIRWISE_TAG) + 16 * elem
    per_rank = be.staging_cap // elem // (W if push else 1)
    piece = max(per_rank // 1024 * 1024, 1024)
    inp, out = input.view(-1), output.view(-1)
    for start in range(0, m, piece):
        k = min(piece, m - start)
        src = input if k == m else inp[start : start + k]
        dst = output if k == m else out[start:]
        chunk, grid = split_work(k, be._programs("all_gather", algorithm, W * k * elem), block)
        if push:
            S = _round_up(k, 64)
            sub, steps = pipeline_steps(
                chunk, be._pipeline_steps("all_gather", W * k * elem, algorithm), block
            )
            buf, epoch = be._next(W * S * elem, steps)
            hdr = be._header()
            be._launch(all_gather_push_kernel, grid, (
                src, dst, buf.view(dtype), buf.deltas(dtype), hdr.view(torch.int64), hdr.deltas(torch.int64),
                *be._sync, k, S, m, chunk, sub, steps, tag, epoch, be.max_spins, be.rank, W, block,
            ))  # fmt: skip
        else:
            buf, epoch = be._next(k * elem, 1)
            hdr = be._header()
            be._launch(all_gather_pairwise_kernel, grid, (
                src, dst, buf.view(dtype), buf.deltas(dtype), hdr.view(torch.int64), hdr.deltas(torch.int64),
                *be._sync, k, m, chunk, tag, epoch, be.max_spins, be.rank, W, block,
            ))  # fmt: skip
    return output


# -- the host side: CudaPeerBackend.all_gather is ``all_gather`` (bound in backend.py) ---------------


def all_gather(be, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto") -> torch.Tensor:
    """output[p*m:(p+1)*m] <- input of rank p. input: [m], output: [W*m]."""
    what = "all_gather"
    be._check_sharded(what, output, input, "output")
    W = be.world_size
    elem = input.element_size()
    algorithm = be._algorithm(what, algorithm, output.numel() * elem)
    m = input.numel()
    if m == 0:
        return output
    if algorithm in ("pairwise", "push_pipelined"):
        all_gather_new(be, output, input, algorithm)
        be._after(what)
        return output
    piece = max(be.staging_cap // elem // 1024 * 1024, 1024)
    if m <= piece and algorithm == "direct":  # the common case, without reshaping
        buf, epoch = be._next(m * elem, 1)
        chunk, grid = be._chunk(m, elem)
        be._launch(all_gather_kernel, grid, (
            input, output, buf.view(input.dtype), buf.deltas(input.dtype), *be._sync, m, chunk, epoch,
            be.max_spins, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
        be._after(what)
        return output
    inp, out = input.view(-1), output.view(W, m)
    for start in range(0, m, piece):
        k = min(piece, m - start)
        src = inp[start : start + k]
        buf, epoch = be._next(k * elem, 1)
        if algorithm == "copy_engine":
            buf.view(input.dtype)[:k].copy_(src)
            be._barrier_kernel(epoch)
            # peers in rotated order (rank + i in round i): in rank order every rank would
            # first copy from rank 0, whose NVLink egress then serves W - 1 readers at once
            for i in range(W):
                p = (be.rank + i) % W
                view = src if p == be.rank else buf.peer(p).view(input.dtype)[:k]
                out[p, start : start + k].copy_(view)
            continue
        dst = out[:, start : start + k]
        if not dst.is_contiguous():
            # a piece of a [W, m] output is W strided rows; gather into a contiguous [W, k] first
            tmp = torch.empty(W, k, dtype=input.dtype, device=be.device)
        else:
            tmp = dst
        chunk, grid = be._chunk(k, elem)
        be._launch(all_gather_kernel, grid, (
            src, tmp, buf.view(input.dtype), buf.deltas(input.dtype), *be._sync, k, chunk, epoch,
            be.max_spins, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
        if tmp is not dst:
            dst.copy_(tmp)
    be._after(what)
    return output
