"""The alpha-beta(-gamma) cost model that ``algorithm="auto"`` uses, and its calibration.

A message of N bytes between two ranks costs ``alpha + N * beta`` (alpha: per-message overhead,
here mostly the Python progress engine and the flag round trip; beta: seconds per byte through the
transport). Reducing N bytes locally costs ``N * gamma``. Every call also pays a fixed ``delta``
(argument checks, the header exchange, setting up the engine), measured as the time of an empty
all-reduce.

The bandwidth term counts the bytes the busiest rank sends (S) and receives (R):
``(S + w R) beta``. On a network link sending and receiving overlap (full duplex, ``w = 0``);
over shared memory a rank does its own copies, into the peer's slots when it sends and out of its
own slots when it receives, so both cost its CPU time (``w = 1``). With n ranks, N buffer bytes,
p the largest power of two <= n and d the binary-tree depth:

===============  =========================  ===================================  =================
collective       algorithm                  latency                              S, R per rank
===============  =========================  ===================================  =================
all-reduce       ring                       2(n-1) alpha                         2(n-1)/n N each
all-reduce       tree (double binary)       2 d alpha                            from the trees:
                                                                                 N/2 per edge
all-reduce       rhd                        2 log2(p) alpha (+2 alpha if n != p) 2(p-1)/p N (+N)
all-reduce       one_shot                   (n-1) alpha                          (n-1) N each
all-reduce       two_shot                   2(n-1) alpha                         2(n-1)/n N each
reduce-scatter   ring, direct               (n-1) alpha                          (n-1)/n N each
all-gather       ring, direct               (n-1) alpha                          (n-1)/n N each
broadcast        ring                       (n-1) alpha                          N each (a relay)
broadcast        tree (binomial)            ceil(log2 n) alpha                   S = children * N
broadcast        direct                     (n-1) alpha                          S = (n-1) N
reduce           tree (binomial)            ceil(log2 n) alpha                   R = children * N
all-to-all       direct                     (n-1) alpha                          (n-1)/n N each
===============  =========================  ===================================  =================

plus ``N_reduced * gamma`` for the reducing collectives ((n-1)/n N for ring / rhd / two-shot, the
busiest rank's received bytes for trees, (n-1) N for one-shot). The direct algorithms count alpha
per peer because the engine serves their messages one after the other. Pipelining is assumed
perfect (no fill term), and all ranks' copies are assumed not to slow each other down, which
is false on a memory-bound machine (over shared memory, when ranks outnumber cores, the time is
scaled by n / cores since the ranks' copies then take turns on the cores); the benchmark prints every prediction next to its
measurement so the reader can see where the model fails.

Calibration (:func:`calibrate`) runs a ping-pong between ranks 0 and 1 over the transport (sizes
up to 32 MiB, so beta sees DRAM and not only cache), fits alpha and beta by least squares, times
``add_`` for gamma and an empty all-reduce for delta. The result is cached as JSON (default
``~/.cache/nanoparallel/calibration.json``, keyed by transport); ``init`` uses rank 0's copy.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_CACHE = (
    Path(os.environ.get("NANOPARALLEL_CACHE", Path.home() / ".cache" / "nanoparallel")) / "calibration.json"
)


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``busbw = algbw * bus_factor``, the one definition that
    ``nanoparallel.bench``, ``nanoparallel.cuda.sweep`` and ``nanoparallel.cuda.lab.diagnose`` use.

    It turns a collective's algorithm bandwidth (bytes per rank over time) into what the busiest
    link carries under the optimal algorithm, so that one number is comparable with a link's
    bandwidth whatever the rank count: 2(n-1)/n for all-reduce (a reduce-scatter and an all-gather),
    (n-1)/n for all-gather, reduce-scatter and all-to-all (each rank receives all but its own
    share), 1 for broadcast and reduce (every byte crosses one link once). ``bytes`` is the
    per-rank buffer, for all-gather the gathered output and for reduce-scatter the input.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"bus_factor: world_size must be >= 1, got {n}")
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    if collective not in factors:
        raise ValueError(f"bus_factor: collective must be one of {sorted(factors)}, got {collective!r}")
    return factors[collective]


@dataclass
class Params:
    """Seconds: alpha per message, beta per byte moved, gamma per byte reduced."""

    alpha: float = 20e-6
    beta: float = 1 / 4e9
    gamma: float = 1 / 8e9
    delta: float = 50e-6
    recv_weight: float = 1.0
    cores: int = 0  # cores the ranks share (0: unknown); see predict()
    source: str = "default guess (not calibrated)"


def _tree_load(n: int) -> tuple[float, float]:
    """Busiest rank's (sent, received) over both trees, in units of the buffer N."""
    from nanoparallel.algorithms.tree import double_binary_trees

    sent, recv = [0.0] * n, [0.0] * n
    for parent, children in double_binary_trees(n):
        for r in range(n):
            up = parent[r] is not None
            sent[r] += 0.5 * (up + len(children[r]))  # reduce to parent, broadcast to children
            recv[r] += 0.5 * (len(children[r]) + up)
    worst = max(range(n), key=lambda r: sent[r] + recv[r])
    return sent[worst], recv[worst]


