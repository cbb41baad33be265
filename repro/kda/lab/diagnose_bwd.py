"""GPU diagnosis of the backward: which gradient, which stage, under which kernel setting.

    python -m repro.kda.lab.diagnose_bwd [--case fla-mild] [--variants all] [--json OUT]
    python -m repro.kda.lab.diagnose_bwd --sanitize-case --set state_bwd_bv=32   (one small fwd+bwd, for
                                                                                  compute-sanitizer)

For a case in the style of flash-linear-attention's ``tests/ops/test_kda.py::test_chunk`` it prints,
per variant (a :class:`repro.kda.KDAConfig`, or a lab-only change of the state backward), fla's error
measure (RMS of the difference over RMS of the fp64 reference) of o, hT and every gradient, and the
error of each output of the reverse state kernel (dU, the per-chunk dS, dh0) against the same
recurrence run in fp64 in PyTorch on the same saved forward tensors, which tells the state kernel
apart from the intra-chunk kernels downstream. GPU only (the point is the compiled code, not the
interpreter's).

The lab-only variants run the backward's stages themselves (:func:`lab_backward`): the state
backward with its products in another precision than the rest, or at value block 16 with 8 warps,
the configuration Triton 3.6 compiled wrongly on an H100 (2026-11-24; the fast path takes 4 warps
there, backward_inter_chunk.STATE_BWD_WARPS_BV16), so that the bug stays reproducible.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton

from paperclub.bench import apply_settings, parse_settings
from paperclub.triton_compat import interpreting
from repro.kda import KDAConfig, chunk_kda
from repro.kda.backward_inter_chunk import inter_chunk_bwd, kda_state_bwd_fused_kernel
from repro.kda.backward_intra_chunk import intra_chunk_bwd
from repro.kda.chunk import kda_fwd_triton
from repro.kda.reference import kda_recurrence
from repro.kda.tiles import BT

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def fla_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref) in fp64: flash-linear-attention's ``get_err_ratio``."""
    d = (out.double() - ref.double()).pow(2).mean().sqrt()
    return float(d / (ref.double().pow(2).mean().sqrt() + 1e-12))


def make_case(B, T, H, K, V, dtype, gate_div=1.0, mask_p=0.0, scale=0.1, seed=42, h0=True, dht=True):
    """Inputs drawn as fla's test_chunk draws them (q, k L2-normalised), on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.rand(B, T, H, K, generator=gen), p=2, dim=-1)
    k = F.normalize(torch.rand(B, T, H, K, generator=gen), p=2, dim=-1)
    v = torch.rand(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) / gate_div
    g = g * (torch.rand(g.shape, generator=gen) > mask_p)
    beta = torch.randn(B, T, H, generator=gen).sigmoid()
    case = dict(q=q, k=k, v=v, g=g, beta=beta)
    case = {n: x.to(dtype) if n != "g" else x for n, x in case.items()}
    case["h0"] = torch.randn(B, H, K, V, generator=gen) if h0 else None
    do = torch.randn(B, T, H, V, generator=gen).to(dtype)
    dht_ = torch.randn(B, H, K, V, generator=gen) if dht else None
    dev = DEVICE

    return (
        {n: (x.to(dev) if x is not None else None) for n, x in case.items()},
        do.to(dev),
        (dht_.to(dev) if dht_ is not None else None),
        scale,
    )


def run_grads(fn, case, do, dht, scale, dtype=None):
    """o, hT and the gradients of (o * do).sum() + (hT * dht).sum() through ``fn``."""
    leaves = {
        n: x.detach().clone().to(dtype or x.dtype).requires_grad_(True)
        for n, x in case.items()
        if x is not None
    }
    o, hT = fn(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale,
        leaves.get("h0"), True,
    )  # fmt: skip
    loss = (o * do.to(o.dtype)).sum()
    if dht is not None:
        loss = loss + (hT * dht.to(hT.dtype)).sum()
    loss.backward()
    grads = {"d" + n: leaves[n].grad for n in ("q", "k", "v", "g", "beta")}
    grads["dh0"] = leaves["h0"].grad if "h0" in leaves else None
    return o.detach(), hT.detach(), grads


def reference(case, do, dht, scale):
    return run_grads(
        lambda q, k, v, g, b, s, h0, fin: kda_recurrence(q, k, v, g, b, s, h0, fin),
        case,
        do,
        dht,
        scale,
        dtype=torch.float64,
    )


def torch_state_bwd(q, saved, do, dhT, scale):
    """The fused state kernel's recurrence (kernels.kda_state_bwd_fused_kernel) in fp64 PyTorch."""
    B, T, H, K = q.shape
    W, KD, G, Aqk, gamma = (saved[n].double() for n in ("W", "KD", "G", "Aqk", "gamma"))
    HV, NT = W.shape[2], gamma.shape[2]
    V = do.shape[-1]
    pad = NT * BT - T

    def chunks(x):  # [B, T, HV, D] -> [B, HV, NT, BT, D]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.view(B, NT, BT, HV, -1).permute(0, 3, 1, 2, 4)

    qe = q.double().repeat_interleave(HV // H, dim=2)
    QG, Wc, KDc, A, dO = chunks(qe * G.exp() * scale), chunks(W), chunks(KD), chunks(Aqk), chunks(do.double())
    dS = (
        dhT.double().clone()
        if dhT is not None
        else torch.zeros(B, HV, K, V, dtype=torch.float64, device=q.device)
    )
    dU = torch.zeros(B, HV, NT, BT, V, dtype=torch.float64, device=q.device)
    dh_all = torch.zeros(B, HV, NT, K, V, dtype=torch.float64, device=q.device)
    for n in reversed(range(NT)):
        dh_all[:, :, n] = dS
        du = A[:, :, n].transpose(-1, -2) @ dO[:, :, n] + KDc[:, :, n] @ dS
        dU[:, :, n] = du
        dS = gamma[:, :, n, :, None] * dS - Wc[:, :, n].transpose(-1, -2) @ du
        dS = dS + QG[:, :, n].transpose(-1, -2) @ dO[:, :, n]
    dU = dU.permute(0, 2, 3, 1, 4).reshape(B, NT * BT, HV, V)[:, :T]
    return dU, dh_all, dS


#: name -> KDAConfig fields, or ``_STATE`` (lab_backward's state stage: its value block, warps and
#: product precision) or ``_FLA`` (flash-linear-attention's chunk_kda on the same inputs: the peer's
#: own error). The "triton" and "torch" backwards this script also compared left in issue #40.
VARIANTS = {
    "split": {},
    # what the default was before the fix: value block 16 at 8 warps (wrong on an H100, Triton 3.6)
    "split/bv16-8warps": {"_STATE": {"bv": 16, "warps": 8}},
    "split/bv16": {"state_bwd_bv": 16},
    "split/bv32": {"state_bwd_bv": 32},
    "split/bv64": {"state_bwd_bv": 64},
    "split/bv128": {"state_bwd_bv": 128},
    "split/state-ieee": {"_STATE": {"prec": "ieee"}},
    "split/all-ieee": {"dot_prec_bf16": "ieee", "dot_prec_fp16": "ieee"},
    "split/all-tf32x3": {"dot_prec_bf16": "tf32x3", "dot_prec_fp16": "tf32x3"},
    "fla": {"_FLA": True},
}


def _with_config(config: KDAConfig):
    """chunk_kda with ``config``, in run_grads' calling convention."""
    return lambda q, k, v, g, beta, scale, h0, fin: chunk_kda(q, k, v, g, beta, scale, h0, fin, config=config)


def fla_chunk_kda(q, k, v, g, beta, scale, h0, output_final_state):
    from fla.ops.kda import chunk_kda

    return chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=output_final_state
    )


