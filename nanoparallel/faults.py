"""Failure detection: peer liveness, abort propagation and the pre-collective header check.

What this module promises (PCCL, keiblinger2025pccl, is the anchor: a collective library should
fail *fast and everywhere* rather than hang, and detect disagreement before touching data):

* Liveness. Every rank publishes ``host:pid`` in the store at bootstrap. When all ranks share a
  host, each rank maps a one-page status file in ``/dev/shm`` per peer; a waiting rank looks at
  ``/proc/<pid>/stat`` of every peer (dead or zombie means dead) and at the peers' abort words.
  Across hosts, a daemon thread writes a heartbeat into the store every ``heartbeat_s`` and a
  peer whose heartbeat is older than ``4 * heartbeat_s`` counts as dead.
* Abort propagation. A rank that raises sets its abort word (and an ``abort/<rank>`` store key),
  so ranks waiting on a *third* rank fail too instead of waiting for their own timeout.
* Header check (:func:`header`, :func:`check_headers`): before each collective every rank sends
  every other rank one fixed-size header; all ranks see all headers and raise the same
  :class:`MismatchError`.

Non-promises are listed in FAULTS.md (no recovery, no membership change, PID reuse, hung-but-alive
ranks are caught only by the timeout).
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

import numpy as np
import torch

from nanoparallel.errors import MismatchError, PeerFailureError

ABORT_CODES = {
    0: "running",
    1: "timed out",
    2: "saw a dead peer",
    3: "saw a header mismatch",
    4: "closed",
    5: "failed",
}


def store_barrier(store, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank sets ``<prefix>/<rank>`` and waits for all the others' keys."""
    store.set(f"{prefix}/{rank}", b"1")
    store.wait([f"{prefix}/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


def _proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state letter follows the ')' that closes the command name
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Liveness:
    """Knows whether peers are alive; ``check()`` raises :class:`PeerFailureError` if one is not."""

    def __init__(
        self, rank: int, world_size: int, store, prefix: str, timeout_s: float, heartbeat_s: float = 1.0
    ):
        self.rank, self.world_size, self.store, self.prefix = rank, world_size, store, prefix
        self.heartbeat_s = heartbeat_s
        # NANOPARALLEL_HOSTNAME lets a test pretend ranks sit on different hosts (store heartbeats)
        host = os.environ.get("NANOPARALLEL_HOSTNAME") or socket.gethostname()
        store.set(f"{prefix}/who/{rank}", f"{host}:{os.getpid()}".encode())
        who = [store.get(f"{prefix}/who/{r}").decode() for r in range(world_size)]
        self.hosts = [w.rsplit(":", 1)[0] for w in who]
        self.pids = [int(w.rsplit(":", 1)[1]) for w in who]
        self.same_host = all(h == host for h in self.hosts)
        self._maps: list[mmap.mmap] = []
        self._status: list[np.ndarray] = []
        self._stop = threading.Event()
        self._thread = None
        self._last_store_poll = 0.0
        if self.same_host:
            name = f"/dev/shm/nanoparallel-status-{uuid.uuid4().hex[:12]}-{rank}"
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
            store.set(f"{prefix}/status/{rank}", name.encode())
            for r in range(world_size):
                path = store.get(f"{prefix}/status/{r}").decode()
                with open(path, "r+b") as f:
                    m = mmap.mmap(f.fileno(), 4096)
                self._maps.append(m)
                self._status.append(np.frombuffer(m, dtype=np.int64, count=8))
            store_barrier(store, f"{prefix}/status-mapped", rank, world_size, timeout_s)
            os.unlink(name)  # every peer has it mapped; unlinking now means a crash leaks nothing
        else:
            store.set(f"{prefix}/hb/{rank}", str(time.time()).encode())  # alive from the start
            self._thread = threading.Thread(
                target=self._beat, args=(self._own_client(store, timeout_s),), daemon=True
            )
            self._thread.start()

    @staticmethod
    def _own_client(store, timeout_s: float):
        """The heartbeat thread's own connection: a store client is not safe to share across threads."""
        import torch.distributed as dist

        if isinstance(store, dist.TCPStore):
            return dist.TCPStore(
                store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
        return store  # e.g. a HashStore or FileStore in one process: share it

    def _beat(self, store) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                store.set(f"{self.prefix}/hb/{self.rank}", str(time.time()).encode())
            except Exception:  # the store went away: nothing left to report to
                return

    def abort(self, code: int) -> None:
        """Tell every peer this rank gave up (``code`` from ABORT_CODES)."""
        if self._status:
            if self._status[self.rank][0] == 0:
                self._status[self.rank][0] = code
        else:
            try:
                self.store.set(f"{self.prefix}/abort/{self.rank}", str(code).encode())
            except Exception:
                pass

    def check(self, what: str) -> None:
        """Raise PeerFailureError naming the peer if any peer is dead or aborted."""
        if self.same_host:
            # deaths first: a dead rank is the root cause, the peers' aborts are its echo
            for p in range(self.world_size):
                if p != self.rank and not _proc_alive(self.pids[p]):
                    raise PeerFailureError(
                        f"nanoparallel rank {self.rank}: {what}: rank {p} (pid {self.pids[p]}) is dead"
                    )
            for p in range(self.world_size):
                code = int(self._status[p][0]) if p != self.rank else 0
                if code not in (0, 4):
                    raise PeerFailureError(
                        f"nanoparallel rank {self.rank}: {what}: rank {p} aborted its communicator "
                        f"({ABORT_CODES.get(code, code)})"
                    )
        if not self.same_host and time.monotonic() - self._last_store_poll > self.heartbeat_s:
            self._last_store_poll = time.monotonic()
            now = time.time()
            peers = [p for p in range(self.world_size) if p != self.rank]
            for p in peers:  # silence first: the frozen rank is the root cause, aborts are its echo
                if self.store.check([f"{self.prefix}/hb/{p}"]):
                    age = now - float(self.store.get(f"{self.prefix}/hb/{p}").decode())
                    if age > 4 * self.heartbeat_s:
                        raise PeerFailureError(
                            f"nanoparallel rank {self.rank}: {what}: rank {p} sent no heartbeat for {age:.1f}s"
                        )
            for p in peers:
                if self.store.check([f"{self.prefix}/abort/{p}"]):
                    code = int(self.store.get(f"{self.prefix}/abort/{p}").decode())
                    raise PeerFailureError(
                        f"nanoparallel rank {self.rank}: {what}: rank {p} aborted its communicator "
                        f"({ABORT_CODES.get(code, code)})"
                    )

    def peer_closed(self, p: int) -> bool:
        return bool(self._status) and int(self._status[p][0]) == 4

    def close(self) -> None:
        self._stop.set()
        self._status = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a numpy view still alive; the mapping goes with the process
                pass
        self._maps = []


# ---------------------------------------------------------------------------------------------
# Header check. A header is int64[8 + 2n]:
#   magic, sequence number, op, count, dtype, reduce op, root, algorithm, send_counts[n], recv_counts[n]
# send/recv counts are only used by all_to_all (what this rank sends to / receives from each rank).

MAGIC = 0x6E616E6F  # "nano"
OPS = (
    "barrier",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "send",
    "invalid arguments",
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float64)
REDUCE_OPS = ("sum", "max", "min", "avg")
FIELDS = ("magic", "sequence number", "operation", "element count", "dtype", "reduce op", "root", "algorithm")


def header_len(world_size: int) -> int:
    return 8 + 2 * world_size


def header(
    world_size: int,
    seq: int,
    op: str,
    count: int = 0,
    dtype: torch.dtype | None = None,
    reduce_op: str | None = None,
    root: int = -1,
    algorithm: int = -1,
    send_counts=None,
    recv_counts=None,
) -> torch.Tensor:
    h = torch.zeros(header_len(world_size), dtype=torch.int64)
    h[:8] = torch.tensor(
        [
            MAGIC,
            seq,
            OPS.index(op),
            count,
            -1 if dtype is None else DTYPES.index(dtype),
            -1 if reduce_op is None else REDUCE_OPS.index(reduce_op),
            root,
            algorithm,
        ]
    )
    if send_counts is not None:
        h[8 : 8 + world_size] = torch.tensor(send_counts)
        h[8 + world_size :] = torch.tensor(recv_counts)
    return h


def describe(field: int, value: int, algorithms: tuple[str, ...] = ()) -> str:
    if value == -1:
        return "none"
    if field == 2:
        return OPS[value] if 0 <= value < len(OPS) else f"?{value}"
    if field == 4:
        return str(DTYPES[value]).replace("torch.", "") if 0 <= value < len(DTYPES) else f"?{value}"
    if field == 5:
        return REDUCE_OPS[value] if 0 <= value < len(REDUCE_OPS) else f"?{value}"
    if field == 7 and 0 <= value < len(algorithms):
        return algorithms[value]
    return str(value)


def check_headers(headers: torch.Tensor, rank: int, algorithms: tuple[str, ...] = ()) -> None:
    """``headers[r]`` is rank r's header. Every rank sees the same table, so every rank raises alike.

    Raises MismatchError naming the ranks and each field that differs.
    """
    n = headers.shape[0]
    problems = []
    for f, name in enumerate(FIELDS):
        col = headers[:, f].tolist()
        if len(set(col)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(col):
                groups.setdefault(describe(f, v, algorithms), []).append(r)
            problems.append(
                f"{name} differs: " + "; ".join(f"ranks {rs} have {v}" for v, rs in groups.items())
            )
    if not problems and headers[0, 2].item() == OPS.index("all_to_all"):
        send = headers[:, 8 : 8 + n]
        recv = headers[:, 8 + n :]
        for src in range(n):
            for dst in range(n):
                if send[src, dst] != recv[dst, src]:
                    problems.append(
                        f"all_to_all split differs: rank {src} sends {send[src, dst].item()} elements to rank "
                        f"{dst}, which expects {recv[dst, src].item()}"
                    )
    if problems:
        raise MismatchError(
            f"nanoparallel rank {rank}: collective arguments disagree across ranks: " + " | ".join(problems)
        )
