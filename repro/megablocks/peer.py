"""megablocks, the package, as the benchmark's peer: importing it, its dMoE expert computation with our
weights and routing, and a first run of it in a child process.

megablocks runs in the bench's process beside our kernels; a fault in its kernels would end the CUDA
context for every later row, so :func:`probe_megablocks` first runs its forward + backward once per
benchmark shape in a child (``python -m repro.megablocks.bench --probe-megablocks [--quick]``, which
calls :func:`probe_main`), and the bench times it only if that passed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from repro.megablocks.reference import moe_per_expert
from repro.megablocks.shapes import MLP, bench_shapes, make_routing


def load_megablocks():
    """``(megablocks module, '')`` or ``(None, why)``."""
    try:
        import megablocks  # noqa: F401
        import megablocks.layers.dmoe as mb_dmoe
        from megablocks.layers.arguments import Arguments  # noqa: F401
        from megablocks.layers.dmoe import dMoE  # noqa: F401

        return mb_dmoe, ""
    except Exception as exc:  # not installed, or its extension/Triton guard refused
        why = f"import megablocks failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return None, why + _setup_outcome()


def _setup_outcome() -> str:
    """The last verdict line of peers_setup.sh's log, if it ran (why the build did not happen)."""
    log = Path(os.environ.get("MEGABLOCKS_SETUP_LOG", "/tmp/megablocks_peer_setup.log"))
    try:
        lines = [ln for ln in log.read_text().splitlines() if "FAILED" in ln or "installed" in ln]
    except OSError:
        return " (peers_setup.sh left no log)"
    return f" (peers_setup.sh: {lines[-1].split('] ', 1)[-1]})" if lines else ""


def megablocks_experts(mb_dmoe, E, k, d, f, w1, w2, w3, mlp: str = "glu"):
    """megablocks' dMoE with our weights (w1 -> w1, w3 -> v1, w2 -> w2); returns
    ``fn(x, weights, indices) -> [T, d]`` calling its expert computation with our routing."""
    import torch.nn.functional as F
    from megablocks.layers.arguments import Arguments

    args = Arguments(
        hidden_size=d,
        ffn_hidden_size=f,
        moe_num_experts=E,
        moe_top_k=k,
        bias=False,
        return_bias=False,
        activation_fn=F.silu if mlp == "glu" else (lambda t: F.gelu(t, approximate="tanh")),
        mlp_type=mlp,
        mlp_impl="sparse",
        bf16=w1.dtype == torch.bfloat16,
        fp16=w1.dtype == torch.float16,
        device=w1.device,
        moe_loss_weight=0.0,
    )
    layer = mb_dmoe.dMoE(args)
    mlp_mod = layer.experts.mlp
    with torch.no_grad():
        mlp_mod.w1.copy_(w1)
        mlp_mod.w2.copy_(w2)
        if mlp == "glu":
            mlp_mod.v1.copy_(w3)
    params = [p for p in layer.experts.parameters() if p.requires_grad]

    def fn(x, weights, indices):
        out = layer.experts(x.view(x.shape[0], 1, d), None, weights, indices)
        out = out[0] if isinstance(out, tuple) else out
        return out.view(x.shape[0], d)

    return fn, params


def probe_megablocks(quick: bool, timeout_s: float = 150.0) -> tuple[bool, str]:
    """Run megablocks' forward + backward once per benchmark shape (skewed routing: the largest
    expert) in a child process; ``(ok, note)``."""
    cmd = [
        sys.executable,
        "-m",
        "repro.megablocks.bench",
        "--probe-megablocks",
        *(["--quick"] if quick else []),
    ]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"megablocks probe timed out after {timeout_s:.0f} s: megablocks not timed."
    if res.returncode != 0:
        tail = " ".join((res.stdout + res.stderr).strip().splitlines()[-3:])[-300:]
        return False, f"megablocks probe failed (exit {res.returncode}): {tail}: megablocks not timed."
    # its own lines only (stdout): the child's stderr holds library warnings, which are no result
    errors = "; ".join(ln.strip() for ln in res.stdout.splitlines() if "rel. error" in ln)
    return True, f"megablocks probe passed in {time.perf_counter() - t0:.0f} s" + (
        f" ({errors})." if errors else "."
    )


def probe_main(quick: bool) -> None:
    """The child's side of :func:`probe_megablocks`: megablocks at every benchmark shape, its output's
    error against the fp32 reference printed; exit 3 where it cannot be imported."""

    mb, why = load_megablocks()
    if mb is None:
        print(why)
        sys.exit(3)
    for shape, dims in bench_shapes(quick).items():
        E, k, d, f, T = (dims[c] for c in ("E", "k", "d", "f", "T"))
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w1, w2, w3 = (
            torch.randn(E * f, d, device="cuda", dtype=torch.bfloat16) / math.sqrt(d) for _ in range(3)
        )
        weights, indices = make_routing(T, E, k, "skewed", "cuda")
        weights = weights.to(torch.bfloat16).requires_grad_(True)
        fn, params = megablocks_experts(mb, E, k, d, f, w1, w2, w3)
        y = fn(x, weights, indices)
        torch.autograd.grad(y, [x, weights, *params], torch.randn_like(y))
        torch.cuda.synchronize()
        ref = moe_per_expert(x.float(), weights.float(), indices, w1.float(), w2.float(), w3.float(), E, MLP)
        print(f"{shape}: megablocks output rel. error {float((y.float() - ref).norm() / ref.norm()):.1e}")
