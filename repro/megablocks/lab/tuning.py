"""Our two dMoE paths under other tile settings, beside torch._grouped_mm, on one GPU.

Run by the benchmark, ``python -m repro.megablocks.bench --out DIR --budget-s N [--quick] [--tune-first]``:
with budget left after the main table (before it with ``--tune-first``), rows under ``8e-top2 (tuning)``
and ``64e-top8 (tuning)`` time ``ours_sparse`` and ``ours_grouped`` with each :data:`TUNING` variant of
``repro.megablocks.kernels.GPU_CONFIG`` (through ``kernel_config``; column ``config``, ``tune:default``
being GPU_CONFIG as it stands), balanced routing, beside torch._grouped_mm once per shape (at the
default). The variants go in the order of ``TUNING``, each on both shapes, so that a short budget still
compares the first ones; ``group_m=1`` is the launch order before the grouped one (column tiles fastest).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from paperclub.bench import Budget, Report
from repro.megablocks.kernels import GPU_CONFIG, kernel_config

# GPU_CONFIG variants timed after the main table while budget remains (the first is the default),
# in this order, each on the TUNE_SHAPES.
# History: the first H100 run of the grouped order found single wins (256-wide grouped tiles at 8
# experts; 4 warps, 4 stages for the sparse kernels); the run of 2026-11-25 13:45 UTC timed them
# combined and found each path's winner on both shapes, split into per-path settings in
# kernels.GPU_CONFIG, the defaults since the GPU tests of 16:05 UTC passed with them. The run of
# 16:05 also timed, on top of them, the TMA grouped GEMM (best grouped row at both shapes, by 2-3%),
# grouped 4 stages, 64-row grouped tiles, 32-deep k steps and group_m 4 (none better than the
# default). Rows now: the default; the grouped GEMM's other kernel; the layer's glue through PyTorch ops
# instead of the fused kernels (what the fused ones save); the defaults before 16:05 (8 warps,
# 3 stages, 128-wide grouped tiles). Since 16:32 UTC the TMA grouped GEMM is the default (its row
# was the best grouped row at both shapes), so its row is now the pointer kernel's (gmm_tma False).
# Last, the weight gradient's TMA kernel (gmm_wgrad_tma True, off by default until a GPU run has
# tested and timed it; the wgrad was 10.6 ms of the grouped path's ~29 ms GEMM time at 8 experts).
PREVIOUS_DEFAULT = {"num_warps": 8, "num_stages": 3, "gmm_n": 128}
TUNING = [
    {},
    {"gmm_tma": False},
    {"fused_glue": False},
    PREVIOUS_DEFAULT,
    {"gmm_wgrad_tma": True},
]
# 8e-top2 first: an expert's weight (117 MB) exceeds the L2, where the launch order matters most
TUNE_SHAPES = ("8e-top2", "64e-top8")


def tuning_rows(
    report: Report,
    shapes: dict,
    budget: Budget,
    notes: list,
    run_config: Callable[..., list[dict]],
    finish_row: Callable[[dict], dict] = lambda row: row,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Every TUNING variant on each of TUNE_SHAPES (those among ``shapes``: --quick has 64e-top8 only),
    rows by the bench's ``run_config`` (``finish_row`` adds a row's last columns) while ``budget``
    lasts; a (variant, shape) whose expected time (1.2 x the longest so far at that shape) does not fit
    is skipped, with a note. Returns the longest time of a row at each shape."""
    tune_shapes = [s for s in TUNE_SHAPES if s in shapes]
    notes.append(f"Tuning rows: tune:default is GPU_CONFIG = {dict(GPU_CONFIG)}.")
    base_ms: dict[str, float] = {}  # torch_grouped_mm at the default, per shape
    longest: dict[str, float] = {}
    skipped = []
    for variant in TUNING:
        label = "tune:" + (",".join(f"{k}={v}" for k, v in variant.items()) or "default")
        for shape in tune_shapes:
            expect = longest.get(shape, max(longest.values(), default=0.0))
            if not budget.allows(1.2 * expect, reserve_s=15):
                skipped.append(f"{shape} {label}")
                continue
            t0 = clock()
            try:
                with kernel_config(**variant):
                    for row in run_config(
                        f"{shape} (tuning)", shapes[shape], "balanced", rounds=3, notes=notes,
                        only=("ours_sparse", "ours_grouped", "torch_grouped_mm" if not variant else ""),
                        config=label, base_ms=base_ms.get(shape),
                    ):  # fmt: skip
                        if row["impl"] == "torch_grouped_mm" and row.get("ms"):
                            base_ms[shape] = row["ms"]
                        report.add(**finish_row(row))
            except Exception as exc:  # a variant that does not compile or fit is a result, not a crash
                notes.append(
                    f"tuning {shape} {label}: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
                )
            torch.cuda.empty_cache()
            longest[shape] = max(longest.get(shape, 0.0), clock() - t0)
            print(f"tuning {shape} {label} done in {clock() - t0:.1f} s", flush=True)
    if skipped:
        notes.append(f"tuning rows skipped (budget {budget.seconds:.0f} s): {'; '.join(skipped)}")
    return longest
