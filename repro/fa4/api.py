"""The public entry points and the dispatch: which kernel runs, chosen by a frozen :class:`Switches`.

    from repro.fa4 import Switches, attention
    out = attention(q, k, v, causal=True)                                  # [B, S, H, D], bf16 / fp16
    out = attention(q, k, v, window=(256, 0))                              # a sliding window
    out = attention(q, k, v, lazy_rescale=False, soft_exp=2)               # ablation switches
    out = attention(q, k, v, causal=True, config=Switches(gluon=True))     # a config built beforehand

q: [B, S_q, H, D]; k: [B, S_k, H_kv, D]; v: [B, S_k, H_kv, D_v] with H_kv dividing H (grouped-query
attention); D any head size from 1 to 256 and D_v from 1 to 512 (flash-attn's range), bf16 or fp16.
Causal masks are bottom-right aligned (query i sees keys j <= i + S_k - S_q; with S_q > S_k the first
S_q - S_k queries see no key and get zero output and zero gradient, as in flash-attn). ``window=(left,
right)`` is flash-attn's sliding window: query i sees keys i' - left <= j <= i' + right, i' = i + S_k -
S_q; None or a negative bound is unbounded on that side, and ``causal=True`` makes right 0. The
switches are checked and resolved (:func:`resolve`: the launch shapes filled in, ``gluon=None`` and
``bwd="auto"`` made concrete by :func:`auto_forward` and :func:`auto_backward`) once, before any kernel runs, and the resolved config is saved for
the backward, so that what ran forward decides what runs backward.

Head sizes and tiles (:func:`head_layout`). The kernels' tiles are powers of two (Triton's and
Gluon's tensor shapes must be); every other head size is zero-padded to a tile in PyTorch before the
kernels and the padding sliced off after. The softmax scale stays 1/sqrt(D) of the caller's D; zero
columns of q and k add nothing to Q K^T, zero columns of v give output columns that are sliced off, so
the result is exact. What it costs, per head and (query, key) pair: the forward's two matmuls do
2 (T + T_v) chunks multiply-adds instead of 2 (D + D_v) (:meth:`HeadLayout.flops_ratio`: 1.33x at
D = 96 on the 128 tile, 2x at D = 32 on the 64 tile, 1.2x for D = 192, D_v = 128), and the padded
copies of q, k, v and the sliced output add one read and one write of those tensors (2 B H S (D + T)
bytes and so on: memory passes, small beside the S^2 work at S >= 1k).

* D <= 128: the GPU-verified kernels at D = 64 or 128 (the same compiled code as before issue #42:
  ``lab/fingerprints.py``), v sharing q's tile; a D_v wider than the tile is cut into chunks of the
  tile, each a call of the kernels on the same q and k (exact: O's columns and, backward, dV's are
  independent per chunk, dQ and dK the sums of the chunks'), so D_v up to 512 reuses them too. On
  Hopper the forward there is the Gluon kernel (:func:`auto_forward`).
* D > 128: the 256 tile (v on a tile of its own, 64, 128 or 256): on Hopper the Gluon forward and
  backward, v padded to the 256 tile where it is narrower (:func:`run_layout`: MLA's D = 192,
  D_v = 128 does 1.6x the caller's matmul work there rather than 1.2x, on kernels 1.6x (forward) to
  3x (backward) faster than the Triton ones at that tile); elsewhere the Triton kernels, v on its own
  tile.
* ``window``: the Triton kernels' sliding-window entry points (``triton_fwd._fwd_window_kernel``,
  ``triton_bwd._bwd_*_window_kernel``, ``triton_bwd_fused._bwd_fused_window_kernel``). A window that
  hides no key from any row, or only the future, runs the plain (or causal) kernels.
* ``Switches(own_v_tile=True)``: v on its own tile at D <= 128 too (the kernels' D_V != D paths, new
  code, not yet run on a GPU; off by default since padding serves those inputs with verified kernels).

Sizes above 128 and windows, refused before issue #42, have run flash-attn's FA2 and FA3 test
matrices on an H200 (``tests/test_gpu_peer_matrix.py``; the results on the fa4 page).

The kernels, one file per stage of the pipeline (zadouri2026flashattention4; FA3's Hopper schedule,
shah2024flashattention3, where the paper's Blackwell one has no Hopper form):

* ``triton_fwd``: the Triton forward with FA4's conditional rescaling and software exp2 as switches
  (off Hopper, with a window, D > 128, or ``gluon=False``);
* ``gluon_fwd``: the warp-specialised Gluon forward (Hopper; the default there, :func:`auto_forward`);
* ``gluon_bwd``: the warp-specialised Gluon backward (``bwd="gluon"``; Hopper; the default there);
* ``triton_bwd_fused``: FA3's one-pass backward in Triton (``bwd="fused"``; off Hopper when causal);
* ``triton_bwd``: FA2's two-kernel backward (``bwd="fa2"``; off Hopper otherwise; the cross-check);
* ``reference``: the paper's equations in PyTorch, the ground truth.

:func:`attention_forward` and :func:`attention_backward` are the forward with its log-sum-exp and the
backward from a given output and log-sum-exp, for callers that keep them themselves (ring attention,
``repro.usp``; NSA's sliding-window branch, ``repro.nsa``)::

    o, lse = attention_forward(q, k, v, window=(511, 0))             # lse [B, H, S_q], natural log
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, window=(511, 0))

:func:`attention_any_d` is the entry point of the CPU tests: it also takes float32 and the tiles 16
and 32 (for the Triton interpreter, where bf16 matmuls and wide tiles are slow).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from paperclub.triton_compat import interpreting
from repro.fa4.reference import RESCALE_THRESHOLD

__all__ = [
    "Switches",
    "attention",
    "attention_any_d",
    "attention_backward",
    "attention_forward",
    "auto_backward",
    "auto_forward",
    "forward_with_counts",
    "head_layout",
    "run_layout",
]

#: The head sizes of q and k the public entry points take (flash-attn's: up to 256) ...
MAX_HEAD_DIM = 256
#: ... and of v (flash-attn 3 takes D_v up to 512 at D = 64, the MLA decode shape): wider than a
#: tile, v is cut into chunks (see the module docstring).
MAX_HEAD_DIM_V = 512
#: The tiles every kernel here has run at on a GPU (Triton and Gluon, forward and backward).
VERIFIED_TILES = (64, 128)
#: The tiles of the public entry points: 256 only in the Triton kernels (not yet run on a GPU).
PUBLIC_TILES = (64, 128, 256)
#: The tiles the Gluon forward runs (q, k and v on one of them): the verified ones and 256 (its own
#: launch, GLUON_DEFAULTS[256] in gluon_fwd: 64-key tiles, two stages, 192 KiB of shared memory).
GLUON_FORWARD_TILES = (64, 128, 256)
#: The tiles the Gluon backward runs (``bwd="gluon"``); ``bwd="auto"`` picks it at the verified ones
#: only: at 256 (its own schedule, gluon_bwd's D = 256 section) flash-attn's matrix has not run it yet.
GLUON_BACKWARD_TILES = (64, 128, 256)
#: ... and of the interpreter's tests (attention_any_d): small tiles keep the CPU fast.
TEST_TILES = (16, 32, 64, 128, 256)
#: The kernel-level entry points' head sizes (run_forward / run_backward, repro.usp): no padding there.
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
        None (the default): :func:`auto_forward` picks it where it runs (Hopper, bf16/fp16, q, k and v
        on one tile of 64, 128 or 256, no window) and no Triton-only forward switch is set; False: the
        Triton kernel always (the ablation's baseline, FA4's ideas one at a time).
    block_m, block_n, num_warps, num_stages: launch shape; None picks the tuned default
        (``triton_fwd.FWD_DEFAULTS``).
    bwd: which backward runs. "fa2": FA2's two kernels (``repro.fa4.triton_bwd``: dK/dV per key block,
        then dQ per query block; S and dP computed twice, 7 matmuls per tile pair, no atomics). "fused":
        FA3's one-pass schedule (``repro.fa4.triton_bwd_fused``: one program per key block, dK/dV in
        registers, dQ by fp32 atomic adds, 5 matmuls; a preprocess kernel for delta = rowsum(dO * O)).
        "gluon": the same 5-matmul schedule warp-specialised in Gluon (``repro.fa4.gluon_bwd``: a TMA
        load warp, two consumer warpgroups of 64 keys each with asynchronous wgmma, dQ by TMA bulk
        reductions; at the 256 tile its own schedule: 64 keys a program, one consumer for dV and
        one for dK, P^T and dS^T exchanged through shared memory); Hopper (sm_90) only, refused in the
        CPU interpreter. "auto" (the default, :func:`auto_backward`): "gluon" on Hopper at tiles 64,
        128 and 256, else "fused" when causal and "fa2" otherwise. At D = 256 (H200, 2026-11-29,
        results/nvidia-h200-gluon-bwd-d256.json, backward alone, bf16, S = 4k-8k) "gluon" ran
        1.00-1.25x cuDNN's speed and "fused" 0.34-0.37x.
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
    own_v_tile: at D <= 128, v on a tile of its own head size (the Triton kernels' D_V != D paths)
        instead of sharing q's (padded, or cut into chunks of q's tile). New code, not yet run on a
        GPU, so off: with it off the verified kernels serve every D_v (see :func:`head_layout`).
        Triton only (not with gluon=True or bwd="gluon").

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
    gluon: bool | None = None
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
    own_v_tile: bool = False


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


def _dims_text(dims) -> str:
    if isinstance(dims, range):
        return f"{dims.start} to {dims.stop - 1}"
    return f"one of {list(dims)}"


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dims, dtypes, dims_v=None
) -> None:
    """Raise, naming the argument and what was expected, unless q, k, v are attention inputs with a
    dtype in ``dtypes``, q and k's head size D in ``dims`` and v's in ``dims_v`` (None: v has k's
    shape, the kernel-level entry points' rule), all on one device. ``dims``, ``dims_v``: a
    collection or a ``range``."""
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
    if dims_v is None and k.shape != v.shape:
        raise ValueError(
            f"attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"attention: k must be [B={b}, S_k, H_kv, D={d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"attention: v must be [B, S_k, H_kv, D_v] = [{k.shape[0]}, {k.shape[1]}, {k.shape[2]}, D_v] "
            f"to match k {tuple(k.shape)}, got {tuple(v.shape)}"
        )
    if d not in dims:
        raise ValueError(
            f"attention: head dim D = {d} of q and k is not supported, expected {_dims_text(dims)}"
        )
    if dims_v is not None and v.shape[3] not in dims_v:
        raise ValueError(
            f"attention: head dim D_v = {v.shape[3]} of v is not supported, expected {_dims_text(dims_v)}"
        )
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"attention: KV heads H_kv = {h_kv} must divide query heads H = {h}")
    if s_q == 0 or k.shape[1] == 0 or b == 0:
        raise ValueError(f"attention: empty input, q {tuple(q.shape)}, k {tuple(k.shape)}")


@dataclass(frozen=True)
class HeadLayout:
    """How the caller's head sizes map onto the kernels' tiles (see the module docstring).

    d, d_v: the caller's head sizes of q/k and of v; tile: the head size q and k are padded to; tile_v:
    the width of each of the ``chunks`` pieces v is cut into (the last padded)."""

    d: int
    d_v: int
    tile: int
    tile_v: int
    chunks: int

    @property
    def verified(self) -> bool:
        """The kernels that ran on a GPU before issue #42 serve it (one tile of 64 or 128 for q, k, v)."""
        return self.tile == self.tile_v and self.tile in VERIFIED_TILES

    @property
    def gluon_forward(self) -> bool:
        """The Gluon forward takes it: q, k and v on one tile of GLUON_FORWARD_TILES."""
        return self.tile == self.tile_v and self.tile in GLUON_FORWARD_TILES

    @property
    def gluon_backward(self) -> bool:
        """The Gluon backward takes it (``bwd="gluon"``): q, k and v on one tile of GLUON_BACKWARD_TILES."""
        return self.tile == self.tile_v and self.tile in GLUON_BACKWARD_TILES

    @property
    def exact(self) -> bool:
        """No padding and no chunks: the caller's tensors go to the kernels as they are."""
        return self.d == self.tile and self.d_v == self.tile_v and self.chunks == 1

    def flops_ratio(self) -> float:
        """Matmul work run over the work of the caller's head sizes: chunks (T + T_v) / (D + D_v), for
        the forward's Q K^T and P V (the backward's five matmuls scale the same way)."""
        return self.chunks * (self.tile + self.tile_v) / (self.d + self.d_v)


def head_layout(d: int, d_v: int, tiles=PUBLIC_TILES, own_v_tile: bool = False) -> HeadLayout:
    """The tiles q, k (head size ``d``) and v (``d_v``) run on, from ``tiles`` (powers of two).

    d at most the widest verified tile (128) and not ``own_v_tile``: one tile T >= d for q, k and each
    chunk of v, T among the verified ones, the one that does the least matmul work (chunks * 2T; at a
    tie the wider, fewer calls). Otherwise (d > 128, or ``own_v_tile``): q and k on the smallest tile
    >= d, v on the smallest tile >= d_v, in chunks of the widest tile when d_v is wider."""
    tiles = tuple(sorted(tiles))
    if d > tiles[-1]:
        raise ValueError(f"attention: head dim D = {d} is wider than the widest tile {tiles[-1]}")
    shared = [t for t in tiles if d <= t <= max(VERIFIED_TILES)]
    if shared and not own_v_tile:
        cost = {t: -(-d_v // t) * 2 * t for t in shared}
        tile = min(shared, key=lambda t: (cost[t], -t))
        return HeadLayout(d, d_v, tile, tile, -(-d_v // tile))
    tile = min(t for t in tiles if t >= d)
    tile_v = min((t for t in tiles if t >= d_v), default=tiles[-1])
    return HeadLayout(d, d_v, tile, tile_v, -(-d_v // tile_v))


def attention_mask(window, causal: bool, s_q: int, s_k: int) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) as the kernels take them, from the caller's ``window`` and ``causal``.

    ``window``: None, or flash-attn's (left, right): query i sees keys i' - left .. i' + right,
    i' = i + S_k - S_q; a bound that is None or negative is unbounded; ``causal`` makes right 0. A
    window that hides no key from any row is no mask (causal False, window None), one that hides only
    the future is causal (True, None); any other comes back as two bounds >= 0, an unbounded side as
    S_q + S_k (every row's every key)."""
    if window is None:
        return bool(causal), None
    if isinstance(window, torch.Tensor) and window.numel() == 2 and not window.is_floating_point():
        window = window.tolist()  # flash-attn's own tests pass torch.randint(0, S_k, (2,))
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise TypeError(f"attention: window must be (left, right) or None, got {window!r}")
    bounds = []
    for name, x in zip(("left", "right"), window, strict=True):
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Integral)):
            raise TypeError(f"attention: window {name} must be an int or None, got {x!r}")
        bounds.append(None if x is None or x < 0 else int(x))
    left, right = bounds
    if causal:
        right = 0
    all_left = left is None or left >= s_k - 1  # max over rows of i' - left <= 0
    all_right = right is None or right >= s_q - 1  # min over rows of i' + right >= S_k - 1
    if all_left and all_right:
        return False, None
    if all_left and right == 0:
        return True, None
    wide = s_q + s_k
    return False, (wide if left is None else left, wide if right is None else right)


def empty_rows(s_q: int, s_k: int, causal: bool, window: tuple[int, int] | None) -> int:
    """How many of the first query rows see no key (causal or a window with S_q > S_k + right)."""
    right = window[1] if window is not None else (0 if causal else None)
    return 0 if right is None else max(0, s_q - s_k - right)


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


def resolve(sw: Switches, d: int, interpret: bool, window: bool = False) -> Switches:
    """``sw`` checked and with every launch choice made (None fields filled from the tuned defaults
    for head dim (tile) ``d``, those of the general kernels, which run windows and v on its own tile,
    with ``window``, or the interpreter's small tiles); refuses combinations that cannot run.
    ``bwd="auto"`` is left as it is here (:func:`auto_backward` needs the tensors)."""
    from repro.fa4.triton_bwd import BWD_DEFAULTS, BWD_INTERPRET, BWD_WINDOW_DEFAULTS
    from repro.fa4.triton_fwd import FWD_DEFAULTS, FWD_INTERPRET, FWD_WINDOW_DEFAULTS

    if window:
        FWD_DEFAULTS = {**FWD_DEFAULTS, **FWD_WINDOW_DEFAULTS}  # noqa: N806 - the table in use
        BWD_DEFAULTS = {**BWD_DEFAULTS, **BWD_WINDOW_DEFAULTS}  # noqa: N806

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
        from repro.fa4.triton_bwd_fused import FUSED_DEFAULTS, FUSED_INTERPRET, FUSED_WINDOW_DEFAULTS

        if window:
            FUSED_DEFAULTS = {**FUSED_DEFAULTS, **FUSED_WINDOW_DEFAULTS}  # noqa: N806
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


#: The forward switches only the Triton kernel has: any of them set (not at its default) asks for it,
#: so ``gluon=None`` leaves them to the Triton forward rather than refusing them.
TRITON_FORWARD_ONLY = (
    "soft_exp", "pingpong", "persistent", "warp_specialize", "tma",
    "block_m", "block_n", "num_warps", "num_stages", "own_v_tile",
)  # fmt: skip


def auto_forward(q: torch.Tensor, window, layout: HeadLayout, sw: Switches) -> bool:
    """Whether ``gluon=None`` runs the Gluon forward for ``q`` on ``layout``'s tiles: on a Hopper GPU
    (sm_90) where Triton has Gluon, q bf16/fp16, q, k and v on one tile of GLUON_FORWARD_TILES (64 or
    128: head sizes 1-128 padded to it, v in chunks of it; 256: D and D_v in 129-256 padded to it), no
    ``window``, and none of :data:`TRITON_FORWARD_ONLY` set.
    Measured (results/nvidia-h200-peer.json, 2026-11-29, D = 128, bf16, 16 heads, B x S = 16k): 0.88-1.09x
    cuDNN's forward at S = 2k-8k against the Triton kernel's 0.66-0.76x (with TMA); flash-attn's FA2 and
    FA3 test matrices pass through it at every head size up to 128 (gpu-checks.json, 2026-11-29, H200).
    Elsewhere (other GPUs, the CPU interpreter, v off q's tile, a window) the Triton forward."""
    if sw.gluon is not None:
        return sw.gluon
    default = Switches()
    if any(getattr(sw, n) != getattr(default, n) for n in TRITON_FORWARD_ONLY):
        return False
    if (
        q.device.type != "cuda"
        or interpreting()
        or q.dtype not in (torch.bfloat16, torch.float16)
        or window is not None
        or not layout.gluon_forward
    ):
        return False
    from repro.fa4 import gluon_fwd

    return gluon_fwd.HAS_GLUON and torch.cuda.get_device_capability(q.device) == (9, 0)


def run_layout(q: torch.Tensor, window, tiles, sw: Switches, d_v: int | None = None) -> HeadLayout:
    """The tiles a call with ``q`` (head size D, v's ``d_v``, by default D) and ``sw`` runs on:
    :func:`head_layout`'s, except where it puts v on a narrower tile than q's (D > 128, D_v below the
    256 tile; not with ``own_v_tile``): there v is padded to q's tile too when that lets the Gluon
    kernels take the call (``gluon=True``, or ``gluon=None`` where :func:`auto_forward` picks them).
    Padded v costs matmul work (:meth:`HeadLayout.flops_ratio` 1.6x against 1.2x at D = 192,
    D_v = 128) on kernels faster at the 256 tile than the Triton ones by more than that: forward
    1.07-1.11x cuDNN against 0.64-0.72x, backward 1.00-1.25x against 0.34-0.37x (H200, 2026-11-29,
    results/nvidia-h200-heads.json and nvidia-h200-gluon-bwd-d256.json, D = D_v = 256)."""
    d = q.shape[-1]
    d_v = d if d_v is None else d_v
    layout = head_layout(d, d_v, tiles, sw.own_v_tile)
    if sw.own_v_tile or sw.gluon is False or layout.tile_v >= layout.tile:
        return layout
    shared = HeadLayout(d, d_v, layout.tile, layout.tile, 1)
    return shared if sw.gluon or auto_forward(q, window, shared, sw) else layout


def auto_backward(
    q: torch.Tensor, causal: bool, window=None, d: int | None = None, d_v: int | None = None
) -> str:
    """The backward bwd="auto" runs for ``q`` (head size ``d``, v's ``d_v``: the tiles the kernels run,
    by default q's last dimension): "gluon" on a Hopper GPU (sm_90) where Triton has Gluon and q is
    bf16/fp16 with d = d_v in {64, 128, 256} and no ``window``, the fastest of ours there at every
    measured shape (results/*-bwd.json, 2026-11-25, and *-bwd-gluon-dq.json, 2026-11-27, H100; at 256
    nvidia-h200-gluon-bwd-d256.json, 2026-11-29); elsewhere (other GPUs, the CPU interpreter, D 16/32,
    fp32, a window) "fused" when causal or windowed and "fa2"
    otherwise, the faster Triton backward of each."""
    d = q.shape[-1] if d is None else d
    d_v = d if d_v is None else d_v
    if (
        q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and d in GLUON_BACKWARD_TILES
        and d_v == d
        and window is None
    ):
        from repro.fa4 import gluon_bwd

        if gluon_bwd.HAS_GLUON and torch.cuda.get_device_capability(q.device) == (9, 0):
            return "gluon"
    return "fused" if causal or window is not None else "fa2"


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


def run_forward(q, k, v, causal: bool, scale: float, sw: Switches, count: bool = False, window=None):
    """The forward kernel ``sw`` (resolved) names: (o [B, S_q, H, D_v], lse [B, H, S_q] fp32 base 2,
    rescale counts). q, k, v at the kernels' tiles; ``window`` None or (left, right) >= 0 (see
    :func:`attention_mask`). No checks: the entry points have made them."""
    from repro.fa4.triton_fwd import triton_forward

    if sw.gluon:
        return _forward_gluon(q, k, v, causal, scale, sw, count)
    return triton_forward(q, k, v, causal, scale, sw, count, window=window)


def run_backward(do, q, k, v, o, lse, causal: bool, scale: float, sw: Switches, window=None):
    """dq, dk, dv by the backward ``sw`` (resolved) names, from o and the base-2 lse. q, k, v
    contiguous, at the kernels' tiles. A config whose bwd is still "auto" (resolved without the
    tensors) runs "fa2"."""
    if sw.bwd == "gluon":
        from repro.fa4.gluon_bwd import gluon_attention_backward

        return gluon_attention_backward(do, q, k, v, o, lse, causal, scale, dq_tma=sw.bwd_dq_tma)
    if sw.bwd == "fused":
        from repro.fa4.triton_bwd_fused import backward_fused

        return backward_fused(
            do, q, k, v, o, lse, causal, scale,
            sw.bwd_block_m, sw.bwd_block_n, sw.bwd_num_warps, sw.bwd_num_stages, sw.bwd_tma, sw.bwd_dq_tma,
            window=window,
        )  # fmt: skip
    from repro.fa4.triton_bwd import triton_backward

    return triton_backward(do, q, k, v, o, lse, causal, scale, sw, window=window)


# ---------------------------------------------------------------------------------------------
# Head sizes on the kernels' tiles: padding and v's chunks, forward and backward
# ---------------------------------------------------------------------------------------------


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with its last dimension zero-padded to ``width`` (``t`` itself, contiguous, when it has it)."""
    if t.shape[-1] == width:
        return t.contiguous()
    return F.pad(t, (0, width - t.shape[-1])).contiguous()


def _v_chunks(v: torch.Tensor, layout: HeadLayout) -> list[torch.Tensor]:
    """v cut into ``layout.chunks`` pieces of ``layout.tile_v`` columns, the last zero-padded."""
    tv = layout.tile_v
    return [_pad(v[..., c * tv : (c + 1) * tv], tv) for c in range(layout.chunks)]


def _join(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """The chunks' outputs side by side, cut to the caller's ``width``."""
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if out.shape[-1] == width else out[..., :width].contiguous()


def forward_on_tiles(q, k, v, causal, scale, sw, window, layout: HeadLayout):
    """The forward on the kernels' tiles: (o [B, S_q, H, D_v], lse2 [B, H, S_q] base 2, the chunks'
    outputs at the tile width, which the backward reads). Every chunk's log-sum-exp is the same (it
    depends on q and k only); the first is returned."""
    qp, kp = _pad(q, layout.tile), _pad(k, layout.tile)
    parts, lse2 = [], None
    for vc in _v_chunks(v, layout):
        o_c, l2, _ = run_forward(qp, kp, vc, causal, scale, sw, window=window)
        parts.append(o_c)
        lse2 = l2 if lse2 is None else lse2
    return _join(parts, layout.d_v), lse2, parts


def backward_on_tiles(do, q, k, v, parts, lse2, causal, scale, sw, window, layout: HeadLayout):
    """dq, dk, dv from the chunks' outputs ``parts`` (as :func:`forward_on_tiles` returns them) and
    dO [B, S_q, H, D_v]. Per chunk the backward runs on (q, k, v_c, o_c, dO_c): its delta is
    rowsum(dO_c O_c), its dS the chunk's share of dS (linear in dP - delta, which splits by columns of
    v), so dq and dk are the sums over chunks (in fp32 when there are several) and dv the chunks'."""
    qp, kp = _pad(q, layout.tile), _pad(k, layout.tile)
    tv = layout.tile_v
    dq = dk = None
    dvs = []
    for c, (vc, oc) in enumerate(zip(_v_chunks(v, layout), parts, strict=True)):
        doc = _pad(do[..., c * tv : (c + 1) * tv].to(q.dtype), tv)
        dq_c, dk_c, dv_c = run_backward(doc, qp, kp, vc, oc, lse2, causal, scale, sw, window=window)
        if layout.chunks > 1:
            dq_c, dk_c = dq_c.float(), dk_c.float()
        dq = dq_c if dq is None else dq + dq_c
        dk = dk_c if dk is None else dk + dk_c
        dvs.append(dv_c)
    dq, dk = dq.to(q.dtype), dk.to(k.dtype)
    cut = (lambda t: t) if layout.tile == layout.d else (lambda t: t[..., : layout.d].contiguous())
    return cut(dq), cut(dk), _join(dvs, layout.d_v)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, sw, window, layout):
        o, lse, parts = forward_on_tiles(q, k, v, causal, scale, sw, window, layout)
        ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), lse, *parts)
        # the resolved config decides the backward
        ctx.causal, ctx.scale, ctx.sw, ctx.window, ctx.layout = causal, scale, sw, window, layout
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, *parts = ctx.saved_tensors
        dq, dk, dv = backward_on_tiles(
            do, q, k, v, parts, lse, ctx.causal, ctx.scale, ctx.sw, ctx.window, ctx.layout
        )
        return dq, dk, dv, None, None, None, None, None


