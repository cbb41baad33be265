"""Shared-memory transport between processes on one host: our own slot rings in ``/dev/shm``.

Memory layout. Each rank owns one *inbox* file; for every sender ``src`` and channel ``c`` it holds
one stream::

    [ctrl: head (written by receiver) | 56 B pad | tail (written by sender) | 56 B pad]
    [slot 0: slot_bytes][slot 1] ... [slot nslots-1]

The receiver creates the file, every rank maps every inbox, and the file is unlinked right after
all ranks mapped it, so a crashed job leaves nothing behind in /dev/shm. head and tail sit on
different cache lines so the two sides do not fight over one line.

Two protocols, after NCCL's (hu2025demystifying, "Communication protocols"):

* ``simple``: the sender copies a chunk into the slot, then publishes ``tail = step + 1``; the
  receiver waits for ``tail > step``, reads (copies or reduces straight out of the slot) and
  returns the slot with ``head = step + 1``. Data then a separate flag: on x86 stores become
  visible in program order (TSO), which is the fence NCCL issues on a GPU; on a weakly ordered
  CPU this needs an explicit store fence between the copy and the flag.
* ``ll`` (low latency): every 8-byte line carries 4 bytes of data and a 4-byte flag equal to the
  step number; there is no tail. The receiver snapshots the lines and accepts the chunk when every
  flag in the snapshot is current; an aligned 8-byte line is written by one store, so data and
  flag of a line arrive together. Half of every slot is flags, so LL moves half the bandwidth of
  Simple, but saves the flag round trip: it is for small messages.

Both protocols return slots with ``head``, so a sender never overwrites a slot that is unread.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np
import torch

from nanoparallel.faults import store_barrier
from nanoparallel.transport.base import Transport

CTRL_BYTES = 128
HEAD, TAIL = 0, 8  # int64 indices in the ctrl block: 64 bytes apart


class _Stream:
    __slots__ = ("ctrl", "slots", "lines", "np_lines", "step")

    def __init__(self, buf: mmap.mmap, offset: int, nslots: int, slot_bytes: int):
        self.ctrl = np.frombuffer(buf, dtype=np.int64, count=CTRL_BYTES // 8, offset=offset)
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nslots * slot_bytes, offset=offset + CTRL_BYTES)
        self.slots = raw.view(nslots, slot_bytes)
        self.lines = raw.view(torch.int32).view(nslots, slot_bytes // 8, 2)
        self.np_lines = np.frombuffer(
            buf, dtype=np.int32, count=nslots * slot_bytes // 4, offset=offset + CTRL_BYTES
        )
        self.np_lines = self.np_lines.reshape(nslots, slot_bytes // 8, 2)
        self.step = 0


class ShmTransport(Transport):
    """Point-to-point over shared memory; ``protocol`` is ``"simple"`` or ``"ll"``."""

    name = "shm"

    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        prefix: str,
        *,
        protocol: str = "simple",
        n_channels: int = 2,
        slot_bytes: int = 1 << 20,
        nslots: int = 4,
        timeout_s: float = 30.0,
        liveness=None,
    ):
        super().__init__(rank, world_size, timeout_s, liveness)
        if protocol not in ("simple", "ll"):
            raise ValueError(f"ShmTransport: protocol must be 'simple' or 'll', got {protocol!r}")
        if slot_bytes % 64 or slot_bytes <= 0:
            raise ValueError(f"ShmTransport: slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.protocol, self.n_channels, self.slot_bytes, self.nslots = (
            protocol,
            n_channels,
            slot_bytes,
            nslots,
        )
        self.name = f"shm-{protocol}"
        self.chunk_bytes = slot_bytes if protocol == "simple" else slot_bytes // 2
        self.stream_bytes = CTRL_BYTES + nslots * slot_bytes
        size = 4096 + max(world_size, 1) * n_channels * self.stream_bytes
        path = f"/dev/shm/nanoparallel-{uuid.uuid4().hex[:12]}-{rank}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        store.set(f"{prefix}/inbox/{rank}", path.encode())
        self._maps: list[mmap.mmap] = []
        try:
            for r in range(world_size):
                with open(store.get(f"{prefix}/inbox/{r}").decode(), "r+b") as f:
                    self._maps.append(mmap.mmap(f.fileno(), size))
            store_barrier(store, f"{prefix}/inbox-mapped", rank, world_size, timeout_s)
        finally:
            os.unlink(path)
        # out[peer][c]: my stream inside peer's inbox; inn[peer][c]: peer's stream inside mine
        self.out = {
            p: [self._stream(p, rank, c) for c in range(n_channels)] for p in range(world_size) if p != rank
        }
        self.inn = {
            p: [self._stream(rank, p, c) for c in range(n_channels)] for p in range(world_size) if p != rank
        }

    def _stream(self, owner: int, src: int, channel: int) -> _Stream:
        offset = 4096 + (src * self.n_channels + channel) * self.stream_bytes
        return _Stream(self._maps[owner], offset, self.nslots, self.slot_bytes)

    @staticmethod
    def _flag(step: int) -> int:
        return step % 0x7FFFFFFE + 1  # never 0 (fresh memory) and never the value a slot held before

    def _try_send(self, peer: int, channel: int, op, k: int) -> bool:
        st = self.out[peer][channel]
        step = st.step
        if step - int(st.ctrl[HEAD]) >= self.nslots:
            return False  # every slot still unread: back-pressure
        data = self._chunk(op, k)
        n = data.numel()
        slot = step % self.nslots
        if self.protocol == "simple":
            st.slots[slot, :n].copy_(data)
            st.ctrl[TAIL] = step + 1  # the flag, after the data (x86 keeps store order)
        else:
            nlines = -(-n // 4)
            packed = torch.empty(nlines, 2, dtype=torch.int32)
            words = packed[:, 0]
            if n % 4 == 0 and data.storage_offset() % 4 == 0:
                words.copy_(data.view(torch.int32))
            else:
                tmp = torch.zeros(nlines * 4, dtype=torch.uint8)
                tmp[:n] = data
                words.copy_(tmp.view(torch.int32))
            packed[:, 1] = self._flag(step)
            st.lines[slot, :nlines].copy_(packed)  # one contiguous copy: each line lands whole
        st.step = step + 1
        return True

    def _try_recv(self, peer: int, channel: int, op, k: int) -> bool:
        st = self.inn[peer][channel]
        step = st.step
        slot = step % self.nslots
        if self.protocol == "simple":
            if int(st.ctrl[TAIL]) <= step:
                return False
            nbytes = self._chunk(op, k).numel()
            self._deliver(op, k, st.slots[slot, :nbytes])
        else:
            nbytes = self._chunk(op, k).numel()
            nlines = -(-nbytes // 4)
            flag = self._flag(step)
            if st.np_lines[slot, nlines - 1, 1] != flag:  # cheap probe before the full check
                return False
            snap = st.lines[slot, :nlines].clone()
            if not bool((snap[:, 1] == flag).all()):
                return False
            words = torch.empty(nlines, dtype=torch.int32).copy_(
                snap[:, 0]
            )  # fresh strides even for one line
            self._deliver(op, k, words.view(torch.uint8)[:nbytes])
        st.ctrl[HEAD] = step + 1
        st.step = step + 1
        return True

    def close(self) -> None:
        self.out, self.inn = {}, {}
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still referenced; the mapping dies with the process
                pass
        self._maps = []
