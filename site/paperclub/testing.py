"""Shared helpers for the reproductions' tests: relative errors and tolerance checks, the GPU job's
sanitizer pass and measure log, and what a kernel call dispatches.

Every repro compares a fast path against a reference by the relative Frobenius error
``||out - ref|| / ||ref||`` (the measure flash-linear-attention and METHOD.md use), so the
tolerance reads the same everywhere: fp32 vs fp64 about 1e-5, tf32 about 3e-4, bf16 about 1e-2.

A helper that a second reproduction's tests need lives here, not in the first one's ``tests/``:
one repro's tests never import another's. (The offline sm_90a compile of kernels for CPU tests is
:func:`paperclub.lab.offline`.)
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def dispatched(kernel_module, kernel_names):
    """Within the block: the aten ops dispatched outside Triton launches (``ops``, names without
    ``aten.``) and the launches of the kernels ``kernel_names`` of ``kernel_module`` in order
    (``launches``). Yields ``(ops, launches)``; the kernels are restored afterwards. What a test of
    "one launch, no host synchronisation, no extra copies" reads. (The CPU interpreter runs a kernel
    with torch ops of its own: those are not recorded.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.in_kernel = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.in_kernel:
                self.ops.append(str(func).removeprefix("aten."))
            return func(*args, **(kwargs or {}))

    record, launches = Record(), []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*a, **kw):
                launches.append(self.name)
                record.in_kernel = True
                try:
                    return self.kernel[grid](*a, **kw)
                finally:
                    record.in_kernel = False

            return launch

    originals = {name: getattr(kernel_module, name) for name in kernel_names}
    for name, kernel in originals.items():
        setattr(kernel_module, name, Counted(name, kernel))
    try:
        with record:
            yield record.ops, launches
    finally:
        for name, kernel in originals.items():
            setattr(kernel_module, name, kernel)