def state_bwd(q, saved, do, dhT, scale, prec, config: KDAConfig, bv=None, warps=None):
    """The state backward as the fast path runs it (backward_inter_chunk.inter_chunk_bwd), or, with
    ``warps`` given, launched here at value block ``bv`` with exactly that many warps (the fast path
    would take 4 at block 16)."""
    if warps is None:
        return inter_chunk_bwd(q, saved, do, dhT, scale, prec, block_v=bv or config.state_bwd_bv,
                               warps=config.state_bwd_warps)  # fmt: skip
    B, T, H, K = q.shape
    HV, NT = saved["W"].shape[2], saved["gamma"].shape[2]
    V = saved["U_new"].shape[-1]
    f32 = dict(device=q.device, dtype=torch.float32)
    dU = torch.empty(B, T, HV, V, **f32)
    dh_all = torch.empty_like(saved["h_all"])
    dh0 = torch.empty(B, HV, K, V, **f32)
    dhT_c = dhT.float().contiguous() if dhT is not None else None
    BV = min(V, bv)
    kda_state_bwd_fused_kernel[(triton.cdiv(V, BV), B * HV)](
        q, saved["G"], saved["Aqk"], saved["W"], saved["KD"], saved["gamma"], do, dhT_c, dU, dh_all, dh0,
        scale, T, NT, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=dhT is not None, DOT_PREC=prec,
        num_warps=warps,
    )  # fmt: skip
    return dU, dh_all, dh0


def lab_backward(case, do, dht, scale, config: KDAConfig, state: dict):
    """o, hT and the gradients of (o * do).sum() + (hT * dht).sum() by the backward's stages called
    here, with ``state`` (``bv``, ``warps``, ``prec``) changing the state backward alone."""
    x = {n: (t.contiguous() if t is not None else None) for n, t in case.items()}
    o, hT, saved = kda_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], True, config)
    prec = config.dot_precision(x["q"].dtype)
    do = do.to(o.dtype).contiguous()
    dU, dh_all, dh0 = state_bwd(
        x["q"], saved, do, dht, scale, state.get("prec", prec), config, state.get("bv"), state.get("warps")
    )
    dq, dk, dv, dg, dbeta = intra_chunk_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale, saved, do, dU, dh_all, prec, not interpreting(),
        mat_bk=config.bwd_mat_bk, mat_bv=config.bwd_mat_bv, mat_warps=config.bwd_mat_warps,
        mat_stages=config.bwd_mat_stages, dqk_bk=config.bwd_dqk_bk, dqk_bv=config.bwd_dqk_bv,
        dqk_warps=config.bwd_dqk_warps, dqk_stages=config.bwd_dqk_stages,
    )  # fmt: skip
    grads = dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0 if x["h0"] is not None else None)
    return o, hT, grads


