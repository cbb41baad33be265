"""Launchers and autograd for the NSA Triton kernels (``kernels.py``), with the input checks.

Shapes follow flash-linear-attention: q [B, T, HQ, D]; k, v [B, T, H, D] with H dividing HQ.
Kernels take D in {16, 32, 64, 128}, fp16 / bf16 / fp32, on CUDA or under the Triton CPU interpreter.
"""

from __future__ import annotations

import math

import torch
import triton

from paperclub.triton_compat import interpreting, patch_interpreter
from repro.nsa import kernels as kn
from repro.nsa import reference as ref

HEAD_DIMS = (16, 32, 64, 128)
BLOCK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUP = 64
# dK/dV of the selected branch: (block, query) pairs per program. 256 keeps the always-selected
# first block (read by every query) spread over T S / 256 programs instead of serialised on one.
SLC_CHUNK = 256


def _interp() -> bool:
    patch_interpreter()
    return interpreting()


def _launch(d: int, backward: bool = False, itemsize: int = 2, window: bool = False) -> dict:
    """Tile sizes of the strided kernels: 16 under the interpreter (small tests). On a GPU the forward
    takes FlashAttention-2's Hopper shape, 128 queries x 64 keys with 8 warps and 3 stages (two K/V
    tiles of 64 x 128 bf16 per stage fit shared memory), the backward 64 x 64 with 8 warps: with 4,
    ptxas (sm_90a, offline) spills 0.4-1 KB per thread at D = 128 (two fp32 64 x 128 accumulators
    beside K and V); with 8 it spills at most 124 bytes.

    The sliding window's forward takes 64 x 64 tiles with 4 warps and 3 stages: a 128-query tile reads
    639 keys for 512 a query (the tile's rows are 127 positions apart), a 64-query tile 575. Measured
    on an H100 at T = 64k, w = 512, bf16 (2026-11-27, 5 interleaved rounds): 3.83 ms against 4.79 ms
    with the 128 x 64 shape; the compressed branch keeps 128 x 64 (10.1 ms split against 11.1 ms at
    64 x 64; 128 x 128 and 64 x 128 were slower for both)."""
    if _interp():
        return {"BM": 16, "BN": 16, "num_warps": 4, "num_stages": 1}
    if backward or itemsize > 2:  # fp32 tiles are twice the bytes: the smaller shape fits at D = 128
        return {"BM": 64, "BN": 64, "num_warps": 8 if d >= 64 else 4, "num_stages": 2}
    if window:
        return {"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 3}
    return {"BM": 128 if d >= 64 else 64, "BN": 64, "num_warps": 8 if d >= 64 else 4, "num_stages": 3}


def _check_tensor(fn: str, name: str, x, ndim: int, shape_hint: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {shape_hint} ({ndim} dims), got shape {tuple(x.shape)}")


def check_qkv(fn: str, q, k, v, k_len: int | None = None) -> tuple[int, int, int, int, int]:
    """Shared checks of q [B, T, HQ, D], k, v [B, Tk, H, D]. Returns (B, T, HQ, H, D)."""
    _check_tensor(fn, "q", q, 4, "[B, T, HQ, D]")
    _check_tensor(fn, "k", k, 4, "[B, T, H, D]")
    _check_tensor(fn, "v", v, 4, "[B, T, H, D]")
    b, t, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"{fn}: k must be [B={b}, T, H, D={d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if k_len is not None and k.shape[1] != k_len:
        raise ValueError(f"{fn}: k must have T = {k_len} positions like q, got {k.shape[1]}")
    h = k.shape[2]
    if h == 0 or hq % h:
        raise ValueError(f"{fn}: KV heads H = {h} must divide query heads HQ = {hq}")
    if hq // h > MAX_GROUP:
        raise ValueError(f"{fn}: group size HQ / H = {hq // h} is larger than the kernels' {MAX_GROUP}")
    if d not in HEAD_DIMS:
        raise ValueError(f"{fn}: head dim D = {d} is not supported, expected one of {HEAD_DIMS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {x.dtype}, expected one of {[str(x) for x in DTYPES]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type != "cuda" and not _interp():
        raise RuntimeError(f"{fn}: needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter")
    if b == 0 or t == 0:
        raise ValueError(f"{fn}: empty input, q {tuple(q.shape)}")
    if max(t * hq * d, k.shape[1] * h * d) >= 2**31:
        # the kernels add 32-bit tile offsets to a 64-bit base per (batch, head): one batch element's
        # tensor must stay below 2^31 elements
        raise ValueError(f"{fn}: T * HQ * D = {t * hq * d} is too large for the kernels (at most 2^31 - 1)")
    return b, t, hq, h, d


def _scale(scale: float | None, d: int) -> float:
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def _ieee(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32


def _check_block_size(fn: str, name: str, value: int) -> None:
    if value not in BLOCK_SIZES:
        raise ValueError(f"{fn}: {name} = {value} is not supported, expected one of {BLOCK_SIZES}")


def _check_gates(fn: str, gates: torch.Tensor, shape: tuple, hint: str) -> None:
    """Eq. 5's gates, one per branch and query head: ``shape`` = (B, Tq, HQ, 3), named ``hint``."""
    if gates.shape != shape:
        raise ValueError(f"{fn}: gates must be {hint} = {shape}, got {tuple(gates.shape)}")


# ----------------------------------------------------------------------------------------------
# Strided causal attention: the compressed branch and the sliding window


# The compressed branch's forward walks its key tiles in three loops: the masked tiles at the window's
# lower edge (none without a window), the interior every query of the tile sees (no mask, no bounds
# check), the masked tiles at the diagonal. False: one masked loop over every tile (the kernel before
# 2026-11-27). On an H100 at T = 64k (bf16, 2026-11-27, 5 interleaved rounds) the compressed branch
# took 10.1 ms split against 12.5 ms in one loop, the whole forward 43.3 against 46.6 ms.
# The sliding window keeps one loop: split, it took the same time (3.88 against 3.83 ms at its 64 x 64
# tile, within the rounds' range) and spills more (784 against 284 bytes, sm90_check). fp32 inputs on
# a GPU keep one loop too: their tile already spills at D = 128 and the three loops double that. Under
# the interpreter the compressed branch splits in every dtype, so the CPU tests cover the GPU's path.
STRIDED_SPLIT = True
# Tile override of the strided forward on a GPU ({"BM", "BN", "num_warps", "num_stages"}), for sweeps;
# None takes _launch's shape.
STRIDED_FWD_TILE: dict | None = None


def _strided_fwd(q, k, v, scale, stride, offset, window, split=None):
    """The strided forward; ``split`` None takes the rule above, True/False forces it (tests, sweeps)."""
    b, t, hq, d = q.shape
    nk, h = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(b, t, hq, device=q.device, dtype=torch.float32)
    cfg = _launch(d, itemsize=q.element_size(), window=window > 0)
    if STRIDED_FWD_TILE is not None and not _interp():
        cfg = dict(STRIDED_FWD_TILE)
    if split is None:
        split = STRIDED_SPLIT and window == 0 and (q.element_size() == 2 or _interp())
    kn._strided_fwd_kernel[(triton.cdiv(t, cfg["BM"]), b * hq)](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, nk, hq, hq // h, scale * kn.LOG2E,
        STRIDE=stride, OFFSET=offset, WINDOW=window, D=d, IEEE=_ieee(q), SPLIT=bool(split), **cfg,
    )  # fmt: skip
    return o, lse


def _strided_bwd(do, q, k, v, o, lse, scale, stride, offset, window):
    b, t, hq, d = q.shape
    nk, h = k.shape[1], k.shape[2]
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()  # [B, T, HQ]: rowsum(dO * O) = rowsum(P * dP)
    dq = torch.empty_like(q)
    dk = torch.zeros(b, nk, h, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    cfg = _launch(d, backward=True, itemsize=q.element_size())
    common = dict(STRIDE=stride, OFFSET=offset, WINDOW=window, D=d, IEEE=_ieee(q), **cfg)
    kn._strided_bwd_dq_kernel[(triton.cdiv(t, cfg["BM"]), b * hq)](
        q, k, v, do, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, nk, hq, hq // h, scale * kn.LOG2E, scale, **common,
    )  # fmt: skip
    if nk > 0:
        kn._strided_bwd_dkdv_kernel[(triton.cdiv(nk, cfg["BN"]), b * hq)](
            q, k, v, do, lse, delta, dk, dv,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            t, nk, hq, hq // h, scale * kn.LOG2E, scale, **common,
        )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _StridedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, stride, offset, window):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _strided_fwd(q, k, v, scale, stride, offset, window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, stride, offset, window)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _strided_bwd(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    block_len: int = 32,
    stride: int = 16,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed branch (§3.3.1) with Triton kernels, forward and backward.

    q [B, T, HQ, D]; k_cmp, v_cmp [B, Nc, H, D] (compressed token i covers positions i d .. i d + l - 1
    and is visible from position i d + l - 1 on). Returns (o [B, T, HQ, D], lse [B, T, HQ] float32,
    natural log, -inf where no compressed token is visible yet; lse carries no gradient).
    """
    b, t, hq, h, d = check_qkv("compressed_attention", q, k_cmp, v_cmp)
    if block_len < 1 or stride < 1:
        raise ValueError(
            f"compressed_attention: block_len and stride must be >= 1, got {block_len}, {stride}"
        )
    return _StridedAttention.apply(q, k_cmp, v_cmp, _scale(scale, d), stride, block_len - 1, 0)


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 512, scale: float | None = None
) -> torch.Tensor:
    """Sliding-window branch (§3.3.3): query t attends keys t - w < s <= t. Shapes as the reference."""
    b, t, hq, h, d = check_qkv("sliding_window_attention", q, k, v, k_len=q.shape[1])
    if window < 1:
        raise ValueError(f"sliding_window_attention: window must be >= 1, got {window}")
    return _StridedAttention.apply(q, k, v, _scale(scale, d), 1, 0, int(window))[0]


# ----------------------------------------------------------------------------------------------
# Selection: block scores (Eqs. 8-10) and the selected branch


# the score kernel's tile under the CPU interpreter (tests set BJ = 32, the GPU configs' other tile)
SCORES_INTERP_TILE = {"BM": 16, "BJ": 16}


def selection_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    num_blocks: int,
    block_len: int = 32,
    stride: int = 16,
    select_len: int = 64,
    scale: float | None = None,
    mask: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Block importance p_slc' (Eqs. 8-10) with a Triton kernel. Returns [B, T, H, Ns] float32.

    q [B, T, HQ, D]; k_cmp [B, Nc, H, D]; lse_cmp [B, T, HQ] from :func:`compressed_attention`. Needs
    l'/d a power of two and l/d <= 17 (the kernel's tiles: at least 16 selection blocks of l'/d
    compression blocks each; a block's last l/d - 1 pieces overlap the next tile). On a GPU the small matmuls run in tf32 for 16-bit inputs:
    scores within about 1e-3 relative, enough to rank blocks.

    ``mask = (n_initial, n_local)``: the kernel also applies Eq. 11's masks (see
    :func:`masked_selection_scores`); without it, entries of blocks after a query's own are not written.
    """
    b, t, hq, h, d = check_qkv("selection_scores", q, k_cmp, k_cmp)
    r, c = select_len // stride, block_len // stride
    if select_len % stride or block_len % stride:
        raise ValueError(
            f"selection_scores: stride d = {stride} must divide block_len {block_len} and select_len {select_len}"
        )
    if r & (r - 1) or c - 1 > 16:
        raise ValueError(
            f"selection_scores: needs select_len / stride a power of two and block_len / stride <= 17, got "
            f"{r} and {c}"
        )
    if t * h * num_blocks >= 2**31:
        raise ValueError(
            f"selection_scores: T * H * num_blocks = {t * h * num_blocks} is too large (at most 2^31 - 1)"
        )
    if lse_cmp.shape != (b, t, hq):
        raise ValueError(
            f"selection_scores: lse_cmp must be [B, T, HQ] = {(b, t, hq)}, got {tuple(lse_cmp.shape)}"
        )
    q, k_cmp, lse_cmp = q.contiguous(), k_cmp.contiguous(), lse_cmp.float().contiguous()
    scores = torch.empty(b, t, h, num_blocks, device=q.device, dtype=torch.float32)
    n_initial, n_local = mask if mask is not None else (0, 0)
    args = (
        q, k_cmp, lse_cmp, scores,
        q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        t, k_cmp.shape[1], num_blocks, h, hq // h, _scale(scale, d) * kn.LOG2E, triton.next_power_of_2(t),
    )  # fmt: skip
    consts = dict(
        STRIDE=stride, BLOCK_LEN=block_len, SELECT_LEN=select_len, D=d, IEEE=_ieee(q),
        MASKED=mask is not None, N_INITIAL=n_initial, N_LOCAL=n_local,
    )  # fmt: skip
    if _interp():  # one small shape; the GPU times kn.SCORES_CONFIGS at the first call
        tile = SCORES_INTERP_TILE
        kn._scores_kernel[(triton.cdiv(t, tile["BM"]), b * h)](*args, **consts, **tile, num_warps=4)
    else:
        grid = lambda meta: (triton.cdiv(t, meta["BM"]), b * h)  # noqa: E731
        kn._scores_tuned[grid](*args, **consts)
    return scores


def masked_selection_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    config: ref.NSAConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`selection_scores` with Eq. 11's masks applied in the same kernel, as the decode step does:
    the forced blocks (the ``n_initial`` first and the ``n_local`` ending at the query) are +inf, the
    blocks after the query's own -inf, every entry written. The other entries are bit for bit those
    of :func:`selection_scores`, so ``reference.select_blocks`` on the unmasked scores and
    :func:`topk_blocks` on these pick the same blocks. q [B, T, HQ, D]; k_cmp [B, Nc, H, D];
    lse_cmp [B, T, HQ]. Returns [B, T, H, Ns] float32, Ns = ceil(T / l')."""
    ns = triton.cdiv(q.shape[1], config.select_len)
    mask = (config.n_initial, config.n_local)
    return selection_scores(
        q, k_cmp, lse_cmp, ns, config.block_len, config.stride, config.select_len, scale, mask=mask
    )


#: Eq. 11's top-n and sort as one Triton kernel (:func:`topk_blocks_fused`) in :func:`topk_blocks`
#: where Ns <= FUSED_TOPK_MAX_NS and n <= FUSED_TOPK_MAX_N (else torch.topk and the sort kernel).
#: On since the H100 run of 2026-11-25 (13:35 UTC): test_gpu_fused_topk_is_a_top_n passed, and the
#: breakdown at T = 64k timed it at 2.74 ms against 7.70 ms for torch.topk + the sort kernel.
FUSED_TOPK = True
FUSED_TOPK_MAX_NS = 4096  # one program holds its rows' Ns scores in registers: BR * Ns <= 8192
FUSED_TOPK_MAX_N = 64  # the sort holds BR x n x n ranks


def _check_topk(fn: str, masked_scores, n_select: int) -> None:
    _check_tensor(fn, "masked_scores", masked_scores, 4, "[B, T, H, Ns]")
    if n_select < 1:
        raise ValueError(f"{fn}: n_select must be >= 1, got {n_select}")
    if masked_scores.device.type != "cuda" and not _interp():
        raise RuntimeError(f"{fn}: needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter")


def topk_blocks_fused(masked_scores: torch.Tensor, n_select: int) -> torch.Tensor:
    """:func:`topk_blocks` as one Triton kernel (``kn._topn_rows_kernel``): each program reads BR rows
    of the scores once and picks n times the row's largest (leftmost on ties), then sorts the picks
    ascending with -1 for none (a pick of -inf), padded to n. The same contract as :func:`topk_blocks`:
    with no ties the same tensor; with ties a top-n too, maybe another one. Scores must be NaN-free
    (the masked scores kernel writes none). Ns <= FUSED_TOPK_MAX_NS, n <= FUSED_TOPK_MAX_N."""
    _check_topk("topk_blocks_fused", masked_scores, n_select)
    b, t, h, ns = masked_scores.shape
    if ns > FUSED_TOPK_MAX_NS or n_select > FUSED_TOPK_MAX_N:
        raise ValueError(
            f"topk_blocks_fused: needs Ns <= {FUSED_TOPK_MAX_NS} and n <= {FUSED_TOPK_MAX_N}, got Ns = {ns}, "
            f"n = {n_select}"
        )
    scores = masked_scores.float().contiguous()
    bi = torch.empty(b, t, h, n_select, device=masked_scores.device, dtype=torch.int32)
    rows = b * t * h
    if rows == 0:
        return bi
    ns_pow2 = triton.next_power_of_2(max(ns, 1))
    bsel = triton.next_power_of_2(n_select)
    br = max(1, min(64, 8192 // ns_pow2, 8192 // (bsel * bsel)))
    kn._topn_rows_kernel[(triton.cdiv(rows, br),)](
        scores, bi, rows, ns, min(n_select, ns), n_select,
        BR=br, NS_POW2=ns_pow2, BSEL=bsel, num_warps=4,
    )  # fmt: skip
    return bi


def topk_blocks(masked_scores: torch.Tensor, n_select: int) -> torch.Tensor:
    """Eq. 11's top-n on scores from :func:`masked_selection_scores`: one ``torch.topk`` and one small
    Triton kernel that drops the picks of -inf (future blocks), sorts the rest ascending and pads with
    -1, as ``reference.select_blocks`` returns them (or :func:`topk_blocks_fused` where ``FUSED_TOPK``
    and the shape allow). masked_scores [B, T, H, Ns] float32. Returns [B, T, H, n] int32."""
    _check_topk("topk_blocks", masked_scores, n_select)
    b, t, h, ns = masked_scores.shape
    if FUSED_TOPK and 0 < ns <= FUSED_TOPK_MAX_NS and n_select <= FUSED_TOPK_MAX_N:
        return topk_blocks_fused(masked_scores, n_select)
    top_val, top_idx = masked_scores.topk(min(n_select, ns), dim=-1)
    bi = torch.empty(b, t, h, n_select, device=masked_scores.device, dtype=torch.int32)
    rows = b * t * h
    br = 32
    kn._sort_picks_kernel[(triton.cdiv(rows, br),)](
        top_val, top_idx, bi, rows, top_idx.shape[-1], n_select, ns,
        BR=br, BSEL=triton.next_power_of_2(n_select), num_warps=4,
    )  # fmt: skip
    return bi


def check_block_indices(
    block_indices: torch.Tensor, b: int, t: int, h: int, block_size: int, tk: int
) -> None:
    """Indices must be [B, T, H, S] integers, each -1 (none) or a block that starts at or before the
    query, not repeated within a row."""
    fn = "selected_attention"
    _check_tensor(fn, "block_indices", block_indices, 4, "[B, T, H, S]")
    if block_indices.shape[:3] != (b, t, h):
        raise ValueError(
            f"{fn}: block_indices must be [B, T, H, S] = [{b}, {t}, {h}, S], got {tuple(block_indices.shape)}"
        )
    if block_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: block_indices must be int32 or int64, got {block_indices.dtype}")
    bi = block_indices.long()
    nb = -(-tk // block_size)
    if (bi >= nb).any():
        raise ValueError(
            f"{fn}: block_indices out of range: the largest is {bi.max().item()}, blocks are 0..{nb - 1}"
        )
    pos = torch.arange(t, device=bi.device)[None, :, None, None]
    future = (bi >= 0) & (bi * block_size > pos)
    if future.any():
        where = future.nonzero()[0].tolist()
        raise ValueError(
            f"{fn}: block_indices selects a future block: query t = {where[1]} (batch {where[0]}, head "
            f"{where[2]}) picks block {bi[tuple(where)].item()}, which starts at {bi[tuple(where)].item() * block_size} > t"
        )
    srt = bi.sort(-1).values
    if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
        raise ValueError(f"{fn}: block_indices repeats a block within one query's row")


def _slc_fwd(q, k, v, bi, block_size, scale):
    b, t, hq, d = q.shape
    h = k.shape[2]
    g = hq // h
    o = torch.empty_like(q)
    lse = torch.empty(b, t, hq, device=q.device, dtype=torch.float32)
    kn._slc_fwd_kernel[(t, b * h)](
        q, k, v, bi, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, h, g, bi.shape[-1], scale * kn.LOG2E,
        D=d, BS=block_size, BG=max(16, triton.next_power_of_2(g)), IEEE=_ieee(q),
        num_warps=4, num_stages=2 if not _interp() else 1,
    )  # fmt: skip
    return o, lse


def _slc_bwd(do, q, k, v, o, lse, bi, block_size, scale):
    b, t, hq, d = q.shape
    h = k.shape[2]
    g = hq // h
    s = bi.shape[-1]
    bg = max(16, triton.next_power_of_2(g))
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    nw = 4  # a [G, l'] = [16, 64] tile per step: more warps would idle
    ns = 2 if not _interp() else 1
    kn._slc_bwd_dq_kernel[(t, b * h)](
        q, k, v, do, o, lse, delta, bi, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, h, g, s, scale * kn.LOG2E, scale,
        D=d, BS=block_size, BG=bg, IEEE=_ieee(q), num_warps=nw, num_stages=ns,
    )  # fmt: skip
    # The (block, query) pairs sorted by block: the CSR list of which queries read each block.
    nb = triton.cdiv(t, block_size)
    invalid = b * h * nb * t
    bil = bi.long()
    bh = (
        torch.arange(b, device=q.device)[:, None, None, None] * h
        + torch.arange(h, device=q.device)[None, None, :, None]
    )
    pos = torch.arange(t, device=q.device)[None, :, None, None]
    keys = torch.where(bil >= 0, ((bh * nb + bil) * t + pos), invalid).flatten().sort().values
    dk = torch.zeros(b, t, h, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    n = keys.numel()
    chunk = SLC_CHUNK if not _interp() else 64
    kn._slc_bwd_dkdv_kernel[(triton.cdiv(n, chunk),)](
        q, k, v, do, lse, delta, keys, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        t, h, g, nb, n, invalid, scale * kn.LOG2E, scale,
        D=d, BS=block_size, BG=bg, CHUNK=chunk, IEEE=_ieee(q), num_stages=1,
        num_warps=8 if d >= 64 else 4,  # two fp32 [l', D] accumulators: 4 warps spill 3.9 KB at D = 128
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


#: The selected branch's backward as :func:`_slc_bwd_tiled` (block-major dK/dV over the inverted
#: selection, BQ queries x G heads per matmul; delta fused into the dQ kernel) instead of
#: :func:`_slc_bwd` (dK/dV one (block, query) pair at a time, atomics at every block change, kept as
#: the cross-check). On since 2026-11-27: its GPU tests passed (bf16, fp16, fp32; compute-sanitizer
#: clean) and ``python -m repro.nsa.bench --slc-bwd 8192,65536`` timed it on an H100 at 2.3x the
#: query-major backward's speed and 2.0x fla's for the branch's forward + backward.
TILED_SLC_BWD = True
#: queries per work item of the tiled dK/dV kernel on the GPU: a block read by more queries (the
#: first block, by all T of them) is split over several programs whose partial sums meet in fp32
#: atomics; 1024 = n l' (16 x 64), the average number of queries per block at the paper's setting
SLC_TILED_CHUNK = 1024
#: rows of the tiled dK/dV kernel's query tile on the GPU, BQ x next_pow2(G): the inner dimension of
#: its dV and dK matmuls (64 = one [64, 128] bf16 tile of q and of dO beside K, V and two fp32
#: [l', D] accumulators; see sm90_check for registers)
SLC_TILED_ROWS = 64
#: software-pipelining stages of its query loop (2: the next tile's gathers in flight; 1 spills less)
SLC_TILED_STAGES = 2


def invert_block_indices(
    bi: torch.Tensor, num_blocks: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The selection turned around, on the device with no host synchronisation: for each segment
    (b, h, block), segment = (b H + h) num_blocks + block, the positions t of the queries whose row of
    ``bi`` [B, T, H, S] (int, -1 = none) holds that block. Returns ``(qidx, offsets, item_seg,
    first_item, grid)``: qidx int32 lists the queries segment after segment, ascending within one
    (one sort of B T H S keys); offsets [NSEG + 1], where each segment's list starts (offsets[NSEG]:
    the number of valid pairs); the work items of the tiled dK/dV kernel, ``chunk`` queries at most,
    as item_seg [grid] int32 (the item's segment, NSEG past the last real item) and first_item [NSEG]
    (a segment's first item); offsets and first_item are int32 unless B T H S needs 64 bits.
    ``grid`` = NSEG + B T H S // chunk bounds the number of items (a segment of c queries has
    ceil(c / chunk) <= c / chunk + 1 of them) without reading c back."""
    fn = "invert_block_indices"
    _check_tensor(fn, "bi", bi, 4, "[B, T, H, S]")
    if bi.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: bi must be int32 or int64, got {bi.dtype}")
    if chunk < 1 or num_blocks < 1:
        raise ValueError(
            f"{fn}: chunk and num_blocks must be >= 1, got chunk = {chunk}, num_blocks = {num_blocks}"
        )
    b, t, h, s = bi.shape
    nseg = b * h * num_blocks
    dev = bi.device
    wide = nseg * t >= 2**31 - 1  # int32 keys sort faster; 64-bit only when the keys need it
    kdt = torch.int64 if wide else torch.int32
    seg = (torch.arange(b, device=dev, dtype=kdt)[:, None, None, None] * h
           + torch.arange(h, device=dev, dtype=kdt)[None, None, :, None]) * num_blocks + bi.to(kdt)  # fmt: skip
    pos = torch.arange(t, device=dev, dtype=kdt)[None, :, None, None]
    keys = torch.where(bi >= 0, seg * t + pos, nseg * t).flatten().sort().values
    bounds = torch.arange(nseg + 1, device=dev, dtype=kdt) * t
    small = b * t * h * s < 2**31 - 1  # 32-bit offsets (fewer registers in the kernel's loop) when they fit
    offsets = torch.searchsorted(keys, bounds, out_int32=small)  # offsets[NSEG] = number of valid pairs
    qidx = (keys % t).to(torch.int32)
    items = (offsets.diff() + (chunk - 1)) // chunk
    last = items.cumsum(0).to(offsets.dtype)
    grid = nseg + b * t * h * s // chunk
    item_seg = torch.searchsorted(
        last, torch.arange(grid, device=dev, dtype=last.dtype), right=True, out_int32=True
    )
    return qidx, offsets, item_seg, last - items, grid


def _slc_bwd_tiled(do, q, k, v, o, lse, bi, block_size, scale, chunk=None, rows=None):
    """The selected branch's backward, block-major (``TILED_SLC_BWD``).

    Why this split. dQ stays query-major (``kn._slc_bwd_dq_kernel``, one program per (t, KV head)):
    its accumulator is the query's own [G, D] rows, its matmuls have inner dimensions D and l', and
    a query's blocks are its own (neighbouring queries select different ones), so taking several
    queries per program would only add masked blocks; moving dQ into the block-major pass would add
    a [G, D] atomic per (query, block) pair (8.6e9 fp32 atomics at 64k). What dQ's kernel does
    differently here: it also computes delta = rowsum(dO * O) from the rows it loads
    (``FUSE_DELTA``), where :func:`_slc_bwd` builds it with PyTorch from three [B, T, HQ, D] fp32
    temporaries (2 GB each at 64k). dK, dV go block-major (``kn._slc_bwd_dkdv_tiled_kernel``): the
    selection inverted once (:func:`invert_block_indices`, a sort of B T H S int keys and two
    searchsorted), then per KV block its queries BQ at a time, so the two accumulating matmuls have an
    inner dimension of BQ x G = ``SLC_TILED_ROWS`` rather than G, and K, V are loaded once per work
    item rather than at each change of block in a chunk of pairs.

    Costs: memory for a few [B, T, H, S] int temporaries (the keys, their sort, qidx: 17 MB each at
    64k, H = 4, S = 16, int32 keys), offsets and the item map (NSEG + grid ints, under 0.1 MB);
    launches: the sort, two searchsorted and a few elementwise ops (all on the stream, no host
    synchronisation), dQ, dK/dV, and the fp32 -> input dtype casts of dK, dV. Atomics only where a
    block is read by more than ``chunk`` queries, one [l', D] add per work item, so the summation
    order (and the last bits of dK, dV) of those blocks may change between runs; the rest is
    deterministic.
    """
    b, t, hq, d = q.shape
    h = k.shape[2]
    g = hq // h
    bg = max(16, triton.next_power_of_2(g))
    interp = _interp()
    ns = 2 if not interp else 1
    do = do.contiguous()
    delta = torch.empty(b, t, hq, device=q.device, dtype=torch.float32)  # written by the dQ kernel
    dq = torch.empty_like(q)
    kn._slc_bwd_dq_kernel[(t, b * h)](
        q, k, v, do, o, lse, delta, bi, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        t, h, g, bi.shape[-1], scale * kn.LOG2E, scale,
        D=d, BS=block_size, BG=bg, IEEE=_ieee(q), FUSE_DELTA=True, num_warps=4, num_stages=ns,
    )  # fmt: skip
    nb = triton.cdiv(t, block_size)
    chunk = chunk or (SLC_TILED_CHUNK if not interp else 16)
    # fp32 (twice the bytes per tile): 16 rows, one stage; 64 rows spill 29 KB per thread (sm90_check)
    wide = q.element_size() > 2
    rows = rows or (SLC_TILED_ROWS if not (interp or wide) else 16)
    bgp = triton.next_power_of_2(g)
    bq = max(1, rows // bgp)
    qidx, offsets, item_seg, first_item, grid = invert_block_indices(bi, nb, chunk)
    dk = torch.zeros(b, t, h, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    kn._slc_bwd_dkdv_tiled_kernel[(grid,)](
        q, k, v, do, lse, delta, qidx, offsets, item_seg, first_item, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        t, h, g, nb, b * h * nb, scale * kn.LOG2E, scale,
        D=d, BS=block_size, BGP=bgp, BQ=bq, CHUNK=chunk, IEEE=_ieee(q),
        num_warps=8 if d >= 64 and not interp else 4,
        num_stages=SLC_TILED_STAGES if not (interp or wide) else 1,
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bi, block_size, scale):
        q, k, v, bi = q.contiguous(), k.contiguous(), v.contiguous(), bi.to(torch.int32).contiguous()
        o, lse = _slc_fwd(q, k, v, bi, block_size, scale)
        ctx.save_for_backward(q, k, v, o, lse, bi)
        ctx.args = (block_size, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, bi = ctx.saved_tensors
        bwd = _slc_bwd_tiled if TILED_SLC_BWD else _slc_bwd
        dq, dk, dv = bwd(do, q, k, v, o, lse, bi, *ctx.args)
        return dq, dk, dv, None, None, None


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    block_size: int = 64,
    scale: float | None = None,
    check_indices: bool = True,
) -> torch.Tensor:
    """Selected branch (§3.3.2, Eq. 12) with the group-centric Triton kernel, forward and backward.

    q [B, T, HQ, D]; k, v [B, T, H, D]; block_indices [B, T, H, S] int: block j covers keys
    j l' .. j l' + l' - 1 (l' = ``block_size``); a negative entry means no block; a block must start at
    or before its query (keys after the query inside its own block are masked) and appear once per
    row. ``check_indices=False`` skips that validation (it synchronises with the GPU). Returns
    [B, T, HQ, D].
    """
    b, t, hq, h, d = check_qkv("selected_attention", q, k, v, k_len=q.shape[1])
    _check_block_size("selected_attention", "block_size", block_size)
    if check_indices:
        check_block_indices(block_indices, b, t, h, block_size, k.shape[1])
    return _SelectedAttention.apply(q, k, v, block_indices, block_size, _scale(scale, d))


# ----------------------------------------------------------------------------------------------
# The whole layer's attention and the decode step


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    config: ref.NSAConfig | None = None,
    scale: float | None = None,
    block_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 with the Triton kernels: the same arguments and result as ``reference.nsa_attention``.

    q [B, T, HQ, D]; k_cmp, v_cmp [B, Nc, H, D]; k_slc, v_slc, k_win, v_win [B, T, H, D]; gates
    [B, T, HQ, 3]. Returns (o [B, T, HQ, D], block_indices [B, T, H, n]). Differentiable in everything
    but the indices (top-n is not differentiated, §3.3.2).
    """
    cfg = config or ref.NSAConfig()
    cfg.validate()
    b, t, hq, h, d = check_qkv("nsa_attention", q, k_slc, v_slc, k_len=q.shape[1])
    check_qkv("nsa_attention (window keys)", q, k_win, v_win, k_len=t)
    _check_gates("nsa_attention", gates, (b, t, hq, 3), "[B, T, HQ, 3]")
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, cfg.block_len, cfg.stride, scale)
    if block_indices is None:
        with torch.no_grad():
            # Eq. 11 in two launches and one topk: the scores kernel writes the masks too
            scores = masked_selection_scores(q, k_cmp, lse, cfg, scale)
            block_indices = topk_blocks(scores, cfg.n_select)
            del scores
        check = False
    else:
        check = True
    o_slc = selected_attention(q, k_slc, v_slc, block_indices, cfg.select_len, scale, check_indices=check)
    o_win = sliding_window_attention(q, k_win, v_win, cfg.window, scale)
    return gated_sum(gates, o_cmp, o_slc, o_win), block_indices


#: Eq. 5's gated sum as one Triton kernel (:func:`gated_sum_fused`) instead of five PyTorch ops, on
#: by default since its first H100 run (2026-11-25): ``test_gpu_fused_gated_sum_bf16`` passed, and the
#: 64k breakdown (results/*-breakdown.json) timed it at 1.40 ms against 6.13 ms for the PyTorch ops
#: (which read and write 1 GB tensors eight times). False restores the PyTorch ops.
FUSED_GATE = True


def gated_sum(
    gates: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor
) -> torch.Tensor:
    """Eq. 5: ``g_cmp o_cmp + g_slc o_slc + g_win o_win`` with gates [B, T, HQ, 3] and outputs
    [B, T, HQ, D]: the fused kernel (``FUSED_GATE``, D a power of two), else five PyTorch ops in the
    outputs' dtype."""
    d = o_cmp.shape[-1]
    if FUSED_GATE and d > 0 and not d & (d - 1):
        return gated_sum_fused(gates, o_cmp, o_slc, o_win)
    g = gates.to(o_cmp.dtype)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


def gated_sum_fused(
    gates: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor
) -> torch.Tensor:
    """Eq. 5's gated sum in one Triton kernel (fp32 sum, one rounding to the outputs' dtype);
    differentiable in the gates and the three outputs (the backward in PyTorch). Shapes as
    :func:`gated_sum`; D a power of two."""
    _check_gates("gated_sum_fused", gates, (*o_cmp.shape[:-1], 3), "[B, T, HQ, 3]")
    for name, x in (("o_slc", o_slc), ("o_win", o_win)):
        if x.shape != o_cmp.shape or x.dtype != o_cmp.dtype:
            raise ValueError(
                f"gated_sum_fused: {name} must match o_cmp ({tuple(o_cmp.shape)}, {o_cmp.dtype}), "
                f"got {tuple(x.shape)}, {x.dtype}"
            )
    d = o_cmp.shape[-1]
    if d & (d - 1):
        raise ValueError(f"gated_sum_fused: head dim {d} is not a power of two")
    return _GatedSum.apply(gates, o_cmp, o_slc, o_win)


class _GatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates, a, b, c):
        gates, a, b, c = (x.contiguous() for x in (gates, a, b, c))
        o = torch.empty_like(a)
        rows, d = a.numel() // a.shape[-1], a.shape[-1]
        br = 16 if _interp() else max(1, 2048 // d)
        kn._gate_sum_kernel[(triton.cdiv(rows, br),)](gates, a, b, c, o, rows, D=d, BR=br, num_warps=4)
        ctx.save_for_backward(gates, a, b, c)
        return o

    @staticmethod
    def backward(ctx, do):
        gates, a, b, c = ctx.saved_tensors
        g = gates.to(do.dtype)
        grads = [g[..., i : i + 1] * do for i in range(3)]
        dg = torch.stack([(do.float() * x.float()).sum(-1) for x in (a, b, c)], -1).to(gates.dtype)
        return (dg, *grads)


def nsa_decode(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    config: ref.NSAConfig | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step: the token at position t = T - 1 (already appended to the caches) against
    the three branches, with two Triton kernels that count the KV tokens they load (§5.2), around one
    ``torch.topk`` (Eq. 11); nothing synchronises with the host. The first kernel runs the compressed
    branch and the block scores of Eqs. 8-10, the second sorts top-k's picks and runs the selected
    branch, the window and the gated sum of Eq. 5.

    q [B, 1, HQ, D]; k_cmp, v_cmp [B, Nc, H, D]; k_slc, v_slc, k_win, v_win [B, T, H, D] (the caches);
    gates [B, 1, HQ, 3]. Returns (o [B, 1, HQ, D], block_indices [B, 1, H, n], tokens [B, H, 3] int32:
    compressed, selected and window tokens read per GQA group).
    """
    cfg = config or ref.NSAConfig()
    cfg.validate()
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"nsa_decode: q must be one token, [B, 1, HQ, D], got {tuple(q.shape)}")
    b, _, hq, h, d = check_qkv("nsa_decode", q, k_slc, v_slc)
    check_qkv("nsa_decode (window cache)", q, k_win, v_win, k_len=k_slc.shape[1])
    check_qkv("nsa_decode (compressed cache)", q, k_cmp, v_cmp)
    _check_gates("nsa_decode", gates, (b, 1, hq, 3), "[B, 1, HQ, 3]")
    _check_block_size("nsa_decode", "select_len", cfg.select_len)
    t_cache = k_slc.shape[1]
    t = t_cache - 1
    nc = k_cmp.shape[1]
    if nc < ref.num_compressed(t_cache, cfg.block_len, cfg.stride):
        raise ValueError(
            f"nsa_decode: the compressed cache holds {nc} tokens, a cache of {t_cache} needs "
            f"{ref.num_compressed(t_cache, cfg.block_len, cfg.stride)}"
        )
    scale = _scale(scale, d)
    # Everything below is launches and allocations: no value goes to or comes from the host (the
    # position t is a kernel argument, not a tensor), so the host never waits for the stream.
    q, k_cmp, v_cmp = q.contiguous(), k_cmp.contiguous(), v_cmp.contiguous()
    k_slc, v_slc, k_win, v_win = (x.contiguous() for x in (k_slc, v_slc, k_win, v_win))
    g = hq // h
    bg = max(16, triton.next_power_of_2(g))
    bn = 16 if _interp() else 64
    ncp = max(nc, 1)
    ns = triton.cdiv(t_cache, cfg.select_len)
    # Score tiles of BC stride pieces = BC / R selection blocks (R = l'/d, a power of two as l' is):
    # [BG, BC] logits per load, 16 tiles at 64k with the paper's R = 4; 32 under the interpreter, so
    # that the tests' few hundred tokens span several tiles.
    r = cfg.select_len // cfg.stride
    bc = max(r, 32 if _interp() else 256)
    dev, f32 = q.device, torch.float32
    o_cmp = torch.empty(b, hq, d, device=dev, dtype=f32)
    logits = torch.empty(b, hq, ncp, device=dev, dtype=f32)  # scratch: read only where written
    scores = torch.empty(b, h, ns, device=dev, dtype=f32)
    counts = torch.empty(b, h, 3, device=dev, dtype=torch.int32)  # every entry written by a kernel
    nw = 4 if d <= 64 else 8
    kn._decode_cmp_kernel[(b * h,)](
        q, k_cmp, v_cmp, o_cmp, logits, scores, counts,
        q.stride(0), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        t, nc, h, g, ncp, ns, scale * kn.LOG2E,
        STRIDE=cfg.stride, BLOCK_LEN=cfg.block_len, SELECT_LEN=cfg.select_len, N_INITIAL=cfg.n_initial,
        N_LOCAL=cfg.n_local, D=d, BN=bn, BG=bg, BJ=bc // r, BC=bc,
        IEEE=_ieee(q), num_warps=nw,
    )  # fmt: skip
    # Eq. 11: the same torch.topk as reference.select_blocks, on scores whose forced and future blocks
    # the kernel already set to +inf and -inf; the second kernel sorts and pads its picks.
    top_val, top_idx = scores.topk(min(cfg.n_select, ns), dim=-1)
    bi = torch.empty(b, 1, h, cfg.n_select, device=dev, dtype=torch.int32)
    o = torch.empty_like(q)
    kn._decode_sparse_kernel[(b * h,)](
        q, k_slc, v_slc, k_win, v_win, top_val, top_idx, o_cmp, gates.contiguous(), o, bi, counts,
        q.stride(0), q.stride(2), k_slc.stride(0), k_slc.stride(1), k_slc.stride(2),
        k_win.stride(0), k_win.stride(1), k_win.stride(2),
        t, h, g, cfg.n_select, top_idx.shape[-1], ns, cfg.window, scale * kn.LOG2E,
        D=d, BS=cfg.select_len, BN=bn, BG=bg, BSEL=triton.next_power_of_2(cfg.n_select), IEEE=_ieee(q),
        num_warps=nw,
    )  # fmt: skip
    return o, bi, counts
