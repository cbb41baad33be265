"""Benchmark of USP attention: ``python -m repro.usp.bench --out DIR --budget-s N [--quick]``.

One GPU (this session's job): what splitting attention costs, before any communication.
* ``full``: one SDPA call (flash) over the whole sequence, forward and backward: the baseline.
* ``usp n=1``: :func:`repro.usp.usp_attention` with no groups (world size 1): the LSE path and one merge.
* ``ring n=N``: an emulated ring of N ranks in one process (:func:`repro.usp.ring.emulated_ring_attention`):
  every rank's steps one after the other, no communication. ``ms`` is the total over the N ranks,
  ``ms_per_rank`` = ms / N what each of N GPUs would compute, ``overhead`` = ms / full's ms (1.0: free).
* peers at world size 1: PyTorch's ``context_parallel`` (ring attention over SDPA, torchtitan's) and
  yunchang's ``LongContextAttention`` (the authors' library; without flash-attn only its PyTorch
  attention types, which have no backward: forward rows only).

Several GPUs: :mod:`repro.usp.dist_bench` (weak and strong scaling, every split, the peers, the
profiler timeline), run by ``repro/usp/gpu_plan.sh``.

Every candidate is checked against SDPA at the same shape before it is timed (paperclub.bench.measure);
bf16 tolerance 2e-2 relative (bf16 rounding of O and of the gradients, ~4e-3 each, plus accumulation order).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from paperclub.bench import Budget, Candidate, Report, bench_parser, ceilings, measure, parse_bench_args
from paperclub.testing import assert_rel_close

COLUMNS = [
    "impl", "world", "ulysses", "ring", "pass", "causal", "S", "B", "H", "H_kv", "D",
    "ms", "ms_min", "ms_max", "check", "ms_per_rank", "overhead", "tokens_per_s", "tflops_per_gpu", "note",
]  # fmt: skip
TOL = 2e-2
PACKAGES = ["yunchang"]


def attention_flops(b: int, s: int, h: int, d: int, causal: bool, passes: str) -> float:
    """Useful FLOPs of softmax attention: 4 B S^2 H D forward (QK^T and PV), 2.5x that backward,
    halved by a causal mask."""
    fwd = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
    return fwd * (3.5 if passes == "fwd+bwd" else 1.0)


def _expand_kv(q, k, v):
    """K/V repeated to q's head count (what a model without GQA kernels does), so that SDPA surely
    takes its flash kernel: with enable_gqa it might fall back to the math kernel and its S x S matrix."""
    rep = q.shape[2] // k.shape[2]
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2))


def _sdpa_bhsd(q, k, v, causal):
    """SDPA on [B, S, H, D] tensors; GQA by expanding K/V."""
    k, v = _expand_kv(q, k, v)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


def _fwd_bwd(fn, leaves, do):
    """A timed call: forward, then backward with dO (gradients accumulate; every candidate alike)."""

    def run():
        out = fn()
        out.backward(do)

    return run


def _check(fn, leaves, do, ref, passes):
    """Compare fn's output (and gradients for fwd+bwd) with the reference tuple (o, dq, dk, dv)."""

    def run():
        for t in leaves:
            t.grad = None
        out = fn()
        assert_rel_close(out.float(), ref[0], TOL, "o")
        if passes == "fwd+bwd":
            out.backward(ref[4])
            for name, t, want in zip(("dq", "dk", "dv"), leaves, ref[1:4], strict=True):
                assert_rel_close(t.grad.float(), want, TOL, name)
        for t in leaves:
            t.grad = None

    return run


