"""Benchmark: our chunkwise KDA against flash-linear-attention and causal flash attention.

``python -m repro.kda.bench [--quick] [--seqlens 2048,4096] [--out DIR]``

Shapes: H = 16 heads, K = V = 128, bf16, B x T = 16384 tokens for T = 2k .. 32k; at T = 64k
B = 1 (65536 tokens: B cannot go below 1). Each row is the median over ROUNDS rounds, in each of
which every implementation and pass at that T is timed once in turn (``paperclub.bench.time_ms``,
CUDA events through triton's do_bench, itself a median):

* ``ours``: ``repro.kda.chunk_kda`` (Triton forward, four launches; backward as chunk.BACKWARD selects);
* ``fla_kda``: ``fla.ops.kda.chunk_kda`` (flash-linear-attention 0.6.0, default arguments);
* ``fla_gdn``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (scalar gate per head);
* ``sdpa_flash``: ``torch.nn.functional.scaled_dot_product_attention`` causal, flash backend.

``rel_err_vs_fla`` (forward rows of ``ours``) is ``||o_ours - o_fla|| / ||o_fla||`` on the same
inputs; both run in bf16, so about 1e-2 is agreement.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paperclub.bench import Candidate, Report, kernel_times, measure
from paperclub.testing import rel_error

H, K, V = 16, 128, 128
TOKENS = 16384
ALL_T = [2048, 4096, 8192, 16384, 32768, 65536]


DEVICE = "cuda"  # tests/test_bench.py runs the benchmark's logic on the CPU


def make_inputs(
    B: int, T: int, device: str | None = None, dtype=torch.bfloat16, seed: int = 0, gate_scale: float = 0.5
):
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=device, generator=gen).to(dtype)
    # g = logsigmoid(x) * gate_scale (see GATES)
    g = (F.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen)) * gate_scale).float()
    beta = torch.rand(B, T, H, device=device, generator=gen).float()
    return q, k, v, g, beta


def impls(cu_seqlens: torch.Tensor | None = None):
    """name -> fn(q, k, v, g, beta) -> o. With ``cu_seqlens``: ours and fla's KDA on a packed batch."""
    from repro.kda import chunk_kda as ours

    if cu_seqlens is not None:
        out = {"ours": lambda q, k, v, g, beta: ours(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]}
        try:
            from fla.ops.kda import chunk_kda as fla_kda

            out["fla_kda"] = lambda q, k, v, g, beta: fla_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens.long())[
                0
            ]
        except ImportError as exc:
            print(f"flash-linear-attention not importable ({exc}); varlen: ours only")
        return out
    out = {"ours": lambda q, k, v, g, beta: ours(q, k, v, g, beta)[0]}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda as fla_kda

        out["fla_kda"] = lambda q, k, v, g, beta: fla_kda(q, k, v, g, beta)[0]
        # GDN: one decay per head and token (the channel mean of KDA's), same q, k, v, beta
        out["fla_gdn"] = lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g.mean(-1), beta)[0]
    except ImportError as exc:
        print(f"flash-linear-attention not importable ({exc}); timing ours and SDPA only")

    def sdpa(q, k, v, g, beta):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
        return o.transpose(1, 2)

    out["sdpa_flash"] = sdpa
    return out


