"""Benchmark: the dMoE layer's forward + backward against torch._grouped_mm, the capacity-factor MoE
and the megablocks package, on one GPU.

``python -m repro.megablocks.bench [--quick] [--out DIR] [--budget-s SECONDS] [--tune-first]``

Shapes (bf16, SwiGLU experts, as the MoE models of these sizes use):

* ``64e-top8``: 64 experts, top-8, hidden 2048, ffn 1408 (DeepSeek-V2-Lite / Qwen-MoE-like), T = 16384;
* ``8e-top2``: 8 experts, top-2, hidden 4096, ffn 14336 (Mixtral-like), T = 8192.

Routings, fixed for every candidate (the router's matmul is the same for all and is left out):
``balanced`` (every expert gets exactly T k / E assignments) and ``skewed`` (each token draws its k
experts without replacement with probability proportional to 1 / (rank + 1)^SKEW).

Candidates, each timed as forward + backward (gradients of x, the router weights and every expert
weight, through ``torch.autograd.grad``), in interleaved rounds by ``paperclub.bench.measure`` after
a correctness check of its output against ``moe_per_expert`` in fp32 at that shape:

* ``ours_sparse``: :func:`repro.megablocks.dmoe_sparse` (SDD, DSD, DDS Triton kernels, block 128);
* ``ours_grouped``: :func:`repro.megablocks.dmoe_grouped` (our Triton grouped GEMM);
* ``torch_grouped_mm``: the same permutation and combine around ``torch._grouped_mm`` (the path
  torchtitan's MoE uses), each group padded to 16 rows for its alignment rule;
* ``capacity_1.0``, ``capacity_2.0``: the capacity-factor MoE (padded ``bmm``), which drops tokens:
  its check is against the reference on the kept assignments; ``drop_rate`` says how many it drops;
* ``megablocks_sparse``: megablocks' dMoE expert computation (``dMoE.experts``) with our routing and
  weights copied in, where ``peers_setup.sh`` managed to build it (a note says why not otherwise).

``pct_of_matmul`` is ``tflops`` over the measured bf16 matmul ceiling (8192^3, ``paperclub.bench.ceilings``,
also stored in the JSON). ``tflops`` counts the useful work of the routed assignments for every row (fwd + bwd = 3 x forward;
forward = 2 T k d f x 3 matmuls for SwiGLU), so a capacity row's padding or drops are not credited.

With budget left after the main table (before it with ``--tune-first``), rows under ``8e-top2
(tuning)`` and ``64e-top8 (tuning)`` time our two paths with other tile settings: see
``repro.megablocks.lab.tuning``.

``--kernels`` times the paper's per-kernel comparison instead (§6.3, Figure 9) and writes
``results/<device>-kernels.json``: our block-sparse SDD and DSD kernels against cuBLAS batched matmul
(``torch.bmm``) on the six products of an FFN layer's forward and backward (``KERNEL_PROBLEMS``), at
the problem sizes of MoE-XS, MoE-Small and MoE-Medium (``PAPER_KERNEL_SHAPES``), tokens spread
uniformly over the 64 experts as the paper does so that batched matmul can run them, fp16 (the paper's
mixed precision) and bf16; every candidate checked against an fp32 batched matmul at that problem
before it is timed (see :func:`kernel_problems`, :func:`kernels_main`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from paperclub.bench import (
    Budget,
    Candidate,
    Report,
    bench_parser,
    ceilings,
    fwd_bwd,
    measure,
    parse_bench_args,
    run_paced,
)
from paperclub.testing import assert_rel_close
from repro.megablocks.kernels import dsd, sdd
from repro.megablocks.moe import _combine, dmoe_grouped, dmoe_sparse
from repro.megablocks.peer import load_megablocks, megablocks_experts, probe_main, probe_megablocks
from repro.megablocks.reference import activation, capacity_moe, moe_per_expert
from repro.megablocks.shapes import (
    MLP,
    ROUTINGS,
    SHAPES,  # noqa: F401 (bench.SHAPES: profile.py, the tests)
    bench_shapes,
    make_routing,
)
from repro.megablocks.topology import moe_topology, permute

TOL_BF16 = 2e-2  # bf16 outputs vs the fp32 per-expert reference: 8 mantissa bits, fp32 accumulation
COLUMNS = [
    "shape", "routing", "impl", "config", "tokens", "max_load", "drop_rate",
    "ms", "ms_min", "ms_max", "check", "tokens_per_s", "tflops", "pct_of_matmul", "vs_grouped_mm",
]  # fmt: skip


def useful_flops(T: int, k: int, d: int, f: int, mlp: str = MLP) -> float:
    """Forward + backward FLOPs of the routed assignments (backward = 2 x forward)."""
    return 3 * (3 if mlp == "glu" else 2) * 2.0 * T * k * d * f


def grouped_mm_moe(x, weights, indices, w1, w2, w3, num_experts: int, mlp: str = MLP):
    """dMoE forward through ``torch._grouped_mm`` (differentiable): rows sorted by expert, each
    group padded to 16 rows, ``offs`` the groups' end rows (int32)."""
    E, d = num_experts, x.shape[1]
    f = w1.shape[0] // E
    with torch.no_grad():
        perm = permute(indices, E, 16)
        offs = torch.cumsum(perm.padded_counts, 0).to(torch.int32)
    xs = x.new_zeros(perm.padded_rows, d).index_put((perm.dest,), x[perm.token])
    h1 = torch._grouped_mm(xs, w1.view(E, f, d).transpose(1, 2), offs=offs)
    h3 = torch._grouped_mm(xs, w3.view(E, f, d).transpose(1, 2), offs=offs) if mlp == "glu" else None
    y = torch._grouped_mm(activation(h1, h3, mlp), w2.view(E, f, d), offs=offs)
    return _combine(y[perm.dest], perm, weights, x.shape[0])


