"""GPU checks of the local attention backends inside the ring (one GPU: an emulated ring of 4 ranks,
the same steps, merges and block backwards as the distributed one) and of usp_attention at world 1.

bf16/fp16 against a float32 reference on the same GPU: tolerance 2e-2 relative (bf16 rounds O and
each gradient to ~4e-3; the LSE merges and the dK/dV sums over 4 blocks add a little).
"""

from __future__ import annotations

import pytest
import torch

from paperclub.testing import assert_rel_close
from repro.usp import shard, unshard, usp_attention
from repro.usp.local import get_backend
from repro.usp.reference import attention
from repro.usp.ring import emulated_ring_attention
from repro.usp.tests import worker
from repro.usp.tests.sections import HYBRID_SECTION, RING_SECTION

TOL = 2e-2


def _inputs(S, H, H_kv, D, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, S, H, D, device="cuda", generator=gen)
    k = torch.randn(2, S, H_kv, D, device="cuda", generator=gen)
    v = torch.randn(2, S, H_kv, D, device="cuda", generator=gen)
    do = torch.randn(2, S, H, D, device="cuda", generator=gen)
    return [t.to(dtype) for t in (q, k, v, do)]


def _reference(q, k, v, do, causal):
    leaves = [t.detach().float().clone().requires_grad_(True) for t in (q, k, v)]
    o = attention(*leaves, causal=causal)
    o.backward(do.float())
    return [o.detach(), *(t.grad for t in leaves)]


def _emulated(backend, causal, layout, n=4, S=768, H=4, H_kv=2, D=128, dtype=torch.bfloat16):
    q, k, v, do = _inputs(S, H, H_kv, D, dtype)
    want = _reference(q, k, v, do, causal)
    sh = [torch.stack([shard(t, n, r, layout) for r in range(n)]).requires_grad_(True) for t in (q, k, v)]
    do_sh = torch.stack([shard(do, n, r, layout) for r in range(n)])
    o = emulated_ring_attention(
        *sh, causal=causal, scale=D**-0.5, layout=layout, backend=get_backend(backend)
    )
    o.backward(do_sh)
    for name, got, ref in zip(
        ("o", "dq", "dk", "dv"), (o.detach(), *(t.grad for t in sh)), want, strict=True
    ):
        assert got.dtype == dtype
        assert_rel_close(unshard(list(got), layout).float(), ref, TOL, f"{backend} {name}")


@pytest.mark.gpu
@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@pytest.mark.parametrize("backend", ["sdpa", "fa4"])
@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (True, "contiguous"), (False, "zigzag")])
def test_ring_backends_on_gpu(backend, causal, layout):
    """PyTorch's flash kernel and repro.fa4 as the ring's local attention: LSE merge and ring
    backward with the global O and LSE, GQA, off-tile length (S/8 = 96 per chunk)."""
    _emulated(backend, causal, layout)


@pytest.mark.gpu
def test_ring_cudnn_backend_on_gpu():
    """The cuDNN backend as the ring's local attention (written without a GPU; passed on an H100,
    2026-11-25, where it had been an xfail)."""
    _emulated("sdpa_cudnn", True, "zigzag")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,D", [("sdpa", torch.float16, 64), ("fa4", torch.bfloat16, 64)])
def test_usp_world_one_on_gpu(backend, dtype, D):
    """usp_attention without groups (one rank) on the GPU, fp16 and bf16, D = 64."""
    q, k, v, do = _inputs(1000, 4, 4, D, dtype, seed=1)
    want = _reference(q, k, v, do, True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = usp_attention(*leaves, causal=True, layout="contiguous", backend=backend)
    o.backward(do)
    for name, got, ref in zip(
        ("o", "dq", "dk", "dv"), (o.detach(), *(t.grad for t in leaves)), want, strict=True
    ):
        assert_rel_close(got.float(), ref, TOL, f"{backend} {name}")


@pytest.mark.gpu
def test_sdpa_fp32_falls_back_to_math_on_gpu():
    """The flash kernel has no fp32: the sdpa backend computes fp32 with explicit matmuls (tf32 off)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _emulated("sdpa", True, "zigzag", n=2, S=256, D=64, dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.gpu
@pytest.mark.claim("usp/ring-exact", section=RING_SECTION)
@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (False, "contiguous")])
def test_auto_backend_ring_on_gpu(causal, layout):
    """The default local attention ("auto": cuDNN on CUDA bf16) inside the ring: LSE merge in place,
    ring backward with the global O and LSE, GQA, off-tile length."""
    _emulated("auto", causal, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,S", [(torch.bfloat16, 128, 1000), (torch.float16, 64, 777)])
def test_auto_backend_world_one_on_gpu(dtype, D, S):
    """usp_attention's default path at world 1 (one cuDNN call, its own O and gradients, no casts)."""
    q, k, v, do = _inputs(S, 8, 2, D, dtype, seed=2)
    want = _reference(q, k, v, do, True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = usp_attention(*leaves, causal=True, layout="contiguous")
    o.backward(do)
    for name, got, ref in zip(
        ("o", "dq", "dk", "dv"), (o.detach(), *(t.grad for t in leaves)), want, strict=True
    ):
        assert got.dtype == dtype
        assert_rel_close(got.float(), ref, TOL, f"auto {name}")


@pytest.mark.gpu
def test_fa4_gluon_backend_ring_on_gpu():
    """repro.fa4's Gluon forward (with FA2's Triton backward) as the ring's local attention (Hopper)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa4_gluon is a Hopper (sm_90) kernel")
    _emulated("fa4_gluon", True, "zigzag")


@pytest.mark.gpu
@pytest.mark.claim("usp/usp-exact", section=HYBRID_SECTION)
def test_multi_gpu_selfcheck_nccl():
    """Two (or four) GPUs, NCCL: every factorisation, both layouts, causal and not, with and without
    the Ulysses head-group pipeline, outputs and gradients against one-device attention (bf16)."""
    from nanoparallel.launch import spawn_ranks

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs two GPUs")
    world = 4 if n >= 4 else 2

    def crashed(message):
        rank, failed, rows = message
        return f"rank {rank}: {rows[0]}" if failed < 0 else None

    out = spawn_ranks(
        world, worker.nccl_selfcheck_rank, {"seq": 128 * world, "backend": "auto"}, 240, crashed
    )
    rank0 = [m for m in out if m[0] == 0][0]
    assert all(m[1] == 0 for m in out), "\n".join(rank0[2])
