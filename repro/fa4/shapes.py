"""The shapes, FLOPs, inputs and rows shared by the bench (:mod:`repro.fa4.bench`) and its part ``peer``
(:mod:`repro.fa4.peer`): the paper's sweep (D = 128, 16 heads, B x S = 16k tokens), our two forwards of
the peer table, the FLOP count, the bf16 inputs, the result table and its error rows, the shapes within
a budget. Both import from here, so that the imports go one way (bench -> peer -> shapes).
"""

from __future__ import annotations

import itertools

import torch

from paperclub.bench import Budget, Report, within_budget

#: The paper's sweep: 16 heads of D = 128, B x S = 16k tokens, S = 1k..16k.
HEADS = 16
HEAD_DIM = 128
TOKENS = 16384
SEQLENS = (1024, 2048, 4096, 8192, 16384)

#: The Triton forward whatever the device (``gluon=False``; the default picks Gluon on Hopper).
TRITON = {"gluon": False}


#: The Triton forward's fastest in results/nvidia-h100-80gb-hbm3.json (S = 4k-16k): TMA on, default launch shape.
OURS_BEST = {**TRITON, "tma": True}

#: The warp-specialised Gluon forward (repro.fa4.gluon_fwd; sm_90 only, launched with
#: repro.fa4.GLUON_LAUNCH) and the backward bwd="auto" picks: the Gluon one on Hopper since
#: 2026-11-25 (the committed peer file, of 2026-11-23, ran the FA2 Triton backward).
OURS_GLUON = {"gluon": True}


#: The columns of the comparison (<device>.json) and of the peer table (<device>-peer.json).
COLUMNS = ["group", "impl", "causal", "S", "B", "pass", "ms", "tflops", "note"]


def flops(b: int, s: int, causal: bool, passes: str) -> float:
    """FLOPs of one call: 4 B H S^2 D forward (halved when causal), x3.5 for "fwd+bwd", x2.5 for "bwd"."""
    f = 4.0 * b * HEADS * s * s * HEAD_DIM * (0.5 if causal else 1.0)
    return f * {"fwd+bwd": 3.5, "bwd": 2.5}.get(passes, 1.0)


def make_inputs(b: int, s: int, layout: str = "bshd", d: int = HEAD_DIM, d_v: int | None = None):
    """bf16 leaves q, k, v: [B, S, H, D] (``layout="bhsd"``: [B, H, S, D]), v's head size ``d_v``
    (default D)."""

    def leaf(dim: int) -> torch.Tensor:
        shape = (b, s, HEADS, dim) if layout == "bshd" else (b, HEADS, s, dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    return [leaf(d), leaf(d), leaf(d if d_v is None else d_v)]


def _err_note(err: float) -> str:
    return f"rel.err vs cuDNN {err:.1e}" + ("" if err < 2e-2 else " WRONG")


def _report(title: str, columns: list[str], notes: str, **kw) -> Report:
    """One of the bench's result tables; SDPA (cuDNN, FA2) the peer unless ``kw`` says otherwise."""
    sdpa_peer = (
        f"torch {torch.__version__} SDPA (cuDNN {torch.backends.cudnn.version()}, FlashAttention-2 backend)"
    )
    kw = {"peer": sdpa_peer, "packages": ["triton", "torch"], "measure_ceilings": False, **kw}
    return Report(package="fa4", title=title, columns=columns, notes=notes, **kw)


def _row_error(report: Report, **row) -> None:
    report.add(**row, ms=float("nan"), tflops=float("nan"))


def _shapes(seqlens, budget: Budget, reserve_s: float, skipped: list):
    """(causal, S, B) of each length, not causal first, B x S = TOKENS; a shape that would start with
    less than ``reserve_s`` of the budget left is named in ``skipped`` instead."""
    shapes = itertools.product((False, True), seqlens)
    for causal, s in within_budget(shapes, budget, reserve_s, skipped, lambda c: f"S={c[1]} causal={c[0]}"):
        yield causal, s, max(1, TOKENS // s)
