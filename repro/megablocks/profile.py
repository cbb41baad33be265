"""Per-kernel GPU time of one forward + backward of each dMoE implementation (balanced routing).

``python -m repro.megablocks.profile [8e-top2] [64e-top8]`` on a GPU: for ours (grouped, sparse),
the ``torch._grouped_mm`` path and megablocks' dMoE (when it imports), three warm-up iterations,
then ``torch.profiler`` over three more; prints each implementation's GPU time per iteration and its
14 most expensive kernels (time per iteration, launches per iteration). The benchmark's shapes,
weights and routing (``bench.SHAPES``, ``bench.make_routing``); nothing is checked here, the
benchmark checks every candidate before it times it. What it showed is on the paper page.
"""

from __future__ import annotations

import math
import sys

import torch

from paperclub.bench import fwd_bwd, kernel_times
from repro.megablocks import bench
from repro.megablocks.moe import dmoe_grouped, dmoe_sparse


def _inputs(shape: str):
    dims = bench.SHAPES[shape]
    E, k, d, f, T = (dims[c] for c in ("E", "k", "d", "f", "T"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, d, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    w1, w2, w3 = (
        (torch.randn(E * f, d, device="cuda", generator=gen) / math.sqrt(d)).bfloat16().requires_grad_(True)
        for _ in range(3)
    )
    weights, indices = bench.make_routing(T, E, k, "balanced", "cuda")
    weights = weights.bfloat16().requires_grad_(True)
    grad_out = torch.randn(T, d, device="cuda", generator=gen).bfloat16()
    return (E, k, d, f), x, (w1, w2, w3), weights, indices, grad_out


def profile_shape(shape: str, iters: int = 3, top: int = 14) -> None:
    (E, k, d, f), x, (w1, w2, w3), weights, indices, grad_out = _inputs(shape)
    leaves = [x, weights, w1, w2, w3]
    impls = {
        "ours_grouped": (lambda: dmoe_grouped(x, weights, indices, w1, w2, w3, E, "glu"), leaves),
        "ours_sparse": (lambda: dmoe_sparse(x, weights, indices, w1, w2, w3, E, "glu", 128), leaves),
        "torch_grouped_mm": (lambda: bench.grouped_mm_moe(x, weights, indices, w1, w2, w3, E, "glu"), leaves),
    }
    mb, why = bench.load_megablocks()
    if mb is not None:
        fn, params = bench.megablocks_experts(mb, E, k, d, f, w1.detach(), w2.detach(), w3.detach())
        impls["megablocks"] = (lambda: fn(x, weights, indices), [x, weights, *params])
    else:
        print(f"{shape}: megablocks not profiled: {why}")
    for name, (forward, params) in impls.items():
        rows = kernel_times(fwd_bwd(forward, params, grad_out), reps=iters, warmup=iters)
        print(f"\n=== {shape} {name}: {sum(ms for _, ms, _ in rows):.2f} ms GPU per iteration")
        for kernel, ms, launches in rows[:top]:
            print(f"  {ms:7.2f} ms  x{launches:<3} {kernel[:110]}")


def main(argv: list[str] | None = None) -> None:
    shapes = (argv if argv is not None else sys.argv[1:]) or list(bench.SHAPES)
    unknown = [s for s in shapes if s not in bench.SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}: expected some of {list(bench.SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("repro.megablocks.profile needs a CUDA GPU")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for shape in shapes:
        profile_shape(shape)


if __name__ == "__main__":
    main()