def _scale(d: int, scale: float | None) -> float:
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"attention: scale must be a positive finite number, got {scale}")
    return scale


@dataclass(frozen=True)
class _Plan:
    """What an entry point runs, decided before any kernel: the scale, the resolved config, the mask
    (causal, window) and the tiles."""

    scale: float
    sw: Switches
    causal: bool
    window: tuple[int, int] | None
    layout: HeadLayout


def _prepare(q, k, v, causal, scale, window, sw: Switches, tiles, dtypes, dims=None, dims_v=None) -> _Plan:
    """Check the inputs, the device, the mask and the switches; the plan. ``dims``, ``dims_v``: the
    head sizes taken (by default every one up to MAX_HEAD_DIM, MAX_HEAD_DIM_V)."""
    dims = range(1, MAX_HEAD_DIM + 1) if dims is None else dims
    dims_v = range(1, MAX_HEAD_DIM_V + 1) if dims_v is None else dims_v
    check_inputs(q, k, v, causal, dims, dtypes, dims_v)
    d, d_v = q.shape[-1], v.shape[-1]
    scale = _scale(d, scale)
    causal, window = attention_mask(window, causal, q.shape[1], k.shape[1])
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"attention: q, k, v are on {q.device}; the kernels need a CUDA device, or TRITON_INTERPRET=1 "
            "for the CPU interpreter"
        )
    layout = run_layout(q, window, tiles, sw, d_v)
    if sw.gluon is None:
        sw = replace(sw, gluon=auto_forward(q, window, layout, sw))
    if sw.bwd == "auto":
        sw = replace(sw, bwd=auto_backward(q, causal, window, layout.tile, layout.tile_v))
    if sw.gluon and (window is not None or not layout.gluon_forward):
        raise ValueError(
            f"attention: gluon=True runs q, k and v on one tile of {GLUON_FORWARD_TILES} (D_v on D's "
            f"tile) without a window; got D = {d}, D_v = {d_v} (tiles {layout.tile}, {layout.tile_v}), "
            f"window = {window}: leave it off, the Triton kernels take these"
        )
    if sw.bwd == "gluon" and (window is not None or not layout.gluon_backward):
        raise ValueError(
            f"attention: bwd='gluon' runs q, k and v on one tile of {GLUON_BACKWARD_TILES} (D_v on D's "
            f"tile, own_v_tile off) without a window; got D = {d}, D_v = {d_v} (tiles {layout.tile}, "
            f"{layout.tile_v}), window = {window}, own_v_tile = {sw.own_v_tile}: leave it off, the Triton "
            "kernels take these"
        )
    if window is not None and (sw.pingpong or sw.persistent):
        raise ValueError(
            "attention: a sliding window runs one query tile per program: pingpong and persistent do not "
            f"apply (got pingpong={sw.pingpong}, persistent={sw.persistent})"
        )
    # the general kernels (a window, or v on its own tile) have launch shapes of their own, picked by
    # the wider of the two tiles (at D = 64 with v on 128 the D = 64 launch spills in the backward)
    general = window is not None or layout.tile_v != layout.tile
    sw = resolve(sw, max(layout.tile, layout.tile_v), interpreting(), general)
    if sw.bwd == "gluon":  # refuse before the forward runs, not at the first backward
        from repro.fa4.gluon_bwd import check_device

        check_device(q)
    return _Plan(scale, sw, causal, window, layout)


