"""GPU diagnosis of the backward: which gradient, which stage, under which kernel setting.

    python -m repro.kda.diagnose_bwd [--case fla-mild] [--variants all] [--json OUT]
    python -m repro.kda.diagnose_bwd --sanitize-case --set STATE_BWD_BV=32   (one small fwd+bwd, for
                                                                              compute-sanitizer)

For a case in the style of flash-linear-attention's ``tests/ops/test_kda.py::test_chunk`` it prints,
per backward variant, fla's error measure (RMS of the difference over RMS of the fp64 reference) of
o, hT and every gradient, and for the split backward the error of each output of the reverse state
kernel (dU, the per-chunk dS, dh0) against the same recurrence run in fp64 in PyTorch on the same
saved forward tensors, which tells the state kernel apart from the intra-chunk kernels A and B.
GPU only (the point is the compiled code, not the interpreter's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.nn.functional as F

from repro.kda import chunk as C
from repro.kda.reference import kda_recurrence

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
    HV, NT, BT = W.shape[2], gamma.shape[2], C.BT
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


VARIANTS = {
    "split": {},
    # what the default was before the fix: value block 16 at 8 warps (wrong on an H100, Triton 3.6)
    "split/bv16-8warps": {"STATE_BWD_BV": 16, "STATE_BWD_WARPS_BV16": 8},
    "split/bv16": {"STATE_BWD_BV": 16},
    "split/bv32": {"STATE_BWD_BV": 32},
    "split/bv64": {"STATE_BWD_BV": 64},
    "split/bv128": {"STATE_BWD_BV": 128},
    "split/state-ieee": {"_STATE_PREC": "ieee"},
    "split/all-ieee": {"DOT_PREC_BF16": "ieee", "DOT_PREC_FP16": "ieee"},
    "split/all-tf32x3": {"DOT_PREC_BF16": "tf32x3", "DOT_PREC_FP16": "tf32x3"},
    "triton": {"BACKWARD": "triton"},
    "torch": {"BACKWARD": "torch"},
    "fla": {"_FLA": True},  # flash-linear-attention's chunk_kda on the same inputs: the peer's own error
}


def fla_chunk_kda(q, k, v, g, beta, scale, h0, output_final_state):
    from fla.ops.kda import chunk_kda

    return chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=output_final_state
    )


@contextlib.contextmanager
def settings(overrides: dict):
    """Settings of repro.kda.chunk changed for the duration (chunk.changed_settings), plus
    ``_STATE_PREC``: the precision of the fused state backward's products alone."""
    plain = {n: v for n, v in overrides.items() if not n.startswith("_")}
    old_state = C._state_bwd_fused
    try:
        if "_STATE_PREC" in overrides:
            C._state_bwd_fused = lambda q, saved, do, dhT, scale, prec, p=overrides["_STATE_PREC"]: old_state(
                q, saved, do, dhT, scale, p
            )
        with C.changed_settings(plain):
            yield
    finally:
        C._state_bwd_fused = old_state


def state_stage_errors(case, do, dht, scale):
    """Errors of the split backward's state kernel outputs against :func:`torch_state_bwd`."""
    x = case
    o, hT, saved = C.kda_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], True)
    prec = C._dot_precision(x["q"].dtype)
    dU, dh_all, dh0 = C._state_bwd_fused(x["q"], saved, do.contiguous(), dht, scale, prec)
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
        "--set", action="append", default=[], help="NAME=VALUE module setting for --sanitize-case"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and args.case != ["tiny"]:
        print(
            "diagnose_bwd: needs a CUDA GPU (on CPU only --case tiny, to check this script)", file=sys.stderr
        )
        return 2
    if args.sanitize_case:
        over = {}
        for s in args.set:
            name, _, val = s.partition("=")
            over[name] = (
                val if name.startswith("_") or name == "BACKWARD" else (None if val == "None" else int(val))
            )
        for dtype in (torch.float16, torch.bfloat16):
            for T in (64, 300):
                case, do, dht, scale = make_case(1, T, 1, 128, 128, dtype, gate_div=10.0)
                with settings(over):
                    run_grads(C.chunk_kda, case, do, dht, scale)
        torch.cuda.synchronize()
        print(f"sanitize case done: {over}")
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
                try:
                    with settings(VARIANTS[name]):
                        fn = fla_chunk_kda if "_FLA" in VARIANTS[name] else C.chunk_kda
                        o, hT, grads = run_grads(fn, case, do, dht, scale)
                        if name.startswith("split"):
                            row.update(state_stage_errors(case, do, dht, scale))
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
