"""GPU matrix of the backward passes (``bwd="fa2"`` and ``bwd="fused"``) against the fp64 reference,
with cuDNN's own error on the same inputs beside ours.

Matrix: D 64 / 128 x causal or not x bf16 / fp16 x both backwards, each over SHAPES: S = 1, 113 (off
every tile), 1000, 2048; S_q < S_k and S_q > S_k (causal: the first S_q - S_k rows see no key, zero
output and gradient as in flash-attn); GQA (H = 8 on H_kv = 2) and MHA; B = 1 and 2. The fused backward
also runs behind the Gluon forward (the pairing the benchmark times).

Verdict per tensor (o, dq, dk, dv): ours <= max(2 x cuDNN's error, FLOOR[dtype]). cuDNN is torch SDPA
with ``SDPBackend.CUDNN_ATTENTION`` on the same rounded inputs (KV heads repeated for GQA; a
bottom-right causal mask from ``causal_lower_right`` when S_q != S_k), falling back to the flash
backend, then the memory-efficient one, where a backend refuses a shape; where none runs (or its
result is not finite, e.g. rows without keys) only the floor applies. FLOOR: a few roundings of the
half-precision type (P and dS before their matmuls, the output cast) at unit roundoff 2^-9 (bf16)
and 2^-12 (fp16): 1e-2 and 2e-3; the fp32 accumulation order (dQ atomics) is far below both.
Measured errors go to ``$PAPERCLUB_TEST_LOG`` (``log_measure``). Under compute-sanitizer
(``sanitizing()``) only our kernels run, on the shapes with ragged tails, for their memory accesses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paperclub.testing import log_measure, rel_error, sanitizing
from repro.fa4 import attention
from repro.fa4.reference import attention_exact

FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

#: (B, S_q, S_k, H, H_kv)
SHAPES = [
    (1, 1, 1, 8, 2),
    (2, 113, 113, 8, 2),
    (2, 1000, 1000, 8, 8),
    (1, 2048, 2048, 8, 2),
    (1, 113, 1000, 8, 2),
    (1, 1000, 113, 8, 8),
    (2, 1, 2048, 8, 2),
]
SANITIZER_SHAPES = [(2, 113, 113, 8, 2), (1, 113, 1000, 8, 2), (1, 1000, 113, 8, 8)]

FUSED_CLAIM = pytest.mark.claim(
    "fa4/fused-backward-exact", section="Abstract, contribution (3): the backward pass (arXiv v1)"
)
FA2_CLAIM = pytest.mark.claim(
    "fa4/kernel-equals-reference",
    section="Abstract, contributions (1) and (2): the forward algorithm and its backward (arXiv v1)",
)
CASES = [
    pytest.param(d, causal, dtype, bwd, fwd, marks=FUSED_CLAIM if bwd == "fused" else FA2_CLAIM,
                 id=f"d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}-{bwd}-{fwd}")
    for d in (64, 128)
    for causal in (False, True)
    for dtype in (torch.bfloat16, torch.float16)
    for bwd, fwd in (("fa2", "triton"), ("fused", "triton"), ("fused", "gluon"))
    if fwd == "triton" or dtype == torch.bfloat16
]  # fmt: skip


def _peer(q, k, v, do, causal):
    """cuDNN's (or the fallback backend's) output and gradients on the same inputs, [B, S, H, D]; and
    the backend's name. None where every backend refuses the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    h = q.shape[2]
    s_q, s_k = q.shape[1], k.shape[1]
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        qt = leaves[0].transpose(1, 2)
        kt, vt = (t.repeat_interleave(h // t.shape[2], dim=2).transpose(1, 2) for t in leaves[1:])
        try:
            with sdpa_kernel(backend):
                if causal and s_q != s_k:
                    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(s_q, s_k))
                else:
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                out = out.transpose(1, 2)
                grads = torch.autograd.grad(out, leaves, do)
        except RuntimeError:  # this backend does not take this shape or dtype: try the next
            continue
        return name, out.detach(), grads
    return None, None, None


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal, dtype, bwd, fwd", CASES)
def test_gpu_backward_matrix(d, causal, dtype, bwd, fwd, extra=None):
    """``extra``: more switches (test_gluon_bwd's atomic-dQ cross-check calls this body with them)."""
    switches = {"bwd": bwd, **({"gluon": True} if fwd == "gluon" else {}), **(extra or {})}
    failures = []
    for seed, (b, s_q, s_k, h, h_kv) in enumerate(SANITIZER_SHAPES if sanitizing() else SHAPES):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (
            torch.randn(b, s, n, d, generator=g).to("cuda", dtype)
            for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv))
        )
        do = torch.randn(b, s_q, h, d, generator=g).to("cuda", dtype)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, causal=causal, **switches)
        ours = [out.detach(), *torch.autograd.grad(out, leaves, do)]
        torch.cuda.synchronize()
        if sanitizing():  # the pass for memory errors: values were checked in the plain pass
            continue
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out = attention_exact(*ref_leaves, causal=causal)
        ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_leaves, do.double())]
        del ref_out, ref_leaves
        peer_name, peer_out, peer_grads = _peer(q, k, v, do, causal)
        peer = [peer_out, *peer_grads] if peer_name else [None] * 4
        shape = dict(B=b, S_q=s_q, S_k=s_k, H=h, H_kv=h_kv)
        for name, a, r, p in zip(("o", "dq", "dk", "dv"), ours, ref, peer, strict=True):
            err = rel_error(a, r)
            peer_err = rel_error(p, r) if p is not None else float("nan")
            usable = peer_err == peer_err and peer_err != float("inf")
            tol = max(2 * peer_err, FLOOR[dtype]) if usable else FLOOR[dtype]
            log_measure(
                "fa4/gpu-bwd-matrix", d=d, causal=causal, dtype=str(dtype), bwd=bwd, fwd=fwd, **shape,
                tensor=name, error=float(f"{err:.3g}"), peer=peer_name, peer_error=float(f"{peer_err:.3g}"),
                tolerance=float(f"{tol:.3g}"),
            )  # fmt: skip
            if not err <= tol:
                failures.append(f"{shape} {name}: {err:.2e} > {tol:.1e} ({peer_name} {peer_err:.2e})")
        del ours, ref, peer, peer_grads, peer_out, leaves, out
        torch.cuda.empty_cache()
    assert not failures, "errors over tolerance:\n" + "\n".join(failures)
