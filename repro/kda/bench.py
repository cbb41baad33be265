"""Benchmark: our chunkwise KDA against flash-linear-attention and causal flash attention.

``python -m repro.kda.bench [--quick] [--seqlens 2048,4096] [--only std,mild,varlen] [--impls ours,fla_kda]
[--set NAME=VALUE] [--out DIR] [--budget-s S] [--rounds N] [--tag TAG]`` (the common options are
``paperclub.bench``'s; ``--set`` changes a field of the :class:`repro.kda.KDAConfig` ours runs with).

Shapes: H = 16 heads, K = V = 128, bf16, B x T = 16384 tokens for T = 2k .. 32k; at T = 64k B = 1
(65536 tokens: B cannot go below 1). Parts (``--only``): ``std`` and ``mild``, two gate regimes
(:data:`GATES`) at every T; ``varlen``, one packed batch of 16384 tokens in sequences of different
lengths (``cu_seqlens``). Two more parts run only when named (issues #42, #37; not in the default
run): ``d256``, head size K = V = 256 (and 192, zero-padded to 256 by chunk_kda) beside fla's
chunk_kda, B x T = 16384 tokens at T = 8k, the default ``KDAConfig()``; ``dplr``, the
Kimi Linear paper's kernel comparison (§3, its Figure 2 as we read v2: batch 1, 16 heads; K = V =
128 here) at T = 4k, 16k and 64k (``--seqlens`` chooses others): ours and fla's KDA beside fla's
general DPLR chunk kernel ``chunk_dplr_delta_rule``, fed the same recurrence (:func:`repro.kda.reference.kda_as_dplr`).
Each row is the median over ``--rounds`` rounds (default 3), in each of which every implementation and pass at that shape is timed once in turn (``paperclub.bench.measure``,
CUDA events through triton's do_bench, itself a median):

* ``ours``: ``repro.kda.chunk_kda`` (Triton: four forward launches, three backward launches);
* ``fla_kda``: ``fla.ops.kda.chunk_kda`` (flash-linear-attention 0.6.0, default arguments);
* ``fla_gdn``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (scalar gate per head);
* ``sdpa_flash``: ``torch.nn.functional.scaled_dot_product_attention`` causal, flash backend;
* ``fla_dplr``, ``fla_dplr_lb`` (part ``dplr``): ``fla.ops.generalized_delta_rule.chunk_dplr_delta_rule``
  (fla 0.6.0) with its defaults (chunk 16, for gates of any size), and with ``lower_bound=-2.5``, the
  loosest bound fla's ``gate_bound_is_safe`` takes at chunk 64 (its tensor-core scheme there): the
  part's gates are clamped to [-2.5, 0) for every candidate (DPLR_G_MIN), which moves about 1e-7 of
  them (logsigmoid(x) / 2 passes -2.5 only for x < -5).

Before timing, ours and fla_kda are checked at the row's shape: output and gradients in bf16 against
our fp32 path (:func:`gradient_check`); one that fails is not timed. The DPLR candidates are checked
through that mapping (gradients reach q, k, v, g, beta) and timed on the mapped
tensors, their own inputs (the three elementwise products of the mapping are not in their time). ``rel_err_vs_fla`` (forward rows
of ``ours``) is ``||o_ours - o_fla|| / ||o_fla||`` on the same inputs; both run in bf16, so about 1e-2
is agreement. ``tflops``: :func:`flops` over the median time. Tuning sweeps, the product-precision
comparison, the per-kernel breakdown, Nsight Compute and the backward's diagnosis are in
``repro/kda/lab/`` (its README lists them).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from paperclub.bench import (
    Candidate,
    Plan,
    Report,
    Step,
    apply_settings,
    bench_parser,
    describe_changes,
    measure,
    parse_bench_args,
    select,
)
from paperclub.testing import rel_error
from repro.kda.config import KDAConfig
from repro.kda.reference import kda_as_dplr as dplr_inputs
from repro.kda.tiles import BT

H, K, V = 16, 128, 128
TOKENS = 16384
ALL_T = [2048, 4096, 8192, 16384, 32768, 65536]
ROUNDS = 3  # clock and temperature drift moved single timings by 5-8%: the median of interleaved rounds
DEVICE = "cuda"  # tests/test_bench.py runs the benchmark's logic on the CPU

GATES = {
    # a per-channel log-decay like a trained gate's: mostly mild, some channels fast (>= -10 per token)
    "std": 0.5,
    # mild: fla's gate_logit_normalizer 10 (decay rates near 1), where a wrong state backward shows
    "mild": 0.1,
}
DEFAULT_PARTS = (*GATES, "varlen")
PARTS = (*DEFAULT_PARTS, "d256", "dplr")
IMPLS = ("ours", "fla_kda", "fla_gdn", "sdpa_flash", "fla_dplr", "fla_dplr_lb")
# head sizes of the d256 part (192: padded to 256 by chunk_kda, fla's kernels take it as it is), its T
# (B = TOKENS // T), and the T of the dplr part (B = 1, the paper's Figure 2)
LARGE_HEADS = (256, 192)
LARGE_HEAD_T = (8192,)
DPLR_T = (4096, 16384, 65536)
DPLR_G_MIN = -2.5  # fla's DPLR takes chunk 64 for lower_bound >= -2.6 (gate_bound_is_safe)
# gradient check before timing, bf16 against our fp32 path at the same shape (relative error):
# bf16 rounding gives ~4e-3 (o) to ~1.5e-2 (dg) on an H100; a wrong kernel gives 1e-1 and more
CHECK_TOL = {"o": 2e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2, "dg": 6e-2, "dbeta": 6e-2}
# fla's DPLR kernels on KDA's recurrence: another factorisation (chunk 16, its own rounding of the
# mapped a, b, k'), checked at twice that; a wrong result is ten times off or more
DPLR_CHECK_TOL = {n: 2 * t for n, t in CHECK_TOL.items()}


def make_inputs(
    B: int, T: int, device: str | None = None, dtype=torch.bfloat16, seed: int = 0, gate_scale: float = 0.5,
    dk: int | None = None, dv: int | None = None,
):  # fmt: skip
    """q, k (L2-normalised), v in ``dtype``; g = logsigmoid(x) * gate_scale and beta in fp32; head
    sizes ``dk``, ``dv`` (default K, V)."""
    device = device or DEVICE
    dk, dv = dk or K, dv or V
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, device=device, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, dk, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, dv, device=device, generator=gen).to(dtype)
    g = (F.logsigmoid(torch.randn(B, T, H, dk, device=device, generator=gen)) * gate_scale).float()
    beta = torch.rand(B, T, H, device=device, generator=gen).float()
    return q, k, v, g, beta


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


def flops(
    impl: str, B: int, T: int, passes: str, dk: int | None = None, dv: int | None = None
) -> float | None:
    """FLOPs of one call, the algorithm's matmuls as written (dense blocks, no credit for the zeros of
    triangular ones), forward + backward counted as 3x the forward.

    KDA (ours, fla_kda; fla_gdn counted the same), per token and head with chunk C = 64: the decayed
    key products A_kk, A_qk (4 C K), the UT transform as a triangular solve (C^2 / 3), the WY factors
    W, U' (2 C K + 2 C V), the state recurrence (4 K V) and the output (2 K V + 2 C V). Causal
    attention (sdpa_flash): 2 T K + 2 T V per token and head, halved (the FlashAttention convention).
    None for the DPLR kernels (another algorithm: no count of ours for it)."""
    if impl.startswith("fla_dplr"):
        return None
    dk, dv, C = dk or K, dv or V, BT
    if impl == "sdpa_flash":
        per_token = (2 * T * dk + 2 * T * dv) / 2
    else:
        per_token = 6 * C * dk + 4 * C * dv + C * C / 3 + 6 * dk * dv
    fwd = per_token * B * T * H
    return fwd * (3.0 if passes == "fwd+bwd" else 1.0)


def impls(config: KDAConfig | None = None, cu_seqlens: torch.Tensor | None = None) -> dict:
    """name -> fn(q, k, v, g, beta) -> o. Ours runs with ``config``; with ``cu_seqlens``: ours and
    fla's KDA on a packed batch."""
    from repro.kda import chunk_kda as ours

    if cu_seqlens is not None:
        out = {
            "ours": lambda q, k, v, g, beta: ours(q, k, v, g, beta, cu_seqlens=cu_seqlens, config=config)[0]
        }
        try:
            from fla.ops.kda import chunk_kda as fla_kda

            out["fla_kda"] = lambda q, k, v, g, beta: fla_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens.long())[
                0
            ]
        except ImportError as exc:
            print(f"flash-linear-attention not importable ({exc}); varlen: ours only")
        return out
    out = {"ours": lambda q, k, v, g, beta: ours(q, k, v, g, beta, config=config)[0]}
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


