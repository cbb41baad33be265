"""Plain-PyTorch ground truth for the FlashAttention-4 reproduction (zadouri2026flashattention4).

Everything here is slow and meant to be read next to the paper:

* :func:`attention_exact`: softmax(Q K^T * scale) V in float64, causal or not, with grouped KV heads.
* :func:`online_softmax_attention`: the FlashAttention-2 recurrence over key blocks (running max
  ``m``, running sum ``l``, unnormalised output ``O``), the baseline that FA4 modifies.
* :func:`lazy_rescale_attention`: FA4's conditional (lazy) rescaling: the running max used to
  shift the exponentials is only moved when the true max has grown by more than ``tau`` (log2
  units), so most key blocks skip the O *= alpha correction. Returns statistics too.
* :func:`exp2_poly` / :func:`fit_exp2_poly`: the software exponential: 2^x = 2^j * 2^f with
  j = floor(x), f in [0, 1), 2^f from a degree-3 polynomial (Horner form, one FMA per degree),
  2^j written into the float's exponent bits.

All softmax arithmetic is in base 2, as in the kernels: s = (q . k) * scale * log2(e), and
exp(x * scale) = 2^(x * scale * log2 e). Layout is ``[B, S, H, D]`` throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

LOG2E = 1.0 / math.log(2.0)
#: FA4's rescaling threshold: log2(256) = 8, i.e. the stale max may lag the true one by a factor 256.
RESCALE_THRESHOLD = 8.0


def _expand_kv(k: torch.Tensor, h: int) -> torch.Tensor:
    """[B, S, H_kv, D] -> [B, S, H, D] by repeating each KV head for its group of query heads."""
    h_kv = k.shape[2]
    return k.repeat_interleave(h // h_kv, dim=2)


def causal_mask(s_q: int, s_k: int, device=None) -> torch.Tensor:
    """[S_q, S_k] bool, True where query i may see key j. Queries are aligned to the *end* of the
    keys (bottom-right), the convention of FlashAttention and of decoding with a cache."""
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    return j <= i


def window_mask(s_q: int, s_k: int, left: int | None, right: int | None, device=None) -> torch.Tensor:
    """[S_q, S_k] bool, True where query i may see key j under a sliding window (flash-attn's
    ``window_size=(left, right)``): i' - left <= j <= i' + right with i' = i + S_k - S_q (bottom-right
    aligned, as :func:`causal_mask`); None or a negative bound is unbounded on that side."""
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    ok = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if left is not None and left >= 0:
        ok &= j >= i - left
    if right is not None and right >= 0:
        ok &= j <= i + right
    return ok


def attention_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor:
    """Exact attention in float64.

    q: [B, S_q, H, D], k: [B, S_k, H_kv, D], v: [B, S_k, H_kv, D_v] with H_kv dividing H (D_v may
    differ from D). Returns [B, S_q, H, D_v] float64. ``window`` (left, right): a sliding window
    (:func:`window_mask`); with ``causal`` too, right is 0 (flash-attn's rule). Query rows that see no
    key (causal or a window with S_q > S_k) give zero (flash-attn's convention), with zero gradient.
    """
    b, s_q, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q64, k64, v64 = (
        t.detach().to(torch.float64) if not t.requires_grad else t.to(torch.float64) for t in (q, k, v)
    )
    k64, v64 = _expand_kv(k64, h), _expand_kv(v64, h)
    logits = torch.einsum("bihd,bjhd->bhij", q64, k64) * scale
    if causal or window is not None:
        if window is None:
            mask = causal_mask(s_q, k.shape[1], q.device)
        else:
            left, right = window
            mask = window_mask(s_q, k.shape[1], left, 0 if causal else right, q.device)
        seen = mask.any(-1)[:, None]  # [S_q, 1]: rows with at least one visible key
        # an all -inf row would give 0/0; a finite row of zeros there, then p * 0, keeps it (and its
        # gradient) at zero
        logits = logits.masked_fill(~mask & seen, float("-inf")).masked_fill(~seen, 0.0)
        p = torch.softmax(logits, dim=-1) * seen
    else:
        p = torch.softmax(logits, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", p, v64)


def _log2_logits(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
    """[B, H, S_q, S_k] float64 logits in log2 units (s * scale * log2 e), -inf where masked."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = _expand_kv(k.to(torch.float64), q.shape[2])
    s = torch.einsum("bihd,bjhd->bhij", q.to(torch.float64), k) * (scale * LOG2E)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    return s


def online_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_n: int = 16,
) -> torch.Tensor:
    """FlashAttention-2's online softmax over key blocks of ``block_n`` (float64, base 2).

    For each key block j (all rows of a head at once):
        m_new = max(m, rowmax(S_j));  alpha = 2^(m - m_new)
        P_j = 2^(S_j - m_new);  l = alpha * l + rowsum(P_j);  O = alpha * O + P_j V_j
    and finally O / l. Every block rescales O; that is what FA4 makes conditional.
    q: [B, S_q, H, D], k, v: [B, S_k, H_kv, D]. Returns [B, S_q, H, D] float64.
    """
    s = _log2_logits(q, k, causal, scale)
    vv = _expand_kv(v.to(torch.float64), q.shape[2]).permute(0, 2, 1, 3)  # [B, H, S_k, D]
    b, h, s_q, s_k = s.shape
    m = torch.full((b, h, s_q), float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    o = torch.zeros(b, h, s_q, vv.shape[-1], dtype=torch.float64, device=q.device)
    for start in range(0, s_k, block_n):
        sj = s[..., start : start + block_n]
        m_new = torch.maximum(m, sj.amax(-1))
        # Rows that have seen only masked keys keep m = -inf; shift by 0 there so 2^(-inf - 0) = 0.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - shift)
        p = torch.exp2(sj - shift[..., None])
        l = alpha * l + p.sum(-1)
        o = alpha[..., None] * o + p @ vv[:, :, start : start + block_n]
        m = m_new
    return (o / l[..., None]).permute(0, 2, 1, 3)


@dataclass
class LazyStats:
    """What the lazy-rescaling emulation saw.

    steps: key-block steps after the first one of each query tile (the first always sets the max);
    rescales: how many of those steps moved the max (and so multiplied O by alpha);
    max_term: the largest unnormalised P element seen (bounded by 2^tau);
    max_rowsum: the largest running row sum l seen (bounded by N * 2^tau).
    """

    steps: int
    rescales: int
    max_term: float
    max_rowsum: float

    @property
    def fraction(self) -> float:
        return self.rescales / self.steps if self.steps else 0.0


def lazy_rescale_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    tau: float = RESCALE_THRESHOLD,
    block_m: int = 16,
    block_n: int = 16,
    dtype: torch.dtype = torch.float32,
    per_tile: bool = True,
) -> tuple[torch.Tensor, LazyStats]:
    """FA4's conditional rescaling, emulated in PyTorch with the kernel's tiling.

    The running max ``m`` is the shift used in the exponentials, not necessarily the true max.
    At each key block the candidate ``m_cand = max(m, rowmax(S_j))`` is computed; the shift moves
    to it only if some row of the query tile (``per_tile=True``, the kernel's warp-uniform branch)
    or that row (``per_tile=False``) has ``m_cand - m > tau``. Otherwise the stale ``m`` stays,
    alpha = 1 and O is not touched. Every element then satisfies S - m <= tau, so each
    unnormalised term is at most 2^tau and the row sum at most S_k * 2^tau: with tau = 8 and fp32
    (max 2^128) nothing can overflow. The final O / l is exact because O and l share one shift.

    ``tau = 0`` with ``per_tile=False`` is exactly FA2 (rescale whenever the max grows).
    q: [B, S_q, H, D], k, v: [B, S_k, H_kv, D]. Returns ([B, S_q, H, D] in ``dtype``, stats).
    """
    s_all = _log2_logits(q, k, causal, scale).to(dtype)
    vv = _expand_kv(v.to(dtype), q.shape[2]).permute(0, 2, 1, 3)
    b, h, s_q, s_k = s_all.shape
    out = torch.empty(b, h, s_q, vv.shape[-1], dtype=dtype, device=q.device)
    steps = rescales = 0
    max_term = max_rowsum = 0.0
    for m0 in range(0, s_q, block_m):
        s = s_all[:, :, m0 : m0 + block_m]
        m = torch.full(s.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(*s.shape[:-1], vv.shape[-1], dtype=dtype, device=q.device)
        first = True
        for n0 in range(0, s_k, block_n):
            sj = s[..., n0 : n0 + block_n]
            if torch.isinf(sj).all() and sj.max() < 0:  # fully masked block: the kernel skips it
                continue
            m_cand = torch.maximum(m, sj.amax(-1))
            grow = m_cand - m  # +inf where m was -inf (first visible block of a row)
            if per_tile:
                # One decision per (batch, head) tile, as a warp-uniform branch would make.
                need = (grow > tau).flatten(2).any(-1, keepdim=True).expand_as(m)
            else:
                need = grow > tau
            m_new = torch.where(need, m_cand, m)
            alpha = torch.where(need, torch.exp2(m - m_new), torch.ones_like(m))
            p = torch.exp2(sj - m_new[..., None])
            l = alpha * l + p.sum(-1)
            o = alpha[..., None] * o + p @ vv[:, :, n0 : n0 + block_n]
            if not first:
                steps += need.numel() if not per_tile else b * h
                rescales += int(need.sum()) if not per_tile else int(need[..., 0].sum())
            first = False
            max_term = max(max_term, float(p.max()))
            max_rowsum = max(max_rowsum, float(l.max()))
            m = m_new
        out[:, :, m0 : m0 + block_m] = o / l[..., None]
    return out.permute(0, 2, 1, 3), LazyStats(steps, rescales, max_term, max_rowsum)


# ---------------------------------------------------------------------------------------------
# Software exp2 (the paper's exponential emulation on the FMA units)
# ---------------------------------------------------------------------------------------------


def fit_exp2_poly(degree: int = 3, iters: int = 30) -> np.ndarray:
    """Coefficients c_0..c_degree of p(f) ~ 2^f on [0, 1] minimising the max *relative* error.

    Remez-style: start from a relative-weighted least-squares fit on Chebyshev nodes, then
    iteratively reweight (Lawson's algorithm) toward the equioscillating minimax solution. We pin
    c_0 = 1 so that 2^0 is exact and the integer part carries powers of two exactly.
    """
    f = 0.5 - 0.5 * np.cos(np.linspace(0.0, np.pi, 2001))
    target = np.exp2(f)
    # Basis without the constant (c_0 = 1 pinned): columns f, f^2, ..., f^degree, scaled by 1/target.
    basis = np.stack([f**i for i in range(1, degree + 1)], axis=1) / target[:, None]
    rhs = (target - 1.0) / target
    w = np.ones_like(f)
    c = np.zeros(degree)
    for _ in range(iters):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(basis * sw[:, None], rhs * sw, rcond=None)
        err = np.abs(basis @ c - rhs)
        w = w * (err + 1e-300)
        w /= w.sum()
    return np.concatenate([[1.0], c])


def chebyshev_bound(degree: int = 3) -> float:
    """Upper bound on the max relative error of the best degree-n relative approximation to 2^f on
    [0, 1]: the Chebyshev interpolant's error is at most max|f^(n+1)| / ((n+1)! 2^n) * (1/2)^(n+1)
    with f^(n+1)(x) = (ln 2)^(n+1) 2^x <= 2 (ln 2)^(n+1), and 2^f >= 1 turns absolute into relative.
    The minimax polynomial is at least as good as that interpolant. For n = 3: 1.50e-4."""
    n = degree
    return 2 * math.log(2) ** (n + 1) / (math.factorial(n + 1) * 2**n) * 0.5 ** (n + 1)


#: The coefficients the kernel uses (computed by fit_exp2_poly(3), rounded to fp32, checked by a test).
EXP2_POLY3 = (1.0, 0.6951168775558472, 0.2276446372270584, 0.07706732302904129)
#: Inputs below this give exactly 0 (2^-126 is the smallest normal float; the kernel flushes below it).
EXP2_MIN_INPUT = -126.0


def exp2_poly(x: torch.Tensor, coeffs: tuple[float, ...] = EXP2_POLY3) -> torch.Tensor:
    """2^x in float32 by range reduction, the way the kernel does it.

    j = floor(x), f = x - j in [0, 1); p(f) by Horner (one fused multiply-add per degree); then
    2^j * p(f) by adding j to the exponent field of p(f)'s bits (p(f) in [1, 2) has exponent 0).
    Inputs below -126 give 0, like a flushed subnormal. x: any shape, returns float32 same shape.
    """
    x = x.to(torch.float32)
    xc = torch.clamp(x, min=EXP2_MIN_INPUT)
    j = torch.floor(xc)
    f = xc - j
    p = torch.full_like(f, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * f + c
    bits = p.view(torch.int32) + (j.to(torch.int32) << 23)
    return torch.where(x < EXP2_MIN_INPUT, torch.zeros_like(x), bits.view(torch.float32))
