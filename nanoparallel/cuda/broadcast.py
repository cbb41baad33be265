"""Broadcast among the GPUs of one host: every algorithm's kernel, and the backend's ``broadcast``.

The algorithms (``CudaPeerBackend.broadcast(algorithm=...)``): ``direct`` (the root copies in, one
barrier, every rank reads the root's buffer: ``broadcast_kernel``), ``copy_engine`` (the same read
as ``Tensor.copy_``), and ``ring``, where the root's bytes leave it once, in chunks that flow down
a chain of GPUs (``ring_broadcast_kernel``).

The ``direct`` broadcast (``broadcast_kernel``) lets every rank read the root's buffer:
with W ranks the root sends W - 1 copies of the message, so its NVLink egress is the limit and
the bus bandwidth is a (W - 1)-th of a link's. On 4 H100s (2026-11-27) that gave 123 GB/s, a third
of the 330-390 GB/s one GPU moves per direction, and 0.35x NCCL's 359 GB/s at 1 GiB. NCCL
broadcasts along a ring instead (hu2025demystifying, "Ring" and the ``recvCopySend`` primitive):
rank ``root`` sends chunk c to the next rank, which forwards it while the root sends chunk c + 1.

Here the chain is root -> root + 1 -> ... -> root - 1 (mod W). Each program (CUDA block) owns one
range of the message and cuts it into ``steps`` steps; in step c a rank at chain position k > 0
waits for its predecessor's signal for step c, then reads the step from its own staging buffer
once and stores it twice: into its tensor (local) and into the successor's staging buffer (NVLink),
then signals the successor. The root stores straight from its tensor; the last rank only copies
out. Signals go to one peer (``primitives._signal``/``_await``), not to all of them, so a rank waits
only for the step it needs: this is a true pipeline, not a lock-step of barriers. One barrier with
every peer opens the call: a rank writes into its successor's buffer only after the successor has
finished the previous call that used that buffer (buffers alternate between calls), and a peer
that never came makes every rank time out instead of one.

Bytes and the prediction (before any run): the busiest GPU sends n bytes and receives n (the
direct broadcast: the root sends (W - 1) n). A chain of W ranks with S steps per program takes
(S + W - 2) step times, so with B the NVLink bandwidth of one GPU writing to one peer (360 GB/s
with a full grid of Triton stores on H100, ``diagnose``), busbw = n / t = B S / (S + W - 2),
minus the opening barrier: 340 GB/s at S = 32 and W = 4, 0.94x NCCL's 359; 0.89x at S = 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoparallel.cuda.partition import STEP_BYTES, pipeline_steps, split_work
from nanoparallel.cuda.primitives import (
    _await,
    _barrier,
    _check_headers,
    _copy,
    _meet,
    _publish_header,
    _signal,
    _step,
)

# header tag of this kernel (primitives._check_headers): ranks that disagree on root or dtype differ
RING_TAG = 1 << 12


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def broadcast_kernel(
    tensor, buf, D, flags, F, err, n, chunk, root, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Every rank reads the root's buffer. tensor: [n]; one barrier, n bytes read per non-root."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    if root == RANK:
        _copy(buf, tensor, lo, hi, BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    if root != RANK:
        # root is a runtime value, so find its offset with a static scan over the ranks
        for p in tl.static_range(W):
            if p == root:
                _copy(tensor, buf + D[p], lo, hi, BLOCK)


@triton.jit
def _copy_twice(dst_a, dst_b, src, lo, hi, BLOCK: tl.constexpr):
    """dst_a[lo:hi] = dst_b[lo:hi] = src[lo:hi]: one load, two stores."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(src + offs, mask=mask)
        tl.store(dst_a + offs, x, mask=mask)
        tl.store(dst_b + offs, x, mask=mask)