def dplr_impls(config: KDAConfig | None = None) -> dict:
    """Part ``dplr``: name -> (fn(q, k, v, g, beta) -> o, checked, and the function timed on its own
    inputs, ``None`` for the same as checked, or ``dplr_inputs`` for the mapped tensors): ours, fla's
    KDA, fla's DPLR chunk kernel with its defaults and with ``lower_bound=DPLR_G_MIN``."""
    from repro.kda import chunk_kda as ours

    out = {"ours": (lambda q, k, v, g, beta: ours(q, k, v, g, beta, config=config)[0], None)}
    try:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
        from fla.ops.kda import chunk_kda as fla_kda
    except ImportError as exc:
        print(f"flash-linear-attention not importable ({exc}); dplr: ours only")
        return out
    out["fla_kda"] = (lambda q, k, v, g, beta: fla_kda(q, k, v, g, beta)[0], None)
    for name, kw in (("fla_dplr", {}), ("fla_dplr_lb", {"lower_bound": DPLR_G_MIN})):
        dplr = lambda q, kw_, v, a, b, gk, kw=kw: chunk_dplr_delta_rule(q, kw_, v, a, b, gk, **kw)[0]  # noqa: E731
        out[name] = (lambda *x, dplr=dplr: dplr(*dplr_inputs(*x)), dplr)
    return out


