"""The warp-specialised Gluon forward (``repro.fa4.gluon_fwd``).

Gluon kernels do not run under TRITON_INTERPRET, so the CPU check is an offline compile for sm_90a
(``repro.fa4.lab.compile`` through ``paperclub.lab.offline``: Triton's compiler and the bundled ptxas
need no GPU): every variant must compile, fit the H100's
227 KiB of shared memory per block and not spill. The tests marked ``gpu`` run it on an H100
against the float64 reference: output, log-sum-exp and the gradients through the backward
``bwd="auto"`` picks (on Hopper the Gluon backward; the Triton one before 2026-11-25).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from paperclub.lab import CPU_JOBS, offline
from paperclub.testing import assert_rel_close
from repro.fa4 import attention
from repro.fa4.gluon_fwd import HAS_GLUON, gluon_attention_forward
from repro.fa4.reference import attention_exact, causal_mask

needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon)")
from paperclub.lab import HOPPER_SMEM_PER_BLOCK as H100_SMEM_PER_BLOCK  # noqa: E402

COMPILE_CASES = [(d, causal, "bf16", 2) for d in (64, 128) for causal in (False, True)]
COMPILE_CASES += [(128, False, "fp16", 2), (128, True, "bf16", 1)]
# D = 256 (q, k, v padded to the 256 tile): 64-key tiles, two stages (192 KiB); 128-key tiles spill.
COMPILE_CASES += [
    (256, False, "bf16", 2),
    (256, True, "fp16", 2),
    (256, True, "bf16", 2, {"store_tma": True}),
]
# The launcher's knobs (gluon_fwd.KNOBS); 3 stages at D = 128 is the tightest fit (224 KiB + barriers).
COMPILE_CASES += [
    (128, False, "bf16", 2, {"store_tma": True}),
    (128, True, "bf16", 2, {"store_tma": True}),
    (128, True, "bf16", 1, {"store_tma": True}),
    (64, True, "bf16", 2, {"store_tma": True}),
    (128, True, "bf16", 2, {"num_stages": 3}),
    (128, True, "bf16", 2, {"block_n": 64, "num_stages": 4}),
    (128, True, "bf16", 2, {"load_regs": 32, "consumer_regs": 232}),
]


def _key(d, causal, dtype, consumers, knobs=None):
    return (d, causal, dtype, consumers, json.dumps(knobs or {}, sort_keys=True))


def _case_id(case):
    d, c, t, n = case[:4]
    knobs = "".join(f"-{k}{int(v)}" for k, v in (case[4] if len(case) > 4 else {}).items())
    return f"d{d}-causal{int(c)}-{t}-consumers{n}{knobs}"


@pytest.fixture(scope="module")
def compile_rows(tmp_path_factory) -> dict:
    """All COMPILE_CASES compiled offline for sm_90a (paperclub.lab.offline, one process per CPU)."""
    cases = [
        dict(kernel="gluon_fwd", d=d, causal=c, dtype=t, num_consumers=n, **(rest[0] if rest else {}))
        for d, c, t, n, *rest in COMPILE_CASES
    ]
    rows = offline(
        "repro.fa4.lab.compile:checks",
        cases,
        cache_dir=tmp_path_factory.mktemp("triton-cache"),
        jobs=CPU_JOBS,
    )
    return {_key(*case): row for case, row in zip(COMPILE_CASES, rows, strict=True)}


@needs_gluon
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_gluon_forward_compiles_for_sm90(compile_rows, case):
    knobs = case[4] if len(case) > 4 else {}
    row = compile_rows[_key(*case)]
    print(row)
    assert "error" not in row, row["error"]
    assert row["target_ok"] and row["wgmma"] > 0 and row["tma_loads"] > 0, row
    assert knobs.get("load_regs", 24) in row["setmaxnreg"], row  # the load warp gives its registers away
    assert (row["tma_stores"] > 0) == knobs.get("store_tma", False), row
    assert 0 < row["shared"] <= H100_SMEM_PER_BLOCK, f"shared memory {row['shared']} B > 227 KiB"
    if "ptxas_error" in row:
        pytest.fail(f"ptxas: {row['ptxas_error']}")
    if "spill_stores" in row:  # absent only when this Triton bundles no ptxas
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row


def test_gluon_knob_errors():
    from repro.fa4.gluon_fwd import _constexprs

    base = dict(block_n=None, num_stages=None, store_tma=False, load_regs=24, consumer_regs=240)
    args = (128, False, False, 8.0, 2, True)
    assert _constexprs(*args, **base)["BLOCK_N"] == 128
    assert _constexprs(*args, **{**base, "block_n": 64, "num_stages": 4})["NUM_STAGES"] == 4
    for bad in (
        {"block_n": 176},
        {"block_n": 256},
        {"num_stages": 0},
        {"consumer_regs": 236},
        {"load_regs": 16},
    ):
        with pytest.raises(ValueError):
            _constexprs(*args, **{**base, **bad})
    with pytest.raises(ValueError, match="num_consumers"):
        _constexprs(128, False, False, 8.0, 3, True, **base)


def test_gluon_switch_errors():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available():
        qd = q.to("cuda" if torch.cuda.is_available() else "cpu")
        with pytest.raises(ValueError, match="cannot combine"):
            attention(qd, qd, qd, gluon=True, soft_exp=2)
    if HAS_GLUON:
        with pytest.raises(RuntimeError, match="CUDA"):
            gluon_attention_forward(q, q, q)  # CPU tensors
        if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
            with pytest.raises(ValueError, match="head dim"):
                gluon_attention_forward(*(torch.zeros(1, 8, 2, 32, device="cuda", dtype=torch.bfloat16),) * 3)


# --------------------------------------------------------------------------------------------
# H100: against the float64 reference.
# --------------------------------------------------------------------------------------------


def _lse_exact(q, k, causal):
    """[B, H, S_q] base-2 log-sum-exp of the scaled logits, float64 (what the backward reads)."""
    d, h = q.shape[-1], q.shape[2]
    k64 = k.detach().double().repeat_interleave(h // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.detach().double(), k64) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    return torch.logsumexp(s, dim=-1) / math.log(2.0)


# (B, S_q, S_k, H, H_kv, D): ragged S, GQA, S_q < S_k, every head dim.
GPU_SHAPES = [
    (2, 1000, 1000, 4, 2, 128),
    (1, 2048, 2048, 8, 8, 128),
    (2, 77, 77, 4, 4, 128),
    (1, 300, 700, 4, 1, 128),
    (2, 1000, 1000, 4, 2, 64),
    (1, 513, 1025, 6, 3, 64),
    (2, 1000, 1000, 4, 2, 256),
    (1, 300, 700, 4, 1, 256),
]
GPU_CASES = [
    (shape, causal, lazy) for shape in GPU_SHAPES for causal in (False, True) for lazy in (True, False)
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, causal, lazy",
    GPU_CASES,
    ids=[f"{'x'.join(map(str, s))}-causal{int(c)}-lazy{int(z)}" for s, c, z in GPU_CASES],
)
def test_gpu_gluon_matches_reference(shape, causal, lazy):
    b, s_q, s_k, h, h_kv, d = shape
    g = torch.Generator().manual_seed(s_q * 31 + s_k)
    mk = lambda *sh: torch.randn(*sh, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    q, k, v = mk(b, s_q, h, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d)
    o, lse = gluon_attention_forward(q.detach(), k.detach(), v.detach(), causal=causal, lazy_rescale=lazy)
    ref = attention_exact(q, k, v, causal=causal)
    assert_rel_close(o, ref, 1.5e-2, "output")
    torch.testing.assert_close(lse.double(), _lse_exact(q, k, causal), atol=2e-2, rtol=1e-3)
    # Through the public API: the Gluon forward's O and LSE feed the backward bwd="auto" picks.
    out = attention(q, k, v, causal=causal, gluon=True, lazy_rescale=lazy)
    assert_rel_close(out, ref, 1.5e-2, "output (attention, gluon=True)")
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g_, r in zip("qkv", grads, ref_grads, strict=True):
        assert_rel_close(g_, r, 3e-2, f"d{name}")


GPU_VARIANTS = [(1, False), (2, False), (2, True)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "consumers, sync", GPU_VARIANTS, ids=[f"consumers{c}-sync{int(s)}" for c, s in GPU_VARIANTS]
)
def test_gpu_gluon_variants_fp16(consumers, sync):
    """fp16, one consumer warpgroup, and two with and without the ping-pong turn barriers."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1000, 4, 128, generator=g).to("cuda", torch.float16)
    k, v = (torch.randn(2, 1100, 2, 128, generator=g).to("cuda", torch.float16) for _ in range(2))
    for causal in (False, True):
        o, lse = gluon_attention_forward(q, k, v, causal=causal, num_consumers=consumers, pingpong_sync=sync)
        assert_rel_close(o, attention_exact(q, k, v, causal=causal), 1.5e-2, "output")
        torch.testing.assert_close(lse.double(), _lse_exact(q, k, causal), atol=2e-2, rtol=1e-3)


