"""The GPU test matrix of chunk_kda: flash-linear-attention 0.6.0's own chunk_kda test matrix
(``tests/ops/test_kda.py``: every case of ``test_chunk`` and ``test_chunk_varlen``, drawn as fla
draws them, checked in fla's error measure and tolerances), plus cases of ours.

Which file: fla's tests are not in its wheels or sdists; we read ``tests/ops/test_kda.py`` as stored
at commit d1097c6 (the safe_gate / disable_recompute matrix; every argument it passes exists in
0.6.0's ``chunk_kda``, released 2026-10-23), facts only, through the search tool. Each fla case is
run as follows, since our chunk_kda takes normalised q, k and the log-decay itself (as fla's does
without its fused extras):

* ``use_qk_l2norm_in_kernel``: fla normalises q, k inside its kernel; here PyTorch's F.normalize
  runs before chunk_kda, as fla's reference does (same math, same gradient to the raw q, k);
* ``use_gate_in_kernel``: fla computes ``g = -exp(A_log) softplus(g_raw + dt_bias)`` (with
  ``safe_gate``: ``-5 sigmoid(exp(A_log)(g_raw + dt_bias))``) inside; here the same formula runs in
  PyTorch before chunk_kda, and A_log's and dt_bias's gradients reach them through our dg;
* ``safe_gate`` (inputs clamped to [-5, 0], or the lower-bound gate) and ``disable_recompute`` are
  fla's kernel choices: the inputs are drawn as fla draws them for each, our kernels are the same.

Gates far below our kernels' range are in the matrix: fla's very strong case (normaliser 0.1, g
down to about -40), the gate-in-kernel ones, and the varlen cases' masked entries at -1000: chunk_kda
clamps them to -10 (gate.py). The clamp's own error in these measures (the fp64 recurrence with and
without it, same inputs, 2026-11-28): below 8e-5 for o, the final state and dq dk dv dbeta on every
such case, up to 3.1e-4 for dg and dh0 in the very strong one (where the exact gradient to h0 has
decayed by e^-40): under every 16-bit tolerance, not under fp32's fla / 50. So fp32 cases whose
gates reach below -10 take the clamp's budget instead, 1e-3 (FP32_CLAMP_TOL), and say so in the log.

Error measure: RMS(diff) / RMS(ref), fla's ``assert_close`` ratio, which is
:func:`paperclub.testing.rel_error`. fla's tolerances (fp16 inputs): test_chunk 0.005 o and final
state, 0.008 dq dk dv dh0, 0.02 dg dbeta, 0.008 d(dt_bias) (d(A_log): 0.003, a warning only in fla:
logged, not asserted); test_chunk_varlen 0.005, 0.007 dq dv dh0, 0.008 dk, 0.015 dg dbeta, 0.005
d(dt_bias). Our reference is the recurrence in fp64 on the GPU (fla's runs in the inputs' precision);
under compute-sanitizer (the GPU job's second pass, for memory errors) only our kernels run. bf16
keeps 3 fewer mantissa bits than fp16 (2^-8 against 2^-11 unit roundoff): its tolerances are fla's
times 4. fp32 inputs take fla's divided by 50 (ieee products; measured below 1.1e-6 on an H100).

fla's head size 256 (varlen case 5) runs with the default config: every case of this matrix above 128 (D = 192 fp16/bf16, D = 256
fp16/bf16/fp32, varlen D = 256) passed on an H200 on 28 Nov 2026, fp32 D = 256 after its shared-memory
fix. fla's own errors on the same inputs
are logged beside ours where it is installed (16-bit, D = 128: each new shape and dtype costs fla an
autotuning of every kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from paperclub.testing import log_measure, rel_error, sanitizing
from paperclub.triton_compat import interpreting
from repro.kda import KDAConfig, chunk_kda, recurrent_kda
from repro.kda.gate import G_MIN

CLAIM = "kda/chunk-equals-recurrent"
SECTION = "§3.1 (arXiv v2)"

CHUNK_TOL = {
    "o": 5e-3,
    "hT": 5e-3,
    "dq": 8e-3,
    "dk": 8e-3,
    "dv": 8e-3,
    "dh0": 8e-3,
    "dg": 2e-2,
    "dbeta": 2e-2,
}
CHUNK_TOL |= {"ddt_bias": 8e-3}
VARLEN_TOL = {"o": 5e-3, "hT": 5e-3, "dq": 7e-3, "dk": 8e-3, "dv": 7e-3, "dh0": 7e-3, "dg": 1.5e-2}
VARLEN_TOL |= {"dbeta": 1.5e-2, "ddt_bias": 5e-3}
SCALE_TOL = {torch.float16: 1.0, torch.bfloat16: 4.0, torch.float32: 1 / 50}
FP32_CLAMP_TOL = 1e-3


@dataclass(frozen=True)
class Case:
    """One test case. ``draw``: "chunk" (fla's test_chunk: q, k, v uniform, g = logsigmoid(x) /
    gate_norm masked to 0 with probability mask_p) or "varlen" (fla's test_chunk_varlen: q, v
    normal, k normalised normal, and entries of g set to -1000 with probability mask_p)."""

    B: int
    T: int
    H: int
    D: int
    scale: float | None
    gate_norm: float = 1.0
    mask_p: float = 0.0
    l2norm_in_kernel: bool = False
    gate_in_kernel: bool = False
    safe_gate: bool = False
    disable_recompute: bool = False
    cu_seqlens: tuple[int, ...] | None = None
    h0: bool = True
    dht: bool = True
    draw: str = "chunk"

    @property
    def tol(self) -> dict[str, float]:
        return VARLEN_TOL if self.draw == "varlen" else CHUNK_TOL


def draw_inputs(
    case: Case, dtype: torch.dtype, seed: int = 42
) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """The leaves fla's test draws for ``case`` (fp64 on the CPU; q, k, v, beta and a 16-bit raw
    gate rounded to ``dtype``, as the kernel gets them), dO and dh_T."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    B, T, H, D = case.B, case.T, case.H, case.D

    def rnd(*shape, normal=True):
        return (torch.randn if normal else torch.rand)(*shape, generator=gen, dtype=f64)

    if case.draw == "chunk":
        q, k, v = rnd(B, T, H, D, normal=False), rnd(B, T, H, D, normal=False), rnd(B, T, H, D, normal=False)
        g = rnd(B, T, H, D)
        leaves = {"q": q, "k": k, "v": v}
        if case.gate_in_kernel:
            leaves |= {"g": g, "A_log": rnd(H), "dt_bias": rnd(H * D)}
        else:
            g = F.logsigmoid(g) / case.gate_norm
            g = g * (rnd(*g.shape, normal=False) > case.mask_p)
            leaves["g"] = g.clamp(-5, 0) if case.safe_gate else g
        leaves["beta"] = rnd(B, T, H).sigmoid()
    else:
        leaves = {"q": rnd(B, T, H, D), "k": F.normalize(rnd(B, T, H, D), dim=-1), "v": rnd(B, T, H, D)}
        g = rnd(B, T, H, D)
        if case.gate_in_kernel:
            leaves |= {"A_log": torch.empty(1, 1, H, 1, dtype=f64).uniform_(1, 16, generator=gen).log()}
            leaves |= {"dt_bias": rnd(H * D)}
        else:
            g = F.logsigmoid(g) * (rnd(*g.shape, normal=False) > case.mask_p)
        keep = rnd(*g.shape, normal=False) > case.mask_p
        g = torch.where(keep, g, -1000.0)
        leaves["g"] = g.clamp(-5, 0) if case.safe_gate else g
        leaves["beta"] = rnd(B, T, H, normal=False).sigmoid()
    rounded = ("q", "k", "v", "beta") + (("g",) if case.gate_in_kernel and case.draw == "varlen" else ())
    leaves = {n: x.to(dtype).double() if n in rounded else x for n, x in leaves.items()}
    states = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    if case.h0:
        leaves["h0"] = rnd(states, H, D, D)
    do = rnd(B, T, H, D).to(dtype).double()
    dhT = None
    if case.dht:
        dhT = rnd(states, H, D, D, normal=case.draw == "chunk")
    return leaves, do, dhT


