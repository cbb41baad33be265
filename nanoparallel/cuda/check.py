"""Correctness check of every GPU collective and algorithm, run by every rank at once.

Every rank can regenerate every other rank's input from the seed (rank r's input for case k is
drawn from ``seed + 1000 k + r``), so each rank computes the float64 reference for the whole group
locally and compares its own output with it: no second communication path is trusted. Used by the
GPU tests and by the sweep, so a benchmark run on a machine also proves the numbers are of correct
collectives.

Tolerances (relative Frobenius error against float64): float32 1e-6 per reduction step;
bf16 1e-2 and fp16 2e-3 per step (one rounding of a float32 sum); integers exact. The ring rounds
its partial sums once per step, so its tolerance is multiplied by the number of ranks.
"""

from __future__ import annotations

import itertools

import torch

from nanoparallel.cuda import ALGORITHMS

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SIZES = (0, 1, 2, 3, 31, 1021, 4099, 65537, (1 << 20) + 7)
BIG_DTYPES = (torch.float32, torch.bfloat16)  # the largest size only for these, to keep it quick
# every op on one float and one integer type; the others with the ops whose rounding differs
OPS = {
    torch.float32: ("sum", "max", "min", "avg"),
    torch.bfloat16: ("sum", "avg"),
    torch.float16: ("sum", "max"),
    torch.int32: ("sum", "max", "min", "avg"),
    torch.int64: ("sum",),
}


def draw(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    s = torch.stack([x.to(torch.float64) for x in xs])
    if op == "sum":
        return s.sum(0)
    if op == "avg":
        # integers: floor of the mean, like torch.div(..., rounding_mode="floor")
        return s.mean(0) if xs[0].dtype.is_floating_point else torch.floor(s.sum(0) / len(xs))
    return s.max(0).values if op == "max" else s.min(0).values


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, steps: int) -> str | None:
    out = out.detach().cpu().to(torch.float64)
    if not dtype.is_floating_point:
        return None if torch.equal(out, ref) else "integer result differs from the exact reference"
    if not torch.isfinite(out).all():
        return "non-finite values in the output (unwritten or poisoned elements)"
    denom = ref.norm().item()
    err = (out - ref).norm().item() / (denom if denom else 1.0)
    tol = TOL[dtype] * steps
    return None if err <= tol else f"relative error {err:.3e} > {tol:.1e}"


def poison(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer full of a value no correct result has: NaN, or a huge integer."""
    if dtype.is_floating_point:
        return torch.full((n,), float("nan"), dtype=dtype, device=device)
    return torch.full((n,), torch.iinfo(dtype).max, dtype=dtype, device=device)


def check_all(backend, seed: int = 0, sizes=SIZES, dtypes=DTYPES) -> tuple[int, list[str]]:
    """Run every collective x algorithm x dtype x size on ``backend``; return (cases, failures)."""
    rank, W, dev = backend.rank, backend.world_size, backend.device
    failures: list[str] = []
    cases = 0
    k = 0

    def inputs(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [draw(n, dtype, seed + 1000 * k + r) for r in range(W)]

    def report(what: str, problem: str | None) -> None:
        nonlocal cases
        cases += 1
        if problem:
            failures.append(f"rank {rank}: {what}: {problem}")

    for n, dtype in itertools.product(sizes, dtypes):
        if n > 100_000 and dtype not in BIG_DTYPES:
            continue
        ops = OPS[dtype]
        for algo, op in itertools.product(ALGORITHMS["all_reduce"] + ("auto",), ops):
            k += 1
            xs = inputs(n, dtype)
            t = xs[rank].to(dev)
            backend.all_reduce(t, op=op, algorithm=algo)
            report(
                f"all_reduce {algo} {op} {dtype} n={n}",
                _close(t, reduce_ref(xs, op), dtype, W if algo == "ring" else 1),
            )
        for algo, op in itertools.product(ALGORITHMS["reduce_scatter"] + ("auto",), ops):
            k += 1
            xs = inputs(W * n, dtype)
            out = poison(n, dtype, dev)
            backend.reduce_scatter(out, xs[rank].to(dev), op=op, algorithm=algo)
            ref = reduce_ref(xs, op)[rank * n : (rank + 1) * n]
            report(
                f"reduce_scatter {algo} {op} {dtype} m={n}",
                _close(out, ref, dtype, W if algo == "ring" else 1),
            )
        for algo in ALGORITHMS["all_gather"] + ("auto",):
            k += 1
            xs = inputs(n, dtype)
            out = poison(W * n, dtype, dev)
            backend.all_gather(out, xs[rank].to(dev), algorithm=algo)
            ok = torch.equal(out.cpu(), torch.cat(xs))
            report(
                f"all_gather {algo} {dtype} m={n}", None if ok else "output is not the inputs in rank order"
            )
        for algo, root in itertools.product(ALGORITHMS["broadcast"] + ("auto",), range(W)):
            k += 1
            xs = inputs(n, dtype)
            t = xs[rank].to(dev)
            backend.broadcast(t, root=root, algorithm=algo)
            ok = torch.equal(t.cpu(), xs[root])
            report(
                f"broadcast {algo} root={root} {dtype} n={n}",
                None if ok else "differs from the root's tensor",
            )
        # uneven all-to-all: counts[s][d] elements from s to d, drawn from the seed on every rank
        k += 1
        g = torch.Generator().manual_seed(seed + 1000 * k)
        counts = torch.randint(0, max(n, 1) + 1, (W, W), generator=g).tolist()
        if n == 0:
            counts = [[0] * W for _ in range(W)]
        xs = [draw(sum(counts[s]), dtype, seed + 1000 * k + s) for s in range(W)]
        recv = [counts[s][rank] for s in range(W)]
        expected = torch.cat([xs[s][sum(counts[s][:rank]) : sum(counts[s][: rank + 1])] for s in range(W)])
        for algo in ALGORITHMS["all_to_all"] + ("auto",):
            out = poison(sum(recv), dtype, dev)
            backend.all_to_all(
                out, xs[rank].to(dev), output_splits=recv, input_splits=counts[rank], algorithm=algo
            )
            ok = torch.equal(out.cpu(), expected)
            report(f"all_to_all {algo} {dtype} counts={counts}", None if ok else "received the wrong data")
    backend.barrier()
    return cases, failures
