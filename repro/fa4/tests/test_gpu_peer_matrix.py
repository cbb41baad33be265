"""flash-attn's own test matrices, run on our ``attention``: every shape, head size, mask, head grouping
and dtype its tests parametrise, for the functions both libraries have (issue #42's target: no refusal,
no failure). Each case: forward and gradients against float64, with SDPA's own error on the same
inputs as the yardstick, as ``test_gpu_bwd.py`` judges ours.

The matrices (facts read from flash-attn's tests, Dao-AILab/flash-attention):

* FA2, ``tests/test_flash_attn.py::test_flash_attn_output``: head size d in {32, 40, 59, 64, 96, 111,
  128, 160, 192, 224, 256} (d_v = d); (S_q, S_k) in the ten pairs of :data:`FA2_SEQLENS`; causal or
  not; local or not (a window (left, right) drawn from [0, S_k) each); MHA, MQA, GQA with 9 query heads
  on 9, 1 or 3 KV heads; fp16 and bf16; batch 4. Left out: dropout, ALiBi and the packed-QKV layouts
  (features we do not have) and its ``deterministic`` flag (our deterministic backward is a choice of
  kernel, ``bwd="fa2"``: ``test_gpu_deterministic_backward``).
* FA3, ``hopper/test_flash_attn.py::test_flash_attn_output``: d in {64, 96, 128, 192, 256}; d_v = d,
  and 128 too for 128 < d <= 192, and 256 and 512 for d <= 64; (S_q, S_k) in the twenty pairs of
  :data:`FA3_SEQLENS`, causal and local skipped where S_k < S_q (as FA3 does); MHA, MQA, GQA with 6
  query heads on 6, 1 or 2 KV heads; bf16 and fp16; batch 9 (S_k <= 2048) or 2; the backward where
  d_v <= 256 (as FA3). Left out: fp8, softcap, qv, attention chunks, and its kernel choices (pack_gqa,
  num_splits).

Verdict per tensor (o, dq, dk, dv): ours <= max(2 x SDPA's error, FLOOR[dtype]) against float64, the
rule and floors of ``test_gpu_bwd.py`` (an SDPA error over 10 x the floor is no yardstick: floor only). SDPA runs on the same rounded inputs (KV heads repeated) with
cuDNN, else the flash, memory-efficient or math backend, whichever first takes the shape (a window is
a boolean mask, which the flash backend refuses); rows that see no key are zeros in ours and in the
reference (flash-attn's convention) and NaN in SDPA's, which are taken as zeros. Measured errors go
to ``$PAPERCLUB_TEST_LOG``. ``PAPERCLUB_FA4_MATRIX=fa2`` or ``fa3`` runs one matrix (the default both);
``gluon`` (opt-in, e.g. ``fa2,fa3,gluon``) adds both matrices once more through the Gluon forward
(``gluon=True``) at every case it takes (D_v = D, every head size up to 256, no window variant): what
had to pass before the Gluon forward became the default on Hopper (D <= 128 on 2026-11-29; D > 128,
the 256 tile, after its own run);
under compute-sanitizer each case runs two variants (a window with GQA, causal with MQA) on its
two smallest shapes, ours only (the values were checked in the plain pass).

What runs where: without a window, on Hopper, the Gluon forward on q, k and v's tile (64, 128 or 256;
padded), elsewhere the Triton one; the backward is the Gluon one at tiles 64 and 128, the Triton
kernels at 256; every window runs the Triton kernels' window entry points.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from paperclub.testing import log_measure, rel_error, sanitizing
from repro.fa4 import attention
from repro.fa4.reference import attention_exact, window_mask

FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: where the matrix runs (a CPU dry run of the test's own code sets "cpu" under the interpreter)
DEVICE = "cuda"
CLAIM = pytest.mark.claim(
    "fa4/kernel-equals-reference",
    section="Abstract, contributions (1) and (2): the forward algorithm and its backward (arXiv v1)",
)

FA2_SEQLENS = [
    (113, 203), (128, 217), (113, 211), (108, 256), (256, 512),
    (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048),
]  # fmt: skip
FA3_SEQLENS = [
    (1, 1), (64, 128), (128, 192), (256, 256), (239, 1), (799, 3), (113, 203), (113, 128), (128, 217),
    (113, 211), (108, 256), (256, 512), (384, 256), (640, 128), (512, 256), (1024, 1024), (1023, 1024),
    (1024, 1023), (4096, 4096), (4224, 4224),
]  # fmt: skip
FA2_HEAD_DIMS = [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256]
FA3_HEAD_DIMS = [64, 96, 128, 192, 256]


def fa3_dv(d: int) -> list[int]:
    """FA3's d_v values for head size d."""
    return [128, d] if 128 < d <= 192 else ([256, 512, d] if d <= 64 else [d])


