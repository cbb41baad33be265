"""Bootstrap and the public API: ``init(...) -> Communicator``.

The store (a torch.distributed TCPStore from MASTER_ADDR / MASTER_PORT unless one is passed) is
used only to bootstrap: ranks publish their pid and the names of their shared-memory inboxes, and
wait for each other once. After that, all traffic goes through the transport.

Every collective first exchanges a small header (operation, count, dtype, reduce op, root,
algorithm, sequence number) with every peer; if they disagree, every rank raises the same
:class:`~nanoparallel.errors.MismatchError` instead of hanging. All waits are bounded by
``timeout_s`` and watch the peers' liveness (see faults.py and FAULTS.md).

Semantics follow torch.distributed: ``all_reduce`` works in place (or into ``out``), outputs of
``all_gather`` / ``reduce_scatter`` / ``all_to_all`` are flat concatenations in rank order.

``op="avg"``: floats divide the sum by the world size; integers take the floor of the mean,
``floor(sum / n)`` (``torch.div(..., rounding_mode="floor")``), so -3 over 2 ranks gives -2.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from nanoparallel import algorithms as algs
from nanoparallel import cost_model
from nanoparallel.algorithms.common import REDUCERS
from nanoparallel.errors import CommAbortedError, CommError, MismatchError
from nanoparallel.faults import DTYPES, REDUCE_OPS, Liveness, check_headers, header, store_barrier
from nanoparallel.transport.base import Recv, Send, Transport

TRANSPORTS = ("auto", "shm", "torch", "gloo", "cuda")  # "gloo" is another name for "torch"


def default_store(rank: int, world_size: int, timeout_s: float):
    """A TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's variables); rank 0 hosts it."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise ValueError(
            f"nanoparallel.init: no store given and {exc.args[0]} is not set; pass store=... or run under "
            "torchrun (which sets MASTER_ADDR and MASTER_PORT)"
        ) from None
    return dist.TCPStore(host, port, world_size, rank == 0, timedelta(seconds=timeout_s))


def init(
    rank: int,
    world_size: int,
    *,
    store=None,
    transport: str = "auto",
    timeout_s: float = 30.0,
    device: str | torch.device = "cpu",
    protocol: str = "simple",
    n_channels: int = 2,
    slot_bytes: int = 1 << 20,
    nslots: int = 4,
    check: bool = True,
    params: cost_model.Params | None = None,
    name: str = "default",
) -> Communicator:
    """Join a communicator of ``world_size`` ranks. Collective: every rank calls it.

    transport: "shm" (shared memory, one host), "torch" (torch.distributed send/recv, gloo on CPU),
    "cuda" (the GPU peer-memory backend in nanoparallel.cuda), or "auto" (cuda for a CUDA device,
    else shm when all ranks share a host, else torch). protocol: "simple" or "ll" (shm only).
    n_channels, slot_bytes, nslots: the pipelining (channels x slots of slot_bytes per peer).
    check: exchange headers before every collective (the mismatch check; costs one small
    message per peer). params: cost-model parameters for ``algorithm="auto"`` (default: rank 0's
    cached calibration for this transport, else built-in guesses).
    """
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"nanoparallel.init: world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"nanoparallel.init: rank must be in [0, {world_size}), got {rank!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"nanoparallel.init: transport must be one of {TRANSPORTS}, got {transport!r}")
    if timeout_s <= 0:
        raise ValueError(f"nanoparallel.init: timeout_s must be > 0, got {timeout_s}")
    device = torch.device(device)
    if transport == "gloo":
        transport = "torch"
    if store is None:
        store = default_store(rank, world_size, timeout_s)
    joined = store.add(f"nanoparallel/{name}/joined", 1)
    key = f"nanoparallel/{name}/{(joined - 1) // world_size}"
    requested = transport
    if transport == "auto":
        transport = "cuda" if device.type == "cuda" else "shm"
    if transport == "cuda":
        return Communicator(
            rank,
            world_size,
            None,
            None,
            key,
            timeout_s,
            check,
            cost_model.Params(),
            device,
            backend=_cuda_backend(rank, world_size, store, device, timeout_s),
        )
    if device.type != "cpu":
        raise ValueError(
            f"nanoparallel.init: transport {transport!r} works on CPU tensors; got device {device}"
        )
    liveness = Liveness(rank, world_size, store, f"{key}/live", timeout_s)
    if transport == "shm" and not liveness.same_host:
        if requested == "shm":
            raise ValueError(
                f"nanoparallel.init: transport 'shm' needs all ranks on one host; they are on {sorted(set(liveness.hosts))}"
            )
        transport = "torch"  # "auto" across hosts
    tp: Transport
    if transport == "shm":
        from nanoparallel.transport.shm import ShmTransport

        tp = ShmTransport(
            rank,
            world_size,
            store,
            f"{key}/shm",
            protocol=protocol,
            n_channels=n_channels,
            slot_bytes=slot_bytes,
            nslots=nslots,
            timeout_s=timeout_s,
            liveness=liveness,
        )
    else:
        tp = _torch_transport(rank, world_size, store, key, n_channels, slot_bytes, timeout_s, liveness)
    if params is None:
        if rank == 0:
            found = cost_model.load(tp.name)
            store.set(f"{key}/params", json.dumps(asdict(found) if found else None))
        raw = json.loads(store.get(f"{key}/params"))
        params = cost_model.Params(**raw) if raw else cost_model.Params()
    store_barrier(store, f"{key}/ready", rank, world_size, timeout_s)
    return Communicator(rank, world_size, tp, liveness, key, timeout_s, check, params, device)


