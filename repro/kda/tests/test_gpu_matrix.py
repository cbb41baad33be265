"""The GPU test matrix of chunk_kda's default path, in the spirit of flash-linear-attention's
``tests/ops/test_kda.py::test_chunk``: its cases, its way of drawing inputs (q, k, v uniform, q and k
L2-normalised, ``g = logsigmoid(x) / gate_logit_normalizer``, gates zeroed with probability
``mask_p``, h0 and dht random) and its tolerances on its error measure, RMS(diff) / RMS(ref), which
is :func:`paperclub.testing.rel_error` (the Frobenius ratio is the RMS ratio).

fla's tolerances (its fp16 inputs): 0.005 for o and the final state, 0.008 for dq, dk, dv, dh0, 0.02
for dg and dbeta. Our reference is the recurrence in fp64 on the GPU (fla's runs in the inputs'
precision); under compute-sanitizer (the GPU job's second pass, for memory errors) only our kernels run. bf16 keeps 3 fewer
mantissa bits than fp16 (2^-8 against 2^-11 unit roundoff): its tolerances are fla's times 4, still
well under what a wrong kernel gives (the split backward before the fix: dk 0.10, dh0 2.0 in bf16).
fp32 inputs take fla's fp16 tolerances divided by 50 (fp32 products at ieee precision; measured
below 1e-6 on an H100).

Cases cover what users pass: fp16, bf16 and fp32; K = V in {64, 128} and fla's 60 and 100 (padded
inside chunk_kda); mild (normaliser 10), strong (1), very strong (0.1), mixed (mask_p 0.5) gates; T a
multiple of 64 and not; B = 1 and H = 1; with and without h0 and dht; and the state value blocks of
the fused state backward (16, 32, 64, 128) in the mild case, which the wrong compile hid in.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paperclub.testing import log_measure, rel_error, sanitizing
from repro.kda import KDAConfig, chunk_kda, recurrent_kda

CLAIM = "kda/chunk-equals-recurrent"
SECTION = "§3.1"

FLA_TOL = {"o": 5e-3, "hT": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}
SCALE_TOL = {torch.float16: 1.0, torch.bfloat16: 4.0, torch.float32: 1 / 50}


def fla_inputs(B, T, H, D, gate_norm, mask_p, dtype, h0=True, dht=True, seed=42):
    """Inputs as fla's test_chunk draws them, in fp64 on the CPU (cast to ``dtype`` for the kernel)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.rand(B, T, H, D, generator=gen, dtype=torch.float64), p=2, dim=-1)
    k = F.normalize(torch.rand(B, T, H, D, generator=gen, dtype=torch.float64), p=2, dim=-1)
    v = torch.rand(B, T, H, D, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)) / gate_norm
    g = g * (torch.rand(g.shape, generator=gen, dtype=torch.float64) > mask_p)
    beta = torch.randn(B, T, H, generator=gen, dtype=torch.float64).sigmoid()
    x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    # the kernel's inputs are rounded to dtype; the reference takes the same rounded values
    x = {n: t.to(dtype).double() if n in ("q", "k", "v", "beta") else t for n, t in x.items()}
    x["h0"] = torch.randn(B, H, D, D, generator=gen, dtype=torch.float64) if h0 else None
    do = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).to(dtype).double()
    dhT = torch.randn(B, H, D, D, generator=gen, dtype=torch.float64) if dht else None
    return x, do, dhT


def errors(x, do, dhT, dtype, scale, with_fla=True, config=None):
    """Errors of chunk_kda (in ``dtype``) against the fp64 recurrence, both on the GPU."""
    names = [n for n in ("q", "k", "v", "g", "beta", "h0") if x[n] is not None]
    ref = {n: x[n].to("cuda", copy=True).requires_grad_(True) for n in names}
    gpu = {
        n: x[n].to("cuda", dtype if n in ("q", "k", "v", "beta") else torch.float32).requires_grad_(True)
        for n in names
    }
    results = {}
    sides = [("ours", gpu, "cuda")] if sanitizing() else [("ours", gpu, "cuda"), ("ref", ref, "cuda")]
    peer = fla_chunk_kda()
    # the peer's own error on the same inputs: fla's chunk_kda, same dtypes, fresh leaves; in the 16-bit
    # dtypes at D = 128 only (each new dtype and head dim costs fla an autotuning of every kernel)
    if (
        with_fla
        and peer is not None
        and not sanitizing()
        and dtype != torch.float32
        and x["q"].shape[-1] == 128
    ):
        fla = {n: t.detach().clone().requires_grad_(True) for n, t in gpu.items()}
        sides.append(("fla", fla, "cuda"))
    for side, t, dev in sides:
        fn = {"ref": recurrent_kda, "ours": chunk_kda, "fla": peer}[side]
        kw = {"config": config} if side == "ours" else {}
        try:
            o, hT = fn(t["q"], t["k"], t["v"], t["g"], t["beta"], scale, t.get("h0"), True, **kw)
            outs, grads = [o], [do.to(dev, o.dtype)]
            if dhT is not None:
                outs.append(hT)
                grads.append(dhT.to(dev, hT.dtype))
            torch.autograd.backward(outs, grads)
        except Exception as exc:  # the peer's failure is reported in the log, ours fails the test
            if side != "fla":
                raise
            results["fla_failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        results[side] = {"o": o, "hT": hT, **{"d" + n: t[n].grad for n in names}}
    torch.cuda.synchronize()
    if "ref" not in results:
        return {}, {}
    ref_out = results["ref"]
    ours = {n: rel_error(results["ours"][n], ref_out[n]) for n in ref_out}
    theirs = {n: rel_error(results["fla"][n], ref_out[n]) for n in ref_out} if "fla" in results else {}
    if "fla_failed" in results:
        theirs = {"failed": results["fla_failed"]}
    return ours, theirs


def fla_chunk_kda():
    """fla's chunk_kda as fn(q, k, v, g, beta, scale, h0, output_final_state), or None if not installed."""
    try:
        from fla.ops.kda import chunk_kda as fla_kda
    except ImportError:
        return None

    def run(q, k, v, g, beta, scale, h0, output_final_state):
        return fla_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state)

    return run


