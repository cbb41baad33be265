"""The point-to-point Transport interface and the progress engine every algorithm runs on.

An algorithm describes one collective as a list of :class:`Send` and :class:`Recv` operations and
hands it to :meth:`Transport.run`. The engine cuts every operation into chunks of
``chunk_bytes`` (one buffer slot), deals chunk ``k`` to channel ``channels[k % len(channels)]``
and advances all operations round-robin, one chunk at a time, until all are done. This is how
NCCL pipelines (hu2025demystifying, "Channels" and "Data transfer"): several independent channels,
each a FIFO of fixed-size slots, and a primitive that may forward chunk ``k`` as soon as chunk ``k``
has arrived.

Dependencies are chunk-wise: ``Send(..., after=(r,))`` sends chunk ``k`` only once chunk ``k`` of
``r`` is complete, which lets a ring forward a chunk it just reduced, or a tree pass a chunk up
while later chunks are still arriving from its children.

Ordering rule: on one stream (a direction between two ranks on one channel) operations are served
in the order they were listed, on both sides. Algorithms list matching operations in the same
order on the sending and the receiving rank.

A subclass implements three non-blocking calls: ``_try_send(peer, channel, op, k) -> bool``
(send ``self._chunk(op, k)`` if there is room), ``_try_recv(peer, channel, op, k) -> bool``
(if chunk ``k`` has arrived, ``self._deliver(op, k, view)`` straight from the buffer) and
``_flush()``. They must be cheap when nothing is ready: the engine polls them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nanoparallel.errors import CommAbortedError, CommTimeoutError, PeerFailureError

Reducer = Callable[[torch.Tensor, torch.Tensor], None]  # reducer(dst, incoming): dst <- dst (op) incoming


@dataclass(eq=False)
class Send:
    """Send the bytes of ``data`` (a contiguous tensor) to ``peer``."""

    peer: int
    data: torch.Tensor
    channels: Sequence[int] = (0,)
    after: Sequence = ()
    label: str = "send"
    _next: list = field(default_factory=list, repr=False)
    _nchunks: int = 0
    _bytes: torch.Tensor | None = None

    def done(self, k: int) -> bool:
        """Whether chunk ``k`` of this operation has completed."""
        return self._next[k % len(self._next)] > k


@dataclass(eq=False)
class Recv:
    """Receive into ``out`` (contiguous) from ``peer``; ``reduce`` combines instead of copying."""

    peer: int
    out: torch.Tensor
    reduce: Reducer | None = None
    channels: Sequence[int] = (0,)
    after: Sequence = ()
    label: str = "recv"
    _next: list = field(default_factory=list, repr=False)
    _nchunks: int = 0
    _bytes: torch.Tensor | None = None

    def done(self, k: int) -> bool:
        return self._next[k % len(self._next)] > k


class Transport:
    """Moves bytes between ranks; subclasses provide the non-blocking primitives."""

    name = "abstract"
    chunk_bytes = 1 << 20
    n_channels = 1

    def __init__(self, rank: int, world_size: int, timeout_s: float, liveness=None):
        self.rank, self.world_size, self.timeout_s, self.liveness = rank, world_size, timeout_s, liveness
        self.bytes_sent = 0  # payload bytes handed to peers; tests count them against the paper's formulas
        self.messages_sent = 0  # chunks
        self.aborted: str | None = None
        # Busy-poll this long before sleeping between polls. With a core per rank, spinning gives
        # the lowest latency; with more ranks than cores the peer we wait for needs our core, so
        # give it up soon. NANOPARALLEL_SPIN_US overrides.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        default_us = 1000.0 if world_size <= cores else 30.0
        self.spin_s = float(os.environ.get("NANOPARALLEL_SPIN_US", default_us)) * 1e-6

    def scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable buffer: fresh large allocations cost a page fault per 4 KiB on every call
        (64 MiB: ~30 ms here), more than the collective itself. Grows, never shrinks."""
        if not hasattr(self, "_scratch"):
            self._scratch: dict[str, torch.Tensor] = {}
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[name] = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        return buf[:nbytes].view(dtype)

    # -- to implement -----------------------------------------------------------------------
    def _try_send(self, peer: int, channel: int, op: Send, k: int) -> bool:
        raise NotImplementedError

    def _try_recv(self, peer: int, channel: int, op: Recv, k: int) -> bool:
        raise NotImplementedError

    def _flush(self) -> None:
        """Wait until every send handed out is safe to forget (asynchronous transports)."""

    def close(self) -> None:
        pass

    # -- the engine ---------------------------------------------------------------------------
    def run(self, ops: Sequence[Send | Recv], what: str) -> None:
        """Complete every operation; raise CommTimeoutError / PeerFailureError instead of hanging."""
        if self.aborted:
            raise CommAbortedError(f"nanoparallel rank {self.rank}: communicator unusable ({self.aborted})")
        cb = self.chunk_bytes
        queues: dict[tuple[bool, int, int], list] = {}
        for op in ops:
            if op.peer == self.rank or not 0 <= op.peer < self.world_size:
                raise ValueError(f"nanoparallel rank {self.rank}: {op.label}: bad peer {op.peer}")
            buf = op.data if isinstance(op, Send) else op.out
            nbytes = buf.numel() * buf.element_size()
            op._nchunks = -(-nbytes // cb)
            op._next = list(range(len(op.channels)))
            op._bytes = buf.view(-1).view(torch.uint8) if nbytes else buf.view(-1)
            if isinstance(op, Send):
                self.bytes_sent += nbytes
            for dep in op.after:
                if dep._nchunks != op._nchunks:
                    raise AssertionError(f"{op.label}: depends on {dep.label} with a different chunk count")
            for ci, ch in enumerate(op.channels):
                if ci < op._nchunks:
                    queues.setdefault((isinstance(op, Send), op.peer, ch), []).append((op, ci))
        streams = [(key, q) for key, q in queues.items()]
        heads = [0] * len(streams)
        remaining = len(streams)
        last_progress = time.monotonic()
        idle = 0
        while remaining:
            progressed = False
            for i, (key, q) in enumerate(streams):
                if heads[i] >= len(q):
                    continue
                op, ci = q[heads[i]]
                k = op._next[ci]
                blocked = False
                for dep in op.after:
                    if dep._next[k % len(dep._next)] <= k:  # dep.done(k), inlined: this loop is hot
                        blocked = True
                        break
                if blocked:
                    continue
                is_send, peer, ch = key
                if is_send:
                    ok = self._try_send(peer, ch, op, k)
                    if ok:
                        self.messages_sent += 1
                else:
                    ok = self._try_recv(peer, ch, op, k)
                if ok:
                    progressed = True
                    op._next[ci] = k + len(op.channels)
                    if op._next[ci] >= op._nchunks:
                        heads[i] += 1
                        if heads[i] >= len(q):
                            remaining -= 1
            if progressed:
                idle = 0
                continue
            idle += 1
            if idle == 1:
                last_progress = time.monotonic()
            elif idle & 63 == 0:
                waited = time.monotonic() - last_progress
                self._check(what, streams, heads, waited)
                if waited > self.spin_s:
                    # Nothing arrived for a while: sleep briefly so an oversubscribed machine can
                    # run the peer we wait for (sched_yield costs a whole time slice on some VMs).
                    time.sleep(20e-6)
        self._flush()

    def _chunk(self, op, k: int) -> torch.Tensor:
        """Bytes of chunk ``k`` of ``op`` (a view into the caller's tensor)."""
        cb = self.chunk_bytes
        return op._bytes[k * cb : (k + 1) * cb]

    def _deliver(self, op: Recv, k: int, src: torch.Tensor) -> None:
        """Copy (or reduce) the arrived bytes ``src`` of chunk ``k`` into ``op.out``."""
        if op.reduce is None:
            self._chunk(op, k).copy_(src)
            return
        dst = self._chunk(op, k).view(op.out.dtype)
        op.reduce(dst, src.view(op.out.dtype))

    def _check(self, what: str, streams, heads, waited: float) -> None:
        if self.liveness is not None:
            try:
                self.liveness.check(what)
            except PeerFailureError as exc:
                self.abort(2, str(exc))
                raise
        if waited > self.timeout_s:
            stuck = []
            for i, (key, q) in enumerate(streams):
                if heads[i] < len(q):
                    op, ci = q[heads[i]]
                    verb = "send to" if key[0] else "receive from"
                    stuck.append(
                        f"{op.label}: {verb} rank {key[1]} (channel {key[2]}, chunk {op._next[ci]}/{op._nchunks})"
                    )
            msg = (
                f"nanoparallel rank {self.rank}: {what} timed out after {self.timeout_s:.1f}s without progress; "
                f"waiting on: " + "; ".join(stuck[:4])
            )
            self.abort(1, msg)
            raise CommTimeoutError(msg)

    def abort(self, code: int, reason: str) -> None:
        self.aborted = reason
        if self.liveness is not None:
            self.liveness.abort(code)