def predict(collective: str, algorithm: str, n: int, nbytes: int, prm: Params, header: bool = True) -> float:
    """Predicted seconds for one collective of ``nbytes`` (per-rank buffer) on ``n`` ranks."""
    if n <= 1:
        return prm.delta if header else 0.0
    N = float(nbytes)
    p = 1 << (n.bit_length() - 1)
    lg = math.ceil(math.log2(n))
    f = (n - 1) / n
    fp = (p - 1) / p
    fold = n != p
    if (collective, algorithm) == ("all_reduce", "tree"):
        from nanoparallel.algorithms.tree import double_binary_trees, tree_depth

        d = max(tree_depth(t[0]) for t in double_binary_trees(n))
        ts, tr = _tree_load(n)
    # (latency in alphas, sent / N, received / N, reduced / N)
    table = {
        ("all_reduce", "ring"): (2 * (n - 1), 2 * f, 2 * f, f),
        ("all_reduce", "rhd"): (2 * math.log2(p) + 2 * fold, 2 * fp + fold, 2 * fp + fold, fp + fold),
        ("all_reduce", "one_shot"): (n - 1, n - 1, n - 1, n - 1),
        ("all_reduce", "two_shot"): (2 * (n - 1), 2 * f, 2 * f, f),
        ("reduce_scatter", "ring"): (n - 1, f, f, f),
        ("reduce_scatter", "direct"): (n - 1, f, f, f),
        ("all_gather", "ring"): (n - 1, f, f, 0),
        ("all_gather", "direct"): (n - 1, f, f, 0),
        ("broadcast", "ring"): (n - 1, 1, 1, 0),
        ("broadcast", "tree"): (lg, lg, 1, 0),
        ("broadcast", "direct"): (n - 1, n - 1, 0, 0),
        ("reduce", "tree"): (lg, 1, lg, lg),
        ("all_to_all", "direct"): (n - 1, f, f, 0),
    }
    if (collective, algorithm) == ("all_reduce", "tree"):
        table[("all_reduce", "tree")] = (2 * d, ts, tr, tr / 2)
    key = (collective, algorithm)
    if key not in table:
        raise ValueError(f"predict: no formula for collective {collective!r} with algorithm {algorithm!r}")
    lat, s, r, red = table[key]
    t = lat * prm.alpha + (s + prm.recv_weight * r) * N * prm.beta + red * N * prm.gamma
    if prm.recv_weight and prm.cores and n > prm.cores:
        t *= n / prm.cores  # shared memory is CPU-bound: more ranks than cores time-share them
    return t + (prm.delta if header else 0.0)