def single_gpu_config(
    report: Report, *, S: int, causal: bool, B: int, H: int, H_kv: int, D: int, rings, backends, peers,
    rounds: int, device: str = "cuda", dtype=torch.bfloat16, rep: int = 10,
) -> None:  # fmt: skip
    """Time one shape: full SDPA, usp at world 1, emulated rings, peers; add the rows to the report."""
    from repro.usp import shard, usp_attention
    from repro.usp.local import get_backend
    from repro.usp.ring import emulated_ring_attention

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, S, H, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, S, H_kv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, S, H_kv, D, device=device, dtype=dtype, generator=gen)
    do = torch.randn(B, S, H, D, device=device, dtype=dtype, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    # reference: SDPA in the same dtype (flash on a GPU); its output and gradients in fp32
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o_ref = _sdpa_bhsd(*ref_leaves, causal)
    o_ref.backward(do)
    ref = (o_ref.detach().float(), *(t.grad.float() for t in ref_leaves), do)
    del ref_leaves, o_ref
    scale = 1.0 / math.sqrt(D)
    base = dict(world=1, causal=causal, S=S, B=B, H=H, H_kv=H_kv, D=D)

    for passes in ("fwd+bwd", "fwd"):
        cands: dict[str, Candidate] = {}
        meta: dict[str, dict] = {}

        def add(name, fn, leaves_, do_, ref_, n=1, passes=passes, cands=cands, meta=meta, **m):
            run = _fwd_bwd(fn, leaves_, do_) if passes == "fwd+bwd" else (lambda: fn())
            cands[name] = Candidate(fn=run, check=_check(fn, leaves_, do_, ref_, passes))
            meta[name] = dict(n=n, **m)

        add("full sdpa", lambda: _sdpa_bhsd(*leaves, causal), leaves, do, ref, ulysses=1, ring=1)
        for be in backends if passes == "fwd+bwd" else backends[:1]:
            add(
                f"usp n=1 ({be})",
                lambda be=be: usp_attention(*leaves, causal=causal, backend=be),
                leaves, do, ref, ulysses=1, ring=1,
            )  # fmt: skip
        # emulated rings: every N with the first backend and zigzag; the contiguous layout (causal) and
        # the other backends at the middle N only (fewer candidates: each costs rounds x rep calls)
        mid = rings[len(rings) // 2]
        ring_runs = [(n, "zigzag", backends[0]) for n in rings]
        if passes == "fwd+bwd":
            ring_runs += [(mid, "contiguous", backends[0])] if causal else []
            ring_runs += [(mid, "zigzag", be) for be in backends[1:]]
        else:
            ring_runs = [(mid, "zigzag", backends[0])]
        for n, layout, be in ring_runs:
            if S % (2 * n):
                continue
            sh = [
                torch.stack([shard(t, n, r, layout) for r in range(n)]).requires_grad_(True)
                for t in (q, k, v)
            ]
            do_sh = torch.stack([shard(do, n, r, layout) for r in range(n)])
            ref_sh = (*(torch.stack([shard(t, n, r, layout) for r in range(n)]) for t in ref[:4]), do_sh)
            fn = lambda sh=sh, layout=layout, be=be: emulated_ring_attention(
                *sh, causal=causal, scale=scale, layout=layout, backend=get_backend(be)
            )
            add(f"ring n={n} {layout} ({be})", fn, sh, do_sh, ref_sh, n=n, ulysses=1, ring=n)
        res = measure(cands, rounds=rounds, rep=rep, warmup=3)
        full_ms = res["full sdpa"].median_ms
        for name, m in res.items():
            n = meta[name].pop("n")
            ms = m.median_ms
            report.add(
                impl=name, **base, **meta[name], **{"pass": passes}, **m.row(),
                ms_per_rank=None if ms is None else ms / n,
                overhead=None if (ms is None or not full_ms) else ms / full_ms,
                tokens_per_s=None if ms is None else B * S / (ms * 1e-3),
                tflops_per_gpu=None if ms is None else attention_flops(B, S, H, D, causal, passes) / (ms * 1e-3) / 1e12,
            )  # fmt: skip
        for peer in peers:
            for row in peer(
                q=q, k=k, v=v, do=do, ref=ref, causal=causal, passes=passes, rounds=rounds, rep=rep
            ):
                ms = row.get("ms")
                report.add(
                    **base, **{"pass": passes}, **row,
                    overhead=None if (ms is None or not full_ms) else ms / full_ms,
                    tokens_per_s=None if ms is None else B * S / (ms * 1e-3),
                    tflops_per_gpu=None if ms is None else attention_flops(B, S, H, D, causal, passes) / (ms * 1e-3) / 1e12,
                )  # fmt: skip


def _fold_heads(g, h_kv: int):
    """Gradient of expanded K/V [B, S, H, D] summed back onto its H_kv heads (what the expansion's
    backward does)."""
    b, s, h, d = g.shape
    return g if h == h_kv else g.reshape(b, s, h_kv, h // h_kv, d).sum(3)


def _init_single_rank_group(device: str = "cuda") -> str:
    """A 1-rank NCCL process group (the peers need one even on one GPU; gloo on CPU); '' or the reason
    it failed."""
    import torch.distributed as dist

    if dist.is_initialized():
        return ""
    try:
        from nanoparallel.launch import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if device == "cuda":
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)
        return ""
    except Exception as exc:  # recorded in the report, the rest still runs
        return f"{type(exc).__name__}: {exc}"


def _error_row(impl: str, exc: BaseException) -> dict:
    return {"impl": impl, "check": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}


def peer_torch_cp(*, q, k, v, do, ref, causal, passes, rounds, rep) -> list[dict]:
    """torch.distributed.tensor.experimental.context_parallel at world size 1 (SDPA flash under it).
    Timed in its own rounds: inside the context every SDPA call (ours included) would go through CP."""
    impl = "torch context_parallel (world 1)"
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        why = _init_single_rank_group(q.device.type)
        if why:
            return [{"impl": impl, "check": f"failed: no process group: {why}"}]
        k, v = _expand_kv(q, k, v)  # its SDPA has no GQA: K/V expanded outside the timed call
        mesh = init_device_mesh(q.device.type, (dist.get_world_size(),))
        bufs = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]  # [B, H, S, D]
        with (
            sdpa_kernel(SDPBackend.FLASH_ATTENTION),
            context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4),
        ):
            leaves = [t.detach().clone().requires_grad_(True) for t in bufs[:3]]
            fn = lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal).transpose(1, 2)
            do_ = bufs[3].transpose(1, 2)
            run = _fwd_bwd(fn, leaves, do_) if passes == "fwd+bwd" else fn

            def check():
                for t in leaves:
                    t.grad = None
                out = fn()
                assert_rel_close(out.float(), ref[0], TOL, "o")
                if passes == "fwd+bwd":
                    out.backward(do_)
                    for name, t, want in zip(("dq", "dk", "dv"), leaves, ref[1:4], strict=True):
                        # [B, H, S, D] -> [B, S, H, D]; expanded K/V heads summed back onto their group
                        got = _fold_heads(t.grad.transpose(1, 2).float(), want.shape[2])
                        assert_rel_close(got, want, TOL, name)

            m = measure({impl: Candidate(fn=run, check=check)}, rounds=rounds, rep=rep, warmup=3)[impl]
        note = "own rounds (not interleaved)" + (
            "; K/V expanded to H heads" if q.shape[2] != ref[2].shape[2] else ""
        )
        return [{"impl": impl, **m.row(), "note": note}]
    except Exception as exc:
        return [_error_row(impl, exc)]