def _run(q, k, v, causal, scale, window, sw: Switches, tiles, dtypes):
    plan = _prepare(q, k, v, causal, scale, window, sw, tiles, dtypes)
    skip = empty_rows(q.shape[1], k.shape[1], plan.causal, plan.window)
    return _with_empty_rows(
        lambda qs: _Attention.apply(qs, k, v, plan.causal, plan.scale, plan.sw, plan.window, plan.layout),
        q,
        v.shape[-1],
        skip,
    )


def _with_empty_rows(fn, q: torch.Tensor, d_v: int, skip: int) -> torch.Tensor:
    """``fn(q)``, except that the first ``skip`` query rows, which see no key (causal or a window with
    S_q > S_k + right, bottom-right aligned), get zeros (flash-attn's convention; their gradient is
    zero too) and ``fn`` runs on the rest, whose masks are unchanged (both ends are aligned to the
    last key)."""
    if skip <= 0:
        return fn(q)
    part = fn(q[:, skip:].contiguous())
    return torch.cat([part.new_zeros(q.shape[0], skip, q.shape[2], d_v), part], dim=1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    config: Switches | None = None,
    window: tuple[int | None, int | None] | None = None,
    **switches,
) -> torch.Tensor:
    """softmax(Q K^T * scale) V with FA4's forward ideas; differentiable.

    q: [B, S_q, H, D], k: [B, S_k, H_kv, D], v: [B, S_k, H_kv, D_v], H_kv dividing H, D from 1 to
    256, D_v from 1 to 512, bf16 or fp16, on CUDA (any strides: inputs are made contiguous). scale
    defaults to 1 / sqrt(D). ``window``: (left, right) sliding window, flash-attn's ``window_size``
    (see the module docstring). The kernels: ``config`` (a :class:`Switches`) or its fields as
    keywords. Returns [B, S_q, H, D_v] in q's dtype.
    """
    sw = switches_from(switches, config)
    return _run(q, k, v, causal, scale, window, sw, PUBLIC_TILES, PUBLIC_DTYPES)