def choose(collective: str, algorithms: tuple[str, ...], n: int, nbytes: int, prm: Params) -> str:
    """The algorithm with the smallest predicted time (ties: the first listed)."""
    return min(algorithms, key=lambda alg: predict(collective, alg, n, nbytes, prm))


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares for t = alpha + beta * size, with relative weights (each point counts alike)."""
    w = [1.0 / max(t, 1e-9) for t in seconds]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, x in zip(w, sizes, strict=True))
    sy = sum(wi * wi * y for wi, y in zip(w, seconds, strict=True))
    sxx = sum(wi * wi * x * x for wi, x in zip(w, sizes, strict=True))
    sxy = sum(wi * wi * x * y for wi, x, y in zip(w, sizes, seconds, strict=True))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    if beta <= 0:  # noise beat the signal: fall back to the slope between the two largest sizes
        (x0, y0), (x1, y1) = sorted(zip(sizes, seconds, strict=True))[-2:]
        beta = max((y1 - y0) / max(x1 - x0, 1), 1e-13)
    return max(alpha, 1e-7), beta


def calibrate(
    comm, sizes: tuple[int, ...] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 25), reps: int = 9
) -> Params:
    """Measure alpha, beta (ping-pong rank 0 <-> 1 through ``comm``'s transport), gamma (local
    ``add_``) and delta (an empty all-reduce). Each time is the minimum over ``reps``: other jobs
    on the machine only ever add time.

    Collective: every rank of ``comm`` must call it. Ranks other than 0 and 1 only wait.
    """
    from nanoparallel.transport.base import Recv, Send

    tp = comm.transport
    ch = tuple(range(tp.n_channels))
    times: list[float] = []
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)
        comm.barrier()
        samples = []
        if comm.rank in (0, 1) and comm.world_size > 1:
            peer = 1 - comm.rank
            for i in range(reps + 2):
                t0 = time.perf_counter()
                if comm.rank == 0:
                    tp.run([Send(peer, buf, ch)], "calibrate")
                    tp.run([Recv(peer, buf, None, ch)], "calibrate")
                else:
                    tp.run([Recv(peer, buf, None, ch)], "calibrate")
                    tp.run([Send(peer, buf, ch)], "calibrate")
                if i >= 2:
                    samples.append((time.perf_counter() - t0) / 2)
        times.append(min(samples) if samples else 0.0)
    x = torch.ones(1 << 22, dtype=torch.float32)
    y = torch.ones_like(x)
    adds = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.add_(y)
        adds.append(time.perf_counter() - t0)
    gamma = min(adds) / (x.numel() * 4)
    empty = torch.empty(0)
    calls = []
    for _ in range(20):
        t0 = time.perf_counter()
        comm.all_reduce(empty, algorithm="ring")
        calls.append(time.perf_counter() - t0)
    stats = torch.tensor([*times, gamma, min(calls)], dtype=torch.float64)
    comm.broadcast(stats, root=0)  # everyone adopts rank 0's numbers, so "auto" picks alike
    if comm.world_size > 1:
        alpha, beta = fit_alpha_beta(list(sizes), stats[:-2].tolist())
    else:
        alpha, beta = 1e-7, 1e-13
    return Params(
        alpha=alpha,
        beta=beta,
        gamma=float(stats[-2]),
        delta=float(stats[-1]),
        recv_weight=1.0 if tp.name.startswith("shm") else 0.0,
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0),
        source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} on {comm.world_size} ranks",
    )


def load(key: str, path: Path = DEFAULT_CACHE) -> Params | None:
    try:
        data = json.loads(Path(path).read_text())
        return Params(**data[key])
    except (FileNotFoundError, KeyError, json.JSONDecodeError, TypeError):
        return None


def save(key: str, prm: Params, path: Path = DEFAULT_CACHE) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        data = {}
    data[key] = asdict(prm)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