def run_config(
    shape: str,
    dims: dict,
    routing: str,
    *,
    device: str = "cuda",
    dtype=torch.bfloat16,
    block_size: int = 128,
    rounds: int = 5,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    timer=None,
    notes: list | None = None,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    config: str = "default",
    base_ms: float | None = None,
) -> list[dict]:
    """Every candidate at one shape and routing; returns the Report rows.

    Timing: ``rounds`` interleaved rounds; in each, ``time_ms`` (triton's do_bench: ``warmup_ms`` and
    ``rep_ms`` are milliseconds of calls, the median call is kept) per candidate. ``only``: the
    candidates to build (default all); ``base_ms``: the torch_grouped_mm time for ``vs_grouped_mm``
    when that peer is not among them."""
    notes = notes if notes is not None else []
    E, k, d, f, T = (dims[c] for c in ("E", "k", "d", "f", "T"))
    gen = torch.Generator(device=device).manual_seed(1)
    x = (torch.randn(T, d, device=device, generator=gen)).to(dtype).requires_grad_(True)
    w1, w2, w3 = (
        (torch.randn(E * f, d, device=device, generator=gen) / math.sqrt(d)).to(dtype).requires_grad_(True)
        for _ in range(3)
    )
    weights, indices = make_routing(T, E, k, routing, device)
    weights = weights.to(dtype).requires_grad_(True)
    leaves = [x, weights, w1, w2, w3]
    grad_out = torch.randn(T, d, device=device, generator=gen).to(dtype)
    counts = torch.bincount(indices.reshape(-1), minlength=E)
    max_load = int(counts.max())
    with torch.no_grad():  # fp32 reference of the forward at this shape
        ref = moe_per_expert(
            *(t.detach().float() for t in (x, weights)), indices, w1.float(), w2.float(), w3.float(), E, MLP
        )

    def checked(fn, ref_out=ref):
        return lambda: assert_rel_close(fn(), ref_out, TOL_BF16 if dtype != torch.float32 else 1e-4, "output")

    want = lambda name: (only is None or name in only) and name not in skip
    cands: dict[str, Candidate] = {}
    extra: dict[str, dict] = {}
    sparse = lambda: dmoe_sparse(x, weights, indices, w1, w2, w3, E, MLP, block_size)
    grouped = lambda: dmoe_grouped(x, weights, indices, w1, w2, w3, E, MLP)
    cands["ours_sparse"] = Candidate(fwd_bwd(sparse, leaves, grad_out), checked(sparse))
    cands["ours_grouped"] = Candidate(fwd_bwd(grouped, leaves, grad_out), checked(grouped))
    if not want("torch_grouped_mm"):
        pass
    elif hasattr(torch, "_grouped_mm"):
        gmm_fn = lambda: grouped_mm_moe(x, weights, indices, w1, w2, w3, E, MLP)
        cands["torch_grouped_mm"] = Candidate(fwd_bwd(gmm_fn, leaves, grad_out), checked(gmm_fn))
    else:
        notes.append(f"torch {torch.__version__} has no torch._grouped_mm: that peer did not run.")
    for cf in (1.0, 2.0) if want("capacity_1.0") else ():
        cap = lambda cf=cf: capacity_moe(x, weights, indices, w1, w2, w3, E, cf, MLP)[0]
        with torch.no_grad():
            kept = capacity_moe(x, weights, indices, w1, w2, w3, E, cf, MLP)[1]
            ref_kept = moe_per_expert(
                x.float(), (weights * kept).float(), indices, w1.float(), w2.float(), w3.float(), E, MLP
            )
        name = f"capacity_{cf}"
        cands[name] = Candidate(fwd_bwd(cap, leaves, grad_out), checked(cap, ref_kept))
        extra[name] = {"drop_rate": round(1.0 - float(kept.float().mean()), 4)}
    mb, why = (None, "")
    if want("megablocks_sparse"):
        mb, why = load_megablocks() if device == "cuda" else (None, "megablocks needs CUDA")
    if mb is not None:
        try:
            mb_fn, mb_params = megablocks_experts(mb, E, k, d, f, w1.detach(), w2.detach(), w3.detach())
            mbf = lambda: mb_fn(x, weights, indices)
            cands["megablocks_sparse"] = Candidate(
                fwd_bwd(mbf, [x, weights, *mb_params], grad_out), checked(mbf)
            )
        except Exception as exc:
            why = f"megablocks dMoE could not be built: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if why and why not in notes:
        notes.append(why)
    del ref
    if only is not None:
        cands = {name: c for name, c in cands.items() if name in only}
    res = measure(cands, rounds=rounds, warmup=warmup_ms, rep=rep_ms, timer=timer)
    flops = useful_flops(T, k, d, f)
    base = res.get("torch_grouped_mm")
    base_ms = base.median_ms if base is not None else base_ms
    rows = []
    for name, m in res.items():
        row = dict(
            shape=shape, routing=routing, impl=name, config=config, tokens=T, max_load=max_load, drop_rate=0.0
        )
        row.update(m.row())
        row.update(extra.get(name, {}))
        if m.median_ms:
            row["tokens_per_s"] = round(T / (m.median_ms * 1e-3))
            row["tflops"] = round(flops / (m.median_ms * 1e-3) / 1e12, 1)
            if base_ms:
                row["vs_grouped_mm"] = round(m.median_ms / base_ms, 3)
        rows.append(row)
    return rows


