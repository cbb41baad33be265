"""The alpha-beta(-gamma) cost model that ``algorithm="auto"`` uses, and its calibration.

A message of N bytes between two ranks costs ``alpha + N * beta`` (alpha: per-message overhead,
here mostly the Python progress engine and the flag round trip; beta: seconds per byte copied
through the transport). Reducing N bytes locally costs ``N * gamma``. With n ranks, N the buffer
bytes, p the largest power of two <= n, d = ceil(log2(n + 1)) - 1 the depth of the binary tree:

=============  =====================================================================================
all-reduce
ring           2(n-1) alpha + 2(n-1)/n N beta + (n-1)/n N gamma
tree           2 d alpha + 2 N beta + N gamma   (two trees of N/2; an interior node moves 3N/2, a
               leaf N/2, so a rank moves about 2N over both trees; pipelined, so depth costs alpha)
rhd            2 log2(p) alpha + 2(p-1)/p N beta + (p-1)/p N gamma  [+ 2 alpha + 2 N beta + N gamma
               when n != p: the fold and unfold]
one_shot       (n-1) alpha + (n-1) N beta + (n-1) N gamma
two_shot       2(n-1) alpha + 2(n-1)/n N beta + (n-1)/n N gamma
reduce-scatter ring and direct: (n-1) alpha + (n-1)/n N beta + (n-1)/n N gamma (N = input bytes)
all-gather     ring and direct: (n-1) alpha + (n-1)/n N beta (N = output bytes)
broadcast      ring (n-1) alpha + N beta; tree ceil(log2 n) alpha + ceil(log2 n) N beta at the
               root (pipelined, the root sends to each child); direct (n-1) alpha + (n-1) N beta
all-to-all     (n-1) alpha + (n-1)/n N beta
=============  =====================================================================================

On shared memory all ranks' copies go through the same memory system, so a "link" is not
independent: the model is deliberately simple and the benchmark prints its prediction beside the
measurement so the reader can see where it fails. Every collective also pays the header check,
(n-1) alpha, added to every prediction. The direct algorithms count alpha per peer because the
engine serves their messages one after the other.

Calibration (:func:`calibrate`) runs a ping-pong between ranks 0 and 1 over the transport and
fits alpha and beta by least squares; gamma comes from timing ``add_`` locally. The result is
cached as JSON (default ``~/.cache/nanoparallel/calibration.json``, keyed by transport).
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


@dataclass
class Params:
    """Seconds: alpha per message, beta per byte moved, gamma per byte reduced."""

    alpha: float = 20e-6
    beta: float = 1 / 4e9
    gamma: float = 1 / 8e9
    source: str = "default guess (not calibrated)"


def predict(collective: str, algorithm: str, n: int, nbytes: int, prm: Params, header: bool = True) -> float:
    """Predicted seconds for one collective of ``nbytes`` (per-rank buffer) on ``n`` ranks."""
    a, b, g, N = prm.alpha, prm.beta, prm.gamma, float(nbytes)
    if n <= 1:
        return 0.0
    hdr = (n - 1) * a if header else 0.0
    p = 1 << (n.bit_length() - 1)
    lg = math.ceil(math.log2(n))
    d = max(math.ceil(math.log2(n + 1)) - 1, 1)
    f = (n - 1) / n
    table = {
        ("all_reduce", "ring"): 2 * (n - 1) * a + 2 * f * N * b + f * N * g,
        ("all_reduce", "tree"): 2 * d * a + 2 * N * b + N * g,
        ("all_reduce", "rhd"): 2 * math.log2(p) * a
        + 2 * (p - 1) / p * N * b
        + (p - 1) / p * N * g
        + ((2 * a + 2 * N * b + N * g) if n != p else 0.0),
        ("all_reduce", "one_shot"): (n - 1) * (a + N * b + N * g),
        ("all_reduce", "two_shot"): 2 * (n - 1) * a + 2 * f * N * b + f * N * g,
        ("reduce_scatter", "ring"): (n - 1) * a + f * N * (b + g),
        ("reduce_scatter", "direct"): (n - 1) * a + f * N * (b + g),
        ("all_gather", "ring"): (n - 1) * a + f * N * b,
        ("all_gather", "direct"): (n - 1) * a + f * N * b,
        ("broadcast", "ring"): (n - 1) * a + N * b,
        ("broadcast", "tree"): lg * a + lg * N * b,
        ("broadcast", "direct"): (n - 1) * (a + N * b),
        ("reduce", "tree"): lg * a + lg * N * (b + g),
        ("all_to_all", "direct"): (n - 1) * a + f * N * b,
    }
    key = (collective, algorithm)
    if key not in table:
        raise ValueError(f"predict: no formula for collective {collective!r} with algorithm {algorithm!r}")
    return table[key] + hdr


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
    return max(alpha, 1e-7), max(beta, 1e-13)


def calibrate(
    comm, sizes: tuple[int, ...] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22), reps: int = 10
) -> Params:
    """Measure alpha, beta (ping-pong rank 0 <-> 1 through ``comm``'s transport) and gamma.

    Collective: every rank of ``comm`` must call it. Ranks other than 0 and 1 only wait.
    """
    from nanoparallel.transport.base import Recv, Send

    tp = comm.transport
    times: list[float] = []
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)
        comm.barrier()
        t = 0.0
        if comm.rank in (0, 1) and comm.world_size > 1:
            peer = 1 - comm.rank
            for i in range(reps + 2):
                t0 = time.perf_counter()
                if comm.rank == 0:
                    tp.run([Send(peer, buf, tuple(range(tp.n_channels)))], "calibrate")
                    tp.run([Recv(peer, buf, None, tuple(range(tp.n_channels)))], "calibrate")
                else:
                    tp.run([Recv(peer, buf, None, tuple(range(tp.n_channels)))], "calibrate")
                    tp.run([Send(peer, buf, tuple(range(tp.n_channels)))], "calibrate")
                if i >= 2:
                    t += (time.perf_counter() - t0) / 2
        times.append(t / reps)
    x = torch.ones(1 << 22, dtype=torch.float32)
    y = torch.ones_like(x)
    t0 = time.perf_counter()
    for _ in range(5):
        x.add_(y)
    gamma = (time.perf_counter() - t0) / 5 / x.numel() / 4
    stats = torch.tensor([*times, gamma], dtype=torch.float64)
    comm.broadcast(stats, root=0)  # everyone adopts rank 0's numbers, so "auto" picks alike
    alpha, beta = fit_alpha_beta(list(sizes), stats[:-1].tolist()) if comm.world_size > 1 else (1e-7, 1e-13)
    return Params(
        alpha=alpha, beta=beta, gamma=float(stats[-1]), source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')}"
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
