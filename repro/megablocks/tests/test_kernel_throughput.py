"""megablocks/kernel-throughput (§6.3, Figure 9): the benchmark's per-kernel comparison computes what
it claims to compare.

The claim is a speed claim, measured by ``python -m repro.megablocks.bench --kernels`` (rows in
``results/<device>-kernels.json``), not by a test. What a test can check is that the rows compare
like with like: for each of Figure 9's six products, our kernel (SDD, DSD, DSD through the transpose
indices) computes on the block-sparse layout exactly what cuBLAS batched matmul computes on the
``[E, n, ...]`` layout, with the same FLOPs (only the block diagonal is stored, no padding), through
the very functions the benchmark times (:func:`repro.megablocks.bench.kernel_problems`). On CPU at
toy sizes (Triton's interpreter, fp32 with IEEE products: 1e-5 relative); on the GPU at the paper's
three problem sizes in bf16 (2e-2, 8 mantissa bits).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub.testing import assert_rel_close, sanitizing
from repro.megablocks import bench

CLAIM = "megablocks/kernel-throughput"
SECTION = "§6.3, Figure 9 (arXiv v1)"


@pytest.mark.claim(CLAIM, section=SECTION)
@settings(max_examples=6, deadline=None)
@given(
    E=st.integers(1, 4),
    blocks_per_expert=st.integers(1, 2),
    d=st.integers(1, 40),  # the dense side's free dimension, off the tile
    blocks_per_ffn=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_problems_equal_batched_matmul(E, blocks_per_expert, d, blocks_per_ffn, seed):
    b = 16
    dims = dict(E=E, T=E * blocks_per_expert * b, d=d, f=blocks_per_ffn * b)
    problems = bench.kernel_problems(dims, device="cpu", dtype=torch.float32, block_size=b, seed=seed)
    assert tuple(problems) == bench.KERNEL_PROBLEMS
    for name, p in problems.items():
        ref = p.reference()
        assert_rel_close(p.as_batched(p.ours()), ref, 1e-5, f"ours {name}")
        assert_rel_close(p.batched(), ref, 1e-5, f"bmm {name}")
        # the same work: the batched product's FLOPs, which the sparse product matches block for block
        E_, rows, cols = ref.shape
        inner = {"nt": dims["d"], "nn": dims["f"], "tn": dims["T"] // E}[name.rsplit(":", 1)[1]]
        assert p.flops == 2.0 * E_ * rows * cols * inner


def test_kernel_problems_refuse_padding():
    """§6.3's problems have a multiple of the block size per expert (the paper's uniform routing);
    other sizes are refused with the reason, not silently padded."""
    with pytest.raises(ValueError, match="multiple of block_size=16 per expert"):
        bench.kernel_problems(
            dict(E=4, T=4 * 20, d=8, f=16), device="cpu", dtype=torch.float32, block_size=16
        )
    with pytest.raises(ValueError, match="dtype_name='fp8'"):
        bench.kernel_rows("x", dict(E=1, T=16, d=8, f=16), "fp8", device="cpu", block_size=16)


def test_kernel_rows_and_summary():
    """The rows the benchmark writes: both candidates checked before timing (a timer that runs each
    once), relative throughput = cuBLAS's time over ours, and Figure 9's statistics over them."""
    times = {"ours": 4.0, "cublas_bmm": 2.0}
    calls = []

    def timer(fn, warmup, rep):
        fn()
        calls.append(fn)
        return times["ours"] if len(calls) % 2 == 1 else times["cublas_bmm"]

    rows = bench.kernel_rows(
        "toy", dict(E=2, T=2 * 16, d=8, f=16), "fp32", device="cpu", block_size=16, rounds=1, timer=timer
    )
    assert [(r["problem"], r["impl"]) for r in rows] == [
        (p, impl) for p in bench.KERNEL_PROBLEMS for impl in ("ours", "cublas_bmm")
    ]
    assert all(r["check"] == "ok" for r in rows)
    assert {r["rel_throughput"] for r in rows if r["impl"] == "ours"} == {0.5}
    assert "50.0% of cuBLAS" in bench.kernel_summary(rows) and "6 problems" in bench.kernel_summary(rows)


@pytest.mark.gpu
@pytest.mark.claim(CLAIM, section=SECTION)
@pytest.mark.parametrize("model", list(bench.PAPER_KERNEL_SHAPES))
def test_kernel_problems_at_paper_sizes_on_gpu(model):
    """bf16 at MoE-XS, -Small, -Medium's sizes (block 128): ours and torch.bmm against fp32 bmm."""
    if sanitizing() and model != "MoE-Medium":
        pytest.skip("under compute-sanitizer the smallest size covers the same kernels")
    dims = bench.PAPER_KERNEL_SHAPES[model]
    problems = bench.kernel_problems(dims, device="cuda", dtype=torch.bfloat16)
    for name, p in problems.items():
        ref = p.reference()
        assert_rel_close(p.as_batched(p.ours()), ref, bench.KERNEL_TOL[torch.bfloat16], f"ours {name}")
        assert_rel_close(p.batched(), ref, bench.KERNEL_TOL[torch.bfloat16], f"bmm {name}")
        del ref
    torch.cuda.synchronize()


def test_kernels_main_flow(monkeypatch, tmp_path):
    """``--kernels``: every model in fp16 then bf16 (``--quick``: MoE-Medium only), the rows' percentage
    of the ceiling, the summary in the notes, written as ``<device>-kernels.json``; kernel_rows and the
    GPU parts faked."""
    seen = []

    def fake_rows(model, dims, dtype_name, **kw):
        seen.append((model, dtype_name))
        return [
            dict(
                model=model,
                problem=p,
                dtype=dtype_name,
                impl=impl,
                **dims,
                ms=1.0,
                check="ok",
                tflops=400.0,
                rel_throughput=0.9 if impl == "ours" else 1.0,
            )  # fmt: skip
            for p in bench.KERNEL_PROBLEMS
            for impl in ("ours", "cublas_bmm")
        ]

    written = {}
    monkeypatch.setattr(bench, "kernel_rows", fake_rows)
    monkeypatch.setattr(bench, "ceilings", lambda: {"matmul_bf16_tflops": 800.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(
        bench.Report, "write", lambda self, tag="", out_dir=None, **kw: written.update(r=self, tag=tag)
    )
    bench.main(["--kernels", "--out", str(tmp_path), "--budget-s", "1000"])
    assert seen == [(m, dt) for dt in bench.KERNEL_DTYPES for m in bench.PAPER_KERNEL_SHAPES]
    report = written["r"]
    assert written["tag"] == "kernels" and len(report.rows) == 6 * 2 * 3 * 2
    assert all(r["pct_of_matmul"] == 50.0 for r in report.rows)
    assert "fp16: ours at 90.0% of cuBLAS" in report.notes and "over 18 problems" in report.notes
    seen.clear()
    bench.main(["--kernels", "--quick", "--budget-s", "1000"])
    assert seen == [("MoE-Medium", dt) for dt in bench.KERNEL_DTYPES]