_YUNCHANG_GROUPS: list = []


def peer_yunchang(*, q, k, v, do, ref, causal, passes, rounds, rep) -> list[dict]:
    """yunchang 0.6.4 LongContextAttention at world size 1, PyTorch attention types (no flash-attn)."""
    rows = []
    try:
        import yunchang
        from yunchang import LongContextAttention, set_seq_parallel_pg
        from yunchang.kernels import AttnType
    except Exception as exc:
        return [_error_row("yunchang", exc)]
    why = _init_single_rank_group(q.device.type)
    if why:
        return [{"impl": "yunchang", "check": f"failed: no process group: {why}"}]
    try:
        if not _YUNCHANG_GROUPS:
            set_seq_parallel_pg(1, 1, 0, 1)
            _YUNCHANG_GROUPS.append(True)
    except Exception as exc:
        return [_error_row("yunchang", exc)]
    for kind in ("TORCH_FLASH", "TORCH_CUDNN"):
        impl = f"yunchang {yunchang.__version__} {kind.lower()} (world 1)"
        try:
            attn = LongContextAttention(ring_impl_type="zigzag", attn_type=getattr(AttnType, kind))
            # its PyTorch attention types call the flash/cuDNN ops directly, which have no GQA
            leaves = [
                t.detach().clone().requires_grad_(passes == "fwd+bwd") for t in (q, *_expand_kv(q, k, v))
            ]
            fn = lambda attn=attn, leaves=leaves: attn(*leaves, causal=causal)
            run = _fwd_bwd(fn, leaves, do) if passes == "fwd+bwd" else fn
            m = measure(
                {impl: Candidate(fn=run, check=_check(fn, leaves, do, ref, passes))},
                rounds=rounds,
                rep=rep,
                warmup=3,
            )
            note = "own rounds (not interleaved)" + (
                "; K/V expanded to H heads" if k.shape[2] != q.shape[2] else ""
            )
            rows.append({"impl": impl, **m[impl].row(), "note": note})
        except Exception as exc:
            rows.append(_error_row(impl, exc))
    return rows