def attention_any_d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    config: Switches | None = None,
    window: tuple[int | None, int | None] | None = None,
    **switches,
) -> torch.Tensor:
    """Internal: :func:`attention` that also takes float32 and the tiles 16 and 32 (interpreter tests)."""
    sw = switches_from(switches, config)
    return _run(q, k, v, causal, scale, window, sw, TEST_TILES, (*PUBLIC_DTYPES, torch.float32))


LN2 = math.log(2.0)


def _forward_backward_dtypes() -> tuple[torch.dtype, ...]:
    # fp32 only where the kernels run in the interpreter (the GPU's fp32 dots are tf32)
    return PUBLIC_DTYPES + ((torch.float32,) if interpreting() else ())


def _lse_plan(q, k, v, causal, scale, window, config, who: str) -> _Plan:
    sw = config if config is not None else Switches()
    tiles = TEST_TILES if interpreting() else PUBLIC_TILES
    plan = _prepare(q, k, v, causal, scale, window, sw, tiles, _forward_backward_dtypes())
    if empty_rows(q.shape[1], k.shape[1], plan.causal, plan.window):
        if plan.window is None:
            raise ValueError(
                f"{who}: causal needs S_q <= S_k here (rows that see no key have no log-sum-exp), "
                f"got S_q = {q.shape[1]}, S_k = {k.shape[1]}"
            )
        raise ValueError(
            f"{who}: a window (left, right) needs S_q <= S_k + right here (rows that see no key have no "
            f"log-sum-exp), got S_q = {q.shape[1]}, S_k = {k.shape[1]}, window = {window}"
        )
    return plan


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    config: Switches | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward and its log-sum-exp, without autograd: for callers that keep both and run
    :func:`attention_backward` themselves (a ring of blocks merging partial results; NSA's window).

    q: [B, S_q, H, D], k: [B, S_k, H_kv, D], v: [B, S_k, H_kv, D_v], head sizes and ``window`` as
    :func:`attention`, bf16 or fp16 (and float32 in the CPU interpreter); every query row must see a
    key (causal: S_q <= S_k; a window: S_q <= S_k + right). Returns (o [B, S_q, H, D_v] in q's dtype,
    lse [B, H, S_q] float32, natural log: log sum_j exp(scale q_i . k_j) over the keys row i sees).
    ``config`` (default Switches()) chooses the forward kernel; its backward fields are for
    :func:`attention_backward`, which must get the same ``causal``, ``scale`` and ``window``."""
    plan = _lse_plan(q, k, v, causal, scale, window, config, "attention_forward")
    o, lse2, _ = forward_on_tiles(q, k, v, plan.causal, plan.scale, plan.sw, plan.window, plan.layout)
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
    window: tuple[int | None, int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attention from its output ``o`` and natural-log ``lse`` (as
    :func:`attention_forward` returns them), by the backward ``config`` names (default Switches():
    bwd="auto"). Shapes and ``window`` as :func:`attention_forward`; do and o [B, S_q, H, D_v] (cast to
    q's dtype), lse [B, H, S_q]. Returns gradients in the inputs' dtypes and shapes."""
    plan = _lse_plan(q, k, v, causal, scale, window, config, "attention_backward")
    b, s_q, h, _ = q.shape
    d_v = v.shape[-1]
    for name, t, shape in (
        ("do", do, (b, s_q, h, d_v)),
        ("o", o, (b, s_q, h, d_v)),
        ("lse", lse, (b, h, s_q)),
    ):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"attention_backward: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}"
            )
    lse2 = (lse.float() / LN2).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do, o = do.to(q.dtype).contiguous(), o.to(q.dtype).contiguous()
    parts = _v_chunks(o, plan.layout)
    return backward_on_tiles(
        do, q, k, v, parts, lse2, plan.causal, plan.scale, plan.sw, plan.window, plan.layout
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
    the kernel rescaled O. Shapes as :func:`attention_any_d` at one of its tiles (no padding, no
    window). Returns ([B, S_q, H, D], fraction)."""
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