def _why(exc: BaseException) -> str:
    """An error for a note: its type and the first 160 characters of its message on one line."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def _with_pct(row: dict, ceil: dict) -> dict:
    """Add ``pct_of_matmul``: the row's TFLOP/s over the measured bf16 matmul ceiling."""
    if row.get("tflops") and ceil.get("matmul_bf16_tflops"):
        row["pct_of_matmul"] = round(100 * row["tflops"] / ceil["matmul_bf16_tflops"], 1)
    return row


# ---------------------------------------------------------------------------------------------
# §6.3, Figure 9: the block-sparse kernels against cuBLAS batched matmul, problem by problem.

# The problem sizes of §6.3: the MoE models of Table 2 (64 experts, top-1) with Table 1's hidden sizes
# (ffn = 4 x hidden) and Table 3's micro batches for MegaBlocks (64, 32 and 8 sequences of 1024
# tokens), as the authors' block-sparse library benchmarks them (stk's triton_benchmarks.py: tokens,
# hidden, ffn, experts = 64k/512/2048/64, 32k/768/3072/64, 8k/1024/4096/64).
PAPER_KERNEL_SHAPES = {
    "MoE-XS": dict(E=64, T=64 * 1024, d=512, f=2048),
    "MoE-Small": dict(E=64, T=32 * 1024, d=768, f=3072),
    "MoE-Medium": dict(E=64, T=8 * 1024, d=1024, f=4096),
}
# Figure 9's six products of one FFN layer (layer0 = X W1^T, layer1 = H W2, both weights [E f, d] as
# MegaBlocks stores them): name = layer:pass:kind:layout, the layout saying which operand is transposed.
KERNEL_PROBLEMS = (
    "layer0:fwd:sdd:nt",  # H = mask(X W1^T)
    "layer0:gradw:dsd:tn",  # dW1 = dH^T X (the sparse operand read through the transpose indices)
    "layer0:gradx:dsd:nn",  # dX = dH W1
    "layer1:fwd:dsd:nn",  # Y = H W2
    "layer1:gradw:dsd:tn",  # dW2 = H^T dY
    "layer1:gradx:sdd:nt",  # dH = mask(dY W2^T)
)
KERNEL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
KERNEL_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}  # 11 / 8 mantissa bits
KERNEL_COLUMNS = [
    "model", "problem", "dtype", "impl", "E", "T", "d", "f",
    "ms", "ms_min", "ms_max", "check", "tflops", "pct_of_matmul", "rel_throughput",
]  # fmt: skip