def main(argv=None) -> None:
    ap = bench_parser(
        __doc__.splitlines()[0],
        budget_s=240.0,
        rounds=None,
        quick_help="smallest meaningful sweep",
        only=False,
        settings=False,
    )
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu for a smoke run of the code paths")
    ap.add_argument("--seqs", type=int, nargs="*", default=None, help="sequence lengths (override the sweep)")
    ap.add_argument("--backends", nargs="*", default=None,
                    help="local attention backends (default auto sdpa fa4_gluon fa4; the first serves the rings)")  # fmt: skip
    args = parse_bench_args(ap, argv)
    budget = Budget(args.budget_s).part(0.75)  # counted from here
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("repro.usp.bench is the one-GPU benchmark; on several GPUs run repro.usp.dist_bench")
    report = Report(
        package="usp",
        title="USP attention on one GPU: the local kernels, and what splitting costs before any communication",
        peer="torch context_parallel; yunchang 0.6.4",
        columns=COLUMNS,
        packages=PACKAGES,
        measure_ceilings=False,
        ceilings_used=ceilings() if args.device == "cuda" else {},
        notes=(
            "bf16, fwd+bwd unless pass says fwd. usp n=1 (backend) is usp_attention without groups: one local "
            "attention call through that backend (auto = cuDNN here). ring n=N is an emulated ring (all N ranks "
            "in one process, no communication); ms is the total, ms_per_rank = ms / N; overhead = ms / full "
            "sdpa's ms. yunchang without flash-attn has no backward for its PyTorch attention types: fwd rows only."
        ),
    )
    if args.device == "cpu":
        # a smoke run of the code paths; one thread (tiny ops on a shared CPU spin otherwise)
        torch.set_num_threads(1)
        shapes = [dict(S=32, causal=True, B=1, H=2, H_kv=1, D=16)]
        kw = dict(
            rings=[2, 4], backends=args.backends or ["auto", "sdpa", "math"], peers=[], rounds=1, device="cpu",
            dtype=torch.float32,
        )  # fmt: skip
    else:
        seqs = args.seqs or ([8192] if args.quick else [8192, 16384, 32768])
        # LLaMA-3-8B's attention: 32 query heads, 8 K/V heads, D = 128
        shapes = [dict(S=s, causal=c, B=1, H=32, H_kv=8, D=128) for s in seqs for c in (True, False)]
        kw = dict(
            rings=[2, 4, 8], backends=args.backends or ["auto", "sdpa", "fa4_gluon", "fa4"],
            peers=[peer_torch_cp, peer_yunchang], rounds=5, rep=30,
        )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        for shape in shapes:
            if not budget.allows():
                report.notes += f" Stopped at the budget ({args.budget_s:.0f} s) before {shape}."
                break
            single_gpu_config(report, **shape, **kw)
            report.write(out_dir=args.out, tag=args.tag)  # after every shape: a cut-off run keeps its rows
    finally:
        torch.set_num_threads(threads)
    import torch.distributed as dist

    if dist.is_initialized():  # the peers' 1-rank group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