def fp32_path():
    """Our chunk_kda with the default config on fp32 inputs (ieee products): the reference of the
    gradient check (head sizes above 128 allowed)."""
    from repro.kda import chunk_kda

    config = KDAConfig()
    return lambda q, k, v, g, beta, cu_seqlens=None: chunk_kda(
        q.float(), k.float(), v.float(), g.float(), beta.float(), cu_seqlens=cu_seqlens, config=config
    )[0]


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


def plan_steps(Ts: list[int], parts: list[str], dplr_T=DPLR_T) -> list[Step]:
    """One step per (gate regime, T) in order of T, then the packed batch, then the large heads and
    the DPLR comparison where asked; each step's cost grows with its tokens (B x T)."""
    steps = [
        Step(f"{gates}@T={T}", kind="fixed", size=max(1, TOKENS // T) * T, data=(gates, T))
        for T in Ts
        for gates in GATES
        if gates in parts
    ]
    if "varlen" in parts:
        steps.append(
            Step(f"varlen@T={TOKENS}", kind="varlen", size=TOKENS, first_cost=1.5, data=("varlen", TOKENS))
        )
    if "d256" in parts:
        steps += [
            Step(f"d{D}@T={T}", kind="d256", size=TOKENS, first_cost=4.0, data=(f"d{D}", T))
            for D in LARGE_HEADS
            for T in LARGE_HEAD_T
        ]
    if "dplr" in parts:
        steps += [Step(f"dplr@T={T}", kind="dplr", size=T, first_cost=3.0, data=("dplr", T)) for T in dplr_T]
    return steps


def run(
    *,
    quick: bool = False,
    out_dir=None,
    budget=None,
    parts: list[str] | None = None,
    names: list[str] | None = None,
    seqlens: list[int] | None = None,
    config: KDAConfig | None = None,
    rounds: int | None = None,
    tag: str | None = None,
) -> None:
    """The benchmark at every T of ALL_T (``quick``: T = 4096 only, no packed batch; ``seqlens``: those
    T), the parts of ``parts`` (default all of PARTS), the candidates ``names`` (default all). A partial
    run writes under its own tag (``quick``, ``seqlens-<T>-...``, ``gates-<part>-...``) so the full
    results file is left alone. Every candidate's output and gradients are checked at the shape before
    it is timed; one that fails is not timed. ``budget`` (a paperclub.bench.Budget): shapes predicted
    to end after it are not started, and named in the notes."""
    from paperclub.bench import Budget

    config = KDAConfig() if config is None else config
    rounds = ROUNDS if rounds is None else rounds
    parts = list(parts or DEFAULT_PARTS)
    budget = budget or Budget(None)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("repro.kda.bench needs a CUDA GPU")
    Ts = [4096] if quick else (seqlens or ALL_T)
    if quick:
        parts = [p for p in parts if p != "varlen"]
    if tag is None:
        tag = "quick" if quick else ("seqlens-" + "-".join(map(str, seqlens)) if seqlens else "")
        if set(parts) != set(DEFAULT_PARTS) and not quick:
            tag = "-".join(x for x in (tag, "gates", *sorted(parts)) if x)
    changes = describe_changes(config, KDAConfig())
    report = Report(
        package="kda",
        title="KDA forward and forward+backward, H=16, bf16, K=V=D (128 unless the row says)",
        peer="flash-linear-attention 0.6.0",
        columns=[
            "impl",
            "gates",
            "B",
            "T",
            "D",
            "pass",
            "ms",
            "ms_min",
            "ms_max",
            "tflops",
            "check",
            "rel_err_vs_fla",
        ],
        packages=["flash-linear-attention", "fla-core"],
        notes=(
            "B*T = 16384 tokens except T = 65536 (B = 1, 65536 tokens). gates: 'std' g = logsigmoid(x) * 0.5, "
            "'mild' g = logsigmoid(x) / 10 (fla's gate_logit_normalizer 10); 'varlen' rows: one packed batch "
            "of 16384 tokens in sequences of different lengths (cu_seqlens). "
            "ours: Triton forward (4 launches) and backward (3 launches), "
            f"KDAConfig {'defaults' if not changes else 'with ' + changes}. Before timing, ours and "
            "fla_kda are checked at the row's shape: output and gradients in bf16 against our fp32 path "
            f"(relative error under {CHECK_TOL}); 'check' says so. rel_err_vs_fla: our forward output against "
            f"fla's chunk_kda on the same bf16 inputs. tflops: bench.flops (the algorithm's matmuls, fwd+bwd "
            f"3x fwd) over ms. Each row: median (and range) of {rounds} rounds in "
            "which every implementation and pass at that shape is timed in turn (paperclub.bench.measure)."
        ),
        measure_ceilings=False,
    )
    fns = impls(config)
    if names:
        fns = {n: f for n, f in fns.items() if n in names}
    print(
        f"kda bench on {torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}: {', '.join(fns)}",
        flush=True,
    )
    failed: list[str] = []
    base_notes = report.notes
    reference = fp32_path()
    dplr_T = [4096] if quick else (seqlens or DPLR_T)
    plan = Plan(plan_steps(Ts, parts, dplr_T), budget, reserve_s=20)
    for step in plan:
        t_start = time.monotonic()
        gates, T = step.data
        D, timed_on = K, {}
        if gates == "varlen":
            B, cu = 1, varlen_offsets(TOKENS)
            inputs = make_inputs(1, TOKENS, gate_scale=GATES["std"])
            cands = {n: f for n, f in impls(config, cu_seqlens=cu).items() if n in fns}
        elif gates.startswith("d") and gates[1:].isdigit():  # d256, d192: large heads beside fla
            B, cu, D = max(1, TOKENS // T), None, int(gates[1:])
            inputs = make_inputs(B, T, gate_scale=GATES["std"], dk=D, dv=D)
            big = impls(config)
            cands = {n: f for n, f in big.items() if n in ("ours", "fla_kda") and (not names or n in names)}
        elif gates == "dplr":
            B, cu = 1, None
            q, k, v, g, beta = make_inputs(1, T, gate_scale=GATES["std"])
            inputs = (q, k, v, g.clamp(min=DPLR_G_MIN), beta)  # the bound fla_dplr_lb is told
            pairs = {n: p for n, p in dplr_impls(config).items() if not names or n in names}
            cands = {n: p[0] for n, p in pairs.items()}
            timed_on = {n: (p[1], dplr_inputs(*inputs)) for n, p in pairs.items() if p[1] is not None}
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
            if name in ("ours", "fla_kda") or name.startswith("fla_dplr"):
                ref = (lambda *x, cu=cu: reference(*x, cu_seqlens=cu)) if cu is not None else reference
                tol = DPLR_CHECK_TOL if name.startswith("fla_dplr") else None
                check = lambda fn=fn, ref=ref, x=inputs, tol=tol: gradient_check(fn, x, ref, tol=tol)  # noqa: E731
            # what is timed: the checked function on the inputs, or (DPLR) the kernel on its own inputs
            fn, x_timed = timed_on.get(name, (fn, inputs))
            leaves = [x.detach().clone().requires_grad_(True) for x in x_timed]
            do = torch.randn_like(inputs[2])

            def fwd_bwd(fn=fn, leaves=leaves, do=do):
                o = fn(*leaves)
                return torch.autograd.grad(o, leaves, do, allow_unused=True)

            candidates[(name, "fwd")] = Candidate(fn=lambda fn=fn, x=x_timed: fn(*x), check=check)
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
        t_checked = time.monotonic()
        timed = {f"{n}|{p}": Candidate(fn=c.fn) for (n, p), c in candidates.items() if n in ok}
        res.update(measure(timed, rounds=rounds))
        for key, m in res.items():
            name, label = key.split("|")
            if m.ok and m.median_ms is None:
                continue
            err = errs.get(name) if label == "fwd" else None
            verdict = "ok" if name in ok else res[f"{name}|fwd"].row()["check"]
            if name not in ("ours", "fla_kda") and not name.startswith("fla_dplr"):
                verdict = "not checked (another function)"
            row = m.row()
            row["check"] = verdict
            count = flops(name, B, T, label, D, D)
            tflops = count / (m.median_ms * 1e9) if m.median_ms and count else None
            report.add(
                impl=name, gates=gates, B=B, T=T, D=D, rel_err_vs_fla=err, tflops=tflops, **row,
                **{"pass": label},
            )  # fmt: skip
            if m.median_ms is not None:
                print(
                    f"{gates:6s} T={T:6d} B={B:2d} {name:11s} {label:8s} {m.median_ms:8.3f} ms "
                    f"({m.min_ms:.3f}-{m.max_ms:.3f})",
                    flush=True,
                )
        del inputs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        plan.record(step, check_s=t_checked - t_start, time_s=time.monotonic() - t_checked)
        report.notes = _notes(base_notes, plan, failed)
        report.write(out_dir=out_dir, tag=tag)  # keep what was measured so far
    report.notes = _notes(base_notes, plan, failed)
    for gates in (x for x in GATES if x in parts):
        report.plot(title=f"forward time, {gates} gates", x="T", y="ms", series="impl",
                    where={"pass": "fwd", "gates": gates}, logx=True, logy=True)  # fmt: skip
        report.plot(title=f"forward + backward time, {gates} gates", x="T", y="ms", series="impl",
                    where={"pass": "fwd+bwd", "gates": gates}, logx=True, logy=True)  # fmt: skip
    if "dplr" in parts:
        for label in ("fwd", "fwd+bwd"):
            report.plot(title=f"KDA against general DPLR, B=1, H=16, D=128, {label}", x="T", y="ms",
                        series="impl", where={"pass": label, "gates": "dplr"}, logx=True, logy=True)  # fmt: skip
    report.measure_ceilings = not quick and budget.allows(reserve_s=10)
    report.write(out_dir=out_dir, tag=tag)


def _notes(base: str, plan: Plan, failed: list[str]) -> str:
    skipped = plan.notes()
    return base + (f" {skipped}" if skipped else "") + (f" Failed: {'; '.join(failed)}." if failed else "")


def main(argv=None) -> None:
    ap = bench_parser(__doc__.splitlines()[0], rounds=ROUNDS, quick_help="T = 4096 only, no packed batch")
    ap.add_argument(
        "--seqlens",
        default="",
        help="comma-separated T values (e.g. 2048,4096; B = 16384 // T), written as <device>-seqlens-2048-4096.json",
    )
    ap.add_argument("--impls", default="", help=f"comma-separated subset of {','.join(IMPLS)}")
    args = parse_bench_args(ap, argv)
    try:
        # d256 and dplr run only when named
        parts = select(PARTS, args.only, "part") if args.only else list(DEFAULT_PARTS)
        names = select(IMPLS, [x for x in args.impls.split(",") if x], "implementation")
        config = apply_settings(KDAConfig(), args.settings)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        seqlens = [int(x) for x in args.seqlens.split(",") if x]
    except ValueError:
        seqlens = [0]
    if any(T < 1 for T in seqlens):
        raise SystemExit(f"--seqlens {args.seqlens!r}: expected positive integers")
    run(
        quick=args.quick, out_dir=args.out, budget=args.budget, parts=parts, names=names,
        seqlens=seqlens or None, config=config, rounds=args.rounds, tag=args.tag or None,
    )  # fmt: skip


if __name__ == "__main__":
    main()
