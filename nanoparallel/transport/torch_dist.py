"""Portable fallback transport: torch.distributed isend/irecv (gloo on CPU).

Each channel is a gloo tag, so chunks of one channel stay in order (gloo matches messages by
source and tag, first come first served). Sends are asynchronous: the chunk is cloned, because the
algorithm may overwrite the source region (a ring's all-gather phase) before gloo has sent it.
Gloo marks a receive complete only inside ``wait()`` (``is_completed`` stays False even after the
data landed, and a ``wait`` that times out breaks the connection), so each posted receive is
waited on by a small thread pool and the engine polls the future: the engine thread itself never
blocks, which keeps the timeout and liveness checks running and avoids cross-flow deadlocks.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from nanoparallel.errors import PeerFailureError
from nanoparallel.transport.base import Transport

TAG_BASE = 1000


class TorchTransport(Transport):
    """Point-to-point over a torch.distributed process group."""

    name = "torch"

    def __init__(
        self,
        rank: int,
        world_size: int,
        group=None,
        *,
        n_channels: int = 2,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 30.0,
        liveness=None,
    ):
        super().__init__(rank, world_size, timeout_s, liveness)
        self.group, self.n_channels, self.chunk_bytes = group, n_channels, chunk_bytes
        self._sends: list = []
        self._pending: dict[tuple[int, int], tuple] = {}  # (peer, channel) -> (future, buffer)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="nanoparallel-recv")

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def _try_send(self, peer: int, channel: int, op, k: int) -> bool:
        buf = self._chunk(op, k).clone()
        self._sends.append(
            (dist.isend(buf, self._global(peer), group=self.group, tag=TAG_BASE + channel), buf)
        )
        return True

    def _try_recv(self, peer: int, channel: int, op, k: int) -> bool:
        key = (peer, channel)
        if key not in self._pending:
            buf = torch.empty(self._chunk(op, k).numel(), dtype=torch.uint8)
            work = dist.irecv(buf, self._global(peer), group=self.group, tag=TAG_BASE + channel)
            self._pending[key] = (self._pool.submit(work.wait), buf)
        fut, buf = self._pending[key]
        if not fut.done():
            return False
        exc = fut.exception()
        if exc is not None:  # gloo saw the connection drop: the peer's process is gone
            self.abort(2, str(exc))
            raise PeerFailureError(
                f"nanoparallel rank {self.rank}: receive from rank {peer} failed in gloo: {exc}"
            )
        del self._pending[key]
        self._deliver(op, k, buf)
        return True

    def _flush(self) -> None:
        sends, self._sends = self._sends, []
        for work, _ in sends:
            try:
                work.wait()
            except RuntimeError as exc:
                self.abort(2, str(exc))
                raise PeerFailureError(
                    f"nanoparallel rank {self.rank}: a send failed in gloo: {exc}"
                ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