def warm(Ts: list[int]) -> None:
    """Compile and autotune every implementation at every shape once, timing nothing.

    flash-linear-attention autotunes its kernels on first use and caches the results on disk,
    as Triton caches compiled kernels: a warm-up process running beside the tests makes the
    measuring run itself short."""
    fns = impls()
    for T in Ts:
        B = max(1, TOKENS // T)
        inputs = make_inputs(B, T)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            torch.autograd.grad(fn(*leaves), leaves, torch.randn_like(inputs[2]), allow_unused=True)
            torch.cuda.synchronize()
            print(f"warm T={T} {name}: {time.perf_counter() - t0:.1f} s", flush=True)


#: Rounds of the main benchmark: at each T every implementation and pass is timed once per round,
#: in turn; a row is the median (clock and temperature drift moved single timings by 5-8%).
ROUNDS = 3


GATES = {
    # a per-channel log-decay like a trained gate's: mostly mild, some channels fast (>= -10 per token)
    "std": 0.5,
    # mild: fla's gate_logit_normalizer 10 (decay rates near 1), where a wrong state backward shows
    "mild": 0.1,
}
# gradient check before timing, bf16 against our fp32 path at the same shape (relative error):
# bf16 rounding gives ~4e-3 (o) to ~1.5e-2 (dg) on an H100; a wrong kernel gives 1e-1 and more
CHECK_TOL = {"o": 2e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2, "dg": 6e-2, "dbeta": 6e-2}


def gradient_check(fn, inputs, reference, names=("q", "k", "v", "g", "beta"), tol=None, errors_out=None):
    """A ``Candidate.check``: ``fn``'s output and gradients on ``inputs`` (bf16) against our fp32 path
    on the same values; raises naming every quantity over ``tol`` (default CHECK_TOL). Returns the
    worst ratio of error to tolerance; ``errors_out`` (a dict), if given, receives every error."""
    tol = CHECK_TOL if tol is None else tol

    def grads(f, xs):
        leaves = [x.detach().clone().requires_grad_(True) for x in xs]
        o = f(*leaves)
        do = torch.randn(o.shape, generator=torch.Generator(o.device).manual_seed(1), device=o.device)
        gs = torch.autograd.grad(o, leaves, do.to(o.dtype))
        return {"o": o.detach(), **{f"d{n}": g for n, g in zip(names, gs, strict=True)}}

    ours = grads(fn, inputs)
    ref = grads(reference, [x.float() for x in inputs])
    errs = {n: rel_error(ours[n].float(), ref[n].float()) for n in ref}
    if errors_out is not None:
        errors_out.update(errs)
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= tol[n]}
    if bad:
        raise AssertionError(f"against our fp32 path: {bad} over {tol}")
    return max(e / tol[n] for n, e in errs.items())