def state_stage_errors(case, do, dht, scale, config: KDAConfig, state: dict):
    """Errors of the state backward's outputs against :func:`torch_state_bwd`."""
    x = case
    o, hT, saved = kda_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], True, config)
    prec = state.get("prec", config.dot_precision(x["q"].dtype))
    dU, dh_all, dh0 = state_bwd(
        x["q"], saved, do.contiguous(), dht, scale, prec, config, state.get("bv"), state.get("warps")
    )
    rU, rh, r0 = torch_state_bwd(x["q"], saved, do, dht, scale)
    return {
        "state.dU": fla_error(dU, rU),
        "state.dh_all": fla_error(dh_all, rh),
        "state.dh0": fla_error(dh0, r0),
    }


CASES = {
    # the reproducer: fla's mild-gate case (gate_logit_normalizer 10), T not a multiple of 64
    "fla-mild": dict(B=2, T=1500, H=4, K=128, V=128, gate_div=10.0),
    "fla-strong": dict(B=4, T=1024, H=4, K=128, V=128, gate_div=1.0),
    "fla-masked": dict(B=2, T=1000, H=3, K=64, V=64, gate_div=1.0, mask_p=0.5),
    "mild-k64": dict(B=2, T=1500, H=4, K=64, V=64, gate_div=10.0),
    "b1h1": dict(B=1, T=300, H=1, K=128, V=128, gate_div=10.0),
    "tiny": dict(B=1, T=100, H=2, K=16, V=16, gate_div=10.0),  # for a check of this script on CPU
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="cases (default: all)")
    ap.add_argument("--dtype", action="append", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--variants", default="all", help="comma-separated names of VARIANTS, or all")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument(
        "--sanitize-case", action="store_true", help="one small fwd+bwd (B=1, H=1, T=64, K=V=128)"
    )
    ap.add_argument(
        "--set", action="append", default=[], help="NAME=VALUE, a KDAConfig field, for --sanitize-case"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and args.case != ["tiny"]:
        print(
            "diagnose_bwd: needs a CUDA GPU (on CPU only --case tiny, to check this script)", file=sys.stderr
        )
        return 2
    if args.sanitize_case:
        try:
            config = apply_settings(KDAConfig(), parse_settings(args.set))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        for dtype in (torch.float16, torch.bfloat16):
            for T in (64, 300):
                case, do, dht, scale = make_case(1, T, 1, 128, 128, dtype, gate_div=10.0)
                run_grads(_with_config(config), case, do, dht, scale)
        torch.cuda.synchronize()
        print(f"sanitize case done: {args.set}")
        return 0
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    dtypes = [getattr(torch, d) for d in (args.dtype or ["float16", "bfloat16", "float32"])]
    results = []
    for cname in args.case or list(CASES):
        spec = dict(CASES[cname])
        dims = {k: spec.pop(k) for k in ("B", "T", "H", "K", "V")}
        for dtype in dtypes:
            case, do, dht, scale = make_case(**dims, dtype=dtype, **spec)
            ro, rh, rg = reference(case, do, dht, scale)
            for name in names:
                row = {"case": cname, "dtype": str(dtype).removeprefix("torch."), "variant": name}
                spec = VARIANTS[name]
                try:
                    config = KDAConfig(**{n: v for n, v in spec.items() if not n.startswith("_")})
                    if "_FLA" in spec:
                        o, hT, grads = run_grads(fla_chunk_kda, case, do, dht, scale)
                    elif "_STATE" in spec:
                        o, hT, grads = lab_backward(case, do, dht, scale, config, spec["_STATE"])
                    else:
                        o, hT, grads = run_grads(_with_config(config), case, do, dht, scale)
                    if "_FLA" not in spec:
                        row.update(state_stage_errors(case, do, dht, scale, config, spec.get("_STATE", {})))
                    row["o"], row["hT"] = fla_error(o, ro), fla_error(hT, rh)
                    row.update({n: fla_error(grads[n], rg[n]) for n in GRADS})
                except Exception as exc:  # a variant that fails to compile or run is a result too
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                results.append(row)
                cols = ["o", "hT", *GRADS, "state.dU", "state.dh_all", "state.dh0"]
                print(
                    f"{cname:11s} {row['dtype']:9s} {name:20s} "
                    + " ".join(f"{c}={row[c]:.1e}" for c in cols if c in row)
                    + (f" ERROR {row['error']}" if "error" in row else ""),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