def _cases():
    """One test per (matrix, d, d_v, dtype); each runs every head grouping, mask and shape of it."""
    wanted = os.environ.get("PAPERCLUB_FA4_MATRIX", "fa2,fa3").split(",")
    cases = []
    for dtype in (torch.float16, torch.bfloat16):
        t = str(dtype)[6:]
        if "fa2" in wanted:
            cases += [pytest.param("fa2", d, d, dtype, id=f"fa2-d{d}-{t}") for d in FA2_HEAD_DIMS]
        if "fa3" in wanted:
            cases += [
                pytest.param("fa3", d, dv, dtype, id=f"fa3-d{d}-dv{dv}-{t}")
                for d in FA3_HEAD_DIMS
                for dv in fa3_dv(d)
            ]
        if "gluon" in wanted:  # the Gluon forward's cases: D_v = D, every D (it runs no window)
            cases += [
                pytest.param(f"gluon-{m}", d, d, dtype, id=f"gluon-{m}-d{d}-{t}")
                for m, dims in (("fa2", FA2_HEAD_DIMS), ("fa3", FA3_HEAD_DIMS))
                for d in dims
            ]
    return cases


#: under compute-sanitizer (memory accesses, not values): a window with GQA, causal with MQA
SANITIZER_VARIANTS = [("gqa", False, True), ("mqa", True, False)]
#: (head grouping, causal, local) of every case: the peer's mha_type x causal x local
VARIANTS = [
    (mha, causal, local)
    for mha in ("mha", "mqa", "gqa")
    for causal in (False, True)
    for local in (False, True)
]


def _shapes(matrix: str, causal: bool, local: bool):
    """(B, S_q, S_k, H, H_kv of MHA) per pair, as the peer's test sizes them."""
    if matrix == "fa2":
        return [(4, s_q, s_k, 9) for s_q, s_k in FA2_SEQLENS]
    out = []
    for s_q, s_k in FA3_SEQLENS:
        if (causal or local) and s_k < s_q:
            continue  # FA3: "Causal attention requires seqlen_k >= seqlen_q"
        out.append((9 if s_k <= 2048 else 2, s_q, s_k, 6))
    return out


def _h_kv(matrix: str, mha: str, h: int) -> int:
    return h if mha == "mha" else (1 if mha == "mqa" else (3 if matrix == "fa2" else 2))


