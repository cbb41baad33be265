"""What every NSA kernel and launcher shares (yuan2025nsa §3.4): the online-softmax step, the tile
loads, the per-row statistics of a backward, and the input checks of every entry point.

Numerics of all kernels: logits in base 2 (``scale * log2(e)`` folded into ``scale_log2``), log-sum-exp
stored in natural log, fp32 accumulation, ``tl.dot`` in tf32 for 16-bit inputs and in IEEE fp32 for
fp32 inputs (``IEEE``, the tests' path). A row that sees no key gets o = 0 and lse = -inf.

Addresses: a 64-bit scalar base per (batch, head) plus 32-bit tile offsets (per-element 64-bit
offsets had cost 0.3-3 KB of register spills per thread in every kernel, compiled offline for sm_90a),
so one batch element's tensor must stay below 2^31 elements (:func:`check_qkv` says so).

Shapes as flash-linear-attention: q [B, T, HQ, Dk]; k [B, T, H, Dk]; v [B, T, H, Dv] with H dividing HQ.

Head sizes (yuan2025nsa §4.1 trains with Dk = 192 for queries and keys and Dv = 128 for values). The
kernels tile a key row as one or two power-of-two pieces, ``D`` (and ``D2``, 0 for none: 192 = 128 +
64), and a value row as ``D_V`` (0: the same as ``D``), so that no matmul runs on padding. What the
kernels take (:data:`KEY_DIMS`, :data:`VALUE_DIMS`); other sizes are zero-padded on the host up to the
next one (:func:`kernel_dims`, :func:`pad_heads`), as ``repro.kda`` does for flash-linear-attention's
D = 60 and 100: zero key columns add nothing to q k^T, zero value columns are sliced off the output,
and the softmax scale stays 1 / sqrt(Dk) of the unpadded size. With Dk = Dv in {16, 32, 64, 128}
(after padding) every launch is the kernels' verified path: no ``D2`` or ``D_V`` is passed, and the
compiled code is the same as before the split (``lab/fingerprints``). Dk != Dv, and Dk = 192, are the
path with ``D2`` / ``D_V``.

Register and spill counts quoted in the kernel files' comments come from the offline compile as it
was when the launch shapes were chosen (November 2026), which compiled each kernel without the
launch's argument specialisation (16-byte aligned pointers, sizes divisible by 16); ``lab/sm90_check``
now compiles every launch as launched, and at the paper's shape in bf16 none spills.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from paperclub import triton_compat

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
HEAD_DIMS = (16, 32, 64, 128)  # Dk = Dv: the verified kernels
KEY_DIMS = (16, 32, 64, 128, 192)  # 192 in two pieces, 128 + 64
VALUE_DIMS = (16, 32, 64, 128)
BLOCK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUP = 64


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``), with its bf16
    fixes installed: the launchers then take small tiles (16 wide) that the tests' shapes span."""
    triton_compat.patch_interpreter()
    return triton_compat.interpreting()


# ----------------------------------------------------------------------------------------------
# Input checks: an error names the argument, what it got and what is expected, before any launch