def check(case, dtype, with_fla=True, **settings):
    """``settings``: fields of KDAConfig changed from the defaults for our side."""
    x, do, dhT = fla_inputs(*case["shape"], case["gate_norm"], case["mask_p"], dtype, case["h0"], case["dht"])
    if case.get("refused"):
        # a difference from fla: per-token decay below gate.G_MIN is refused, not computed (inf before)
        with pytest.raises(ValueError, match=r"must lie in \[-10, 0\]"):
            errors(x, do, dhT, dtype, case["scale"])
        return
    errs, fla_errs = errors(x, do, dhT, dtype, case["scale"], with_fla, KDAConfig(**settings))
    log_measure(
        "kda/gpu-matrix", case=case, dtype=str(dtype), settings=settings,
        errors={n: float(f"{e:.3g}") for n, e in errs.items()},
        fla_errors={n: e if isinstance(e, str) else float(f"{e:.3g}") for n, e in fla_errs.items()},
        tolerance={n: FLA_TOL[n] * SCALE_TOL[dtype] for n in errs},
    )  # fmt: skip
    over = {
        n: (f"{e:.2e}", FLA_TOL[n] * SCALE_TOL[dtype])
        for n, e in errs.items()
        if not e <= FLA_TOL[n] * SCALE_TOL[dtype]
    }
    assert not over, f"errors over tolerance (name: error, tolerance): {over}; all: {errs}; fla's: {fla_errs}"


def case(B, T, H, D, scale, gate_norm, mask_p=0.0, h0=True, dht=True, refused=False):
    return {
        "shape": (B, T, H, D),
        "scale": scale,
        "gate_norm": gate_norm,
        "mask_p": mask_p,
        "h0": h0,
        "dht": dht,
        "refused": refused,
    }


# fla's test_chunk cases (B, T, H, D, scale, gate_logit_normalizer, mask_p), the one with fla's own
# gate (use_gate_in_kernel) run with the plain logsigmoid gate, plus ours for B = H = 1, no states,
# T on and off the chunk size
CASES = {
    "fla-B1-T63-D64": case(1, 63, 1, 64, 1.0, 1.0),
    "fla-B2-T500-D60": case(2, 500, 3, 60, 1.0, 1.0),
    "fla-B2-T1000-D64-masked": case(2, 1000, 3, 64, 0.1, 1.0, mask_p=0.5),
    # g = logsigmoid(x) / 0.1 reaches about -40 per token: outside our kernels' range, refused
    "fla-B3-T1024-D100-very-strong": case(3, 1024, 4, 100, 1.0, 0.1, refused=True),
    "fla-B4-T1024-D128": case(4, 1024, 4, 128, 0.1, 1.0),
    "fla-B2-T1500-D128-mild": case(2, 1500, 4, 128, 0.1, 10.0),
    "fla-B4-T2048-D64": case(4, 2048, 8, 64, 0.1, 1.0),
    "B1-H1-T300-D128-mild": case(1, 300, 1, 128, 0.1, 10.0),
    "B1-H1-T64-D128-no-states": case(1, 64, 1, 128, 0.1, 10.0, h0=False, dht=False),
    "B2-T200-D128-mixed-no-h0": case(2, 200, 2, 128, 0.1, 10.0, mask_p=0.3, h0=False),
}


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("name", list(CASES))
def test_default_path_on_gpu(name, dtype):
    """The default forward and backward (every switch as shipped) on fla's cases and ours."""
    check(CASES[name], dtype)


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("bv", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
def test_state_value_blocks_on_gpu(bv, dtype):
    """The fused state backward at every value block its rule can pick, in the mild-gate case where a
    wrong dS carried across chunks shows (fla's B=2, T=1500, H=4, D=128, normaliser 10)."""
    check(CASES["fla-B2-T1500-D128-mild"], dtype, with_fla=False, state_bwd_bv=bv)


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize(
    "prec",
    [
        pytest.param(
            "tf32",
            marks=pytest.mark.xfail(
                strict=False,
                reason="tf32 products: fp16 errors 4-13x fla's with mild gates in the 2026-11-24 H100 run, "
                "just inside the tolerance in the 2026-11-25 compute-sanitizer pass: at the edge, not a default",
            ),
        ),
        "ieee",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("name", ["fla-B2-T1500-D128-mild", "B1-H1-T64-D128-no-states"])
def test_dot_precision_settings_on_gpu(name, dtype, prec):
    """The other intra-chunk product precisions a user can pick for fp16 (KDAConfig.dot_prec_fp16;
    the default is tf32x3) on the cases where the mild gates make the chunk's triangular solve
    ill-conditioned: ieee must pass; tf32 (the bf16 default) is what failed here, kept as an xfail
    (not strict: it sits at the tolerance's edge and passed once) so the record says why fp16 does
    not use it."""
    check(CASES[name], dtype, with_fla=False, dot_prec_fp16=prec)