def kda_inputs(case: Case, t: dict) -> tuple:
    """q, k, v, g, beta, h0 for the KDA operator from the leaves: fla's fused extras (L2 norm of q
    and k, the gate's activation) in PyTorch, differentiable."""
    q = F.normalize(t["q"], p=2, dim=-1)
    k = t["k"] if case.draw == "varlen" else F.normalize(t["k"], p=2, dim=-1)
    g = t["g"]
    if case.gate_in_kernel:
        H, D = case.H, case.D
        x = g.to(t["dt_bias"].dtype) + t["dt_bias"].view(H, D)
        rate = t["A_log"].view(H, 1).exp()
        g = -5.0 * torch.sigmoid(rate * x) if case.safe_gate else -rate * F.softplus(x)
    return q, k, t["v"], g, t["beta"], t.get("h0")


def run(fn, case: Case, t: dict, do, dhT, **kw) -> dict[str, torch.Tensor]:
    """Outputs and gradients of one side. The reference (recurrent_kda) runs packed sequences one
    by one, each with its own backward right away (its fp64 autograd graph holds a few [K, V] states
    per token: 24 GB for fla's 4096 tokens at D = 256 at once, 11 GB for its longest sequence)."""
    q, k, v, g, beta, h0 = kda_inputs(case, t)
    do = do.to(q.device)
    dhT = None if dhT is None else dhT.to(q.device)

    def backward(o, hT, do, dhT, **kw):
        outs, grads = [o], [do.to(o.dtype)]
        if dhT is not None:
            outs.append(hT)
            grads.append(dhT.to(hT.dtype))
        torch.autograd.backward(outs, grads, **kw)

    if case.cu_seqlens is None or fn is not recurrent_kda:
        extra = (
            {} if case.cu_seqlens is None else {"cu_seqlens": torch.tensor(case.cu_seqlens, device=q.device)}
        )
        o, hT = fn(q, k, v, g, beta, case.scale, h0, True, **extra, **kw)
        backward(o, hT, do, dhT)
    else:
        outs, states = [], []
        for i, (a, b) in enumerate(zip(case.cu_seqlens[:-1], case.cu_seqlens[1:], strict=True)):
            s = slice(a, b)
            o_i, h_i = fn(
                q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], case.scale,
                None if h0 is None else h0[i : i + 1], True,
            )  # fmt: skip
            # the shared part of the graph (q's L2 norm, the gate) is kept for the next sequences
            backward(o_i, h_i, do[:, s], None if dhT is None else dhT[i : i + 1], retain_graph=True)
            outs.append(o_i.detach())
            states.append(h_i.detach())
        o, hT = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return {"o": o, "hT": hT, **{"d" + n: x.grad for n, x in t.items()}}