def _torch_transport(rank, world_size, store, key, n_channels, chunk_bytes, timeout_s, liveness) -> Transport:
    from datetime import timedelta

    import torch.distributed as dist

    from nanoparallel.transport.torch_dist import TorchTransport

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"{key}/gloo", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        group = None
    else:
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"nanoparallel.init: torch.distributed has world size {dist.get_world_size()}, "
                f"expected {world_size}"
            )
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return TorchTransport(
        rank,
        world_size,
        group,
        n_channels=n_channels,
        chunk_bytes=chunk_bytes,
        timeout_s=timeout_s,
        liveness=liveness,
    )


def _cuda_backend(rank, world_size, store, device, timeout_s):
    try:
        from nanoparallel.cuda import CudaPeerBackend
    except ImportError as exc:
        raise RuntimeError(
            f"nanoparallel.init: transport 'cuda' needs nanoparallel.cuda, which failed to import: {exc}"
        ) from None
    if not torch.cuda.is_available():
        raise RuntimeError(
            "nanoparallel.init: transport 'cuda' needs a CUDA GPU; torch.cuda.is_available() is False"
        )
    return CudaPeerBackend(rank, world_size, store, device, timeout_s)


class Communicator:
    """A group of ``world_size`` ranks and the collectives between them. Build it with :func:`init`."""

    def __init__(
        self, rank, world_size, transport, liveness, key, timeout_s, check, params, device, backend=None
    ):
        self.rank, self.world_size, self.transport, self.liveness = rank, world_size, transport, liveness
        self.key, self.timeout_s, self.check, self.params, self.device = key, timeout_s, check, params, device
        self.backend = backend
        self.seq = 0
        self._p2p_seq = [0] * world_size
        self._closed: str | None = None
        self.last_algorithm: str | None = None

    # -- plumbing -----------------------------------------------------------------------------
    @property
    def algorithms(self) -> dict[str, tuple[str, ...]]:
        return self.backend.ALGORITHMS if self.backend is not None else algs.ALGORITHMS

    def _sharded(self, what: str, output: torch.Tensor, input: torch.Tensor, whole: str) -> None:
        """One dtype, and the tensor named ``whole`` world_size times the other's elements."""
        if input.dtype != output.dtype:
            raise ValueError(
                f"nanoparallel {what}: input dtype {input.dtype} differs from output dtype {output.dtype}"
            )
        big, small = (input, output) if whole == "input" else (output, input)
        part = "output" if whole == "input" else "input"
        if big.numel() != self.world_size * small.numel():
            raise ValueError(
                f"nanoparallel {what}: {whole} has {big.numel()} elements, expected world_size * "
                f"{part}.numel() = {self.world_size} * {small.numel()}"
            )

    def _tensor(self, t, name: str, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"nanoparallel {what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(
                f"nanoparallel {what}: {name} has dtype {t.dtype}; supported: "
                + ", ".join(str(d).replace("torch.", "") for d in DTYPES)
            )
        if not t.is_contiguous():
            raise ValueError(f"nanoparallel {what}: {name} must be contiguous (call .contiguous())")
        if self.backend is None and t.device.type != "cpu":
            raise ValueError(
                f"nanoparallel {what}: {name} is on {t.device}; this communicator's transport is CPU"
            )
        return t

    def _algorithm(self, collective: str, algorithm: str, nbytes: int) -> str:
        names = self.algorithms.get(collective, ())
        if algorithm == "auto":
            if self.backend is not None:
                return "auto"
            return cost_model.choose(collective, names, self.world_size, nbytes, self.params)
        if algorithm not in names:
            raise ValueError(
                f"nanoparallel {collective}: algorithm must be 'auto' or one of {names}, got {algorithm!r}"
            )
        return algorithm

    def _enter(self, what: str) -> None:
        if self._closed:
            raise CommAbortedError(
                f"nanoparallel rank {self.rank}: {what} on a communicator that is {self._closed}"
            )

    def _exchange(self, h: torch.Tensor, what: str) -> None:
        """Send our header to every peer, receive theirs, raise MismatchError on any difference."""
        self.seq += 1
        if self.backend is not None or not self.check or self.world_size == 1:
            return
        n = self.world_size
        table = torch.empty(n, h.numel(), dtype=torch.int64)
        table[self.rank] = h
        peers = [p for p in range(n) if p != self.rank]
        ops: list = [Send(p, h, (0,), label=f"{what} header") for p in peers]
        ops += [Recv(p, table[p], None, (0,), label=f"{what} header") for p in peers]
        self.transport.run(ops, f"{what} (header exchange, sequence {self.seq})")
        check_headers(table, self.rank, self.algorithms.get(what, ()))

    def _run(self, what: str, fn, make_header, validate) -> object:
        """Validate, exchange headers, run ``fn``; any failure aborts this communicator."""
        self._enter(what)
        try:
            validate()
        except (TypeError, ValueError) as exc:
            # still take part in the header exchange, so the other ranks fail fast too
            try:
                self._exchange(header(self.world_size, self.seq, "invalid arguments"), what)
            except CommError:
                pass
            self._abort(f"aborted after invalid arguments: {exc}", code=0)
            raise
        try:
            if self.backend is None:
                self._exchange(make_header(), what)
            return fn()
        except MismatchError as exc:
            self._abort(str(exc), code=0)  # every rank sees the mismatch itself: no need to signal
            raise
        except BaseException as exc:
            self._abort(f"aborted: {exc}", code=5)
            raise

    def _abort(self, reason: str, code: int) -> None:
        self._closed = reason
        if self.transport is not None:
            self.transport.aborted = self.transport.aborted or reason
            if code and self.liveness is not None:
                self.liveness.abort(code)

    def _finish_avg(self, t: torch.Tensor, op: str) -> None:
        if op != "avg":
            return
        if t.is_floating_point():
            t.div_(self.world_size)
        else:
            t.copy_(torch.div(t, self.world_size, rounding_mode="floor"))

    def _op(self, op: str, what: str) -> str:
        if op not in REDUCE_OPS:
            raise ValueError(f"nanoparallel {what}: op must be one of {REDUCE_OPS}, got {op!r}")
        return op

    def _alg_index(self, what: str, alg: str) -> int:
        names = self.algorithms.get(what, ())
        return names.index(alg) if alg in names else -1

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", out: torch.Tensor | None = None
    ):
        """Reduce ``tensor`` (any shape) over ranks; in place, or into ``out`` (same shape and dtype)."""
        what = "all_reduce"
        state = {}

        def validate():
            self._tensor(tensor, "tensor", what)
            self._op(op, what)
            if out is not None:
                self._tensor(out, "out", what)
                if out.shape != tensor.shape or out.dtype != tensor.dtype:
                    raise ValueError(
                        f"nanoparallel all_reduce: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                        f"expected {tuple(tensor.shape)} and {tensor.dtype} like tensor"
                    )
            state["alg"] = self._algorithm(what, algorithm, tensor.numel() * tensor.element_size())

        def run():
            target = tensor if out is None else out
            if out is not None:
                out.copy_(tensor)
            self.last_algorithm = state["alg"]
            if self.backend is not None:
                self.backend.all_reduce(target, op, state["alg"])
                return target
            if self.world_size > 1 and target.numel():
                algs.ALL_REDUCE[state["alg"]](self.transport, target.view(-1), REDUCERS[op])
            self._finish_avg(target, op)
            return target

        return self._run(what, run, self._hdr(what, tensor, op, -1, state), validate)

    def _hdr(self, what, t, op, root, state):
        """A function building the header once validate() has resolved the algorithm."""
        return lambda: header(
            self.world_size,
            self.seq,
            what,
            t.numel(),
            t.dtype,
            op,
            root,
            self._alg_index(what, state.get("alg", "")),
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", algorithm: str = "auto"
    ):
        """``input`` [n * m] (any shape with that many elements) -> ``output`` [m]: block ``rank`` reduced."""
        what = "reduce_scatter"
        state = {}

        def validate():
            self._tensor(output, "output", what)
            self._tensor(input, "input", what)
            self._op(op, what)
            self._sharded(what, output, input, "input")
            state["alg"] = self._algorithm(what, algorithm, input.numel() * input.element_size())

        def run():
            self.last_algorithm = state["alg"]
            if self.backend is not None:
                self.backend.reduce_scatter(output, input, op, state["alg"])
                return output
            if self.world_size == 1 or output.numel() == 0:
                output.view(-1).copy_(input.view(-1))
            else:
                algs.REDUCE_SCATTER[state["alg"]](
                    self.transport, output.view(-1), input.view(-1), REDUCERS[op]
                )
            self._finish_avg(output, op)
            return output

        return self._run(what, run, self._hdr(what, input, op, -1, state), validate)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto"):
        """``input`` [m] from every rank -> ``output`` [n * m], rank r's block at r * m."""
        what = "all_gather"
        state = {}

        def validate():
            self._tensor(output, "output", what)
            self._tensor(input, "input", what)
            self._sharded(what, output, input, "output")
            state["alg"] = self._algorithm(what, algorithm, output.numel() * output.element_size())

        def run():
            self.last_algorithm = state["alg"]
            if self.backend is not None:
                self.backend.all_gather(output, input, state["alg"])
                return output
            if self.world_size == 1 or input.numel() == 0:
                output.view(-1).copy_(input.view(-1))
            else:
                algs.ALL_GATHER[state["alg"]](self.transport, output.view(-1), input.view(-1))
            return output

        return self._run(what, run, self._hdr(what, input, None, -1, state), validate)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto"):
        """Copy ``tensor`` of rank ``root`` into ``tensor`` on every rank."""
        what = "broadcast"
        state = {}

        def validate():
            self._tensor(tensor, "tensor", what)
            self._root(root, what)
            state["alg"] = self._algorithm(what, algorithm, tensor.numel() * tensor.element_size())

        def run():
            self.last_algorithm = state["alg"]
            if self.backend is not None:
                self.backend.broadcast(tensor, root, state["alg"])
            elif self.world_size > 1 and tensor.numel():
                algs.BROADCAST[state["alg"]](self.transport, tensor.view(-1), root)
            return tensor

        return self._run(what, run, self._hdr(what, tensor, None, root, state), validate)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum"):
        """Reduce into ``tensor`` on ``root`` (binomial tree); other ranks' tensors are left unchanged."""
        what = "reduce"
        state = {}

        def validate():
            self._tensor(tensor, "tensor", what)
            self._root(root, what)
            self._op(op, what)
            if self.backend is not None:
                raise ValueError("nanoparallel reduce: the cuda backend has no reduce; use all_reduce")
            state["alg"] = "tree"

        def run():
            self.last_algorithm = "tree"
            if self.world_size > 1 and tensor.numel():
                if self.rank == root:
                    work = tensor.view(-1)
                else:
                    work = self.transport.scratch("reduce", tensor.numel(), tensor.dtype)
                    work.copy_(tensor.view(-1))
                algs.reduce_tree(self.transport, work, root, REDUCERS[op])
            if self.rank == root:
                self._finish_avg(tensor, op)
            return tensor

        return self._run(what, run, self._hdr(what, tensor, op, root, state), validate)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits=None, input_splits=None):
        """Like torch.distributed.all_to_all_single: rows (dim 0) of ``input`` go to the ranks in
        ``input_splits`` counts (equal if None); ``output`` receives ``output_splits[p]`` rows from p."""
        what = "all_to_all"
        state = {}
        n = self.world_size

        def splits(t, s, name):
            if t.dim() == 0:
                raise ValueError(f"nanoparallel all_to_all: {name} must have at least one dimension")
            rows = t.shape[0]
            if s is None:
                if rows % n:
                    raise ValueError(
                        f"nanoparallel all_to_all: {name} has {rows} rows, not divisible by world size {n}; "
                        f"pass {name.split('put')[0]}put_splits"
                    )
                s = [rows // n] * n
            s = [int(v) for v in s]
            if len(s) != n or any(v < 0 for v in s) or sum(s) != rows:
                raise ValueError(
                    f"nanoparallel all_to_all: {name}_splits={s} must be {n} non-negative counts summing to "
                    f"{name}.shape[0] = {rows}"
                )
            return s

        def validate():
            self._tensor(output, "output", what)
            self._tensor(input, "input", what)
            if input.dtype != output.dtype:
                raise ValueError(
                    f"nanoparallel all_to_all: input dtype {input.dtype} differs from output dtype {output.dtype}"
                )
            if input.shape[1:] != output.shape[1:]:
                raise ValueError(
                    f"nanoparallel all_to_all: row shapes differ: input {tuple(input.shape[1:])}, "
                    f"output {tuple(output.shape[1:])}"
                )
            row = 1
            for d in input.shape[1:]:
                row *= d
            state["row"] = row
            state["in"] = splits(input, input_splits, "input")
            state["out"] = splits(output, output_splits, "output")
            state["alg"] = "direct"

        def run():
            self.last_algorithm = "direct"
            if self.backend is not None:
                self.backend.all_to_all(output, input, output_splits, input_splits)
                return output

            def bounds(s):
                out, start = [], 0
                for v in s:
                    out.append((start * state["row"], (start + v) * state["row"]))
                    start += v
                return out

            algs.all_to_all_direct(
                self.transport, output.view(-1), input.view(-1), bounds(state["out"]), bounds(state["in"])
            )
            return output

        def hdr():
            return header(
                n,
                self.seq,
                what,
                0,
                input.dtype,
                None,
                -1,
                0,
                [v * state["row"] for v in state["in"]],
                [v * state["row"] for v in state["out"]],
            )

        return self._run(what, run, hdr, validate)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (the header exchange is the barrier)."""
        self._enter("barrier")
        if self.backend is not None:
            return self.backend.barrier()
        try:
            self._exchange(header(self.world_size, self.seq, "barrier"), "barrier")
        except MismatchError as exc:
            self._abort(str(exc), code=0)
            raise
        except BaseException as exc:
            self._abort(f"aborted: {exc}", code=5)
            raise

    def _root(self, root, what):
        if not (isinstance(root, int) and 0 <= root < self.world_size):
            raise ValueError(
                f"nanoparallel {what}: root must be a rank in [0, {self.world_size}), got {root!r}"
            )

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``, which must call ``recv`` with the same numel and dtype.

        A mismatch is detected by the receiver (MismatchError); the sender returns if the data fit
        in the buffer slots, else times out."""
        self._enter("send")
        self._tensor(tensor, "tensor", "send")
        self._peer(dst, "send", "dst")
        self._p2p_seq[dst] += 1
        h = header(self.world_size, self._p2p_seq[dst], "send", tensor.numel(), tensor.dtype)
        ch = tuple(range(self.transport.n_channels))
        try:
            self.transport.run(
                [Send(dst, h, (0,), label="send header"), Send(dst, tensor.view(-1), ch, label="send")],
                f"send to rank {dst}",
            )
        except BaseException as exc:
            self._abort(f"aborted: {exc}", code=5)
            raise

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` from rank ``src``."""
        self._enter("recv")
        self._tensor(tensor, "tensor", "recv")
        self._peer(src, "recv", "src")
        self._p2p_seq[src] += 1
        mine = header(self.world_size, self._p2p_seq[src], "send", tensor.numel(), tensor.dtype)
        theirs = torch.empty_like(mine)
        ch = tuple(range(self.transport.n_channels))
        try:
            self.transport.run([Recv(src, theirs, None, (0,), label="recv header")], f"recv from rank {src}")
            check_headers(torch.stack([theirs, mine]), self.rank)
            self.transport.run([Recv(src, tensor.view(-1), None, ch, label="recv")], f"recv from rank {src}")
        except MismatchError as exc:
            raise MismatchError(
                f"nanoparallel rank {self.rank}: recv from rank {src} does not match its send "
                f"(row 0 = sender, row 1 = us): {exc}"
            ) from None
        except BaseException as exc:
            self._abort(f"aborted: {exc}", code=5)
            raise
        return tensor

    def _peer(self, p, what, name):
        if not (isinstance(p, int) and 0 <= p < self.world_size and p != self.rank):
            raise ValueError(
                f"nanoparallel {what}: {name} must be another rank in [0, {self.world_size}), got {p!r}"
            )
        if self.backend is not None:
            raise ValueError(f"nanoparallel {what}: the cuda backend has no point-to-point operations")

    def close(self) -> None:
        """Release shared memory and threads. Peers still waiting on this rank will time out."""
        if self._closed == "closed":
            return
        self._closed = "closed"
        if self.backend is not None:
            self.backend.close()
            return
        if self.liveness is not None:
            self.liveness.abort(4)
        self.transport.close()
        if self.liveness is not None:
            self.liveness.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