# Every knob value of gluon_fwd.KNOBS that differs from the default, on ragged multi-batch shapes: a
# TMA store that ignored the row bound would overwrite the next batch's first rows.
GPU_KNOBS = [
    ((2, 1000, 1000, 4, 2, 128), {"block_n": 64, "num_stages": 4}),
    ((2, 1000, 1000, 4, 2, 128), {"num_stages": 3, "lazy_rescale": True}),
    ((3, 700, 700, 4, 2, 128), {"store_tma": True}),
    ((2, 333, 500, 4, 4, 128), {"store_tma": True, "num_consumers": 1}),
    ((2, 1000, 1000, 4, 2, 64), {"store_tma": True}),
    ((2, 1000, 1000, 4, 2, 128), {"load_regs": 32, "consumer_regs": 232}),
    ((3, 700, 700, 4, 2, 256), {"store_tma": True}),
    ((2, 1000, 1000, 4, 2, 256), {"num_stages": 1}),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, knobs",
    GPU_KNOBS,
    ids=["x".join(map(str, s)) + "".join(f"-{k}{int(v)}" for k, v in kw.items()) for s, kw in GPU_KNOBS],
)
def test_gpu_gluon_knobs(shape, knobs):
    b, s_q, s_k, h, h_kv, d = shape
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, s_q, h, d, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(b, s_k, h_kv, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    for causal in (False, True):
        o, lse = gluon_attention_forward(q, k, v, causal=causal, **knobs)
        assert_rel_close(
            o, attention_exact(q, k, v, causal=causal), 1.5e-2, f"output {knobs} causal={causal}"
        )
        torch.testing.assert_close(lse.double(), _lse_exact(q, k, causal), atol=2e-2, rtol=1e-3)