def errors(
    case: Case,
    dtype: torch.dtype,
    with_fla: bool = True,
    config: KDAConfig | None = None,
    device: str = "cuda",
):
    """Errors of chunk_kda (in ``dtype``) against the fp64 recurrence, both on ``device``; fla's on
    the same inputs where asked and installed (GPU only)."""
    leaves, do, dhT = draw_inputs(case, dtype)
    ref = {n: x.to(device, copy=True).requires_grad_(True) for n, x in leaves.items()}

    def ours_leaf(n, x):
        # q, k, v, beta in the inputs' dtype (and fla's raw varlen gate, drawn in it); the rest fp32
        low = n in ("q", "k", "v", "beta") or (n == "g" and case.gate_in_kernel and case.draw == "varlen")
        return x.to(device, dtype if low else torch.float32).requires_grad_(True)

    gpu = {n: ours_leaf(n, x) for n, x in leaves.items()}
    config = config or KDAConfig()
    results = {"ours": run(chunk_kda, case, gpu, do, dhT, config=config)}
    if sanitizing():
        return {}, {}
    results["ref"] = run(recurrent_kda, case, ref, do, dhT)
    peer = fla_chunk_kda() if device == "cuda" else None
    if with_fla and peer is not None and dtype != torch.float32 and case.D == 128:
        try:
            fla = {n: x.detach().clone().requires_grad_(True) for n, x in gpu.items()}
            results["fla"] = run(peer, case, fla, do, dhT)
        except Exception as exc:  # the peer's failure is reported in the log, ours fails the test
            results["fla_failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if device == "cuda":
        torch.cuda.synchronize()
    ref_out = results["ref"]
    ours = {n: rel_error(results["ours"][n], x) for n, x in ref_out.items() if x is not None}
    theirs = {
        n: rel_error(results["fla"][n], x) for n, x in ref_out.items() if x is not None and "fla" in results
    }
    if "fla_failed" in results:
        theirs = {"failed": results["fla_failed"]}
    return ours, theirs


def fla_chunk_kda():
    """fla's chunk_kda as fn(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens=None), or
    None if not installed."""
    try:
        from fla.ops.kda import chunk_kda as fla_kda
    except ImportError:
        return None

    def run_fla(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens=None):
        return fla_kda(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip

    return run_fla


def clamped(case: Case) -> bool:
    """Whether the case's log-decays reach below gate.G_MIN (chunk_kda clamps them)."""
    leaves, _, _ = draw_inputs(case, torch.float32)
    return bool((kda_inputs(case, leaves)[3] < G_MIN).any())


def check(case: Case, dtype: torch.dtype, with_fla: bool = True, device: str = "cuda", **settings) -> None:
    """``settings``: fields of KDAConfig changed for our side."""
    config = KDAConfig(**settings)
    errs, fla_errs = errors(case, dtype, with_fla, config, device)
    tol = {n: t * SCALE_TOL[dtype] for n, t in case.tol.items()}
    below = clamped(case)
    if dtype == torch.float32 and below:
        tol = {n: max(t, FP32_CLAMP_TOL) for n, t in tol.items()}
    log_measure(
        "kda/gpu-matrix", case=repr(case), dtype=str(dtype), settings=settings, clamped=below,
        errors={n: float(f"{e:.3g}") for n, e in errs.items()},
        fla_errors={n: e if isinstance(e, str) else float(f"{e:.3g}") for n, e in fla_errs.items()},
        tolerance=tol,
    )  # fmt: skip
    over = {n: (f"{e:.2e}", tol[n]) for n, e in errs.items() if n in tol and not e <= tol[n]}
    assert not over, f"errors over tolerance (name: error, tolerance): {over}; all: {errs}; fla's: {fla_errs}"


# fla 0.6.0's test_chunk (all fp16 in fla): B, T, H, D, scale, gate_logit_normalizer, mask_p,
# use_qk_l2norm_in_kernel, use_gate_in_kernel, safe_gate, disable_recompute
FLA_CHUNK = {
    "B1-T63-H1-D64-safe": Case(1, 63, 1, 64, 1.0, safe_gate=True),
    "B2-T500-H3-D60-safe": Case(2, 500, 3, 60, 1.0, safe_gate=True, disable_recompute=True),
    "B2-T1000-H3-D64-masked": Case(2, 1000, 3, 64, 0.1, mask_p=0.5, disable_recompute=True),
    # normaliser 0.1: g down to about -40 (was refused before the clamp)
    "B3-T1024-H4-D100-very-strong": Case(3, 1024, 4, 100, 1.0, gate_norm=0.1),
    "B4-T1024-H4-D128-safe": Case(4, 1024, 4, 128, 0.1, safe_gate=True, disable_recompute=True),
    "B4-T1024-H4-D128-l2norm-safe": Case(4, 1024, 4, 128, 0.1, l2norm_in_kernel=True, safe_gate=True),
    "B2-T1500-H4-D128-gate-mild": Case(
        2, 1500, 4, 128, 0.1, gate_norm=10, gate_in_kernel=True, disable_recompute=True
    ),
    "B4-T2048-H8-D64-gate-safe": Case(
        4, 2048, 8, 64, 0.1, gate_in_kernel=True, safe_gate=True, disable_recompute=True
    ),
}
# fla 0.6.0's test_chunk_varlen (fp16): H, D, mask_p, cu_seqlens, use_gate_in_kernel, safe_gate,
# disable_recompute; B = 1, T = cu_seqlens[-1], default scale, h0 and dh_T for every sequence
FLA_VARLEN = {
    "H4-D60-N1-gate": Case(
        1, 15, 4, 60, None, mask_p=0.1, gate_in_kernel=True, cu_seqlens=(0, 15), draw="varlen"
    ),
    "H4-D64-N3-gate": Case(
        1, 1000, 4, 64, None, mask_p=0.9, gate_in_kernel=True, cu_seqlens=(0, 256, 500, 1000), draw="varlen"
    ),
    "H4-D128-N3-masked": Case(
        1, 1000, 4, 128, None, mask_p=0.5, cu_seqlens=(0, 256, 500, 1000), draw="varlen"
    ),
    "H4-D100-N5-gate": Case(
        1, 2000, 4, 100, None, gate_in_kernel=True, cu_seqlens=(0, 15, 100, 300, 1200, 2000), draw="varlen"
    ),
    "H4-D256-N5-safe": Case(
        1,
        4096,
        4,
        256,
        None,
        safe_gate=True,
        disable_recompute=True,
        cu_seqlens=(0, 100, 300, 1200, 3000, 4096),
        draw="varlen",
    ),  # fmt: skip
}
# ours: B = H = 1, no states, T on the chunk size, head size 256 and one padded up to it
OURS = {
    "B1-H1-T300-D128-mild": Case(1, 300, 1, 128, 0.1, gate_norm=10),
    "B1-H1-T64-D128-no-states": Case(1, 64, 1, 128, 0.1, gate_norm=10, h0=False, dht=False),
    "B2-T200-D128-mixed-no-h0": Case(2, 200, 2, 128, 0.1, gate_norm=10, mask_p=0.3, h0=False),
    "B2-T300-H2-D256-strong": Case(2, 300, 2, 256, None, gate_norm=0.3),
    "B1-T500-H2-D192-mild": Case(1, 500, 2, 192, None, gate_norm=10),
}

FP16, BF16, FP32 = (torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")


def _param(name: str, dtype) -> object:
    """One (case name, dtype) of the matrix, its id both (a pytest.param inside a tuple would reach
    the test as the ParameterSet itself, not the dtype: the 2026-11-28 GPU run failed so)."""
    return pytest.param(name, dtype[0], id=f"{name}-{dtype[1]}")


# fla's dtype (fp16) on every case; bf16 (training's) on every test_chunk case and on the varlen cases
# with D = 128 and 256; fp32 (slow to compile: its ieee products spill) on four
FP32_CASES = (
    "B1-T63-H1-D64-safe",
    "B3-T1024-H4-D100-very-strong",
    "B1-H1-T300-D128-mild",
    "B2-T300-H2-D256-strong",
)
CHUNK_PARAMS = [_param(n, d) for n in [*FLA_CHUNK, *OURS] for d in (FP16, BF16)] + [
    _param(n, FP32) for n in FP32_CASES
]
VARLEN_PARAMS = [_param(n, FP16) for n in FLA_VARLEN] + [
    _param(n, BF16) for n in ("H4-D128-N3-masked", "H4-D256-N5-safe")
]


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("name, dtype", CHUNK_PARAMS)
def test_fla_chunk_matrix_on_gpu(name, dtype):
    """fla's test_chunk cases and ours: forward and backward."""
    check({**FLA_CHUNK, **OURS}[name], dtype)


@pytest.mark.gpu
@pytest.mark.claim("kda/varlen-equals-separate", section="§3 (arXiv v2)")
@pytest.mark.parametrize("name, dtype", VARLEN_PARAMS)
def test_fla_varlen_matrix_on_gpu(name, dtype):
    """fla's test_chunk_varlen cases: packed sequences against each run alone."""
    check(FLA_VARLEN[name], dtype)


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("bv", [16, 32, 64, 128])
def test_state_value_blocks_on_gpu(bv):
    """The fused state backward at every value block its rule can pick, in the mild-gate case where a
    wrong dS carried across chunks shows (fla's B=2, T=1500, H=4, D=128, normaliser 10; fp16)."""
    case = replace(FLA_CHUNK["B2-T1500-H4-D128-gate-mild"], gate_in_kernel=False)
    check(case, torch.float16, with_fla=False, state_bwd_bv=bv)


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
@pytest.mark.parametrize("name", ["B2-T1500-H4-D128-mild", "B1-H1-T64-D128-no-states"])
def test_dot_precision_settings_on_gpu(name, prec):
    """The other intra-chunk product precisions a user can pick for fp16 (KDAConfig.dot_prec_fp16;
    the default is tf32x3) on the cases where the mild gates make the chunk's triangular solve
    ill-conditioned: ieee must pass; tf32 (the bf16 default) is what failed here, kept as an xfail
    (not strict: it sits at the tolerance's edge and passed once) so the record says why fp16 does
    not use it."""
    cases = {"B2-T1500-H4-D128-mild": Case(2, 1500, 4, 128, 0.1, gate_norm=10), **OURS}
    check(cases[name], torch.float16, with_fla=False, dot_prec_fp16=prec)


# Under Triton's CPU interpreter: a few of the matrix's cases, fla's smallest as it is and others
# shrunk (T, D), through the same draw, preprocessing and check. About 10 s on two cores.
CPU_CASES = {
    "fla-varlen-H4-D60-N1-gate": FLA_VARLEN["H4-D60-N1-gate"],
    "very-strong-T100-D32": Case(1, 100, 2, 32, 1.0, gate_norm=0.1),
    "gate-mild-T80-D16": Case(2, 80, 2, 16, 0.1, gate_norm=10, gate_in_kernel=True),
    "varlen-D256-N2": Case(1, 70, 1, 256, None, cu_seqlens=(0, 20, 70), draw="varlen"),
}


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter subset (the GPU runs the whole matrix)")
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_fla_matrix_subset_on_cpu(name):
    """fla's matrix in small: its preprocessing (L2 norm, gate activation), gates far below -10
    (clamped), head size 256 with packed sequences, in fp16 at fla's tolerances."""
    check(CPU_CASES[name], torch.float16, with_fla=False, device="cpu")