def _peer(q, k, v, do, causal, window, want_grads):
    """SDPA's output and gradients on the same inputs ([B, S, H, D]), and the backend's name; NaN rows
    (no key) as zeros. (None, None, None) where no backend takes the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    h = q.shape[2]
    s_q, s_k = q.shape[1], k.shape[1]
    mask = None
    if window is not None:
        mask = window_mask(s_q, s_k, window[0], 0 if causal else window[1], q.device)
    elif causal and s_q != s_k:
        mask = causal_lower_right(s_q, s_k)
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        leaves = [t.detach().clone().requires_grad_(want_grads) for t in (q, k, v)]
        qt = leaves[0].transpose(1, 2)
        kt, vt = (t.repeat_interleave(h // t.shape[2], dim=2).transpose(1, 2) for t in leaves[1:])
        try:
            with sdpa_kernel(backend):
                if mask is not None:
                    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
                else:
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                out = out.transpose(1, 2)
                grads = torch.autograd.grad(out, leaves, do) if want_grads else [None] * 3
        except RuntimeError:  # this backend does not take this shape, dtype or mask: try the next
            continue
        fix = lambda t: None if t is None else torch.nan_to_num(t.detach(), nan=0.0)  # noqa: E731
        return name, fix(out), [fix(g) for g in grads]
    return None, None, [None] * 3


def _window(local: bool, s_k: int, g: torch.Generator):
    """flash-attn's local window: (left, right) each drawn from [0, S_k)."""
    return tuple(torch.randint(0, s_k, (2,), generator=g).tolist()) if local else None


@pytest.mark.gpu
@CLAIM
@pytest.mark.parametrize("matrix, d, d_v, dtype", _cases())
def test_gpu_peer_matrix(matrix, d, d_v, dtype):
    switches = {}
    variants = SANITIZER_VARIANTS if sanitizing() else VARIANTS
    if matrix.startswith("gluon-"):
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Gluon forward is a Hopper (sm_90) kernel")
        matrix, switches = matrix.removeprefix("gluon-"), {"gluon": True}
        variants = [v for v in variants if not v[2]] or [("mqa", True, False)]  # no window
    failures = []
    for variant in variants:
        failures += _run_variant(matrix, d, d_v, dtype, *variant, **switches)
    assert not failures, f"{len(failures)} errors over tolerance:\n" + "\n".join(failures)


def _run_variant(matrix, d, d_v, dtype, mha, causal, local, **switches) -> list[str]:
    """Every shape of one (head grouping, causal, local) of a case, ours with ``switches``; the
    failures, as lines."""
    shapes = _shapes(matrix, causal, local)
    if sanitizing():  # memory accesses only: the two smallest shapes (ragged ones among them)
        shapes = sorted(shapes, key=lambda s: s[0] * s[1] * s[2])[:2]
    want_grads = not (matrix == "fa3" and d_v > 256)  # FA3 runs no backward for d_v > 256
    failures = []
    for i, (b, s_q, s_k, h) in enumerate(shapes):
        h_kv = _h_kv(matrix, mha, h)
        g = torch.Generator(device=DEVICE).manual_seed(1000 * i + d + d_v)
        gw = torch.Generator().manual_seed(1000 * i + d + d_v)
        q = torch.randn(b, s_q, h, d, device=DEVICE, generator=g).to(dtype)
        k = torch.randn(b, s_k, h_kv, d, device=DEVICE, generator=g).to(dtype)
        v = torch.randn(b, s_k, h_kv, d_v, device=DEVICE, generator=g).to(dtype)
        do = torch.randn(b, s_q, h, d_v, device=DEVICE, generator=g).to(dtype)
        window = _window(local, s_k, gw)
        leaves = [t.clone().requires_grad_(want_grads) for t in (q, k, v)]
        out = attention(*leaves, causal=causal, window=window, **switches)
        ours = [out.detach(), *(torch.autograd.grad(out, leaves, do) if want_grads else [])]
        if sanitizing():
            torch.cuda.synchronize()
            continue
        ref_leaves = [t.double().requires_grad_(want_grads) for t in (q, k, v)]
        ref_out = attention_exact(*ref_leaves, causal=causal, window=window)
        ref = [
            ref_out.detach(),
            *(torch.autograd.grad(ref_out, ref_leaves, do.double()) if want_grads else []),
        ]
        del ref_out, ref_leaves
        peer_name, peer_out, peer_grads = _peer(q, k, v, do, causal, window, want_grads)
        peer = [peer_out, *peer_grads][: len(ours)]
        shape = dict(B=b, S_q=s_q, S_k=s_k, H=h, H_kv=h_kv, causal=causal, window=window)
        for name, a, r, p in zip(("o", "dq", "dk", "dv"), ours, ref, peer, strict=False):
            if r.norm() == 0:  # nothing to compare (a window of one key per row: dq = dk = 0 exactly)
                log_measure(
                    "fa4/gpu-peer-matrix", matrix=matrix, d=d, d_v=d_v, **shape, tensor=name, error=None
                )
                continue
            err = rel_error(a, r)
            peer_err = rel_error(p, r) if p is not None else float("nan")
            # a peer far off the reference is no yardstick (a backend that got a mask wrong): floor only
            usable = peer_err == peer_err and peer_err <= 10 * FLOOR[dtype]
            tol = max(2 * peer_err, FLOOR[dtype]) if usable else FLOOR[dtype]
            log_measure(
                "fa4/gpu-peer-matrix", matrix=matrix, **switches, d=d, d_v=d_v, local=local, mha=mha,
                dtype=str(dtype), **shape, tensor=name, error=float(f"{err:.3g}"), peer=peer_name,
                peer_error=float(f"{peer_err:.3g}"), tolerance=float(f"{tol:.3g}"),
            )  # fmt: skip
            if not err <= tol:
                failures.append(f"{shape} {name}: {err:.2e} > {tol:.1e} ({peer_name} {peer_err:.2e})")
        del ours, ref, peer, peer_grads, peer_out, leaves, out
    torch.cuda.empty_cache()
    return failures