def check_tensor(fn: str, name: str, x, ndim: int, shape_hint: str) -> None:
    """``x`` must be a tensor of ``ndim`` dimensions (``shape_hint`` names them in the error)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {shape_hint} ({ndim} dims), got shape {tuple(x.shape)}")


def check_qkv(fn: str, q, k, v, k_len: int | None = None) -> tuple[int, int, int, int, int, int]:
    """Shared checks of q [B, T, HQ, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv] (v None: keys alone, the
    block scores). Returns (B, T, HQ, H, Dk, Dv), the head sizes as given (:func:`kernel_dims` says
    what the kernels run them at); Dv = Dk without v."""
    v_given = v is not None
    v = k if v is None else v
    check_tensor(fn, "q", q, 4, "[B, T, HQ, Dk]")
    check_tensor(fn, "k", k, 4, "[B, T, H, Dk]")
    check_tensor(fn, "v", v, 4, "[B, T, H, Dv]")
    b, t, hq, dk = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{fn}: k and v must have one [B, T, H], got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.shape[0] != b or k.shape[3] != dk:
        raise ValueError(
            f"{fn}: k must be [B={b}, T, H, Dk={dk}] to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if k_len is not None and k.shape[1] != k_len:
        raise ValueError(f"{fn}: k must have T = {k_len} positions like q, got {k.shape[1]}")
    h, dv = k.shape[2], v.shape[3]
    if h == 0 or hq % h:
        raise ValueError(f"{fn}: KV heads H = {h} must divide query heads HQ = {hq}")
    if hq // h > MAX_GROUP:
        raise ValueError(f"{fn}: group size HQ / H = {hq // h} is larger than the kernels' {MAX_GROUP}")
    if not 1 <= dk <= KEY_DIMS[-1]:
        raise ValueError(
            f"{fn}: head dim Dk = {dk} of q and k is not supported, expected 1 to {KEY_DIMS[-1]}"
        )
    if v_given and not 1 <= dv <= VALUE_DIMS[-1]:
        raise ValueError(f"{fn}: head dim Dv = {dv} of v is not supported, expected 1 to {VALUE_DIMS[-1]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {x.dtype}, expected one of {[str(x) for x in DTYPES]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{fn}: needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter")
    if b == 0 or t == 0:
        raise ValueError(f"{fn}: empty input, q {tuple(q.shape)}")
    dk_kernel, dv_kernel = kernel_dims(dk, dv if v_given else 1)
    if max(t * hq * max(dk_kernel, dv_kernel), k.shape[1] * h * max(dk_kernel, dv_kernel)) >= 2**31:
        # the kernels add 32-bit tile offsets to a 64-bit base per (batch, head): one batch element's
        # tensor must stay below 2^31 elements
        raise ValueError(
            f"{fn}: T * HQ * D = {t * hq * max(dk_kernel, dv_kernel)} is too large for the kernels (at most 2^31 - 1)"
        )
    return b, t, hq, h, dk, dv


def kernel_dims(dk: int, dv: int) -> tuple[int, int]:
    """The head sizes the kernels run (Dk, Dv) at: each the smallest of :data:`KEY_DIMS` /
    :data:`VALUE_DIMS` that holds it (60 -> 64, 100 -> 128, 192 stays)."""
    return next(x for x in KEY_DIMS if x >= dk), next(x for x in VALUE_DIMS if x >= dv)


def key_pieces(dk: int) -> tuple[int, int]:
    """A kernel key size (one of :data:`KEY_DIMS`) as the kernels' constexprs (D, D2): a power of two
    and the rest (0, or a smaller power of two)."""
    d = 1 << (dk.bit_length() - 1)
    return d, dk - d


def head_constexprs(dk: int, dv: int) -> dict:
    """The head-size constexprs of a launch at kernel sizes (dk, dv): ``D`` always, ``D2`` and ``D_V``
    only off the verified path (Dk = Dv, one piece), so that its launches stay as they were."""
    d, d2 = key_pieces(dk)
    if d2 == 0 and dv == d:
        return {"D": d}
    return {"D": d, "D2": d2, "D_V": dv}


def pad_heads(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` zero-padded along its last dimension to ``d`` (itself when it is that wide already)."""
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def softmax_scale(scale: float | None, d: int) -> float:
    """The logits' scale: ``scale``, or 1 / sqrt(Dk) when None (Dk unpadded); refused unless positive
    and finite."""
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def is_fp32(x: torch.Tensor) -> bool:
    """fp32 inputs take IEEE fp32 dots (the kernels' ``IEEE``), 16-bit ones the tensor cores' default."""
    return x.dtype == torch.float32


def check_block_size(fn: str, name: str, value: int) -> None:
    """A selection block length the kernels take (a power of two, 16-128)."""
    if value not in BLOCK_SIZES:
        raise ValueError(f"{fn}: {name} = {value} is not supported, expected one of {BLOCK_SIZES}")


def check_value_dims(fn: str, *values: torch.Tensor) -> None:
    """The three branches' values share one head size Dv (Eq. 5 adds their outputs)."""
    dims = [x.shape[-1] for x in values]
    if len(set(dims)) > 1:
        raise ValueError(f"{fn}: the branches' values must share one head size Dv, got {dims}")


def check_gates(fn: str, gates: torch.Tensor, shape: tuple, hint: str) -> None:
    """Eq. 5's gates, one per branch and query head: ``shape`` = (B, Tq, HQ, 3), named ``hint``."""
    if gates.shape != shape:
        raise ValueError(f"{fn}: gates must be {hint} = {shape}, got {tuple(gates.shape)}")


