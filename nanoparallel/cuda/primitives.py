"""What every collective's Triton kernels are built from: flag barriers between ranks, copies, reductions.

The kernels themselves are in one file per collective (``all_reduce.py``, ``reduce_scatter.py``,
``all_gather.py``, ``broadcast.py``, ``all_to_all.py``); here are the ``@triton.jit`` functions they
share and ``barrier_kernel``, the bare barrier of the copy-engine paths.

Every peer kernel sees the *same* staging buffer on every rank (symmetric memory: one buffer per
rank, each mapped into every rank's address space). Kernels get the local buffer ``buf`` and a
tuple ``D`` of element offsets: rank ``p``'s buffer starts at ``buf + D[p]`` (``D[RANK] == 0``).
Passing peers as offsets from a real tensor argument, rather than as raw integer addresses, keeps
Triton's alignment analysis working (the offsets are multiples of 16 elements, so loads and stores
compile to 16-byte vector accesses) and lets the CPU tests stand in host buffers for peers under
``TRITON_INTERPRET=1``.

Synchronisation (no NCCL, no NVLink multicast): ``flags`` is a symmetric int32 array of
``MAX_PROGRAMS * W`` words per rank. Program ``b`` of rank ``r`` signals peer ``p`` by writing an
*epoch number* into ``flags_p[b * W + r]`` (release, system scope) and waits until its own
``flags_r[b * W + p]`` reaches that epoch (acquire, system scope). Epochs only grow, so flags never
need resetting and a fast peer that already wrote a later epoch does not confuse a slow one. Only
programs with the same index synchronise: program ``b`` of every rank touches the same index ranges,
so no grid-wide barrier is needed. Each barrier spins at most ``max_spins`` times; on expiry it sets
bit 1 of ``err`` and goes on (the host raises on the next check instead of hanging forever).

Staging buffers alternate between two per call (see ``backend.py``), so a kernel needs a
barrier only after its own writes: before a rank overwrites a buffer again, two calls later, every
peer has passed a barrier of the call in between, hence finished reading it.

Reduction ops (``OP``): 0 sum, 1 max, 2 min, 3 avg (sum, then divide by W; integers round
toward minus infinity, as torch's floor division and nanoparallel's CPU path). Half-precision inputs
accumulate in float32; integers accumulate in their own type.
"""

from __future__ import annotations

import triton
import triton.language as tl

OP_CODES = {"sum": 0, "max": 1, "min": 2, "avg": 3}
ERR_TIMEOUT = 1
ERR_SPLITS = 2  # ranks disagree about the call: all-to-all splits, or a header (_check_headers)


@triton.jit
def _combine(acc, x, OP: tl.constexpr):
    if OP == 1:
        return tl.maximum(acc, x)
    elif OP == 2:
        return tl.minimum(acc, x)
    else:
        return acc + x


@triton.jit
def _acc_type(x):
    # bf16/fp16 partial sums lose bits fast; widen them, keep every other type as it is
    if x.dtype == tl.bfloat16 or x.dtype == tl.float16:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _mean(total, W: tl.constexpr):
    """avg: sum / W for floats; floor(sum / W) for integers (torch's floor division)."""
    if total.dtype.is_floating():
        return total / W
    else:
        q = total // W  # truncates toward zero; step down where that rounded a negative up
        return tl.where((q * W != total) & (total < 0), q - 1, q)