@dataclass
class KernelProblem:
    """One of Figure 9's products at one problem size, ours and cuBLAS's on the same values.

    ``ours()``: our kernel on the block-sparse layout (uniform routing: expert e owns rows
    ``[e n, (e+1) n)``, ``n = T / E``); ``batched()``: ``torch.bmm`` on the ``[E, ...]`` layout;
    ``as_batched(out)``: our output in bmm's layout; ``reference()``: fp32 bmm of the same (rounded)
    operands, the ground truth both are checked against; ``flops = 2 T d f``, the same for both."""

    ours: Callable[[], torch.Tensor]
    batched: Callable[[], torch.Tensor]
    as_batched: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[], torch.Tensor]
    flops: float


def kernel_problems(
    dims: dict, *, device, dtype: torch.dtype, block_size: int = 128, seed: int = 0
) -> dict[str, KernelProblem]:
    """The six :data:`KERNEL_PROBLEMS` of an FFN layer at ``dims = dict(E, T, d, f)``.

    Tokens are spread uniformly (``T / E`` per expert, a multiple of ``block_size``: no padding), as
    §6.3 does so that batched matmul can run the same problems; the sparse matrices are the dMoE's
    block-diagonal topology (:func:`~repro.megablocks.topology.moe_topology`). Permutation and the
    topology's construction are left out, as in the paper (they amortise over the six products)."""
    E, T, d, f = (dims[c] for c in ("E", "T", "d", "f"))
    b = block_size
    if T % E or (T // E) % b or f % b:
        raise ValueError(
            f"kernel_problems: T={T} tokens over E={E} experts must give a multiple of block_size={b} "
            f"per expert, and f={f} must be a multiple of it"
        )
    n = T // E
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype)  # noqa: E731
    topo = moe_topology(torch.full((E,), n, device=device), f, b)
    X, dY = rand(T, d), rand(T, d)
    W1, W2 = rand(E * f, d), rand(E * f, d)
    H, dH = rand(topo.nnz, b, b), rand(topo.nnz, b, b)  # the stored blocks of the sparse operands

    def blocks_to_batched(data: torch.Tensor) -> torch.Tensor:
        # block p = (block-row r, j-th block of the row): expert r // (n/b), rows r b.., columns j b..
        return data.view(E, n // b, f // b, b, b).permute(0, 1, 3, 2, 4).reshape(E, n, f)

    def batched(t: torch.Tensor, rows: int) -> torch.Tensor:
        return t.view(E, rows, -1)

    Xb, dYb, W1b, W2b = batched(X, n), batched(dY, n), batched(W1, f), batched(W2, f)
    Hb, dHb = blocks_to_batched(H).contiguous(), blocks_to_batched(dH).contiguous()
    tn = lambda t: t.transpose(1, 2)  # noqa: E731
    rows_first = lambda out: out.view(E, n, d)  # noqa: E731  [T, d] -> [E, n, d]
    weights_first = lambda out: out.view(E, f, d)  # noqa: E731  [E f, d] -> [E, f, d]
    specs = {  # name: (ours, the bmm's operands, our output in the bmm's layout)
        "layer0:fwd:sdd:nt": (lambda: sdd(X, W1.t(), topo), (Xb, tn(W1b)), blocks_to_batched),
        "layer0:gradw:dsd:tn": (lambda: dsd(dH, X, topo, transpose=True), (tn(dHb), Xb), weights_first),
        "layer0:gradx:dsd:nn": (lambda: dsd(dH, W1, topo), (dHb, W1b), rows_first),
        "layer1:fwd:dsd:nn": (lambda: dsd(H, W2, topo), (Hb, W2b), rows_first),
        "layer1:gradw:dsd:tn": (lambda: dsd(H, dY, topo, transpose=True), (tn(Hb), dYb), weights_first),
        "layer1:gradx:sdd:nt": (lambda: sdd(dY, W2.t(), topo), (dYb, tn(W2b)), blocks_to_batched),
    }
    return {
        name: KernelProblem(
            ours=ours,
            batched=lambda a=a, c=c: torch.bmm(a, c),
            as_batched=conv,
            reference=lambda a=a, c=c: torch.bmm(a.float(), c.float()),
            flops=2.0 * T * d * f,
        )
        for name, (ours, (a, c), conv) in specs.items()
    }


def kernel_rows(
    model: str,
    dims: dict,
    dtype_name: str,
    *,
    device: str = "cuda",
    block_size: int = 128,
    rounds: int = 5,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    timer=None,
) -> list[dict]:
    """Report rows for the six problems at one model's size and dtype: ours and ``cublas_bmm``, each
    checked against the fp32 reference at that problem, then timed in interleaved rounds;
    ``rel_throughput`` is ours over cuBLAS's (Figure 9's y axis)."""
    dtypes = {**KERNEL_DTYPES, "fp32": torch.float32}  # fp32: the CPU tests
    if dtype_name not in dtypes:
        raise ValueError(f"kernel_rows: dtype_name={dtype_name!r}, expected one of {sorted(dtypes)}")
    dtype = dtypes[dtype_name]
    tol = KERNEL_TOL[dtype]
    rows = []
    for name, p in kernel_problems(dims, device=device, dtype=dtype, block_size=block_size).items():
        ref = p.reference()

        def checked(fn, to_batched=lambda out: out, ref=ref, name=name):
            return lambda: assert_rel_close(to_batched(fn()), ref, tol, name)

        cands = {
            "ours": Candidate(p.ours, checked(p.ours, p.as_batched)),
            "cublas_bmm": Candidate(p.batched, checked(p.batched)),
        }
        res = measure(cands, rounds=rounds, warmup=warmup_ms, rep=rep_ms, timer=timer)
        base = res["cublas_bmm"].median_ms
        for impl, m in res.items():
            row = dict(model=model, problem=name, dtype=dtype_name, impl=impl, **dims, **m.row())
            if m.median_ms:
                row["tflops"] = round(p.flops / (m.median_ms * 1e-3) / 1e12, 1)
                if base:
                    row["rel_throughput"] = round(base / m.median_ms, 3)
            rows.append(row)
    return rows


def kernel_summary(rows: list[dict]) -> str:
    """Figure 9's statistics of our rows, per dtype: mean, standard deviation, min and max of ours'
    throughput relative to cuBLAS over the problems timed."""
    out = []
    for dtype_name in dict.fromkeys(r["dtype"] for r in rows):
        rel = [r.get("rel_throughput") for r in rows if r["dtype"] == dtype_name and r["impl"] == "ours"]
        rel = [v for v in rel if v]
        if not rel:
            continue
        mean = sum(rel) / len(rel)
        std = (sum((v - mean) ** 2 for v in rel) / len(rel)) ** 0.5
        out.append(
            f"{dtype_name}: ours at {100 * mean:.1f}% of cuBLAS batched matmul's throughput on average over "
            f"{len(rel)} problems (standard deviation {100 * std:.1f}%, from {100 * min(rel):.0f}% to "
            f"{100 * max(rel):.0f}%)."
        )
    return " ".join(out)


def kernels_main(args) -> Path | None:
    """``--kernels``: §6.3's table (see the module docstring), written as ``<device>-kernels.json``.
    ``--quick``: MoE-Medium only."""
    if not torch.cuda.is_available():
        print("repro.megablocks.bench --kernels needs a CUDA GPU", file=sys.stderr)
        return None
    budget = Budget(args.budget_s, clock=lambda: time.perf_counter())
    ceil = ceilings()
    report = Report(
        package="megablocks",
        title="§6.3: block-sparse SDD / DSD against cuBLAS batched matmul (Figure 9's problems)",
        peer=f"cuBLAS batched matmul (torch.bmm, torch {torch.__version__})",
        columns=KERNEL_COLUMNS,
        packages=["triton"],
        ceilings_used=ceil,
    )
    models = {"MoE-Medium": PAPER_KERNEL_SHAPES["MoE-Medium"]} if args.quick else PAPER_KERNEL_SHAPES

    def rows(model, dims, dtype_name):
        for row in kernel_rows(model, dims, dtype_name, rounds=args.rounds):
            report.add(**_with_pct(row, ceil))

    notes: list[str] = []
    items = [
        (f"{model}/{dtype_name}", lambda m=model, dims=dims, dt=dtype_name: rows(m, dims, dt))
        for dtype_name in KERNEL_DTYPES
        for model, dims in models.items()
    ]
    run_paced(items, budget, notes, skip_note=lambda name: f"skipped {name}: budget {args.budget_s:.0f} s",
              error_note=lambda name, exc: f"{name}: {_why(exc)}", after_each=torch.cuda.empty_cache,
              clock=lambda: time.perf_counter())  # fmt: skip
    report.notes = " ".join(
        [
            "Each row: one product of Figure 9 at the model's problem size (uniform routing, block 128, "
            f"metadata built beforehand), median over {args.rounds} interleaved rounds of triton's do_bench "
            "(L2 flushed between calls); rel_throughput = cuBLAS's time over ours. Paper (A100, fp16, "
            "CUTLASS-based kernels): 98.6% on average over its 18 problems, standard deviation 4%, 91% to 104%.",
            kernel_summary(report.rows),
            *notes,
        ]
    )
    report.plot(
        title="TFLOP/s (bf16)", x="T", y="tflops", series="impl", facet="problem", where={"dtype": "bf16"}
    )
    return report.write(tag="kernels", out_dir=Path(args.out) if args.out else None)


def main(argv=None) -> Path | None:
    ap = bench_parser(__doc__.split("\n")[0], budget_s=240.0, rounds=5, quick_help="smaller token counts, "
                      "64e-top8 only", only=False, settings=False, tag=False)  # fmt: skip
    ap.add_argument("--tune-first", action="store_true", help="time the tuning rows before the main table")
    ap.add_argument(
        "--kernels", action="store_true", help="time §6.3's per-kernel table instead (<device>-kernels.json)"
    )
    ap.add_argument("--probe-megablocks", action="store_true", help=argparse.SUPPRESS)
    args = parse_bench_args(ap, argv)
    if args.probe_megablocks:
        return probe_main(args.quick)
    if args.kernels:
        return kernels_main(args)
    if not torch.cuda.is_available():
        print("repro.megablocks.bench needs a CUDA GPU", file=sys.stderr)
        return None
    from repro.megablocks.lab.tuning import tuning_rows

    clock = lambda: time.perf_counter()  # looked up at each call (the tests' fake clock)
    budget = Budget(args.budget_s, clock=clock)
    notes: list[str] = []
    ceil = ceilings()
    report = Report(
        package="megablocks",
        title="dMoE forward + backward (bf16, SwiGLU experts)",
        peer="torch._grouped_mm; megablocks 0.10.0 where it builds",
        columns=COLUMNS,
        packages=["megablocks", "stanford-stk", "triton"],
        ceilings_used=ceil,  # pct_of_matmul's denominator, stored with the rows
    )
    shapes = bench_shapes(args.quick)
    # megablocks runs in this process beside the others; a fault in its kernels would end the CUDA
    # context for every later row, so it first runs once at each shape in a child process
    skip = ()
    if load_megablocks()[0] is not None:
        ok, why = probe_megablocks(args.quick, timeout_s=max(60.0, args.budget_s / 3))
        notes.append(why)
        skip = () if ok else ("megablocks_sparse",)

    def tuning() -> dict:  # repro.megablocks.lab.tuning's rows, into this report
        return tuning_rows(report, shapes, budget, notes, run_config, lambda r: _with_pct(r, ceil), clock)

    # with --tune-first, the main table's configurations take about twice a tuning row (twice the candidates)
    longest = 2.0 * max(tuning().values(), default=0.0) if args.tune_first else 0.0

    def rows(shape, dims, routing):
        for row in run_config(shape, dims, routing, rounds=args.rounds, notes=notes, skip=skip):
            report.add(**_with_pct(row, ceil))

    items = [
        (f"{shape}/{routing}", lambda s=shape, dims=dims, r=routing: rows(s, dims, r))
        for shape, dims in shapes.items()
        for routing in ROUTINGS
    ]
    run_paced(
        items, budget, notes, longest=longest, after_each=torch.cuda.empty_cache, clock=clock,
        skip_note=lambda name: f"skipped {name}: budget {args.budget_s:.0f} s (elapsed {budget.elapsed():.0f} s)",
        error_note=lambda name, exc: f"{name}: {_why(exc)}",
    )  # fmt: skip
    if not args.tune_first:
        tuning()
    report.notes = " ".join(
        [
            "Each row: forward + backward of the expert layer for a fixed routing (router excluded), median over "
            f"{args.rounds} interleaved rounds (range in ms_min/ms_max); tflops counts useful (routed) work.",
            *dict.fromkeys(notes),
        ]
    )
    report.plot(
        title="forward + backward TFLOP/s",
        x="max_load",
        y="tflops",
        series="impl",
        facet="shape",
        where={"config": "default"},
    )
    return report.write(out_dir=Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
