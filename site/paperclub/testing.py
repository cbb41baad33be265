"""Shared helpers for the reproductions' tests: relative errors and tolerance checks.

Every repro compares a fast path against a reference by the relative Frobenius error
``||out - ref|| / ||ref||`` (the measure flash-linear-attention and METHOD.md use), so the
tolerance reads the same everywhere: fp32 vs fp64 about 1e-5, tf32 about 3e-4, bf16 about 1e-2.
"""

from __future__ import annotations

import json
import os

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / max(||ref||_F, tiny)`` computed in float64; NaN/inf give ``inf``."""
    if out.shape != ref.shape:
        raise ValueError(f"rel_error: shapes differ, out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    # in float64 chunks of _CHUNK elements: a whole [8, 4096, 14336] gradient in float64 is 3.5 GiB,
    # and three such temporaries per call filled an H100 under compute-sanitizer
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=o.device)
    den = torch.zeros((), dtype=torch.float64, device=o.device)
    finite = torch.ones((), dtype=torch.bool, device=o.device)
    for i in range(0, o.numel(), _CHUNK):
        oc, rc = o[i : i + _CHUNK].to(torch.float64), r[i : i + _CHUNK].to(torch.float64)
        finite &= torch.isfinite(oc).all()
        num += (oc - rc).square().sum()
        den += rc.square().sum()
    if not finite.item():
        return float("inf")
    num, den = num.sqrt().item(), den.sqrt().item()
    if den == 0.0:
        return num
    return num / den


_CHUNK = 1 << 24


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, name: str = "output") -> None:
    """Fail with a message naming ``name``, the error and the tolerance when ``rel_error > tol``."""
    err = rel_error(out, ref)
    assert err <= tol, (
        f"{name}: relative error {err:.3e} exceeds tolerance {tol:.1e} (shape {tuple(ref.shape)})"
    )


def sanitizing() -> bool:
    """Whether this run is the GPU job's pass under compute-sanitizer (``paperclub.gpu`` sets
    ``PAPERCLUB_SANITIZER=1``). That pass is there for the kernels' memory accesses; the values were
    checked by the pass before it, so a test may leave out its (slow, instrumented) reference there."""
    return os.environ.get("PAPERCLUB_SANITIZER") == "1"


def log_measure(test: str, **values) -> None:
    """Append one JSON line ``{"test": ..., **values}`` to ``$PAPERCLUB_TEST_LOG`` (the GPU job sets it):
    the numbers behind a GPU test's verdict reach the job's logs as the test runs, even when the run
    is cut off before pytest's summary. A no-op without the variable."""
    path = os.environ.get("PAPERCLUB_TEST_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": test, **values}, default=str) + "\n")