def run(
    quick: bool,
    out_dir: Path | None,
    budget_s: float,
    only: list[str] | None = None,
    seqlens: list[int] | None = None,
    gates: list[str] | None = None,
) -> None:
    """The main benchmark at every T of ALL_T (``quick``: T = 4096 only; ``seqlens``: those T,
    written under the tag ``seqlens-<T>-<T>...`` so the full results file is left alone), in two
    gate regimes, then one packed variable-length batch. Every candidate's output and gradients are
    checked at the shape before it is timed (``gradient_check``); one that fails is not timed.
    ``gates``: a subset of GATES and "varlen" to run (default all; ``["varlen"]``: the packed batch only)."""
    wanted = set(gates or [*GATES, "varlen"])
    unknown = wanted - {*GATES, "varlen"}
    if unknown:
        raise SystemExit(f"--gates: unknown {sorted(unknown)}; expected some of {[*GATES, 'varlen']}")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("repro.kda.bench needs a CUDA GPU")
    from repro.kda import chunk as ck

    backward = ck.BACKWARD  # after --set: the notes say which backward and forward the rows timed
    forward = "4 launches, INTRA_FWD_SPLIT" if ck.INTRA_FWD_SPLIT else "3 launches"
    names = (
        "INTRA_FWD_FAST_EXP",
        "INTRA_FWD_QG",
        "INTRA_FWD_KB",
        "OUT_FWD_BV",
        "SPLIT_FAST_EXP",
        "SPLIT_B_STAGES",
    )
    settings = ", ".join(f"{name}={getattr(ck, name)!r}" for name in names)
    start = time.perf_counter()
    report = Report(
        package="kda",
        title="KDA forward and forward+backward, H=16, K=V=128, bf16",
        peer="flash-linear-attention 0.6.0",
        columns=["impl", "gates", "B", "T", "pass", "ms", "ms_min", "ms_max", "check", "rel_err_vs_fla"],
        packages=["flash-linear-attention", "fla-core"],
        notes=(
            "B*T = 16384 tokens except T = 65536 (B = 1, 65536 tokens). gates: 'std' g = logsigmoid(x) * 0.5, "
            "'mild' g = logsigmoid(x) / 10 (fla's gate_logit_normalizer 10); 'varlen' rows: one packed batch "
            "of 16384 tokens in sequences of different lengths (cu_seqlens). "
            f"ours: Triton forward ({forward}) and "
            f"Triton backward (chunk.BACKWARD = {backward!r}); settings {settings}. Before timing, ours and "
            "fla_kda are checked at the row's shape: output and gradients in bf16 against our fp32 path "
            f"(relative error under {CHECK_TOL}); 'check' says so. rel_err_vs_fla: our forward output against "
            f"fla's chunk_kda on the same bf16 inputs. Each row: median (and range) of {ROUNDS} rounds in "
            "which every implementation and pass at that shape is timed in turn (paperclub.bench.measure)."
        ),
        measure_ceilings=False,
    )
    print(
        f"kda bench on {torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}: report ready after {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    fns = impls()
    print(
        f"kda bench: implementations {', '.join(fns)} loaded after {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    if only:
        fns = {name: fn for name, fn in fns.items() if name in only}
    Ts = [4096] if quick else (seqlens or ALL_T)
    tag = "quick" if quick else ("seqlens-" + "-".join(map(str, seqlens)) if seqlens else "")
    if gates:  # a partial run never overwrites the full results file
        tag = "-".join(x for x in (tag, "gates", *sorted(wanted)) if x)
    skipped: list[str] = []
    failed: list[str] = []
    base_notes = report.notes
    reference = fp32_path()
    shapes = [(gates, T) for T in Ts for gates in GATES if gates in wanted]
    if not quick and "varlen" in wanted:
        shapes.append(("varlen", TOKENS))
    for gates, T in shapes:
        if time.perf_counter() - start > budget_s:
            skipped.append(f"{gates}@T={T}")
            continue
        if gates == "varlen":
            B, cu = 1, varlen_offsets(TOKENS)
            inputs = make_inputs(1, TOKENS, gate_scale=GATES["std"])
            cands = {n: f for n, f in impls(cu_seqlens=cu).items() if n in fns}
        else:
            B, cu = max(1, TOKENS // T), None
            inputs = make_inputs(B, T, gate_scale=GATES[gates])
            # the mild regime times ours and fla's KDA only: the other rows do not depend on the gates
            cands = {n: f for n, f in fns.items() if gates == "std" or n in ("ours", "fla_kda")}
        print(f"{gates} T={T}: checking {', '.join(cands)} (first calls compile and autotune)", flush=True)
        errs = {}
        if "fla_kda" in cands and "ours" in cands:
            errs["ours"] = rel_error(cands["ours"](*inputs).float(), cands["fla_kda"](*inputs).float())
        candidates = {}
        for name, fn in cands.items():
            check = None
            if name in ("ours", "fla_kda"):
                ref = (lambda *x, cu=cu: reference(*x, cu_seqlens=cu)) if cu is not None else reference
                check = lambda fn=fn, ref=ref, x=inputs: gradient_check(fn, x, ref)  # noqa: E731
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            do = torch.randn_like(inputs[2])

            def fwd_bwd(fn=fn, leaves=leaves, do=do):
                o = fn(*leaves)
                return torch.autograd.grad(o, leaves, do, allow_unused=True)

            candidates[(name, "fwd")] = Candidate(fn=lambda fn=fn, x=inputs: fn(*x), check=check)
            candidates[(name, "fwd+bwd")] = Candidate(fn=fwd_bwd, check=None)
        # the check of a name runs once, on its fwd candidate; its fwd+bwd row inherits the verdict
        res = measure(
            {f"{n}|{p}": c for (n, p), c in candidates.items() if p == "fwd"}, rounds=1, rep=1, warmup=1
        )
        ok = {key.split("|")[0] for key, m in res.items() if m.ok}
        for key, m in res.items():
            if not m.ok:
                failed.append(f"{key.split('|')[0]} at {gates} T={T}: {m.error}")
                print(f"{gates} T={T:6d} {key} not timed: {m.error}", flush=True)
        timed = {f"{n}|{p}": Candidate(fn=c.fn) for (n, p), c in candidates.items() if n in ok}
        res.update(measure(timed, rounds=ROUNDS))
        for key, m in res.items():
            name, label = key.split("|")
            if m.ok and m.median_ms is None:
                continue
            err = errs.get(name) if label == "fwd" else None
            verdict = "ok" if name in ok else res[f"{name}|fwd"].row()["check"]
            if name not in ("ours", "fla_kda"):
                verdict = "not checked (another function)"
            row = m.row()
            row["check"] = verdict
            report.add(impl=name, gates=gates, B=B, T=T, rel_err_vs_fla=err, **row, **{"pass": label})
            if m.median_ms is not None:
                print(
                    f"{gates:6s} T={T:6d} B={B:2d} {name:11s} {label:8s} {m.median_ms:8.3f} ms "
                    f"({m.min_ms:.3f}-{m.max_ms:.3f})",
                    flush=True,
                )
        del inputs
        torch.cuda.empty_cache()
        report.notes = (
            base_notes
            + (f" Not measured (time budget of the run): {', '.join(skipped)}." if skipped else "")
            + (f" Failed: {'; '.join(failed)}." if failed else "")
        )
        report.write(out_dir=out_dir, tag=tag)  # keep what was measured so far
    report.notes = (
        base_notes
        + (f" Not measured (time budget of the run): {', '.join(skipped)}." if skipped else "")
        + (f" Failed: {'; '.join(failed)}." if failed else "")
    )
    for gates in GATES:
        report.plot(title=f"forward time, {gates} gates", x="T", y="ms", series="impl",
                    where={"pass": "fwd", "gates": gates}, logx=True, logy=True)  # fmt: skip
        report.plot(title=f"forward + backward time, {gates} gates", x="T", y="ms", series="impl",
                    where={"pass": "fwd+bwd", "gates": gates}, logx=True, logy=True)  # fmt: skip
    report.measure_ceilings = not quick and time.perf_counter() - start < budget_s
    report.write(out_dir=out_dir, tag=tag)


def varlen_offsets(total: int, device: str | None = None) -> torch.Tensor:
    """Offsets of a packed batch of ``total`` tokens in sequences of varied lengths (fixed seed):
    long and short ones as a pretraining batch of documents has them."""
    gen = torch.Generator().manual_seed(0)
    lengths, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(64, 4097, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return torch.tensor(offsets, device=device or DEVICE, dtype=torch.int32)


def fp32_path():
    """Our chunk_kda on fp32 inputs (ieee products): the reference of the gradient check."""
    from repro.kda import chunk_kda

    return lambda q, k, v, g, beta, cu_seqlens=None: chunk_kda(
        q.float(), k.float(), v.float(), g.float(), beta.float(), cu_seqlens=cu_seqlens
    )[0]


def breakdown(B: int = 8, T: int = 2048, names: tuple[str, ...] = ("ours", "fla_kda")) -> dict:
    """GPU time of every kernel in one forward and one forward+backward, per implementation.

    Runs each implementation three times under torch.profiler (after a warm-up) and prints, for
    each, the kernels sorted by time per call: where the time goes, to compare launch by launch
    with the peer. Returns ``{impl: {pass: [(kernel, us_per_call), ...]}}``."""
    fns = impls()
    inputs = make_inputs(B, T)
    do = torch.randn_like(inputs[2])
    out: dict = {}
    reps = 3
    for name in names:
        if name not in fns:
            continue
        fn = fns[name]
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]

        def fwd(fn=fn):
            return fn(*inputs)

        def fwd_bwd(fn=fn, leaves=leaves):
            return torch.autograd.grad(fn(*leaves), leaves, do, allow_unused=True)

        out[name] = {}
        for label, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            rows = [(k, ms * 1000) for k, ms, _ in kernel_times(f, reps=reps)]
            total = sum(us for _, us in rows)
            print(f"\n{name} {label} B={B} T={T}: {total / 1000:.3f} ms of kernel time per call")
            for kname, us in rows[:14]:
                print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {kname[:90]}")
            out[name][label] = [(k, round(us, 1)) for k, us in rows]
    return out


def profile_target(B: int = 8, T: int = 2048) -> None:
    """One forward + backward of ours inside cudaProfilerStart/Stop (after a warm-up that compiles
    everything), so that ``ncu --profile-from-start off`` sees each kernel once."""
    from repro.kda import chunk_kda

    leaves = [x.requires_grad_(True) for x in make_inputs(B, T)]
    do = torch.randn_like(leaves[2])
    for profiled in (False, True):
        if profiled:
            torch.cuda.profiler.start()
        torch.autograd.grad(chunk_kda(*leaves)[0], leaves, do)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


TUNING = [  # launch settings of repro.kda.chunk, each change (one or more names) tried against the defaults
    # the forward: the fused intra-chunk kernel, the split one's WY launch, and each of the last
    # round's changes undone (H100, B=8, T=2048, results/nvidia-h100-80gb-hbm3-tuning.json)
    {"INTRA_FWD_SPLIT": False},
    {"WY_FWD_WARPS": 4},
    {"WY_FWD_BK": 32, "WY_FWD_BV": 32},
    {"INTRA_FWD_FAST_EXP": False},
    {"INTRA_FWD_QG": False},
    {"INTRA_FWD_KB": False},
    {"OUT_FWD_BV": 64},
    {"INTRA_FWD_STAGES": 1},
    # settled on an H100 (chunk.py's comments) and left out: the forward's strips, warps and key
    # block, the state kernels' value blocks, the split backward's key block, warps and 16-bit
    # dots. The other Triton backward:
    {"BACKWARD": "triton"},
    # the split backward around its defaults (BKB 32, 4 warps, 3 stages for kernel B)
    {"SPLIT_FAST_EXP": False},
    {"SPLIT_B_STAGES": 1},
    {"SPLIT_B_STAGES": 4},
    {"SPLIT_B_BV": 64},
    {"SPLIT_A_BK": 16, "SPLIT_A_BV": 16, "SPLIT_A_WARPS": 4},
    # accuracy against time for bf16 inputs (chunk.DOT_PREC_BF16): tf32x3 products everywhere
    {"DOT_PREC_BF16": "tf32x3"},
    # the cost of chunk_kda's input check of g (a reduction and a synchronisation per call)
    {"CHECK_DECAY_RANGE": False},
]


#: Rounds of --tune: every setting is timed once per round, in turn, and reported by its median.
#: Single timings of one setting moved by up to 5-8% between runs on one H100 (clocks and
#: temperature), more than the differences being measured; interleaving spreads that drift evenly.
TUNE_ROUNDS = 3


def tune(
    B: int = 8, T: int = 2048, rounds: int = TUNE_ROUNDS, changes: list[dict] | None = None
) -> list[dict]:
    """Time ours (fwd, fwd+bwd) with the defaults and with each change (default: TUNING) applied
    alone, in ``rounds`` interleaved rounds (medians; the row also keeps the range)."""
    from repro.kda import chunk as ck

    changes = TUNING if changes is None else changes
    inputs = make_inputs(B, T)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    do = torch.randn_like(inputs[2])

    def fwd(change: dict):
        with ck.changed_settings(change):
            return ck.chunk_kda(*inputs)

    def fwd_bwd(change: dict):
        with ck.changed_settings(change):
            return torch.autograd.grad(ck.chunk_kda(*leaves)[0], leaves, do)

    trials, candidates = [], {}
    for i, change in enumerate([{}] + changes):  # compile each setting once; one that fails is reported
        try:
            fwd_bwd(change)
        except Exception as exc:  # a setting that does not compile (out of shared memory) is a result
            print(f"{change or 'defaults'}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        trials.append((i, change))
        candidates[f"{i}/fwd"] = functools.partial(fwd, change)
        candidates[f"{i}/fwd+bwd"] = functools.partial(fwd_bwd, change)
    # every setting and pass in turn, ``rounds`` times (paperclub.bench.measure)
    res = measure(candidates, rounds=rounds)
    for key, m in res.items():
        if not m.ok:
            raise RuntimeError(f"tune: setting {key} failed while timed: {m.error}")
    trials = [(change, res[f"{i}/fwd"].rounds, res[f"{i}/fwd+bwd"].rounds) for i, change in trials]
    rows = []
    for change, f_ms, fb_ms in trials:
        fwd_med, fb_med = statistics.median(f_ms), statistics.median(fb_ms)
        rows.append({"B": B, "T": T, "change": change, "fwd_ms": round(fwd_med, 4),
                     "fwd_range": [round(min(f_ms), 4), round(max(f_ms), 4)], "fwd_bwd_ms": round(fb_med, 4),
                     "fwd_bwd_range": [round(min(fb_ms), 4), round(max(fb_ms), 4)]})  # fmt: skip
        print(f"B={B} T={T} {str(change or 'defaults'):32s} fwd {fwd_med:7.3f} ms ({min(f_ms):.3f}-{max(f_ms):.3f})"
              f"  fwd+bwd {fb_med:7.3f} ms ({min(fb_ms):.3f}-{max(fb_ms):.3f})", flush=True)  # fmt: skip
    return rows


PRECISION_SHAPES = ((8, 2048), (2, 8192))


def precision(out_dir: Path | None, budget_s: float = 1e9) -> None:
    """fp16 and bf16 inputs: ours with each product precision of the intra-chunk algebra
    (chunk.DOT_PREC_FP16 / DOT_PREC_BF16 = tf32, tf32x3, ieee) beside fla's chunk_kda in the same
    dtype, mild gates (where precision shows), forward + backward. Each candidate's gradients are
    checked first against our fp32 path at the shape (the largest relative error is ``err_max``); the
    rows then come from interleaved rounds (``measure``)."""
    from repro.kda import chunk as ck

    start = time.perf_counter()
    report = Report(
        package="kda",
        title="KDA fwd+bwd: product precision of the intra-chunk algebra, fp16 and bf16, mild gates",
        peer="flash-linear-attention 0.6.0",
        columns=["impl", "dtype", "prec", "B", "T", "ms", "ms_min", "ms_max", "check", "err_max"],
        packages=["flash-linear-attention", "fla-core"],
        notes=(
            "H=16, K=V=128, g = logsigmoid(x) / 10 (mild). prec: the products of our fp32 intra-chunk and "
            "state algebra (chunk.DOT_PREC_FP16 for fp16, DOT_PREC_BF16 for bf16; defaults "
            f"{ck.DOT_PREC_FP16} / {ck.DOT_PREC_BF16}). err_max: the largest relative error of o and the "
            "input gradients against our fp32 path (ieee) on the same inputs. Medians and range of "
            f"{ROUNDS} interleaved rounds."
        ),
        measure_ceilings=False,
    )
    fns = impls()
    reference = fp32_path()
    for B, T in PRECISION_SHAPES:
        for dtype, setting in ((torch.float16, "DOT_PREC_FP16"), (torch.bfloat16, "DOT_PREC_BF16")):
            if time.perf_counter() - start > budget_s:
                print(f"precision: budget spent, B={B} T={T} {dtype} not measured", flush=True)
                continue
            q, k, v, g, beta = make_inputs(B, T, gate_scale=GATES["mild"])
            inputs = (q.to(dtype), k.to(dtype), v.to(dtype), g, beta)
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            do = torch.randn_like(inputs[2])
            cands, errs = {}, {}
            variants = [("ours", prec, {setting: prec}) for prec in DOT_PRECISION_CHOICES]
            if "fla_kda" in fns:
                variants.append(("fla_kda", "", {}))
            for name, prec, change in variants:
                fn = fns[name]

                def run_once(fn=fn, change=change, leaves=leaves, do=do):
                    with ck.changed_settings(change):
                        return torch.autograd.grad(fn(*leaves), leaves, do, allow_unused=True)

                out = errs[(name, prec)] = {}

                def check(fn=fn, change=change, out=out, x=inputs):
                    with ck.changed_settings(change):
                        gradient_check(fn, x, reference, tol=PRECISION_CHECK_TOL, errors_out=out)

                cands[f"{name}|{prec}"] = Candidate(fn=run_once, check=check)
            print(
                f"precision {dtype} B={B} T={T}: checking {', '.join(cands)} (first calls compile: minutes)",
                flush=True,
            )
            res = measure(cands, rounds=ROUNDS)
            for key, m in res.items():
                name, prec = key.split("|")
                err = errs.get((name, prec)) or {}
                report.add(impl=name, dtype=str(dtype).removeprefix("torch."), prec=prec, B=B, T=T,
                           err_max=round(max(err.values()), 5) if err else None, **m.row())  # fmt: skip
                print(f"{str(dtype):15s} B={B} T={T} {name:8s} {prec:7s} {m.row()}", flush=True)
            report.write(out_dir=out_dir, tag="precision")
    report.write(out_dir=out_dir, tag="precision")


#: the choices of chunk.DOT_PREC_FP16 / DOT_PREC_BF16 that --precision times
DOT_PRECISION_CHOICES = ("tf32", "tf32x3", "ieee")
#: --precision's check only refuses what is plainly wrong (bf16 rounding gives up to ~1.5e-2)
PRECISION_CHECK_TOL = {"o": 5e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2, "dg": 1e-1, "dbeta": 1e-1}


TUNE_COLUMNS = [
    "run",
    "B",
    "T",
    "change",
    "fwd_ms",
    "fwd_min",
    "fwd_max",
    "fwd_bwd_ms",
    "fwd_bwd_min",
    "fwd_bwd_max",
]


def tune_report(rows: list[dict], base: list[str], run: str = "") -> Report:
    """The rows of :func:`tune` as a results file (``<device>-tune.json``): one row per change
    (``change`` "defaults" or the settings as NAME=VALUE, over the defaults plus ``base``, the
    --set arguments), median and range of the interleaved rounds."""
    report = Report(
        package="kda",
        title="KDA launch settings, one change at a time (ours, bf16, H=16, K=V=128)",
        columns=TUNE_COLUMNS,
        notes=f"bench.py --tune: each change against the defaults{' with ' + ', '.join(base) if base else ''}, "
        f"every setting timed once per round in {TUNE_ROUNDS} interleaved rounds; ms is the median, min/max the range.",
        measure_ceilings=False,
    )
    for r in rows:
        change = ", ".join(f"{k}={v!r}" for k, v in r["change"].items()) or "defaults"
        report.add(
            run=run, B=r["B"], T=r["T"], change=change, fwd_ms=r["fwd_ms"], fwd_min=r["fwd_range"][0],
            fwd_max=r["fwd_range"][1], fwd_bwd_ms=r["fwd_bwd_ms"], fwd_bwd_min=r["fwd_bwd_range"][0],
            fwd_bwd_max=r["fwd_bwd_range"][1],
        )  # fmt: skip
    return report


def parse_settings(pairs: list[str], flag: str = "--set") -> dict:
    """``NAME=VALUE`` strings as a dict of settings of repro.kda.chunk (value parsed as a Python
    literal, else kept as a string); an unknown name is an error, not a silent no-op."""
    import ast

    from repro.kda import chunk as ck

    settings = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.isupper() or not hasattr(ck, name):
            raise SystemExit(f"{flag} {pair!r}: expected NAME=VALUE with NAME a setting of repro.kda.chunk")
        try:
            settings[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            settings[name] = text
    return settings


def apply_settings(pairs: list[str]) -> None:
    """Set settings of repro.kda.chunk from ``NAME=VALUE`` strings (see :func:`parse_settings`)."""
    from repro.kda import chunk as ck

    for name, value in parse_settings(pairs).items():
        setattr(ck, name, value)
        print(f"setting {name} = {value!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape, a smoke test")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default repro/kda/results)")
    ap.add_argument("--breakdown", action="store_true", help="GPU time per kernel, ours and fla, B=8, T=2048")
    ap.add_argument("--warm", action="store_true", help="compile and autotune every shape, time nothing")
    ap.add_argument(
        "--profile-target",
        action="store_true",
        help="for Nsight Compute (--profile-from-start off): one forward + backward of ours at B=8, T=2048 "
        "between cudaProfilerStart and Stop, after a warm-up",
    )
    ap.add_argument(
        "--tune",
        action="store_true",
        help="time ours with each launch setting of TUNING (or of --try) changed alone, at B=8, T=2048 "
        "or at each T of --seqlens",
    )
    ap.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="with --tune: one change to time instead of TUNING's (repeatable)",
    )
    ap.add_argument(
        "--precision",
        action="store_true",
        help="fp16 and bf16, mild gates: ours at each product precision (tf32, tf32x3, ieee) beside fla, "
        "fwd+bwd, written as <device>-precision.json",
    )
    ap.add_argument("--impls", default="", help="comma-separated subset of ours,fla_kda,fla_gdn,sdpa_flash")
    ap.add_argument(
        "--seqlens",
        default="",
        help="comma-separated T values of the main benchmark (e.g. 2048,4096; B = 16384 // T), written "
        "as <device>-seqlens-2048-4096.json",
    )
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new measurements after this")
    ap.add_argument(
        "--gates",
        default="",
        help="comma-separated subset of std,mild,varlen to run (e.g. varlen: the packed batch only), "
        "written as <device>-gates-<...>.json",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a launch setting of repro.kda.chunk first (e.g. BACKWARD=triton); repeatable",
    )
    args = ap.parse_args()
    apply_settings(args.set)
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    if any(T < 1 for T in seqlens):
        raise SystemExit(f"--seqlens {args.seqlens!r}: expected positive integers")
    if args.breakdown or args.tune:
        import json

        names = tuple(x for x in args.impls.split(",") if x) or (
            ("ours",) if args.tune else ("ours", "fla_kda")
        )
        result = breakdown(names=names) if args.breakdown else {}
        if args.tune:
            changes = [parse_settings(t.split(","), "--try") for t in args.tries] or None
            result["tune"] = [
                row for T in (seqlens or [2048]) for row in tune(max(1, TOKENS // T), T, changes=changes)
            ]
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            name = "breakdown.json" if args.breakdown else "tune.json"
            (args.out / name).write_text(json.dumps(result, indent=1))
        if args.tune:
            tune_report(result["tune"], args.set).write(out_dir=args.out, tag="tune")
    elif args.precision:
        precision(args.out, args.budget_s)
    elif args.profile_target:
        profile_target()
    elif args.warm:
        warm([4096] if args.quick else (seqlens or ALL_T))
    else:
        gates = [x for x in args.gates.split(",") if x] or None
        run(
            args.quick,
            args.out,
            args.budget_s,
            [x for x in args.impls.split(",") if x],
            seqlens or None,
            gates,
        )


if __name__ == "__main__":
    main()
