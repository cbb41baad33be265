"""Triton kernels that move and reduce data across GPU peer buffers, with our own flag barriers.

Every kernel here sees the *same* staging buffer on every rank (symmetric memory: one buffer per
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

Staging buffers alternate between two per call (see ``nanoparallel.cuda``), so a kernel needs a
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


@triton.jit(do_not_specialize=["epoch", "max_spins"])
def barrier_kernel(flags, F, err, epoch, max_spins, RANK: tl.constexpr, W: tl.constexpr):
    """A bare barrier (one program), for the copy-engine paths."""
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)


# -- pipelined variants: one barrier per step, so the local half of step c overlaps step c+1 ------


@triton.jit
def _step(lo, hi, sub, c):
    """[lo, hi) cut into steps of ``sub`` elements: the range of step c (empty past the end)."""
    s_lo = tl.minimum(lo + c * sub, hi)
    return s_lo, tl.minimum(s_lo + sub, hi)


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


@triton.jit
def _push_slices(inp, buf, D, S, m, lo, hi, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Slice p of inp, elements [lo, hi), into slot RANK of peer p's buffer, for every peer p:
    each peer gets only the slice it owns (reduce-scatter), my own slice is never staged."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        for p in tl.static_range(W):
            if p != RANK:
                x = tl.load(inp + p * m + offs, mask=mask)
                tl.store(buf + D[p] + RANK * S + offs, x, mask=mask)


@triton.jit(do_not_specialize=["epoch", "max_spins", "steps"])
def reduce_scatter_pipelined_kernel(
    inp, out, buf, D, flags, F, err, m, S, chunk, sub, steps, epoch, max_spins,
    OP: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Reduce-scatter by writing, in ``steps`` steps of ``sub`` elements per program, one barrier each.

    inp: [W*m], slice p = [p*m, (p+1)*m) is what rank p ends with; out: [m]; buf: W slots of S
    elements (S >= m; slot RANK unused: my own term is read from my slice of inp). The direct kernel
    (two_shot with GATHER=False) copies all W slices into its buffer, meets once, then reads; here
    program b pushes step c + 1 of slice p to peer p before it reduces step c from its slots
    (released by the barrier of step c), as one_shot_pipelined does for the all-reduce, so the
    NVLink stores of one step overlap the local reduction of the previous one. Same remote bytes,
    (W-1) m per rank, and the same rank-order reduction as the direct kernel (the same bits).
    ``steps`` is the same on every program and rank (barriers epoch+1 .. epoch+steps).
    """
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, m)
    f_lo, f_hi = _step(lo, hi, sub, 0)
    _push_slices(inp, buf, D, S, m, f_lo, f_hi, RANK, W, BLOCK)
    _barrier(flags, F, err, epoch + 1, max_spins, RANK, W)
    for c in range(steps):
        if c + 1 < steps:
            n_lo, n_hi = _step(lo, hi, sub, c + 1)
            _push_slices(inp, buf, D, S, m, n_lo, n_hi, RANK, W, BLOCK)
        s_lo, s_hi = _step(lo, hi, sub, c)
        _reduce_slots(inp + RANK * m, out, buf, S, s_lo, s_hi, OP, RANK, W, BLOCK)
        if c + 1 < steps:
            _barrier(flags, F, err, epoch + 2 + c, max_spins, RANK, W)


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


@triton.jit
def peer_copy_kernel(local, buf, D, n, chunk, PEER: tl.constexpr, READ: tl.constexpr, BLOCK: tl.constexpr):
    """Raw NVLink bandwidth probe (nanoparallel.cuda.diagnose): READ copies peer PEER's buffer into
    ``local``, otherwise ``local`` into the peer's buffer; program b moves [b*chunk, (b+1)*chunk)."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    if READ:
        _copy(local, buf + D[PEER], lo, hi, BLOCK)
    else:
        _copy(buf + D[PEER], local, lo, hi, BLOCK)