# ----------------------------------------------------------------------------------------------
# Triton helpers, inlined into the kernels


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def load_cols(X, base, row_off, ok, C0: tl.constexpr, W: tl.constexpr):
    """Columns C0 .. C0 + W of the rows at ``X + base + row_off`` (64-bit scalar base, 32-bit row
    offsets [rows]); rows not ``ok`` read as 0. A key row's second piece (C0 = D, W = D2)."""
    cols = C0 + tl.arange(0, W)
    return tl.load(X + base + row_off[:, None] + cols[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def value_strides(sb, st, sh, DK: tl.constexpr, DV: tl.constexpr):
    """The (batch, position, head) strides of a contiguous [B, T, H, DV] tensor from those of its
    contiguous [B, T, H, DK] twin (v from k, o and dO from q, dV from dK): the launchers make them
    contiguous and pass one set of strides. Called on the split path only (``D_V`` given)."""
    return sb // DK * DV, st // DK * DV, sh // DK * DV


@triton.jit
def visible_keys(offs_m, offs_n, NK, STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr):
    kpos = offs_n * STRIDE + OFFSET
    vis = (kpos[None, :] <= offs_m[:, None]) & (offs_n[None, :] < NK) & (offs_n[None, :] >= 0)
    if WINDOW > 0:
        vis = vis & (offs_m[:, None] - kpos[None, :] < WINDOW)
    return vis


@triton.jit
def tile_rows(pid, B: tl.constexpr, LIMIT, D: tl.constexpr):
    """The program's tile of B rows: their indices, the head dimension's and which rows are < LIMIT."""
    offs = pid * B + tl.arange(0, B)
    return offs, tl.arange(0, D), offs < LIMIT


@triton.jit
def query_head(pid_bh, HQ, G):
    """For the program axis ``pid_bh = b HQ + hq``: ``b`` (64-bit, for the scalar bases), ``hq`` and
    its KV head ``h``."""
    b = (pid_bh // HQ).to(tl.int64)
    hq = pid_bh % HQ
    return b, hq, hq // G


@triton.jit
def group_rows(pid_bh, H, G, BG: tl.constexpr, D: tl.constexpr):
    """Group-centric rows (§3.4) for the program axis ``pid_bh = b H + h``: ``b`` (64-bit), ``h``,
    HQ = H G, the head dimension's indices and the group's query heads ``hq`` (rows past G masked
    by ``g_ok``)."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    HQ = H * G
    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    hq = h * G + offs_g
    return b, h, HQ, offs_d, g_ok, hq


@triton.jit
def load_pair(X, Y, base, off, ok, y_base, y_off):
    """Two tensors' tiles, X at 64-bit scalar ``base`` + 32-bit tile offsets ``off`` and Y at ``y_base``
    + ``y_off`` (the same ones where both share a layout; V's and dO's own where the value head size
    differs, common.py); rows not ``ok`` read as 0."""
    x = tl.load(X + base + off, mask=ok[:, None], other=0.0)
    y = tl.load(Y + y_base + y_off, mask=ok[:, None], other=0.0)
    return x, y


@triton.jit
def lse_base2(LSE, pos, HQ, hq, ok):
    """The log-sum-exp of [B T, HQ] rows at (``pos`` = b T + t, ``hq``) in base 2, 0 where the row
    saw no key."""
    lse = tl.load(LSE + pos * HQ + hq, mask=ok, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)


@triton.jit
def row_stats(LSE, DELTA, pos, HQ, hq, ok):
    """A backward tile's per-row statistics: :func:`lse_base2` and delta = rowsum(dO * O)."""
    delta = tl.load(DELTA + pos * HQ + hq, mask=ok, other=0.0)
    return lse_base2(LSE, pos, HQ, hq, ok), delta


@triton.jit
def online_softmax_step(
    q, k, v, visible, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr, q2, k2, D2: tl.constexpr
):
    """One key tile of the online softmax (``visible`` broadcasts to [rows, keys]); returns the tile's
    masked base-2 logits and the new running max, sum and accumulator. A key row in two pieces
    (common.py): q2, k2 its next D2 columns (D2 = 0: one piece; pass q, k again)."""
    s = dot(q, tl.trans(k), IEEE)
    if D2 > 0:
        s += dot(q2, tl.trans(k2), IEEE)
    s = s * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return s, m_new, l_i, acc


@triton.jit
def dq_step(p, k, k2, v, do, delta, dq, dq2, IEEE: tl.constexpr, D2: tl.constexpr):
    """FlashAttention-2's dQ update for one tile of probabilities ``p`` [rows, keys]: dP = dO V^T,
    dS = P * (dP - delta), dQ += dS K (dq2 += dS K2 for the keys' second piece, D2 > 0; pass dq, k
    again when D2 = 0). Unscaled: the kernel multiplies by the softmax scale at the store."""
    dp = dot(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    dq += dot(ds.to(k.dtype), k, IEEE)
    if D2 > 0:
        dq2 += dot(ds.to(k.dtype), k2, IEEE)
    return dq, dq2


@triton.jit
def dkdv_step(p_t, q, q2, do, v, delta, dk, dv, dk2, IEEE: tl.constexpr, D2: tl.constexpr):
    """FlashAttention-2's dK / dV update for one tile, transposed ([keys, rows], so that P is never
    transposed): dV += P^T dO, dS^T = P^T * (V dO^T - delta), dK += dS^T Q (dk2 += dS^T Q2 for the keys'
    second piece, D2 > 0; pass dk, q again when D2 = 0). Unscaled, as :func:`dq_step`."""
    dv += dot(p_t.to(do.dtype), do, IEEE)
    dp_t = dot(v, tl.trans(do), IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += dot(ds_t.to(q.dtype), q, IEEE)
    if D2 > 0:
        dk2 += dot(ds_t.to(q.dtype), q2, IEEE)
    return dk, dv, dk2


@triton.jit
def normalise(acc, m_i, l_i):
    """The output and natural-log log-sum-exp of an online softmax; o = 0, lse = -inf where no key was seen."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse
