"""Ring broadcast: the root's bytes leave it once, in chunks that flow down a chain of GPUs.

The ``direct`` broadcast (``kernels.broadcast_kernel``) lets every rank read the root's buffer:
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
out. Signals go to one peer (``kernels._signal``/``_await``), not to all of them, so a rank waits
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

from nanoparallel.cuda.kernels import _await, _check_headers, _meet, _publish_header, _signal, _step

# header tag of this kernel (kernels._check_headers): ranks that disagree on root or dtype differ
RING_TAG = 1 << 12


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
    from nanoparallel.cuda import STEP_BYTES, pipeline_steps, split_work

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
