"""FlashAttention-4's algorithmic ideas (zadouri2026flashattention4) in a Triton attention for Hopper.

Public API::

    from repro.fa4 import attention
    out = attention(q, k, v, causal=True)                      # [B, S, H, D], bf16 / fp16
    out = attention(q, k, v, lazy_rescale=False, soft_exp=2)   # ablation switches

q: [B, S_q, H, D]; k, v: [B, S_k, H_kv, D] with H_kv dividing H (grouped-query attention);
D in {64, 128}; causal masks are bottom-right aligned (query i sees keys j <= i + S_k - S_q; with
S_q > S_k the first S_q - S_k queries see no key and get zero output and zero gradient, as in
flash-attn). Forward and backward run through Triton kernels (``repro.fa4.kernels``, the fused
backward in ``repro.fa4.bwd_fused``) or, on Hopper, warp-specialised Gluon kernels: the forward with
``gluon=True`` (``repro.fa4.gluon_fwd``), the backward ``repro.fa4.gluon_bwd``, which the default
``bwd="auto"`` picks there (:func:`auto_backward`); ``repro.fa4.reference`` is the ground truth.

:func:`attention_any_d` is the internal entry point the CPU tests use: it also takes D in
{16, 32} and float32 (for the Triton interpreter, where bf16 matmuls are slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from paperclub.triton_compat import interpreting
from repro.fa4.reference import RESCALE_THRESHOLD

__all__ = ["Switches", "attention", "attention_any_d", "forward_with_counts"]

PUBLIC_HEAD_DIMS = (64, 128)
TEST_HEAD_DIMS = (16, 32, 64, 128)
PUBLIC_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Switches:
    """Which FA4 ideas the forward kernel uses, plus its launch shape.

    lazy_rescale: conditional rescaling (FA4); False is FA2's rescale-every-block.
    rescale_threshold: tau in log2 units (FA4 uses 8 = log2 256).
    soft_exp: quarters of each tile's columns whose 2^x runs on the FMA units (0, 1, 2 or 4).
    pingpong: each program owns two query tiles sharing K/V loads.
    warp_specialize: Triton's automatic warp specialisation of the key loop.
    persistent: one program per SM looping over tiles (heaviest causal tiles first).
    tma: load K and V tiles with the TMA copy engine (tensor descriptors) instead of pointer loads.
    gluon: run the forward as the warp-specialised Gluon kernel (``repro.fa4.gluon_fwd``: a TMA load
        warp filling a K/V ring guarded by mbarriers, two consumer warpgroups on their own 64-row
        query tiles with asynchronous wgmma, FA3's schedule); Hopper (sm_90) only. The backward is
        whichever ``bwd`` picks (with "auto", the Gluon backward on Hopper). lazy_rescale /
        rescale_threshold apply (row by row there); soft_exp, pingpong, persistent and
        warp_specialize do not exist in it (an error), the forward launch shape
        (block_m, block_n, num_warps, num_stages) is ignored; it launches with GLUON_LAUNCH. Measured
        on an H100 (results/*-gluon-combos.json, *-peer.json): 0.98-1.13x cuDNN's forward at S = 4k-16k
        (1.30-1.50x the Triton kernel with tma=True); lazy_rescale costs nothing there (within 0.6%).
    block_m, block_n, num_warps, num_stages: launch shape; None picks the tuned default.
    bwd: which backward runs. "fa2": FA2's two kernels (dK/dV per key block, then dQ per query block;
        S and dP computed twice, 7 matmuls per tile pair, no atomics). "fused": FA3's one-pass schedule
        (``repro.fa4.bwd_fused``: one program per key block, dK/dV in registers, dQ by fp32 atomic adds,
        5 matmuls; a preprocess kernel for delta = rowsum(dO * O)). "gluon": the same 5-matmul
        schedule warp-specialised in Gluon (``repro.fa4.gluon_bwd``: a TMA load warp, two consumer
        warpgroups of 64 keys each with asynchronous wgmma, dQ by fp32 atomics); Hopper (sm_90) only,
        refused in the CPU interpreter. "auto" (the default, :func:`auto_backward`): "gluon" on
        Hopper, else "fused" when causal and "fa2" otherwise. Measured on an H100 (results/*-bwd.json,
        2026-11-25, D = 128, bf16, S = 4k-16k, fwd+bwd behind the Gluon forward, interleaved rounds):
        gluon 0.77-0.83x cuDNN's speed; fused 0.67-0.75x; fa2 0.67-0.73x.
    bwd_block_m, bwd_block_n, bwd_num_warps, bwd_num_stages: the launch shape of the Triton
        backwards ("fa2", "fused"; the Gluon backward launches with gluon_bwd.GLUON_BWD_DEFAULTS);
        None picks BWD_DEFAULTS ("fa2") or bwd_fused.FUSED_DEFAULTS ("fused").
    bwd_tma: "fused" only: Q and dO tiles through TMA (tensor descriptors); None picks the default.
    bwd_dq_tma: "fused" and "gluon": dQ tiles added by TMA bulk reductions from shared memory (FA3's
        way) instead of one atomic add per element; not in the CPU interpreter. None picks the default
        ("gluon": gluon_bwd.DQ_TMA, on since its H100 run of 2026-11-27).
    bwd_dq_defer: "gluon" only: each step's dQ product one step later, off the barrier on which the
        two consumer warpgroups exchange dS^T halves. None picks gluon_bwd.DQ_DEFER (off: wrong
        results on an H100).

    Measured on one H100 (results/nvidia-h100-80gb-hbm3.json, forward, S = 4k-16k): tma=True is
    the fastest single change (up to +9%); lazy_rescale=False is 3-8% faster than the default here
    (the tile-wide skip decision costs a cross-warp reduction); soft_exp, pingpong and persistent
    all slow it down. The defaults keep FA4's choices so that the ablation reads against them.
    """

    lazy_rescale: bool = True
    rescale_threshold: float = RESCALE_THRESHOLD
    soft_exp: int = 0
    pingpong: bool = False
    warp_specialize: bool = False
    persistent: bool = False
    tma: bool = False
    gluon: bool = False
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    bwd_block_m: int | None = None
    bwd_block_n: int | None = None
    bwd_num_warps: int | None = None
    bwd_num_stages: int | None = None
    bwd: str = "auto"
    bwd_tma: bool | None = None
    bwd_dq_tma: bool | None = None
    bwd_dq_defer: bool | None = None


#: The backwards behind Switches.bwd ("auto" picks one of them by device and causality: auto_backward).
BACKWARDS = ("auto", "fa2", "fused", "gluon")
# Tuned on one H100 (repro/fa4/results/*-autotune.json, S = 8192): (block_m, block_n, num_warps, num_stages).
FWD_DEFAULTS = {64: (128, 128, 8, 3), 128: (128, 128, 8, 3)}
BWD_DEFAULTS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dims, dtypes) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be [B, S, H, D] (4 dims), got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(
                f"attention: {name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, s_q, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"attention: k must be [B={b}, S_k, H_kv, D={d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if d not in dims:
        raise ValueError(f"attention: head dim D = {d} is not supported, expected one of {list(dims)}")
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"attention: KV heads H_kv = {h_kv} must divide query heads H = {h}")
    if s_q == 0 or k.shape[1] == 0 or b == 0:
        raise ValueError(f"attention: empty input, q {tuple(q.shape)}, k {tuple(k.shape)}")


def _resolve(sw: Switches, d: int, interpret: bool) -> Switches:
    if sw.soft_exp not in (0, 1, 2, 4):
        raise ValueError(
            f"attention: soft_exp is the number of quarters in software, 0, 1, 2 or 4; got {sw.soft_exp}"
        )
    if sw.rescale_threshold < 0 or sw.rescale_threshold > 64:
        # 2^tau per term times S_k terms must stay far below fp32's 2^128.
        raise ValueError(
            f"attention: rescale_threshold must be in [0, 64] (log2 units), got {sw.rescale_threshold}"
        )
    if sw.bwd not in BACKWARDS:
        raise ValueError(f"attention: bwd must be one of {list(BACKWARDS)}, got {sw.bwd!r}")
    takes_by_name = {"bwd_tma": ("fused",), "bwd_dq_tma": ("fused", "gluon"), "bwd_dq_defer": ("gluon",)}
    for name, takes in takes_by_name.items():
        if getattr(sw, name) and sw.bwd not in takes:
            allowed = " or ".join(repr(t) for t in takes)
            raise ValueError(f"attention: {name} applies to bwd={allowed} only, got bwd={sw.bwd!r}")
    if sw.bwd == "gluon" and interpret:
        raise ValueError(
            "attention: bwd='gluon' is a Gluon kernel for Hopper GPUs (sm_90a); Gluon kernels do not run in "
            "Triton's CPU interpreter (TRITON_INTERPRET=1): use bwd='fused' or 'fa2' there"
        )
    bm, bn, nw, ns = FWD_DEFAULTS.get(d, (16, 16, 4, 1)) if not interpret else (16, 16, 4, 1)
    if sw.bwd == "fused":
        from repro.fa4.bwd_fused import FUSED_DEFAULTS, FUSED_INTERPRET

        bbm, bbn, bnw, bns, btma, bdq = (
            FUSED_DEFAULTS.get(d, FUSED_INTERPRET) if not interpret else FUSED_INTERPRET
        )
    else:
        bbm, bbn, bnw, bns = BWD_DEFAULTS.get(d, (16, 16, 4, 1)) if not interpret else (16, 16, 4, 1)
        btma = False
        bdq = None if sw.bwd == "gluon" else False  # "gluon": None takes gluon_bwd.DQ_TMA
    if sw.pingpong and sw.block_m is None:
        bm = max(16, bm // 2)  # two tiles per program: keep the rows per program the same
    if sw.soft_exp == 1 and sw.num_stages is None:
        # The 1-in-4 column split needs a layout conversion through shared memory, which does not
        # fit beside three K/V stages of 128 x 128 on an H100 (262 KB asked, 227 KB there).
        ns = min(ns, 2)
    return replace(
        sw,
        block_m=sw.block_m or bm,
        block_n=sw.block_n or bn,
        num_warps=sw.num_warps or nw,
        num_stages=sw.num_stages or ns,
        bwd_block_m=sw.bwd_block_m or bbm,
        bwd_block_n=sw.bwd_block_n or bbn,
        bwd_num_warps=sw.bwd_num_warps or bnw,
        bwd_num_stages=sw.bwd_num_stages or bns,
        bwd_tma=btma if sw.bwd_tma is None else sw.bwd_tma,
        bwd_dq_tma=bdq if sw.bwd_dq_tma is None else sw.bwd_dq_tma,
    )


_SM_COUNT: dict[int, int] = {}


#: Launch knobs of the Gluon forward behind ``gluon=True``, from the interleaved sweep on an H100
#: (results/nvidia-h100-80gb-hbm3-gluon-combos.json, median of 5 rounds, forward vs cuDNN at
#: S = 4k / 8k / 16k): no turn barriers between the two consumers (the warp schedulers interleave
#: them well enough) and the output stored through shared memory by TMA: with lazy rescaling (the
#: Switches default) 0.98 / 1.01 / 1.04 non-causal and 1.02 / 1.06 / 1.13 causal, against the
#: launcher's defaults 0.96 / 0.99 / 1.00 and 0.99 / 1.05 / 1.12.
GLUON_LAUNCH = {"pingpong_sync": False, "store_tma": True}


def _forward_gluon(q, k, v, causal: bool, scale: float, sw: Switches, count: bool):
    from repro.fa4.gluon_fwd import gluon_attention_forward

    other = [n for n in ("soft_exp", "pingpong", "persistent", "warp_specialize") if getattr(sw, n)]
    if other:
        raise ValueError(
            f"attention: gluon=True has its own forward schedule; it cannot combine with {other}"
        )
    if count:
        raise ValueError(
            "attention: forward_with_counts counts the Triton kernel's rescales; not with gluon=True"
        )
    o, lse = gluon_attention_forward(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        lazy_rescale=sw.lazy_rescale,
        rescale_threshold=sw.rescale_threshold,
        **GLUON_LAUNCH,
    )
    return o, lse, torch.zeros(2, device=q.device, dtype=torch.int32)


def _forward(q, k, v, causal: bool, scale: float, sw: Switches, count: bool = False):
    from repro.fa4.kernels import _fwd_kernel

    if sw.gluon:
        return _forward_gluon(q, k, v, causal, scale, sw, count)
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s_q, device=q.device, dtype=torch.float32)
    tile = sw.block_m * (2 if sw.pingpong else 1)
    n_m = triton_cdiv(s_q, tile)
    counts = torch.zeros(2 * n_m * b * h if count else 2, device=q.device, dtype=torch.int32)
    if sw.persistent:
        if q.device.type == "cuda":
            idx = q.device.index or 0
            if idx not in _SM_COUNT:
                _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
            n_prog = _SM_COUNT[idx]
        else:
            n_prog = 4
        grid = (min(n_prog, n_m * b * h),)
    else:
        grid = (n_m, b * h)
    kk, vv = k, v
    if sw.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kk, vv = (TensorDescriptor.from_tensor(t.view(b * s_k, h_kv * d), [sw.block_n, d]) for t in (k, v))
    _fwd_kernel[grid](
        q, kk, vv, o, lse, counts,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        b, h, h // h_kv, s_q, s_k, scale / math.log(2.0), n_m,
        D=d, BLOCK_M=sw.block_m, BLOCK_N=sw.block_n, CAUSAL=causal,
        LAZY_RESCALE=sw.lazy_rescale, RESCALE_TAU=float(sw.rescale_threshold), SOFT_EXP=sw.soft_exp,
        PINGPONG=sw.pingpong, WARP_SPEC=sw.warp_specialize, PERSISTENT=sw.persistent, COUNT=count, USE_TMA=sw.tma,
        num_warps=sw.num_warps, num_stages=sw.num_stages,
    )  # fmt: skip
    return o, lse, counts


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _backward(do, q, k, v, o, lse, causal: bool, scale: float, sw: Switches):
    from repro.fa4.kernels import _bwd_dkdv_kernel, _bwd_dq_kernel

    if sw.bwd == "gluon":
        from repro.fa4.gluon_bwd import gluon_attention_backward

        return gluon_attention_backward(
            do, q, k, v, o, lse, causal, scale, dq_tma=sw.bwd_dq_tma, dq_defer=sw.bwd_dq_defer
        )
    if sw.bwd == "fused":
        from repro.fa4.bwd_fused import backward_fused

        return backward_fused(
            do, q, k, v, o, lse, causal, scale,
            sw.bwd_block_m, sw.bwd_block_n, sw.bwd_num_warps, sw.bwd_num_stages, sw.bwd_tma, sw.bwd_dq_tma,
        )  # fmt: skip
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    do = do.contiguous()
    # delta_i = sum_d dO_id O_id = rowsum(P * dP): the softmax-Jacobian term, one pass in PyTorch.
    delta = (do.float() * o.float()).sum(-1).permute(0, 2, 1).contiguous()  # [B, H, S_q]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    qk_scale = scale / math.log(2.0)
    bm, bn = sw.bwd_block_m, sw.bwd_block_n
    _bwd_dkdv_kernel[(triton_cdiv(s_k, bn), b * h_kv)](
        q, k, v, do, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        h, h_kv, h // h_kv, s_q, s_k, qk_scale, scale,
        D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, num_warps=sw.bwd_num_warps, num_stages=sw.bwd_num_stages,
    )  # fmt: skip
    # dQ tiles are the transpose of dK/dV's: many query rows, fewer keys per step.
    _bwd_dq_kernel[(triton_cdiv(s_q, bn), b * h)](
        q, k, v, do, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        h, h // h_kv, s_q, s_k, qk_scale, scale,
        D=d, BLOCK_M=bn, BLOCK_N=bm, CAUSAL=causal, num_warps=sw.bwd_num_warps, num_stages=sw.bwd_num_stages,
    )  # fmt: skip
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, sw):
        o, lse, _ = _forward(q, k, v, causal, scale, sw)
        ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), o, lse)
        ctx.causal, ctx.scale, ctx.sw = causal, scale, sw
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.sw)
        return dq, dk, dv, None, None, None


def _run(q, k, v, causal, scale, switches, dims, dtypes):
    _check(q, k, v, causal, dims, dtypes)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"attention: scale must be a positive finite number, got {scale}")
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError("attention: needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter")
    unknown = set(switches) - set(Switches.__dataclass_fields__)
    if unknown:
        raise TypeError(
            f"attention: unknown switches {sorted(unknown)}; known: {list(Switches.__dataclass_fields__)}"
        )
    sw = Switches(**switches)
    if sw.bwd == "auto":
        sw = replace(sw, bwd=auto_backward(q, causal))
    sw = _resolve(sw, d, interpreting())
    if sw.bwd == "gluon":  # refuse before the forward runs, not at the first backward
        from repro.fa4.gluon_bwd import check_device

        check_device(q)
    return _with_empty_rows(lambda qs: _Attention.apply(qs, k, v, bool(causal), scale, sw), q, k, causal)


def auto_backward(q: torch.Tensor, causal: bool) -> str:
    """The backward bwd="auto" runs for ``q``: "gluon" on a Hopper GPU (sm_90) where Triton has
    Gluon and q is bf16/fp16 with D in {64, 128}, the fastest of ours there at every measured shape
    (results/*-bwd.json, 2026-11-25, H100: forward + backward 0.77-0.83x cuDNN against 0.67-0.75x
    for the Triton backwards); elsewhere (other GPUs, the CPU interpreter, D 16/32, fp32) "fused"
    when causal and "fa2" otherwise, the faster Triton backward of each."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128):
        from repro.fa4 import gluon_bwd

        if (
            gluon_bwd.HAS_GLUON
            and not gluon_bwd.KNOWN_BROKEN_ON_GPU
            and torch.cuda.get_device_capability(q.device) == (9, 0)
        ):
            return "gluon"
    return "fused" if causal else "fa2"


def _with_empty_rows(fn, q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """``fn(q)``, except that with causal and S_q > S_k the first S_q - S_k query rows see no key
    (bottom-right alignment): they get zeros (flash-attn's convention; their gradient is zero too)
    and ``fn`` runs on the last S_k rows, which are an ordinary causal square."""
    skip = q.shape[1] - k.shape[1]
    if not causal or skip <= 0:
        return fn(q)
    part = fn(q[:, skip:].contiguous())
    return torch.cat([part.new_zeros(q.shape[0], skip, *part.shape[2:]), part], dim=1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    **switches,
) -> torch.Tensor:
    """softmax(Q K^T * scale) V with FA4's forward ideas; differentiable.

    q: [B, S_q, H, D], k and v: [B, S_k, H_kv, D], H_kv dividing H, D in {64, 128}, bf16 or fp16,
    on CUDA. scale defaults to 1 / sqrt(D). ``switches`` are the fields of :class:`Switches`.
    Returns [B, S_q, H, D] in q's dtype.
    """
    return _run(q, k, v, causal, scale, switches, PUBLIC_HEAD_DIMS, PUBLIC_DTYPES)


def attention_any_d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    **switches,
) -> torch.Tensor:
    """Internal: :func:`attention` that also accepts D in {16, 32} and float32 (interpreter tests)."""
    return _run(q, k, v, causal, scale, switches, TEST_HEAD_DIMS, (*PUBLIC_DTYPES, torch.float32))


def forward_with_counts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    **switches,
) -> tuple[torch.Tensor, float]:
    """Forward only, also returning the fraction of key-block steps (after each tile's first) on which
    the kernel rescaled O. Shapes as :func:`attention_any_d`. Returns ([B, S_q, H, D], fraction)."""
    _check(q, k, v, causal, TEST_HEAD_DIMS, (*PUBLIC_DTYPES, torch.float32))
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sw = _resolve(Switches(**switches), d, interpreting())
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"forward_with_counts: causal needs S_q <= S_k here, got S_q = {q.shape[1]}, S_k = {k.shape[1]}"
        )
    o, _, counts = _forward(q, k, v, causal, scale, sw, count=True)
    c = counts.view(-1, 2).to(torch.int64)
    tiles = 2 if sw.pingpong else 1
    steps = (c[:, 0] - tiles).clamp(min=0).sum().item()
    resc = (c[:, 1] - tiles).clamp(min=0).sum().item()
    return o, (resc / steps if steps else 0.0)
