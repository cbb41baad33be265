"""The public entry points and the dispatch: which kernel runs, chosen by a frozen :class:`Switches`.

    from repro.fa4 import Switches, attention
    out = attention(q, k, v, causal=True)                                  # [B, S, H, D], bf16 / fp16
    out = attention(q, k, v, lazy_rescale=False, soft_exp=2)               # ablation switches
    out = attention(q, k, v, causal=True, config=Switches(gluon=True))     # a config built beforehand

q: [B, S_q, H, D]; k, v: [B, S_k, H_kv, D] with H_kv dividing H (grouped-query attention); D in
{64, 128}; causal masks are bottom-right aligned (query i sees keys j <= i + S_k - S_q; with
S_q > S_k the first S_q - S_k queries see no key and get zero output and zero gradient, as in
flash-attn). The switches are checked and resolved (:func:`resolve`: the launch shapes filled in,
``bwd="auto"`` made concrete by :func:`auto_backward`) once, before any kernel runs, and the resolved
config is saved for the backward, so that what ran forward decides what runs backward.

The kernels, one file per stage of the pipeline (zadouri2026flashattention4; FA3's Hopper schedule,
shah2024flashattention3, where the paper's Blackwell one has no Hopper form):

* ``triton_fwd``: the Triton forward with FA4's conditional rescaling and software exp2 as switches;
* ``gluon_fwd``: the warp-specialised Gluon forward (``gluon=True``; Hopper);
* ``gluon_bwd``: the warp-specialised Gluon backward (``bwd="gluon"``; Hopper; the default there);
* ``triton_bwd_fused``: FA3's one-pass backward in Triton (``bwd="fused"``; off Hopper when causal);
* ``triton_bwd``: FA2's two-kernel backward (``bwd="fa2"``; off Hopper otherwise; the cross-check);
* ``reference``: the paper's equations in PyTorch, the ground truth.

:func:`attention_forward` and :func:`attention_backward` are the forward with its log-sum-exp and the
backward from a given output and log-sum-exp, for callers that keep them themselves (ring attention,
``repro.usp``). :func:`attention_any_d` is the entry point of the CPU tests: it also takes D in
{16, 32} and float32 (for the Triton interpreter, where bf16 matmuls are slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from paperclub.triton_compat import interpreting
from repro.fa4.reference import RESCALE_THRESHOLD

__all__ = [
    "Switches",
    "attention",
    "attention_any_d",
    "attention_backward",
    "attention_forward",
    "auto_backward",
    "forward_with_counts",
]

PUBLIC_HEAD_DIMS = (64, 128)
TEST_HEAD_DIMS = (16, 32, 64, 128)
PUBLIC_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Switches:
    """Which FA4 ideas the forward kernel uses, which backward runs, and their launch shapes.

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
    block_m, block_n, num_warps, num_stages: launch shape; None picks the tuned default
        (``triton_fwd.FWD_DEFAULTS``).
    bwd: which backward runs. "fa2": FA2's two kernels (``repro.fa4.triton_bwd``: dK/dV per key block,
        then dQ per query block; S and dP computed twice, 7 matmuls per tile pair, no atomics). "fused":
        FA3's one-pass schedule (``repro.fa4.triton_bwd_fused``: one program per key block, dK/dV in
        registers, dQ by fp32 atomic adds, 5 matmuls; a preprocess kernel for delta = rowsum(dO * O)).
        "gluon": the same 5-matmul schedule warp-specialised in Gluon (``repro.fa4.gluon_bwd``: a TMA
        load warp, two consumer warpgroups of 64 keys each with asynchronous wgmma, dQ by TMA bulk
        reductions); Hopper (sm_90) only, refused in the CPU interpreter. "auto" (the default,
        :func:`auto_backward`): "gluon" on Hopper, else "fused" when causal and "fa2" otherwise.
        Measured on an H100 (results/*-bwd-gluon-dq.json, 2026-11-27, D = 128, bf16, S = 4k-16k,
        forward + backward behind the Gluon forward, 9 interleaved rounds): gluon 0.99-1.05x cuDNN's
        speed; (results/*-bwd.json, 2026-11-25) fused 0.67-0.75x; fa2 0.67-0.73x.
    bwd_block_m, bwd_block_n, bwd_num_warps, bwd_num_stages: the launch shape of the Triton
        backwards ("fa2", "fused"; the Gluon backward launches with gluon_bwd.GLUON_BWD_DEFAULTS);
        None picks triton_bwd.BWD_DEFAULTS ("fa2") or triton_bwd_fused.FUSED_DEFAULTS ("fused").
    bwd_tma: "fused" only: Q and dO tiles through TMA (tensor descriptors); None picks the default.
    bwd_dq_tma: "fused" and "gluon": dQ tiles added by TMA bulk reductions from shared memory (FA3's
        way) instead of one atomic add per element; not in the CPU interpreter. None picks the default
        ("gluon": gluon_bwd.DQ_TMA, on since its H100 run of 2026-11-27; False is the atomic-add
        cross-check).

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


#: The backwards behind Switches.bwd ("auto" picks one of them by device and causality: auto_backward).
BACKWARDS = ("auto", "fa2", "fused", "gluon")

#: Options that existed and were removed because they computed wrong results: refused by name, with
#: the reason, rather than as unknown (their measurements stay in results/ and the results log).
REMOVED_SWITCHES = {
    "bwd_dq_defer": (
        "the Gluon backward's deferred dQ product was removed: it gave wrong dQ on an H100 (relative "
        "error 1.27-1.41 against the FA2 backward at every shape of its D = 128 fp16 sweep, 2026-11-27); "
        "leave it out"
    ),
}

#: Launch knobs of the Gluon forward behind ``gluon=True``, from the interleaved sweep on an H100
#: (results/nvidia-h100-80gb-hbm3-gluon-combos.json, median of 5 rounds, forward vs cuDNN at
#: S = 4k / 8k / 16k): no turn barriers between the two consumers (the warp schedulers interleave
#: them well enough) and the output stored through shared memory by TMA: with lazy rescaling (the
#: Switches default) 0.98 / 1.01 / 1.04 non-causal and 1.02 / 1.06 / 1.13 causal, against the
#: launcher's defaults 0.96 / 0.99 / 1.00 and 0.99 / 1.05 / 1.12.
GLUON_LAUNCH = {"pingpong_sync": False, "store_tma": True}


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dims, dtypes) -> None:
    """Raise, naming the argument and what was expected, unless q, k, v are attention inputs with a
    head dim in ``dims`` and a dtype in ``dtypes``."""
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


def switches_from(fields_: dict, config: Switches | None = None) -> Switches:
    """A Switches from keyword fields (``attention(..., tma=True)``) or a ready ``config``, not both;
    removed options are refused with their reason, unknown ones with the list of known fields."""
    removed = sorted(set(fields_) & set(REMOVED_SWITCHES))
    if removed:
        raise ValueError(f"attention: {removed[0]}: {REMOVED_SWITCHES[removed[0]]}")
    known = [f.name for f in fields(Switches)]
    unknown = set(fields_) - set(known)
    if unknown:
        raise TypeError(f"attention: unknown switches {sorted(unknown)}; known: {known}")
    if config is not None:
        if not isinstance(config, Switches):
            raise TypeError(f"attention: config must be a Switches, got {type(config).__name__}")
        if fields_:
            raise TypeError(f"attention: give config= or switch keywords, not both (got {sorted(fields_)})")
        return config
    return Switches(**fields_)


def resolve(sw: Switches, d: int, interpret: bool) -> Switches:
    """``sw`` checked and with every launch choice made (None fields filled from the tuned defaults
    for head dim ``d``, or the interpreter's small tiles); refuses combinations that cannot run.
    ``bwd="auto"`` is left as it is here (:func:`auto_backward` needs the tensors)."""
    from repro.fa4.triton_bwd import BWD_DEFAULTS, BWD_INTERPRET
    from repro.fa4.triton_fwd import FWD_DEFAULTS, FWD_INTERPRET

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
    takes_by_name = {"bwd_tma": ("fused",), "bwd_dq_tma": ("fused", "gluon")}
    for name, takes in takes_by_name.items():
        if getattr(sw, name) and sw.bwd not in takes:
            allowed = " or ".join(repr(t) for t in takes)
            raise ValueError(f"attention: {name} applies to bwd={allowed} only, got bwd={sw.bwd!r}")
    if sw.bwd == "gluon" and interpret:
        raise ValueError(
            "attention: bwd='gluon' is a Gluon kernel for Hopper GPUs (sm_90a); Gluon kernels do not run in "
            "Triton's CPU interpreter (TRITON_INTERPRET=1): use bwd='fused' or 'fa2' there"
        )
    bm, bn, nw, ns = FWD_DEFAULTS.get(d, FWD_INTERPRET) if not interpret else FWD_INTERPRET
    if sw.bwd == "fused":
        from repro.fa4.triton_bwd_fused import FUSED_DEFAULTS, FUSED_INTERPRET

        bbm, bbn, bnw, bns, btma, bdq = (
            FUSED_DEFAULTS.get(d, FUSED_INTERPRET) if not interpret else FUSED_INTERPRET
        )
    else:
        bbm, bbn, bnw, bns = BWD_DEFAULTS.get(d, BWD_INTERPRET) if not interpret else BWD_INTERPRET
        btma = False
        bdq = False
        if sw.bwd == "gluon":
            from repro.fa4.gluon_bwd import DQ_TMA

            bdq = DQ_TMA
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


def auto_backward(q: torch.Tensor, causal: bool) -> str:
    """The backward bwd="auto" runs for ``q``: "gluon" on a Hopper GPU (sm_90) where Triton has
    Gluon and q is bf16/fp16 with D in {64, 128}, the fastest of ours there at every measured shape
    (results/*-bwd.json, 2026-11-25, and *-bwd-gluon-dq.json, 2026-11-27, H100); elsewhere (other
    GPUs, the CPU interpreter, D 16/32, fp32) "fused" when causal and "fa2" otherwise, the faster
    Triton backward of each."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128):
        from repro.fa4 import gluon_bwd

        if (
            gluon_bwd.HAS_GLUON
            and not gluon_bwd.KNOWN_BROKEN_ON_GPU
            and torch.cuda.get_device_capability(q.device) == (9, 0)
        ):
            return "gluon"
    return "fused" if causal else "fa2"


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


def run_forward(q, k, v, causal: bool, scale: float, sw: Switches, count: bool = False):
    """The forward kernel ``sw`` (resolved) names: (o [B, S_q, H, D], lse [B, H, S_q] fp32 base 2,
    rescale counts). No checks: the entry points have made them."""
    from repro.fa4.triton_fwd import triton_forward

    if sw.gluon:
        return _forward_gluon(q, k, v, causal, scale, sw, count)
    return triton_forward(q, k, v, causal, scale, sw, count)


def run_backward(do, q, k, v, o, lse, causal: bool, scale: float, sw: Switches):
    """dq, dk, dv by the backward ``sw`` (resolved) names, from o and the base-2 lse. q, k, v
    contiguous. A config whose bwd is still "auto" (resolved without the tensors) runs "fa2"."""
    if sw.bwd == "gluon":
        from repro.fa4.gluon_bwd import DQ_TMA, gluon_attention_backward

        dq_tma = DQ_TMA if sw.bwd_dq_tma is None else sw.bwd_dq_tma
        return gluon_attention_backward(do, q, k, v, o, lse, causal, scale, dq_tma=dq_tma)
    if sw.bwd == "fused":
        from repro.fa4.triton_bwd_fused import backward_fused

        return backward_fused(
            do, q, k, v, o, lse, causal, scale,
            sw.bwd_block_m, sw.bwd_block_n, sw.bwd_num_warps, sw.bwd_num_stages, sw.bwd_tma, sw.bwd_dq_tma,
        )  # fmt: skip
    from repro.fa4.triton_bwd import triton_backward

    return triton_backward(do, q, k, v, o, lse, causal, scale, sw)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, sw):
        o, lse, _ = run_forward(q, k, v, causal, scale, sw)
        ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), o, lse)
        ctx.causal, ctx.scale, ctx.sw = causal, scale, sw  # the resolved config decides the backward
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.sw)
        return dq, dk, dv, None, None, None


def _scale(d: int, scale: float | None) -> float:
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"attention: scale must be a positive finite number, got {scale}")
    return scale


def _prepare(q, k, v, causal, scale, sw: Switches, dims, dtypes) -> tuple[float, Switches]:
    """Check the inputs, the device and the switches; the scale and the resolved, concrete config."""
    check_inputs(q, k, v, causal, dims, dtypes)
    d = q.shape[-1]
    scale = _scale(d, scale)
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError("attention: needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter")
    if sw.bwd == "auto":
        sw = replace(sw, bwd=auto_backward(q, causal))
    sw = resolve(sw, d, interpreting())
    if sw.bwd == "gluon":  # refuse before the forward runs, not at the first backward
        from repro.fa4.gluon_bwd import check_device

        check_device(q)
    return scale, sw


def _run(q, k, v, causal, scale, sw: Switches, dims, dtypes):
    scale, sw = _prepare(q, k, v, causal, scale, sw, dims, dtypes)
    return _with_empty_rows(lambda qs: _Attention.apply(qs, k, v, bool(causal), scale, sw), q, k, causal)


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
    config: Switches | None = None,
    **switches,
) -> torch.Tensor:
    """softmax(Q K^T * scale) V with FA4's forward ideas; differentiable.

    q: [B, S_q, H, D], k and v: [B, S_k, H_kv, D], H_kv dividing H, D in {64, 128}, bf16 or fp16,
    on CUDA. scale defaults to 1 / sqrt(D). The kernels: ``config`` (a :class:`Switches`) or its
    fields as keywords. Returns [B, S_q, H, D] in q's dtype.
    """
    return _run(q, k, v, causal, scale, switches_from(switches, config), PUBLIC_HEAD_DIMS, PUBLIC_DTYPES)


def attention_any_d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    config: Switches | None = None,
    **switches,
) -> torch.Tensor:
    """Internal: :func:`attention` that also accepts D in {16, 32} and float32 (interpreter tests)."""
    sw = switches_from(switches, config)
    return _run(q, k, v, causal, scale, sw, TEST_HEAD_DIMS, (*PUBLIC_DTYPES, torch.float32))


LN2 = math.log(2.0)


def _forward_backward_dtypes() -> tuple[torch.dtype, ...]:
    # fp32 only where the kernels run in the interpreter (the GPU's fp32 dots are tf32)
    return PUBLIC_DTYPES + ((torch.float32,) if interpreting() else ())


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    config: Switches | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward and its log-sum-exp, without autograd: for callers that keep both and run
    :func:`attention_backward` themselves (a ring of blocks merging partial results).

    q: [B, S_q, H, D], k, v: [B, S_k, H_kv, D], D in {16, 32, 64, 128}, bf16 or fp16 (and float32 in
    the CPU interpreter); causal needs S_q <= S_k here. Returns (o [B, S_q, H, D] in q's dtype,
    lse [B, H, S_q] float32, natural log: log sum_j exp(scale q_i . k_j)). ``config`` (default
    Switches()) chooses the forward kernel; its backward fields are for :func:`attention_backward`."""
    sw = config if config is not None else Switches()
    scale, sw = _prepare(q, k, v, causal, scale, sw, TEST_HEAD_DIMS, _forward_backward_dtypes())
    _no_empty_rows(q, k, causal, "attention_forward")
    o, lse2, _ = run_forward(q, k, v, bool(causal), scale, sw)
    return o, lse2 * LN2  # the kernels keep log2 of the sum of 2^(s log2 e)


def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    config: Switches | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attention from its output ``o`` and natural-log ``lse`` (as
    :func:`attention_forward` returns them), by the backward ``config`` names (default Switches():
    bwd="auto"). Shapes as :func:`attention_forward`; do and o [B, S_q, H, D] (cast to q's dtype),
    lse [B, H, S_q]. Returns gradients in the inputs' dtypes and shapes."""
    sw = config if config is not None else Switches()
    scale, sw = _prepare(q, k, v, causal, scale, sw, TEST_HEAD_DIMS, _forward_backward_dtypes())
    _no_empty_rows(q, k, causal, "attention_backward")
    b, s_q, h, _ = q.shape
    for name, t, shape in (("do", do, q.shape), ("o", o, q.shape), ("lse", lse, (b, h, s_q))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"attention_backward: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}"
            )
    lse2 = (lse.float() / LN2).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do, o = do.to(q.dtype).contiguous(), o.to(q.dtype).contiguous()
    return run_backward(do, q, k, v, o, lse2, bool(causal), scale, sw)


def _no_empty_rows(q, k, causal, who: str) -> None:
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"{who}: causal needs S_q <= S_k here (rows that see no key have no log-sum-exp), "
            f"got S_q = {q.shape[1]}, S_k = {k.shape[1]}"
        )


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
    check_inputs(q, k, v, causal, TEST_HEAD_DIMS, (*PUBLIC_DTYPES, torch.float32))
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sw = resolve(switches_from(switches), d, interpreting())
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"forward_with_counts: causal needs S_q <= S_k here, got S_q = {q.shape[1]}, S_k = {k.shape[1]}"
        )
    o, _, counts = run_forward(q, k, v, causal, scale, sw, count=True)
    c = counts.view(-1, 2).to(torch.int64)
    tiles = 2 if sw.pingpong else 1
    steps = (c[:, 0] - tiles).clamp(min=0).sum().item()
    resc = (c[:, 1] - tiles).clamp(min=0).sum().item()
    return o, (resc / steps if steps else 0.0)