@triton.jit
def _barrier(flags, F, err, target, max_spins, RANK: tl.constexpr, W: tl.constexpr):
    """Program ``b`` of this rank meets program ``b`` of every peer (see module docstring)."""
    slot = tl.program_id(0) * W
    # every thread's stores must be issued before thread 0 publishes the flag
    tl.debug_barrier()
    for p in tl.static_range(W):
        if p != RANK:
            tl.atomic_xchg(flags + F[p] + slot + RANK, target, sem="release", scope="sys")
    for p in tl.static_range(W):
        if p != RANK:
            seen = tl.atomic_add(flags + slot + p, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < target) & (spins < max_spins):
                seen = tl.atomic_add(flags + slot + p, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < target:
                tl.atomic_or(err, 1)
    tl.debug_barrier()


# -- synchronisation of the kernels written for issue #35 (broadcast.py, all_gather.py, all_reduce.py) --
# The same flags and epochs as _barrier, with two additions: a wait gives up at once when this rank
# has already timed out in this call (a pipelined call meets its peers once per step; without this a
# dead peer would cost one timeout per step), and one peer can be signalled alone (a chain of ranks
# needs only its neighbour). Every wait ends with a CTA barrier, so all threads read after it.


@triton.jit
def _timed_out(err):
    """Whether this rank has recorded a timeout since the host last checked."""
    return (tl.atomic_add(err, 0) & 1) != 0


@triton.jit
def _wait_for(flag, err, target, max_spins):
    """Spin until my flag word ``flag`` reaches ``target`` (acquire, system scope), at most
    ``max_spins`` polls, none once this rank has timed out; an expiry sets bit 1 of ``err``."""
    limit = tl.where(_timed_out(err), 0, max_spins)
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < target) & (spins < limit):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins += 1
    if seen < target:
        tl.atomic_or(err, 1)


@triton.jit
def _signal(flags, F, PEER: tl.constexpr, target, RANK: tl.constexpr, W: tl.constexpr):
    """Tell program ``b`` of rank PEER that this program's stores so far are visible (release)."""
    tl.debug_barrier()  # every thread's stores are issued before the flag
    tl.atomic_xchg(flags + F[PEER] + tl.program_id(0) * W + RANK, target, sem="release", scope="sys")


@triton.jit
def _await(flags, err, PEER: tl.constexpr, target, max_spins, W: tl.constexpr):
    """Wait for program ``b`` of rank PEER to signal ``target`` (see _signal)."""
    _wait_for(flags + tl.program_id(0) * W + PEER, err, target, max_spins)
    tl.debug_barrier()


@triton.jit
def _meet(flags, F, err, target, max_spins, RANK: tl.constexpr, W: tl.constexpr):
    """_barrier with bounded waits that give up once this rank has timed out (see _wait_for)."""
    slot = tl.program_id(0) * W
    tl.debug_barrier()
    for p in tl.static_range(W):
        if p != RANK:
            tl.atomic_xchg(flags + F[p] + slot + RANK, target, sem="release", scope="sys")
    for p in tl.static_range(W):
        if p != RANK:
            _wait_for(flags + slot + p, err, target, max_spins)
    tl.debug_barrier()


@triton.jit
def _publish_header(hdr, n, tag):
    """Write this call's header (element count, tag) where peers can read it after the first meet.
    Every program writes the same two words, so the duplicate stores are harmless."""
    tl.store(hdr, n)
    tl.store(hdr + 1, tag)


@triton.jit
def _check_headers(hdr, H, err, n, tag, RANK: tl.constexpr, W: tl.constexpr):
    """After the first meet: every peer's header must equal mine, else bit 2 of err (the host
    raises MismatchError). Skipped after a timeout: a peer that never came left a stale header."""
    if not _timed_out(err):
        for p in tl.static_range(W):
            if p != RANK:
                if (tl.load(hdr + H[p], volatile=True) != n) | (
                    tl.load(hdr + H[p] + 1, volatile=True) != tag
                ):
                    tl.atomic_or(err, 2)


@triton.jit
def _copy(dst, src, lo, hi, BLOCK: tl.constexpr):
    """dst[lo:hi] = src[lo:hi], BLOCK elements at a time."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _reduce_peers(out, buf, D, lo, hi, OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """out[lo:hi] = op over p of buf_p[lo:hi], peers in rank order (same result on every rank)."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        acc = _acc_type(tl.load(buf + D[0] + offs, mask=mask))
        for p in tl.static_range(1, W):
            acc = _combine(acc, _acc_type(tl.load(buf + D[p] + offs, mask=mask)), OP)
        if OP == 3:
            acc = _mean(acc, W)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _step(lo, hi, sub, c):
    """[lo, hi) cut into steps of ``sub`` elements: the range of step c (empty past the end)."""
    s_lo = tl.minimum(lo + c * sub, hi)
    return s_lo, tl.minimum(s_lo + sub, hi)


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def barrier_kernel(flags, F, err, epoch, max_spins, RANK: tl.constexpr, W: tl.constexpr):
    """A bare barrier (one program), for the copy-engine paths."""
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