@pytest.mark.gpu
@pytest.mark.claim(
    "fa4/deterministic-backward",
    section="arXiv 2603.05451v1, the backward pass: deterministic mode",
)
@pytest.mark.parametrize("window", [None, (300, 0)], ids=["causal", "window"])
def test_gpu_deterministic_backward(window):
    """bwd="fa2" sums every gradient in a fixed order (dQ in its own kernel, one program per query
    block; dK, dV in registers, one program per key block): five runs give the same bits. Beside it,
    whether the default backward's (atomic or bulk-reduced dQ) bits move from run to run is logged,
    not asserted (that is the nondeterminism the paper's deterministic mode removes)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 2048, 8, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2, 2048, 2, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    do = torch.randn_like(q)

    def grads(bwd):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, causal=True, window=window, bwd=bwd)
        return torch.autograd.grad(out, leaves, do)

    runs = 1 if sanitizing() else 4
    first = grads("fa2")
    for _ in range(runs):
        again = grads("fa2")
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), "fa2 backward bits moved"
    base = grads("auto")
    moved = sum(
        not all(torch.equal(a, b) for a, b in zip(base, grads("auto"), strict=True)) for _ in range(runs)
    )
    log_measure("fa4/deterministic-backward", window=str(window), auto_runs_that_differed=moved, of=runs)


@pytest.mark.gpu
@CLAIM
@pytest.mark.parametrize("d, d_v", [(96, 96), (59, 200)], ids=["d96", "d59-dv200"])
def test_gpu_gluon_forward_on_padded_heads(d, d_v):
    """gluon=True (the Gluon forward, Hopper) on padded head sizes and v in chunks: the verified
    kernel at D = 128 (v in two chunks of 128 for D_v = 200), against float64 (bf16: 1e-2)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a Hopper (sm_90) kernel")
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(2, 1000, 8, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 1000, 2, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(2, 1000, 2, d_v, device="cuda", generator=g).bfloat16()
    do = torch.randn(2, 1000, 8, d_v, device="cuda", generator=g).bfloat16()
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, causal=causal, gluon=True)
        grads = torch.autograd.grad(out, leaves, do)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = attention_exact(*ref_leaves, causal=causal)
        ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
        for name, a, r in zip(("o", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
            assert rel_error(a, r) <= FLOOR[torch.bfloat16], f"{name} causal={causal}: {rel_error(a, r):.2e}"