@triton.jit
def _forward(tensor, dst, src, lo, hi, pos, W: tl.constexpr, BLOCK: tl.constexpr):
    """Step [lo, hi) at chain position ``pos``: the root's tensor to the successor's buffer, a
    middle rank's buffer to its tensor and the successor's buffer, the last rank's to its tensor."""
    if pos == 0:
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            tl.store(dst + offs, tl.load(tensor + offs, mask=mask), mask=mask)
    elif pos < W - 1:
        _copy_twice(tensor, dst, src, lo, hi, BLOCK)
    else:
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            tl.store(tensor + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["root", "tag", "steps", "epoch", "max_spins"])
def ring_broadcast_kernel(
    tensor, buf, D, hdr, H, flags, F, err, n, chunk, sub, steps, root, tag, epoch, max_spins,
    RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """tensor: [n], the root's is read, every other rank's overwritten. buf: [n] staging (this rank
    receives its predecessor's stores here). Program b owns [b*chunk, (b+1)*chunk), cut into
    ``steps`` steps of ``sub`` elements. Epochs: epoch+1 for the opening barrier, epoch+2+c for the
    signal of step c (steps + 1 in all)."""
    NEXT: tl.constexpr = (RANK + 1) % W
    PREV: tl.constexpr = (RANK + W - 1) % W
    pos = (RANK - root + W) % W  # 0 for the root, W - 1 for the last rank of the chain
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    _publish_header(hdr, n, tag)
    _meet(flags, F, err, epoch + 1, max_spins, RANK, W)
    _check_headers(hdr, H, err, n, tag, RANK, W)
    for c in range(steps):
        s_lo, s_hi = _step(lo, hi, sub, c)
        if pos > 0:
            _await(flags, err, PREV, epoch + 2 + c, max_spins, W)
        _forward(tensor, buf + D[NEXT], buf, s_lo, s_hi, pos, W, BLOCK)
        if pos < W - 1:
            _signal(flags, F, NEXT, epoch + 2 + c, RANK, W)


def broadcast_ring(be, tensor: torch.Tensor, root: int) -> torch.Tensor:
    """Launch the ring broadcast on backend ``be`` (a CudaPeerBackend): tensor [...], in place.
    Messages larger than the staging buffer go in pieces, one launch each."""
    W, elem, dtype = be.world_size, tensor.element_size(), tensor.dtype
    block = STEP_BYTES // elem
    flat = tensor.view(-1)
    total = flat.numel()
    piece = max(be.staging_cap // elem // 1024 * 1024, 1024)
    tag = RING_TAG + 16 * elem + root
    for start in range(0, total, piece):
        seg = tensor if total <= piece else flat[start : start + piece]
        n = seg.numel()
        chunk, grid = split_work(n, be._programs("broadcast", "ring", n * elem), block)
        sub, steps = pipeline_steps(chunk, be._pipeline_steps("broadcast", n * elem, "ring"), block)
        buf, epoch = be._next(n * elem, steps + 1)
        hdr = be._header()
        be._launch(ring_broadcast_kernel, grid, (
            seg, buf.view(dtype), buf.deltas(dtype), hdr.view(torch.int64), hdr.deltas(torch.int64), *be._sync,
            n, chunk, sub, steps, root, tag, epoch, be.max_spins, be.rank, W, block,
        ))  # fmt: skip
    return tensor


# -- the host side: CudaPeerBackend.broadcast is ``broadcast`` (bound in backend.py) -----------------


def broadcast(be, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto") -> torch.Tensor:
    """In place: tensor <- tensor of rank ``root``. tensor: [...], same shape on every rank."""
    what = "broadcast"
    be._check_tensor(what, "tensor", tensor)
    W = be.world_size
    if not (isinstance(root, int) and 0 <= root < W):
        raise ValueError(f"{what}: root must be in [0, {W}), got {root!r}")
    elem = tensor.element_size()
    algorithm = be._algorithm(what, algorithm, tensor.numel() * elem)
    n = tensor.numel()
    if n == 0 or W == 1:
        return tensor
    if algorithm == "ring":
        broadcast_ring(be, tensor, root)
        be._after(what)
        return tensor
    piece = max(be.staging_cap // elem // 1024 * 1024, 1024)
    if n <= piece and algorithm == "direct":  # the common case, without reshaping
        buf, epoch = be._next(n * elem, 1)
        chunk, grid = be._chunk(n, elem)
        be._launch(broadcast_kernel, grid, (
            tensor, buf.view(tensor.dtype), buf.deltas(tensor.dtype), *be._sync, n, chunk, root, epoch,
            be.max_spins, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
        be._after(what)
        return tensor
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), piece):
        seg = flat[start : start + piece]
        n = seg.numel()
        buf, epoch = be._next(n * elem, 1)
        if algorithm == "copy_engine":
            if be.rank == root:
                buf.view(tensor.dtype)[:n].copy_(seg)
            be._barrier_kernel(epoch)
            if be.rank != root:
                seg.copy_(buf.peer(root).view(tensor.dtype)[:n])
            continue
        chunk, grid = be._chunk(n, elem)
        be._launch(broadcast_kernel, grid, (
            seg, buf.view(tensor.dtype), buf.deltas(tensor.dtype), *be._sync, n, chunk, root, epoch,
            be.max_spins, be.rank, W, STEP_BYTES // elem,
        ))  # fmt: skip
    be._after(what)
    return tensor
